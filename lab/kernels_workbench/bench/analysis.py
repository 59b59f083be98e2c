"""Reading measured rows: medians side by side, the measured ceilings, achieved bandwidth and rate.

The notebooks and the index compare runs through these (:mod:`kernels_workbench.comparison`). The
``*_targets`` tables and :func:`target_verdicts` judge a run against the bounds we hold kernels_lib to in
our own performance work (``studies/``, the bench scripts); no report prints them.
"""

from __future__ import annotations

import json

import pandas as pd
import torch

from .. import data
from .fused_linear_cross_entropy import flops
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


#: The KL divergence's targets (one GPU, same run): label → (ratio column of :func:`row_divergence_targets`,
#: bound); ``"at least"`` as a third element makes the bound a lower one.
KL_DIV_TARGETS = {
    "bandwidth ≥ 0.9": ("forward / copy", 0.9, "at least"),
    "full ≤ 0.6× Liger": ("full / Liger", 0.6),
    "memory ≤ Liger": ("memory / Liger", 1.0),
}
#: The targets for the logits-level JSD and TVD, at every point of a chart.
DIVERGENCE_TARGETS = {
    "full ≤ 0.6× Liger": ("full / Liger", 0.6),
    "forward ≥ 0.9× copy bandwidth": ("forward / copy", 0.9, "at least"),
}


def _meets(values: pd.Series, bound: float, kind: tuple) -> pd.Series:
    """Whether each value meets ``bound`` (an upper bound, or a lower one when ``kind`` is ``("at least",)``)."""
    return values >= bound if kind == ("at least",) else values <= bound


def row_divergence_targets(rows: pd.DataFrame, kernel_name: str, copy_gbps: float, targets: dict = DIVERGENCE_TARGETS) -> pd.DataFrame:
    """A row divergence's targets (KL, JSD, TVD) per x, from rows of one GPU: the bandwidth that
    kernels_lib's ``forward`` and ``forward_no_grad`` achieve and its fraction of ``copy_gbps`` (the
    copy measured in the same run), its ``full`` time and memory over Liger's (NaN where Liger was
    not measured), and one True / False / NaN column per ``targets`` entry. Measured rows must be of one
    run (refused otherwise: :func:`_one_run`)."""
    _one_run(rows)
    speed_full = medians(rows, "speed", "full")
    memory_full = medians(rows, "memory", "full").reindex(speed_full.index)
    table = pd.DataFrame(index=speed_full.index)
    for mode in ("forward", "forward_no_grad"):
        bandwidth = achieved_bandwidth(rows, kernel_name, "kernels_lib", mode).reindex(speed_full.index)
        table[f"{mode} GB/s"] = bandwidth
        table[f"{mode} / copy"] = bandwidth / copy_gbps
    table["full ms"] = speed_full["kernels_lib"]
    table["Liger full ms"] = _provider(speed_full, "liger")
    table["full / Liger"] = table["full ms"] / table["Liger full ms"]
    table["memory / Liger"] = _provider(memory_full, "kernels_lib") / _provider(memory_full, "liger")
    for label, (column, bound, *kind) in targets.items():
        table[label] = _meets(table[column], bound, tuple(kind)).where(table[column].notna())
    return table


def kl_div_targets(rows: pd.DataFrame, copy_gbps: float) -> pd.DataFrame:
    """The KL divergence's targets per V (:data:`KL_DIV_TARGETS`): forward bandwidth ≥ 90% of the copy
    bandwidth; ``full`` time ≤ 0.6× Liger's; ``full`` memory ≤ Liger's."""
    return row_divergence_targets(rows, "kl_div", copy_gbps, KL_DIV_TARGETS)


def achieved_tflops(rows: pd.DataFrame, provider: str, mode: str) -> pd.Series:
    """TFLOP/s of ``provider`` in ``mode`` for fused linear cross-entropy: the matmul FLOPs that
    ``mode`` needs (:func:`kernels_workbench.bench.fused_linear_cross_entropy.flops`, ``2·N·H·V`` per
    product) over the median time, per x. Comparable across providers: it counts the floor's
    FLOPs, not what a provider happens to do (a recomputed matmul lowers the figure)."""
    selected = rows[
        (rows.metric_name == "speed") & (rows.kernel_operation_mode == mode) & (rows.kernel_provider == provider)
    ]
    result = {}
    for _, row in selected.iterrows():
        config = json.loads(row.extra_benchmark_config_str)
        sizes = {"N": row.x_value, "H": config["H"], "V": config["V"]}
        result[row.x_value] = flops(sizes, mode) / (row.y_value_50 * 1e-3) / 1e12
    return pd.Series(result, name=f"{provider} {mode} TFLOP/s", dtype=float).sort_index()


