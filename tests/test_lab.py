"""``./workbench lab`` as people use it: a notebook and its sweep panel run in JupyterLab, and saving leaves the
tracked notebook unchanged.

- The launcher's Jupyter server configuration (``lab/jupyter_server_config.py``) strips a notebook before the
  server saves it. For every committed notebook, a model as JupyterLab sends it after a run (outputs,
  execution counts, the kernel's full ``language_info``, widget state, timing metadata) saved through
  Jupyter's own contents manager with that configuration must give the committed bytes back.
- In chromium through Playwright (marker ``browser``): ``./workbench lab`` itself is started on a free port
  with a token (as root when root), notebook 02 is opened and every cell is run; its sweep panel is driven as
  a newcomer would and must say what it measured and what it could not (what will appear before a sweep, the
  loss, sizes and dtype in its title, on a CPU the interpreter's note, a peer that cannot run unticked and
  named with its reason, "running 0/N" as a sweep starts, the table's people's names, a colour per provider,
  a size above its cap capped with a message; the swept axis changed, a second sweep runs that range); then
  the notebook is saved with Ctrl+S and the tracked file's bytes must be what they were. The server is
  stopped, and what it left in ``notebooks/`` removed, whatever happens.
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


PANEL = ".widget-vbox:has(> .widget-hbox button:has-text('Run sweep'))"
STATUS = f"{PANEL} > .widget-hbox:has(button:has-text('Run sweep')) .widget-html"
#: What the panel's chart shows in the browser: its title, its annotations (subplot titles and notes) and per
#: line its name and the colour plotly drew it in.
PANEL_CHART_JS = """
plot => ({title: (plot.layout && plot.layout.title && plot.layout.title.text) || '',
          notes: ((plot.layout && plot.layout.annotations) || []).map(a => a.text.replace(/<br>/g, ' ')),
          lines: (plot._fullData || []).filter(t => t.fill !== 'toself' && t.name && !['key', 'gap', 'note'].includes(t.meta && t.meta.kind))
                                       .map(t => [t.name, t.line && t.line.color])})
"""
#: Records every text the status shows, from now on, in ``window.statusHistory``.
WATCH_STATUS_JS = """
element => { window.statusHistory = [];
  new MutationObserver(() => window.statusHistory.push(element.textContent.trim()))
    .observe(element, {childList: true, subtree: true, characterData: true}); }
