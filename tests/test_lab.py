"""``./workbench lab`` as people use it: running a notebook in JupyterLab leaves the tracked notebook unchanged.

- The launcher's Jupyter server configuration (``lab/jupyter_server_config.py``) strips a notebook before the
  server saves it. For every committed notebook, a model as JupyterLab sends it after a run (outputs,
  execution counts, the kernel's full ``language_info``, widget state, timing metadata) saved through
  Jupyter's own contents manager with that configuration must give the committed bytes back.
- In chromium through Playwright (marker ``browser``): ``./workbench lab`` itself is started on a free port
  with a token (as root when root), notebook 02 is opened, every cell is run and the notebook is saved
  with Ctrl+S; the cells must have run (numbered prompts, outputs in the page) and the tracked file's
  bytes must be what they were. The server is stopped, and what it left in ``notebooks/`` removed, whatever
  happens.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from lab_server import CHROMIUM_ARGS, chromium_path, jupyter_lab

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "lab" / "jupyter_server_config.py"
NOTEBOOKS = ROOT / "notebooks"
LAB_NOTEBOOK = "02_kl_divergence.ipynb"  # the quickest to run on a CPU (about a minute in the interpreter)


def _committed_notebooks() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "notebooks/*.ipynb"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.split()
        return [ROOT / name for name in listed if (ROOT / name).exists()]
    except (OSError, subprocess.CalledProcessError):  # a copy without .git
        return sorted(NOTEBOOKS.glob("*.ipynb"))


def _config():
    from traitlets.config.loader import PyFileConfigLoader

    return PyFileConfigLoader(CONFIG.name, path=str(CONFIG.parent)).load_config()


def _as_jupyterlab_saves_it_after_a_run(notebook: dict) -> dict:
    """A committed notebook as JupyterLab's save sends it once every cell has run: sources as one string,
    outputs and counts, the kernel's ``language_info``, the widgets' state, timing and scroll metadata."""
    model = copy.deepcopy(notebook)
    model["metadata"]["language_info"] = {
        "codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py", "mimetype": "text/x-python",
        "name": "python", "nbconvert_exporter": "python", "pygments_lexer": "ipython3", "version": "3.11.7"}
    model["metadata"]["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2,
                                                                                 "version_minor": 0}}
    for count, cell in enumerate(model["cells"], 1):
        cell["source"] = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] != "code":
            continue
        cell["execution_count"] = count
        cell["outputs"] = [
            {"output_type": "stream", "name": "stdout", "text": "measured\n"},
            {"output_type": "display_data", "metadata": {},
             "data": {"text/plain": "Panel()", "application/vnd.jupyter.widget-view+json":
                      {"model_id": "0" * 32, "version_major": 2, "version_minor": 0}}},
        ]
        cell["metadata"]["execution"] = {"iopub.execute_input": "2000-01-01T00:00:00.000Z",
                                         "shell.execute_reply": "2000-01-01T00:00:01.000Z"}
        cell["metadata"]["scrolled"] = True
        cell["metadata"]["jupyter"] = {"outputs_hidden": True}
    return model


@pytest.mark.parametrize("path", _committed_notebooks(), ids=lambda path: path.name)
def test_saving_a_run_notebook_writes_the_committed_bytes(path, tmp_path):
    """The configuration as Jupyter loads it, saved through Jupyter's contents manager: the committed bytes."""
    from jupyter_server.services.contents.filemanager import FileContentsManager

    committed = path.read_bytes()
    canonical = nbformat.writes(nbformat.reads(committed.decode("utf-8"), as_version=nbformat.NO_CONVERT)) + "\n"
    assert committed.decode("utf-8") == canonical, (
        f"{path.name} is not written as nbformat writes it (sorted keys, one-space indent, every cell with its "
        "metadata), as Jupyter will: any save in the lab would change it. Rewrite it with nbformat: "
        f"python -c \"import nbformat as n; p='notebooks/{path.name}'; n.write(n.read(p, n.NO_CONVERT), p)\"")
    manager = FileContentsManager(root_dir=str(tmp_path), config=_config())
    dirty = _as_jupyterlab_saves_it_after_a_run(json.loads(committed))
    assert dirty != json.loads(committed)
    manager.save({"type": "notebook", "format": "json", "content": dirty}, path.name)
    assert (tmp_path / path.name).read_bytes() == committed


