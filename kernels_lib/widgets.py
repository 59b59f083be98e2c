"""The interactive sweep panel of the notebooks (ipywidgets + a plotly FigureWidget).

Built only when a notebook runs interactively: a ``FigureWidget`` or ``interact`` built under
papermill hangs the run (measured), so notebooks call :func:`sweep_panel` only when their
``interactive`` parameter is True and draw :func:`kernels_lib.charts.scaling_chart` otherwise.
"""

from __future__ import annotations

import ipywidgets as w
import pandas as pd
import plotly.graph_objects as go
import torch
from IPython.display import display

from .bench.spec import get_spec
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


class SweepPanel:
    """Controls for the swept axis, the fixed sizes, dtype and providers; a Run button; a progress
    bar; a chart and a table that update when a sweep finishes. ``run()`` is what the button calls."""

    def __init__(self, kernel_name: str, device: torch.device | str, preset: dict):
        self.spec = get_spec(kernel_name)
        self.device = torch.device(device)
        x_name = preset["x_name"]
        choices = sorted(set(preset["x_values"]) | {v * 2 for v in preset["x_values"]} | {v // 2 for v in preset["x_values"]})
        self.x_values = w.SelectionRangeSlider(
            options=choices, index=(choices.index(preset["x_values"][0]), choices.index(preset["x_values"][-1])),
            description=f"{x_name} range", layout=w.Layout(width="480px"), style={"description_width": "90px"},
        )
        self.sizes = {
            name: w.IntSlider(value=value, min=1, max=4 * value, description=name, style={"description_width": "90px"})
            for name, value in preset["sizes"].items()
        }
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
                w.HBox([self.x_values, *self.sizes.values()]),
                w.HBox([self.dtype, self.modes, w.VBox(list(self.providers.values()))]),
                w.HBox([self.button, self.progress, self.status]),
                self.figure,
                self.table,
            ]
        )

    def _chart(self, rows: pd.DataFrame) -> go.Figure:
        x_name = self.spec.published["x_name"]
        return scaling_chart(None, rows, x_label=x_name, title=f"{self.spec.kernel_name} on {self.device}")

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
                x_name=self.spec.published["x_name"],
                x_values=values,
                sizes={name: slider.value for name, slider in self.sizes.items()},
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
