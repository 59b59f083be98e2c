"""The workbench as a person meets it, in Debian's chromium driven by Playwright (no browser download).

- The exported HTML: every notebook executed at CPU size once (:mod:`notebook_runs`, shared with the
  notebook tests); each report is opened from
  disk with the network cut off, and every plotly chart must have rendered with the number of traces
  its figure has in the executed notebook, without a page error, without a request that leaves the file
  and without a stderr box; a screenshot is written next to it. In every figure no two text boxes
  overlap or are clipped, and a provider has one colour in every report.
- The index: a card per report, with the dashboard of :mod:`kernels_workbench.dashboard` per GPU;
  every number it shows must equal the dashboard's, offline, and no sparkline label is clipped.
- JupyterLab: a server on loopback with a token runs notebook 02 with ``interactive=True``; the sweep
  panel appears and must say what it measured and what it could not (what will appear before a sweep,
  the loss, sizes and dtype in its title, on a CPU the interpreter's note, a peer that cannot run
  unticked and named with its reason, "running 0/N" as a sweep starts, the table's people's names, a
  colour per provider, a size above its cap capped with a message); the swept axis is changed, a second
  sweep runs, and the chart and the table must have changed. The server is stopped whatever happens.

Chromium is required: where it is missing these tests fail (``.ci/run`` installs it with apt-get).
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch

import notebook_runs  # the notebooks' executions, shared with their own tests
from lab_server import CHROMIUM_ARGS, chromium_path, jupyter_lab
from kernels_workbench import charts, dashboard, report
from kernels_workbench.mathml import markdown_math_to_mathml

# The first test that asks for ``reports`` runs every notebook at CPU size inside its own time (about
# 10 minutes on an idle 2-core machine, data/report_times.csv): past the suite's 900 s per test on a
# loaded one, hence 40 minutes here.
pytestmark = [pytest.mark.browser, pytest.mark.timeout(2400), notebook_runs.GROUP]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"



@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def reports():
    """Every notebook executed once at CPU size, as the runner does (:mod:`notebook_runs`: the same
    executions the notebook tests read), and the runner's index over them: (out folder, HTML reports)."""
    runs = notebook_runs.all_reports()
    failed = [failure for _, _, failure in runs if failure]
    assert not failed, failed
    out = notebook_runs.out_dir()
    report.write_index(out, sorted(runs, key=lambda run: run[0].name), report.notebook_parameters("cpu"))
    return out, sorted(out.glob("*.html"))


def _expected_traces(executed: Path) -> list[int]:
    """The number of traces of each plotly figure of an executed notebook, in output order."""
    notebook = nbformat.read(executed, as_version=4)
    return [
        len(output["data"]["application/vnd.plotly.v1+json"]["data"])
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if "application/vnd.plotly.v1+json" in output.get("data", {})
    ]


def _expected_formulas(executed: Path) -> int:
    """The formulas of an executed notebook's markdown cells and markdown outputs."""
    notebook = nbformat.read(executed, as_version=4)
    texts = [c.source for c in notebook.cells if c.cell_type == "markdown"] + [
        o["data"]["text/markdown"] for c in notebook.cells for o in c.get("outputs", []) if "text/markdown" in o.get("data", {})
    ]
    return sum(markdown_math_to_mathml(text)[1] for text in texts)


def test_index_links_every_report(browser, reports):
    out, pages = reports
    page = browser.new_page()
    try:
        page.goto((out / "index.html").as_uri())
        links = page.eval_on_selector_all("li a", "links => links.map(a => a.getAttribute('href'))")
        assert sorted(links) == sorted(p.name for p in pages if p.name != "index.html")
        assert sorted(links) == sorted(nb.with_suffix(".html").name for nb in NOTEBOOKS.glob("*.ipynb"))
        assert page.locator("li small").count() == len(links)
    finally:
        page.close()


