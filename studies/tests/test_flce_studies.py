"""The fused cross-entropy's studies (studies.bench.flce_studies, studies.flce_frontier,
studies.flce_dial_precision_stages): their readings of recorded runs, and every part of the scripts at CPU
size (peers named where they cannot run here, kernels_lib's default and the arms measured, tables with
their provenance)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

import kernels_lib
from kernels_lib import default_device, reference
from kernels_workbench.bench import fused_linear_cross_entropy as flce
from kernels_workbench.bench.sweep import MEASURED_COLUMNS, available_providers
from studies.bench import analysis as study_analysis
from studies.bench import flce_studies
from test_bench_flce import _torch_lce_loads

DEVICE = default_device()
LIBRARY_ROUTE = importlib.import_module("kernels_lib.fused_linear_cross_entropy")._class_major_route_takes


@pytest.mark.parametrize("full_ms, target_ms, share", [(75.0, 37.5, 0.75), (60.0, 40.0, 0.5), (30.0, 40.0, 0.0), (30.0, 5.0, 1.0)])
def test_deferred_share_needed(full_ms, target_ms, share):
    """Forward at f·G + (1 - f)·3G with G = full/3 meets the target exactly at the share returned (or is
    already under it at 0, or cannot reach it at 1); the kept logits are that share of N·V elements."""
    need = flce_studies.deferred_share_needed(full_ms, target_ms, n_rows=16384, vocab=128256, itemsize=2)
    assert need["share"] == pytest.approx(share)
    assert need["bytes"] == pytest.approx(share * 16384 * 128256 * 2)
    g = full_ms / 3
    forward = need["share"] * g + (1 - need["share"]) * 3 * g
    assert forward == pytest.approx(target_ms) or (share == 0 and forward < target_ms) or (share == 1 and forward > target_ms)


def test_load_run_absent_is_none(monkeypatch, tmp_path):
    monkeypatch.setattr("kernels_workbench.data.MEASURED_DIR", tmp_path)
    assert flce_studies.load_run("dial") is None
    (tmp_path / "gpu_runs").mkdir()
    pd.DataFrame({"a": [1]}).to_csv(tmp_path / flce_studies.RUN_FILES["dial"], index=False)
    assert flce_studies.load_run("dial").a.tolist() == [1]


def test_load_run_gives_the_newest_of_several_runs(monkeypatch, tmp_path):
    monkeypatch.setattr("kernels_workbench.data.MEASURED_DIR", tmp_path)
    (tmp_path / "gpu_runs").mkdir()
    runs = pd.DataFrame({"a": [1, 2, 3, 4], "kernels_lib_commit": ["old", "old", "new", "new"],
                         "timestamp": ["2026-11-30 19:00:00", "2026-11-30 19:05:00",
                                       "2026-12-01 00:20:00", "2026-12-01 00:25:00"]})
    runs.iloc[[2, 3, 0, 1]].to_csv(tmp_path / flce_studies.RUN_FILES["frontier"], index=False)  # order in the file is no clue
    assert sorted(flce_studies.load_run("frontier").a.tolist()) == [3, 4]


def test_load_runs_keeps_every_run_and_filters_the_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr("kernels_workbench.data.MEASURED_DIR", tmp_path)
    assert flce_studies.load_runs("timeline") is None
    (tmp_path / "gpu_runs").mkdir()
    pd.DataFrame({"a": [1, 2, 3], "kernels_lib_commit": ["old", "new", "new"], "gpu_name": ["H200", "H200", "A100"]}).to_csv(
        tmp_path / flce_studies.RUN_FILES["timeline"], index=False)
    assert flce_studies.load_runs("timeline").a.tolist() == [1, 2, 3]
    assert flce_studies.load_runs("timeline", "H200").a.tolist() == [1, 2]


def test_profile_kernels_sums_device_kernels_per_provider_and_n():
    """Kernels are the rows without CPU time; the torch ops and autograd rows that launch them are not
    counted twice; rows of runs before the provider column are kernels_lib's; a skipped provider has no row."""
    profile = pd.DataFrame({
        "name": ["_FusedLinearCrossEntropyFunction", "aten::mm", "gemm", "mm kernel", "merge", "gemm", "quack skipped: no CUDA"],
        "calls per step": [1, 2, 1, 2, 1, 1, float("nan")],
        "device ms per step": [9.0, 4.0, 5.0, 4.0, 0.25, 6.0, float("nan")],
        "cpu ms per step": [2.0, 0.3, 0.0, 0.0, 0.0, 0.0, float("nan")],
        "kernel_provider": ["kernels_lib"] * 5 + [None, "quack"],
        "BT": [4096] * 5 + [8192, 4096],
    })
    table = flce_studies.profile_kernels(profile, top=2).set_index(["kernel_provider", "N"])
    assert list(table.index) == [("kernels_lib", 4096), ("kernels_lib", 8192)]
    assert table.loc[("kernels_lib", 4096), "kernels ms per step"] == 9.25
    assert table.loc[("kernels_lib", 4096), "kernels"] == 3
    # "gemm" and "mm kernel"... only names of GEMM kernels count as GEMMs: "mm kernel" and "merge" are the rest
    assert table.loc[("kernels_lib", 4096), "GEMM ms per step"] == 5.0
    assert table.loc[("kernels_lib", 4096), "other ms per step"] == 4.25
    assert table.loc[("kernels_lib", 4096), "longest"] == "gemm 5.00; mm kernel 4.00"
    assert table.loc[("kernels_lib", 8192), "kernels ms per step"] == 6.0
    without_column = flce_studies.profile_kernels(profile.drop(columns="kernel_provider").iloc[:5])
    assert without_column.kernel_provider.tolist() == ["kernels_lib"]