#: The targets of the fused linear cross-entropy (one GPU, same run): column of
#: :func:`fused_linear_cross_entropy_targets` holding the ratio, and its upper bound.
FLCE_TARGETS = {
    "full ≤ 0.85× torch": ("full / torch", 0.85),
    "full ≤ 0.6× Liger": ("full / Liger", 0.6),
    "full ≤ 0.5× CCE": ("full / CCE", 0.5),
    "forward_no_grad ≤ 1.0× CCE": ("forward_no_grad / CCE", 1.0),
    "forward_no_grad ≤ 0.8× torch": ("forward_no_grad / torch", 0.8),
    "memory full ≤ 1.1× Liger": ("memory / Liger", 1.1),
}


def _provider(table: pd.DataFrame, name: str) -> pd.Series:
    """One provider's column of a :func:`medians` table, NaN where it was not measured."""
    return table[name] if name in table.columns else pd.Series(float("nan"), index=table.index)


def fused_linear_cross_entropy_targets(
    rows: pd.DataFrame, matmul_tflops: float, provider: str = "kernels_lib"
) -> pd.DataFrame:
    """The fused cross-entropy's targets per number of tokens, from rows of one GPU, for ``provider`` (the default
    mode, or a point of the dial such as ``kernels_lib[accurate=False]``).

    Ratio columns (time or memory of ``provider`` over a peer's; NaN where the peer was not
    measured), achieved TFLOP/s of ``full`` and its fraction of the matmul ceiling ``matmul_tflops``
    (measured in the same run), and one column per :data:`FLCE_TARGETS` entry: True / False, or NaN
    where the ratio is unknown.
    """
    speed_full = medians(rows, "speed", "full")
    speed_fwd = medians(rows, "speed", "forward_no_grad")
    memory_full = medians(rows, "memory", "full")
    ours_full = _provider(speed_full, provider)
    ours_fwd = _provider(speed_fwd, provider).reindex(speed_full.index)
    table = pd.DataFrame(index=speed_full.index)
    table["full ms"] = ours_full
    table["full / torch"] = ours_full / _provider(speed_full, "torch")
    table["full / Liger"] = ours_full / _provider(speed_full, "liger")
    table["full / CCE"] = ours_full / _provider(speed_full, "cce")
    table["forward_no_grad ms"] = ours_fwd
    table["forward_no_grad / CCE"] = ours_fwd / _provider(speed_fwd, "cce").reindex(speed_full.index)
    table["forward_no_grad / torch"] = ours_fwd / _provider(speed_fwd, "torch").reindex(speed_full.index)
    memory = memory_full.reindex(speed_full.index)
    table["memory MB"] = _provider(memory, provider)
    table["memory / Liger"] = _provider(memory, provider) / _provider(memory, "liger")
    tflops = achieved_tflops(rows, provider, "full").reindex(speed_full.index)
    table["full TFLOP/s"] = tflops
    table["full / matmul ceiling"] = tflops / matmul_tflops
    for label, (column, bound) in FLCE_TARGETS.items():
        table[label] = (table[column] <= bound).where(table[column].notna())
    return table


def target_verdicts(table: pd.DataFrame, targets: dict = FLCE_TARGETS) -> pd.DataFrame:
    """One row per ``targets`` entry (label → (ratio column, bound), an upper bound unless a third
    element ``"at least"`` makes it a lower one; :data:`FLCE_TARGETS` by default) of a targets table:
    the bound, the worst and best ratio over x (the largest and smallest for an upper bound, the other
    way round for a lower one), and ``met`` (at every x), ``missed`` (at some x) or ``not measured``
    (no ratio at any x)."""
    rows = []
    for label, (column, bound, *kind) in targets.items():
        ratios = table[column].dropna()
        lower = tuple(kind) == ("at least",)
        if not len(ratios):
            status = "not measured"
        else:
            status = "met" if _meets(ratios, bound, tuple(kind)).all() else "missed"
        worst_at = (ratios.idxmin() if lower else ratios.idxmax()) if len(ratios) else None
        rows.append(
            {
                "target": label,
                "bound": bound,
                "worst ratio": ratios[worst_at] if len(ratios) else float("nan"),
                "best ratio": (ratios.max() if lower else ratios.min()) if len(ratios) else float("nan"),
                "worst at x": worst_at,
                "status": status,
            }
        )
    return pd.DataFrame(rows).set_index("target")