def test_index_dashboard_shows_the_measured_numbers_offline(browser, reports):
    """The index's cards in the browser, network cut off: a card per report, a section with a sparkline
    per measured chart and GPU, no target badge, and every number shown (ratios, x) equal to :func:`kernels_workbench.dashboard.dashboard`'s, to two decimals."""
    out, _ = reports
    board = dashboard.dashboard()
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:") else route.abort())
    try:
        page.goto((out / "index.html").as_uri())
        cards = page.locator("li.card").count()
        sections = page.eval_on_selector_all("section.chart", "s => s.map(e => [e.dataset.chart, e.querySelectorAll('svg polyline').length])")
        badges = page.eval_on_selector_all(".badge", "bs => bs.map(b => [b.dataset.key, b.dataset.status, b.getBoundingClientRect().width])")
        numbers = page.eval_on_selector_all(".num", "ns => ns.map(n => [n.dataset.key, n.dataset.col, n.innerText])")
        font = page.evaluate("getComputedStyle(document.body).fontFamily")
        # Every label of every sparkline inside its picture: none clipped at an edge (a "1e+03 ms" once was).
        clipped = page.eval_on_selector_all(
            "figure.spark svg", "svgs => svgs.flatMap(svg => [...svg.querySelectorAll('text')].map(t => { const b = t.getBBox();"
            " return [t.textContent, b.x, b.x + b.width, svg.viewBox.baseVal.width]; }).filter(([_, l, r, w]) => l < 0 || r > w))")
    finally:
        page.close()
    assert errors == []
    assert clipped == [], f"sparkline labels outside their picture (text, left, right, width): {clipped[:5]}"
    assert cards == len(list(NOTEBOOKS.glob("*.ipynb")))
    assert len(sections) == board.chart.nunique() and all(lines >= 2 for _, lines in sections)
    assert badges == []  # comparisons, not targets of ours
    rows = board.set_index("key")
    assert len(numbers) >= 2 * (board.kind == "ratio").sum()
    for key, column, text in numbers:
        value = rows.loc[key, column]
        if column in ("time ratio", "memory ratio"):
            assert text == dashboard.ratio_text(value), (key, column, text, value)
        else:
            assert text == (value if isinstance(value, str) else f"{value:g}"), (key, column, text, value)
    assert "system-ui" in font


def test_every_report_renders_its_charts_offline(browser, reports):
    out, pages = reports
    for html in (p for p in pages if p.name != "index.html"):
        expected = _expected_traces(out / "executed" / html.with_suffix(".ipynb").name)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors, requests = [], []
        page.on("pageerror", lambda error: errors.append(str(error)))
        # every request the report makes is recorded; none may leave the file (and the network is cut off anyway)
        page.on("request", lambda request: requests.append(request.url))
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:") else route.abort())
        try:
            page.goto(html.as_uri(), wait_until="load")
            page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {len(expected)}", timeout=60_000)
            traces = page.eval_on_selector_all(".js-plotly-plot", "plots => plots.map(p => p.data.length)")
            formulas = page.eval_on_selector_all("math", "ms => ms.filter(m => m.getBoundingClientRect().width > 0).length")
            stderr_boxes = page.locator('[data-mime-type="application/vnd.jupyter.stderr"]').count()
            page.screenshot(path=str(html.with_suffix(".png")), full_page=True)
        finally:
            page.close()
        assert expected, f"{html.name}: no figure in the executed notebook"
        assert traces == expected, f"{html.name}: traces per chart {traces}, figures have {expected}"
        assert errors == [], f"{html.name}: page errors {errors}"
        # every formula of the notebook's markdown laid out as MathML by the browser itself, offline
        assert formulas == _expected_formulas(out / "executed" / html.with_suffix(".ipynb").name), f"{html.name}: {formulas} formulas drawn"
        elsewhere = [url for url in requests if url != html.as_uri() and not url.startswith(("data:", "blob:"))]
        assert elsewhere == [], f"{html.name}: asked for {elsewhere}"
        assert stderr_boxes == 0, f"{html.name}: {stderr_boxes} stderr outputs in the report"
        assert html.with_suffix(".png").stat().st_size > 10_000


#: Per plotly figure of a page: its box, the boxes of its SVG text (tick labels, titles, legend, annotations),
#: and per trace its name, its fill and the colour it is drawn in (plotly's full data: defaults resolved).
FIGURES_JS = """
() => Array.from(document.querySelectorAll('.js-plotly-plot')).map((plot, index) => {
  const box = plot.getBoundingClientRect();
  const texts = Array.from(plot.querySelectorAll('svg text')).map(t => {
    const r = t.getBoundingClientRect();
    return {text: t.textContent, x0: r.left, y0: r.top, x1: r.right, y1: r.bottom};
  }).filter(t => t.text.trim() && t.x1 > t.x0 && t.y1 > t.y0);
  const traces = (plot._fullData || []).filter(t => t.visible !== false).map(t => ({name: t.name || '', fill: t.fill || '',
    color: (t.marker && typeof t.marker.color === 'string' ? t.marker.color : null) || (t.line && t.line.color) || null}));
  return {index, title: (plot.layout.title && plot.layout.title.text) || '', box: {x0: box.left, y0: box.top, x1: box.right, y1: box.bottom},
          texts, traces};
})
"""


def _overlap(a: dict, b: dict, tolerance: float = 1.0) -> bool:
    """Whether two boxes share more than ``tolerance`` pixels in both directions."""
    return (min(a["x1"], b["x1"]) - max(a["x0"], b["x0"]) > tolerance
            and min(a["y1"], b["y1"]) - max(a["y0"], b["y0"]) > tolerance)


