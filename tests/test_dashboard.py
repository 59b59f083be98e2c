"""The reports index's dashboard (kernels_lib.workbench.dashboard) against the measured CSVs themselves.

Every expected number here is computed straight from ``data/measured/*.csv`` with pandas (the newest
run of the chart, the median of each provider at the x), not through the dashboard's helpers; the
index page must show each number of the dashboard, formatted.
"""

from __future__ import annotations

import html
import json
import re

import nbformat
import pandas as pd
import pytest

from kernels_lib.workbench import dashboard, data, report

H200 = "NVIDIA H200"


@pytest.fixture(scope="module")
def board() -> pd.DataFrame:
    return dashboard.dashboard()


def _newest_run(kernel_name: str) -> pd.DataFrame:
    """The H200 CUDA rows of the commit of the newest kernels_lib row, read from the CSV directly."""
    rows = pd.read_csv(data.MEASURED_DIR / f"{kernel_name}.csv")
    rows = rows[(rows.gpu_name == H200) & (rows.device == "cuda")]
    ours = rows[rows.kernel_provider == "kernels_lib"].sort_values("timestamp")
    return rows[rows.kernels_lib_commit == ours.kernels_lib_commit.iloc[-1]]


def _full(run: pd.DataFrame, metric: str) -> pd.DataFrame:
    chosen = run[(run.metric_name == metric) & (run.kernel_operation_mode == "full")]
    return chosen.groupby(["x_value", "kernel_provider"]).y_value_50.mean().unstack()


def _published_max_x(kernel_name: str) -> float | None:
    published = pd.read_csv(data.PUBLISHED_ROWS)
    xs = published[published.kernel_name == kernel_name].x_value
    return float(xs.max()) if len(xs) else None


@pytest.mark.parametrize("kernel_name", ["kl_div", "kto_loss", "fused_linear_orpo_loss", "fused_linear_dpo_loss", "tvd"])
def test_headline_ratios_equal_the_csv(board, kernel_name):
    run = _newest_run(kernel_name)
    # one chart per file (the configuration differs only in the swept size), so the file's rows are the chart's
    configs = run.extra_benchmark_config_str.map(lambda s: tuple(sorted((k, str(v)) for k, v in json.loads(s).items()
                                                                       if k != run.x_name.iloc[0])))
    assert configs.nunique() == 1
    speed, memory = _full(run, "speed"), _full(run, "memory")
    published = _published_max_x(kernel_name)
    x = published if published in speed.index else float(speed["kernels_lib"].dropna().index.max())
    # A file may hold several charts (ORPO at T = 1024 and 4096): the one of this run.
    rows = board[(board.kernel_name == kernel_name) & (board.kind == "ratio") & (board.commit == run.kernels_lib_commit.iloc[0])]
    peers = sorted(p for p in speed.columns if p != "kernels_lib" and "[" not in p)
    assert sorted(rows.peer) == peers and len(peers) >= 2
    for _, row in rows.iterrows():
        assert row.x == x
        assert row.commit == run.kernels_lib_commit.iloc[0] and row.gpu == H200
        assert row["ours ms"] == pytest.approx(speed.loc[x, "kernels_lib"], rel=1e-12)
        assert row["time ratio"] == pytest.approx(speed.loc[x, "kernels_lib"] / speed.loc[x, row.peer], rel=1e-12, nan_ok=True)
        assert row["memory ratio"] == pytest.approx(memory.loc[x, "kernels_lib"] / memory.loc[x, row.peer], rel=1e-12, nan_ok=True)


@pytest.mark.parametrize("kernel_name, target, metric, peer, bound", [
    ("kto_loss", "full ≤ 0.6× Liger", "speed", "liger", 0.6),
    ("kto_loss", "memory full ≤ Liger", "memory", "liger", 1.0),
    ("kl_div", "full ≤ 0.6× Liger", "speed", "liger", 0.6),
    ("fused_linear_cpo_loss", "full ≤ 0.85× huggingface", "speed", "huggingface", 0.85),
    ("distill_jsd_loss", "full ≤ 0.8× Liger", "speed", "liger", 0.8),
])
def test_target_verdicts_equal_the_csv(board, kernel_name, target, metric, peer, bound):
    """An upper-bound target over every x of the newest run: its worst ratio, where, and met / missed."""
    table = _full(_newest_run(kernel_name), metric)
    ratios = (table["kernels_lib"] / table[peer]).dropna()
    row = board[(board.kernel_name == kernel_name) & (board.kind == "target") & (board.target == target)]
    assert len(row) == 1
    row = row.iloc[0]
    assert row.bound == bound
    assert row["worst ratio"] == pytest.approx(ratios.max(), rel=1e-12)
    assert row["worst at x"] == ratios.idxmax()
    assert row.status == ("met" if (ratios <= bound).all() else "missed")


