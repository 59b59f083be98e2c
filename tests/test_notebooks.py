"""The notebooks as papermill runs them in CI (CPU parameters), and the runner behind ./workbench reports."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
import pytest

import notebook_runs  # each notebook executed once, shared with the browser tests

from kernels_workbench import report

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render


def _plotly_figures(html: str) -> int:
    return html.count("Plotly.newPlot(")


@pytest.mark.notebook
@notebook_runs.GROUP
def test_kl_notebook_runs_checks_and_exports_figures():
    html_path, results, executed_path = notebook_runs.executed(NOTEBOOKS / "02_kl_divergence.ipynb")

    checks = pd.read_csv(results / "kl_div_checks.csv")
    # 3 dtypes x 4 reductions x 2 log_target, on 2 shapes, all passed
    assert len(checks) == 48
    assert checks["passed"].all()
    assert set(checks["dtype"]) == {"float32", "bfloat16", "float16"}
    assert set(checks["reduction"]) == {"none", "sum", "mean", "batchmean"}
    assert (checks.loc[checks.dtype == "float32", "kernels_lib loss err"] < 1e-5).all()
    assert (checks.loc[checks.dtype == "float32", "kernels_lib grad err"] < 1e-5).all()

    executed = nbformat.read(executed_path, as_version=4)
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    assert not any("ipywidgets" in str(o.get("data", {})) for c in executed.cells for o in c.get("outputs", []))

    html = html_path.read_text(encoding="utf-8")
    assert _plotly_figures(html) >= 2  # the sweep and the published chart
    assert FALLBACK not in html
    # Per GPU of the committed rows, its newest run's comparison: kernels_lib over Liger as the run's own medians say
    from kernels_workbench import data
    from kernels_workbench.bench.analysis import medians
    rows = data.load_measured("kl_div", latest=False)
    runs = data.newest_run_per_gpu(rows[rows.device == "cuda"])
    assert runs, "the committed kl_div rows hold no GPU run"
    for gpu, run in runs.items():
        label = data.gpu_label(gpu)
        table = pd.read_csv(results / f"comparison_kl_div_{label.replace(' ', '_')}.csv", index_col=0)
        speed = medians(run, "speed", "full")
        assert table["× liger"].to_numpy() == pytest.approx((speed["kernels_lib"] / speed["liger"]).to_numpy()), label
        assert f"**{label}**" in html or f"<strong>{label}</strong>" in html, f"no summary line for the {label}"
    judged = html.split("Against Liger, torch and the floor")[1].split("Conclusion")[0]
    assert not any(word in judged for word in ("hold it to", "missed", " met ")), "the report states our targets, not a comparison"


def _failing_notebook(folder: Path) -> Path:
    notebook = nbformat.v4.new_notebook()
    parameters = nbformat.v4.new_code_cell('device = "auto"\nsize = "auto"\ninteractive = True\nrecord = False')
    parameters.metadata["tags"] = ["parameters"]
    notebook.cells = [
        parameters,
        nbformat.v4.new_code_cell("print('reached the first cell')"),
        nbformat.v4.new_code_cell("raise RuntimeError('broken on purpose')"),
        nbformat.v4.new_code_cell("print('never reached')"),
    ]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "99_broken.ipynb"
    nbformat.write(notebook, path)
    return path


@pytest.mark.notebook
def test_runner_stops_on_a_failing_notebook_and_names_it(tmp_path, capsys):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    _failing_notebook(folder)
    out = tmp_path / "out"
    code = report.main(["--notebooks", str(folder), "--out", str(out), "--device", "cpu", "--timeout", "120"])
    assert code == 1
    message = capsys.readouterr().err
    assert "99_broken.ipynb" in message and "RuntimeError" in message and "broken on purpose" in message
    assert "cell 2 " in message  # numbered as in the source notebook, from 0
    partial = nbformat.read(out / "executed" / "99_broken.ipynb", as_version=4)
    printed = [o.get("text", "") for c in partial.cells for o in c.get("outputs", [])]
    assert any("reached the first cell" in text for text in printed)
    assert not (out / "index.html").exists()


@pytest.mark.notebook
def test_runner_keep_going_runs_the_rest_and_still_fails(tmp_path, capsys):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    _failing_notebook(folder)
    fine = nbformat.read(_failing_notebook(folder), as_version=4)
    fine.cells = fine.cells[:2]  # parameters and the print: runs
    nbformat.write(fine, folder / "10_fine.ipynb")
    out = tmp_path / "out"
    args = ["--notebooks", str(folder), "--out", str(out), "--device", "cpu", "--timeout", "120", "--keep-going"]
    assert report.main(args) == 1
    message = capsys.readouterr().err
    assert "1 notebook(s) failed: 99_broken.ipynb" in message and "broken on purpose" in message
    assert (out / "10_fine.html").exists() and not (out / "99_broken.html").exists()
    index = (out / "index.html").read_text(encoding="utf-8")
    assert 'href="10_fine.html"' in index and "10_fine: every cell ran" in index
    assert 'href="executed/99_broken.ipynb"' in index and "99_broken: FAILED" in index


def test_runner_runs_the_overview_after_the_loss_notebooks():
    """At full size the overview reads the rows the loss notebooks append: it must run last."""
    names = ["02_kl_divergence.ipynb", "00_overview.ipynb", "06_preference_dpo_cpo_simpo_grpo.ipynb", "05_training_step.ipynb",
             "01_cross_entropy.ipynb", "04_kto.ipynb"]
    order = [nb.name for nb in report.run_order([Path(n) for n in names])]
    assert order == ["01_cross_entropy.ipynb", "02_kl_divergence.ipynb", "04_kto.ipynb", "05_training_step.ipynb",
                     "06_preference_dpo_cpo_simpo_grpo.ipynb", "00_overview.ipynb"]


def test_runner_finds_every_notebook():
    """The runner takes notebooks/*.ipynb: the preference notebook (06) is among them, before the overview."""
    order = [nb.name for nb in report.run_order(sorted(report.NOTEBOOK_DIR.glob("*.ipynb")))]
    assert "06_preference_dpo_cpo_simpo_grpo.ipynb" in order and order[-1] == "00_overview.ipynb"


def test_runner_parameters_follow_the_device():
    assert report.notebook_parameters("cpu") == {"device": "cpu", "size": "small", "interactive": False, "record": False}
    assert report.notebook_parameters("cuda")["size"] == "full"
    assert report.notebook_parameters("cuda")["record"] is True


@pytest.mark.notebook
def test_runner_index_lists_titles_and_status_and_hides_tagged_inputs(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    notebook = nbformat.v4.new_notebook()
    hidden = nbformat.v4.new_code_cell("print('shown ' + 'output')  # hidden source")
    hidden.metadata["tags"] = ["hide-input"]
    notebook.cells = [
        nbformat.v4.new_markdown_cell("Some text first.\n\n# A small report\n\nand more."),
        hidden,
        nbformat.v4.new_code_cell("print('visible ' + 'source')"),
    ]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, folder / "10_small.ipynb")
    out = tmp_path / "out"
    assert report.main(["--notebooks", str(folder), "--out", str(out), "--device", "cpu", "--timeout", "120"]) == 0
    index = (out / "index.html").read_text(encoding="utf-8")
    assert '<a href="10_small.html">A small report</a>' in index
    assert "10_small: every cell ran" in index and "0 figures" in index
    page = (out / "10_small.html").read_text(encoding="utf-8")
    assert "shown output" in page and "hidden source" not in page
    assert "visible " in page and "source" in page


def _tiny_notebook(folder: Path, name: str = "10_tiny.ipynb", figure: bool = False) -> Path:
    """Parameters, a markdown formula, a print, a warning to stderr and a last print (and, with ``figure``,
    a plotly figure drawn as the notebooks draw theirs)."""
    notebook = nbformat.v4.new_notebook()
    parameters = nbformat.v4.new_code_cell('device = "auto"\nsize = "auto"\ninteractive = True\nrecord = False')
    parameters.metadata["tags"] = ["parameters"]
    notebook.cells = [
        parameters,
        nbformat.v4.new_markdown_cell("# Tiny\n\nA formula: $e^{x}$."),
        nbformat.v4.new_code_cell("print('first output')"),
        nbformat.v4.new_code_cell("import sys, warnings\nwarnings.warn('a warning ' + 'to stderr')\nprint('printed ' + 'to stderr', file=sys.stderr)"),
        nbformat.v4.new_code_cell("print('last output')"),
    ]
    if figure:
        notebook.cells.append(nbformat.v4.new_code_cell(
            'import plotly.graph_objects as go, plotly.io as pio\npio.renderers.default = "plotly_mimetype+notebook"\n'
            "go.Figure(go.Scatter(x=[1, 2], y=[3, 4])).show()"))
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / name
    nbformat.write(notebook, path)
    return path


@pytest.mark.notebook
def test_runner_prints_an_estimate_and_a_line_per_cell(tmp_path, capsys, monkeypatch):
    """The estimate from the table of measured times first, then per notebook ``[k/n] name: cell i/m, t s``
    for each code cell (numbered from 1 as in the source notebook, papermill's injected cell left out)."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    _tiny_notebook(folder)
    _tiny_notebook(folder, "11_other.ipynb")
    times = tmp_path / "times.csv"
    pd.DataFrame([{"notebook": "10_tiny", "device": "cpu", "seconds": 90.0, "cpus": 2, "date": "2025-01-01"}]).to_csv(times, index=False)
    monkeypatch.setattr(report, "TIMES_CSV", times)
    out = tmp_path / "out"
    args = ["--notebooks", str(folder), "--out", str(out), "--device", "cpu", "--timeout", "120", "--record-times"]
    assert report.main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("2 notebook(s) on cpu: about 1.5 min") and "no time measured for 11_other" in lines[0], lines[0]
    cells = [line for line in lines if line.startswith("[1/2] 10_tiny: cell")]
    assert [line.split(",")[0] for line in cells] == ["[1/2] 10_tiny: cell 1/5", "[1/2] 10_tiny: cell 3/5",
                                                      "[1/2] 10_tiny: cell 4/5", "[1/2] 10_tiny: cell 5/5"], lines
    assert all(line.endswith(" s") and line.rsplit(", ", 1)[1][:-2].isdigit() for line in cells)
    assert any(line.startswith("[2/2] 11_other: cell 5/5") for line in lines)
    assert any(line.startswith("[2/2] 11_other: done in ") for line in lines)
    recorded = pd.read_csv(times).set_index("notebook")
    assert sorted(recorded.index) == ["10_tiny", "11_other"] and (recorded.seconds < 90).all()


@pytest.mark.notebook
def test_reports_leave_out_stderr_and_load_nothing_from_a_cdn(tmp_path):
    """stderr (a warning's red box, with this machine's paths) stays in the executed notebook, not in the
    HTML; the HTML loads no script from elsewhere (no MathJax, require.js or mermaid)."""
    import re

    folder = tmp_path / "notebooks"
    folder.mkdir()
    notebook = _tiny_notebook(folder, figure=True)
    out = tmp_path / "out"
    html_path = report.run_notebook(notebook, out, report.notebook_parameters("cpu"), timeout=120)
    executed = nbformat.read(out / "executed" / notebook.name, as_version=4)
    stderr = "".join(o.text for c in executed.cells for o in c.get("outputs", []) if o.get("name") == "stderr")
    assert "a warning to stderr" in stderr and "printed to stderr" in stderr  # there to be left out
    page = html_path.read_text(encoding="utf-8")
    assert "first output" in page and "last output" in page
    assert "a warning to stderr" not in page and "printed to stderr" not in page and 'data-mime-type="application/vnd.jupyter.stderr"' not in page
    assert "Plotly.newPlot(" in page  # the figure, with plotly.js inline
    assert "cdnjs" in "".join(o.get("data", {}).get("text/html", "") for c in executed.cells for o in c.get("outputs", []))
    assert re.findall(r"<script[^>]*\bsrc=", page) == []  # plotly's MathJax from a CDN left out too
    assert not re.search(r"https?://[^\"'\s]*(/mathjax/|require(\.min)?\.js|mermaid)", page, re.I)  # no URL of them left to load
    assert "<math" in page  # the formula as MathML


def test_a_notebook_that_measures_ceilings_reads_them_again():
    """A notebook that loads ``ceilings.csv`` and later appends this run's ceilings (``--record`` on a GPU)
    must load them again in that cell: the floors after it are then of the rows' own run, not of an older
    one (08 at c0d8789 said "the rows' run measured no ceilings" one cell after measuring them)."""
    import re

    loaded = re.compile(r'^\s*(\w+) = data\.load_measured\("ceilings"', re.M)
    stale = []
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        names = set()
        for number, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type != "code":
                continue
            measures = "measure_ceilings(" in cell.source and '"ceilings")' in cell.source
            reloaded = set(loaded.findall(cell.source))
            if measures and names - reloaded:
                stale.append(f"{path.name} cell {number}: {sorted(names - reloaded)}")
            names |= reloaded
    assert stale == [], f"ceilings measured but the loaded frame not read again: {stale}"
