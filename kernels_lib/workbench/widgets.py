"""The interactive sweep panel of the notebooks (ipywidgets + a plotly FigureWidget).

Built only when a notebook runs interactively: a ``FigureWidget`` or ``interact`` built under
papermill hangs the run (measured), so notebooks call :func:`sweep_panel` only when their
``interactive`` parameter is True and draw :func:`kernels_lib.workbench.charts.scaling_chart` otherwise.
"""

from __future__ import annotations

import ipywidgets as w
import pandas as pd
import plotly.graph_objects as go
import torch
from IPython.display import display

from .bench.registry import get_spec
from .bench.sweep import run_sweep
from .charts import scaling_chart

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def summary_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Median per (metric, mode, provider) × x: the table beside the chart."""
    if not len(rows):
        return pd.DataFrame()
    return rows.pivot_table(
        index=["metric_name", "kernel_operation_mode", "kernel_provider"], columns="x_value", values="y_value_50"
    )


def _range_choices(values: list[int]) -> list[int]:
    """Points a range slider offers around ``values``: them, and halves and doubles of them."""
    return sorted(set(values) | {v * 2 for v in values} | {max(1, v // 2) for v in values})


class SweepPanel:
    """Controls for the swept axis (any size of the loss) and its range, the other sizes, dtype,
    modes and providers; a Run button; a progress bar; a chart and a table that update when a sweep
    finishes. ``run()`` is what the button calls."""

    def __init__(self, kernel_name: str, device: torch.device | str, preset: dict):
        self.spec = get_spec(kernel_name)
        self.device = torch.device(device)
        self.preset = preset
        label = {"description_width": "70px"}
        # every size of the loss gets a slider; the swept one is disabled and the range slider rules
        fixed = {preset["x_name"]: preset["x_values"][len(preset["x_values"]) // 2], **preset["sizes"]}
        self.sizes = {
            name: w.IntSlider(value=value, min=1, max=4 * value, description=name, style=label)
            for name, value in fixed.items()
        }
        self.axis = w.Dropdown(options=list(fixed), value=preset["x_name"], description="sweep", style=label)
        self.axis_row = w.HBox([self.axis])
        self.axis.observe(lambda _: self._axis_changed(), names="value")
        self._axis_changed()
        self.dtype = w.Dropdown(options=list(DTYPES), value=str(preset["dtype"]).replace("torch.", ""), description="dtype")
        self.providers = {name: w.Checkbox(value=True, description=name, indent=False) for name in self.spec.providers}
        self.modes = w.SelectMultiple(options=["forward", "forward_no_grad", "backward", "full"], value=["forward", "full"], description="modes")
        self.button = w.Button(description="Run sweep", button_style="primary", icon="play")
        self.progress = w.IntProgress(value=0, min=0, max=1, description="idle")
        self.status = w.HTML()
        self.figure = go.FigureWidget(self._chart(pd.DataFrame()))
        self.table = w.Output()
        self.rows = pd.DataFrame()
        self.button.on_click(lambda _: self.run())
        self.widget = w.VBox(
            [
                self.axis_row,
                w.HBox(list(self.sizes.values())),
                w.HBox([self.dtype, self.modes, w.VBox(list(self.providers.values()))]),
                w.HBox([self.button, self.progress, self.status]),
                self.figure,
                self.table,
            ]
        )

    def _axis_changed(self) -> None:
        """A new range slider around the new axis's values; its fixed-size slider disabled.

        The slider is replaced, not given new options: changing the options of a live
        SelectionRangeSlider left JupyterLab's view and the kernel's value apart (measured: the view
        showed 8–16 while the sweep ran 8, 16 and 32)."""
        axis = self.axis.value
        values = self.preset["x_values"] if axis == self.preset["x_name"] else [self.sizes[axis].value // 2, self.sizes[axis].value]
        choices = _range_choices(values)
        self.x_values = w.SelectionRangeSlider(
            options=choices, index=(choices.index(values[0]), choices.index(values[-1])), description="range",
            layout=w.Layout(width="480px"), style={"description_width": "70px"},
        )
        self.axis_row.children = (self.axis, self.x_values)
        for name, slider in self.sizes.items():
            slider.disabled = name == axis

    def _chart(self, rows: pd.DataFrame) -> go.Figure:
        return scaling_chart(None, rows, x_label=self.axis.value, title=f"{self.spec.kernel_name} on {self.device}")

    def _progress(self, done: int, total: int, label: str) -> None:
        self.progress.max, self.progress.value, self.progress.description = total, done, f"{done}/{total}"
        self.status.value = label

    def run(self) -> pd.DataFrame:
        """Sweep with the current settings, then redraw the chart and the table."""
        low, high = self.x_values.value
        values = [v for v in self.x_values.options if low <= v <= high]
        providers = [name for name, box in self.providers.items() if box.value]
        self.button.disabled = True
        try:
            self.rows = run_sweep(
                self.spec.kernel_name,
                x_name=self.axis.value,
                x_values=values,
                sizes={name: slider.value for name, slider in self.sizes.items() if name != self.axis.value},
                dtype=DTYPES[self.dtype.value],
                device=self.device,
                providers=providers,
                modes=list(self.modes.value),
                progress=self._progress,
            )
        finally:
            self.button.disabled = False
        chart = self._chart(self.rows)
        with self.figure.batch_update():
            self.figure.data = []
            self.figure.add_traces(list(chart.data))
            self.figure.layout.update(chart.layout)
        self.table.clear_output()
        with self.table:
            display(summary_table(self.rows))
        self.status.value = f"done: {len(self.rows)} rows"
        return self.rows


def sweep_panel(kernel_name: str, device: torch.device | str, preset: dict) -> SweepPanel:
    """Build and display the panel; returns it (``panel.run()`` runs a sweep, ``panel.rows`` holds it)."""
    panel = SweepPanel(kernel_name, device, preset)
    display(panel.widget)
    return panel