"""


def _panel_state(page) -> tuple[list, str]:
    """The x values of every trace of the panel's chart and the text of its table (none yet while a new
    chart widget is being drawn: plotly has not set its data)."""
    xs = page.eval_on_selector(f"{PANEL} .js-plotly-plot",
                               "plot => (plot.data || []).map(trace => Array.from(trace.x || []).filter(x => x !== null))")
    table = page.locator(f"{PANEL} table")
    return xs, table.inner_text() if table.count() else ""


def _run_sweep(page, previous: tuple[list, str], timeout: float = 240) -> tuple[list, str]:
    """Click Run sweep and wait until the chart has points, the chart and the table have changed and the button
    is back (the chart is a new widget after each sweep: the table may show first)."""
    button = page.locator(f"{PANEL} button:has-text('Run sweep')")
    button.click()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        page.wait_for_timeout(500)
        state = _panel_state(page)
        if any(state[0]) and state[0] != previous[0] and state[1] and state[1] != previous[1] and button.is_enabled():
            return state
    raise AssertionError(f"the sweep did not update the panel within {timeout} s")


def _panel_chart(page) -> dict:
    return page.eval_on_selector(f"{PANEL} .js-plotly-plot", PANEL_CHART_JS)


def _drive_sweep_panel(page, cpu: bool) -> dict:
    """Notebook 02's panel, once every cell has run, driven as a newcomer would: what the page showed at each
    step (the test asserts on it)."""
    page.wait_for_selector(f"{PANEL} .js-plotly-plot .main-svg", timeout=60_000)
    # the svg is drawn before the widget's layout (title, notes) reaches it: wait for its notes, then read
    plot = page.locator(f"{PANEL} .js-plotly-plot").element_handle()
    page.wait_for_function("plot => ((plot.layout || {}).annotations || []).length > 0", arg=plot, timeout=30_000)
    before = _panel_chart(page)
    liger = page.locator(f"{PANEL} .widget-checkbox:has-text('liger') input")
    liger_label = page.locator(f"{PANEL} .widget-checkbox:has-text('liger')").text_content()
    liger_ticked = liger.is_checked()
    limits = page.locator(f"{PANEL} .widget-html:has-text('Sizes up to')").text_content()
    if cpu:
        liger.check()  # asked for anyway: the status must name it with its reason
    page.eval_on_selector(STATUS, WATCH_STATUS_JS)
    first = _run_sweep(page, _panel_state(page))
    history = page.evaluate("window.statusHistory")
    status = page.locator(STATUS).text_content().strip()
    after = _panel_chart(page)
    page.locator(f"{PANEL} .widget-dropdown:has(label:text-is('sweep')) select").select_option("N")
    second = _run_sweep(page, first)
    # V is a fixed size now: typed far above its cap, it is set to the cap and the panel says so
    v_box = page.locator(f"{PANEL} .widget-text:has(label:text-is('V')) input")
    v_box.fill("99999")
    v_box.press("Enter")
    page.get_by_text(re.compile(r"V = 99999 is above this panel's cap")).wait_for(timeout=30_000)
    capped_to = v_box.input_value()
    return {"before": before, "liger_label": liger_label, "liger_ticked": liger_ticked, "limits": limits, "history": history,
            "status": status, "after": after, "first": first, "second": second, "capped_to": capped_to}


def _check_sweep_panel(seen: dict, cpu: bool) -> None:
    """What the panel must have shown: before a sweep, what will appear; its title names the loss, the fixed size
    and the dtype (and on a CPU that the times rank nothing); a peer that cannot run here is not ticked, and ticked
    anyway is named in the status with its reason; the status says "running 0/N" as the sweep starts; the table
    speaks as people do; each provider has its colour; a subplot with nothing measured says why; the swept axis
    changes and a second sweep runs that range; a size typed above its cap is set to the cap, saying so."""
    from kernels_workbench import charts, widgets

    before, after, first, second = seen["before"], seen["after"], seen["first"], seen["second"]
    limits, status, history, capped_to = seen["limits"], seen["status"], seen["history"], seen["capped_to"]
    liger_label, liger_ticked = seen["liger_label"], seen["liger_ticked"]
    # before the first sweep: what will appear, and on a CPU why memory stays empty
    assert any("after Run sweep" in note for note in before["notes"]), before["notes"]
    assert "KL divergence" in before["title"] and "N=16" in before["title"] and "float32" in before["title"], before["title"]
    assert "V ≤ 8192" in limits and "N ≤ 64" in limits, limits
    if cpu:
        assert widgets.INTERPRETER_NOTE in after["title"], after["title"]
        assert not liger_ticked and "cannot run here" in liger_label, liger_label
        assert any(note.startswith("not measured here") for note in after["notes"]), after["notes"]
        assert "not run here: liger (Liger's kernels need CUDA" in status, status
    # the status changed the moment the sweep started, before the first point was measured
    assert history and history[0].startswith("running 0/"), history[:3]
    assert status.startswith("done: "), status
    # the chart: the baseline under its one name, each provider in its colour of every chart
    colours = {name.split(" · ")[0]: colour for name, colour in after["lines"]}
    ours = charts.display_name("kernels_lib", "CPU" if cpu else None)  # on a CPU: "(Triton interpreter)"
    assert set(colours) == {ours, widgets.BASELINE_NAME}, after["lines"]
    assert all(colour == charts.provider_color(name) for name, colour in colours.items()), colours
    assert len(set(colours.values())) == len(colours)
    # the table speaks as people do
    for column in ("time (ms)", "mode", "provider", "vocabulary size V", widgets.BASELINE_NAME):
        assert column in first[1], f"{column!r} not in the table:\n{first[1]}"
    assert not any(raw in first[1] for raw in ("metric_name", "kernel_operation_mode", "x_value", "kernel_provider")), first[1]
    assert any(first[0]) and any(second[0]), "the chart has no points after a sweep"
    assert first[0] != second[0], f"the chart's x values did not change: {first[0]}"
    # the swept N values are the range the view shows (8–16 around the preset's N = 16), no more
    assert {x for trace in second[0] for x in trace} == {8, 16}, f"the sweep ran other points: {second[0]}"
    assert first[1] != second[1], "the table did not change"
    assert capped_to == "8192", f"V typed as 99999 shows {capped_to}"


@pytest.mark.browser
@pytest.mark.timeout(900)
def test_notebook_02_in_the_lab_runs_drives_its_sweep_panel_and_saves_the_committed_bytes(workbench_lab, tmp_path):
    """Notebook 02 in ``./workbench lab``, as a newcomer uses it: Run All (every cell numbered, outputs in the page, one
    sweep panel), its sweep panel driven (:func:`_check_sweep_panel` says what it must show), then Ctrl+S: the
    tracked file's bytes are the committed ones and the notebook is not left marked unsaved."""
    import torch
    from playwright.sync_api import sync_playwright

    cpu = not torch.cuda.is_available()  # the notebook's device is the default one: a CPU here means the interpreter
    base, token, log = workbench_lab
    path = NOTEBOOKS / LAB_NOTEBOOK
    before = path.read_bytes()
    code_cells = sum(cell["cell_type"] == "code" for cell in json.loads(before)["cells"])
    saved_at = path.stat().st_mtime_ns
    errors, panel = [], None
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            try:
                page = chromium.new_page(viewport={"width": 1400, "height": 1000})
                page.on("pageerror", lambda error: errors.append(str(error)))
                page.goto(f"{base}/lab/tree/{LAB_NOTEBOOK}?token={token}", wait_until="domcontentloaded")
                page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
                # Run All before the kernel is connected runs nothing: wait for the status bar's "Idle"
                page.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).wait_for(timeout=90_000)
                prompts = _run_all_and_wait(page, code_cells)
                outputs = page.locator(".jp-Notebook .jp-OutputArea-output").count()
                panels = page.locator(".jp-Notebook button:has-text('Run sweep')").count()
                if panels == 1:
                    panel = _drive_sweep_panel(page, cpu)
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
    _check_sweep_panel(panel, cpu)
    assert errors == [], f"page errors: {errors}"
    assert saved, f"Ctrl+S did not save {path.name}:\n{log.read_text()[-2000:]}"
    assert after == before, "saving the run notebook changed the tracked file"
    assert dirty == 0, "the notebook is still marked unsaved"
    assert "Pre-save hook failed" not in log.read_text(), log.read_text()[-3000:]
