"""A bad input that the kernels catch on the device (a device-side assert on CUDA, an immediate
RuntimeError in Triton's interpreter), checked without poisoning the suite.

On CUDA a device-side assert ends the process's CUDA context: every later test in that process would
fail with ``AcceleratorError``. So there the call runs in a fresh Python process, and the test asserts
that the process failed with a device-side assert; on a CPU it runs here, under ``pytest.raises``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
#: What every checked snippet may use: torch, kernels_lib and its device.
PRELUDE = "import torch\nimport kernels_lib\nDEVICE = kernels_lib.default_device()\n"


def assert_device_error(code: str, match: str, setup: str = "") -> None:
    """``setup`` then ``code`` (Python source; ``DEVICE`` and ``torch`` are defined) must fail: on a CPU
    with a RuntimeError matching ``match``; on CUDA with a device-side assert, in a subprocess."""
    code, setup = textwrap.dedent(code), textwrap.dedent(setup)
    if not torch.cuda.is_available():
        namespace = {}
        exec(PRELUDE + setup, namespace)
        with pytest.raises(RuntimeError, match=match):
            exec(code, namespace)
        return
    program = PRELUDE + setup + "\n" + code + "\ntorch.cuda.synchronize()\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, f"no error from:\n{code}\n{output[-2000:]}"
    assert "device-side assert" in output, f"not a device-side assert:\n{output[-3000:]}"