def _round_rows(provider, n, round_, mb, commit="abc1234", mode="full", metric="memory"):
    return {"kernel_provider": provider, "x_value": n, "round": round_, "y_value_50": mb, "metric_name": metric,
            "kernel_operation_mode": mode, "kernels_lib_commit": commit, "gpu_name": "NVIDIA H200", "timestamp": "2026-12-04"}


def test_memory_by_round_shows_a_first_round_peak():
    """QuACK's round 1 held 10180 MB at N = 4096 and rounds 2 and 3 2036 (0f2fe95 on the H200)."""
    rows = pd.DataFrame([_round_rows("quack", 4096, 1, 10180.0), _round_rows("quack", 4096, 2, 2036.0),
                         _round_rows("quack", 4096, 3, 2036.0), _round_rows("kernels_lib", 4096, 1, 1164.0),
                         _round_rows("kernels_lib", 4096, 2, 1164.0), _round_rows("kernels_lib", 4096, 3, 1164.0),
                         _round_rows("quack", 4096, 1, 7.0, metric="speed"), _round_rows("quack", 4096, 1, 1.0, mode="forward")])
    table = flce_studies.memory_by_round(rows)
    assert list(table.columns) == ["round 1", "round 2", "round 3", "first round over the rest"]
    assert table.loc[("quack", 4096), "first round over the rest"] == pytest.approx(10180 / 2036)
    assert table.loc[("kernels_lib", 4096), "first round over the rest"] == 1.0
    assert table.loc[("quack", 4096), "round 1"] == 10180.0  # the speed and forward rows are not memory of full
    with pytest.raises(ValueError):
        flce_studies.memory_by_round(pd.concat([rows, pd.DataFrame([_round_rows("quack", 8192, 1, 1.0, commit="def5678")])]))


def test_dial_sweep_names_each_point():
    rows = flce_studies.dial_sweep({"BT": 8, "H": 16, "V": 67}, chunk_sizes=[2, 8], dtype=torch.bfloat16, device=DEVICE)
    speed = rows[rows.metric_name == "speed"]
    assert set(zip(speed.kernel_provider, speed.kernel_operation_mode)) == {
        ("kernels_lib[chunk_size=2 accurate=True]", "forward_no_grad"),
        ("kernels_lib[chunk_size=2 accurate=True]", "full"),
        ("kernels_lib[chunk_size=2 accurate=False]", "full"),
        ("kernels_lib[chunk_size=8 accurate=True]", "forward_no_grad"),
        ("kernels_lib[chunk_size=8 accurate=True]", "full"),
        ("kernels_lib[chunk_size=8 accurate=False]", "full"),
    }
    for _, row in speed.iterrows():
        config = json.loads(row.extra_benchmark_config_str)
        assert row.kernel_provider == flce.variant_name({"chunk_size": config["chunk_size"], "accurate": config["accurate"]})


