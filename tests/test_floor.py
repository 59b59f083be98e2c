"""The one floor (kernels_workbench.floor): per x of one run, the longer of the loss's matmuls (their own time
where the run timed them, else their FLOPs at the run's matmul ceiling) and its minimal bytes at the run's copy
bandwidth; "not measured" (NaN) without that run's own ceilings, never another run's."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from kernels_workbench import floor as one_floor
from kernels_workbench.bench import fused_linear_cross_entropy as flce
from kernels_workbench.bench.registry import get_spec

GPU = "NVIDIA H100 80GB HBM3"
CONFIG = json.dumps({"H": 4096, "V": 128256, "dtype": "torch.bfloat16"})


def _run(values: dict, commit: str = "abc1234") -> pd.DataFrame:
    return pd.DataFrame([
        {"kernel_name": flce.KERNEL_NAME, "kernel_provider": p, "kernel_operation_mode": "full", "metric_name": "speed",
         "x_name": "BT", "x_value": n, "y_value_50": y, "extra_benchmark_config_str": CONFIG, "gpu_name": GPU, "device": "cuda",
         "kernels_lib_commit": commit, "timestamp": "2026-12-05 09:00"}
        for p, by_n in values.items() for n, y in by_n.items()])


def _ceilings(commit="abc1234", copy=3000.0, matmul=500.0):
    return pd.DataFrame([{"kernel_name": k, "gpu_name": GPU, "kernels_lib_commit": commit, "timestamp": "2026-12-05",
                          "y_value_50": v} for k, v in (("copy", copy), ("matmul", matmul)) if v is not None])


def test_the_spec_carries_flops_and_bytes():
    spec = get_spec(flce.KERNEL_NAME)
    sizes = {"BT": 8192, "H": 4096, "V": 128256}
    assert spec.flops(sizes, "full") == pytest.approx(3 * 2 * 8192 * 4096 * 128256)
    assert spec.min_bytes(sizes, torch.bfloat16, "full") == flce.bytes_moved(sizes, torch.bfloat16, "full")
    assert get_spec("kl_div").flops({"N": 1, "V": 2}, "full") is None, "a loss on logits runs no matmul"
    kto = {"B": 2, "T": 4, "H": 8, "V": 16}
    assert get_spec("kto_loss").flops(kto, "full") == pytest.approx(3 * 2 * 2 * 4 * 8 * 16), "KTO's harness: no dx"


def test_the_own_matmuls_time_where_the_run_timed_them_else_the_matmul_ceiling():
    run = _run({"kernels_lib": {4096: 20.0, 8192: 40.0}, flce.FLOOR: {4096: 19.0}})
    table = one_floor.floor(run, _ceilings())
    assert table.loc[4096, "ms"] == 19.0 and table.loc[4096, "bound"] == "matmul", "the three_matmuls' own time"
    flops = get_spec(flce.KERNEL_NAME).flops({"BT": 8192, "H": 4096, "V": 128256}, "full")
    assert table.loc[8192, "ms"] == pytest.approx(flops / 500e12 * 1e3), "not timed at 8192: the run's matmul ceiling"


def test_the_longer_of_matmuls_and_bytes():
    run = _run({"kernels_lib": {4096: 20.0}})
    slow_copy = one_floor.floor(run, _ceilings(copy=1e-3))
    assert slow_copy.loc[4096, "bound"] == "bytes" and slow_copy.loc[4096, "ms"] == slow_copy.loc[4096, "bytes ms"]
    assert slow_copy.loc[4096, "bytes ms"] > slow_copy.loc[4096, "matmul ms"]


def test_not_measured_without_the_runs_own_ceilings():
    run = _run({"kernels_lib": {4096: 20.0}, flce.FLOOR: {4096: 19.0}})
    assert one_floor.floor_ms(run, _ceilings(commit="other")).isna().all(), "another run's ceilings make no floor"
    assert one_floor.floor_ms(run, _ceilings(copy=None)).isna().all(), "no copy bandwidth in the run: not measured"
    assert math.isnan(one_floor.floor_at(flce.KERNEL_NAME, {"BT": 1, "H": 1, "V": 1}, torch.bfloat16, "full", {})[0])


def test_a_published_x_the_run_did_not_time_takes_the_runs_configuration():
    run = _run({"kernels_lib": {4096: 20.0}})
    table = one_floor.floor(run, _ceilings(), xs=[4096, 16384])
    assert table.loc[16384, "ms"] == pytest.approx(4 * table.loc[4096, "ms"], rel=1e-3)


def test_the_matmul_time_is_the_one_floors_and_a_runs_own_matmul_rate_counts():
    sizes = {"BT": 8192, "H": 4096, "V": 128256}
    flops = get_spec(flce.KERNEL_NAME).flops(sizes, "full")
    assert one_floor.matmul_ms(flce.KERNEL_NAME, sizes, "full", 500.0) == pytest.approx(flops / 500e12 * 1e3)
    assert math.isnan(one_floor.matmul_ms(flce.KERNEL_NAME, sizes, "full", math.nan))
    assert one_floor.matmul_ms("kl_div", {"N": 1, "V": 2}, "full", 500.0) == 0.0
    run = _run({"kernels_lib": {8192: 40.0}}).assign(matmul_tflops=400.0)  # the rate the run wrote beside its rows
    assert one_floor.run_rates(run, _ceilings()) == {"copy": 3000.0, "matmul": 400.0}
    assert one_floor.run_rates(run, _ceilings(commit="other")) == {"matmul": 400.0}, "another run's copy is not this run's"
    assert one_floor.floor_ms(run, _ceilings()).loc[8192] == pytest.approx(flops / 400e12 * 1e3)


def test_bytes_ms_is_gigabytes_at_the_runs_copy_bandwidth():
    assert one_floor.bytes_ms(3.0, {"copy": 3000.0}) == pytest.approx(1.0)  # 3 GB at 3000 GB/s: 1 ms
    assert math.isnan(one_floor.bytes_ms(3.0, {"matmul": 700.0}))  # no copy bandwidth measured: not measured
    assert math.isnan(one_floor.bytes_ms(3.0, {"copy": math.nan}))
