"""Sentences generated from measured rows: the headlines and conclusions the notebooks print.

Every figure a notebook states in prose comes from here, computed from the rows it has just drawn, so
the text and the chart above it cannot disagree: :func:`headline` is the one sentence each notebook and
the index open with, :func:`provenance_line` the one line that says which run, :func:`span` the one way a
range of ratios is written. A figure the rows do not hold reads "not measured";
nothing is filled in from another run. Each function returns markdown (one sentence or a bullet list).
"""

from __future__ import annotations

import math

import pandas as pd

from . import data
from .bench.analysis import medians

#: How the sentences name a provider (the bench's provider names otherwise).
NAMES = {"kernels_lib": "kernels_lib", "liger": "Liger", "torch": "torch", "huggingface": "the baseline",
         "trl": "TRL", "quack": "QuACK", "megatron-core": "Megatron-core", "torch_loss_parallel": "`loss_parallel`",
         "cce": "CCE", "liger_sm90": "Liger's CuTe kernel", "torch_lce": "torch's `F.linear_cross_entropy`"}


def name(provider: str) -> str:
    """A provider as a sentence says it (``liger`` → ``Liger``)."""
    return NAMES.get(provider, provider)


def span(values, digits: int = 2, suffix: str = "×") -> str:
    """``0.38–0.41×`` over the finite ``values`` (one figure when they round alike), ``not measured`` when none is."""
    finite = [float(v) for v in (values if hasattr(values, "__iter__") else [values]) if v is not None and math.isfinite(float(v))]
    if not finite:
        return "not measured"
    low, high = f"{min(finite):.{digits}f}", f"{max(finite):.{digits}f}"
    return f"{low}{suffix}" if low == high else f"{low}–{high}{suffix}"


def x_span(index, x_name: str) -> str:
    """``V = 4096–131072`` (or ``V = 4096``) over the x values ``index``."""
    xs = sorted({int(x) if float(x).is_integer() else float(x) for x in index})
    if not xs:
        return f"no {x_name}"
    return f"{x_name} = {xs[0]}" if len(xs) == 1 else f"{x_name} = {xs[0]}–{xs[-1]}"


def ratios(rows: pd.DataFrame, ours: str, peer: str, metric: str = "speed", mode: str = "full") -> pd.Series:
    """Per x, ``ours``' median over ``peer``'s, both of ``rows`` (one run); empty where either is missing."""
    table = medians(rows, metric, mode)
    if ours not in table or peer not in table:
        return pd.Series(dtype=float)
    return (table[ours] / table[peer]).dropna()


#: Where a comparison table (:func:`.comparison.comparison`) marks a peer far from its published figure.
_FAR = " (far from its published figure)"


def headline(what: str, tables: dict[str, pd.DataFrame | list[pd.DataFrame]], *, ours: str = "kernels_lib",
             of: str = "`full`", unmeasured: str = "not measured on a GPU yet, so the published rows alone are drawn") -> str:
    """The one sentence a reader can quote: ``what`` (the loss), then per GPU (``tables``: GPU → its run's
    :func:`.comparison.comparison`, or a list of them, one per loss or configuration) the range over x of
    ``ours``' ``of`` (``full``: forward and backward; notebook 05: the training step) time × the fastest peer's,
    memory × the leanest peer's and time × the floor; a comparison without a floor at all (no ``× floor``
    column: a whole training step) has no floor clause. No commit, no date: the run is said beside the data
    (:func:`provenance_line`). A peer the tables mark far from its published figure is out of "fastest"
    already; a short clause says which. Without GPU rows: ``what: unmeasured.``"""
    parts = []
    for gpu, given in tables.items():
        frames = [t for t in (given if isinstance(given, list | tuple) else [given]) if len(t)]
        if not frames:
            continue
        table = pd.concat(frames)
        far = sorted({c[2:-len(_FAR)] for c in table.columns if c.endswith(_FAR)})
        fastest = span(table["× fastest peer"]) if "× fastest peer" in table else "not measured"
        fastest = "no peer timed" if fastest == "not measured" else f"{fastest} the fastest peer's time"
        if far:
            fastest += f" ({', '.join(map(name, far))} left out: far from {'its' if len(far) == 1 else 'their'} published figure)"
        memory = span(table["memory × leanest"]) if "memory × leanest" in table else "not measured"
        memory = "no peer's memory measured" if memory == "not measured" else f"{memory} the leanest peer's memory"
        where = x_span(table.index, str(table.index.name or "x")) if len(frames) == 1 else f"{len(frames)} charts"
        if "× floor" not in table:  # no floor defined for what is compared
            parts.append(f"on the {data.gpu_label(gpu)} ({where}), {fastest} and {memory}")
            continue
        floor = span(table["× floor"])
        floor = "the floor not measured" if floor == "not measured" else f"{floor} the floor"
        parts.append(f"on the {data.gpu_label(gpu)} ({where}), {fastest}, {memory} and {floor}")
    if not parts:
        return f"{what}: {unmeasured}."
    return f"{what}, {name(ours)}'s {of}: " + "; ".join(parts) + "."


def provenance_line(run: pd.DataFrame) -> str:
    """Where one run's numbers come from, in one line beside them: the GPU, the commit, the date and the
    versions recorded with its rows."""
    if not len(run):
        return "Not measured."
    label, date = data.gpu_label(str(run.gpu_name.iloc[0])), str(run.timestamp.max())[:10] if "timestamp" in run else ""
    versions = [f"{who} {run[column].dropna().astype(str).iloc[-1]}" for who, column in
                (("torch", "torch_version"), ("Triton", "triton_version"), ("Liger", "liger_version"))
                if column in run and run[column].notna().any()]
    return (f"Measured on the {label} ({run.gpu_name.iloc[0]}), kernels_lib commit {data.run_commit(run)}"
            + (f", {date}" if date else "") + (f"; {', '.join(versions)}" if versions else "") + ".")


def floor_lines(floors: pd.DataFrame, chart: str = "chart", providers: tuple[str, ...] = ("kernels_lib", "liger"),
                floor: str = "floor") -> str:
    """A bullet per chart: each provider's time as multiples of the floor, from a table with a ``chart``
    column and ``<provider> / floor`` columns (one row per x); a provider without a figure in a chart is left out."""
    if not len(floors):
        return "No GPU rows with a floor yet: nothing to set against it."
    lines = []
    for label, group in floors.groupby(chart, sort=False):
        said = [f"{name(p)} {span(group[f'{p} / floor'])}" for p in providers
                if f"{p} / floor" in group and group[f"{p} / floor"].notna().any()]  # a provider the chart never measured: left out
        lines.append(f"- `{label}`: `full` at " + ", ".join(said) + f" the {floor}.")
    return "\n".join(lines)


def floor_multiples(times: dict, floor_ms: float, at: str = "", what: str = "the floor") -> str:
    """Each provider's time (``{provider: ms}``) as a multiple of ``floor_ms``, in one sentence; a provider
    without a time reads "not measured"."""
    if not (math.isfinite(floor_ms) and floor_ms > 0):
        return f"No floor measured{' ' + at if at else ''}: nothing to set against it."
    said = [f"{name(p)} {ms / floor_ms:.2f}×" if ms is not None and math.isfinite(ms) else f"{name(p)} not measured"
            for p, ms in times.items()]
    return f"{'At ' + at + ', ' if at else ''}`full` against {what}: " + ", ".join(said) + "."
