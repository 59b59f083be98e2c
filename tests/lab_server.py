"""A JupyterLab server for the browser tests, and Debian's chromium to drive it (``test_lab.py`` starts
``./workbench lab`` itself; ``test_browser.py`` opens the exported reports with the same chromium)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
#: JupyterLab's options that keep a test server quiet: no news, no update check, no extension manager.
QUIET = ["--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly"]


def chromium_path() -> str:
    """Debian's chromium, or the calling test fails saying how to install it."""
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        pytest.fail("Debian's chromium is required for the browser tests and was not found: "
                    "apt-get install chromium (.ci/run does it)", pytrace=False)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_server(url: str, process: subprocess.Popen, log: Path, what: str, timeout: float = 90) -> None:
    """Return once ``url`` answers 200; raise with the server's log when it exits or does not answer in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{what} did not answer {url} within {timeout} s:\n{log.read_text()[-3000:]}")


@contextmanager
def jupyter_lab(command: list[str], folder: Path, what: str, cwd: Path | None = None):
    """Start ``command + [port, token options]`` with its runtime files, settings and workspaces in ``folder``;
    yield ``(base URL, token, log path)`` once it answers; stop it and the kernels it started whatever happens."""
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(folder / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(folder / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(folder / "workspaces")}
    env.pop("KERNELS_LIB_KEEP_OUTPUTS", None)
    log_path = folder / "lab.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([*command, "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                                    f"--IdentityProvider.token={token}", *QUIET],
                                   cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for_server(f"{base}/api/status?token={token}", process, log_path, what)
            yield base, token, log_path
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)  # the server and the kernels it started
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