def test_gradient_errors_bf16_accumulation_grows_with_chunks():
    providers = {
        "kernels_lib": kernels_lib.fused_linear_cross_entropy,
        "lean, 16 chunks": flce.kernels_lib_variant(chunk_size=4, accurate=False).load(),
        "accurate, 16 chunks": flce.kernels_lib_variant(chunk_size=4, accurate=True).load(),
        "torch": reference.fused_linear_cross_entropy,
    }
    table = flce_studies.gradient_errors({"N": 64, "H": 32, "V": 257}, torch.bfloat16, DEVICE, providers).set_index("provider")
    assert list(table.columns) == ["shape", "dtype", "loss err", "dx err", "dW err"]
    assert (table[["loss err", "dx err", "dW err"]] < 2e-2).all().all()
    # float32 accumulation rounds dW once: as accurate as the baseline's single product (in the
    # interpreter, float32 matmuls; on CUDA the stored exponentials' row factors round the N × H operand
    # once more, kernels_lib.kernels.shifted_exponentials: within 1.5x); bf16 accumulation over 16 chunks
    # rounds 16 times.
    factor = 1.05 if kernels_lib.INTERPRETED else 1.5
    assert table.loc["accurate, 16 chunks", "dW err"] <= factor * table.loc["torch", "dW err"]
    assert table.loc["lean, 16 chunks", "dW err"] > 1.3 * table.loc["accurate, 16 chunks", "dW err"]


def test_stage_times_cover_the_pipeline():
    table = flce_studies.stage_times({"BT": 10, "H": 16, "V": 67}, torch.bfloat16, DEVICE, chunk_size=4, accurate=False)
    assert list(table.stage) == ["logits x_c Wᵀ", "kernel: lse, loss, dz", "dx_c = dz W", "dW += dzᵀ x_c"]
    assert (table.chunks == 3).all()
    assert (table["ms"] == table["ms per chunk"] * 3).all() and (table["ms"] > 0).all()
    assert table.attrs["chunk_size"] == 4 and table.attrs["accurate"] is False
    epilogue = flce_studies.stage_times({"BT": 10, "H": 16, "V": 67}, torch.bfloat16, DEVICE, chunk_size=4,
                                        accurate=False, epilogue=True)
    assert list(epilogue.stage) == ["logits and lse: Triton GEMM, lse in its epilogue", "kernel: dz (lse given)",
                                    "dx_c = dz W", "dW += dzᵀ x_c"]
    assert epilogue.attrs["epilogue"] is True and (epilogue["ms"] > 0).all()


def test_h200_script_cpu_paths(tmp_path):
    script = importlib.import_module("studies.flce_dial_precision_stages")
    assert script.SIZES["full"]["chunks"] == [256, 512, 1024, 2048, 4096, 8192]
    code = script.main(["--out", str(tmp_path), "--size", "small", "--parts", "dial,precision,stages"])
    assert code == 0
    dial = pd.read_csv(tmp_path / flce_studies.RUN_FILES["dial"])
    assert list(dial.columns) == MEASURED_COLUMNS and dial.kernel_provider.str.startswith("kernels_lib[chunk_size=").all()
    precision = pd.read_csv(tmp_path / flce_studies.RUN_FILES["precision"])
    assert {"kernels_lib", "kernels_lib[accurate=True]", "torch"} <= set(precision.provider)
    assert {"gpu_name", "torch_version", "kernels_lib_commit"} <= set(precision.columns)
    stages = pd.read_csv(tmp_path / flce_studies.RUN_FILES["stages"])
    assert set(stages.accurate) == {True, False} and "kernels_lib_commit" in stages.columns


