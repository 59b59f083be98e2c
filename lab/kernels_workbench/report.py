"""The main job: execute every notebook with papermill on this machine and export HTML reports.

    python -m kernels_workbench.report [--device auto|cpu|cuda] [--out reports] [--only NAME ...] [--keep-going]
                                          [--record-times] [--record]

On a CPU machine the notebooks run at ``size="small"`` (kernels through Triton's interpreter); on
a GPU at ``size="full"`` (the published workloads). Each notebook runs non-interactively
(``interactive=False``: static figures for a fixed grid, no widgets). Executed notebooks go to
``<out>/executed/``, self-contained HTML reports (figures embedded with plotly.js, readable offline)
to ``<out>/``, with an ``index.html`` that says what the site is, gives per loss and GPU its headline
comparisons, and lists the reports by title with a one-line status and, per report, the measurements of
each GPU it shows (:mod:`kernels_workbench.dashboard`): ratios to each peer and the floor, a sparkline. Cells tagged
``hide-input`` show their output only. Formulas are converted from TeX to MathML at export
(:mod:`kernels_workbench.mathml`), which browsers render without MathJax or a network. A failing
notebook stops the run with exit code 1, naming the notebook and the cell; its partial output stays in
``<out>/executed/`` for inspection. With ``--keep-going`` the other notebooks still run, the index
marks the failed ones, and the exit code is still 1.

Progress: the run first prints its estimate (the per-notebook times of ``data/report_times.csv``, which
``--record-times`` rewrites from the run), then a line per code cell (``[3/10] 02_kl_divergence: cell
14/39, 42 s``). The HTML makes no network request: the export template leaves out require.js and
MathJax, plotly's per-figure MathJax script is removed, and stderr outputs stay in the executed notebooks.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import sys
import time
from pathlib import Path

import nbformat
import pandas as pd
import papermill
from jinja2 import DictLoader
from nbconvert import HTMLExporter
from nbconvert.preprocessors import Preprocessor, TagRemovePreprocessor
from papermill.engines import NBClientEngine, papermill_engines

from kernels_lib._runtime import default_device
from . import comparison, dashboard, data
from .mathml import MathMLPreprocessor

from .paths import REPO_ROOT
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
#: Notebooks that summarize what the others measure: run last (at full size they read the rows the
#: loss notebooks have just appended to data/measured/), listed first in the index (by name).
SUMMARY_NOTEBOOKS = ("00_overview",)


def run_order(notebooks: list[Path]) -> list[Path]:
    """The loss notebooks in name order, then the summaries."""
    return sorted(notebooks, key=lambda nb: (nb.stem in SUMMARY_NOTEBOOKS, nb.name))


class NotebookFailed(RuntimeError):
    """A notebook raised: names the notebook, the cell and where the partial output is."""


def notebook_parameters(device: str) -> dict:
    """The papermill parameters for this machine: small shapes on CPU; on CUDA the published ones,
    whose sweeps are appended to data/measured/ (the GPU refresh)."""
    full = device == "cuda"
    return {"device": device, "size": "full" if full else "small", "interactive": False, "record": full}


#: nbconvert's lab template less the three scripts it loads from a CDN: require.js (nothing in a report
#: needs it: plotly's figures are inline), MathJax (formulas are MathML already, :mod:`.mathml`) and
#: mermaid (no diagrams). With them gone a report makes no request beyond its own file.
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


#: A script an output loads from elsewhere: plotly's notebook renderer asks a CDN for MathJax 3 in every
#: figure's HTML (for TeX in a figure's text, which ours have none of).
_REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc=[\"']?(?:https?:)?//[^>]*>\s*</script>", re.I)


class OfflinePreprocessor(Preprocessor):
    """Leaves out of the report what is not the notebook's to say or would leave the file: stderr
    stream outputs (a library's warning, with the machine's paths in it; they stay in the executed
    notebook) and scripts an HTML output loads from a CDN. Counts them in ``stderr`` and ``scripts``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.stderr = self.scripts = 0

    def preprocess_cell(self, cell, resources, index):
        if "outputs" in cell:
            kept = [o for o in cell.outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
            self.stderr += len(cell.outputs) - len(kept)
            for output in kept:
                data = output.get("data", {})
                if "text/html" in data:
                    data["text/html"], removed = _REMOTE_SCRIPT.subn("", data["text/html"])
                    self.scripts += removed
            cell.outputs = kept
        return cell, resources


def export_html(executed: Path, html_path: Path) -> Path:
    """Write a self-contained HTML report of an executed notebook (inputs of ``hide-input`` cells
    removed, formulas as MathML, stderr left out, no script from a CDN: :data:`OFFLINE_TEMPLATE`,
    :class:`OfflinePreprocessor`)."""
    exporter = HTMLExporter(template_name="lab", extra_loaders=[DictLoader({"offline.html.j2": OFFLINE_TEMPLATE})],
                            template_file="offline.html.j2")
    remover = TagRemovePreprocessor(remove_input_tags={"hide-input"}, enabled=True)
    exporter.register_preprocessor(remover, enabled=True)
    exporter.register_preprocessor(MathMLPreprocessor(), enabled=True)
    exporter.register_preprocessor(OfflinePreprocessor(), enabled=True)
    body, _ = exporter.from_notebook_node(nbformat.read(executed, as_version=4))
    html_path.write_text(body, encoding="utf-8")
    return html_path


#: Cells papermill adds to the executed copy; left out when numbering cells as in the source notebook.
_PAPERMILL_TAGS = {"injected-parameters", "papermill-error-cell-tag"}


def _failed_cell(executed: Path) -> str:
    """The first cell whose output is an error, numbered as in the source notebook (from 0):
    'cell N (first line): Error: message'."""
    notebook = nbformat.read(executed, as_version=4)
    source_cells = [c for c in notebook.cells if not _PAPERMILL_TAGS & set(c.metadata.get("tags", []))]
    for index, cell in enumerate(source_cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                first = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
                return f"cell {index} ({first[:60]!r}): {output.get('ename')}: {output.get('evalue')}"
    return "an unknown cell"


class ProgressEngine(NBClientEngine):
    """papermill's nbclient engine that calls ``progress(cell_number, cells)`` as each code cell starts
    (numbered from 1 as in the source notebook: papermill's injected cells are left out), so that a
    long run says where it is instead of going quiet for minutes."""

    @classmethod
    def execute_managed_notebook(cls, nb_man, kernel_name, progress=None, **kwargs):
        if progress is not None:
            injected = {i for i, c in enumerate(nb_man.nb.cells) if _PAPERMILL_TAGS & set(c.metadata.get("tags", []))}
            number = {i: n for n, i in enumerate((i for i in range(len(nb_man.nb.cells)) if i not in injected), start=1)}
            cells, start = len(number), nb_man.cell_start

            def cell_start(cell, cell_index=None, **kw):
                if cell_index in number and cell.cell_type == "code":
                    progress(number[cell_index], cells)
                return start(cell, cell_index, **kw)

            nb_man.cell_start = cell_start
        return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)


papermill_engines.register("kernels_lib-progress", ProgressEngine)


def run_notebook(notebook: Path, out: Path, parameters: dict, timeout: int, progress=None) -> Path:
    """Execute one notebook into ``out/executed/`` and export its HTML to ``out/``; return the HTML path.
    ``progress(cell_number, cells)``, when given, is called as each code cell starts (:class:`ProgressEngine`)."""
    executed_dir = out / "executed"
    executed_dir.mkdir(parents=True, exist_ok=True)
    executed = executed_dir / notebook.name
    # the kernel imports this checkout's kernels_lib and workbench, not whichever are installed (another worktree's)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    ours = [str(REPO_ROOT), str(REPO_ROOT / "lab")]
    os.environ["PYTHONPATH"] = os.pathsep.join([*ours, *(p for p in paths if p and p not in ours)])
    try:
        papermill.execute_notebook(
            str(notebook),
            str(executed),
            parameters=parameters,
            kernel_name="python3",
            execution_timeout=timeout,
            cwd=str(notebook.parent),
            progress_bar=False,
            engine_name="kernels_lib-progress",
            progress=progress,
        )
    except papermill.PapermillExecutionError as error:
        raise NotebookFailed(
            f"{notebook.name} failed in {_failed_cell(executed)}; partial output in {executed}"
        ) from error
    return export_html(executed, out / notebook.with_suffix(".html").name)


#: The last measured time of each notebook per device (seconds), from which the runner estimates a run.
TIMES_CSV = REPO_ROOT / "data" / "report_times.csv"


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it."""
    return str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)


def read_times(path: Path | None = None) -> pd.DataFrame:
    """``notebook, device, seconds, cpus, date`` rows of ``path`` (default :data:`TIMES_CSV`; empty when missing)."""
    path = TIMES_CSV if path is None else path
    if not path.exists():
        return pd.DataFrame(columns=["notebook", "device", "seconds", "cpus", "date"])
    return pd.read_csv(path)


def estimate(notebooks: list[Path], device: str, times: pd.DataFrame) -> str:
    """One line: the run's expected duration, the sum of each notebook's last measured time on
    ``device`` (:data:`TIMES_CSV`), naming the notebooks without one."""
    known = times[times.device == device].drop_duplicates("notebook", keep="last").set_index("notebook").seconds
    measured = [nb.stem for nb in notebooks if nb.stem in known.index]
    missing = [nb.stem for nb in notebooks if nb.stem not in known.index]
    if not measured:
        return f"{len(notebooks)} notebook(s) on {device}: no measured time to estimate from ({_shown(TIMES_CSV)})"
    total = float(known[measured].sum())
    line = (f"{len(notebooks)} notebook(s) on {device}: about {total / 60:.1f} min from the last measured times "
            f"({_shown(TIMES_CSV)})")
    return line + (f"; no time measured for {', '.join(missing)}" if missing else "")


def record_times(reports: list[tuple[Path, float, str]], device: str, path: Path | None = None) -> None:
    """Replace ``device``'s rows of ``path`` (default :data:`TIMES_CSV`) for the notebooks that ran without a failure."""
    path = TIMES_CSV if path is None else path
    times = read_times(path)
    ran = {html.stem: seconds for html, seconds, failure in reports if not failure}
    times = times[~((times.device == device) & times.notebook.isin(ran))]
    new = pd.DataFrame([{"notebook": name, "device": device, "seconds": round(seconds, 1), "cpus": os.cpu_count(),
                         "date": time.strftime("%Y-%m-%d")} for name, seconds in ran.items()])
    pd.concat([times, new], ignore_index=True).sort_values(["device", "notebook"]).to_csv(path, index=False)


def record_run(reports: list[tuple[Path, float, str]], in_folder: int, seconds: float, argv: list[str] | None) -> dict:
    """Append one ``target='reports'`` row to the GPU runs (:data:`.run_record.RUNS_CSV`): the full-size
    reports are recorded like the GPU test target, with the notebooks that failed named in ``command``."""
    from . import run_record

    failed = [html.stem for html, _, failure in reports if failure]
    counts = {"passed": len(reports) - len(failed), "failed": len(failed), "skipped": 0}
    command = "./workbench reports " + " ".join(sys.argv[1:] if argv is None else argv)
    if failed:
        command += f" (failed: {', '.join(failed)})"
    row = run_record.run_row(counts, in_folder - len(reports), seconds / 60, command, target="reports")
    run_record.append_rows([row])
    return row


def describe(executed: Path) -> tuple[str, int]:
    """The title of an executed notebook (its first markdown heading, else its file name) and how
    many plotly figures it drew."""
    notebook = nbformat.read(executed, as_version=4)
    title = executed.stem
    for cell in notebook.cells:
        heading = next((line for line in cell.source.splitlines() if line.startswith("#")), None)
        if cell.cell_type == "markdown" and heading:
            title = heading.lstrip("#").strip()
            break
    figures = sum("application/vnd.plotly.v1+json" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", []))
    return title, figures


#: The index's style: system fonts, a readable measure, tables.
INDEX_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       max-width: 72rem; margin: 2rem auto; padding: 0 1rem; line-height: 1.5; color: #1f2328; background: #fff; }
h1 { font-size: 1.8rem; margin-bottom: .25rem; } h2 { font-size: 1.25rem; margin: 0; } h3 { font-size: 1rem; margin: 1rem 0 .25rem; }
code { font-size: .9em; background: #f3f4f6; padding: 0 .25em; border-radius: 3px; }
ul.cards { list-style: none; padding: 0; }
li.card { border: 1px solid #d0d7de; border-radius: 8px; padding: 1rem 1.25rem; margin: 1rem 0; }
li.card > small { display: block; color: #57606a; }
li.card.failed { border-color: #cf222e; }
.chart { border-top: 1px solid #eaeef2; margin-top: .75rem; }
.run { color: #57606a; font-size: .9rem; margin: 0 0 .5rem; }
.row { display: flex; flex-wrap: wrap; gap: 1.5rem; align-items: flex-start; }
table.ratios { border-collapse: collapse; font-size: .9rem; font-variant-numeric: tabular-nums; }
table.ratios th, table.ratios td { padding: .2rem .6rem; border-bottom: 1px solid #eaeef2; text-align: right; }
table.ratios th:first-child, table.ratios td:first-child { text-align: left; }
table.ratios thead th { border-bottom: 2px solid #d0d7de; font-weight: 600; }
td.better { color: #1a7f37; } td.worse { color: #cf222e; }
figure.spark { margin: 0; font-size: .8rem; color: #57606a; }
figure.spark figcaption span { margin-right: .6rem; white-space: nowrap; }
"""


#: The dashboard's cards are drawn by :mod:`.dashboard` (its numbers, colours and sparklines in one place).
chart_section, sparkline = dashboard.chart_section, dashboard.sparkline

#: What the site is, in one sentence (the index's first line).
SITE = ("Triton kernels for the LM-head losses of LLM training (cross-entropy, KL, ORPO, KTO, DPO, CPO, SimPO, GRPO, JSD, "
        "TVD, distillation), computed without materializing the logits; one report per loss derives it, checks it against "
        "its baseline in float64 and sets Liger-Kernel&#39;s published charts beside what we measured.")


def provenance_line(chart_list: list) -> str:
    """The generated line beside the measured data: per GPU, the dates of the runs the index shows, the
    versions recorded beside their rows (torch, triton) and how many commits they ran."""
    parts = []
    for gpu in sorted({c.gpu for c in chart_list}, key=lambda g: (data.gpu_label(g), g)):
        of_gpu = [c for c in chart_list if c.gpu == gpu]
        rows = pd.concat([c.rows for c in of_gpu], ignore_index=True)
        dates = sorted({c.date for c in of_gpu})
        versions = ", ".join(f"{name} {' / '.join(sorted(set(rows[f'{name}_version'].dropna().astype(str))))}"
                             for name in ("torch", "triton") if f"{name}_version" in rows and rows[f"{name}_version"].notna().any())
        commits = len({c.commit for c in of_gpu})
        when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
        parts.append(f"{data.gpu_label(gpu)}: runs of {when}" + (f", {versions}" if versions else "")
                     + f", {commits} commit{'s' if commits != 1 else ''}")
    return "; ".join(parts) or "no GPU run yet"


def write_index(out: Path, reports: list[tuple[Path, float, str]], parameters: dict) -> Path:
    """An index page: what the site is, the GPUs measured and the two commands; per chart and GPU the
    headline comparisons (:func:`.dashboard.headline_table`: × the fastest peer, × the leanest peer's
    memory, × the floor) linked to its report; then a card per report ``(html path, seconds, failure
    message or "")``: its title (linked to the report, or to the partial executed notebook of a failed
    one), a one-line status, and for each measured chart it shows (:mod:`.dashboard`, from
    ``data/measured``) the ratios of kernels_lib to each peer and to the floor on each GPU, with a sparkline."""
    chart_list = dashboard.charts()
    board = dashboard.dashboard(chart_list)
    ceilings = data.load_measured("ceilings", latest=False)
    items, links = [], {}
    for path, seconds, failure in reports:
        executed = out / "executed" / path.with_suffix(".ipynb").name
        title, figures = describe(executed)
        if failure:
            status = f"{path.stem}: FAILED after {seconds:.0f} s: {failure}"
            link = f"executed/{executed.name}"  # no HTML: the partial notebook is what there is to read
        else:
            status = f"{path.stem}: every cell ran, in {seconds:.0f} s on {parameters['device']} (size {parameters['size']}) · {figures} figures"
            link = path.name
        links[path.stem] = link
        mine = [chart for chart in chart_list if chart.report == path.stem]
        by_title: dict[str, list] = {}
        for chart in mine:
            by_title.setdefault(chart.title, []).append(chart)
        sections = "".join(chart_section(group, board[board.chart == title].reset_index(drop=True)) for title, group in by_title.items())
        said = (f'<p class="headline">{html.escape(comparison.report_headline(path.stem, ceilings))}</p>'
                if path.stem in comparison.headline_reports() else "")  # the notebook's own opening sentence
        items.append(f'<li class="card{" failed" if failure else ""}" data-report="{html.escape(path.stem)}">'
                     f'<h2><a href="{html.escape(link)}">{html.escape(title)}</a></h2><small>{html.escape(status)}</small>{said}{sections}</li>')
    gpus = ", ".join(data.gpu_label(g) for g in sorted({c.gpu for c in chart_list}, key=data.gpu_label)) or "none yet"
    page = (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'><meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>kernels_lib reports</title><style>{INDEX_STYLE}{dashboard.STYLE}</style></head><body>"
        "<h1>kernels_lib reports</h1>"
        f"<p class=\"site\">{SITE} Measured on: <strong>{html.escape(gpus)}</strong>; the published rows are on the GPUs "
        "their charts name.</p>"
        "<p>On any machine (no GPU needed): <code>./workbench reports</code> runs every notebook and writes these pages; "
        "<code>./workbench test</code> runs the test suite.</p>"
        "<h2>Per loss, on each GPU</h2><p>kernels_lib&#39;s <code>full</code> (forward and backward) time over the fastest "
        "peer&#39;s, its memory over the leanest peer&#39;s, both measured in the same run, and its time over the loss&#39;s "
        "floor (the longer of its matmul FLOPs at the matmul rate and its minimal bytes at the copy bandwidth, both measured "
        "in that run; a loss that mostly reads can run slightly under a copy&#39;s bandwidth, so a bytes floor may read just "
        "under 1×). Below 1: kernels_lib is faster or smaller.</p>"
        + dashboard.headline_table(board, links)
        + f'<p class="run provenance">Data: {html.escape(provenance_line(chart_list))} · these pages executed on '
        f"{html.escape(str(parameters['device']))} at size {html.escape(str(parameters['size']))}.</p>"
        + '<h2>The reports</h2><ul class="cards">\n' + "\n".join(items) + "\n</ul>"
        + dashboard.grpo_family_card()
        + "</body></html>"
    )
    index = out / "index.html"
    index.write_text(page, encoding="utf-8")
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels_workbench.report", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "reports")
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOK_DIR, help="folder of notebooks to run")
    parser.add_argument("--only", nargs="*", help="notebook names (stems) to run; default: all")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    parser.add_argument("--keep-going", action="store_true",
                        help="run the remaining notebooks after a failure (still exit 1, naming every failed one); "
                             "for long GPU refreshes, where one failure should not cost the others' measurements")
    parser.add_argument("--record-times", action="store_true",
                        help=f"write each notebook's time to {_shown(TIMES_CSV)} (the next run's estimate)")
    parser.add_argument("--record", action="store_true",
                        help="append the run to data/measured/gpu_test_runs.csv (target 'reports': notebooks that ran "
                             "to the end as passed, failed ones as failed, the others of the folder as deselected)")
    args = parser.parse_args(argv)
    device = default_device().type if args.device == "auto" else args.device
    notebooks = sorted(args.notebooks.glob("*.ipynb"))
    if args.only:
        notebooks = [nb for nb in notebooks if nb.stem in args.only]
    if not notebooks:
        parser.error(f"no notebooks to run in {args.notebooks}")
    parameters = notebook_parameters(device)
    args.out.mkdir(parents=True, exist_ok=True)
    order = run_order(notebooks)
    print(estimate(order, device, read_times()), flush=True)
    reports, failures = [], []
    began = time.perf_counter()
    for number, notebook in enumerate(order, start=1):
        tag = f"[{number}/{len(order)}] {notebook.stem}"
        print(f"{tag}: running with {parameters}", flush=True)
        start = time.perf_counter()

        def progress(cell, cells, tag=tag, start=start):
            print(f"{tag}: cell {cell}/{cells}, {time.perf_counter() - start:.0f} s", flush=True)

        try:
            html_path, failure = run_notebook(notebook, args.out, parameters, args.timeout, progress), ""
            print(f"{tag}: done in {time.perf_counter() - start:.0f} s ({(time.perf_counter() - began) / 60:.1f} min so far), "
                  f"wrote {html_path}", flush=True)
        except NotebookFailed as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            if not args.keep_going:
                return 1
            html_path, failure = args.out / notebook.with_suffix(".html").name, str(error)
            failures.append(notebook.name)
        reports.append((html_path, time.perf_counter() - start, failure))
    if args.record_times:
        record_times(reports, device)
    if args.record:
        record_run(reports, len(sorted(args.notebooks.glob("*.ipynb"))), time.perf_counter() - began, argv)
    index = write_index(args.out, sorted(reports, key=lambda report: report[0].name), parameters)
    print(f"reports: {index}")
    if failures:
        print(f"error: {len(failures)} notebook(s) failed: {', '.join(failures)} (see above and {index})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
