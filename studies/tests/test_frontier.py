"""Issue 14's frontier: :func:`analysis.frontier_targets` on synthetic rows of one run, and the
committed frontier run's files through :func:`flce_studies.load_run`."""

from __future__ import annotations

import json

import math

import pandas as pd
import pytest

import kernels_lib  # noqa: F401  (before triton: the interpreter on a CPU)
from studies.bench import analysis, flce_studies
from studies.bench.targets import target_verdicts

DIAL = "kernels_lib[chunk_size=512 accurate=False]"


def _rows(points: dict) -> pd.DataFrame:
    """Measured rows from ``{(provider, mode, N): (ms, MB)}``; ``None`` for ms or MB leaves that row out."""
    rows = []
    for (provider, mode, n), values in points.items():
        for metric, value in zip(("speed", "memory"), values):
            if value is not None:
                rows.append({"kernel_provider": provider, "kernel_operation_mode": mode, "metric_name": metric,
                             "x_value": n, "y_value_50": value, "gpu_name": "NVIDIA H200"})
    return pd.DataFrame(rows)


def _full_run(with_quack: bool = True) -> pd.DataFrame:
    points = {
        # N = 4096: the dial point is the fastest and smallest of all, yet not a peer; Liger the fastest peer
        ("kernels_lib", "full", 4096): (20.0, 1000.0),
        (DIAL, "full", 4096): (10.0, 100.0),
        ("torch", "full", 4096): (30.0, 6000.0),
        ("liger", "full", 4096): (25.0, 2000.0),
        # N = 8192: torch the fastest peer; ours slower than it, with less than 0.6x its memory
        ("kernels_lib", "full", 8192): (44.0, 1000.0),
        (DIAL, "full", 8192): (20.0, 100.0),
        ("torch", "full", 8192): (40.0, 12000.0),
        ("liger", "full", 8192): (50.0, 1100.0),
        ("kernels_lib", "forward_no_grad", 4096): (7.0, 10.0),
        ("kernels_lib", "forward_no_grad", 8192): (15.0, 10.0),
        ("torch", "forward_no_grad", 4096): (9.0, 4000.0),
    }
    if with_quack:
        points.update({
            ("quack", "full", 4096): (26.0, 500.0),
            ("quack", "full", 8192): (41.0, 900.0),
            ("quack", "forward_no_grad", 4096): (8.0, 5.0),
            ("quack", "forward_no_grad", 8192): (14.0, 5.0),
        })
    return _rows(points)


def test_fastest_peer_ratios_and_verdicts():
    table = analysis.frontier_targets(_full_run())
    assert table.index.tolist() == [4096, 8192]
    assert table["fastest peer"].tolist() == ["liger", "torch"]  # never the dial point, though it is faster
    assert table["full ms"].tolist() == [20.0, 44.0]
    assert table["peer full ms"].tolist() == [25.0, 40.0]
    assert table["full / fastest peer"].to_numpy() == pytest.approx([0.8, 1.1])
    assert table["peer memory MB"].tolist() == [2000.0, 12000.0]
    assert table["memory / fastest peer"].to_numpy() == pytest.approx([0.5, 1000 / 12000])
    assert table["QuACK forward_no_grad ms"].tolist() == [8.0, 14.0]
    assert table["forward_no_grad / QuACK"].to_numpy() == pytest.approx([7 / 8, 15 / 14])
    assert table["full ≤ 1.0× fastest peer"].tolist() == [True, False]
    assert table["memory full ≤ 0.6× fastest peer's"].tolist() == [True, True]
    assert table["forward_no_grad ≤ 1.0× QuACK"].tolist() == [True, False]
    verdicts = target_verdicts(table, analysis.FRONTIER_TARGETS)
    assert verdicts.status.tolist() == ["missed", "met", "missed"]
    assert verdicts.loc["full ≤ 1.0× fastest peer", "worst at x"] == 8192


def test_dial_point_as_provider_excludes_the_default_too():
    """Judging a point of the dial: the default ``kernels_lib`` and the other dial points are not peers either."""
    table = analysis.frontier_targets(_full_run(), DIAL)
    assert table["fastest peer"].tolist() == ["liger", "torch"]
    assert table["full / fastest peer"].to_numpy() == pytest.approx([10 / 25, 20 / 40])
    assert table["forward_no_grad ms"].isna().all()  # the dial point's no-grad forward was not measured
    assert table["forward_no_grad ≤ 1.0× QuACK"].isna().all()