def test_strip_keeps_what_a_person_wrote(tmp_path, monkeypatch):
    """Sources, tags, a hidden input and the kernelspec stay; KERNELS_LIB_KEEP_OUTPUTS=1 keeps the outputs."""
    namespace = {"get_config": _config}
    exec(compile(CONFIG.read_text(), str(CONFIG), "exec"), namespace)  # as Jupyter's loader runs it
    notebook = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}, "widgets": {}})
    cell = nbformat.v4.new_code_cell("x = 1", execution_count=4, outputs=[nbformat.v4.new_output("stream", text="1")],
                                     metadata={"tags": ["parameters"], "jupyter": {"source_hidden": True}})
    notebook.cells.append(cell)
    kept = copy.deepcopy(notebook)
    monkeypatch.setenv("KERNELS_LIB_KEEP_OUTPUTS", "1")
    namespace["strip_before_save"]({"type": "notebook", "content": kept}, path="a.ipynb")
    assert kept == notebook
    monkeypatch.delenv("KERNELS_LIB_KEEP_OUTPUTS")
    stripped = namespace["strip_notebook"](copy.deepcopy(notebook))
    assert stripped["cells"][0]["outputs"] == [] and stripped["cells"][0]["execution_count"] is None
    assert stripped["cells"][0]["source"] == "x = 1"
    assert stripped["cells"][0]["metadata"] == {"tags": ["parameters"], "jupyter": {"source_hidden": True}}
    assert stripped["metadata"] == {"kernelspec": {"name": "python3", "display_name": "Python 3"}}


# --------------------------------------------------------------------------- in the browser


def _environment_is_prepared() -> bool:
    """Whether ``./workbench`` would use .venv as it is (its stamp matches the pyprojects) rather than install."""
    stamp = ROOT / ".venv" / ".kernels_lib-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "lab" / "pyproject.toml").read_bytes())
    return stamp.exists() and stamp.read_text().strip() == want.hexdigest()[:16]


@pytest.fixture
def workbench_lab():
    """``./workbench lab`` on a free loopback port with a token: (base URL, token, log). Its runtime files,
    settings and workspaces go to a temporary folder; it is stopped with its kernels at the end, and the
    checkpoints folder it makes in notebooks/ is removed when it was not there before."""
    if not _environment_is_prepared():
        pytest.skip("the workbench's environment is not prepared for these pyprojects (./workbench env), "
                    "and ./workbench lab would install it")
    temp = Path(tempfile.mkdtemp(prefix="kernels_lib_lab_"))
    checkpoints = NOTEBOOKS / ".ipynb_checkpoints"
    had_checkpoints = checkpoints.exists()
    try:
        with jupyter_lab([str(ROOT / "workbench"), "lab"], temp, "./workbench lab", cwd=ROOT) as server:
            yield server
    finally:
        if not had_checkpoints:
            shutil.rmtree(checkpoints, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)


#: Per code cell of the open notebook, its prompt: "[3]:" once run, "[*]:" while queued or running.
PROMPTS_JS = """() => Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt'))
                       .map(prompt => prompt.textContent.trim())"""

#: The text of every stderr or error output in the page (textContent: off-screen cells are not laid out).
ERRORS_JS = """() => Array.from(document.querySelectorAll(
  ".jp-Notebook .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"))
  .map(output => output.textContent.trim().slice(-1500))"""


