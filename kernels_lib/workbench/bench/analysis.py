"""Reading measured rows: medians side by side, ratios between providers, achieved bandwidth.

These are what the notebooks state targets with, so they are library code (and unit-tested), not
notebook cells.
"""

from __future__ import annotations

import json

import pandas as pd
import torch

from .. import data
from .fused_linear_cross_entropy import FLOOR, TORCH_LCE_POLICIES, flops
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


#: The KL issue's targets (one GPU, same run): label → (ratio column of :func:`row_divergence_targets`,
#: bound); ``"at least"`` as a third element makes the bound a lower one.
KL_DIV_TARGETS = {
    "bandwidth ≥ 0.9": ("forward / copy", 0.9, "at least"),
    "full ≤ 0.6× Liger": ("full / Liger", 0.6),
    "memory ≤ Liger": ("memory / Liger", 1.0),
}
#: Issue 12's targets for the logits-level JSD and TVD, at every point of a chart.
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
    """The KL issue's targets per V (:data:`KL_DIV_TARGETS`): forward bandwidth ≥ 90% of the copy
    bandwidth; ``full`` time ≤ 0.6× Liger's; ``full`` memory ≤ Liger's."""
    return row_divergence_targets(rows, "kl_div", copy_gbps, KL_DIV_TARGETS)


def achieved_tflops(rows: pd.DataFrame, provider: str, mode: str) -> pd.Series:
    """TFLOP/s of ``provider`` in ``mode`` for fused linear cross-entropy: the matmul FLOPs that
    ``mode`` needs (:func:`kernels_lib.workbench.bench.fused_linear_cross_entropy.flops`, ``2·N·H·V`` per
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


#: The targets of issue 3 (fused linear cross-entropy, on one GPU, same run): column of
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
    """Issue 3's targets per number of tokens, from rows of one GPU, for ``provider`` (the default
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


#: Issue 14's targets (the default on the speed-memory frontier; one GPU, same run): label → (ratio
#: column of :func:`frontier_targets`, upper bound).
FRONTIER_TARGETS = {
    "full ≤ 1.0× fastest peer": ("full / fastest peer", 1.0),
    "memory full ≤ 0.6× fastest peer's": ("memory / fastest peer", 0.6),
    "forward_no_grad ≤ 1.0× QuACK": ("forward_no_grad / QuACK", 1.0),
}


def _base_name(provider: str) -> str:
    """``kernels_lib[chunk_size=2048 accurate=False]`` → ``kernels_lib``: a point of a dial and its provider."""
    return provider.split("[", 1)[0]


