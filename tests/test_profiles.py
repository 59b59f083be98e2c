"""kernels_workbench.profiles: a profiled call split into matmuls, our kernels, torch's kernels and the rest,
with its floor from the ceilings of its own run only."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kernels_workbench import profiles
from kernels_workbench.bench import fused_linear_dpo as dpo_bench
from kernels_workbench.bench import fused_linear_grpo as grpo_bench
from kernels_workbench.bench import fused_linear_kto as kto_bench

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
    assert parts["matmuls"] == pytest.approx(5.0), "the two cuBLAS kernels were not summed into the matmuls"
    assert parts["kernels_lib's kernels"] == pytest.approx(1.0), "our Triton kernel was not counted as ours"
    assert parts["torch's kernels"] == pytest.approx(0.5), "torch's two kernels were not summed"
    assert parts["the rest"] == pytest.approx(1.5), "the rest is not the call less the listed kernels"
    assert parts["matmul TFLOP/s"] == pytest.approx(1000.0), "5 TFLOP in 5 ms is 1000 TFLOP/s"


def test_breakdown_never_gives_a_negative_rest_and_no_rate_without_flops():
    parts = profiles.breakdown(kernels(matmul=[9.0]), call_ms=8.0)
    assert parts["the rest"] == 0.0, "kernels longer than the call's median leave no rest, not a negative one"
    assert math.isnan(parts["matmul TFLOP/s"]), "a rate without FLOPs"


@pytest.mark.parametrize("call_ms", [0.0, -1.0, float("nan"), "3", None])
def test_breakdown_refuses_a_call_time_that_is_not_a_positive_time(call_ms):
    with pytest.raises(ValueError, match="call_ms"):
        profiles.breakdown(kernels(matmul=[1.0]), call_ms=call_ms)


def test_breakdown_names_missing_columns_and_a_table_that_is_not_one():
    with pytest.raises(ValueError, match=r"column\(s\) ms"):
        profiles.breakdown(pd.DataFrame({"kernel": ["nvjet"]}), call_ms=1.0)
    with pytest.raises(TypeError, match="kernels must be a DataFrame"):
        profiles.breakdown(None, call_ms=1.0)


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
    assert point["× floor"] == pytest.approx(1.25), "the call over its floor"
    assert point["matmuls × their floor"] == pytest.approx(1.0), "matmuls at exactly the run's rate read 1×"
    assert point["the rest"] == pytest.approx(0.25 * matmul_ms), "the rest is the call less its matmuls"
    assert "at the run's measured 700 TFLOP/s" in profiles.lines(pd.DataFrame([point])), "the run's rate is not said"


@pytest.mark.parametrize("b", [0, -2, 2.5, True])
def test_a_point_refuses_a_batch_that_is_not_a_positive_integer(b):
    with pytest.raises(ValueError, match="b must be a batch size"):
        profiles.point(dpo_bench.KERNEL_NAME, b, kernels(matmul=[1.0]), call_ms=2.0, meta=META, ceilings=ceilings("abc1234"))


def test_a_point_names_what_its_meta_lacks():
    with pytest.raises(ValueError, match="meta lacks gpu_name"):
        profiles.point(dpo_bench.KERNEL_NAME, 8, kernels(matmul=[1.0]), call_ms=2.0,
                       meta={k: v for k, v in META.items() if k != "gpu_name"}, ceilings=ceilings("abc1234"))


def test_kto_counts_three_products_and_grpo_four():
    kto = {**kto_bench.SPEC.published["sizes"], "B": 8}
    product = 2.0 * 8 * kto["T"] * kto["H"] * kto["V"]
    assert profiles.call_flops(kto_bench.KERNEL_NAME, kto) == pytest.approx(3 * product), \
        "KTO's published call has no dx: policy and reference logits and dW, three products"
    name = grpo_bench.KERNEL_NAMES["token"]
    grpo = {**grpo_bench.SPEC_TOKEN.published["sizes"], "B": 8}
    product = 2.0 * 8 * grpo["T"] * grpo["H"] * grpo["V"]
    assert profiles.call_flops(name, grpo) == pytest.approx(4 * product), "GRPO's call forms dx too: four products"


def test_a_point_never_borrows_another_runs_ceilings():
    for other in (ceilings("another"), ceilings(META["kernels_lib_commit"], gpu="NVIDIA H100 80GB HBM3")):
        point = profiles.point(dpo_bench.KERNEL_NAME, 8, kernels(matmul=[40.0]), call_ms=50.0, meta=META, ceilings=other)
        assert math.isnan(point["floor ms"]) and math.isnan(point["× floor"]), "a floor from another run's ceilings"
    assert "no ceilings measured in its run" in profiles.lines(pd.DataFrame([point]))


def test_preference_profiles_join_times_and_kernels_per_loss_and_b():
    times = pd.DataFrame([{"loss": dpo_bench.KERNEL_NAME, "B": b, "case": case, "ms_p50": ms, **META}
                          for b in (8, 16) for case, ms in (("full", 50.0 * b / 8), ("reference pass", 13.0))])
    listed = pd.DataFrame([{"loss": dpo_bench.KERNEL_NAME, "B": b, "kernel": name, "cuda_ms": ms}
                           for b in (8, 16) for name, ms in (("nvjet_x", 40.0 * b / 8), ("token_logprobs_kernel", 3.0))])
    other = {**META, "gpu_name": "NVIDIA H100 80GB HBM3"}  # a second run: its rows must not join the first's
    times = pd.concat([times, times.assign(**other, ms_p50=times.ms_p50 * 2)], ignore_index=True)
    listed = pd.concat([listed.assign(**META), listed.assign(**other, cuda_ms=listed.cuda_ms * 2)], ignore_index=True)
    table = profiles.preference_profiles(times, listed, ceilings(META["kernels_lib_commit"]))
    assert len(table) == 4, f"one row per run and B, got {len(table)}"
    h200 = table[table.gpu_name == META["gpu_name"]]
    assert list(h200.B) == [8, 16]
    assert list(h200["the rest"]) == pytest.approx([7.0, 17.0]), "kernels of another run joined these times"
    assert list(h200["reference pass ms"]) == [13.0, 13.0]
    assert table[table.gpu_name != META["gpu_name"]]["× floor"].isna().all(), "the H100 run borrowed the H200's ceilings"
    table = h200
    text = profiles.lines(table, {dpo_bench.KERNEL_NAME: "DPO"})
    assert text.count("- **DPO**") == 2 and "on the H200" in text and "matmuls 40.00 ms (80%)" in text, text


def test_kto_profiles_keep_device_rows_and_compare_chunks_with_the_default():
    times = pd.DataFrame([{"B": 8, "chunk_size": c, "ms_50": ms, **META} for c, ms in ((512, 8.0), (1024, 7.2), (2048, 6.8))])
    rows = [{"B": 8, "name": "aten::addmm", "cuda_ms_per_call": 5.0, "cpu_ms_per_call": 0.5},  # an op: its kernels count
            {"B": 8, "name": "nvjet_sm90_tst", "cuda_ms_per_call": 5.0, "cpu_ms_per_call": 0.0},
            {"B": 8, "name": "token_logprobs_kernel", "cuda_ms_per_call": 1.5, "cpu_ms_per_call": 0.0},
            {"B": 8, "name": "cudaLaunchKernel", "cuda_ms_per_call": 0.0, "cpu_ms_per_call": 0.7}]
    table = profiles.kto_profiles(times, pd.DataFrame(rows).assign(**META), ceilings(META["kernels_lib_commit"]))
    row = table.iloc[0]
    assert row["matmuls"] == 5.0, "the op aten::addmm and its kernel were both counted"
    assert row["the rest"] == pytest.approx(1.5), "the rest is the call less its device rows"
    assert row["× at chunk 2048"] == pytest.approx(0.85) and row["chunk"] == 512, "chunks not set against the profiled one"
    sizes = {**kto_bench.SPEC.published["sizes"], "B": 8}
    three_products = 3 * 2.0 * 8 * sizes["T"] * sizes["H"] * sizes["V"]
    assert row["× floor"] == pytest.approx(8.0 / (three_products / 700e9)), "KTO's floor is not its three products' time"
    text = profiles.lines(table)
    assert "B = 8 at 512-row chunks" in text and "0.85× with 2048-row chunks" in text, text
    ratios = profiles.chunk_ratios(times)
    default = profiles.default_chunk("kto_loss", 8)
    assert ratios.loc[("H200", "abc1234", 8), default] == pytest.approx(1.0), "not set against the default chunk"
    assert ratios.loc[("H200", "abc1234", 8), 512] == pytest.approx(8.0 / times.set_index("chunk_size").ms_50[default])


def test_the_committed_profiles_read_and_split_whole_calls():
    for table in (profiles.preference_profiles(), profiles.kto_profiles()):
        assert len(table), "a committed profile in data/measured/gpu_runs/ reads empty"
        share = profiles.shares(table).sum(axis=1)
        assert (share.round(6) == 1.0).all(), f"listed kernels exceed the call's median (rest clipped): {share.tolist()}"
        assert table["gpu_name"].str.startswith("NVIDIA").all()
    assert profiles.lines(pd.DataFrame()) == "No profile measured yet."


def test_small_vocab_steps_take_the_median_over_rounds_per_chart_v_and_provider():
    steps = pd.DataFrame([{"chart": "cross_entropy", "V": v, "round": r, "provider": p, "loss in step ms": ms}
                          for v in (4096, 8192) for r, scale in ((1, 1.0), (2, 3.0), (3, 2.0))
                          for p, ms in (("kernels_lib", 0.2 * scale), ("torch", 0.3 * scale * (v // 4096)))])
    steps = steps.assign(**META)
    table = profiles.small_vocab_steps(pd.concat([steps, steps.assign(gpu_name="NVIDIA H100 80GB HBM3")]))
    assert table.loc[("H200", "abc1234", "cross_entropy", 4096), "kernels_lib"] == pytest.approx(0.4), \
        "not the median of 0.2, 0.6, 0.4"
    assert table.loc[("H200", "abc1234", "cross_entropy", 8192), "torch"] == pytest.approx(1.2)
    assert len(table) == 4, "two runs' rows were combined"
    text = profiles.step_lines(table)
    assert text.count("at 2 of the 2 vocabularies") == 2 and "H200 (kernels_lib abc1234)" in text, text


def test_the_committed_step_profile_reads():
    table = profiles.small_vocab_steps()
    assert len(table) and {"kernels_lib", "torch"} <= set(table.columns), f"columns: {list(table.columns)}"
    assert (table > 0).all().all(), "a loss that adds no time to a step"


# --------------------------------------------------------------------------- the every-loss profile


def loss_profile_rows(commit="abc1234", gpu="NVIDIA H200", stamp="2026-01-01 00:00:00", call_ms=10.0, host_ms=2.0):
    meta = {**META, "gpu_name": gpu, "kernels_lib_commit": commit, "timestamp": stamp}
    times = pd.DataFrame([
        {"loss": "distill_jsd_loss", "x_name": "BT", "x_value": 1024, "ms_p50": call_ms, "host_ms": host_ms, **meta},
        {"loss": "jsd", "x_name": "V", "x_value": 4096, "ms_p50": 0.3, "host_ms": 0.7, **meta},
        {"loss": "jsd", "x_name": "V", "x_value": 8192, "ms_p50": float("nan"), "host_ms": float("nan"), **meta},  # failed
    ])
    kernels = pd.DataFrame([
        {"loss": "distill_jsd_loss", "x_value": 1024, "kernel": "nvjet_a", "cuda_ms": 6.0, **meta},
        {"loss": "distill_jsd_loss", "x_value": 1024, "kernel": "distill_chunk_kernel", "cuda_ms": 2.0, **meta},
        {"loss": "jsd", "x_value": 4096, "kernel": "jsd_kernel", "cuda_ms": 0.1, **meta},
    ])
    return times, kernels


def test_loss_profiles_put_each_loss_on_its_own_axis_with_its_own_run_floor():
    from kernels_workbench.bench import distillation as distill_bench

    times, listed = loss_profile_rows()
    table = profiles.loss_profiles(times, listed, ceilings("abc1234"))
    assert list(table["at"]) == ["BT = 1024", "V = 4096"], "each point named on its chart's axis; the failed point left out"
    distill = table.set_index("at").loc["BT = 1024"]
    flops = distill_bench.flops({"BT": 1024, "H": 4096, "V": 128256}, "full")
    assert distill["matmuls × their floor"] == pytest.approx(6.0 / (flops / 700e9)), "the matmuls against their FLOPs at the run's rate"
    assert distill["the rest"] == pytest.approx(2.0), "the call less every kernel"
    assert distill["host ms"] == 2.0
    jsd = table.set_index("at").loc["V = 4096"]
    assert math.isnan(jsd["matmuls × their floor"]) and jsd["× floor"] > 0, "a loss on logits has a bytes floor and no matmuls"


def test_loss_profiles_keep_each_gpus_newest_run_only():
    old_t, old_k = loss_profile_rows("old0000", stamp="2026-01-01 00:00:00", call_ms=20.0)
    new_t, new_k = loss_profile_rows("new0000", stamp="2026-02-01 00:00:00", call_ms=10.0)
    other_t, other_k = loss_profile_rows("h100000", gpu="NVIDIA H100 80GB HBM3", stamp="2025-12-01 00:00:00")
    table = profiles.loss_profiles(pd.concat([old_t, new_t, other_t]), pd.concat([old_k, new_k, other_k]),
                                   pd.concat([ceilings(c, g) for c, g in (("old0000", "NVIDIA H200"), ("new0000", "NVIDIA H200"),
                                                                        ("h100000", "NVIDIA H100 80GB HBM3"))]))
    assert set(table.kernels_lib_commit) == {"new0000", "h100000"}, "the older H200 run was kept, or the H100's dropped"
    both = profiles.loss_profiles(pd.concat([old_t, new_t]), pd.concat([old_k, new_k]),
                                  pd.concat([ceilings("old0000"), ceilings("new0000")]), newest=False)
    assert len(both) == 4 and set(both.kernels_lib_commit) == {"old0000", "new0000"}
    old = both[both.kernels_lib_commit == "old0000"].set_index("at").loc["BT = 1024"]
    assert old["call ms"] == 20.0 and old["the rest"] == pytest.approx(12.0), "a run's times were joined to another run's kernels"


def test_lines_name_the_axis_and_say_when_the_host_sets_the_pace():
    times, listed = loss_profile_rows(call_ms=10.0, host_ms=12.0)
    times.loc[times.loss == "jsd", "host_ms"] = 0.1
    text = profiles.lines(profiles.loss_profiles(times, listed, ceilings("abc1234")), {"distill_jsd_loss": "distillation JSD"})
    first, second = text.splitlines()
    assert first.startswith("- **distillation JSD**, BT = 1024") and "the host, not the GPU, sets the pace" in first, first
    assert second.startswith("- **jsd**, V = 4096") and "its floor (no matmul)" in second and "sets the pace" not in second, second
    assert "matmuls" not in second.split("(no matmul)")[1], f"a loss without matmuls lists an empty matmul part: {second}"
    assert "matmuls " in first.split("its floor")[1], f"a loss with matmuls lost its matmul part: {first}"


def test_point_on_another_axis_names_it_in_its_refusal():
    with pytest.raises(ValueError, match="b must be a size of BT"):
        profiles.point("distill_jsd_loss", 0, kernels(matmul=[1.0]), call_ms=2.0, meta=META, ceilings=ceilings("abc1234"),
                       x_name="BT")


def test_chunk_trade_sets_each_chunk_against_the_default_of_its_own_run_and_keeps_memory():
    rows = pd.DataFrame([{"loss": "distill_jsd_loss", "x_name": "BT", "B": 1024, "chunk": chunk, "round": r,
                          "full_ms": ms, "full_MiB": mib, **META}
                         for r, scale in ((1, 1.0), (2, 1.1), (3, 5.0))  # round 3 an outlier: the median ignores it
                         for chunk, ms, mib in (("default", 10.0 * scale, 630.0), ("2048", 7.0 * scale, 1006.0))])
    table = profiles.chunk_trade(rows, default_label="lean")
    point = table.loc[("H200", "abc1234", "distill_jsd_loss", "BT", 1024)]
    assert point[("time × lean", "lean")] == 1.0
    assert point[("time × lean", "2048")] == pytest.approx(7.7 / 11.0), "not the median over rounds over the default's median"
    assert point[("MiB", "2048")] == 1006.0 and point[("MiB", "lean")] == 630.0


def test_small_vocab_steps_read_the_divergences_file_with_the_loss_as_its_chart():
    rows = pd.DataFrame([{"loss": "jsd", "V": 4096, "round": r, "provider": p, "loss in step ms": ms, **META}
                         for r in (1, 2, 3) for p, ms in (("kernels_lib", 0.1 * r), ("liger", 0.6))])
    table = profiles.small_vocab_steps(rows)
    assert table.loc[("H200", "abc1234", "jsd", 4096), "kernels_lib"] == pytest.approx(0.2), "the median over rounds"
    text = profiles.step_lines(table, peer="liger")
    assert text.startswith("- `jsd`, H200") and "adds less than liger at 1 of the 1" in text, text


def test_profile_markdown_reads_the_committed_files_of_the_measured_dir(tmp_path, monkeypatch):
    from kernels_workbench import data

    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    assert profiles.profile_markdown({"jsd": "JSD"}).startswith("No kernel profile of these losses measured yet")
    (tmp_path / "gpu_runs").mkdir()
    times, listed = loss_profile_rows()
    times.to_csv(tmp_path / "gpu_runs" / "loss_profile_times.csv", index=False)
    listed.to_csv(tmp_path / "gpu_runs" / "loss_profile_kernels.csv", index=False)
    ceilings("abc1234").assign(kernel_provider="torch", kernel_operation_mode="forward", metric_name="rate",
                               x_value=0).to_csv(tmp_path / "ceilings.csv", index=False)
    text = profiles.profile_markdown({"jsd": "JSD"}, "Intro:\n\n")
    assert text.startswith("Intro:\n\n- **JSD**, V = 4096") and "distill" not in text, text
    assert text.rstrip().endswith("(H200, kernels_lib abc1234, torch 2.11, triton 3.6.)"), text


def test_by_run_names_each_rows_gpu_and_commit_so_two_runs_stay_apart():
    rows = pd.DataFrame({"gpu_name": ["NVIDIA H200", "NVIDIA H100 80GB HBM3"], "kernels_lib_commit": ["bb7b6bd00256", "963cbcd11111"],
                         "B": [2, 2], "chunk_size": [1024, 1024], "ms_50": [2.0, 3.0]})
    table = profiles.by_run(rows).pivot_table(index=["GPU", "commit", "B"], columns="chunk_size", values="ms_50")
    assert len(table) == 2, f"two runs at one B must stay two rows, got {table}"
    assert set(table.index.get_level_values("commit")) == {"bb7b6bd", "963cbcd"}


def test_logits_passes_are_our_kernels_time_in_passes_over_one_heads_logits_at_the_runs_copy_rate():
    sizes = {**dpo_bench.SPEC.published["sizes"], "B": 8}
    buffer = int(sizes["B"]) * int(sizes["T"]) * int(sizes["V"]) * 2  # bf16
    assert profiles.logits_bytes(dpo_bench.KERNEL_NAME, sizes) == buffer
    ours_ms = 3 * buffer / (4000.0 * 1e9) * 1e3  # three passes at 4000 GB/s
    point = profiles.point(dpo_bench.KERNEL_NAME, 8, kernels(matmul=[10.0], ours=[ours_ms]), call_ms=20.0, meta=META,
                           ceilings=ceilings(META["kernels_lib_commit"], copy_gbps=4000.0))
    assert point["logits passes"] == pytest.approx(3.0), "not our kernels' time over one pass at the run's copy rate"
    assert point["logits GiB"] == pytest.approx(buffer / 2**30)
    text = profiles.lines(pd.DataFrame([point]))
    assert "one head's N × V logits" in text and f"({buffer / 2**20:.0f} MiB) 3.0 times" in text, text
    other_run = profiles.point(dpo_bench.KERNEL_NAME, 8, kernels(matmul=[10.0], ours=[ours_ms]), call_ms=20.0, meta=META,
                               ceilings=ceilings("another"))
    assert math.isnan(other_run["logits passes"]), "a copy rate of another run was used"
    assert profiles.logits_bytes("jsd", {"N": 8192, "V": 4096}) is None, "a loss on logits has no chunked logits buffer"
    assert profiles.logits_bytes("distill_jsd_loss", {"BT": 1024, "H": 4096, "V": 1000}) == 1024 * 1000 * 2


# --------------------------------------------------------------------------- the sustained matmul rate


def sustained_rows(commit="abc1234", gpu="NVIDIA H200", stamp="2026-01-01 00:00:00", slow=None):
    """Bursts of a 1024³ product. 5 ms: a slow first launch (3 ms), then 1 ms products. 100 ms: a slow first launch,
    94 products of 1 ms, then 5 of 10 ms, so that the last tenth of the span (10 ms products only) differs from
    the last tenth of the count (half 1 ms, half 10 ms). ``slow`` replaces one product's time (a NaN)."""
    meta = {**META, "gpu_name": gpu, "kernels_lib_commit": commit, "timestamp": stamp}
    rows = []
    for burst, times in ((5.0, [3.0] + [1.0] * 4), (100.0, [3.0] + [1.0] * 94 + [10.0] * 5)):
        start = 0.0
        for i, ms in enumerate(times):
            ms = slow if slow is not None and burst == 100.0 and i == 3 else ms
            rows.append({"shape": "1024^3", "M": 1024, "K": 1024, "N": 1024, "burst_ms": burst, "start_ms": start, "ms": ms,
                         "sm_clock_mhz_before": 1980.0, "sm_clock_mhz_after": 1980.0 if burst < 50 else 1400.0, **meta})
            start += times[i]
    return pd.DataFrame(rows)


