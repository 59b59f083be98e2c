"""The sentences the notebooks generate from measured rows (kernels_workbench.narrative, and the
conclusions of notebooks 05 and 09): each figure comes from the rows given, a missing one reads "not
measured", and runs or GPUs are never mixed in one ratio."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kernels_workbench import narrative
from kernels_workbench import training_step as ts


def _rows(provider, x, ms, mib, *, commit="abc1234", gpu="NVIDIA H200", timestamp="2026-01-02 03:04:05", mode="full"):
    base = {"kernel_provider": provider, "x_value": x, "kernel_operation_mode": mode, "kernels_lib_commit": commit,
            "gpu_name": gpu, "timestamp": timestamp, "device": "cuda"}
    return [{**base, "metric_name": "speed", "y_value_50": ms}, {**base, "metric_name": "memory", "y_value_50": mib}]


def test_span_formats_a_range_one_value_or_nothing():
    assert narrative.span([0.41, 0.384, float("nan")]) == "0.38–0.41×"
    assert narrative.span(pd.Series([0.5, 0.501])) == "0.50×"
    assert narrative.span([float("nan")]) == "not measured" and narrative.span([]) == "not measured"
    assert narrative.span([1.234], digits=1, suffix=" ms") == "1.2 ms"
    assert narrative.x_span([8192, 1024.0, 4096], "BT") == "BT = 1024–8192" and narrative.x_span([3], "V") == "V = 3"


def _table(fastest, memory, floor, index=(1024, 2048), far=()):
    table = pd.DataFrame({"× fastest peer": fastest, "memory × leanest": memory, "× floor": floor}, index=pd.Index(index, name="V"))
    for peer in far:
        table[f"× {peer} (far from its published figure)"] = 0.1
    return table


def test_headline_is_one_sentence_per_loss_with_each_gpu():
    said = narrative.headline("KL divergence", {"NVIDIA H100 80GB HBM3": _table([0.5, 0.6], [0.5, 0.5], [1.1, 1.2]),
                                                "NVIDIA H200": _table([0.7, float("nan")], [float("nan")] * 2, [float("nan")] * 2)})
    assert said == ("KL divergence, kernels_lib's `full`: on the H100 80GB (V = 1024–2048), 0.50–0.60× the fastest peer's time, "
                    "0.50× the leanest peer's memory and 1.10–1.20× the floor; on the H200 (V = 1024–2048), 0.70× the fastest "
                    "peer's time, no peer's memory measured and the floor not measured.")


def test_headline_leaves_a_far_peer_out_in_a_clause():
    said = narrative.headline("GRPO", {"NVIDIA H200": [_table([0.9], [0.5], [1.2], (16,), far=("liger",)), _table([0.8], [0.4], [1.1], (8,))]})
    assert "0.80–0.90× the fastest peer's time (Liger left out: far from its published figure)" in said, said
    assert "(2 charts)" in said and "0.10" not in said, "the far peer's ratio is not in the sentence's numbers"


def test_headline_without_a_floor_column_has_no_floor_clause():
    """A comparison with no floor at all (a whole training step) says time and memory only, as ``of`` names it."""
    table = _table([0.9, 1.1], [1.0, 1.04], [1.0, 1.0]).drop(columns="× floor")
    said = narrative.headline("The training step", {"NVIDIA H200": [table, table]}, of="step", unmeasured="not measured")
    assert said == ("The training step, kernels_lib's step: on the H200 (2 charts), 0.90–1.10× the fastest peer's time and "
                    "1.00–1.04× the leanest peer's memory."), said
    assert narrative.headline("The training step", {}, unmeasured="not measured on a GPU yet") == "The training step: not measured on a GPU yet."


def test_the_training_step_headline_reads_each_gpus_newest_run_per_model():
    rows = pd.DataFrame([{"run_id": run, "model": "m", "provider": p, "checkpointing": False, "tokens": 8192, "step_ms_50": ms,
                          "peak_gib": gib, "note": None, "gpu_name": "NVIDIA H200", "device": "cuda", "kernels_lib_commit": commit,
                          "timestamp": f"2026-01-0{run} 00:00:00"}
                         for run, commit, scale in ((1, "aaaaaaa", 10.0), (2, "bbbbbbb", 1.0))
                         for p, ms, gib in (("kernels_lib", 90.0 * scale, 10.0), ("huggingface", 100.0, 20.0), ("liger", 120.0, 12.0))])
    said = ts.headline(rows)
    assert "0.90× the fastest peer's time and 0.83× the leanest peer's memory" in said, said  # run 2 only: 90/100, 10/12
    assert "bbbbbbb" not in said and "bbbbbbb" in ts.provenance_lines(rows)


def test_headline_without_gpu_rows_says_so():
    assert narrative.headline("KTO", {}) == "KTO: not measured on a GPU yet, so the published rows alone are drawn."


def test_provenance_line_names_the_run_beside_the_data():
    rows = pd.DataFrame(_rows("kernels_lib", 1024, 1.0, 100.0)).assign(torch_version="2.9.0", liger_version="0.6.0")
    assert narrative.provenance_line(rows) == ("Measured on the H200 (NVIDIA H200), kernels_lib commit abc1234, 2026-01-02; "
                                               "torch 2.9.0, Liger 0.6.0.")


def test_floor_lines_read_their_table():
    floors = pd.DataFrame({"chart": ["a", "a", "b"], "kernels_lib / floor": [1.2, 1.5, 1.1], "liger / floor": [3.0, 2.9, float("nan")]})
    lines = narrative.floor_lines(floors).splitlines()
    assert lines == ["- `a`: `full` at kernels_lib 1.20–1.50×, Liger 2.90–3.00× the floor.",
                     "- `b`: `full` at kernels_lib 1.10× the floor."]
    assert narrative.floor_lines(floors.iloc[:0]).startswith("No GPU rows")


def test_estimate_beside_reference_covers_every_reference_peak():
    table = ts.estimate_beside_reference()
    assert len(table) == len(ts.REFERENCE_PEAK_GIB)
    assert all(math.isfinite(r) and 0.5 < r < 2 for r in table["estimate / reference"])
    assert table.loc[("llama-3.2-1b", True, "fused"), "reference, SPEC §7 (GiB)"] == pytest.approx(13.9)


def test_floor_multiples_names_each_provider():
    said = narrative.floor_multiples({"kernels_lib": 11.0, "huggingface": 32.0, "liger": float("nan")}, 10.0, at="B = 32",
                                     what="the matmul floor")
    assert said == "At B = 32, `full` against the matmul floor: kernels_lib 1.10×, the baseline 3.20×, Liger not measured."
    assert narrative.floor_multiples({"kernels_lib": 1.0}, float("nan")).startswith("No floor measured")