def frontier_targets(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """Issue 14's targets per number of tokens (:data:`FRONTIER_TARGETS`), from rows of one GPU, for
    ``provider`` (the default, or a point of its dial).

    The peers are every provider measured in ``full`` that is not ``provider``'s own (so neither
    ``provider`` nor the points of its dial, ``kernels_lib[…]``, nor the floor's three matmuls): torch,
    Liger, CCE, Liger's CuTe DSL kernel, QuACK, torch's ``F.linear_cross_entropy``, whichever were measured. Per x: the fastest peer in ``full`` (its name, median time
    and ``full`` memory), ``provider``'s ``full`` time and memory and their ratios to that peer's,
    ``provider``'s ``forward_no_grad`` time and its ratio to QuACK's, and one True / False / NaN
    column per target (NaN where no peer, or QuACK, was measured at that x).
    """
    speed_full = medians(rows, "speed", "full")
    index = speed_full.index
    memory_full = medians(rows, "memory", "full").reindex(index)
    speed_fwd = medians(rows, "speed", "forward_no_grad").reindex(index)
    own = _base_name(provider)
    peers = speed_full[[c for c in speed_full.columns if _base_name(c) != own and c != FLOOR]]  # the floor is no peer
    fastest = pd.Series([times.idxmin() if times.notna().any() else None for _, times in peers.iterrows()], index=index, dtype=object)

    def at_fastest(table: pd.DataFrame) -> pd.Series:
        """The fastest peer's value of ``table`` at each x, NaN where there is none."""
        values = [table.at[x, peer] if peer is not None and peer in table.columns else float("nan") for x, peer in fastest.items()]
        return pd.Series(values, index=index, dtype=float)

    table = pd.DataFrame(index=index)
    table["fastest peer"] = fastest
    table["full ms"] = _provider(speed_full, provider)
    table["peer full ms"] = at_fastest(speed_full)
    table["full / fastest peer"] = table["full ms"] / table["peer full ms"]
    table["memory MB"] = _provider(memory_full, provider)
    table["peer memory MB"] = at_fastest(memory_full)
    table["memory / fastest peer"] = table["memory MB"] / table["peer memory MB"]
    table["forward_no_grad ms"] = _provider(speed_fwd, provider)
    table["QuACK forward_no_grad ms"] = _provider(speed_fwd, "quack")
    table["forward_no_grad / QuACK"] = table["forward_no_grad ms"] / table["QuACK forward_no_grad ms"]
    for label, (column, bound) in FRONTIER_TARGETS.items():
        table[label] = (table[column] <= bound).where(table[column].notna())
    return table


#: Issue 30's targets (past the cuBLAS floor; one GPU, same run): label → (ratio column of
#: :func:`past_floor_targets`, upper bound).
TORCH_LCE, TORCH_LCE_ACCURATE = list(TORCH_LCE_POLICIES)
PAST_FLOOR_TARGETS = {
    "full ≤ 0.92× three matmuls": ("full / three matmuls", 0.92),
    "full ≤ 0.95× QuACK": ("full / QuACK", 0.95),
    "memory full ≤ 0.6× QuACK's": ("memory / QuACK", 0.6),
    "forward_no_grad ≤ 0.9× QuACK": ("forward_no_grad / QuACK", 0.9),
    "full ≤ 0.8× torch LCE": ("full / torch LCE", 0.8),
    "memory full ≤ torch LCE's": ("memory / torch LCE", 1.0),
    "full ≤ 0.8× torch LCE (accurate)": ("full / torch LCE (accurate)", 0.8),
    "memory full ≤ torch LCE's (accurate)": ("memory / torch LCE (accurate)", 1.0),
}


def past_floor_targets(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """Issue 30's targets per number of tokens (:data:`PAST_FLOOR_TARGETS`), from rows of one run
    (refused otherwise, :func:`_one_run`): ``provider``'s ``full`` time over the floor measured in the
    run (:data:`~.fused_linear_cross_entropy.FLOOR`, the three matmuls alone) and over QuACK's and
    torch's ``F.linear_cross_entropy`` (default options and ``acc_policy="accurate"``), and, shown
    without a target, over Liger's CuTe DSL kernel's and CCE's; its ``full`` memory over theirs, its
    ``forward_no_grad`` over QuACK's; one True / False / NaN column per target
    (NaN where the run did not measure that provider: "not measured", never another run's)."""
    rows = _one_run(rows)
    speed_full = medians(rows, "speed", "full")
    index = speed_full.index
    memory_full = medians(rows, "memory", "full").reindex(index)
    speed_fwd = medians(rows, "speed", "forward_no_grad").reindex(index)
    table = pd.DataFrame(index=index)
    table["full ms"] = _provider(speed_full, provider)
    table["three matmuls ms"] = _provider(speed_full, FLOOR)
    table["full / three matmuls"] = table["full ms"] / table["three matmuls ms"]
    table["full / QuACK"] = table["full ms"] / _provider(speed_full, "quack")
    table["memory MB"] = _provider(memory_full, provider)
    table["memory / QuACK"] = table["memory MB"] / _provider(memory_full, "quack")
    table["forward_no_grad / QuACK"] = _provider(speed_fwd, provider) / _provider(speed_fwd, "quack")
    for name, label in ((TORCH_LCE, "torch LCE"), (TORCH_LCE_ACCURATE, "torch LCE (accurate)"),
                        ("liger_sm90", "Liger CuTe"), ("cce", "CCE")):
        table[f"full / {label}"] = table["full ms"] / _provider(speed_full, name)
        table[f"memory / {label}"] = table["memory MB"] / _provider(memory_full, name)
    for label, (column, bound) in PAST_FLOOR_TARGETS.items():
        table[label] = (table[column] <= bound).where(table[column].notna())
    return table


def past_floor_rates(rows: pd.DataFrame, bound: float = PAST_FLOOR_TARGETS["full ≤ 0.92× three matmuls"][1]) -> pd.DataFrame:
    """What ``full`` ≤ ``bound``× the measured floor asks of the GEMMs, per number of tokens, from rows of one
    run: the rate at which cuBLAS ran the three products in the run (their FLOPs, :func:`.fused_linear_cross_entropy.flops`,
    over the floor's median time), the rate ``bound`` × that time needs (the products cannot be skipped), and
    both over the run's square-product rate (``matmul_tflops``: a bf16 8192³ product through cuBLAS, measured in
    the same run by ``scripts/flce_frontier.py --parts past_floor``; NaN for a run without it). A needed rate
    above the square product's asks for GEMMs faster on these shapes than cuBLAS is on its best one."""
    rows = _one_run(rows)
    floor = rows[(rows.kernel_provider == FLOOR) & (rows.kernel_operation_mode == "full") & (rows.metric_name == "speed")]
    square = float(rows.matmul_tflops.max()) if "matmul_tflops" in rows.columns else float("nan")
    columns = ["x_value", "three matmuls ms", "three matmuls TFLOP/s", f"{bound}× needs TFLOP/s", "square 8192³ TFLOP/s",
               "three matmuls / square", f"{bound}× needs / square"]
    out = []
    for _, row in floor.sort_values("x_value").iterrows():
        sizes = {**json.loads(row.extra_benchmark_config_str), "BT": int(row.x_value)}
        rate = flops(sizes, "full") / (row.y_value_50 * 1e-3) / 1e12
        out.append([row.x_value, row.y_value_50, rate, rate / bound, square, rate / square, rate / bound / square])
    return pd.DataFrame(out, columns=columns).set_index("x_value")  # empty where the run has no floor row


def past_floor_rate_ranges(rates: pd.DataFrame) -> dict[str, str | None]:
    """The ranges over N of a :func:`past_floor_rates` table as text, for the notebook and the dashboard
    alike: ``ran`` and ``needs`` (TFLOP/s, whole numbers), ``ran / square`` and ``needs / square`` (two
    decimals) and ``square`` (TFLOP/s), the last three None where the run measured no square product."""
    def span(column: str, digits: int) -> str:
        return f"{rates[column].min():.{digits}f}–{rates[column].max():.{digits}f}"

    bound = next(c for c in rates.columns if c.endswith("× needs TFLOP/s")).split("×")[0]
    has_square = bool(rates["square 8192³ TFLOP/s"].notna().any())
    return {"ran": span("three matmuls TFLOP/s", 0), "needs": span(f"{bound}× needs TFLOP/s", 0),
            "ran / square": span("three matmuls / square", 2) if has_square else None,
            "needs / square": span(f"{bound}× needs / square", 2) if has_square else None,
            "square": f"{rates['square 8192³ TFLOP/s'].iloc[0]:.0f}" if has_square else None}


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


#: Issue 4's targets (ORPO and KTO, one GPU, same run): label → (ratio column of
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
    :func:`issue13_targets`). Measured rows must be of one run (refused otherwise: :func:`_one_run`)."""
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


def issue13_targets(baseline: str) -> dict:
    """Issue 13's targets (DPO, CPO, SimPO, GRPO; one GPU, same run): ``full`` ≤ 0.8× Liger's and
    ≤ 0.85× the baseline's (``huggingface``, or ``torch`` for GRPO) at every B, ``full`` memory ≤ Liger's."""
    return {
        "full ≤ 0.8× Liger": ("full / Liger", 0.8),
        f"full ≤ 0.85× {baseline}": (f"full / {baseline}", 0.85),
        "memory full ≤ Liger": ("memory / Liger", 1.0),
    }


def distillation_targets(baseline: str = "torch") -> dict:
    """Issue 12's targets for the fused two-head losses (``fused_linear_jsd``, ``distill_jsd_loss``,
    ``distill_cosine_loss``; one GPU, same run), for :func:`preference_targets`: ``full`` ≤ 0.8× Liger's
    and ≤ 0.85× the ``baseline``'s (``torch``: both heads' logits materialized) at every BT, ``full``
    memory ≤ Liger's: the bounds of :func:`issue13_targets`."""
    return issue13_targets(baseline)


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


