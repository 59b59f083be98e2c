"""The interactive sweep panel of the notebooks (ipywidgets + a plotly FigureWidget).

Built only when a notebook runs interactively: a ``FigureWidget`` or ``interact`` built under
papermill hangs the run (measured), so notebooks call :func:`sweep_panel` only when their
``interactive`` parameter is True and draw :func:`kernels_workbench.charts.scaling_chart` otherwise.

The panel says what it measured and what it could not:

- the chart's title names the loss, the device, the fixed sizes and the dtype (:func:`chart_title`); on a
  CPU it says that kernels_lib's times come from Triton's interpreter and rank nothing (:data:`INTERPRETER_NOTE`),
  and only kernels_lib's kernels are labelled "(Triton interpreter)": torch and TRL run natively;
- a provider that cannot run here is not ticked, and is named with its reason under the boxes and, when
  ticked anyway, in the status after the sweep (:func:`sweep_status`);
- a subplot with nothing to show says why (:func:`panel_figure`): "not measured here" for memory on a CPU,
  what will appear there before the first sweep;
- a provider and each variant of its own keep their colour of every chart (:func:`.charts.provider_color`);
  every provider is shown under its one display name (:func:`.charts.display_name`: the baseline as
  :data:`BASELINE_NAME` whatever its key in the data) in the checkboxes, the progress, the status, the
  table and the chart;
- the table names its columns as people do, with units (:func:`summary_table`);
- a size above the panel's cap is set to the cap with a message saying the cap and why (:func:`capped`);
- the status says "running 0/N" the moment a sweep starts.
"""

from __future__ import annotations

import textwrap
import time

import ipywidgets as w
import pandas as pd
import plotly.graph_objects as go
import torch
from IPython.display import display