def ceiling_rows(commit="abc1234", gpu="NVIDIA H200", tflops=1.5):
    return pd.DataFrame([{"kernel_name": "matmul", "gpu_name": gpu, "kernels_lib_commit": commit, "y_value_50": tflops,
                          "timestamp": "2026-01-01 00:00:00"}])


def test_sustained_rates_leave_out_the_first_launch_and_read_the_last_tenth_of_the_span():
    runs = pd.concat([sustained_rows(), sustained_rows(stamp="2026-01-02 00:00:00"), sustained_rows(commit="def5678")])
    table = profiles.sustained_rates(runs, ceilings=ceiling_rows())
    assert len(table) == 6, f"three runs (two share GPU and commit) of two bursts each, got {len(table)} rows"
    one = 2.0 * 1024**3 / 1e-3 / 1e12  # TFLOP/s of a 1 ms product
    long = table[(table.commit == "abc1234") & (table["burst ms"] == 100.0)].iloc[0]
    assert long["products"] == 100, "the two runs of one commit were merged"
    short = table[(table.commit == "abc1234") & (table["burst ms"] == 5.0)].iloc[0]
    assert short["first tenth TFLOP/s"] == pytest.approx(one), "the slow first launch counted in the first tenth"
    assert long["first tenth TFLOP/s"] == pytest.approx(one)
    assert long["last tenth TFLOP/s"] == pytest.approx(one / 10), "the last tenth is of the burst's span, not its count"
    assert long["last / first"] == pytest.approx(0.1) and long["SM MHz after"] == 1400.0
    assert long["last tenth / ceiling"] == pytest.approx(one / 10 / 1.5), "not over its own run's ceiling"
    other = table[table.commit == "def5678"]
    assert other["ceiling TFLOP/s"].isna().all(), "a run took another run's ceiling"
    text = profiles.sustained_lines(table)
    assert "100 ms burst ends at 0.10× the 5 ms burst's rate" in text and "matmul ceiling (its median) 2 TFLOP/s" in text, text
    assert "no ceiling in that run" in text, text


def test_sustained_rates_give_nan_for_a_nan_time_and_name_missing_columns():
    table = profiles.sustained_rates(sustained_rows(slow=float("nan")), ceilings=ceiling_rows())
    assert math.isnan(table[table["burst ms"] == 100.0]["first tenth TFLOP/s"].iloc[0]), "a NaN time was skipped"
    with pytest.raises(ValueError, match="start_ms"):
        profiles.sustained_rates(sustained_rows().drop(columns=["start_ms"]))
    assert profiles.sustained_lines(pd.DataFrame()) == "No sustained-rate run measured yet."


def test_the_committed_sustained_run_reads():
    table = profiles.sustained_rates()
    assert len(table) and (table["last tenth TFLOP/s"] > 0).all(), table
