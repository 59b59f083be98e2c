"""Plotly charts of published and measured rows (both in the published CSV's layout).

:func:`scaling_chart` redraws Liger's published scaling chart: one panel per (metric, mode), the
swept axis on x, median on y, a p20–p80 band around each line. Liger's charts put x on a log₂
scale for these workloads (powers of two) and y linear; so do we.

How a reader tells the lines apart, in every figure of every report:

- a provider (or a variant of its own, ``kernels_lib[accurate=True]``) is a colour (:data:`COLORS`,
  :data:`VARIANT_COLORS`: one fixed palette, every colour apart from every other), named once in the
  "provider" legend;
- a GPU is a marker and a dash (:data:`GPU_STYLES`), named once in the "GPU" legend; the published rows
  of a GPU have open markers; a GPU's floor (:func:`add_floor`) is drawn in the floor's colour with its
  GPU's marker and dash;
- the baseline has one name, whatever the data calls it (:data:`DISPLAY_NAMES`: "torch", "huggingface"
  and "baseline" are all :data:`BASELINE_NAME`);
- on a CPU only kernels_lib's own kernels run in Triton's interpreter, and only they are labelled so
  (:func:`display_name`); torch and TRL run natively;
- published memory counts the inputs, ours does not (peak minus inputs): the two are never on one
  axis (:data:`PUBLISHED_MEMORY_TITLE`);
- a panel with no measured row says "not measured on a GPU yet" instead of showing published rows alone;
- a line with no point at a size where its peers have one is broken there, with a ✕ that says why
  ("out of memory", or "not measured at x = …") on hover and a legend entry saying so.

kernels_lib's traces are drawn last, on top of the peers' (:func:`kernels_lib_on_top`), each workload's swept
axis has one name (:func:`axis_title`), and a log axis is ticked at the measured sizes, printed as integers.
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
#: The baseline's one display name: an eager torch path on fp32 logits, which the losses' specs call "torch" or
#: "huggingface" (as Liger's published CSVs do) and CCE's published rows "baseline".
BASELINE_NAME = "torch (eager)"
#: A provider's name as every chart, legend, checkbox, status line and table shows it (:func:`display_name`);
#: a provider not listed keeps its key.
DISPLAY_NAMES = {"torch": BASELINE_NAME, "huggingface": BASELINE_NAME, "baseline": BASELINE_NAME}
#: A provider's colour, by base name (:func:`base_provider`), in every figure: every colour here and in
#: :data:`VARIANT_COLORS` is apart from every other (at least 20 ΔE, CIELAB), so no two providers look alike.
#: The baseline's three keys share one colour: they are one provider under one display name.
COLORS = {
    "kernels_lib": "#d62728",
    "torch": "#1f77b4",
    "huggingface": "#1f77b4",
    "baseline": "#1f77b4",
    "torch_compile": "#393b79",
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
#: A variant that is a provider of its own (registered beside its default, and drawn beside it) has its own
#: colour, a light shade of its provider's, in every figure: ``kernels_lib[accurate=True]`` is not drawn in
#: kernels_lib's red. The points of a dial (``kernels_lib[chunk_size=256]``) keep their provider's colour.
VARIANT_COLORS = {
    "kernels_lib[accurate=True]": "#ff9896",
    "torch_lce[acc_policy=accurate]": "#ffbb78",
}
#: The colour of a floor (:func:`add_floor`, the floor line of :func:`speed_memory_chart`): no provider's.
FLOOR_COLOR = "#252525"
#: Colours for a provider not in :data:`COLORS`, picked by a hash of its base name (the same in every figure).
SPARE_COLORS = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
UNITS = {"speed": "ms", "memory": "MB"}
#: A GPU's marker and dash, by short label (:func:`.data.gpu_label`), in every figure: the measured GPUs, the
#: published ones, and a CPU. A GPU not listed gets one of :data:`SPARE_GPU_STYLES` (:func:`gpu_style`).
GPU_STYLES = {
    "H100 80GB": ("circle", "solid"),
    "H200": ("square", "dashdot"),
    "A100 80GB": ("triangle-up", "dash"),
    "H100 PCIe": ("diamond", "longdash"),
    "B200": ("star", "longdashdot"),
    "CPU": ("circle", "solid"),
}
SPARE_GPU_STYLES = (("pentagon", "dot"), ("hexagon", "dash"), ("cross", "longdash"), ("hourglass", "dashdot"))
#: The y title of each metric: a median time is "time", whatever the CSV's metric is called; our memory is the
#: peak less the inputs' bytes.
METRIC_TITLES = {"speed": "time (ms)", "memory": "peak memory beyond inputs (MB)"}
#: The y title of published memory, on an axis of its own: Liger's rows count the inputs (and the weights).
PUBLISHED_MEMORY_TITLE = "published peak memory, inputs included (MB)"
#: Where a kernels_lib kernel ran in Triton's interpreter, the label its name carries (and no other provider's).
INTERPRETER_LABEL = "(Triton interpreter)"
#: The note of a panel with no measured row.
NOT_MEASURED_NOTE = "not measured on a GPU yet"
#: The legend entry of the ✕ where a line has no point (:func:`scaling_chart`).
GAP_LEGEND = "✕ no point here (hover: why)"
#: One name per swept axis, whatever the published CSV or a preset calls it.
AXIS_TITLES = {
    "tokens": "tokens (B·T)", "total tokens": "tokens (B·T)", "b x t": "tokens (B·T)", "bt": "tokens (B·T)",
    "tokens (b × t)": "tokens (B·T)", "tokens (b·t)": "tokens (B·T)", "b × t": "tokens (B·T)",
    "b": "batch size B", "batch size b": "batch size B", "batch size (b)": "batch size B", "b (sequences)": "batch size B",
    "b (chosen + rejected rows)": "batch size B (chosen + rejected rows)",
    "v": "vocabulary size V", "vocab size": "vocabulary size V", "vocabulary size (v)": "vocabulary size V",
    "n": "rows N", "t": "sequence length T", "h": "hidden size H",
}


def base_provider(name: str) -> str:
    """A trace's or a row's provider, without its dial and its series: ``kernels_lib[chunk_size=512]``,
    ``kernels_lib · H200 (measured)`` and ``kernels_lib OOM`` are all ``kernels_lib``."""
    return re.split(r"[\[ ·]", str(name).strip(), maxsplit=1)[0]


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


def is_interpreter_device(gpu_name) -> bool:
    """Whether rows of ``gpu_name`` ran on a CPU, where kernels_lib's kernels run in Triton's interpreter."""
    text = str(gpu_name).lower()
    return "interpreter" in text or text.strip().startswith("cpu")


def device_label(gpu_name) -> str:
    """The device as a legend names it: the GPU's short label (:func:`.data.gpu_label`), or "CPU" for a CPU
    (what ran in the interpreter there is said on the provider's name: :func:`display_name`)."""
    return "CPU" if is_interpreter_device(gpu_name) else gpu_label(gpu_name)


def display_name(provider: str, gpu_name=None) -> str:
    """``provider`` as every chart, legend, checkbox, status line and table shows it (:data:`DISPLAY_NAMES`:
    the baseline as :data:`BASELINE_NAME`); on a CPU (``gpu_name`` of a CPU run) kernels_lib's own kernels
    carry :data:`INTERPRETER_LABEL`, and no other provider does (torch and TRL run natively there)."""
    name = DISPLAY_NAMES.get(str(provider), str(provider))
    if gpu_name is not None and is_interpreter_device(gpu_name) and base_provider(provider) == "kernels_lib":
        name = f"{name} {INTERPRETER_LABEL}"
    return name


def gpu_style(label: str) -> tuple[str, str]:
    """A GPU's (marker symbol, dash) by its short label: :data:`GPU_STYLES`, else a spare style fixed by the
    label (the same in every figure)."""
    label = device_label(label)
    return GPU_STYLES.get(label) or SPARE_GPU_STYLES[zlib.crc32(label.encode()) % len(SPARE_GPU_STYLES)]


def gpu_styles(labels) -> dict[str, tuple[str, str]]:
    """The (marker, dash) of each GPU of one figure: :data:`GPU_STYLES` for a listed GPU, and for any other the
    first of :data:`SPARE_GPU_STYLES` that no other GPU of the figure has (so two GPUs of a figure never look
    alike)."""
    labels = list(dict.fromkeys(device_label(label) for label in labels))
    styles = {label: GPU_STYLES[label] for label in labels if label in GPU_STYLES}
    for label in labels:
        if label not in styles:
            free = [style for style in SPARE_GPU_STYLES if style not in styles.values()]
            styles[label] = free[0] if free else gpu_style(label)
    return styles


def axis_title(x_label: str) -> str:
    """The one name of a swept axis (:data:`AXIS_TITLES`): "B x T", "tokens", "total tokens" are all
    "tokens (B·T)"; a label it does not know is kept."""
    return AXIS_TITLES.get(str(x_label).strip().lower(), x_label)


def _kind(trace) -> str | None:
    """What a trace of these charts is beyond a data line: "key" (a legend entry only), "gap" (the ✕ of a
    missing point), "floor", or None."""
    meta = getattr(trace, "meta", None)
    return meta.get("kind") if isinstance(meta, dict) else None


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


def integer_ticks(values, max_labels: int = 8) -> dict:
    """``tickvals`` and ``ticktext`` for a log axis at the measured sizes (integers printed as
    integers), thinned to at most ``max_labels`` labels so that they never overlap."""
    values = sorted({float(v) for v in values if pd.notna(v) and v > 0})
    step = max(1, -(-len(values) // max_labels))
    values = values[::step]
    return {"tickvals": values, "ticktext": [f"{v:.0f}" if float(v).is_integer() else f"{v:g}" for v in values]}


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def _x_text(x) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:g}"


def gap_reason(rows: pd.DataFrame, x, x_label: str) -> str:
    """Why a line has no point at ``x`` (``rows``: its rows at ``x``, none where it was not run there): "out of
    memory" where a row's note says so, the note's first part where there is another, else "not measured"."""
    notes = [str(n).split("; ")[0] for n in rows.get("note", pd.Series(dtype=object)) if isinstance(n, str) and n.strip()]
    where = f"{x_label} = {_x_text(x)}"
    if any("out of memory" in n.lower() or "outofmemory" in n.lower() for n in notes):
        return f"out of memory at {where}"
    if notes:
        return f"no point at {where}: {textwrap.shorten(notes[0], 80)}"
    return f"not measured at {where}"


def _panel_rows(frame: pd.DataFrame | None, metric: str, mode: str) -> pd.DataFrame:
    if frame is None or not len(frame):
        return pd.DataFrame()
    return frame[(frame.metric_name == metric) & (frame.kernel_operation_mode == mode)]


def _subplot_center(figure: go.Figure, col: int) -> tuple[float, float]:
    subplot = figure.get_subplot(1, col)
    return sum(subplot.xaxis.domain) / 2, sum(subplot.yaxis.domain) / 2


def note_subplot(figure: go.Figure, col: int, text: str, width: int = 24) -> None:
    """Say ``text`` in the middle of subplot ``col`` (wrapped to lines of ``width`` characters), and draw the
    subplot without ticks: plotly.js leaves out a subplot with no trace at all, so it gets one invisible,
    pointless trace."""
    x, y = _subplot_center(figure, col)
    figure.add_annotation(
        text="<br>".join(textwrap.wrap(text, width)), xref="paper", yref="paper", x=x, y=y, xanchor="center",
        yanchor="middle", showarrow=False, font={"size": 12, "color": "#555"}, name="note",
    )
    figure.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="", showlegend=False, hoverinfo="skip",
                                marker={"opacity": 0}, meta={"kind": "note"}), row=1, col=col)
    figure.update_xaxes(showticklabels=False, showgrid=False, zeroline=False, row=1, col=col)
    figure.update_yaxes(showticklabels=False, showgrid=False, zeroline=False, row=1, col=col)


