"""One comparison layer: every ratio the index prints is the one its notebook prints for the same run and GPU,
both read off kernels_workbench.comparison (the notebooks call the same functions), and every headline is one
sentence without a commit hash or a date. Built from the committed data/measured rows, not by running notebooks."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from kernels_workbench import comparison, dashboard, data
from kernels_workbench import report as report_module
from kernels_workbench import tensor_parallel as tp
from kernels_workbench import training_step as ts

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2} (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{4}\b")


@pytest.fixture(scope="module")
def ceilings():
    return data.load_measured("ceilings", latest=False)


@pytest.fixture(scope="module")
def heads():
    return dashboard.headlines(dashboard.dashboard())


def _one_sentence(text: str) -> bool:
    return len(re.findall(r"[.!?](?=\s|$)", text.strip())) == 1 and text.strip().endswith(".")


@pytest.mark.parametrize("report", list(comparison.HEADLINES))
def test_the_index_ratio_is_the_notebooks_for_the_same_run_and_gpu(report, ceilings, heads):
    """Per chart and GPU of the report, the index's × fastest peer, × leanest peer's memory and × floor at its x
    equal the notebook's comparison table (comparison.comparison of the same run) at that x."""
    runs = comparison.chart_runs(comparison.HEADLINES[report][1])
    assert runs, f"{report}: no measured chart in data/measured"
    mine = heads[heads.report == report]
    compared = 0
    for kernel_name, title, gpu, run in runs:
        row = mine[(mine.chart == title) & (mine.gpu == gpu)]
        assert len(row) == 1, f"{report}: the index has no row for {title} on {gpu}"
        row = row.iloc[0]
        assert row.run == data.run_label(run), f"{title} on {gpu}: the index reads another run than the notebook"
        table = comparison.comparison(run, ceilings, kernel_name=kernel_name)
        at = table.loc[row.x]
        for index_column, table_column in (("time ratio", "× fastest peer"), ("memory ratio", "memory × leanest"),
                                           ("floor ratio", "× floor")):
            ours, theirs = dashboard.ratio_text(row[index_column]), dashboard.ratio_text(at[table_column])
            assert ours == theirs, f"{title} on {gpu} at {row.x_name} = {row.x}: the index prints {ours}, the notebook {theirs} ({table_column})"
        if isinstance(row["fastest peer"], str):
            assert row["fastest peer"] == at["fastest peer"], f"{title} on {gpu}: the index and the notebook name other fastest peers"
        compared += 1
    assert compared == len(runs)


@pytest.mark.parametrize("report", list(comparison.HEADLINES))
def test_a_headline_is_one_sentence_without_a_commit_or_a_date(report, ceilings):
    said = comparison.report_headline(report, ceilings)
    assert _one_sentence(said), f"{report}: not one sentence: {said}"
    assert not HASH.search(said), f"{report}: a commit hash in the headline: {HASH.search(said).group()}"
    assert not DATE.search(said), f"{report}: a date in the headline: {DATE.search(said).group()}"
    assert "the floor" in said and "fastest peer" in said, f"{report}: the headline leaves out the floor or the fastest peer"


def test_every_floor_ratio_of_the_index_is_the_notebooks_floor(ceilings, heads):
    """The FCE's floor on each GPU comes from the run's own three_matmuls, the same number the index prints."""
    runs = comparison.chart_runs(["fused_linear_cross_entropy"])
    assert runs, "no fused linear cross-entropy run in data/measured"
    for _, title, gpu, run in runs:
        row = heads[(heads.chart == title) & (heads.gpu == gpu)].iloc[0]
        table = comparison.comparison(run, ceilings)
        assert dashboard.ratio_text(row["floor ratio"]) == dashboard.ratio_text(table.loc[row.x, "× floor"])
        assert table["× floor"].min() <= row["floor ratio"] <= table["× floor"].max(), "the index's ratio lies in the headline's range"


