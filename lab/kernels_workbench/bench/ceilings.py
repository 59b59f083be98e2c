"""The two ceilings a kernel is judged against, measured on the same GPU in the same run.

- copy bandwidth: a device-to-device copy of 2 GiB, bytes read plus bytes written over the median
  time (the METHOD's definition): the floor of a bandwidth-bound kernel is its bytes over this.
- matmul rate: a bf16 8192³ product through torch (cuBLAS), 2·M·N·K FLOPs over the median time:
  the floor of a fused linear loss is its matmul FLOPs over this.
Returned as rows in the measured layout (``kernel_name`` ``copy`` / ``matmul``) so they are stored
with the data they bound.
"""

from __future__ import annotations

import json

import pandas as pd
import torch

from .environment import provenance
from .sweep import MEASURED_COLUMNS
from .timing import time_callable


def copy_bandwidth(device: torch.device, gib: float = 2.0):
    """(GB/s read+write, Timing) of ``dst.copy_(src)`` for ``gib`` GiB."""
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    timing = time_callable(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / (timing.p50 * 1e-3) / 1e9, timing


def matmul_rate(device: torch.device, size: int = 8192):
    """(TFLOP/s, Timing) of a bf16 ``size``³ product on random data."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    timing = time_callable(lambda: a @ b, device)
    return 2 * size**3 / (timing.p50 * 1e-3) / 1e12, timing


def measure_ceilings(device: torch.device | str) -> pd.DataFrame:
    """Both ceilings as measured rows; on CPU (interpreter) there is nothing meaningful to measure: empty."""
    device = torch.device(device)
    if device.type != "cuda":
        return pd.DataFrame(columns=MEASURED_COLUMNS)
    stamp = provenance(device)
    rows = []
    for name, unit, fn, config in (
        ("copy", "GB/s", copy_bandwidth, {"GiB": 2.0, "dtype": "torch.float32"}),
        ("matmul", "TFLOP/s", matmul_rate, {"M": 8192, "N": 8192, "K": 8192, "dtype": "torch.bfloat16"}),
    ):
        rate, timing = fn(device)
        rows.append(
            {
                "kernel_name": name,
                "kernel_provider": "torch",
                "kernel_operation_mode": "forward",
                "metric_name": "rate",
                "metric_unit": unit,
                "x_name": "",
                "x_label": "",
                "x_value": 0,
                "y_value_50": rate,
                # The rate at the p80 time is the low one: work / t = rate * p50 / t.
                "y_value_20": rate * timing.p50 / timing.p80,
                "y_value_80": rate * timing.p50 / timing.p20,
                "extra_benchmark_config_str": json.dumps(config),
                **stamp,
                "device": device.type,
                "timer": timing.timer,
                "note": f"median time {timing.p50:.4f} ms",
            }
        )
    return pd.DataFrame(rows, columns=MEASURED_COLUMNS)
