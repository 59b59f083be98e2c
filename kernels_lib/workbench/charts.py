"""Plotly charts of published and measured rows (both in the published CSV's layout).

:func:`scaling_chart` redraws Liger's published scaling chart: one panel per (metric, mode), the
swept axis on x, median on y, a p20–p80 band around each line. Liger's charts put x on a log₂
scale for these workloads (powers of two) and y linear; so do we. Each trace is named
``provider · GPU (published|measured)`` so rows from different GPUs never read as one series.
"""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

PANELS = (("speed", "forward"), ("speed", "full"), ("memory", "full"))
COLORS = {
    "kernels_lib": "#d62728",
    "torch": "#1f77b4",
    "huggingface": "#1f77b4",
    "liger": "#2ca02c",
    "cce": "#9467bd",
    "liger_sm90": "#17becf",
    "quack": "#ff7f0e",
}
UNITS = {"speed": "ms", "memory": "MB"}


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def _series(frame: pd.DataFrame, source: str):
    """Yield (name, provider, source, rows sorted by x) per (GPU, provider) of ``frame``."""
    for (gpu, provider), rows in frame.groupby(["gpu_name", "kernel_provider"], sort=False):
        yield f"{provider} · {gpu} ({source})", provider, rows.sort_values("x_value")


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

    ``published`` and ``measured``: rows of one loss (either may be None or empty). Each panel
    shows the rows of its (metric, mode); a line per (GPU, provider, source) with its p20–p80 band.
    Published lines are dashed, measured ones solid.
    """
    figure = make_subplots(rows=1, cols=len(panels), subplot_titles=[f"{m} · {mode}" for m, mode in panels])
    sources = [(published, "published", "dash"), (measured, "measured", "solid")]
    legend_seen = set()
    for col, (metric, mode) in enumerate(panels, start=1):
        for frame, source, dash in sources:
            if frame is None or not len(frame):
                continue
            rows = frame[(frame.metric_name == metric) & (frame.kernel_operation_mode == mode)]
            for name, provider, series in _series(rows, source):
                color = COLORS.get(provider, "#7f7f7f")
                x = series.x_value.tolist()
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
        figure.update_yaxes(title_text=f"{metric} ({UNITS.get(metric, '')})", row=1, col=col)
    figure.update_layout(title=title, height=460, legend={"orientation": "h", "y": -0.25}, margin={"t": 80})
    return figure


def line_traces(figure: go.Figure) -> list[go.Scatter]:
    """The median lines of a :func:`scaling_chart` (the bands left out)."""
    return [trace for trace in figure.data if trace.fill != "toself"]


def _base_provider(provider: str) -> str:
    """``kernels_lib[chunk_size=512 accurate=False]`` → ``kernels_lib`` (for its color)."""
    return provider.split("[", 1)[0]


#: Where a marker's label may go, in order of preference (plotly's ``textposition`` values).
LABEL_POSITIONS = ("top center", "bottom center", "middle right", "middle left", "top right", "bottom left", "top left", "bottom right")


def label_positions(x: list[float], y: list[float], *, log_x: bool = True, near: float = 0.08) -> list[str]:
    """A ``textposition`` per marker such that markers closer than ``near`` (a fraction of each axis's
    span; x in log₁₀ when ``log_x``) never share one: each marker, in order, takes the first of
    :data:`LABEL_POSITIONS` that no nearer-than-``near`` earlier marker took, so two labels of close
    markers go to different sides instead of overlapping."""
    xs = pd.Series(x, dtype=float).pipe(lambda s: s.clip(lower=1e-12).map(math.log10) if log_x else s)
    ys = pd.Series(y, dtype=float)
    span = lambda s: (s.max() - s.min()) or 1.0  # noqa: E731
    xs, ys = (xs - xs.min()) / span(xs), (ys - ys.min()) / span(ys)
    chosen: list[str] = []
    for i in range(len(xs)):
        taken = {chosen[j] for j in range(i) if abs(xs[i] - xs[j]) < near and abs(ys[i] - ys[j]) < near}
        chosen.append(next((p for p in LABEL_POSITIONS if p not in taken), LABEL_POSITIONS[i % len(LABEL_POSITIONS)]))
    return chosen


def speed_memory_chart(
    rows: pd.DataFrame, x_value: int, mode: str = "full", *, title: str | None = None, floor_ms: float | None = None
) -> go.Figure:
    """Speed against memory at one point of the swept axis: one marker per provider (points of a
    dial such as ``kernels_lib[chunk_size=…]`` are providers too), the ``mode``'s peak memory on x
    and its median time on y; lower-left is better. Each marker is labelled with its provider, on the side
    :func:`label_positions` picks so that close markers' labels do not overlap. ``floor_ms``, when given, draws the arithmetic
    floor (e.g. the matmuls at the measured ceiling) as a horizontal line.

    ``rows``: measured rows of one GPU holding ``speed`` and ``memory`` rows of ``mode``.
    """
    at_x = rows[rows.x_value == x_value]
    speed = at_x[(at_x.metric_name == "speed") & (at_x.kernel_operation_mode == mode)]
    memory = at_x[(at_x.metric_name == "memory") & (at_x.kernel_operation_mode == mode)]
    ms = speed.groupby("kernel_provider", sort=False).y_value_50.median()
    mb = memory.groupby("kernel_provider", sort=False).y_value_50.median()
    figure = go.Figure()
    providers = ms.index.intersection(mb.index)
    positions = label_positions(mb[providers].tolist(), ms[providers].tolist())
    for provider, position in zip(providers, positions):
        color = COLORS.get(_base_provider(provider), "#7f7f7f")
        figure.add_trace(
            go.Scatter(
                x=[mb[provider]],
                y=[ms[provider]],
                mode="markers+text",
                name=provider,
                text=[provider],
                textposition=position,
                marker={"color": color, "size": 11, "symbol": "circle" if provider == _base_provider(provider) else "diamond"},
                hovertemplate=f"{provider}<br>%{{x:.0f}} MB<br>%{{y:.3g}} ms<extra></extra>",
            )
        )
    if floor_ms is not None:
        figure.add_hline(y=floor_ms, line_dash="dot", line_color="#7f7f7f", annotation_text=f"floor {floor_ms:.1f} ms")
    figure.update_xaxes(title_text=f"memory, {mode} (MB, peak minus inputs)", type="log")
    figure.update_yaxes(title_text=f"time, {mode} (ms)")
    figure.update_layout(title=title or f"speed vs memory at x = {x_value} ({mode})", height=480, showlegend=False)
    return figure


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
    return figure
