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
        assert "GPU rows not measured yet" in html and "scripts/tensor_parallel_bench.py --out data/measured" in html
    else:
        assert "Against TP = 1, the peers and the floor" in html
        assert "**met**" in html or "<strong>met</strong>" in html or "missed" in html
        assert "Conclusion" in html and "scales at an efficiency of" in html  # the generated conclusion


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
    # The TP = 2 targets stay at TP = 2 when the run also has TP = 8.
    assert tp.verdicts(pd.DataFrame(rows)).set_index("target").loc["tp2_time", "ratio"] == pytest.approx(0.55)


def test_check_says_where_it_cannot_run(monkeypatch):
    """The gloo check holds CPU tensors: it runs where the kernels are interpreted, and elsewhere says why."""
    import kernels_lib
    from kernels_lib.workbench import tensor_parallel

    monkeypatch.setattr(kernels_lib, "INTERPRETED", True)
    assert tensor_parallel.check_unavailable() is None
    monkeypatch.setattr(kernels_lib, "INTERPRETED", False)
    assert "CPU tensors" in tensor_parallel.check_unavailable()


def _run(rows):
    return pd.DataFrame(rows).assign(kernels_lib_commit="abc1234", gpu_name="NVIDIA H100 80GB HBM3", timestamp="t", device="cuda")


def test_verdict_lines_say_the_range_and_why_a_target_is_missed():
    """Each target one bullet: met at every point, or missed with the worst point's share of the collectives
    and of dx (from the rows, H and dtype from the run's configuration)."""
    rows = []
    rows += _rows("fused_linear_cross_entropy", "kernels_lib", 1, 8192, 100.0, 1000.0)
    rows += _rows("fused_linear_cross_entropy", "kernels_lib", 2, 8192, 70.0, 500.0, comm_ms=14.0)
    frame = _run(rows).assign(extra_benchmark_config_str='{"H": 4096, "dtype": "torch.bfloat16"}', comm_bytes=2 * 8192 * 4096 * 2.0)
    lines = tp.verdict_lines(frame).splitlines()
    assert len(lines) == len(tp.TARGETS)
    time_line = next(line for line in lines if line.startswith(f"- {tp.TARGETS['tp2_time'][0]}"))
    assert "0.70–0.70×" in time_line and "**missed** at 1 of 1 points" in time_line and "14.0 ms (20%" in time_line
    assert "50% of it $dx$" in time_line and "without them 0.56× TP = 1" in time_line
    memory_line = next(line for line in lines if line.startswith(f"- {tp.TARGETS['tp2_memory'][0]}"))
    assert "**met** at every point" in memory_line
    assert sum("**not measured**" in line for line in lines) == len(tp.TARGETS) - 2  # no peer rows: nothing invented


def test_conclusion_states_each_tp_from_the_run():
    rows = []
    for provider, times in (("kernels_lib", (100.0, 60.0)), ("megatron-core", (200.0, 100.0))):
        rows += _rows("fused_linear_cross_entropy", provider, 1, 8192, times[0], 1000.0)
        rows += _rows("fused_linear_cross_entropy", provider, 2, 8192, times[1], 540.0)
    said = tp.conclusion(_run(rows))
    assert said.startswith("On the H100 80GB HBM3, at TP = 2 kernels_lib's `full` scales at an efficiency of 0.83 (the peers 1.00)")
    assert "its per-GPU memory 0.54× TP = 1's" in said and "run of commit abc1234" in said
    assert tp.conclusion(pd.DataFrame()) == "No GPU rows yet: the scaling is not measured."
    only_one = _run(_rows("fused_linear_cross_entropy", "kernels_lib", 1, 8192, 100.0, 1000.0))
    assert tp.conclusion(only_one) == "The run measured TP = 1 only: no scaling to state."


def test_same_sizes_ignores_tp_and_v():
    published = {"S": 2048, "B": 4, "V": 32000, "TP": 1, "dtype": "bf16"}
    assert tp.same_sizes('{"S": 2048, "B": 4, "V": 128256, "TP": 2}', published)
    assert not tp.same_sizes('{"S": 1024, "B": 4, "V": 32000, "TP": 1}', published)
    assert not tp.same_sizes("not json", published)


def test_load_runs_takes_the_gpu_of_the_newest_row_unless_named(tmp_path, monkeypatch):
    """No GPU is the default: without a name, the GPU of the newest CUDA row; per workload its newest commit."""
    base = {"kernel_provider": "kernels_lib", "tp": 1, "x_value": 8192, "kernel_operation_mode": "full", "metric_name": "speed",
            "y_value_50": 1.0, "device": "cuda", "extra_benchmark_config_str": "{}"}
    rows = pd.DataFrame([
        {**base, "kernel_name": "fused_linear_cross_entropy", "gpu_name": "NVIDIA H200", "kernels_lib_commit": "a", "timestamp": "2026-01-01"},
        {**base, "kernel_name": "fused_linear_cross_entropy", "gpu_name": "NVIDIA H100 80GB HBM3", "kernels_lib_commit": "b", "timestamp": "2026-01-02"},
        {**base, "kernel_name": "fused_linear_cross_entropy", "gpu_name": "NVIDIA H100 80GB HBM3", "kernels_lib_commit": "c", "timestamp": "2026-01-03"},
        {**base, "kernel_name": "fused_linear_cross_entropy", "gpu_name": "cpu", "kernels_lib_commit": "d", "timestamp": "2026-01-04", "device": "cpu"},
    ])
    path = tmp_path / "tensor_parallel.csv"
    rows.to_csv(path, index=False)
    monkeypatch.setattr(tp.data, "measured_path", lambda name: path)
    monkeypatch.setattr(tp.data, "read_rows", lambda p: pd.read_csv(p))
    newest = tp.load_runs()
    assert set(newest.gpu_name) == {"NVIDIA H100 80GB HBM3"} and set(newest.kernels_lib_commit) == {"c"}
    assert set(tp.load_runs("NVIDIA H200").kernels_lib_commit) == {"a"}