def _peers_here(names) -> set:
    """The providers of ``names`` that load on this machine (a peer's wheel installed, CUDA where it needs it):
    what a sweep of them measures here, whatever else is installed."""
    return set(available_providers(flce.KERNEL_NAME, list(names))[0])


def _errors(rows: pd.DataFrame) -> pd.Series:
    """The ``error`` column of a part's rows as text ("" where a row has none, or the part wrote no such column)."""
    return rows["error"].fillna("").astype(str) if "error" in rows else pd.Series("", index=rows.index)


def _frontier_script():
    """``studies/flce_frontier.py`` as a module."""
    return importlib.import_module("studies.flce_frontier")


def _check_frontier(script, out: Path, torch_lce: set) -> None:
    rows = pd.read_csv(out / script.FILES["frontier"])
    assert list(rows.columns) == MEASURED_COLUMNS
    dial = {flce.variant_name({"chunk_size": c, "accurate": False}) for c in script.SIZES["small"]["chunks"]}
    # Liger's Triton kernel runs only where the kernels are compiled (CUDA) and liger-kernel is installed
    # (the peers' CuTe and QuACK kernels need their wheels): in the interpreter it is skipped.
    # torch's own chunked linear_cross_entropy is pure torch: it runs wherever torch has it (>= 2.13).
    providers = set(rows.kernel_provider)
    assert dial | {"kernels_lib", "torch", flce.FLOOR} | torch_lce <= providers
    assert providers - dial - {"kernels_lib"} == _peers_here(script.PEERS)  # every peer that loads here, no other
    assert set(rows.kernel_operation_mode) == {"forward", *script.MODES}
    peer_run = rows[rows.kernel_provider.isin(["kernels_lib", "torch"])].note
    for peer in {"quack", "liger_sm90"} - _peers_here(script.PEERS):
        assert peer_run.str.contains(f"{peer} skipped").all()
    rounds = pd.read_csv(out / script.FILES["frontier_rounds"])
    n_rounds = script.SIZES["small"]["rounds"]
    assert sorted(rounds["round"].unique()) == list(range(1, n_rounds + 1)) and script.SIZES["full"]["rounds"] == 3
    first_provider = rounds.groupby("round").kernel_provider.first()
    assert first_provider[1] != first_provider[2], "every other round reverses the providers' order"
    main = rows[rows.kernel_provider.isin(["kernels_lib", "torch"])]
    assert main.note.str.contains(f"median of {n_rounds} rounds").all()
    assert len(main) == len(rounds[rounds.kernel_provider.isin(["kernels_lib", "torch"])]) / n_rounds


def _check_past_floor(script, out: Path, torch_lce: set) -> None:
    # issue 30's part: the same peers and the floor, no dial, and its targets judged from that one run
    dial = {flce.variant_name({"chunk_size": c, "accurate": False}) for c in script.SIZES["small"]["chunks"]}
    past = pd.read_csv(out / script.FILES["past_floor"])
    assert {"kernels_lib", "torch", flce.FLOOR, script.DX_ARM} | torch_lce <= set(past.kernel_provider) and not set(past.kernel_provider) & dial
    from kernels_lib.chunks import matmuls

    assert matmuls.DX_BLOCK_ROWS != flce_studies.DX_BLOCK_ROWS_BEFORE  # the arm's constant put back after its sweep
    judged = study_analysis.past_floor_targets(past)
    assert judged["full / three matmuls"].notna().all() and judged["full / QuACK"].isna().all()
    # the square product's rate of the same run: measured on a GPU, NaN on a CPU (no cuBLAS rate to speak of)
    rates = study_analysis.past_floor_rates(past)
    assert (rates["three matmuls TFLOP/s"] > 0).all()
    assert rates["square 8192³ TFLOP/s"].notna().all() if torch.cuda.is_available() else rates["square 8192³ TFLOP/s"].isna().all()


