"""Plotly charts of published and measured rows (both in the published CSV's layout).

:func:`scaling_chart` redraws Liger's published scaling chart: one panel per (metric, mode), the
swept axis on x, median on y, a p20–p80 band around each line. Liger's charts put x on a log₂
scale for these workloads (powers of two) and y linear; so do we. Each trace is named
``provider · GPU (published|measured)`` so rows from different GPUs never read as one series.

One look in every figure of every report: a provider has one colour (:func:`provider_color`, keyed by
its base name, so ``kernels_lib[chunk_size=256]`` is drawn in kernels_lib's colour, with a diamond
where a figure shows the dial), kernels_lib's traces are drawn last, on top of the peers'
(:func:`kernels_lib_on_top`), the speed axis is "time (ms)", each workload's swept axis has one name
(:func:`axis_title`), and a log axis is ticked at the measured sizes, printed as integers.
"""

from __future__ import annotations

import math
import re
import textwrap
import zlib

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .data import gpu_label

PANELS = (("speed", "forward"), ("speed", "full"), ("memory", "full"))
#: A provider's colour, by base name (:func:`base_provider`), in every figure. ``torch`` and
#: ``huggingface`` share the baseline's blue: Liger's published rows call torch's path "huggingface".
COLORS = {
    "kernels_lib": "#d62728",
    "torch": "#1f77b4",
    "huggingface": "#1f77b4",
    "baseline": "#1f77b4",
    "liger": "#2ca02c",
    "liger_sm90": "#17becf",
    "liger_tp": "#98df8a",
    "cce": "#9467bd",
    "quack": "#ff7f0e",
    "trl": "#8c564b",
    "megatron-core": "#e377c2",
    "megatron-fused": "#bcbd22",
    "megatron-unfused": "#dbdb8d",
    "torch_loss_parallel": "#aec7e8",
    "torch_lce": "#c49c94",
    "three_matmuls": "#7f7f7f",  # the floor measured in the run (not a loss)
}
#: Colours for a provider not in :data:`COLORS`, picked by a hash of its base name (the same in every figure).
SPARE_COLORS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
UNITS = {"speed": "ms", "memory": "MB"}
#: The line of each GPU's measured rows in a scaling chart, in :func:`.data.gpus_measured`' order (the
#: published rows are dashed, a floor dotted).
MEASURED_DASHES = ("solid", "dashdot", "longdash", "longdashdot")
#: The y title of each metric: a median time is "time", whatever the CSV's metric is called.
METRIC_TITLES = {"speed": "time (ms)", "memory": "memory (MB)"}
#: One name per swept axis, whatever the published CSV or a preset calls it.
AXIS_TITLES = {
    "tokens": "tokens (B × T)", "total tokens": "tokens (B × T)", "b x t": "tokens (B × T)", "bt": "tokens (B × T)",
    "tokens (b × t)": "tokens (B × T)",
    "b": "batch size (B)", "batch size b": "batch size (B)", "batch size (b)": "batch size (B)", "b (sequences)": "batch size (B)",
    "b (chosen + rejected rows)": "batch size (B, chosen + rejected rows)",
    "v": "vocabulary size (V)", "vocab size": "vocabulary size (V)",
    "n": "rows (N)", "t": "sequence length (T)", "h": "hidden size (H)",
}


def base_provider(name: str) -> str:
    """A trace's or a row's provider, without its dial and its series: ``kernels_lib[chunk_size=512]``,
    ``kernels_lib · H200 (measured)`` and ``kernels_lib OOM`` are all ``kernels_lib``."""
    return re.split(r"[\[ ·]", str(name).strip(), maxsplit=1)[0]


#: A variant that is a provider of its own (registered beside its default, and drawn beside it) has its own
#: colour, a darker shade of its provider's, in every figure: ``kernels_lib[accurate=True]`` is not drawn in
#: kernels_lib's red. The points of a dial (``kernels_lib[chunk_size=256]``) keep their provider's colour.
VARIANT_COLORS = {
    "kernels_lib[accurate=True]": "#67000d",
    "torch_lce[acc_policy=accurate]": "#543005",
}