def _key(name: str, *, legend: str, group: str, color: str, symbol: str | None = None, dash: str = "solid",
         width: float = 3, rank: int = 1000) -> go.Scatter:
    """A legend entry and nothing else (no point): a provider's colour, or a GPU's marker and dash."""
    return go.Scatter(
        x=[None], y=[None], name=name, legend=legend, legendgroup=group, legendrank=rank, showlegend=True,
        mode="lines+markers" if symbol else "lines", hoverinfo="skip", meta={"kind": "key"},
        line={"color": color, "dash": dash, "width": width}, marker={"symbol": symbol or "circle", "color": color, "size": 8},
    )


#: The colour of the GPU legend's entries: a GPU has no colour of its own.
GPU_KEY_COLOR = "#555555"


def _gpu_key_name(label: str, source: str) -> str:
    return f"{label} (published)" if source == "published" else label


def _add_gpu_key(figure: go.Figure, label: str, source: str, style: tuple[str, str]) -> None:
    """The GPU legend's entry of ``label`` (rows of ``source``) in ``style`` (marker, dash), once per figure."""
    name = _gpu_key_name(label, source)
    if any(_kind(t) == "key" and t.legend == "legend2" and t.name == name for t in figure.data):
        return
    symbol, dash = style
    figure.add_trace(_key(name, legend="legend2", group=f"gpu:{name}", color=GPU_KEY_COLOR,
                          symbol=symbol + ("-open" if source == "published" else ""), dash=dash, width=2), row=1, col=1)
    figure.data[-1].meta = {"kind": "key", "gpu": label, "style": list(style)}