#: The targets of ORPO and KTO (one GPU, same run): label → (ratio column of
#: :func:`preference_targets`, upper bound).
ORPO_TARGETS = {
    "full ≤ 0.85× huggingface": ("full / huggingface", 0.85),
    "full ≤ 0.8× Liger": ("full / Liger", 0.8),
    "memory full ≤ Liger": ("memory / Liger", 1.0),
}
KTO_TARGETS = {
    "full ≤ 0.6× Liger": ("full / Liger", 0.6),
    "forward ≤ 0.9× huggingface": ("forward / huggingface", 0.9),
    "memory full ≤ Liger": ("memory / Liger", 1.0),
}


def preference_targets(rows: pd.DataFrame, targets: dict, provider: str = "kernels_lib", baseline: str = "huggingface") -> pd.DataFrame:
    """The targets of a preference chart per batch size, from rows of one GPU: ``provider``'s median
    time of ``forward`` and ``full`` and its ``full`` memory, their ratios to the ``baseline``'s, Liger's
    and (where measured) TRL's fused-head path's (NaN where a peer was not measured or failed), and one
    True / False / NaN column per ``targets`` entry (:data:`ORPO_TARGETS`, :data:`KTO_TARGETS`,
    :func:`preference_head_targets`). Measured rows must be of one run (refused otherwise: :func:`_one_run`)."""
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


def preference_head_targets(baseline: str) -> dict:
    """The targets of DPO, CPO, SimPO and GRPO (one GPU, same run): ``full`` ≤ 0.8× Liger's and
    ≤ 0.85× the baseline's (``huggingface``, or ``torch`` for GRPO) at every B, ``full`` memory ≤ Liger's."""
    return {
        "full ≤ 0.8× Liger": ("full / Liger", 0.8),
        f"full ≤ 0.85× {baseline}": (f"full / {baseline}", 0.85),
        "memory full ≤ Liger": ("memory / Liger", 1.0),
    }


def orpo_targets(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """:func:`preference_targets` with :data:`ORPO_TARGETS`: ``full`` ≤ 0.85× huggingface and
    ≤ 0.8× Liger, ``full`` memory ≤ Liger's."""
    return preference_targets(rows, ORPO_TARGETS, provider)


def kto_targets(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """:func:`preference_targets` with :data:`KTO_TARGETS`: ``full`` ≤ 0.6× Liger, ``forward``
    ≤ 0.9× huggingface, ``full`` memory ≤ Liger's."""
    return preference_targets(rows, KTO_TARGETS, provider)


def verdicts_by_run(rows: pd.DataFrame, targets: dict, provider: str = "kernels_lib", baseline: str = "huggingface") -> pd.DataFrame:
    """:func:`target_verdicts` of each run in ``rows`` (all rows of one GPU, not only the newest: a
    run is the rows of one ``kernels_lib_commit`` on one GPU, every provider measured in it), oldest run first.
    One row per (run, target): the run's commit and date, the bound, worst and best ratio over x,
    where the worst is, and the status. Targets near their bound can be met in one run and missed in
    the next; this table shows by how much they move."""
    tables = []
    for commit, gpu_name in data.runs(rows):
        run = data.one_run(rows, commit, gpu_name)
        verdicts = target_verdicts(preference_targets(run, targets, provider, baseline), targets)
        tables.append(verdicts.assign(commit=commit, date=run.timestamp.min()).reset_index())
    if not tables:
        return pd.DataFrame(columns=["date", "commit", "target", "bound", "worst ratio", "best ratio", "worst at x", "status"])
    table = pd.concat(tables).sort_values(["date", "target"], kind="stable")
    return table[["date", "commit", "target", "bound", "worst ratio", "best ratio", "worst at x", "status"]].reset_index(drop=True)
