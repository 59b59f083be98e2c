"""Notebook 09 (vocabulary-parallel losses) as papermill runs it in CI: the gloo check launched from
the notebook asserted, the two published charts drawn, each GPU's sections either compared or naming the
command; and the comparisons on rows in the bench script's layout."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
import pytest

import notebook_runs  # each notebook executed once, shared with the browser tests

from kernels_workbench import data, report
from kernels_workbench import tensor_parallel as tp

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
    runs = tp.load_runs_per_gpu()
    if not runs:
        assert "GPU rows not measured yet" in html and "scripts/tensor_parallel_bench.py --out data/measured" in html
    else:
        assert "Against the peers at the same TP, TP = 1 and the floor" in html and "× fastest peer" in html
        for gpu, rows in runs.items():  # each GPU its own table, its figures those of the run's rows
            if not (rows.kernel_name == "fused_linear_cross_entropy").any():
                continue
            table = pd.read_csv(results / f"comparison_tensor_parallel_{data.gpu_label(gpu).replace(' ', '_')}.csv").set_index(["N", "TP"])
            speed = rows[(rows.kernel_name == "fused_linear_cross_entropy") & (rows.metric_name == "speed")
                         & (rows.kernel_operation_mode == "full")].set_index(["kernel_provider", "tp", "x_value"]).y_value_50
            for (n, k), row in table.iterrows():
                assert row["kernels_lib ms"] == pytest.approx(speed[("kernels_lib", k, n)])
                if ("megatron-core", k, n) in speed.index:
                    assert row["× megatron-core"] == pytest.approx(speed[("kernels_lib", k, n)] / speed[("megatron-core", k, n)])
            assert f"On the {data.gpu_label(gpu)}, " in html
        assert "Conclusion" in html and "scales at an efficiency of" in html  # the generated conclusion
    assert "**met**" not in html and "<strong>met</strong>" not in html and "missed" not in html


CONFIG = '{{"N": 8192, "H": 4096, "V": 128256, "TP": {tp}, "dtype": "torch.bfloat16", "reduction": "mean"}}'


def _rows(kernel_name, provider, tp_size, x, full_ms, memory, comm_ms=float("nan")):
    base = {"kernel_name": kernel_name, "kernel_provider": provider, "tp": tp_size, "x_value": x,
            "kernel_operation_mode": "full", "comm_bytes": 1.0, "comm_ms": comm_ms}
    return [{**base, "metric_name": "speed", "y_value_50": full_ms}, {**base, "metric_name": "memory", "y_value_50": memory}]


def _run(rows, gpu="NVIDIA H100 80GB HBM3"):
    frame = pd.DataFrame(rows).assign(kernels_lib_commit="abc1234", gpu_name=gpu, timestamp="t", device="cuda", x_name="N")
    return frame.assign(extra_benchmark_config_str=[CONFIG.format(tp=k) for k in frame.tp])


def _ceilings(commit="abc1234", gpu="NVIDIA H100 80GB HBM3"):
    return pd.DataFrame([{"kernel_name": "copy", "gpu_name": gpu, "kernels_lib_commit": commit, "y_value_50": 3000.0, "timestamp": "t"},
                         {"kernel_name": "matmul", "gpu_name": gpu, "kernels_lib_commit": commit, "y_value_50": 700.0, "timestamp": "t"}])


def _launch():
    rows = []
    rows += _rows("fused_linear_cross_entropy", "kernels_lib", 1, 8192, 100.0, 1000.0)
    rows += _rows("fused_linear_cross_entropy", "kernels_lib", 2, 8192, 55.0, 600.0, comm_ms=5.0)
    rows += _rows("fused_linear_cross_entropy", "torch_loss_parallel", 1, 8192, 110.0, 12000.0)
    rows += _rows("fused_linear_cross_entropy", "torch_loss_parallel", 2, 8192, 100.0, 6000.0)
    rows += _rows("fused_linear_cross_entropy", "megatron-core", 2, 8192, 80.0, 3000.0)
    return rows


def test_tp_comparison_sets_each_tp_against_the_peers_at_the_same_tp():
    """Rows as the bench script writes them: at each TP kernels_lib's time over each peer's at that TP only (a peer
    not measured there is NaN, not another TP's), the fastest and leanest peer, and its efficiency against its own TP = 1."""
    table = tp.tp_comparison(_run(_launch()), tp.NO_CEILINGS)
    two, one = table.loc[(8192, 2)], table.loc[(8192, 1)]
    assert two["× torch_loss_parallel"] == pytest.approx(0.55) and two["× megatron-core"] == pytest.approx(55 / 80)
    assert two["fastest peer"] == "megatron-core" and two["× fastest peer"] == pytest.approx(55 / 80)
    assert two["leanest peer"] == "megatron-core" and two["memory × leanest"] == pytest.approx(0.2)
    assert two["efficiency"] == pytest.approx(100 / (2 * 55)) and two["memory / TP = 1"] == pytest.approx(0.6)
    assert one["× torch_loss_parallel"] == pytest.approx(100 / 110) and pd.isna(one["× megatron-core"])
    assert one["fastest peer"] == "torch_loss_parallel" and one["efficiency"] == pytest.approx(1.0)
    assert table["× floor"].isna().all()  # the run measured no ceilings: no floor, never another run's
    assert tp.tp_comparison(pd.DataFrame(), tp.NO_CEILINGS).empty


def test_the_floor_at_tp_is_one_ranks_share_at_the_runs_own_ceilings():
    table = tp.tp_comparison(_run(_launch()), _ceilings())
    floor = table["kernels_lib ms"] / table["× floor"]
    assert floor.notna().all() and floor[(8192, 2)] / floor[(8192, 1)] == pytest.approx(0.5, rel=0.05)  # V / 2 per rank
    floors = tp.floor_table(_run(_launch()), _ceilings())
    assert floors.loc[(8192, 2), "floor ms"] == pytest.approx(floor[(8192, 2)])
    assert floors.loc[(8192, 2), "megatron-core / floor"] == pytest.approx(80 / floor[(8192, 2)])
    assert tp.tp_comparison(_run(_launch()), _ceilings(commit="other"))["× floor"].isna().all()  # another run's ceilings


def test_logits_comparisons_split_the_tp_suffixes():
    rows = []
    for provider, ms in (("kernels_lib", 1.0), ("liger", 1.25), ("megatron-fused", 2.0), ("kernels_lib[TP=2]", 3.0),
                         ("megatron-fused[TP=2]", 2.0)):
        rows += _rows("cross_entropy", provider, float("nan"), 4096, ms, 10.0)
    run = pd.DataFrame(rows).drop(columns="tp").assign(kernels_lib_commit="abc1234", gpu_name="NVIDIA H200", timestamp="t",
                                                        x_name="V", extra_benchmark_config_str='{"B": 8, "T": 2048, "V": 4096}')
    tables = tp.logits_comparisons(run)
    assert sorted(tables) == [1, 2]
    assert tables[1].loc[4096, "× liger"] == pytest.approx(0.8) and "× megatron-fused[TP=2]" not in tables[1]
    assert tables[1].loc[4096, "fastest peer"] == "liger"
    assert tables[2].loc[4096, "× megatron-fused"] == pytest.approx(1.5) and "× liger" not in tables[2]


def test_scaling_efficiency_against_the_same_providers_tp1():
    """Efficiency t1 / (k·tk) and the memory ratio against the same provider's TP = 1 row, stated as measured."""
    rows = []
    for k, ms, mib in [(1, 100.0, 1000.0), (2, 55.0, 550.0), (4, 30.0, 300.0), (8, 20.0, 150.0)]:
        rows += _rows("fused_linear_cross_entropy", "kernels_lib", k, 8192, ms, mib)
    rows += _rows("fused_linear_cross_entropy", "torch_loss_parallel", 2, 8192, 60.0, 9000.0)  # no TP = 1 row
    efficiency = tp.scaling_efficiency(pd.DataFrame(rows))
    table = efficiency.set_index(["provider", "TP"])
    assert table.loc[("kernels_lib", 1), "efficiency"] == pytest.approx(1.0)
    assert table.loc[("kernels_lib", 2), "efficiency"] == pytest.approx(100 / (2 * 55))
    assert table.loc[("kernels_lib", 8), "speed-up"] == pytest.approx(5.0)
    assert table.loc[("kernels_lib", 4), "MiB / TP = 1"] == pytest.approx(0.3)
    assert pd.isna(table.loc[("torch_loss_parallel", 2), "efficiency"])
    said = tp.efficiency_line(efficiency, "NVIDIA H200")
    assert said.startswith("On the H200 this run measured TP = 1, 2, 4, 8: at TP = 2 kernels_lib's `full` efficiency is 0.91")
    assert "at TP = 8 kernels_lib's `full` efficiency is 0.62 (the peers not measured)" in said
    assert len(tp.efficiency_chart(efficiency, "NVIDIA H200").data) == 2 and len(tp.time_chart(tp.scaling_table(pd.DataFrame(rows)), "x").data) >= 4


def test_check_says_where_it_cannot_run(monkeypatch):
    """The gloo check holds CPU tensors: it runs where the kernels are interpreted, and elsewhere says why."""
    import kernels_lib
    from kernels_workbench import tensor_parallel

    monkeypatch.setattr(kernels_lib, "INTERPRETED", True)
    assert tensor_parallel.check_unavailable() is None
    monkeypatch.setattr(kernels_lib, "INTERPRETED", False)
    assert "CPU tensors" in tensor_parallel.check_unavailable()


def test_conclusion_states_each_gpu_and_tp_from_its_run():
    rows = []
    for provider, times in (("kernels_lib", (100.0, 60.0)), ("megatron-core", (200.0, 100.0))):
        rows += _rows("fused_linear_cross_entropy", provider, 1, 8192, times[0], 1000.0 if provider == "kernels_lib" else 4000.0)
        rows += _rows("fused_linear_cross_entropy", provider, 2, 8192, times[1], 540.0 if provider == "kernels_lib" else 2000.0)
    h200 = _run(_rows("fused_linear_cross_entropy", "kernels_lib", 1, 8192, 100.0, 1000.0), gpu="NVIDIA H200")
    said = tp.conclusion({"NVIDIA H100 80GB HBM3": _run(rows), "NVIDIA H200": h200})
    h100, other = said.split(" On the H200")
    assert h100.startswith("On the H100 80GB, at TP = 2 kernels_lib's `full` scales at an efficiency of 0.83 (the peers 1.00)")
    assert "its per-GPU memory 0.54× TP = 1's" in h100 and "it takes 0.60× the fastest peer's time at that TP (megatron-core)" in h100
    assert "at 0.27× the leanest peer's memory" in h100 and "abc1234" not in said  # the run's commit goes to its provenance line
    assert other.startswith(", the run measured TP = 1 only: no scaling to state")
    assert tp.conclusion({}) == "No GPU rows yet: the scaling is not measured."
    assert tp.conclusion(pd.DataFrame()) == "No GPU rows yet: the scaling is not measured."
    assert not any(word in said for word in ("target", " met", "missed"))


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