def test_missing_quack_leaves_its_verdict_unjudged():
    table = analysis.frontier_targets(_full_run(with_quack=False))
    assert table["QuACK forward_no_grad ms"].isna().all()
    assert table["forward_no_grad / QuACK"].isna().all()
    assert table["forward_no_grad ≤ 1.0× QuACK"].isna().all()
    assert table["fastest peer"].tolist() == ["liger", "torch"]
    verdicts = target_verdicts(table, analysis.FRONTIER_TARGETS)
    assert verdicts.loc["forward_no_grad ≤ 1.0× QuACK", "status"] == "not measured"
    assert verdicts.loc["full ≤ 1.0× fastest peer", "status"] == "missed"


def test_no_peer_or_failed_peer_at_an_n():
    """At an N where no peer has a time (only kernels_lib measured, or the peer's point failed: an empty
    value), there is no fastest peer and no verdict; a peer whose memory is missing leaves only that ratio unknown."""
    rows = _rows({
        ("kernels_lib", "full", 4096): (20.0, 1000.0),
        (DIAL, "full", 4096): (10.0, 100.0),
        ("kernels_lib", "full", 8192): (40.0, 1000.0),
        ("liger", "full", 8192): (50.0, None),
        ("kernels_lib", "full", 16384): (80.0, 1000.0),
        ("liger", "full", 16384): (float("nan"), float("nan")),
    })
    table = analysis.frontier_targets(rows)
    assert table["fastest peer"].tolist()[0] is None and table["fastest peer"].tolist()[2] is None
    assert table.loc[8192, "fastest peer"] == "liger"
    assert math.isnan(table.loc[4096, "full / fastest peer"]) and math.isnan(table.loc[16384, "full / fastest peer"])
    assert table.loc[8192, "full / fastest peer"] == pytest.approx(0.8)
    assert bool(table.loc[8192, "full ≤ 1.0× fastest peer"])
    assert math.isnan(table.loc[8192, "memory / fastest peer"])
    assert table["memory full ≤ 0.6× fastest peer's"].isna().all()
    assert pd.isna(table.loc[4096, "full ≤ 1.0× fastest peer"])


def test_frontier_runs_are_registered():
    for part in ("frontier", "frontier_forward", "frontier_stages"):
        assert flce_studies.RUN_FILES[part] == f"gpu_runs/fused_linear_cross_entropy_{part}.csv"


def test_load_frontier_runs(monkeypatch, tmp_path):
    from kernels_workbench import data

    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    assert flce_studies.load_run("frontier") is None
    (tmp_path / "gpu_runs").mkdir()
    _full_run().to_csv(tmp_path / flce_studies.RUN_FILES["frontier"], index=False)
    pd.DataFrame({"BT": [16], "candidate": ["cuBLAS logits matmul alone"], "ms_50": [1.0]}).to_csv(
        tmp_path / flce_studies.RUN_FILES["frontier_forward"], index=False)
    loaded = flce_studies.load_run("frontier")
    assert analysis.frontier_targets(loaded)["fastest peer"].tolist() == ["liger", "torch"]
    assert flce_studies.load_run("frontier_forward").candidate.tolist() == ["cuBLAS logits matmul alone"]
    assert flce_studies.load_run("frontier_stages") is None


def test_committed_frontier_run_names_a_peer_at_each_published_n():
    rows = flce_studies.load_run("frontier")
    if rows is None or not (rows.gpu_name == "NVIDIA H200").any():
        pytest.skip("the frontier has not been measured on the H200")
    table = analysis.frontier_targets(rows[rows.gpu_name == "NVIDIA H200"])
    assert table.index.tolist() == [4096, 8192, 16384]
    assert table["fastest peer"].notna().all()
    assert not table["fastest peer"].str.startswith("kernels_lib").any()
    assert (table["full ms"] > 0).all() and (table["memory MB"] > 0).all()