def figure_gpu_style(figure: go.Figure, gpu: str) -> tuple[str, str]:
    """The (marker, dash) ``gpu`` has in ``figure`` (its GPU legend entry's), else :func:`gpu_style`'s."""
    label = device_label(gpu)
    for trace in figure.data:
        meta = trace.meta if isinstance(trace.meta, dict) else {}
        if meta.get("kind") == "key" and meta.get("gpu") == label:
            return tuple(meta["style"])
    return gpu_style(label)


def _add_provider_key(figure: go.Figure, name: str, color: str, *, width: float = 3) -> None:
    if any(_kind(t) == "key" and t.legend == "legend" and t.name == name for t in figure.data):
        return
    figure.add_trace(_key(name, legend="legend", group=name, color=color, width=width,
                          rank=1 if base_provider(name) == "kernels_lib" else 1000), row=1, col=1)


def _layout_legends(figure: go.Figure, right_axis: bool, published: bool) -> None:
    """The provider legend under the panels, the GPU legend at their right (past a right-hand axis where one is
    drawn): two places, so that neither covers the other."""
    figure.update_layout(
        legend={"title": {"text": "provider (colour)"}, "orientation": "h", "x": 0, "xanchor": "left", "y": -0.22,
                "yanchor": "top", "font": {"size": 11}},
        legend2={"title": {"text": "GPU (marker, dash)" + ("<br>open marker: published" if published else "")}, "orientation": "v",
                 "x": 1.12 if right_axis else 1.02, "xanchor": "left", "y": 1, "yanchor": "top", "font": {"size": 11}},
    )


