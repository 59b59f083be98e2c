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


def test_headline_is_per_gpu_from_the_newest_run_of_each():
    rows = (_rows("kernels_lib", 1024, 1.0, 100.0) + _rows("liger", 1024, 2.5, 200.0)
            + _rows("kernels_lib", 2048, 2.0, 200.0) + _rows("liger", 2048, 4.0, 400.0)
            # an older run on the same GPU, with other figures: not read
            + _rows("kernels_lib", 1024, 9.0, 900.0, commit="0ld0001", timestamp="2025-01-01")
            + _rows("liger", 1024, 1.0, 100.0, commit="0ld0001", timestamp="2025-01-01")
            # another GPU: its own sentence, its own run; Liger not measured there
            + _rows("kernels_lib", 1024, 3.0, 100.0, gpu="NVIDIA H100 80GB HBM3"))
    said = narrative.headline(pd.DataFrame(rows), ["liger"], x_name="V")
    h100, h200 = said.split(". On the ")
    assert h100.startswith("On the H100 80GB, kernels_lib's `full` takes Liger not measured in that run")
    assert h200.startswith("H200, kernels_lib's `full` takes 0.40–0.50× Liger's time at 0.50× its memory (V = 1024–2048)")
    assert "run of commit abc1234 on NVIDIA H200" in h200 and "0ld0001" not in said


def test_headline_without_gpu_rows_says_so():
    cpu = pd.DataFrame(_rows("kernels_lib", 1, 1.0, float("nan"))).assign(device="cpu")
    assert narrative.headline(cpu, ["liger"]).startswith("Not measured on a GPU yet")
    assert narrative.headline(pd.DataFrame(), ["liger"]).startswith("Not measured on a GPU yet")


def test_floor_and_ratio_lines_read_their_tables():
    floors = pd.DataFrame({"chart": ["a", "a", "b"], "kernels_lib / floor": [1.2, 1.5, 1.1], "liger / floor": [3.0, 2.9, float("nan")]})
    lines = narrative.floor_lines(floors).splitlines()
    assert lines == ["- `a`: `full` at kernels_lib 1.20–1.50×, Liger 2.90–3.00× the floor.",
                     "- `b`: `full` at kernels_lib 1.10× the floor."]
    assert narrative.floor_lines(floors.iloc[:0]).startswith("No GPU rows")
    table = pd.DataFrame({"full / Liger": [0.4, 0.6], "full / TRL": [float("nan")] * 2}, index=[1024, 8192])
    said = narrative.ratio_lines({"fused_linear_jsd": table}, {"full / Liger": "Liger's time", "full / TRL": "TRL's time"}, "BT")
    assert said == "- `fused_linear_jsd` (BT = 1024–8192): 0.40–0.60× Liger's time."
    assert narrative.where_above(pd.Series([0.7, 0.9, 0.85], index=[1024, 2048, 4096]), 0.8, "BT") == "at BT = 2048, 4096"
    assert narrative.where_above(pd.Series([0.7]), 0.8) == "nowhere"


def test_estimate_beside_reference_covers_every_reference_peak():
    table = ts.estimate_beside_reference()
    assert len(table) == len(ts.REFERENCE_PEAK_GIB)
    assert all(math.isfinite(r) and 0.5 < r < 2 for r in table["estimate / reference"])
    assert table.loc[("llama-3.2-1b", True, "fused"), "reference, SPEC §7 (GiB)"] == pytest.approx(13.9)


def test_floor_margin_says_what_a_bound_asks_of_the_floor():
    said = narrative.floor_margin(11.0, 13.5, 10.0, 0.8, "liger", at="B = 8")
    assert said == ("At B = 8, kernels_lib's `full` runs at 1.10× the floor and Liger's at 1.35×, so ≤ 0.8× Liger's time asks "
                    "for 1.08× the floor: below where kernels_lib runs.")
    assert narrative.floor_margin(10.5, 30.0, 10.0, 0.6).endswith("asks for 1.80× the floor: within reach.")
    assert narrative.floor_margin(11.0, 15.0, 10.0, 0.6).endswith("asks for 0.90× the floor: below the floor: out of reach for any kernel.")
    assert narrative.floor_margin(float("nan"), 1.0, 1.0, 0.8).startswith("Not measured")


def test_floor_multiples_names_each_provider():
    said = narrative.floor_multiples({"kernels_lib": 11.0, "huggingface": 32.0, "liger": float("nan")}, 10.0, at="B = 32",
                                     what="the matmul floor")
    assert said == "At B = 32, `full` against the matmul floor: kernels_lib 1.10×, the baseline 3.20×, Liger not measured."
    assert narrative.floor_multiples({"kernels_lib": 1.0}, float("nan")).startswith("No floor measured")