def _check_stages(script, out: Path, torch_lce: set) -> None:
    stages = pd.read_csv(out / script.FILES["stages"])
    assert set(stages.chunk_size) == set(script.SIZES["small"]["stage_chunks"]) and "kernels_lib_commit" in stages.columns
    assert set(stages.route) == {"cuBLAS logits", "epilogue GEMM", "epilogue GEMM, logits_out configs"}


def _check_class_major(script, out: Path, torch_lce: set) -> None:
    major = pd.read_csv(out / script.FILES["class_major"])
    assert set(major.stage) == {"shift", "exponentials GEMM", "dx", "dW", "scale rows"}
    # Every stage timed; a GEMM config the GPU cannot hold (shared memory) is a recorded failure with its reason.
    gemm = major.stage == "exponentials GEMM"
    assert major[~gemm].ms.notna().all() and major[gemm].ms.notna().any()
    assert (major[gemm & major.ms.isna()].error.astype(str).str.contains("out of resource")).all()
    assert major[major.stage == "dW"].variant.str.contains(r"\(1 matmuls\)").any(), "one slab of all V classes"


def _check_profile(script, out: Path, torch_lce: set) -> None:
    profile = pd.read_csv(out / script.FILES["profile"])
    assert set(profile.kernel_provider) == {"kernels_lib", "quack"}
    if "quack" not in _peers_here(["quack"]):
        assert profile[profile.kernel_provider == "quack"].name.str.contains("skipped").all()
    assert not profile[profile.kernel_provider == "kernels_lib"].name.str.contains("skipped|failed").any()


def _check_timeline(script, out: Path, torch_lce: set) -> None:
    timeline = pd.read_csv(out / script.FILES["timeline"])
    assert set(timeline.kernel_provider) == {"kernels_lib", "quack"}
    assert timeline[timeline.kernel_provider == "kernels_lib"].ms_50.notna().sum() == 1
    quack = timeline[timeline.kernel_provider == "quack"]
    assert (quack.ms_50.notna() | _errors(quack).str.contains("skipped|failed")).all()  # timed, or why not


def _check_quack_ab(script, out: Path, torch_lce: set) -> None:
    quack_ab = pd.read_csv(out / script.FILES["quack_ab"])
    assert set(quack_ab.kernel_provider) == {"kernels_lib"} | _peers_here(["quack"])
    if "quack" not in _peers_here(["quack"]):
        assert quack_ab.note.str.contains("quack skipped").all()


def _check_quack_pairs(script, out: Path, torch_lce: set) -> None:
    pairs = pd.read_csv(out / script.FILES["quack_pairs"])
    ours = pairs[pairs.kernel_provider == "kernels_lib"]
    quack = pairs[pairs.kernel_provider == "quack"]
    assert len(quack) and (quack.ms_50.notna() | _errors(quack).str.contains("skipped|failed")).all()  # timed, or why not
    assert set(ours.kernel_operation_mode) == {"full", "forward_no_grad"} and set(ours.BT) == set(script.SIZES["small"]["x_values"])
    assert (ours.samples == script.SIZES["small"]["pair_samples"]).all() and ours.ms_50.gt(0).all()


def _check_exponentials(script, out: Path, torch_lce: set) -> None:
    n_rounds = script.SIZES["small"]["rounds"]
    ab = pd.read_csv(out / script.FILES["exponentials"])
    assert {"kernels_lib", script.LOGITS_ARM} | _peers_here(script.PEERS) == set(ab.kernel_provider)  # the frontier's peers
    assert ab.note.str.contains(f"median of {n_rounds} rounds").all()
    assert script.flce_module.STORE_EXPONENTIALS, "the A/B puts the setting back"


def _check_wide_class_major(script, out: Path, torch_lce: set) -> None:
    n_rounds = script.SIZES["small"]["rounds"]
    wide = pd.read_csv(out / script.FILES["wide_class_major"])
    assert {"kernels_lib", script.WIDE_ARM} | _peers_here(["torch", "quack", "torch_lce"]) == set(wide.kernel_provider)
    if "quack" not in _peers_here(["quack"]):
        assert wide[wide.kernel_provider != script.WIDE_ARM].note.str.contains("quack skipped").all()
    assert wide.note.str.contains(f"median of {n_rounds} rounds").all() and set(wide.x_value) == {min(script.SIZES["small"]["x_values"])}
    assert script.flce_module._class_major_route_takes is LIBRARY_ROUTE, "the A/B puts the library's predicate back"


