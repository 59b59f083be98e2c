"""A peer measured far from its own published figure, set beside that peer's own benchmark configuration.

``studies/liger_grpo_own_config.py`` times Liger's fused GRPO module two ways on one GPU, each in a fresh
process: as the chart sweep's adapter calls it (``bench_adapter``) and as Liger's own benchmark script
configures it (``liger_own``). :func:`table` sets both beside Liger's published ``full`` time at the same
``B``; :func:`sentence` says what the rows show, and that the gap stays unexplained where an arm is missing.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import data
from .narrative import span

FILE = data.MEASURED_DIR / "gpu_runs" / "liger_grpo_own_config.csv"
ARMS = {"bench_adapter": "the chart sweep's adapter", "liger_own": "Liger's own benchmark configuration"}
KERNEL_NAMES = {"token": "fused_linear_grpo_loss_token", "sequence": "fused_linear_grpo_loss_sequence"}


def read(path: Path | str | None = None) -> pd.DataFrame:
    """The study's rows (empty when it has not run)."""
    path = Path(path) if path is not None else FILE
    return data.read_table(path) if path.exists() else pd.DataFrame()


def published_full_ms(level: str, published: pd.DataFrame | None = None) -> pd.Series:
    """Liger's published ``full`` median (ms) per ``B`` at ``level``, and the published GPU as the name."""
    rows = data.load_published(KERNEL_NAMES[level]) if published is None else published
    rows = rows[(rows.kernel_provider == "liger") & (rows.kernel_operation_mode == "full") & (rows.metric_name == "speed")]
    series = rows.set_index(rows.x_value.astype(int)).y_value_50.astype(float)
    return series.rename(str(rows.gpu_name.iloc[0]) if len(rows) else "not published")


def table(rows: pd.DataFrame, published: dict[str, pd.DataFrame] | None = None) -> pd.DataFrame:
    """Per level and ``B``: each arm's measured ``full`` time (ms), Liger's published time and each arm's
    time over it (``× published``). An arm the run has no rows of is absent."""
    if not len(rows):
        return pd.DataFrame()
    parts = []
    for level, group in rows.groupby("importance_sampling_level", sort=False):
        times = group.pivot_table(index="B", columns="arm", values="ms_p50")
        times = times[[arm for arm in ARMS if arm in times.columns]]
        figure = published_full_ms(level, None if published is None else published[level])
        out = times.rename(columns=lambda arm: f"{arm} ms")
        out["published ms"] = figure.reindex(out.index)
        for arm in times.columns:
            out[f"{arm} × published"] = times[arm] / out["published ms"]
        out.insert(0, "level", level)
        parts.append(out.reset_index())
    return pd.concat(parts, ignore_index=True)


def sentence(rows: pd.DataFrame, published: dict[str, pd.DataFrame] | None = None) -> str:
    """What the study shows, in the words of its rows: the adapter's time at the largest ``B`` over the
    published figure and on which GPUs, and whether Liger's own configuration ran."""
    if not len(rows):
        return "Liger's own benchmark configuration has not been run beside the chart's adapter yet: the gap is unexplained."
    shown = table(rows, published)
    largest = shown[shown.B == shown.B.max()]
    gpu = data.gpu_label(str(rows.gpu_name.iloc[0]))
    ran = [arm for arm in ARMS if f"{arm} ms" in shown.columns and shown[f"{arm} ms"].notna().any()]
    said = []
    if "bench_adapter" in ran:
        ratios = largest["bench_adapter × published"]
        said.append(f"as the chart calls it, Liger's GRPO takes {span(largest['bench_adapter ms'], 0, ' ms')} "
                    f"at B = {int(shown.B.max())} on the {gpu}, "
                    f"{span(ratios, 1)} its published time on the slower "
                    f"{data.gpu_label(published_full_ms('token', None if published is None else published['token']).name)}")
    if "liger_own" in ran:
        own = largest["liger_own × published"]
        said.append(f"in its own benchmark's configuration {span(own, 1)} that time")
        return "; ".join(said).capitalize() + "."
    said.append("its own benchmark's configuration did not run at the installed versions "
                f"(liger-kernel {rows.liger_version.iloc[0]}, torch {rows.torch_version.iloc[0]}), "
                "so the gap is unexplained and Liger is left out of the fastest peer here")
    return "; ".join(said)[0].upper() + "; ".join(said)[1:] + "."