def later_default_against(frontier: pd.DataFrame, later: pd.DataFrame, peer: str = "quack",
                          anchor: str = "torch") -> pd.DataFrame:
    """A later commit's default (``later``: rows of ``kernels_lib`` and ``anchor``, one run) against
    ``peer`` as the ``frontier`` run measured it, per (mode, N) of ``later``: both times, their ratio,
    and the ``anchor`` (measured in both runs) in each with its drift ``later / frontier``, which says
    how far a ratio across the two runs can be trusted (a GPU or clock difference moves the anchor too)."""
    rows = []
    for mode in sorted(later.kernel_operation_mode.unique()):
        ours, theirs = medians(later, "speed", mode), medians(frontier, "speed", mode)
        for n in ours.index:
            peer_ms = theirs.at[n, peer] if peer in theirs and n in theirs.index else float("nan")
            anchor_now = ours.at[n, anchor] if anchor in ours else float("nan")
            anchor_then = theirs.at[n, anchor] if anchor in theirs and n in theirs.index else float("nan")
            rows.append({"mode": mode, "N": n, "kernels_lib ms": ours.at[n, "kernels_lib"], f"{peer} ms": peer_ms,
                         f"kernels_lib / {peer}": ours.at[n, "kernels_lib"] / peer_ms,
                         f"{anchor} ms (later run)": anchor_now, f"{anchor} ms ({peer}'s run)": anchor_then,
                         f"{anchor} drift": anchor_now / anchor_then})
    return pd.DataFrame(rows).set_index(["mode", "N"])