def test_later_default_against_the_frontier_run():
    def row(provider, mode, n, ms):
        return {"kernel_provider": provider, "kernel_operation_mode": mode, "metric_name": "speed", "x_value": n, "y_value_50": ms}

    frontier = pd.DataFrame([row("quack", "full", 4096, 19.0), row("torch", "full", 4096, 24.0),
                             row("kernels_lib", "full", 4096, 21.0), row("torch", "forward_no_grad", 4096, 9.0)])
    later = pd.DataFrame([row("kernels_lib", "full", 4096, 20.0), row("torch", "full", 4096, 24.6),
                          row("kernels_lib", "forward_no_grad", 4096, 6.4), row("torch", "forward_no_grad", 4096, 9.0)])
    table = analysis.later_default_against(frontier, later)
    assert table.loc[("full", 4096), "kernels_lib / quack"] == pytest.approx(20.0 / 19.0)
    assert table.loc[("full", 4096), "torch drift"] == pytest.approx(24.6 / 24.0)
    # QuACK's forward_no_grad missing from the frontier run: NaN, not an error
    assert pd.isna(table.loc[("forward_no_grad", 4096), "kernels_lib / quack"])
    assert table.loc[("forward_no_grad", 4096), "torch drift"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- issue 30: past the floor


def test_the_measured_floor_is_no_peer():
    """The three matmuls are faster than every loss; the fastest peer is still the fastest loss."""
    rows = pd.concat([_full_run(), _rows({(analysis.FLOOR, "full", 4096): (5.0, 9000.0),
                                          (analysis.FLOOR, "full", 8192): (9.0, 9000.0)})], ignore_index=True)
    table = analysis.frontier_targets(rows)
    assert list(table["fastest peer"]) == ["liger", "torch"]


def _past_floor_run(**extra) -> pd.DataFrame:
    points = {
        ("kernels_lib", "full", 4096): (18.0, 1100.0), ("kernels_lib", "forward_no_grad", 4096): (6.0, 10.0),
        (analysis.FLOOR, "full", 4096): (20.0, 5000.0),
        ("quack", "full", 4096): (19.0, 2000.0), ("quack", "forward_no_grad", 4096): (6.5, 10.0),
        ("torch_lce", "full", 4096): (100.0, 2000.0),
        ("kernels_lib", "full", 8192): (37.0, 2200.0), ("kernels_lib", "forward_no_grad", 8192): (12.0, 10.0),
        (analysis.FLOOR, "full", 8192): (37.0, 9000.0),
        ("quack", "full", 8192): (38.0, 3000.0), ("quack", "forward_no_grad", 8192): (12.4, 10.0),
        ("torch_lce", "full", 8192): (40.0, 2100.0),
        ("liger_sm90", "full", 8192): (39.5, 3100.0),
        **extra,
    }
    return _rows(points).assign(kernels_lib_commit="abc1234", timestamp="2026-12-02 19:00")


def test_past_floor_ratios_and_verdicts():
    table = analysis.past_floor_targets(_past_floor_run())
    assert table.loc[4096, "full / three matmuls"] == pytest.approx(0.9)
    assert table.loc[8192, "full / three matmuls"] == pytest.approx(1.0)
    assert table.loc[4096, "full / QuACK"] == pytest.approx(18 / 19)
    assert table.loc[8192, "memory / QuACK"] == pytest.approx(2200 / 3000)
    assert table.loc[4096, "forward_no_grad / QuACK"] == pytest.approx(6 / 6.5)
    assert table.loc[4096, "full / torch LCE"] == pytest.approx(0.18)
    assert table.loc[8192, "memory / torch LCE"] == pytest.approx(2200 / 2100)
    # Liger's CuTe kernel beside, without a target; CCE not in this run
    assert table.loc[8192, "full / Liger CuTe"] == pytest.approx(37 / 39.5)
    assert table.loc[8192, "memory / Liger CuTe"] == pytest.approx(2200 / 3100)
    assert pd.isna(table.loc[4096, "full / Liger CuTe"]) and table["full / CCE"].isna().all()
    verdicts = target_verdicts(table, analysis.PAST_FLOOR_TARGETS)
    assert verdicts.loc["full ≤ 0.92× three matmuls", "status"] == "missed"  # 1.0 at N = 8192
    assert verdicts.loc["full ≤ 0.92× three matmuls", "worst at x"] == 8192
    assert verdicts.loc["full ≤ 0.95× QuACK", "status"] == "missed"  # 18/19 = 0.947 met, 37/38 = 0.974 not
    assert verdicts.loc["memory full ≤ 0.6× QuACK's", "status"] == "missed"
    assert verdicts.loc["full ≤ 0.8× torch LCE", "status"] == "missed"  # 37/40 at N = 8192
    assert verdicts.loc["memory full ≤ torch LCE's", "status"] == "missed"
    # torch's accurate policy was not in this run: not measured, never borrowed from another run
    assert verdicts.loc["full ≤ 0.8× torch LCE (accurate)", "status"] == "not measured"


def test_past_floor_rates_set_the_floor_beside_the_square_product_of_the_run():
    """The three matmuls' rate is their FLOPs over the floor's time; 0.92× of that time needs rate / 0.92; both over
    the run's own 8192³ rate; NaN where the run did not measure it."""
    rows = _past_floor_run()
    config = {"H": 4096, "V": 128256, "dtype": "torch.bfloat16"}
    rows = rows.assign(extra_benchmark_config_str=json.dumps(config), matmul_tflops=700.0)
    rates = analysis.past_floor_rates(rows)
    flops = 6 * 4096 * 4096 * 128256
    assert rates.loc[4096, "three matmuls TFLOP/s"] == pytest.approx(flops / 20e-3 / 1e12)
    assert rates.loc[8192, "0.92× needs TFLOP/s"] == pytest.approx(2 * flops / 37e-3 / 1e12 / 0.92)
    assert rates.loc[8192, "0.92× needs / square"] == pytest.approx(2 * flops / 37e-3 / 1e12 / 0.92 / 700.0)
    assert list(rates.index) == [4096, 8192]
    assert analysis.past_floor_rates(rows.drop(columns="matmul_tflops"))["three matmuls / square"].isna().all()
    assert analysis.past_floor_rates(rows[rows.kernel_provider != analysis.FLOOR]).empty  # a run without its floor
    with pytest.raises(ValueError, match="abc1234.*def5678|def5678.*abc1234"):
        analysis.past_floor_rates(pd.concat([rows, rows.assign(kernels_lib_commit="def5678")], ignore_index=True))


def test_past_floor_refuses_rows_of_two_runs():
    rows = pd.concat([_past_floor_run(), _past_floor_run().assign(kernels_lib_commit="def5678")], ignore_index=True)
    with pytest.raises(ValueError, match="abc1234.*def5678|def5678.*abc1234"):
        analysis.past_floor_targets(rows)


def _gluon_rows(commit: str = "abc1234") -> pd.DataFrame:
    """A Gluon A/B run as ``scripts/flce_frontier.py --parts gluon`` writes it: two sizes, the three arms,
    one more Gluon variant (faster at BT = 8192 only) and one that failed to compile (no time)."""
    arms = {flce_studies.GLUON_AB_CUBLAS: (6.0, 12.0), flce_studies.GLUON_AB_TL: (6.3, 12.9),
            flce_studies.GLUON_AB_GLUON: (7.0, 15.0), "logits_logsumexp {'GLUON': True, 'num_stages': 2}": (7.7, 14.0),
            "logits_logsumexp {'GLUON': True, 'num_stages': 4}": (math.nan, math.nan)}
    rows = []
    for name, times in arms.items():
        for bt, ms in zip((4096, 8192), times):
            rows.append({"BT": bt, "candidate": name, "ms_50": ms, "lse_rel_err": math.nan if "cuBLAS" in name else 3e-7,
                         "error": "OutOfResources: shared memory" if math.isnan(ms) else math.nan,
                         "kernels_lib_commit": commit, "gpu_name": "NVIDIA H200", "timestamp": "2026-12-03 09:00:41"})
    return pd.DataFrame(rows)


def test_gluon_ab_table_ratios_and_best_variant():
    table = flce_studies.gluon_ab_table(_gluon_rows())
    assert table.loc[4096, "gluon / tl"] == pytest.approx(7.0 / 6.3)
    assert table.loc[8192, "gluon / cuBLAS"] == pytest.approx(15.0 / 12.0)
    assert table.loc[8192, "tl / cuBLAS"] == pytest.approx(12.9 / 12.0)
    # the fastest Gluon variant that ran: the default at 4096, num_stages=2 at 8192; the failed one never
    assert table.loc[4096, "best gluon variant"] == "{'GLUON': True}"
    assert table.loc[8192, "best gluon variant"] == "{'GLUON': True, 'num_stages': 2}"
    assert table.loc[8192, "best gluon / tl"] == pytest.approx(14.0 / 12.9)


def test_gluon_ab_table_refuses_rows_of_two_runs():
    rows = pd.concat([_gluon_rows("abc1234"), _gluon_rows("def5678")], ignore_index=True)
    with pytest.raises(ValueError, match="abc1234.*def5678|def5678.*abc1234"):
        flce_studies.gluon_ab_table(rows)


def test_committed_gluon_run_is_checked_and_one_run():
    """The committed H200 run: every arm at each N, the Gluon stage's error no larger than the tl.* stage's
    beyond float32 rounding (both against the same float32 logits)."""
    run = flce_studies.load_run("gluon")
    if run is None:
        pytest.fail("data/measured/gpu_runs/fused_linear_cross_entropy_gluon_ab.csv is missing")
    table = flce_studies.gluon_ab_table(run)
    assert list(table.index) == [4096, 8192, 16384]
    assert table[["cuBLAS ms", "tl ms", "gluon ms"]].notna().all().all()
    assert (table["gluon lse err"] <= 2 * table["tl lse err"] + 1e-7).all()
