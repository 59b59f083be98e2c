"""kernels_lib.workbench.profiles: a profiled call split into matmuls, our kernels, torch's kernels and the rest,
with its floor from the ceilings of its own run only."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kernels_lib.workbench import profiles
from kernels_lib.workbench.bench import fused_linear_dpo as dpo_bench
from kernels_lib.workbench.bench import fused_linear_kto as kto_bench

META = {"gpu_name": "NVIDIA H200", "kernels_lib_commit": "abc1234", "torch_version": "2.11", "triton_version": "3.6"}


@pytest.mark.parametrize("name, expected", [
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "matmuls"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmuls"),
    ("cutlass::Kernel2<cutlass_80_tensorop>", "matmuls"),
    ("token_logprobs_kernel", "kernels_lib's kernels"),
    ("scale_gradient_kernel", "kernels_lib's kernels"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "torch's kernels"),
    ("Memset (Device)", "torch's kernels"),
    ("Memcpy DtoD (Device -> Device)", "torch's kernels"),
])
def test_each_kernel_name_lands_in_its_part(name, expected):
    assert profiles.kind(name) == expected, f"{name!r} classified as {profiles.kind(name)!r}, expected {expected!r}"


def kernels(**ms) -> pd.DataFrame:
    names = {"matmul": "nvjet_a", "ours": "token_logprobs_kernel", "torch": "void at::native::fill"}
    return pd.DataFrame([{"kernel": f"{names[k]}{i}", "ms": v} for k, values in ms.items() for i, v in enumerate(values)])


def test_breakdown_sums_each_part_and_leaves_the_rest_of_the_call():
    parts = profiles.breakdown(kernels(matmul=[3.0, 2.0], ours=[1.0], torch=[0.25, 0.25]), call_ms=8.0, flops=5e12)
    assert parts["matmuls"] == pytest.approx(5.0) and parts["kernels_lib's kernels"] == pytest.approx(1.0)
    assert parts["torch's kernels"] == pytest.approx(0.5) and parts["the rest of the call"] == pytest.approx(1.5)
    assert parts["matmul TFLOP/s"] == pytest.approx(5e12 / 5e-3 / 1e12), "5 TFLOP in 5 ms is 1000 TFLOP/s"
    assert sum(parts[k] for k in profiles.KINDS) == pytest.approx(parts["call ms"])


def test_breakdown_never_gives_a_negative_rest_and_no_rate_without_flops():
    parts = profiles.breakdown(kernels(matmul=[9.0]), call_ms=8.0)
    assert parts["the rest of the call"] == 0.0, "kernels longer than the call's median leave no rest, not a negative one"
    assert math.isnan(parts["matmul TFLOP/s"])


@pytest.mark.parametrize("call_ms", [0.0, -1.0, float("nan")])
def test_breakdown_refuses_a_call_time_that_is_not_a_positive_time(call_ms):
    with pytest.raises(ValueError, match="call_ms"):
        profiles.breakdown(kernels(matmul=[1.0]), call_ms=call_ms)


def test_breakdown_names_missing_columns():
    with pytest.raises(ValueError, match="ms"):
        profiles.breakdown(pd.DataFrame({"kernel": ["nvjet"]}), call_ms=1.0)


def ceilings(commit: str, gpu: str = "NVIDIA H200", copy_gbps: float = 4000.0, matmul_tflops: float = 700.0) -> pd.DataFrame:
    return pd.DataFrame([{"kernel_name": "copy", "gpu_name": gpu, "kernels_lib_commit": commit, "y_value_50": copy_gbps,
                          "timestamp": "2026-01-01 00:00:00"},
                         {"kernel_name": "matmul", "gpu_name": gpu, "kernels_lib_commit": commit, "y_value_50": matmul_tflops,
                          "timestamp": "2026-01-01 00:00:00"}])


def test_a_point_takes_its_floor_from_its_own_runs_ceilings():
    sizes = {**dpo_bench.SPEC.published["sizes"], "B": 8}
    flops = dpo_bench.flops(sizes, "full")
    matmul_ms = flops / (700.0 * 1e9)  # exactly the floor's matmul time at 700 TFLOP/s
    point = profiles.point(dpo_bench.KERNEL_NAME, 8, kernels(matmul=[matmul_ms]), call_ms=1.25 * matmul_ms, meta=META,
                           ceilings=ceilings(META["kernels_lib_commit"]))
    assert point["floor ms"] == pytest.approx(matmul_ms), "DPO at this size is bound by its matmuls"
    assert point["× floor"] == pytest.approx(1.25)
    assert point["matmuls × their floor"] == pytest.approx(1.0)
    assert point["the rest of the call"] == pytest.approx(0.25 * matmul_ms)


def test_a_point_never_borrows_another_runs_ceilings():
    point = profiles.point(dpo_bench.KERNEL_NAME, 8, kernels(matmul=[40.0]), call_ms=50.0, meta=META,
                           ceilings=ceilings("another"))
    assert math.isnan(point["floor ms"]) and math.isnan(point["× floor"]), "a floor from another run's ceilings"
    assert "no ceilings measured in its run" in profiles.lines(pd.DataFrame([point]))


def test_preference_profiles_join_times_and_kernels_per_loss_and_b():
    times = pd.DataFrame([{"loss": dpo_bench.KERNEL_NAME, "B": b, "case": case, "ms_p50": ms, **META}
                          for b in (8, 16) for case, ms in (("full", 50.0 * b / 8), ("reference pass", 13.0))])
    listed = pd.DataFrame([{"loss": dpo_bench.KERNEL_NAME, "B": b, "kernel": name, "cuda_ms": ms}
                           for b in (8, 16) for name, ms in (("nvjet_x", 40.0 * b / 8), ("token_logprobs_kernel", 3.0))])
    table = profiles.preference_profiles(times, listed, ceilings(META["kernels_lib_commit"]))
    assert list(table.B) == [8, 16]
    assert list(table["the rest of the call"]) == pytest.approx([7.0, 17.0])
    assert list(table["reference pass ms"]) == [13.0, 13.0]
    text = profiles.lines(table, {dpo_bench.KERNEL_NAME: "DPO"})
    assert text.count("- **DPO**") == 2 and "on the H200" in text and "matmuls 40.00 ms (80%)" in text


def test_kto_profiles_keep_device_rows_and_compare_chunks_with_the_default():
    times = pd.DataFrame([{"B": 8, "chunk_size": c, "ms_50": ms, **META} for c, ms in ((512, 8.0), (1024, 7.2), (2048, 6.8))])
    rows = [{"B": 8, "name": "aten::addmm", "cuda_ms_per_call": 5.0, "cpu_ms_per_call": 0.5},  # an op: its kernels count
            {"B": 8, "name": "nvjet_sm90_tst", "cuda_ms_per_call": 5.0, "cpu_ms_per_call": 0.0},
            {"B": 8, "name": "token_logprobs_kernel", "cuda_ms_per_call": 1.5, "cpu_ms_per_call": 0.0},
            {"B": 8, "name": "cudaLaunchKernel", "cuda_ms_per_call": 0.0, "cpu_ms_per_call": 0.7}]
    table = profiles.kto_profiles(times, pd.DataFrame(rows).assign(**META), ceilings(META["kernels_lib_commit"]))
    row = table.iloc[0]
    assert row["matmuls"] == 5.0, "the op aten::addmm and its kernel were both counted"
    assert row["the rest of the call"] == pytest.approx(1.5)
    assert row["× at chunk 2048"] == pytest.approx(0.85) and row["chunk"] == 512
    assert row["× floor"] == pytest.approx(8.0 / (kto_bench.flops({**kto_bench.SPEC.published["sizes"], "B": 8}, "full") / 700e9))
    assert "2048-row chunks 0.85×" in profiles.lines(table)
    ratios = profiles.chunk_ratios(times)
    assert list(ratios.loc[8]) == pytest.approx([1.0, 0.9, 0.85])


def test_the_committed_profiles_read_and_split_whole_calls():
    for table in (profiles.preference_profiles(), profiles.kto_profiles()):
        assert len(table), "a committed profile in data/measured/gpu_runs/ reads empty"
        share = profiles.shares(table).sum(axis=1)
        assert (share.round(6) == 1.0).all(), f"the parts do not add up to the call: {share.tolist()}"
        assert table["gpu_name"].str.startswith("NVIDIA").all()
    assert profiles.lines(pd.DataFrame()) == "No profile measured yet."


def test_small_vocab_steps_take_the_median_over_rounds_per_chart_v_and_provider():
    steps = pd.DataFrame([{"chart": "cross_entropy", "V": v, "round": r, "provider": p, "loss in step ms": ms}
                          for v in (4096, 8192) for r, scale in ((1, 1.0), (2, 3.0), (3, 2.0))
                          for p, ms in (("kernels_lib", 0.2 * scale), ("torch", 0.3 * scale * (v // 4096)))])
    table = profiles.small_vocab_steps(steps)
    assert table.loc[("cross_entropy", 4096), "kernels_lib"] == pytest.approx(0.4), "not the median of 0.2, 0.6, 0.4"
    assert table.loc[("cross_entropy", 8192), "torch"] == pytest.approx(1.2)
    text = profiles.step_lines(table, steps.assign(**META))
    assert "kernels_lib adds less than torch at 2 of 2 V" in text and "H200, kernels_lib abc1234" in text


def test_the_committed_step_profile_reads():
    table = profiles.small_vocab_steps()
    assert len(table) and {"kernels_lib", "torch"} <= set(table.columns), f"columns: {list(table.columns)}"
    assert (table > 0).all().all(), "a loss that adds no time to a step"
