"""The workbench as a person meets it, in Debian's chromium driven by Playwright (no browser download).

- The exported HTML: every notebook executed at CPU size once (:mod:`notebook_runs`, shared with the
  notebook tests); each report is opened from
  disk with the network cut off, and every plotly chart must have rendered with the number of traces
  its figure has in the executed notebook, without a page error, without a request that leaves the file
  and without a stderr box; a screenshot is written next to it. In every figure no two text boxes
  overlap or are clipped, and a provider has one colour in every report.
- The index: a card per report, with the dashboard of :mod:`kernels_workbench.dashboard` per GPU;
  every number it shows must equal the dashboard's, offline, and no sparkline label is clipped.
- JupyterLab: notebook 02 and its sweep panel are driven in ``./workbench lab`` by ``test_lab.py``.

Chromium is required: where it is missing these tests fail (``.ci/run`` installs it with apt-get).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

import notebook_runs  # the notebooks' executions, shared with their own tests
from lab_server import CHROMIUM_ARGS, chromium_path
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


@pytest.fixture(scope="module")
def rendered(browser, reports):
    """Every report opened once from disk with the network cut off, as a reader opens it: per report its
    expected traces, and what the page showed (traces per chart, formulas laid out, page errors, requests,
    stderr boxes, and :data:`FIGURES_JS` per figure); a full-page screenshot is written next to it."""
    out, pages = reports
    seen = {}
    for html in (p for p in pages if p.name != "index.html"):
        executed = out / "executed" / html.with_suffix(".ipynb").name
        expected = _expected_traces(executed)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors, requests = [], []
        page.on("pageerror", lambda error, errors=errors: errors.append(str(error)))
        # every request the report makes is recorded; none may leave the file (and the network is cut off anyway)
        page.on("request", lambda request, requests=requests: requests.append(request.url))
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:") else route.abort())
        try:
            page.goto(html.as_uri(), wait_until="load")
            page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {max(len(expected), 1)}",
                                   timeout=60_000)
            page.wait_for_timeout(1000)  # the figures' text settles after the first draw
            seen[html] = {
                "expected": expected, "formulas expected": _expected_formulas(executed),
                "traces": page.eval_on_selector_all(".js-plotly-plot", "plots => plots.map(p => p.data.length)"),
                "formulas": page.eval_on_selector_all("math", "ms => ms.filter(m => m.getBoundingClientRect().width > 0).length"),
                "stderr boxes": page.locator('[data-mime-type="application/vnd.jupyter.stderr"]').count(),
                "figures": page.evaluate(FIGURES_JS), "errors": errors, "requests": requests}
            page.screenshot(path=str(html.with_suffix(".png")), full_page=True)
        except Exception as error:  # noqa: BLE001 (a page that does not render fails both tests, naming itself)
            seen[html] = {"failure": f"{type(error).__name__}: {error}"}
        finally:
            page.close()
    return seen


def _opened(html: Path, seen: dict) -> dict:
    assert "failure" not in seen, f"{html.name} did not render: {seen['failure'][:1500]}"
    return seen


def test_every_report_renders_its_charts_offline(rendered):
    for html, seen in rendered.items():
        expected = _opened(html, seen)["expected"]
        assert expected, f"{html.name}: no figure in the executed notebook"
        assert seen["traces"] == expected, f"{html.name}: traces per chart {seen['traces']}, figures have {expected}"
        assert seen["errors"] == [], f"{html.name}: page errors {seen['errors']}"
        # every formula of the notebook's markdown laid out as MathML by the browser itself, offline
        assert seen["formulas"] == seen["formulas expected"], f"{html.name}: {seen['formulas']} formulas drawn"
        elsewhere = [url for url in seen["requests"] if url != html.as_uri() and not url.startswith(("data:", "blob:"))]
        assert elsewhere == [], f"{html.name}: asked for {elsewhere}"
        assert seen["stderr boxes"] == 0, f"{html.name}: {seen['stderr boxes']} stderr outputs in the report"
        assert html.with_suffix(".png").stat().st_size > 10_000


def test_every_figure_has_legible_text_and_one_colour_per_provider(rendered):
    """Across every report's plotly figures: no two SVG text boxes overlap and none is clipped by its figure;
    a provider (by base name: ``kernels_lib[chunk_size=256]`` is kernels_lib) and a variant of its own
    (``kernels_lib[accurate=True]``, :data:`~kernels_workbench.charts.VARIANT_COLORS`) is drawn in one colour,
    the one :func:`kernels_workbench.charts.provider_color` gives it; kernels_lib's lines come after every peer's
    (drawn on top)."""
    colours: dict[str, set] = {}
    problems = []
    for html, seen in rendered.items():
        for figure in _opened(html, seen)["figures"]:
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