def scaling_chart(
    published: pd.DataFrame | None,
    measured: pd.DataFrame | None,
    *,
    x_label: str,
    title: str,
    panels=PANELS,
    log_x: bool = True,
    unmeasured_note: str | None = NOT_MEASURED_NOTE,
) -> go.Figure:
    """The published scaling chart with our measured rows beside it.

    ``published`` and ``measured``: rows of one loss (either may be None or empty; ``measured`` may hold
    the newest run of several GPUs, :func:`.data.newest_run_per_gpu`). Each panel shows the rows of its
    (metric, mode): a line per (GPU, provider, source) with its p20–p80 band, named
    ``provider · GPU (published|measured)`` on hover. The colour is the provider's, the marker and dash the
    GPU's (open markers: published); the legends name each provider and each GPU once.

    A panel with no measured row shows no published line alone: it says ``unmeasured_note`` (None: leaves the
    panel empty, for a caller that says something of its own). Published memory, which counts the inputs, is
    drawn on a right-hand axis of its own (:data:`PUBLISHED_MEMORY_TITLE`), ours on the left. A line with no
    point at a size where a peer of its GPU and source has one is broken there and marked with a ✕ that says
    why on hover (:func:`gap_reason`).
    """
    panels = list(panels)
    x_label = axis_title(x_label)
    measured_in = [_panel_rows(measured, *panel).get("y_value_50", pd.Series(dtype=float)).notna().any() for panel in panels]
    right_axis = [metric == "memory" and measured_in[i] and bool(len(_panel_rows(published, metric, mode)))
                  for i, (metric, mode) in enumerate(panels)]
    figure = make_subplots(rows=1, cols=max(1, len(panels)), specs=[[{"secondary_y": r} for r in right_axis]] if panels else None,
                           subplot_titles=[f"{'time' if m == 'speed' else m} · {mode}" for m, mode in panels])
    xs_seen, gaps = [], False
    styles = gpu_styles(str(g) for frame in (published, measured) if frame is not None and len(frame) for g in frame.gpu_name)
    unmeasured = []
    for col, (metric, mode) in enumerate(panels, start=1):
        figure.update_xaxes(title_text=x_label, type="log" if log_x else "linear", row=1, col=col)
        figure.update_yaxes(title_text=METRIC_TITLES.get(metric, metric), row=1, col=col, secondary_y=False)
        if not measured_in[col - 1]:
            unmeasured.append(col)
            if unmeasured_note:
                shown = _panel_rows(published, metric, mode)
                extra = "" if not len(shown) else " (the published rows are not drawn alone)"
                note_subplot(figure, col, unmeasured_note + extra)
            continue
        for frame, source in ((published, "published"), (measured, "measured")):
            rows = _panel_rows(frame, metric, mode)
            if not len(rows):
                continue
            on_right = source == "published" and metric == "memory"
            for gpu, on_gpu in rows.groupby("gpu_name", sort=False):
                label = device_label(gpu)
                symbol, dash = styles[label]
                if source == "published":
                    symbol += "-open"
                sizes = sorted({float(x) for x in on_gpu[on_gpu.y_value_50.notna()].x_value})
                for provider, series in on_gpu.groupby("kernel_provider", sort=False):
                    shown_name = display_name(provider, gpu)
                    name = f"{shown_name} · {label} ({source})"
                    color = provider_color(provider)
                    dial = "[" in str(provider) and palette_key(provider) not in VARIANT_COLORS
                    points = series[series.y_value_50.notna()].sort_values("x_value")
                    by_x = dict(zip(points.x_value.astype(float), points.y_value_50.astype(float)))
                    xs = sorted(set(sizes) | set(by_x))
                    xs_seen += xs
                    missing = [x for x in xs if x not in by_x]
                    unit = UNITS.get(metric, "")
                    what = " (published, inputs included)" if on_right else ""
                    if {"y_value_20", "y_value_80"} <= set(points.columns) and len(points):
                        x = points.x_value.tolist()
                        figure.add_trace(
                            go.Scatter(
                                x=x + x[::-1], y=points.y_value_80.tolist() + points.y_value_20.tolist()[::-1],
                                fill="toself", fillcolor=_rgba(color, 0.15), mode="lines", line={"width": 0},
                                hoverinfo="skip", showlegend=False, legendgroup=shown_name, name=f"{name} p20–p80",
                            ),
                            row=1, col=col, secondary_y=on_right if right_axis[col - 1] else None,
                        )
                    figure.add_trace(
                        go.Scatter(
                            x=xs, y=[by_x.get(x) for x in xs], mode="lines+markers", name=name, legendgroup=shown_name,
                            showlegend=False, connectgaps=False,
                            line={"color": color, "dash": dash, "width": 1.5 if dial else 2.5},
                            marker={"symbol": symbol, "size": 7, "color": color},
                            hovertemplate=f"{name}{what}<br>{x_label} = %{{x}}<br>%{{y:.4g}} {unit}<extra></extra>",
                        ),
                        row=1, col=col, secondary_y=on_right if right_axis[col - 1] else None,
                    )
                    if missing:
                        gaps = True
                        reasons = [gap_reason(series[series.x_value.astype(float) == x], x, x_label) for x in missing]
                        known = sorted(by_x)
                        anchor = [by_x[max([k for k in known if k < x], default=min(known))] if known else None for x in missing]
                        figure.add_trace(
                            go.Scatter(
                                x=missing, y=anchor, mode="markers", name=f"{name}: no point", legendgroup=shown_name,
                                showlegend=False, marker={"symbol": "x", "size": 10, "color": color}, meta={"kind": "gap"},
                                text=reasons, hovertemplate=f"{name}<br>%{{text}}<extra></extra>",
                            ),
                            row=1, col=col, secondary_y=on_right if right_axis[col - 1] else None,
                        )
                    _add_provider_key(figure, shown_name, color, width=1.5 if dial else 3)
                _add_gpu_key(figure, label, source, styles[label])
        if right_axis[col - 1]:
            figure.update_yaxes(title_text=PUBLISHED_MEMORY_TITLE, secondary_y=True, showgrid=False, row=1, col=col)
    if gaps:
        figure.add_trace(_key(GAP_LEGEND, legend="legend2", group="gap", color=GPU_KEY_COLOR, symbol="x", width=0), row=1, col=1)
        figure.data[-1].mode = "markers"
    if log_x and xs_seen:  # every panel over the same sizes, ticked at them: a panel never looks linear
        # a panel is narrower beside more panels (and the GPU legend at their right): fewer labels, none overlapping
        figure.update_xaxes(matches="x", **integer_ticks(xs_seen, max(3, 12 // max(1, len(panels)))))
        # the first and last sizes a little inside the panel: their labels clear the y axis's and the next panel's
        low, high = math.log10(min(xs_seen)), math.log10(max(xs_seen))
        pad = max(0.08, 0.06 * (high - low))
        figure.update_xaxes(range=[low - pad, high + pad])
    # tick labels off the axis lines: the first size's label cannot meet the y axis's "0" at the corner
    figure.update_xaxes(ticklabelstandoff=8)
    figure.update_yaxes(ticklabelstandoff=6)
    figure.update_layout(height=480, meta={"not_measured_panels": unmeasured}, **wrapped_title(title))
    _layout_legends(figure, any(right_axis), any(k.name.endswith("(published)") for k in legend_keys(figure, "legend2")))
    return kernels_lib_on_top(figure)


def line_traces(figure: go.Figure) -> list[go.Scatter]:
    """The median lines of a :func:`scaling_chart` and its floors (the bands, the legend-only entries, the ✕
    of missing points and the notes' placeholders left out)."""
    return [trace for trace in figure.data if trace.fill != "toself" and _kind(trace) not in ("key", "gap", "note")]


def legend_keys(figure: go.Figure, legend: str = "legend") -> list[go.Scatter]:
    """The legend-only entries of a figure: ``"legend"``, the providers (a colour each); ``"legend2"``, the GPUs
    (a marker and dash each) and the ✕ of missing points."""
    return [trace for trace in figure.data if _kind(trace) == "key" and (trace.legend or "legend") == legend]


def gap_traces(figure: go.Figure) -> list[go.Scatter]:
    """The ✕ of missing points of a :func:`scaling_chart`, their reasons in ``text``."""
    return [trace for trace in figure.data if _kind(trace) == "gap"]


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


def is_published(rows: pd.DataFrame) -> bool:
    """Whether ``rows`` are published rows (the published CSV's layout: a Liger version, no kernels_lib commit)."""
    return "liger_version" in rows.columns and "kernels_lib_commit" not in rows.columns


def speed_memory_chart(
    rows: pd.DataFrame, x_value: int, mode: str = "full", *, title: str | None = None, floor_ms: float | None = None,
    published: bool | None = None,
) -> go.Figure:
    """Speed against memory at one point of the swept axis: the ``mode``'s peak memory on x (log, labelled
    at 1-2-5 steps only: :func:`log_ticks`) and its median time on y; lower-left is better. One trace, so
    one legend entry and one colour, per provider (:func:`base_provider`): the points of a dial such as
    ``kernels_lib[chunk_size=…]`` are diamonds in kernels_lib's trace beside its default (a circle), each
    named on hover, not beside its marker (the points of a dial lie within a few percent of each other, and
    no placement of a dozen labels there keeps them apart). ``floor_ms``, when given, draws the arithmetic
    floor (e.g. the matmuls at the measured ceiling) as a horizontal line.

    ``rows``: rows of one GPU holding ``speed`` and ``memory`` rows of ``mode``; ``published`` (default: told by
    the columns, :func:`is_published`) titles the memory axis with the published definition (inputs included)
    instead of ours (beyond inputs).
    """
    published = is_published(rows) if published is None else published
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
                name=display_name(base),
                customdata=[display_name(p) for p in members],
                marker={"color": provider_color(base), "size": 11,
                        "symbol": ["circle" if p == base else "diamond" for p in members]},
                hovertemplate="%{customdata}<br>%{x:.0f} MB<br>%{y:.3g} ms<extra></extra>",
            )
        )
    if floor_ms is not None:
        figure.add_hline(y=floor_ms, line_dash="dot", line_color=FLOOR_COLOR, annotation_text=f"floor {floor_ms:.1f} ms",
                         annotation_position="bottom right")
    memory_title = "published peak memory, inputs included" if published else "peak memory beyond inputs"
    figure.update_xaxes(title_text=f"{memory_title}, {mode} (MB)", type="log", **log_ticks([mb[p] for p in providers]))
    figure.update_yaxes(title_text=f"time, {mode} (ms)")
    figure.update_layout(height=480, showlegend=True, **wrapped_title(title or f"time vs memory at x = {x_value} ({mode})", width=80),
                         legend={"font": {"size": 11}, "title": {"text": "provider"}})
    return kernels_lib_on_top(figure)


def add_floor(figure: go.Figure, floor: pd.DataFrame, *, name: str = "floor", gpu: str | None = None, panels=PANELS) -> go.Figure:
    """Draw a floor on the speed panels of a :func:`scaling_chart`: a line per panel whose mode is a column of
    ``floor`` (ms, indexed by x), in :data:`FLOOR_COLOR`. With ``gpu`` (the GPU the floor is of), in that GPU's
    marker and dash (:func:`gpu_style`), named ``floor · GPU``, the floor once in the provider legend and the GPU
    in the GPU legend; without, dotted. A panel that says it has no measured row gets no floor. Returns ``figure``."""
    meta = figure.layout.meta if isinstance(figure.layout.meta, dict) else {}
    skipped = set(meta.get("not_measured_panels", []))
    if gpu is not None:
        label = device_label(gpu)
        style = figure_gpu_style(figure, label)
        symbol, dash = style
        trace_name = f"{name} · {label}" if name == "floor" else name
        line, marker, mode = {"color": FLOOR_COLOR, "dash": dash, "width": 2}, {"symbol": symbol, "size": 6, "color": FLOOR_COLOR}, "lines+markers"
    else:
        trace_name, line, marker, mode = name, {"color": FLOOR_COLOR, "dash": "dot", "width": 2}, None, "lines"
    shown = False
    for col, (metric, mode_) in enumerate(panels, start=1):
        if metric != "speed" or mode_ not in floor.columns or col in skipped:
            continue
        series = floor[mode_].dropna().sort_index()
        figure.add_trace(
            go.Scatter(
                x=series.index.tolist(), y=series.tolist(), mode=mode, name=trace_name, legendgroup="floor" if gpu else trace_name,
                showlegend=gpu is None and not shown, line=line, marker=marker, meta={"kind": "floor"},
                hovertemplate=f"{trace_name}<br>x=%{{x}}<br>%{{y:.4g}} ms<extra></extra>",
            ),
            row=1,
            col=col,
        )
        shown = True
    if gpu is not None and shown:
        _add_provider_key(figure, "floor", FLOOR_COLOR, width=2)
        _add_gpu_key(figure, label, "measured", style)
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
