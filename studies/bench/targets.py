"""The bounds we hold kernels_lib to in our performance studies, and the tables that judge a run against them.

Each ``*_TARGETS`` table maps a label to ``(ratio column, bound)`` of a targets table (an upper bound, or a
lower one with a third element ``"at least"``); the ``*_targets`` functions build those tables per x from
rows of one GPU, and :func:`target_verdicts` sums one up (met at every x, missed at some, not measured).
The ratios themselves come from the workbench (:mod:`kernels_workbench.bench.analysis`: medians, achieved
bandwidth, :func:`~kernels_workbench.bench.analysis.preference_targets`); the bounds are ours, kept here
rather than in the product's reports.
"""

from __future__ import annotations

import json

import pandas as pd

from kernels_workbench import data
from kernels_workbench.bench.analysis import _one_run, _provider, achieved_bandwidth, medians, preference_targets
from kernels_workbench.bench.fused_linear_cross_entropy import flops


def _meets(values: pd.Series, bound: float, kind: tuple) -> pd.Series:
    """Whether each value meets ``bound`` (an upper bound, or a lower one when ``kind`` is ``("at least",)``)."""
    return values >= bound if kind == ("at least",) else values <= bound


def target_verdicts(table: pd.DataFrame, targets: dict | None = None) -> pd.DataFrame:
    """One row per ``targets`` entry (label → (ratio column, bound), an upper bound unless a third
    element ``"at least"`` makes it a lower one; :data:`FLCE_TARGETS` by default) of a targets table:
    the bound, the worst and best ratio over x (the largest and smallest for an upper bound, the other
    way round for a lower one), and ``met`` (at every x), ``missed`` (at some x) or ``not measured``
    (no ratio at any x)."""
    rows = []
    for label, (column, bound, *kind) in (FLCE_TARGETS if targets is None else targets).items():
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


# --------------------------------------------------------------------------- row divergences (KL, JSD, TVD)


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


def row_divergence_targets(rows: pd.DataFrame, kernel_name: str, copy_gbps: float, targets: dict = DIVERGENCE_TARGETS) -> pd.DataFrame:
    """A row divergence's targets (KL, JSD, TVD) per x, from rows of one GPU: the bandwidth that
    kernels_lib's ``forward`` and ``forward_no_grad`` achieve and its fraction of ``copy_gbps`` (the
    copy measured in the same run), its ``full`` time and memory over Liger's (NaN where Liger was
    not measured), and one True / False / NaN column per ``targets`` entry. Measured rows must be of one
    run (refused otherwise)."""
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


# --------------------------------------------------------------------------- fused linear cross-entropy


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


# --------------------------------------------------------------------------- the preference losses


#: The targets of ORPO and KTO (one GPU, same run): label → (ratio column of
#: :func:`~kernels_workbench.bench.analysis.preference_targets`, upper bound).
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


def preference_head_targets(baseline: str) -> dict:
    """The targets of DPO, CPO, SimPO and GRPO (one GPU, same run): ``full`` ≤ 0.8× Liger's and
    ≤ 0.85× the baseline's (``huggingface``, or ``torch`` for GRPO) at every B, ``full`` memory ≤ Liger's."""
    return {
        "full ≤ 0.8× Liger": ("full / Liger", 0.8),
        f"full ≤ 0.85× {baseline}": (f"full / {baseline}", 0.85),
        "memory full ≤ Liger": ("memory / Liger", 1.0),
    }


def orpo_targets(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """:func:`~kernels_workbench.bench.analysis.preference_targets` with :data:`ORPO_TARGETS`: ``full``
    ≤ 0.85× huggingface and ≤ 0.8× Liger, ``full`` memory ≤ Liger's."""
    return preference_targets(rows, ORPO_TARGETS, provider)


def kto_targets(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """:func:`~kernels_workbench.bench.analysis.preference_targets` with :data:`KTO_TARGETS`: ``full``
    ≤ 0.6× Liger, ``forward`` ≤ 0.9× huggingface, ``full`` memory ≤ Liger's."""
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