def test_every_figure_has_legible_text_and_one_colour_per_provider(browser, reports):
    """Across every report's plotly figures: no two SVG text boxes overlap and none is clipped by its figure;
    a provider (by base name: ``kernels_lib[chunk_size=256]`` is kernels_lib) and a variant of its own
    (``kernels_lib[accurate=True]``, :data:`~kernels_workbench.charts.VARIANT_COLORS`) is drawn in one colour,
    the one :func:`kernels_workbench.charts.provider_color` gives it; kernels_lib's lines come after every peer's
    (drawn on top)."""
    out, pages = reports
    colours: dict[str, set] = {}
    problems = []
    for html in (p for p in pages if p.name != "index.html"):
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:") else route.abort())
        try:
            page.goto(html.as_uri(), wait_until="load")
            page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length > 0", timeout=60_000)
            page.wait_for_timeout(1000)
            figures = page.evaluate(FIGURES_JS)
        finally:
            page.close()
        for figure in figures:
            where = f"{html.stem} figure {figure['index']} ({figure['title'][:50]!r})"
            texts, box = figure["texts"], figure["box"]
            overlapping = [(a["text"], b["text"]) for i, a in enumerate(texts) for b in texts[i + 1:] if _overlap(a, b)]
            clipped = [t["text"] for t in texts if t["x0"] < box["x0"] - 1 or t["x1"] > box["x1"] + 1
                       or t["y0"] < box["y0"] - 1 or t["y1"] > box["y1"] + 1]
            if overlapping or clipped:
                problems.append(f"{where}: overlapping {overlapping[:5]}, clipped {clipped[:5]}")
            lines = [t for t in figure["traces"] if t["fill"] != "toself" and t["name"]]
            for trace in lines:  # a provider by its palette key; any other trace (a bar's component, a floor) by its name
                base = charts.palette_key(trace["name"])
                named = base in charts.COLORS or base in charts.VARIANT_COLORS or "[" in trace["name"] or " · " in trace["name"]
                colours.setdefault(base if named else trace["name"], set()).add(trace["color"])
            providers = [charts.base_provider(t["name"]) for t in lines if charts.base_provider(t["name"]) in charts.COLORS]
            if "kernels_lib" in providers and providers[providers.index("kernels_lib"):].count("kernels_lib") != len(providers) - providers.index("kernels_lib"):
                problems.append(f"{where}: a peer drawn over kernels_lib: {providers}")
    assert problems == [], "\n".join(problems)
    several = {name: sorted(map(str, found)) for name, found in colours.items() if len(found) > 1}
    assert several == {}, f"providers drawn in more than one colour: {several}"
    wrong = {name: found for name, found in colours.items()
             if (name in charts.COLORS or name in charts.VARIANT_COLORS) and found != {charts.provider_color(name)}}
    assert wrong == {}, f"providers not in their palette colour: {wrong}"
    assert colours.get("kernels_lib") == {charts.COLORS["kernels_lib"]}


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on loopback over a copy of the notebooks: (base URL, token). Stopped at the end."""
    root = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, root)
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}", "--allow-root"]
    with jupyter_lab(command, tmp_path, "jupyter lab") as (base, token, _):
        yield base, token


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


def test_jupyterlab_runs_the_kl_notebook_and_the_sweep_panel_says_what_it_measured(browser, lab, tmp_path):
    """Notebook 02's panel driven as a newcomer would: before a sweep its chart says what will appear; its
    title names the loss, the fixed size and the dtype (and on a CPU that the times rank nothing); a peer
    that cannot run here is not ticked, and ticked anyway is named in the status with its reason; the status
    says "running 0/N" as the sweep starts; the table speaks as people do; each provider has its colour;
    a subplot with nothing measured says why; the swept axis changes and a second sweep runs that range; a
    size typed above its cap is set to the cap with a message saying so."""
    from kernels_workbench import widgets

    cpu = not torch.cuda.is_available()  # the notebook's device is the default one: a CPU here means the interpreter
    base, token = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    try:
        page.goto(f"{base}/lab/tree/02_kl_divergence.ipynb?token={token}", wait_until="domcontentloaded")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        # Run All before the kernel is connected runs nothing: wait for the status bar's "Idle"
        page.get_by_text(re.compile(r"Python 3 \(ipykernel\) \| Idle")).wait_for(timeout=90_000)
        page.locator(".lm-MenuBar-itemLabel:text-is('Run')").click()
        page.locator(".lm-Menu-itemLabel:text-is('Run All Cells')").click()
        page.wait_for_selector(f"{PANEL} button:has-text('Run sweep')", timeout=180_000)
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
        page.screenshot(path=str(tmp_path / "jupyterlab.png"))
    finally:
        page.close()
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
    assert errors == [], f"page errors: {errors}"
