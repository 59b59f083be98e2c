"""Reading measured rows: medians side by side, the measured ceilings, achieved bandwidth, a preference chart's ratios.

The notebooks and the index compare runs through these (:mod:`kernels_workbench.comparison`). The bounds
we hold kernels_lib to in our own performance work, and the verdicts against them, are the studies'
(``studies/bench/targets.py``); no report prints them.
"""

from __future__ import annotations

import json

import pandas as pd
import torch

from .. import data
from .registry import get_spec


def _one_run(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows``, refused (``ValueError`` naming the runs, :func:`.data.run_label`) when they carry the run
    columns and mix runs: a target's ratio sets kernels_lib's median beside a peer's of the same run only.
    Rows without the run columns (a sweep just measured, published rows) pass."""
    if len(rows) and set(data.RUN_COLUMNS) <= set(rows.columns):
        data.run_label(rows)
    return rows


def medians(rows: pd.DataFrame, metric: str, mode: str) -> pd.DataFrame:
    """Median per x (index) and provider (columns) for one (metric, mode)."""
    selected = rows[(rows.metric_name == metric) & (rows.kernel_operation_mode == mode)]
    return selected.pivot_table(index="x_value", columns="kernel_provider", values="y_value_50")


def ceiling(ceilings: pd.DataFrame, name: str, gpu_name: str, commit: str | None = None) -> float:
    """The measured ``copy`` (GB/s) or ``matmul`` (TFLOP/s) ceiling on ``gpu_name``: the newest one
    of the run of ``commit`` (the run the compared rows come from) when given and measured, else the
    newest of all."""
    rows = ceilings[(ceilings.kernel_name == name) & (ceilings.gpu_name == gpu_name)]
    if not len(rows):
        raise ValueError(f"no {name} ceiling measured on {gpu_name}")
    same_run = rows[rows.kernels_lib_commit == commit] if commit is not None else rows.iloc[:0]
    return float((same_run if len(same_run) else rows).sort_values("timestamp").y_value_50.iloc[-1])


def ceiling_run(ceilings: pd.DataFrame, name: str, gpu_name: str, commit: str | None = None) -> tuple[float, str]:
    """:func:`ceiling` and the commit of the run that measured it: ``commit`` itself when that run
    measured the ceiling, else the newest run's (then a floor from it is *not* of the rows' run, and
    whatever prints it must say so)."""
    rows = ceilings[(ceilings.kernel_name == name) & (ceilings.gpu_name == gpu_name)]
    if not len(rows):
        raise ValueError(f"no {name} ceiling measured on {gpu_name}")
    same_run = rows[rows.kernels_lib_commit.astype(str) == str(commit)] if commit is not None else rows.iloc[:0]
    newest = (same_run if len(same_run) else rows).sort_values("timestamp").iloc[-1]
    return float(newest.y_value_50), str(newest.kernels_lib_commit)


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


def _provider(table: pd.DataFrame, name: str) -> pd.Series:
    """One provider's column of a :func:`medians` table, NaN where it was not measured."""
    return table[name] if name in table.columns else pd.Series(float("nan"), index=table.index)


def preference_targets(rows: pd.DataFrame, targets: dict, provider: str = "kernels_lib", baseline: str = "huggingface") -> pd.DataFrame:
    """The targets of a preference chart per batch size, from rows of one GPU: ``provider``'s median
    time of ``forward`` and ``full`` and its ``full`` memory, their ratios to the ``baseline``'s, Liger's
    and (where measured) TRL's fused-head path's (NaN where a peer was not measured or failed), and one
    True / False / NaN column per ``targets`` entry (label → (ratio column, upper bound); ``{}`` for the
    ratios alone; the studies' bounds are in ``studies/bench/targets.py``). Measured rows must be of one
    run (refused otherwise: :func:`_one_run`)."""
    _one_run(rows)
    speed = {mode: medians(rows, "speed", mode) for mode in ("forward", "full")}
    index = speed["full"].index
    memory = medians(rows, "memory", "full").reindex(index)
    peers = {baseline: baseline, "Liger": "liger", "TRL head": "trl"}
    table = pd.DataFrame(index=index)
    for mode, times in speed.items():
        times = times.reindex(index)
        ours = _provider(times, provider)
        table[f"{mode} ms"] = ours
        for label, peer in peers.items():
            if label != "TRL head" or "trl" in times:
                table[f"{mode} / {label}"] = ours / _provider(times, peer)
    table["memory MB"] = _provider(memory, provider)
    for label, peer in peers.items():
        if label != "TRL head" or "trl" in memory:
            table[f"memory / {label}"] = table["memory MB"] / _provider(memory, peer)
    for label, (column, bound) in targets.items():
        table[label] = (table[column] <= bound).where(table[column].notna())
    return table