def _run_all_and_wait(page, code_cells: int, timeout: float = 150) -> list[str]:
    """Run every cell from the Run menu and wait until every code cell has a number; fail when the run stops
    short (a cell raised: the rest are no longer queued)."""
    page.locator(".lm-MenuBar-itemLabel:text-is('Run')").click()
    page.locator(".lm-Menu-itemLabel:text-is('Run All Cells')").click()
    deadline, stopped_since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        page.wait_for_timeout(1000)
        prompts = page.evaluate(PROMPTS_JS)
        numbered = [p for p in prompts if re.fullmatch(r"\[\d+\]:", p)]
        if len(prompts) == code_cells and len(numbered) == code_cells:
            return prompts
        if any(p == "[*]:" for p in prompts):
            stopped_since = None
        elif stopped_since is None:
            stopped_since = time.monotonic()
        elif time.monotonic() - stopped_since > 10:
            errors = page.evaluate(ERRORS_JS)
            raise AssertionError(f"the run stopped short: prompts {prompts}; errors: {errors[-2:]}")
    raise AssertionError(f"the cells did not all run within {timeout} s: {page.evaluate(PROMPTS_JS)}")


@pytest.mark.browser
@pytest.mark.timeout(420)
def test_running_a_notebook_in_the_lab_leaves_the_tracked_notebook_unchanged(workbench_lab, tmp_path):
    """Notebook 02 run from Run All in ``./workbench lab`` and saved with Ctrl+S: every cell ran (numbered prompts,
    outputs and the sweep panel in the page) and the tracked file's bytes are the committed ones."""
    from playwright.sync_api import sync_playwright

    base, token, log = workbench_lab
    path = NOTEBOOKS / LAB_NOTEBOOK
    before = path.read_bytes()
    code_cells = sum(cell["cell_type"] == "code" for cell in json.loads(before)["cells"])
    saved_at = path.stat().st_mtime_ns
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            try:
                page = chromium.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{base}/lab/tree/{LAB_NOTEBOOK}?token={token}", wait_until="domcontentloaded")
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
                # Run All before the kernel is connected runs nothing: wait for the status bar's "Idle"
                page.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).wait_for(timeout=90_000)
                prompts = _run_all_and_wait(page, code_cells)
                outputs = page.locator(".jp-Notebook .jp-OutputArea-output").count()
                panels = page.locator(".jp-Notebook button:has-text('Run sweep')").count()
                page.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).wait_for(timeout=60_000)
                # a click on a prompt gives the notebook the focus (and presses no widget): Ctrl+S saves it
                page.locator(".jp-Notebook .jp-Cell .jp-InputPrompt").first.click()
                page.keyboard.press("Control+s")
                deadline = time.monotonic() + 30
                while path.stat().st_mtime_ns == saved_at and time.monotonic() < deadline:
                    time.sleep(0.2)
                saved = path.stat().st_mtime_ns != saved_at
                deadline = time.monotonic() + 15  # the file is written before the page hears back
                while (dirty := page.locator(".jp-mod-dirty").count()) and time.monotonic() < deadline:
                    page.wait_for_timeout(200)
                page.screenshot(path=str(tmp_path / "lab.png"))
            finally:
                chromium.close()
        after = path.read_bytes()
    finally:
        if path.read_bytes() != before:  # never leave a run's outputs in the tracked notebook
            path.write_bytes(before)
    assert prompts == [f"[{n}]:" for n in range(1, code_cells + 1)], prompts
    assert outputs >= code_cells // 2, f"only {outputs} outputs in the page after running {code_cells} cells"
    assert panels == 1, "the sweep panel (ipywidgets) did not appear"
    assert saved, f"Ctrl+S did not save {path.name}:\n{log.read_text()[-2000:]}"
    assert after == before, "saving the run notebook changed the tracked file"
    assert dirty == 0, "the notebook is still marked unsaved"
    assert "Pre-save hook failed" not in log.read_text(), log.read_text()[-3000:]