def palette_key(name: str) -> str:
    """What ``name``'s colour is keyed by: its variant (``kernels_lib[accurate=True]`` of
    ``kernels_lib[accurate=True] · H100 80GB (measured)``) where :data:`VARIANT_COLORS` has it, else its
    base provider (:func:`base_provider`)."""
    variant = re.match(r"\s*([^\s\[·]+(?:\[[^\]]*\])?)", str(name))
    key = variant.group(1) if variant else str(name)
    return key if key in VARIANT_COLORS else base_provider(name)


def provider_color(name: str) -> str:
    """The colour of ``name``'s provider or variant, the one every chart uses: :data:`VARIANT_COLORS` for a
    variant of its own, :data:`COLORS` by base name, else a spare colour fixed by the base name."""
    key = palette_key(name)
    if key in VARIANT_COLORS:
        return VARIANT_COLORS[key]
    return COLORS.get(key) or SPARE_COLORS[zlib.crc32(key.encode()) % len(SPARE_COLORS)]


def axis_title(x_label: str) -> str:
    """The one name of a swept axis (:data:`AXIS_TITLES`): "B x T", "tokens", "total tokens" are all
    "tokens (B × T)"; a label it does not know is kept."""
    return AXIS_TITLES.get(str(x_label).strip().lower(), x_label)


def kernels_lib_on_top(figure: go.Figure) -> go.Figure:
    """Reorder ``figure``'s traces so that bands come first and kernels_lib's traces last (drawn on top
    of the peers'), keeping the order within each group; kernels_lib leads the legend. Returns ``figure``."""
    def key(trace):
        ours = base_provider(trace.name or "") == "kernels_lib"
        return (getattr(trace, "fill", None) != "toself", ours)

    figure.data = tuple(sorted(figure.data, key=key))
    for trace in figure.data:
        if base_provider(trace.name or "") == "kernels_lib":
            trace.legendrank = 1
    return figure


def wrapped_title(title: str, width: int = 100) -> dict:
    """A layout ``title`` broken into lines of at most ``width`` characters (a report's figure is about
    1200 px wide: a longer title would be clipped at its right edge), with the top margin it needs."""
    lines = textwrap.wrap(str(title), width) or [""]
    return {"title": "<br>".join(lines), "margin": {"t": 60 + 22 * len(lines)}}


