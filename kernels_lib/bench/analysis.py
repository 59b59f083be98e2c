"""Reading measured rows: medians side by side, ratios between providers, achieved bandwidth.

These are what the notebooks state targets with, so they are library code (and unit-tested), not
notebook cells.
"""

from __future__ import annotations

import json

import pandas as pd
import torch

from .spec import get_spec


def medians(rows: pd.DataFrame, metric: str, mode: str) -> pd.DataFrame:
    """Median per x (index) and provider (columns) for one (metric, mode)."""
    selected = rows[(rows.metric_name == metric) & (rows.kernel_operation_mode == mode)]
    return selected.pivot_table(index="x_value", columns="kernel_provider", values="y_value_50")


def ceiling(ceilings: pd.DataFrame, name: str, gpu_name: str) -> float:
    """The newest measured ``copy`` (GB/s) or ``matmul`` (TFLOP/s) ceiling on ``gpu_name``."""
    rows = ceilings[(ceilings.kernel_name == name) & (ceilings.gpu_name == gpu_name)]
    if not len(rows):
        raise ValueError(f"no {name} ceiling measured on {gpu_name}")
    return float(rows.sort_values("timestamp").y_value_50.iloc[-1])


def achieved_bandwidth(rows: pd.DataFrame, kernel_name: str, provider: str, mode: str) -> pd.Series:
    """GB/s that ``provider`` moves in ``mode``: the loss's minimal bytes (:attr:`LossSpec.bytes_moved`)
    over the median time, per x."""
    spec = get_spec(kernel_name)
    selected = rows[
        (rows.metric_name == "speed") & (rows.kernel_operation_mode == mode) & (rows.kernel_provider == provider)
    ]
    result = {}
    for _, row in selected.iterrows():
        config = json.loads(row.extra_benchmark_config_str)
        dtype = getattr(torch, config["dtype"].replace("torch.", ""))
        sizes = {k: v for k, v in config.items() if isinstance(v, int) and not isinstance(v, bool)}
        result[row.x_value] = spec.bytes_moved(sizes, dtype, mode) / (row.y_value_50 * 1e-3) / 1e9
    return pd.Series(result, name=f"{provider} {mode} GB/s").sort_index()


def kl_div_targets(rows: pd.DataFrame, copy_gbps: float) -> pd.DataFrame:
    """The KL issue's targets per V, from rows of one GPU: forward bandwidth ≥ 90% of the copy
    bandwidth; ``full`` time ≤ 0.6× Liger's; ``full`` memory ≤ Liger's."""
    speed_full = medians(rows, "speed", "full")
    memory_full = medians(rows, "memory", "full")
    table = pd.DataFrame(index=speed_full.index)
    for mode in ("forward", "forward_no_grad"):
        bandwidth = achieved_bandwidth(rows, "kl_div", "kernels_lib", mode)
        table[f"{mode} GB/s"] = bandwidth
        table[f"{mode} / copy"] = bandwidth / copy_gbps
    table["full ms"] = speed_full["kernels_lib"]
    table["Liger full ms"] = speed_full.get("liger")
    table["full / Liger"] = speed_full["kernels_lib"] / speed_full.get("liger")
    table["memory / Liger"] = memory_full["kernels_lib"] / memory_full.get("liger")
    table["bandwidth ≥ 0.9"] = table["forward / copy"] >= 0.9
    table["full ≤ 0.6× Liger"] = table["full / Liger"] <= 0.6
    table["memory ≤ Liger"] = table["memory / Liger"] <= 1.0
    return table
