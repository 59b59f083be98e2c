"""Rows in the measured CSV layout for the tests of the comparison, the targets and the charts: one builder each,
shared by ``tests/`` and ``studies/tests/`` (which puts ``tests/`` on the path)."""

from __future__ import annotations

import json

import pandas as pd

from kernels_workbench import data

H200 = "NVIDIA H200"
KL_CONFIG = {"N": 16384, "dtype": "torch.float32", "reduction": "batchmean", "log_target": False}
MODES = ("forward", "forward_no_grad", "full")


def kl_rows(provider, ms, mb, commit, gpu=H200, timestamp="2026-01-01 00:00:00", xs=(4096, 8192), kernel="kl_div"):
    """One provider's rows of one run: every mode of :data:`MODES` at each x, speed ``ms`` and memory ``mb``."""
    return pd.DataFrame([
        {"kernel_name": kernel, "kernel_provider": provider, "kernel_operation_mode": mode, "metric_name": metric,
         "x_name": "V", "x_label": "vocab size", "x_value": x, "y_value_50": value, "y_value_20": value, "y_value_80": value,
         "extra_benchmark_config_str": json.dumps({**KL_CONFIG, "V": x}), "gpu_name": gpu, "timestamp": timestamp,
         "kernels_lib_commit": commit, "device": "cuda", "torch_version": "2.11.0", "liger_version": "0.8.5"}
        for mode in MODES for x in xs for metric, value in (("speed", ms), ("memory", mb))
    ])


def two_runs() -> pd.DataFrame:
    """Run "old" measured kernels_lib and Liger; run "new" (later) kernels_lib alone."""
    return pd.concat([
        kl_rows("kernels_lib", 2.0, 100.0, "old"), kl_rows("liger", 4.0, 200.0, "old"),
        kl_rows("kernels_lib", 1.0, 100.0, "new", timestamp="2026-02-01 00:00:00"),
    ], ignore_index=True)


def flce_rows(values: dict) -> pd.DataFrame:
    """Fused-CE rows from ``{(provider, mode, metric): {x: median}}`` at H = 4096, V = 128256."""
    return pd.DataFrame([
        {"kernel_name": "fused_linear_cross_entropy", "kernel_provider": provider, "kernel_operation_mode": mode,
         "metric_name": metric, "x_value": x, "y_value_50": y,
         "extra_benchmark_config_str": json.dumps({"H": 4096, "V": 128256, "BT": x, "dtype": "torch.bfloat16"})}
        for (provider, mode, metric), by_x in values.items() for x, y in by_x.items()
    ])


#: One fused-CE run with every peer: kernels_lib, torch, Liger and CCE (CCE without a memory row).
FLCE_SYNTHETIC = flce_rows({
    ("kernels_lib", "full", "speed"): {4096: 20.0, 8192: 44.0},
    ("torch", "full", "speed"): {4096: 24.5, 8192: 49.1},
    ("liger", "full", "speed"): {4096: 46.1, 8192: 55.3},
    ("cce", "full", "speed"): {4096: 48.4, 8192: 96.2},
    ("kernels_lib", "forward_no_grad", "speed"): {4096: 7.0, 8192: 14.0},
    ("torch", "forward_no_grad", "speed"): {4096: 9.33, 8192: 18.5},
    ("cce", "forward_no_grad", "speed"): {4096: 8.39, 8192: 16.7},
    ("kernels_lib", "full", "memory"): {4096: 1100.0, 8192: 1300.0},
    ("liger", "full", "memory"): {4096: 1065.0, 8192: 1129.0},
    ("torch", "full", "memory"): {4096: 6012.0, 8192: 12024.0},
})


def committed_kl_run() -> tuple[pd.DataFrame, pd.DataFrame]:
    """The newest committed H200 run of ``kl_div.csv`` that measured the four modes, and the ceilings.

    The analysis judges the rows of one run (one commit on one GPU); a notebook's full-size refresh measures
    the published modes only, without ``forward_no_grad``, so the newest run of all four is looked for."""
    rows = data.read_rows(data.DATA_DIR / "measured" / "kl_div.csv")
    ceilings = data.read_rows(data.DATA_DIR / "measured" / "ceilings.csv")
    h200 = rows[rows.gpu_name == H200]
    for commit in h200.sort_values("timestamp").kernels_lib_commit.unique()[::-1]:
        run = data.one_run(h200, commit=commit, gpu_name=H200)
        if set(run.kernel_operation_mode) >= {"forward", "backward", "full", "forward_no_grad"}:
            return run, ceilings
    raise AssertionError("no H200 run of kl_div.csv measured the four modes")
