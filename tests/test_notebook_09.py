"""Notebook 09 (vocabulary-parallel losses) as papermill runs it in CI: the gloo check launched from
the notebook asserted, the two published charts drawn, the H200 sections either judged or naming the
command; and the verdict logic on rows in the bench script's layout."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
import pytest

import notebook_runs  # each notebook executed once, shared with the browser tests

from kernels_lib.workbench import report
from kernels_lib.workbench import tensor_parallel as tp

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "09_tensor_parallel.ipynb"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render


@pytest.mark.notebook
@notebook_runs.GROUP
def test_tensor_parallel_notebook_runs_its_check_and_draws_the_charts():
    html_path, results, executed_path = notebook_runs.executed(NOTEBOOK)

    executed = nbformat.read(executed_path, as_version=4)
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    assert [o for o in outputs if o.get("output_type") == "error"] == []
    assert not any("ipywidgets" in str(o.get("data", {})) for o in outputs)

    checks = pd.read_csv(results / "tensor_parallel_check.csv")
    assert checks["passed"].all() and set(checks["ranks"]) == {2, 3}
    assert set(checks["against"]) == {"one process", "float64"} and len(checks) == 2 * 2 * len(tp.CASES)
    assert (checks.filter(like=" err").max() <= tp.TOLERANCE).all()

    html = html_path.read_text(encoding="utf-8")
    assert FALLBACK not in html
    assert html.count("Plotly.newPlot(") >= 2
    for name in ("megatron_cross_entropy", "cross_entropy"):
        assert f"({name})" in html
    if not len(tp.load_runs()):
        assert "H200 rows not measured yet" in html and "scripts/tensor_parallel_bench.py --out data/measured" in html
    else:
        assert "Issue 11" in html and ("**met**" in html or "<strong>met</strong>" in html or "missed" in html)


def _rows(kernel_name, provider, tp_size, x, full_ms, memory, comm_ms=float("nan")):
    base = {"kernel_name": kernel_name, "kernel_provider": provider, "tp": tp_size, "x_value": x,
            "kernel_operation_mode": "full", "comm_bytes": 1.0, "comm_ms": comm_ms}
    return [{**base, "metric_name": "speed", "y_value_50": full_ms}, {**base, "metric_name": "memory", "y_value_50": memory}]


def test_verdicts_ratio_limit_and_miss():
    """Rows as the bench script writes them: each target's ratio is ours over the peer's at the same
    point, met when within the limit, and a miss says by how much."""
    rows = []
    rows += _rows("fused_linear_cross_entropy", "kernels_lib", 1, 8192, 100.0, 1000.0)
    rows += _rows("fused_linear_cross_entropy", "kernels_lib", 2, 8192, 55.0, 600.0, comm_ms=5.0)
    rows += _rows("fused_linear_cross_entropy", "torch_loss_parallel", 2, 8192, 100.0, 6000.0)
    rows += _rows("cross_entropy", "kernels_lib", 1, 4096, 1.0, 10.0)
    rows += _rows("cross_entropy", "liger", 1, 4096, 1.25, 10.0)
    verdict = tp.verdicts(pd.DataFrame(rows)).set_index("target")
    assert verdict.loc["tp2_time", "ratio"] == pytest.approx(0.55) and verdict.loc["tp2_time", "met"]
    assert verdict.loc["tp2_memory", "ratio"] == pytest.approx(0.6) and not verdict.loc["tp2_memory", "met"]
    assert verdict.loc["tp2_memory", "over by"] == pytest.approx(0.6 / 0.55 - 1)
    assert verdict.loc["vs_loss_parallel_memory", "ratio"] == pytest.approx(0.1)
    assert verdict.loc["logits_vs_liger", "ratio"] == pytest.approx(0.8) and verdict.loc["logits_vs_liger", "met"]
    assert "vs_megatron_time" not in verdict.index  # no Megatron rows: nothing judged, nothing invented


def test_scaling_efficiency_and_the_tp8_targets():
    """Efficiency t1 / (k·tk) and the memory ratio against the same provider's TP = 1 row; issue 15's
    targets judged at TP = 8 only, and named as not measured where the run stopped below it."""
    rows = []
    for k, ms, mib in [(1, 100.0, 1000.0), (2, 55.0, 550.0), (4, 30.0, 300.0), (8, 20.0, 150.0)]:
        rows += _rows("fused_linear_cross_entropy", "kernels_lib", k, 8192, ms, mib)
    rows += _rows("fused_linear_cross_entropy", "torch_loss_parallel", 2, 8192, 60.0, 9000.0)  # no TP = 1 row
    table = tp.scaling_efficiency(pd.DataFrame(rows)).set_index(["provider", "TP"])
    assert table.loc[("kernels_lib", 1), "efficiency"] == pytest.approx(1.0)
    assert table.loc[("kernels_lib", 2), "efficiency"] == pytest.approx(100 / (2 * 55))
    assert table.loc[("kernels_lib", 8), "speed-up"] == pytest.approx(5.0)
    assert table.loc[("kernels_lib", 4), "MiB / TP = 1"] == pytest.approx(0.3)
    assert pd.isna(table.loc[("torch_loss_parallel", 2), "efficiency"])
    verdict = tp.scaling_verdicts(pd.DataFrame(rows)).set_index("target")
    assert verdict.loc["tp8_time", "ratio"] == pytest.approx(0.2) and verdict.loc["tp8_time", "status"] == "met"
    assert verdict.loc["tp8_memory", "ratio"] == pytest.approx(0.15) and verdict.loc["tp8_memory", "status"] == "met"
    below = [r for r in rows if r["tp"] <= 4]
    missing = tp.scaling_verdicts(pd.DataFrame(below))
    assert missing.ratio.isna().all() and (missing.status == "not measured (TP ≤ 4 in this run)").all()
    # Issue 11's targets stay at TP = 2 when the run also has TP = 8.
    assert tp.verdicts(pd.DataFrame(rows)).set_index("target").loc["tp2_time", "ratio"] == pytest.approx(0.55)


def test_check_says_where_it_cannot_run(monkeypatch):
    """The gloo check holds CPU tensors: it runs where the kernels are interpreted, and elsewhere says why."""
    import kernels_lib
    from kernels_lib.workbench import tensor_parallel

    monkeypatch.setattr(kernels_lib, "INTERPRETED", True)
    assert tensor_parallel.check_unavailable() is None
    monkeypatch.setattr(kernels_lib, "INTERPRETED", False)
    assert "CPU tensors" in tensor_parallel.check_unavailable()
