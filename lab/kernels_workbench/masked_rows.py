"""The masked-rows runs (``scripts/masked_rows_bench.py``) read back: does the head's time follow the valid tokens?

:func:`newest_runs` reads ``data/measured/gpu_runs/fused_linear_cross_entropy_masked_rows.csv`` (None
while no GPU run is committed), one run per GPU; :func:`figure` draws each provider's median time
(p20–p80 as error bars) against the masked share, beside its time relative to its own unmasked point with
the valid-token share as the line a loss that drops the masked rows would follow; :func:`sentence`
says it in one line, every figure taken from the rows.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import charts, data
from .bench.masked_rows import KERNEL_NAME

#: Where the runs are committed, under ``data/measured/``.
RUNS_FILE = f"gpu_runs/{KERNEL_NAME}.csv"
NOT_MEASURED = ("The masked-rows workload has not been measured on a GPU yet: "
                "`python scripts/masked_rows_bench.py --out DIR` on the GPU, then append its CSV to "
                f"`data/measured/{RUNS_FILE}`.")


def newest_runs(path=None) -> dict[str, pd.DataFrame] | None:
    """Per GPU, the rows of its newest run; None when the file does not exist."""
    path = data.MEASURED_DIR / RUNS_FILE if path is None else path
    if not path.exists():
        return None
    return data.newest_run_per_gpu(data.read_rows(path))


def _speed(rows: pd.DataFrame) -> pd.DataFrame:
    speed = rows[(rows.metric_name == "speed") & rows.y_value_50.notna()]
    return speed.sort_values(["kernel_provider", "x_value"])


def relative_times(rows: pd.DataFrame) -> pd.DataFrame:
    """Per provider and masked share, the median time over the provider's own time at 0 % masked, and the
    valid-token share ``1 - masked / 100`` (the ratio of a loss whose time follows the valid tokens)."""
    speed = _speed(rows)
    unmasked = speed[speed.x_value == 0].set_index("kernel_provider").y_value_50
    speed = speed[speed.kernel_provider.isin(unmasked.index)]
    return pd.DataFrame({
        "provider": speed.kernel_provider.values, "masked %": speed.x_value.values,
        "time / unmasked": (speed.y_value_50 / speed.kernel_provider.map(unmasked)).values,
        "valid share": (1 - speed.x_value / 100).values,
    })


def figure(rows: pd.DataFrame, gpu: str = "") -> go.Figure:
    """Left: median time (ms) of forward + backward against the masked share, p20–p80 as error bars.
    Right: each provider's time over its unmasked time, and the valid-token share (dotted)."""
    speed, relative = _speed(rows), relative_times(rows)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time (ms), forward + backward", "time / time at 0 % masked"))
    for provider, group in speed.groupby("kernel_provider", sort=False):
        color = charts.provider_color(provider)
        name = charts.display_name(provider)
        fig.add_trace(go.Scatter(
            x=group.x_value, y=group.y_value_50, mode="lines+markers", name=name, legendgroup=provider,
            line={"color": color}, error_y={"type": "data", "symmetric": False,
                                            "array": group.y_value_80 - group.y_value_50,
                                            "arrayminus": group.y_value_50 - group.y_value_20}), row=1, col=1)
        mine = relative[relative.provider == provider]
        fig.add_trace(go.Scatter(x=mine["masked %"], y=mine["time / unmasked"], mode="lines+markers", name=name,
                                 legendgroup=provider, showlegend=False, line={"color": color}), row=1, col=2)
    shares = sorted(speed.x_value.unique())
    fig.add_trace(go.Scatter(x=shares, y=[1 - s / 100 for s in shares], mode="lines", name="valid-token share",
                             line={"color": charts.FLOOR_COLOR, "dash": "dot"}), row=1, col=2)
    fig.update_xaxes(title_text="masked positions (%)", tickvals=shares)
    fig.update_layout(height=420, **charts.wrapped_title(f"The head's loss with masked positions{' · ' + gpu if gpu else ''}"))
    return fig


def sentence(rows: pd.DataFrame, ours: str = "kernels_lib") -> str:
    """One line from the rows: at the largest masked share, each provider's time over its unmasked time,
    beside the valid-token share."""
    relative = relative_times(rows)
    if relative.empty or ours not in set(relative.provider):
        return f"No {ours} row with an unmasked point in this run."
    top = relative["masked %"].max()
    at_top = relative[relative["masked %"] == top].set_index("provider")["time / unmasked"]
    others = ", ".join(f"{charts.display_name(p)} {r:.2f}" for p, r in at_top.items() if p != ours)
    return (f"With {top:g} % of the positions masked ({1 - top / 100:.0%} of the tokens valid), {ours}'s head takes "
            f"{at_top[ours]:.2f} of its unmasked time" + (f"; {others}." if others else "."))
