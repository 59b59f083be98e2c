"""What a reader asks of one measured run, per x: kernels_lib's time over each peer's, over the fastest
peer's and over the loss's floor, and its memory over the leanest peer's.

Every ratio is taken inside one run on one GPU (the rows of one ``kernels_lib_commit`` and ``gpu_name``,
refused otherwise), and the floor is computed from the ceilings that **same** run measured: the longer
of the loss's matmul FLOPs at the measured matmul rate and its minimal bytes at the measured copy
bandwidth (:func:`.overview.floor_ms`). A run that measured no ceilings has no floor here ("not
measured"), never another run's. Memory is peak allocated minus the inputs; a peer that allocates
under 1 MB beyond its inputs (Liger's cross-entropy writes the gradient over the logits) has no memory
ratio: a ratio to ~0 says nothing.

:func:`comparison` is the table the notebooks print under each published chart; :func:`summary`
says its extremes in one line per GPU.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import torch

from . import data
from .bench.analysis import ceiling_run, medians
from .bench.fused_linear_cross_entropy import FLOOR
from .bench.registry import get_spec
from .overview import floor_ms as one_floor

#: Below this many MB beyond its inputs a peer's memory is not a base for a ratio.
MIN_PEER_MB = 1.0


def peers_of(run: pd.DataFrame, ours: str = "kernels_lib") -> list[str]:
    """The providers ``ours`` is compared with: every other provider with a ``full`` time in the run, except
    other configurations of any provider (names with ``[``: dial points, ``accurate=True``, ``TP=2``) and the
    measured floor."""
    speed = medians(run, "speed", "full")
    return [p for p in speed.columns if p != ours and "[" not in p and p != FLOOR]


def run_rates(run: pd.DataFrame, ceilings: pd.DataFrame) -> dict[str, float]:
    """The ``copy`` (GB/s) and ``matmul`` (TFLOP/s) ceilings measured in the run's own run (commit and GPU);
    a ceiling that run did not measure is absent."""
    return own_rates(ceilings, str(run.gpu_name.iloc[0]), data.run_commit(run))


def own_rates(ceilings: pd.DataFrame, gpu_name: str, commit: str | None) -> dict[str, float]:
    """The ``copy`` and ``matmul`` ceilings measured on ``gpu_name`` in the run of ``commit`` itself (never the
    newest run's, which :func:`~.bench.analysis.ceiling_run` falls back to); a ceiling it did not measure is absent."""
    rates = {}
    for name in ("copy", "matmul"):
        try:
            rate, measured_in = ceiling_run(ceilings, name, gpu_name, commit)
        except ValueError:
            continue
        if measured_in == str(commit):
            rates[name] = rate
    return rates


def floor_ms(run: pd.DataFrame, ceilings: pd.DataFrame, kernel_name: str | None = None, mode: str = "full") -> pd.Series:
    """Per x of the run, the least time ``mode`` can take on its GPU (:func:`.overview.floor_ms` at the x's own
    sizes and dtype, with the run's own ceilings, :func:`run_rates`); the floor's own measured time where the
    run timed it (:data:`~.bench.fused_linear_cross_entropy.FLOOR`); NaN where the run measured no ceilings
    or the loss has no bench spec."""
    times = medians(run, "speed", mode)
    if FLOOR in times:
        return times[FLOOR].rename("floor ms")
    kernel_name = kernel_name or str(run.kernel_name.iloc[0])
    rates = run_rates(run, ceilings)
    out = pd.Series(math.nan, index=times.index, name="floor ms", dtype=float)
    try:
        get_spec(kernel_name)
    except ValueError:
        return out
    if not {"copy", "matmul"} <= set(rates):
        return out
    for x in times.index:
        point = run[run.x_value == x]
        config = json.loads(point.extra_benchmark_config_str.iloc[0])
        x_name = str(point.x_name.iloc[0])
        sizes = {**{k: v for k, v in config.items() if k[:1].isupper() and isinstance(v, int)}, x_name: int(x)}
        dtype = getattr(torch, str(config.get("dtype", "torch.float32")).replace("torch.", ""))
        out[x] = one_floor(kernel_name, sizes, dtype, mode, rates["copy"], rates["matmul"])[0]
    return out


def comparison(run: pd.DataFrame, ceilings: pd.DataFrame, *, ours: str = "kernels_lib", kernel_name: str | None = None) -> pd.DataFrame:
    """Per x (index, named after the run's axis) of one run: ``ours``' ``full`` time in ms, its time over each
    peer's (``× <peer>``), the fastest peer and the time over its (``× fastest peer``), over the floor
    (:func:`floor_ms`, ``× floor``), ``ours``' memory in MB, the leanest peer and the memory over its
    (``memory × leanest``). NaN where a provider was not measured at that x. Rows of two runs are refused
    (``ValueError`` naming them, :func:`.data.run_label`)."""
    if not len(run):
        raise ValueError("comparison: no rows (expected the rows of one measured run)")
    data.run_label(run)  # refuses two runs
    speed, memory = medians(run, "speed", "full"), medians(run, "memory", "full")
    if ours not in speed:
        raise ValueError(f"comparison: ours={ours!r} has no full time in the run (providers: {sorted(speed.columns)})")
    peers = peers_of(run, ours)
    table = pd.DataFrame(index=speed.index)
    table["kernels_lib ms" if ours == "kernels_lib" else f"{ours} ms"] = speed[ours]
    for peer in peers:
        table[f"× {peer}"] = speed[ours] / speed[peer]
    fastest = speed[peers].dropna(how="all") if peers else pd.DataFrame()
    table["fastest peer"] = fastest.idxmin(axis=1).reindex(table.index) if len(fastest) else None
    table["× fastest peer"] = speed[ours] / speed[peers].min(axis=1) if peers else math.nan
    table["× floor"] = speed[ours] / floor_ms(run, ceilings, kernel_name).reindex(table.index)
    memory = memory.reindex(table.index)
    table["kernels_lib MB" if ours == "kernels_lib" else f"{ours} MB"] = memory.get(ours)
    lean = memory[[p for p in peers if p in memory]].where(lambda m: m >= MIN_PEER_MB).dropna(how="all")
    table["leanest peer"] = lean.idxmin(axis=1).reindex(table.index) if len(lean) else None
    table["memory × leanest"] = (memory.get(ours) / lean.min(axis=1).reindex(table.index)) if len(lean) and ours in memory else math.nan
    table.index.name = str(run.x_name.iloc[0]) if "x_name" in run else "x"
    return table


def _span(values) -> str:
    finite = [float(v) for v in values if pd.notna(v)]
    if not finite:
        return "not measured"
    low, high = f"{min(finite):.2f}", f"{max(finite):.2f}"
    return f"{low}×" if low == high else f"{low}–{high}×"


def summary(tables: dict[str, pd.DataFrame]) -> str:
    """One markdown bullet per GPU (``tables``: GPU name → its :func:`comparison`): the range over x of
    kernels_lib's time over the fastest peer's, over the floor, and its memory over the leanest peer's."""
    if not tables:
        return "Not measured on a GPU yet: no comparison to state."
    lines = []
    for gpu, table in tables.items():
        xs = sorted(int(x) if float(x).is_integer() else x for x in table.index)
        where = f"{table.index.name} = {xs[0]}" if len(xs) == 1 else f"{table.index.name} = {xs[0]}–{xs[-1]}"
        said = [f"{_span(table[column])} {what}" if table[column].notna().any() else missing
                for column, what, missing in (("× fastest peer", "the fastest peer's time", "no peer measured"),
                                              ("× floor", "the floor", "no floor (the run measured no ceilings)"),
                                              ("memory × leanest", "the leanest peer's memory", "no peer's memory measured"))]
        lines.append(f"- **{data.gpu_label(gpu)}** ({where}): " + ", ".join(said) + ".")
    return "\n".join(lines)
