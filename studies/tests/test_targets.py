"""The studies' targets (:mod:`studies.bench.targets`): each table's ratios and per-x flags on synthetic rows of
one run and on the committed KL run, the verdicts (met, missed, not measured; lower and upper bounds), rows of
two runs refused, and the verdicts of each run apart."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from kernels_workbench import data
from kernels_workbench.bench.analysis import ceiling, medians
from studies.bench import targets
from synthetic_rows import FLCE_SYNTHETIC, H200, committed_kl_run, kl_rows, two_runs

# -------------------------------------------------------------------------- rows of one or two runs


@pytest.mark.parametrize("judge", [
    lambda rows: targets.row_divergence_targets(rows, "kl_div", 4000.0),
    lambda rows: targets.kl_div_targets(rows, 4000.0),
])
def test_a_judge_of_targets_refuses_rows_of_two_runs(judge):
    rows = two_runs()
    with pytest.raises(ValueError, match="one run"):
        judge(rows)
    with pytest.raises(ValueError, match="one run"):  # the same commit on two GPUs is two runs too
        judge(pd.concat([kl_rows("kernels_lib", 1.0, 1.0, "c"), kl_rows("liger", 2.0, 2.0, "c", gpu="NVIDIA H100")]))
    judge(data.one_run(rows))  # one run: judged


def test_the_newest_run_has_no_peer_to_borrow():
    """Liger was measured in the old run only: the new run's ratio to Liger is not measured, not the old one's."""
    newest = data.one_run(two_runs())
    assert set(newest.kernels_lib_commit) == {"new"}
    table = targets.row_divergence_targets(newest, "kl_div", 4000.0)
    assert table["full / Liger"].isna().all() and table["full ≤ 0.6× Liger"].isna().all()
    verdicts = targets.target_verdicts(table, targets.DIVERGENCE_TARGETS)
    assert verdicts.loc["full ≤ 0.6× Liger", "status"] == "not measured"
    old = targets.row_divergence_targets(data.one_run(two_runs(), "old", H200), "kl_div", 4000.0)
    assert old["full / Liger"].tolist() == [0.5, 0.5]


def test_verdicts_by_run_judges_each_commit_and_gpu_apart():
    rows = pd.concat([kl_rows("kernels_lib", 1.0, 1.0, "c"), kl_rows("huggingface", 2.0, 2.0, "c"), kl_rows("liger", 2.0, 2.0, "c"),
                      kl_rows("kernels_lib", 3.0, 1.0, "c", gpu="NVIDIA H100"), kl_rows("huggingface", 2.0, 2.0, "c", gpu="NVIDIA H100"),
                      kl_rows("liger", 2.0, 2.0, "c", gpu="NVIDIA H100")])
    table = targets.verdicts_by_run(rows, targets.ORPO_TARGETS)
    assert len(table) == 2 * len(targets.ORPO_TARGETS)
    statuses = table[table.target == "full ≤ 0.8× Liger"].status.tolist()
    assert sorted(statuses) == ["met", "missed"]  # 0.5 on one GPU, 1.5 on the other: never their mean


# --------------------------------------------------------------------------- row divergences


def test_row_divergence_targets_and_lower_bounds():
    """Synthetic rows of one run: the ratios, the bandwidth fraction and the verdicts (a lower bound for the bandwidth)."""
    copy = 4000.0
    rows = []
    for v, share, liger_ratio in ((64, 0.95, 0.5), (128, 0.85, 0.7)):
        ours = 12 * 8 * v / (copy * 1e9) * 1e3 / share  # ms at `share` of the copy bandwidth
        for provider, ms, mb in (("kernels_lib", ours, 1.0), ("liger", ours / liger_ratio, 2.0)):
            for mode in ("forward", "full"):
                for metric, value in (("speed", ms), ("memory", mb)):
                    rows.append({"kernel_provider": provider, "kernel_operation_mode": mode, "metric_name": metric, "x_value": v,
                                 "y_value_50": value, "extra_benchmark_config_str": json.dumps({"N": 8, "V": v, "dtype": "torch.float32"})})
    table = targets.row_divergence_targets(pd.DataFrame(rows), "tvd", copy)
    assert table["forward / copy"].to_numpy() == pytest.approx([0.95, 0.85])
    assert table["full / Liger"].to_numpy() == pytest.approx([0.5, 0.7])
    assert table["memory / Liger"].to_numpy() == pytest.approx([0.5, 0.5])
    assert table["forward_no_grad GB/s"].isna().all()  # not measured
    assert table["forward ≥ 0.9× copy bandwidth"].tolist() == [True, False]
    assert table["full ≤ 0.6× Liger"].tolist() == [True, False]
    verdicts = targets.target_verdicts(table, targets.DIVERGENCE_TARGETS)
    bandwidth = verdicts.loc["forward ≥ 0.9× copy bandwidth"]
    assert bandwidth.status == "missed" and bandwidth["worst at x"] == 128
    assert bandwidth["worst ratio"] == pytest.approx(0.85) and bandwidth["best ratio"] == pytest.approx(0.95)
    assert verdicts.loc["full ≤ 0.6× Liger", "worst ratio"] == pytest.approx(0.7)
    unjudged = targets.row_divergence_targets(pd.DataFrame(rows).query("kernel_provider != 'liger'"), "tvd", copy)
    assert targets.target_verdicts(unjudged, targets.DIVERGENCE_TARGETS).loc["full ≤ 0.6× Liger", "status"] == "not measured"


@pytest.fixture(scope="module")
def committed():
    return committed_kl_run()


def test_kl_div_targets(committed):
    rows, ceilings = committed
    copy = ceiling(ceilings, "copy", "NVIDIA H200")
    table = targets.kl_div_targets(rows, copy)
    assert list(table.index) == [4096, 8192, 16384, 32768, 65536, 131072]
    for column in ("forward GB/s", "forward / copy", "forward_no_grad GB/s", "full ms", "Liger full ms",
                   "full / Liger", "memory / Liger", "bandwidth ≥ 0.9", "full ≤ 0.6× Liger", "memory ≤ Liger"):
        assert column in table.columns, column
    speed_full = medians(rows, "speed", "full")
    memory_full = medians(rows, "memory", "full")
    x = 131072
    assert table.loc[x, "full / Liger"] == pytest.approx(speed_full.loc[x, "kernels_lib"] / speed_full.loc[x, "liger"])
    assert table.loc[x, "memory / Liger"] == pytest.approx(memory_full.loc[x, "kernels_lib"] / memory_full.loc[x, "liger"])
    assert table.loc[x, "forward / copy"] == pytest.approx(table.loc[x, "forward GB/s"] / copy)
    assert (table["bandwidth ≥ 0.9"] == (table["forward / copy"] >= 0.9)).all()
    assert (table["full ≤ 0.6× Liger"] == (table["full / Liger"] <= 0.6)).all()
    assert (table["memory ≤ Liger"] == (table["memory / Liger"] <= 1.0)).all()


# --------------------------------------------------------------------------- fused linear cross-entropy


FLCE_ROWS = FLCE_SYNTHETIC


def test_achieved_tflops():
    tflops = targets.achieved_tflops(FLCE_ROWS, "kernels_lib", "full")
    assert list(tflops.index) == [4096, 8192]
    assert tflops.loc[8192] == pytest.approx(3 * 2 * 8192 * 4096 * 128256 / 44e-3 / 1e12)
    assert targets.achieved_tflops(FLCE_ROWS, "nobody", "full").empty


def test_flce_targets_ratios_and_flags():
    table = targets.fused_linear_cross_entropy_targets(FLCE_ROWS, matmul_tflops=680.0)
    assert list(table.index) == [4096, 8192]
    assert table.loc[8192, "full / torch"] == pytest.approx(44.0 / 49.1)
    assert table.loc[8192, "full / Liger"] == pytest.approx(44.0 / 55.3)
    assert table.loc[4096, "full / CCE"] == pytest.approx(20.0 / 48.4)
    assert table.loc[8192, "forward_no_grad / CCE"] == pytest.approx(14.0 / 16.7)
    assert table.loc[4096, "forward_no_grad / torch"] == pytest.approx(7.0 / 9.33)
    assert table.loc[8192, "memory / Liger"] == pytest.approx(1300.0 / 1129.0)
    assert table.loc[8192, "full / matmul ceiling"] == pytest.approx(table.loc[8192, "full TFLOP/s"] / 680.0)
    assert bool(table.loc[4096, "full ≤ 0.85× torch"]) and not bool(table.loc[8192, "full ≤ 0.85× torch"])
    assert bool(table.loc[4096, "memory full ≤ 1.1× Liger"]) and not bool(table.loc[8192, "memory full ≤ 1.1× Liger"])
    assert table["full ≤ 0.6× Liger"].tolist() == [True, False]  # 20/46.1, 44/55.3
    assert table["forward_no_grad ≤ 1.0× CCE"].all()


def test_target_verdicts_and_missing_peer():
    without_cce = FLCE_ROWS[FLCE_ROWS.kernel_provider != "cce"]
    table = targets.fused_linear_cross_entropy_targets(without_cce, matmul_tflops=680.0)
    assert table["full / CCE"].isna().all() and table["full ≤ 0.5× CCE"].isna().all()
    verdicts = targets.target_verdicts(table)
    assert list(verdicts.index) == list(targets.FLCE_TARGETS)
    assert verdicts.loc["full ≤ 0.5× CCE", "status"] == "not measured"
    assert verdicts.loc["full ≤ 0.85× torch", "status"] == "missed"
    assert verdicts.loc["full ≤ 0.85× torch", "worst at x"] == 8192
    assert verdicts.loc["full ≤ 0.85× torch", "worst ratio"] == pytest.approx(44.0 / 49.1)
    assert verdicts.loc["forward_no_grad ≤ 0.8× torch", "status"] == "met"


# --------------------------------------------------------------------------- the preference losses


def synthetic_rows(ours_full=10.0, ours_forward=4.0, liger_full=14.0, liger_ok=True):
    """Rows of one GPU at B = 2, 4 for the three providers: ours scale with B, the peers fixed."""
    rows = []

    def add(provider, mode, metric, b, value):
        rows.append({"kernel_provider": provider, "kernel_operation_mode": mode, "metric_name": metric,
                     "x_value": b, "y_value_50": value})

    for b in (2, 4):
        scale = b / 2
        add("kernels_lib", "forward", "speed", b, ours_forward * scale)
        add("kernels_lib", "full", "speed", b, ours_full * scale)
        add("kernels_lib", "full", "memory", b, 800.0)
        add("huggingface", "forward", "speed", b, 5.0)
        add("huggingface", "full", "speed", b, 12.0)
        add("huggingface", "full", "memory", b, 6000.0)
        add("liger", "forward", "speed", b, liger_full if liger_ok else math.nan)
        add("liger", "full", "speed", b, liger_full if liger_ok else math.nan)
        add("liger", "full", "memory", b, 1000.0 if liger_ok else math.nan)
    return pd.DataFrame(rows)


def test_orpo_targets_and_verdicts():
    table = targets.orpo_targets(synthetic_rows())
    assert table.loc[2, "full / huggingface"] == pytest.approx(10 / 12) and table.loc[4, "full / Liger"] == pytest.approx(20 / 14)
    assert table.loc[2, "memory / Liger"] == pytest.approx(0.8)
    assert table.loc[2, "full ≤ 0.85× huggingface"] and not table.loc[4, "full ≤ 0.85× huggingface"]
    verdicts = targets.target_verdicts(table, targets.ORPO_TARGETS)
    assert list(verdicts.index) == list(targets.ORPO_TARGETS)
    assert verdicts.loc["full ≤ 0.85× huggingface", "status"] == "missed"
    assert verdicts.loc["full ≤ 0.85× huggingface", "worst at x"] == 4
    assert verdicts.loc["memory full ≤ Liger", "status"] == "met"


def test_kto_targets_with_liger_failed():
    table = targets.kto_targets(synthetic_rows(ours_full=3.0, ours_forward=2.0, liger_ok=False))
    assert table["full / Liger"].isna().all() and table["full ≤ 0.6× Liger"].isna().all()
    assert table.loc[2, "forward / huggingface"] == pytest.approx(0.4)
    verdicts = targets.target_verdicts(table, targets.KTO_TARGETS)
    assert verdicts.status.to_dict() == {
        "full ≤ 0.6× Liger": "not measured", "forward ≤ 0.9× huggingface": "met", "memory full ≤ Liger": "not measured"
    }


def test_verdicts_by_run_judges_each_run_apart():
    """Two runs (commits): the first meets ORPO's full ≤ 0.85× huggingface at every B, the second
    misses it at B = 4; each run is judged on its own rows, oldest first."""
    good = synthetic_rows(ours_full=4.0).assign(kernels_lib_commit="aaa", gpu_name="NVIDIA H200", timestamp="2026-11-29 10:00:00")
    bad = synthetic_rows(ours_full=10.0).assign(kernels_lib_commit="bbb", gpu_name="NVIDIA H200", timestamp="2026-11-29 11:00:00")
    table = targets.verdicts_by_run(pd.concat([bad, good]), targets.ORPO_TARGETS)
    assert list(table.commit.unique()) == ["aaa", "bbb"] and len(table) == 2 * len(targets.ORPO_TARGETS)
    status = table.set_index(["commit", "target"]).status
    assert status["aaa", "full ≤ 0.85× huggingface"] == "met" and status["bbb", "full ≤ 0.85× huggingface"] == "missed"
    worst = table.set_index(["commit", "target"])["worst ratio"]
    assert worst["bbb", "full ≤ 0.85× huggingface"] == pytest.approx(20 / 12)
    assert targets.verdicts_by_run(good.iloc[:0], targets.ORPO_TARGETS).empty
