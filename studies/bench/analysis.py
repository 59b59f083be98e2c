"""The fused cross-entropy's frontier and past-the-floor readings, for the studies.

The frontier: the default against the fastest peer per number of tokens, in time and memory, and its
no-grad forward against QuACK's (:func:`frontier_targets`). Past the floor: ``full`` over the three
matmuls measured in the same run, over QuACK's and torch's ``F.linear_cross_entropy`` (:func:`past_floor_targets`),
and what a bound under the floor asks of the GEMMs (:func:`past_floor_rates`). The bounds are our own
study targets, kept here rather than in the product's reports.
"""

from __future__ import annotations

import json

import pandas as pd

from kernels_workbench.bench.analysis import _one_run, _provider, medians
from kernels_workbench.bench.fused_linear_cross_entropy import FLOOR, TORCH_LCE_POLICIES, flops


#: The frontier's targets (the default on the speed-memory frontier; one GPU, same run): label → (ratio
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
    """The frontier's targets per number of tokens (:data:`FRONTIER_TARGETS`), from rows of one GPU, for
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


#: The past-the-floor targets (past the cuBLAS floor; one GPU, same run): label → (ratio column of
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
    """The past-the-floor targets per number of tokens (:data:`PAST_FLOOR_TARGETS`), from rows of one run
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
    the same run by ``python -m studies.flce_frontier --parts past_floor``; NaN for a run without it). A needed rate
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
