"""One comparison layer: every ratio the index prints is the one its notebook prints for the same run and GPU,
both read off kernels_workbench.comparison (the notebooks call the same functions), and every headline is one
sentence without a commit hash or a date. Built from the committed data/measured rows, not by running notebooks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kernels_workbench import comparison, dashboard, data

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
    for _, title, gpu, run in comparison.chart_runs(["fused_linear_cross_entropy"]):
        row = heads[(heads.chart == title) & (heads.gpu == gpu)].iloc[0]
        table = comparison.comparison(run, ceilings)
        assert dashboard.ratio_text(row["floor ratio"]) == dashboard.ratio_text(table.loc[row.x, "× floor"])
        assert table["× floor"].min() <= row["floor ratio"] <= table["× floor"].max(), "the index's ratio lies in the headline's range"


def test_the_notebooks_open_with_the_one_headline_and_no_floor_formula():
    """Each loss notebook's headline cell calls comparison.report_headline; no notebook divides FLOPs by a rate."""
    for report in comparison.HEADLINES:
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