def integer_ticks(values) -> dict:
    """``tickvals`` and ``ticktext`` for a log axis at the measured sizes (integers printed as
    integers), thinned to at most 8 labels so that they never overlap."""
    values = sorted({float(v) for v in values if pd.notna(v) and v > 0})
    step = max(1, -(-len(values) // 8))
    values = values[::step]
    return {"tickvals": values, "ticktext": [f"{v:.0f}" if float(v).is_integer() else f"{v:g}" for v in values]}


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def _series(frame: pd.DataFrame, source: str):
    """Yield (name, provider, rows sorted by x) per (GPU, provider) of ``frame``, named with the GPU's short
    label (:func:`.data.gpu_label`): ``kernels_lib · H100 80GB (measured)``."""
    for (gpu, provider), rows in frame.groupby(["gpu_name", "kernel_provider"], sort=False):
        yield f"{provider} · {gpu_label(gpu)} ({source})", provider, rows.sort_values("x_value")


def scaling_chart(
    published: pd.DataFrame | None,
    measured: pd.DataFrame | None,
    *,
    x_label: str,
    title: str,
    panels=PANELS,
    log_x: bool = True,
) -> go.Figure:
    """The published scaling chart with our measured rows beside it.

    ``published`` and ``measured``: rows of one loss (either may be None or empty; ``measured`` may hold
    the newest run of several GPUs, :func:`.data.newest_run_per_gpu`). Each panel shows the rows of its
    (metric, mode); a line per (GPU, provider, source) with its p20–p80 band, named with the GPU's short
    label. Published lines are dashed; measured ones solid on the first GPU, dotted-dashed on a second, and so on.
    """
    figure = make_subplots(rows=1, cols=len(panels), subplot_titles=[f"{'time' if m == 'speed' else m} · {mode}" for m, mode in panels])
    x_label = axis_title(x_label)
    xs_seen = []
    sources = [(published, "published"), (measured, "measured")]
    # one dash per measured GPU (the first solid), the published rows dashed: a provider keeps its colour on every GPU
    measured_gpus = sorted({str(g) for g in measured.gpu_name}, key=lambda g: (gpu_label(g), g)) if measured is not None and len(measured) else []
    dashes = {gpu: MEASURED_DASHES[i % len(MEASURED_DASHES)] for i, gpu in enumerate(measured_gpus)}
    legend_seen = set()
    for col, (metric, mode) in enumerate(panels, start=1):
        for frame, source in sources:
            if frame is None or not len(frame):
                continue
            rows = frame[(frame.metric_name == metric) & (frame.kernel_operation_mode == mode)]
            for name, provider, series in _series(rows, source):
                dash = "dash" if source == "published" else dashes[str(series.gpu_name.iloc[0])]
                color = provider_color(provider)
                x = series.x_value.tolist()
                xs_seen += x
                if {"y_value_20", "y_value_80"} <= set(series.columns):
                    figure.add_trace(
                        go.Scatter(
                            x=x + x[::-1],
                            y=series.y_value_80.tolist() + series.y_value_20.tolist()[::-1],
                            fill="toself",
                            fillcolor=_rgba(color, 0.15),
                            mode="lines",  # the band's outline only: no markers at its vertices
                            line={"width": 0},
                            hoverinfo="skip",
                            showlegend=False,
                            legendgroup=name,
                            name=f"{name} p20–p80",
                        ),
                        row=1,
                        col=col,
                    )
                figure.add_trace(
                    go.Scatter(
                        x=x,
                        y=series.y_value_50,
                        mode="lines+markers",
                        name=name,
                        legendgroup=name,
                        showlegend=name not in legend_seen,
                        line={"color": color, "dash": dash},
                        hovertemplate=f"{name}<br>{x_label}=%{{x}}<br>%{{y:.4g}} {UNITS.get(metric, '')}<extra></extra>",
                    ),
                    row=1,
                    col=col,
                )
                legend_seen.add(name)
        figure.update_xaxes(title_text=x_label, type="log" if log_x else "linear", row=1, col=col)
        figure.update_yaxes(title_text=METRIC_TITLES.get(metric, metric), row=1, col=col)
    if log_x and xs_seen:  # every panel over the same sizes, ticked at them: a panel never looks linear
        figure.update_xaxes(matches="x", **integer_ticks(xs_seen))
    figure.update_layout(height=460, legend={"orientation": "h", "y": -0.25}, **wrapped_title(title))
    return kernels_lib_on_top(figure)


def line_traces(figure: go.Figure) -> list[go.Scatter]:
    """The median lines of a :func:`scaling_chart` (the bands left out)."""
    return [trace for trace in figure.data if trace.fill != "toself"]


def log_ticks(values) -> dict:
    """``tickvals`` and ``ticktext`` for a log axis over ``values``: the 1-2-5 steps of each decade
    within their range (integers printed as integers), so that no minor label ("2 3 … 9") crowds the
    axis; where fewer than two steps fall in the range, the smallest and the largest value, rounded to
    two significant digits."""
    values = [float(v) for v in values if pd.notna(v) and v > 0]
    if not values:
        return {}
    low, high = min(values) / 1.15, max(values) * 1.15
    steps = [m * 10.0**k for k in range(int(math.floor(math.log10(low))) - 1, int(math.ceil(math.log10(high))) + 1) for m in (1, 2, 5)]
    ticks = [v for v in steps if low <= v <= high]
    if len(ticks) < 2:
        ticks = sorted({float(f"{v:.2g}") for v in (min(values), max(values))})
    ticks = ticks[:: max(1, -(-len(ticks) // 8))]
    return {"tickvals": ticks, "ticktext": [f"{v:.0f}" if float(v).is_integer() else f"{v:g}" for v in ticks]}


def speed_memory_chart(
    rows: pd.DataFrame, x_value: int, mode: str = "full", *, title: str | None = None, floor_ms: float | None = None
) -> go.Figure:
    """Speed against memory at one point of the swept axis: the ``mode``'s peak memory on x (log, labelled
    at 1-2-5 steps only: :func:`log_ticks`) and its median time on y; lower-left is better. One trace, so
    one legend entry and one colour, per provider (:func:`base_provider`): the points of a dial such as
    ``kernels_lib[chunk_size=…]`` are diamonds in kernels_lib's trace beside its default (a circle), each
    named on hover, not beside its marker (the points of a dial lie within a few percent of each other, and
    no placement of a dozen labels there keeps them apart). ``floor_ms``, when given, draws the arithmetic
    floor (e.g. the matmuls at the measured ceiling) as a horizontal line.

    ``rows``: measured rows of one GPU holding ``speed`` and ``memory`` rows of ``mode``.
    """
    at_x = rows[rows.x_value == x_value]
    speed = at_x[(at_x.metric_name == "speed") & (at_x.kernel_operation_mode == mode)]
    memory = at_x[(at_x.metric_name == "memory") & (at_x.kernel_operation_mode == mode)]
    ms = speed.groupby("kernel_provider", sort=False).y_value_50.median()
    mb = memory.groupby("kernel_provider", sort=False).y_value_50.median()
    figure = go.Figure()
    providers = [p for p in ms.index.intersection(mb.index) if pd.notna(ms[p]) and pd.notna(mb[p])]
    groups: dict[str, list[str]] = {}
    for provider in providers:
        groups.setdefault(palette_key(provider), []).append(provider)  # a variant of its own: its own trace and colour
    for base, members in groups.items():
        members = sorted(members, key=lambda p: (p != base, mb[p]))  # the default first, then the dial by memory
        figure.add_trace(
            go.Scatter(
                x=[mb[p] for p in members],
                y=[ms[p] for p in members],
                mode="markers",
                name=base,
                customdata=members,
                marker={"color": provider_color(base), "size": 11,
                        "symbol": ["circle" if p == base else "diamond" for p in members]},
                hovertemplate="%{customdata}<br>%{x:.0f} MB<br>%{y:.3g} ms<extra></extra>",
            )
        )
    if floor_ms is not None:
        figure.add_hline(y=floor_ms, line_dash="dot", line_color="#7f7f7f", annotation_text=f"floor {floor_ms:.1f} ms",
                         annotation_position="bottom right")
    figure.update_xaxes(title_text=f"memory, {mode} (MB, peak minus inputs)", type="log", **log_ticks([mb[p] for p in providers]))
    figure.update_yaxes(title_text=f"time, {mode} (ms)")
    figure.update_layout(height=480, showlegend=True, **wrapped_title(title or f"time vs memory at x = {x_value} ({mode})", width=80),
                         legend={"font": {"size": 11}})
    return kernels_lib_on_top(figure)


def add_floor(figure: go.Figure, floor: pd.DataFrame, *, name: str = "floor", panels=PANELS) -> go.Figure:
    """Draw a floor on the speed panels of a :func:`scaling_chart`: a dotted grey line per panel
    whose mode is a column of ``floor`` (ms, indexed by x). Returns ``figure``."""
    shown = False
    for col, (metric, mode) in enumerate(panels, start=1):
        if metric != "speed" or mode not in floor.columns:
            continue
        series = floor[mode].dropna().sort_index()
        figure.add_trace(
            go.Scatter(
                x=series.index.tolist(),
                y=series.tolist(),
                mode="lines",
                name=name,
                legendgroup=name,
                showlegend=not shown,
                line={"color": "#7f7f7f", "dash": "dot", "width": 2},
                hovertemplate=f"{name}<br>x=%{{x}}<br>%{{y:.4g}} ms<extra></extra>",
            ),
            row=1,
            col=col,
        )
        shown = True
    return kernels_lib_on_top(figure)


def table_number(value: float) -> str:
    """A table's float as the reports print it: an integral value as an integer (a vocabulary of
    128256, not 128256.000), otherwise three decimals, or three significant digits in scientific
    notation below 0.001 and from a million (relative errors of 1e-7 stay visible)."""
    if value != value:
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{value:.0f}"
    return f"{value:.3f}" if 1e-3 <= abs(value) < 1e6 else f"{value:.3g}"


def table_options() -> None:
    """pandas' display options for the notebooks' tables: :func:`table_number` for floats, every row
    and column shown (no "…" rows or columns in a report; a table too wide to read is pivoted or
    trimmed where it is made)."""
    pd.set_option("display.float_format", table_number)
    pd.set_option("display.max_rows", 500)
    pd.set_option("display.max_columns", 100)
    pd.set_option("display.width", 250)