def _check_row_major_dw(script, out: Path, torch_lce: set) -> None:
    row_major = pd.read_csv(out / script.FILES["row_major_dw"])
    assert set(row_major.stage) == {"dx", "dW"} and row_major.ms.gt(0).all() and "kernels_lib_commit" in row_major
    assert len(row_major[row_major.stage == "dW"]) == 2 * len(script.SIZES["small"]["slab_rows"]), "written and added to"


FRONTIER_PART_CHECKS = {
    "frontier": _check_frontier, "past_floor": _check_past_floor, "stages": _check_stages,
    "class_major": _check_class_major, "profile": _check_profile, "timeline": _check_timeline,
    "quack_ab": _check_quack_ab, "quack_pairs": _check_quack_pairs, "exponentials": _check_exponentials,
    "wide_class_major": _check_wide_class_major, "row_major_dw": _check_row_major_dw,
    "forward": None, "default": None, "overhead": None, "gluon": None,
}


def test_frontier_script_parts_each_have_a_test():
    """Every part of the frontier script runs in :func:`test_frontier_script_cpu_paths`, and its peers are named."""
    script = _frontier_script()
    assert set(FRONTIER_PART_CHECKS) == set(script.PARTS)
    assert {"liger_sm90", "quack"} <= set(script.PEERS)
    assert set(flce.TORCH_LCE_POLICIES) <= set(script.PEERS)


@pytest.mark.parametrize("part", list(FRONTIER_PART_CHECKS))
def test_frontier_script_cpu_paths(part, tmp_path, capsys):
    """The frontier run at CPU size, one part: every peer named (skipped here, with the reason), kernels_lib's
    default and each dial point in both modes, and the stage tables with their provenance."""
    script = _frontier_script()
    code = script.main(["--out", str(tmp_path), "--size", "small", "--parts", part])
    assert code == 0, f"the {part} part returned {code}; its stderr ends:\n{capsys.readouterr().err[-3000:]}"
    # ... and on an older torch from torch 2.13's files where KERNELS_LIB_TORCH_LCE_FILES names them (as on the H200).
    torch_lce = set(flce.TORCH_LCE_POLICIES) if _torch_lce_loads() else set()
    if FRONTIER_PART_CHECKS[part] is not None:
        FRONTIER_PART_CHECKS[part](script, tmp_path, torch_lce)


def test_wide_class_major_arms_follow_the_default_of_the_run():
    """The wide class-major A/B's arm is the class-major chunk since the default went back to 1, the chunked
    route in the runs made while it was 2: each run's routes are told by the arm it has, and the recorded
    runs of the old kind still read."""
    new = pd.DataFrame({"kernel_provider": ["kernels_lib", flce_studies.WIDE_CLASS_MAJOR_ARM, "torch"]})
    old = pd.DataFrame({"kernel_provider": ["kernels_lib", flce_studies.WIDE_CLASS_MAJOR_ARM_BEFORE, "torch"]})
    assert flce_studies.wide_class_major_arms(new) == {"chunked": "kernels_lib", "class-major": flce_studies.WIDE_CLASS_MAJOR_ARM}
    assert flce_studies.wide_class_major_arms(old) == {"chunked": flce_studies.WIDE_CLASS_MAJOR_ARM_BEFORE, "class-major": "kernels_lib"}
    with pytest.raises(ValueError, match="no arm of the wide class-major A/B"):
        flce_studies.wide_class_major_arms(pd.DataFrame({"kernel_provider": ["kernels_lib"]}))
    recorded = flce_studies.load_run("wide_class_major")
    if recorded is not None:  # the newest recorded run names one of the two arms
        assert set(flce_studies.wide_class_major_arms(recorded).values()) <= set(recorded.kernel_provider)