def test_tensor_parallel_ratios_equal_the_csv(board):
    rows = pd.read_csv(data.MEASURED_DIR / "tensor_parallel.csv")
    flce = rows[(rows.gpu_name == H200) & (rows.device == "cuda") & (rows.kernel_name == "fused_linear_cross_entropy")]
    flce = flce[flce.kernels_lib_commit == flce.sort_values("timestamp").kernels_lib_commit.iloc[-1]]
    full = flce[(flce.metric_name == "speed") & (flce.kernel_operation_mode == "full")]
    medians = full.groupby(["x_value", "kernel_provider", "tp"]).y_value_50.mean()
    x, tp2 = float(full.x_value.max()), int(full.tp.max())
    ours = medians.loc[(x, "kernels_lib", tp2)]
    shown = board[(board.kernel_name == dashboard.TENSOR_PARALLEL) & (board.kind == "ratio")]
    expected = {f"{p} TP={t}": ours / v for (px, p, t), v in medians.items()
                if px == x and (t == tp2 and p != "kernels_lib" or (p, t) == ("kernels_lib", 1)) and not pd.isna(v)}  # a failed provider has no ratio
    assert len(expected) >= 2
    assert dict(zip(shown.peer, shown["time ratio"])) == pytest.approx(expected, rel=1e-12)
    targets = board[(board.kernel_name == dashboard.TENSOR_PARALLEL) & (board.kind == "target")]
    tp2_time = targets[targets.target.str.startswith("kernels_lib TP = 2 full")].iloc[0]  # issue 11's: at TP = 2
    per_n = (medians.xs(("kernels_lib", 2), level=(1, 2)) / medians.xs(("kernels_lib", 1), level=(1, 2))).dropna()
    assert tp2_time["worst ratio"] == pytest.approx(per_n.max(), rel=1e-12)
    assert tp2_time.status == ("met" if (per_n <= tp2_time.bound).all() else "missed")
    tp8_time = targets[targets.target.str.startswith("kernels_lib TP = 8 / TP = 1 full")].iloc[0]  # issue 15's: at TP = 8
    if tp2 < 8:
        assert tp8_time.status == "not measured" and pd.isna(tp8_time["worst ratio"])
    else:
        per_n = (medians.xs(("kernels_lib", 8), level=(1, 2)) / medians.xs(("kernels_lib", 1), level=(1, 2))).dropna()
        assert tp8_time["worst ratio"] == pytest.approx(per_n.max(), rel=1e-12)


def test_every_measured_loss_has_a_chart_with_peers_and_targets(board):
    """Each report's losses (REPORTS) measured on the H200 appear, each with ratios to at least one peer;
    every loss but the logits-level CE charts (judged on the tensor-parallel chart) with targets."""
    measured = {name for name in dashboard.REPORTS if (data.MEASURED_DIR / f"{name}.csv").exists()}
    assert set(board.kernel_name) == measured
    for name in measured:
        kinds = set(board[board.kernel_name == name].kind)
        assert "ratio" in kinds, name
        assert ("target" in kinds) == (name not in ("cross_entropy", "megatron_cross_entropy")), name
    assert set(board[board.kind == "target"].status) <= {"met", "missed", "not measured"}


def test_index_shows_every_number_of_the_dashboard(board, tmp_path):
    (tmp_path / "executed").mkdir()
    reports = []
    for stem in sorted(set(dashboard.REPORTS.values())):
        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# Report {stem}")])
        nbformat.write(notebook, tmp_path / "executed" / f"{stem}.ipynb")
        reports.append((tmp_path / f"{stem}.html", 3.0, ""))
    page = report.write_index(tmp_path, reports, report.notebook_parameters("cpu")).read_text(encoding="utf-8")
    shown = {(html.unescape(k), c): html.unescape(t)
             for k, c, t in re.findall(r'<span class="num" data-key="([^"]*)" data-col="([^"]*)">([^<]*)</span>', page)}
    expected = {}
    for _, row in board.iterrows():
        # A target badge names its worst ratio only where the target was measured (a peer missing from the run: none).
        columns = ("time ratio", "memory ratio") if row.kind == "ratio" else ("worst ratio",) * (not pd.isna(row["worst ratio"]))
        for column in columns:
            expected[(row.key, column)] = "–" if pd.isna(row[column]) else f"{row[column]:.2f}"
        if row.kind == "target" and not pd.isna(row["worst ratio"]):
            worst_at = row["worst at x"]
            expected[(row.key, "worst at x")] = worst_at if isinstance(worst_at, str) else f"{worst_at:g}"
    first_ratio = board[board.kind == "ratio"].groupby("chart", sort=False).key.first()
    for chart, key in first_ratio.items():
        expected[(key, "x")] = f"{board[board.key == key].x.iloc[0]:g}"
    assert {k: v for k, v in shown.items() if k in expected} == expected
    assert set(shown) == set(expected)
    assert page.count('class="chart"') == board.chart.nunique()
    for _, row in board[board.kind == "target"].iterrows():
        assert f'data-key="{html.escape(row.key)}" data-status="{html.escape(row.status)}"' in page
    assert page.count("<svg") == board.chart.nunique()