def test_the_notebooks_open_with_the_one_headline_and_no_floor_formula():
    """Each loss notebook's headline cell (and 05's, 09's) calls comparison.report_headline; no notebook divides FLOPs by a rate."""
    for report in comparison.headline_reports():
        cells = json.loads((NOTEBOOKS / f"{report}.ipynb").read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        assert any(f'comparison.report_headline("{report}"' in c for c in code), f"{report}: its headline is not comparison.report_headline"
    for path in sorted(NOTEBOOKS.glob("0*.ipynb")):
        code = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        inline = re.search(r"\* 1e12\) \* 1e3|/ r\[\"matmul\"\]|importlib\.import_module\([^)]*make_inputs", code)
        assert not inline, f"{path.name}: a floor formula inline ({inline.group()}): call kernels_workbench.floor"


def test_grpo_liger_is_far_from_its_published_figure_and_out_of_the_fastest(ceilings):
    runs = comparison.chart_runs(["fused_linear_grpo_loss_token"])
    assert runs, "no GRPO run in data/measured"
    for _, _, gpu, run in runs:
        far = comparison.far_from_published(run, comparison.published_for(run))
        table = comparison.comparison(run, ceilings)
        if "liger" in far:
            assert "liger" not in set(table["fastest peer"].dropna()), f"{gpu}: a far peer named the fastest"
            assert f"× liger ({comparison.FAR})" in table
    said = comparison.report_headline("06_preference_dpo_cpo_simpo_grpo", ceilings)
    assert "Liger left out: far from its published figure" in said or not any(
        comparison.far_from_published(r, comparison.published_for(r)) for *_, r in runs)


@pytest.mark.parametrize("report", comparison.OWN_HEADLINES)
def test_the_training_step_and_tensor_parallel_headlines_are_one_sentence_without_a_commit_or_a_date(report, ceilings):
    """05 and 09 open through the same narrative.headline: one sentence, the fastest and leanest peers, no hash, no date."""
    said = comparison.report_headline(report, ceilings)
    assert _one_sentence(said), f"{report}: not one sentence: {said}"
    assert not HASH.search(said), f"{report}: a commit hash in the headline: {HASH.search(said).group()}"
    assert not DATE.search(said), f"{report}: a date in the headline: {DATE.search(said).group()}"
    assert "fastest peer's time" in said and "leanest peer's memory" in said, said
    assert ("the floor" in said) == (report == "09_tensor_parallel"), "a whole training step has no floor; a rank's share has one"


def _own_tables(report: str, ceilings) -> dict:
    """GPU → the comparison tables behind 05's or 09's headline (by x), as the notebook's headline reads them."""
    if report == "05_training_step":
        return {gpu: pd.concat(frames) for gpu, frames in ts.headline_tables(ts.measured_rows()).items()}
    return tp.headline_tables(tp.load_runs_per_gpu(), ceilings)


@pytest.mark.parametrize("report", comparison.OWN_HEADLINES)
def test_the_index_reads_05s_and_09s_numbers_from_their_headlines_tables(report, ceilings, heads):
    """Per chart and GPU of 05 and 09 on the index, its time × the fastest peer and memory × the leanest peer are
    among the values the headline's range covers on that GPU, at the chart's x."""
    mine, tables = heads[heads.report == report], _own_tables(report, ceilings)
    # 05: the sweep of training_step.csv (the run beside torch's F.linear_cross_entropy is its own); 09: the tensor-parallel chart
    mine = mine[mine.chart.str.startswith("tensor-parallel ") if report == "09_tensor_parallel"
                else ~mine.chart.str.startswith(f"training step, {dashboard.TORCH_LCE_LABEL}")]
    assert len(mine) and tables, f"{report}: nothing measured in data/measured"
    for _, row in mine.iterrows():
        table = tables[row.gpu]
        at = table.loc[[row.x]] if row.x in table.index else table.iloc[:0]
        assert len(at), f"{row.chart} on {row.gpu}: the headline has no figure at {row.x_name} = {row.x}"
        for index_column, table_column in (("time ratio", "× fastest peer"), ("memory ratio", "memory × leanest")):
            if pd.notna(row[index_column]):
                said = {dashboard.ratio_text(v) for v in at[table_column]}
                assert dashboard.ratio_text(row[index_column]) in said, f"{row.chart} on {row.gpu}: {index_column} not the headline's"


def test_the_index_cards_of_05_and_09_say_the_notebooks_sentence(tmp_path, ceilings):
    """The index's card of each report with a headline prints comparison.report_headline, the sentence its notebook opens with."""
    executed = tmp_path / "executed"
    executed.mkdir()
    reports = []
    for report in comparison.OWN_HEADLINES:
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# {report}")]), executed / f"{report}.ipynb")
        reports.append((tmp_path / f"{report}.html", 1.0, ""))
    page = report_module.write_index(tmp_path, reports, report_module.notebook_parameters("cpu")).read_text(encoding="utf-8")
    for report in comparison.OWN_HEADLINES:
        card = page[page.index(f'data-report="{report}"'):]
        card = card[:card.index("</li>")]
        assert f'<p class="headline">{html.escape(comparison.report_headline(report, ceilings))}</p>' in card, report


def test_no_commit_in_the_tensor_parallel_conclusion(ceilings):
    said = tp.conclusion(tp.load_runs_per_gpu(), ceilings)
    assert not HASH.search(said) and not DATE.search(said), said