from .bench.registry import get_spec
from .bench.spec import LossSpec
from .bench.sweep import available_providers, run_sweep
from .charts import (
    BASELINE_NAME, METRIC_TITLES, axis_title, display_name, is_interpreter_device, note_subplot, scaling_chart, table_number,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("forward", "forward_no_grad", "backward", "full")
#: The loss as a title names it, by ``kernel_name``.
LOSS_LABELS = {
    "fused_linear_cross_entropy": "Fused linear cross-entropy",
    "fused_linear_orpo_loss": "ORPO (fused linear)",
    "kto_loss": "KTO (fused linear)",
    "kl_div": "KL divergence",
    "fused_linear_grpo_loss_token": "GRPO, token-level importance sampling",
    "fused_linear_grpo_loss_sequence": "GRPO, sequence-level importance sampling",
    "fused_linear_dpo_loss": "DPO (fused linear)",
    "fused_linear_cpo_loss": "CPO (fused linear)",
    "fused_linear_simpo_loss": "SimPO (fused linear)",
    "jsd": "Jensen-Shannon divergence",
    "tvd": "Total variation distance",
    "fused_linear_jsd": "Fused linear JSD (distillation)",
    "distill_jsd_loss": "Distillation, JSD",
    "distill_cosine_loss": "Distillation, cosine",
    "cross_entropy": "Cross-entropy",
    "megatron_cross_entropy": "Vocab-parallel cross-entropy (Megatron)",
}
#: What a chart drawn on a CPU says of its times.
INTERPRETER_NOTE = ("on a CPU kernels_lib runs in Triton's interpreter (torch and TRL natively): "
                    "times show the path works, they rank nothing")
#: Why the memory subplot of a CPU sweep is empty.
NO_MEMORY_NOTE = "not measured here: peak memory is read on a GPU only, a CPU sweep has none"
#: A size the panel takes at most, as a multiple of the notebook's preset, and why.
CAP_FACTOR = 4
CAP_REASON = "so that one sweep stays within minutes (the Triton interpreter on a CPU) and within a GPU's memory"
#: The table's and the status's names of the measurements.
MEASURE_NAMES = {"speed": METRIC_TITLES["speed"], "memory": METRIC_TITLES["memory"]}


def loss_label(kernel_name: str) -> str:
    """The loss as a title names it (:data:`LOSS_LABELS`; an unlisted loss keeps its ``kernel_name``)."""
    return LOSS_LABELS.get(kernel_name, kernel_name)


def display_provider(spec: LossSpec, provider: str, device: torch.device | str | None = None) -> str:
    """A provider as the panel shows it: its one display name (:func:`.charts.display_name`), the spec's
    baseline as :data:`BASELINE_NAME`; on a CPU (``device``) kernels_lib's kernels labelled as run in Triton's
    interpreter, and no other provider."""
    where = None if device is None else ("CPU" if is_interpreted(device) else "cuda")
    return BASELINE_NAME if provider == spec.baseline else display_name(provider, where)


def skip_reason(text: str) -> str:
    """The reason a provider cannot run here, as a person reads it: ``available_providers``' text without
    the exception's type and cut at its first ``;`` ("Liger's kernels need CUDA (…)")."""
    text = str(text)
    head, _, rest = text.partition(": ")
    if rest and head.isidentifier() and head[:1].isupper():
        text = rest
    return text.split("; ")[0].strip()


def is_interpreted(device: torch.device | str) -> bool:
    """Whether a sweep on ``device`` runs our kernels in Triton's interpreter (any device but a GPU)."""
    return torch.device(device).type != "cuda"


def device_label(device: torch.device | str) -> str:
    """The device as a title names it: the GPU's name, or "CPU" (the title's second line says what runs there)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU" if device.type == "cpu" else str(device)


def chart_title(label: str, device_text: str, sizes: dict, dtype: str, *, x_name: str, interpreted: bool) -> str:
    """The panel chart's title: the loss, the device, the fixed sizes and the dtype, the swept axis; on a CPU
    a second, smaller line with :data:`INTERPRETER_NOTE`."""
    fixed = ", ".join(f"{name}={value}" for name, value in sizes.items() if name != x_name)
    title = "<br>".join(textwrap.wrap(f"{label} on {device_text} · {fixed + ' · ' if fixed else ''}{dtype} · {x_name} swept", 100))
    return f"{title}<br><sup>{INTERPRETER_NOTE}</sup>" if interpreted else title


def chart_panels(modes) -> list[tuple[str, str]]:
    """The subplots of a sweep of ``modes``: the time of each mode (in :data:`MODES`' order), then the memory
    of ``full`` (of the last mode when ``full`` is not swept)."""
    modes = [m for m in MODES if m in modes]
    if not modes:
        return []
    return [("speed", m) for m in modes] + [("memory", "full" if "full" in modes else modes[-1])]


#: A subplot that says why it is empty: :func:`.charts.note_subplot`.
_empty_subplot = note_subplot


def panel_figure(
    rows: pd.DataFrame, spec: LossSpec, *, panels, x_name: str, title: str, interpreted: bool, swept: bool
) -> go.Figure:
    """The panel's chart of ``rows`` (a sweep; empty before the first): :func:`.charts.scaling_chart` with the
    baseline shown as :data:`BASELINE_NAME`, a subplot with no measured point saying why it is empty (memory
    on a CPU: :data:`NO_MEMORY_NOTE`; before a sweep (``swept`` False): what will appear there; every point
    failed: so). On a CPU only kernels_lib's lines are named as run in Triton's interpreter (the chart's names,
    :func:`.charts.display_name`); the speed axes are "time (ms)" for every provider."""
    shown = rows.assign(kernel_provider=[display_provider(spec, p) for p in rows.kernel_provider]) if len(rows) else None
    figure = scaling_chart(None, shown, x_label=x_name, title="", panels=panels, unmeasured_note=None)
    lines = title.count("<br>") + 1
    figure.update_layout(title={"text": title}, margin={"t": 60 + 22 * lines}, width=max(760, 300 * len(panels)))
    for col, (metric, mode) in enumerate(panels, start=1):
        measured = len(rows) and rows[(rows.metric_name == metric) & (rows.kernel_operation_mode == mode)].y_value_50.notna().any()
        if metric == "memory" and interpreted:
            _empty_subplot(figure, col, NO_MEMORY_NOTE)
        elif not swept:
            what = MEASURE_NAMES.get(metric, metric)
            _empty_subplot(figure, col, f"after Run sweep: {what} of each ticked provider")
        elif not measured:
            _empty_subplot(figure, col, "not measured here: every ticked provider failed at every point (the status says why)")
    return figure


def summary_table(rows: pd.DataFrame, spec: LossSpec | None = None) -> pd.DataFrame:
    """Median per (mode, provider) × (measure, swept size): the table beside the chart, its columns named as
    people say them ("mode", "provider", "time (ms)", "peak memory beyond inputs (MB)", the swept axis by its
    name), each provider by its display name (:func:`display_provider`; on a CPU kernels_lib's as run in
    Triton's interpreter); a point that failed is NaN, not left out."""
    if not len(rows):
        return pd.DataFrame()
    x_name = str(rows.x_name.iloc[0]) if "x_name" in rows.columns else "size"
    providers = list(dict.fromkeys(rows.kernel_provider))
    device = "cpu" if "gpu_name" in rows.columns and any(map(is_interpreter_device, rows.gpu_name)) else None
    if spec is not None:
        named = lambda p: display_provider(spec, p, device)  # noqa: E731
    else:
        named = lambda p: display_name(p, "CPU" if device else None)  # noqa: E731
    frame = pd.DataFrame({
        "mode": pd.Categorical(rows.kernel_operation_mode, categories=[m for m in MODES if m in set(rows.kernel_operation_mode)]),
        "provider": pd.Categorical([named(p) for p in rows.kernel_provider], categories=list(dict.fromkeys(map(named, providers)))),
        "measure": pd.Categorical([MEASURE_NAMES.get(m, m) for m in rows.metric_name],
                                  categories=[MEASURE_NAMES[m] for m in MEASURE_NAMES if m in set(rows.metric_name)]),
        axis_title(x_name): rows.x_value.astype(int),
        "value": rows.y_value_50.astype(float),
    })
    table = frame.pivot_table(index=["mode", "provider"], columns=["measure", axis_title(x_name)], values="value",
                              aggfunc="median", dropna=False, observed=True)
    table.columns.names = [None, axis_title(x_name)]
    return table


def capped(name: str, value: int, cap: int) -> tuple[int, str]:
    """``value`` held to ``1 … cap``, and the message saying what was done and why ("" when nothing was)."""
    if value > cap:
        return cap, f"{name} = {value} is above this panel's cap: set to {cap} ({CAP_FACTOR}× the notebook's preset, {CAP_REASON})."
    if value < 1:
        return 1, f"{name} = {value} is below 1: set to 1."
    return value, ""


def sweep_status(rows: pd.DataFrame, spec: LossSpec, asked: list[str], skipped: dict[str, str], seconds: float) -> str:
    """The status after a sweep: how many points in how long, each asked-for provider that did not run here
    with its reason, and each one that failed at some point with its error."""
    speed = rows[rows.metric_name == "speed"] if len(rows) else rows
    parts = [f"done: {len(speed)} points in {seconds:.1f} s"]
    not_run = [f"{display_provider(spec, p)} ({skip_reason(skipped[p])})" for p in asked if p in skipped]
    if not_run:
        parts.append("not run here: " + "; ".join(not_run))
    if len(speed):
        failed = speed[speed.y_value_50.isna()]
        for provider, points in failed.groupby("kernel_provider", sort=False):
            error = next((n.split("; ")[0] for n in points.note if isinstance(n, str) and n and " skipped (" not in n.split("; ")[0]), "no error recorded")
            parts.append(f"{display_provider(spec, provider)} failed at {len(points)} of "
                         f"{(speed.kernel_provider == provider).sum()} points ({error})")
    return " · ".join(parts)


def _range_choices(values: list[int], cap: int | None = None) -> list[int]:
    """Points a range slider offers around ``values``: them, and halves and doubles of them (at most ``cap``)."""
    choices = set(values) | {v * 2 for v in values} | {max(1, v // 2) for v in values}
    return sorted(v for v in choices if cap is None or v <= cap or v in values)


class SweepPanel:
    """Controls for the swept axis (any size of the loss) and its range, the other sizes, dtype,
    modes and providers; a Run button; a progress bar and a status; a chart and a table that update when a
    sweep finishes. ``run()`` is what the button calls.

    ``label``: the loss as the title names it (default :func:`loss_label`)."""

    def __init__(self, kernel_name: str, device: torch.device | str, preset: dict, *, label: str | None = None):
        self.spec = get_spec(kernel_name)
        self.device = torch.device(device)
        self.preset = preset
        self.label = label or loss_label(kernel_name)
        self.interpreted = is_interpreted(self.device)
        label_style = {"description_width": "70px"}
        # every size of the loss gets a box; the swept one is disabled and the range slider rules
        fixed = {preset["x_name"]: preset["x_values"][len(preset["x_values"]) // 2], **preset["sizes"]}
        self.caps = {name: CAP_FACTOR * value for name, value in fixed.items()}
        self.sizes = {
            name: w.IntText(value=value, description=name, style=label_style, layout=w.Layout(width="170px"))
            for name, value in fixed.items()
        }
        self.limits = w.HTML()
        self.size_message = w.HTML()
        self._capping = False
        for name, box in self.sizes.items():
            box.observe(lambda change, name=name: self._size_changed(name, change), names="value")
        self.axis = w.Dropdown(options=list(fixed), value=preset["x_name"], description="sweep", style=label_style)
        self.axis_row = w.HBox([self.axis])
        self.axis.observe(lambda _: self._axis_changed(), names="value")
        self._axis_changed()
        self.dtype = w.Dropdown(options=list(DTYPES), value=str(preset["dtype"]).replace("torch.", ""), description="dtype")
        _, self.skipped = available_providers(kernel_name)
        self.providers = {
            name: w.Checkbox(
                value=name not in self.skipped, indent=False, layout=w.Layout(width="auto"),
                description=display_provider(self.spec, name, self.device) + (" (cannot run here)" if name in self.skipped else ""),
                tooltip=skip_reason(self.skipped[name]) if name in self.skipped else provider.description,
            )
            for name, provider in self.spec.providers.items()
        }
        self.not_here = w.HTML(self._not_here_text())
        self.modes = w.SelectMultiple(options=list(MODES), value=["forward", "full"], description="modes")
        self.button = w.Button(description="Run sweep", button_style="primary", icon="play")
        self.progress = w.IntProgress(value=0, min=0, max=1, description="idle")
        self.status = w.HTML("idle: press Run sweep")
        self.rows = pd.DataFrame()
        self.swept = False
        self.figure = go.FigureWidget(self._chart(self.rows))
        self.table = w.Output()
        self.button.on_click(lambda _: self.run())
        for control in (self.dtype, self.modes):
            control.observe(lambda _: self._redraw_placeholder(), names="value")
        self.widget = w.VBox(
            [
                self.axis_row,
                w.HBox(list(self.sizes.values())),
                self.limits,
                self.size_message,
                w.HBox([self.dtype, self.modes, w.VBox(list(self.providers.values()) + [self.not_here])]),
                w.HBox([self.button, self.progress, self.status]),
                self.figure,
                self.table,
            ]
        )

    # ----------------------------------------------------------------------------------------- settings
    def _not_here_text(self) -> str:
        if not self.skipped:
            return ""
        items = "".join(f"<li>{display_provider(self.spec, n, self.device)}: {skip_reason(why)}</li>" for n, why in self.skipped.items())
        return f"<small>Cannot run here, so not ticked:<ul style='margin:0'>{items}</ul></small>"

    def _limits_text(self) -> str:
        caps = ", ".join(f"{name} ≤ {cap}" for name, cap in self.caps.items())
        return (f"<small>Sizes up to {CAP_FACTOR}× the notebook's preset ({caps}), {CAP_REASON}; the range offers the "
                f"preset's points, their halves and their doubles within the cap.</small>")

    def _size_changed(self, name: str, change: dict) -> None:
        """A size typed: held to its cap with a message saying so (the message goes at the next size within it)."""
        if self._capping:
            return
        value, message = capped(name, int(change["new"]), self.caps[name])
        self.size_message.value = f"<span style='color:#b45309'>{message}</span>" if message else ""
        if value != change["new"]:
            self._capping = True
            try:
                self.sizes[name].value = value
            finally:
                self._capping = False
        self._redraw_placeholder()

    def _axis_changed(self) -> None:
        """A new range slider around the new axis's values; its fixed-size box disabled.

        The slider is replaced, not given new options: changing the options of a live
        SelectionRangeSlider left JupyterLab's view and the kernel's value apart (measured: the view
        showed 8–16 while the sweep ran 8, 16 and 32)."""
        axis = self.axis.value
        values = self.preset["x_values"] if axis == self.preset["x_name"] else [max(1, self.sizes[axis].value // 2), self.sizes[axis].value]
        choices = _range_choices(values, self.caps[axis])
        self.x_values = w.SelectionRangeSlider(
            options=choices, index=(choices.index(values[0]), choices.index(values[-1])), description="range",
            layout=w.Layout(width="480px"), style={"description_width": "70px"},
        )
        self.axis_row.children = (self.axis, self.x_values)
        for name, box in self.sizes.items():
            box.disabled = name == axis
        self.limits.value = self._limits_text()
        self._redraw_placeholder()

    # -------------------------------------------------------------------------------------------- chart
    def _title(self) -> str:
        sizes = {name: box.value for name, box in self.sizes.items()}
        device_text = str(self.rows.gpu_name.iloc[0]) if len(self.rows) and not self.interpreted else device_label(self.device)
        dtype = self.dtype.value if hasattr(self, "dtype") else str(self.preset["dtype"]).replace("torch.", "")
        return chart_title(self.label, device_text, sizes, dtype, x_name=self.axis.value, interpreted=self.interpreted)

    def _chart(self, rows: pd.DataFrame) -> go.Figure:
        modes = list(self.modes.value) if hasattr(self, "modes") else ["forward", "full"]
        if self.swept and len(rows):
            modes = [m for m in MODES if m in set(rows.kernel_operation_mode)]
        return panel_figure(rows, self.spec, panels=chart_panels(modes), x_name=self.axis.value, title=self._title(),
                            interpreted=self.interpreted, swept=self.swept)

    def _draw(self, chart: go.Figure) -> None:
        """Show ``chart`` in a new FigureWidget: updating the old one's layout would keep the subplots,
        axes and notes that ``chart`` no longer has."""
        old, self.figure = self.figure, go.FigureWidget(chart)
        self.widget.children = tuple(self.figure if child is old else child for child in self.widget.children)

    def _redraw_placeholder(self) -> None:
        """Before the first sweep, the chart follows the settings (title, subplots, what will appear)."""
        if hasattr(self, "widget") and not self.swept:
            self._draw(self._chart(self.rows))

    # -------------------------------------------------------------------------------------------- sweep
    def _progress(self, done: int, total: int, label: str) -> None:
        self.progress.max, self.progress.value, self.progress.description = total, done, f"{done}/{total}"
        provider, _, rest = str(label).partition(" ")  # run_sweep's "provider mode x=…": the provider by its display name
        self.status.value = f"running {done}/{total}: {display_provider(self.spec, provider, self.device)} {rest}".rstrip()

    def run(self) -> pd.DataFrame:
        """Sweep with the current settings, then redraw the chart and the table."""
        low, high = self.x_values.value
        values = [v for v in self.x_values.options if low <= v <= high]
        asked = [name for name, box in self.providers.items() if box.value]
        runnable = [name for name in asked if name not in self.skipped]
        modes = [m for m in MODES if m in self.modes.value]
        total = len(values) * len(runnable) * len(modes)
        self.progress.max, self.progress.value, self.progress.description = max(total, 1), 0, f"0/{total}"
        if not total:
            self.status.value = "nothing to run: " + ("tick a mode" if not modes else "tick a provider that can run here")
            return self.rows
        self.status.value = (f"running 0/{total}: {', '.join(display_provider(self.spec, p, self.device) for p in runnable)} "
                             f"at {len(values)} sizes")
        self.button.disabled = True
        start = time.perf_counter()
        try:
            rows = run_sweep(
                self.spec.kernel_name,
                x_name=self.axis.value,
                x_values=values,
                sizes={name: box.value for name, box in self.sizes.items() if name != self.axis.value},
                dtype=DTYPES[self.dtype.value],
                device=self.device,
                providers=runnable,
                modes=modes,
                progress=self._progress,
            )
        except Exception as error:  # said in the status, not lost in the kernel's log
            self.status.value = f"failed: {type(error).__name__}: {next(iter(str(error).splitlines()), '')}"
            raise
        finally:
            self.button.disabled = False
        self.rows, self.swept = rows, True
        self._draw(self._chart(self.rows))
        self.table.clear_output()
        with self.table:
            display(summary_table(self.rows, self.spec).style.format(table_number, na_rep="failed"))
        self.status.value = sweep_status(self.rows, self.spec, asked, self.skipped, time.perf_counter() - start)
        return self.rows


def sweep_panel(kernel_name: str, device: torch.device | str, preset: dict, *, label: str | None = None) -> SweepPanel:
    """Build and display the panel; returns it (``panel.run()`` runs a sweep, ``panel.rows`` holds it).
    ``label``: the loss as the chart's title names it (default :func:`loss_label`)."""
    panel = SweepPanel(kernel_name, device, preset, label=label)
    display(panel.widget)
    return panel


def chooser(labels, description: str = "loss") -> w.Dropdown:
    """A dropdown of ``labels`` (``(label, value)`` pairs or values) wide enough for its longest label: a
    plain ``Dropdown`` cuts labels at its default 300 px."""
    options = list(labels)
    longest = max((len(str(o[0] if isinstance(o, tuple) else o)) for o in options), default=10)
    return w.Dropdown(options=options, description=description, style={"description_width": "initial"},
                      layout=w.Layout(width=f"{longest + len(description) + 8}ch"))


def sweep_chooser(choices: dict[str, tuple[str, dict]], device: torch.device | str, description: str = "loss") -> w.Dropdown:
    """A :func:`chooser` of ``choices`` (label → (kernel_name, preset)) above the panel of the chosen one,
    its title naming the label; displays both and returns the dropdown."""
    dropdown = chooser(list(choices), description)
    area = w.Output()

    def show(_=None):
        area.clear_output()
        with area:
            name, preset = choices[dropdown.value]
            sweep_panel(name, device, preset, label=dropdown.value)

    dropdown.observe(show, names="value")
    display(dropdown, area)
    show()
    return dropdown
