"""The reports index's dashboard: per measured chart, kernels_lib's headline ratios and its targets.

A *chart* is the measured rows of one loss on one swept axis and configuration on the H200 (CUDA):
each published workload of :func:`kernels_lib.workbench.overview.workloads` that has measured rows,
the measured losses without a published chart (DPO), and the tensor-parallel rows
(``data/measured/tensor_parallel.csv``, :mod:`kernels_lib.workbench.tensor_parallel`). Only the
chart's newest run is read (the rows of the commit of its newest kernels_lib row): ratios and targets
compare providers measured in the same run.

:func:`dashboard` returns one tidy row per (chart, peer) (``kind == "ratio"``): kernels_lib's ``full``
median time and memory and their ratios to the peer's at the headline x (the published chart's
largest x when measured, else the largest measured), and one row per (chart, target)
(``kind == "target"``): the verdict of the target functions of :mod:`.bench.analysis` (or of
:func:`.tensor_parallel.verdicts`) over every x of the run, with its bound and worst ratio.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd

from . import data, overview
from . import tensor_parallel as tp
from .bench.analysis import (
    DIVERGENCE_TARGETS,
    FLCE_TARGETS,
    FRONTIER_TARGETS,
    KL_DIV_TARGETS,
    KTO_TARGETS,
    ORPO_TARGETS,
    ceiling,
    distillation_targets,
    frontier_targets,
    fused_linear_cross_entropy_targets,
    issue13_targets,
    medians,
    preference_targets,
    row_divergence_targets,
    target_verdicts,
)
from .bench.registry import get_spec

#: The report (notebook stem) that judges each measured loss; ``tensor_parallel`` is the
#: tensor-parallel CSV. Losses not named here have no card.
REPORTS = {
    "fused_linear_cross_entropy": "01_cross_entropy",
    "kl_div": "02_kl_divergence",
    "fused_linear_orpo_loss": "03_orpo",
    "kto_loss": "04_kto",
    "fused_linear_dpo_loss": "06_preference_dpo_cpo_simpo_grpo",
    "fused_linear_cpo_loss": "06_preference_dpo_cpo_simpo_grpo",
    "fused_linear_simpo_loss": "06_preference_dpo_cpo_simpo_grpo",
    "fused_linear_grpo_loss_token": "06_preference_dpo_cpo_simpo_grpo",
    "fused_linear_grpo_loss_sequence": "06_preference_dpo_cpo_simpo_grpo",
    "jsd": "07_divergences_jsd_tvd",
    "tvd": "07_divergences_jsd_tvd",
    "fused_linear_jsd": "08_distillation",
    "distill_jsd_loss": "08_distillation",
    "distill_cosine_loss": "08_distillation",
    "cross_entropy": "09_tensor_parallel",
    "megatron_cross_entropy": "09_tensor_parallel",
    "tensor_parallel": "09_tensor_parallel",
}
TENSOR_PARALLEL = "tensor_parallel"
COLUMNS = ["key", "kind", "report", "chart", "kernel_name", "x_name", "x", "published x", "peer", "ours ms", "peer ms",
           "time ratio", "ours MB", "peer MB", "memory ratio", "target", "bound", "worst ratio", "worst at x", "status",
           "commit", "gpu", "date"]


@dataclass(frozen=True)
class Chart:
    """The newest run of one measured chart: its rows, which provider is kernels_lib's, and provenance."""

    kernel_name: str
    title: str
    x_name: str
    rows: pd.DataFrame
    ours: str  # the provider (column of full_medians) whose ratios are shown
    published_x: float | None  # the published chart's largest x; None without a published chart
    commit: str
    gpu: str

    @property
    def key(self) -> str:
        return f"{self.kernel_name}/{self.x_name}/{self.title}"

    @property
    def report(self) -> str:
        return REPORTS[self.kernel_name]

    @property
    def date(self) -> str:
        return str(self.rows.timestamp.max())[:10]


def _newest_run(rows: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows of the newest run (:func:`data.newest_run`) and its commit."""
    newest = data.newest_run(rows)
    return newest, str(newest.kernels_lib_commit.iloc[0]) if len(newest) else None


def charts(gpu_name: str = overview.H200) -> list[Chart]:
    """Every chart of :data:`REPORTS` with measured rows on ``gpu_name``: the published workloads (in the
    published CSV's order), then the measured losses without one, then the tensor-parallel rows."""
    result = []
    published_names = set()
    for workload in overview.workloads(gpu_name):
        published_names.add(workload.kernel_name)
        if workload.kernel_name not in REPORTS or not len(workload.measured):
            continue
        run, commit = _newest_run(overview.workload_runs(workload, gpu_name))
        result.append(Chart(workload.kernel_name, workload.title, workload.x_name, run, "kernels_lib",
                            float(workload.published.x_value.max()), commit, gpu_name))
    for kernel_name in REPORTS:
        if kernel_name in published_names or kernel_name == TENSOR_PARALLEL:
            continue
        everything = overview.measured_on(kernel_name, gpu_name, latest=False)
        if not len(everything):
            continue
        run, commit = _newest_run(everything)
        x_name = str(run.x_name.iloc[0])
        title = overview.chart_title(kernel_name, json.loads(run.extra_benchmark_config_str.iloc[0]), x_name)
        result.append(Chart(kernel_name, title, x_name, run, "kernels_lib", None, commit, gpu_name))
    runs = tp.load_runs(gpu_name)
    if len(runs):
        flce = runs[runs.kernel_name == "fused_linear_cross_entropy"]
        config = json.loads(flce.extra_benchmark_config_str.iloc[0])
        title = "tensor-parallel " + overview.chart_title("fused_linear_cross_entropy", config, "N").replace("TP = 1, ", "")
        commits = ", ".join(sorted(set(runs.kernels_lib_commit)))
        result.append(Chart(TENSOR_PARALLEL, title, "N", runs.reset_index(drop=True), f"kernels_lib TP={max(runs.tp)}", None,
                            commits, gpu_name))
    return result


def full_medians(chart: Chart, metric: str) -> pd.DataFrame:
    """The chart's ``full`` medians of ``metric`` (``speed``: ms, ``memory``: MB) per x (index) and provider
    (columns); for the tensor-parallel chart the fused linear cross-entropy rows, one column per
    ``"provider TP=n"``."""
    if chart.kernel_name != TENSOR_PARALLEL:
        return medians(chart.rows, metric, "full")
    table = tp.pivot(chart.rows, "fused_linear_cross_entropy", metric, "full")
    table.columns = [f"{provider} TP={n}" for provider, n in table.columns]
    return table


def peers(chart: Chart) -> list[str]:
    """The providers kernels_lib is compared with: every other provider measured in ``full`` in the run,
    except points of a dial or other configurations (names with ``[``); on the tensor-parallel chart
    the providers at kernels_lib's TP, and kernels_lib at TP = 1."""
    providers = [p for p in full_medians(chart, "speed").columns if p != chart.ours and "[" not in p]
    if chart.kernel_name == TENSOR_PARALLEL:
        same_tp = chart.ours.rsplit(" ", 1)[1]
        providers = [p for p in providers if p.endswith(f" {same_tp}") or p == "kernels_lib TP=1"]
    return providers


def headline_x(chart: Chart) -> float:
    """The x of the headline ratios: the published chart's largest x where kernels_lib's ``full`` time
    was measured in the run, else the largest such x."""
    measured = full_medians(chart, "speed")[chart.ours].dropna().index
    return float(chart.published_x if chart.published_x in measured else max(measured))


def verdicts(chart: Chart, ceilings: pd.DataFrame) -> pd.DataFrame:
    """The chart's targets judged over every x of its run, as :func:`.bench.analysis.target_verdicts`
    writes them (index ``target``; ``bound``, ``worst ratio``, ``worst at x``, ``status``): the target
    functions its report uses, with the ceilings of the same run. For the tensor-parallel chart,
    :func:`.tensor_parallel.verdicts` per target (issue 11's, at TP = 2) and :func:`.tensor_parallel.scaling_verdicts`
    (issue 15's, at TP = 8): ``met`` where met at every point, the largest ratio.
    Empty for a chart without targets."""
    rows, name = chart.rows, chart.kernel_name
    if name == TENSOR_PARALLEL:
        judged = [(tp.TARGETS, tp.verdicts(rows), "x"), (tp.SCALING_TARGETS, tp.scaling_verdicts(rows), "N")]
        out = [_worst_point(f"{what} ≤ {limit}", limit, points[(points.target == target) & points.ratio.notna()], x)
               for targets, points, x in judged for target, (what, limit) in targets.items()]
        return pd.DataFrame(out).set_index("target")
    if name == "fused_linear_cross_entropy":
        # issue 3's targets, then issue 14's against the run's fastest peer (the speed-memory frontier)
        table = fused_linear_cross_entropy_targets(rows, ceiling(ceilings, "matmul", chart.gpu, chart.commit))
        return pd.concat([target_verdicts(table, FLCE_TARGETS), target_verdicts(frontier_targets(rows), FRONTIER_TARGETS)])
    if name in ("kl_div", "jsd", "tvd"):
        targets = KL_DIV_TARGETS if name == "kl_div" else DIVERGENCE_TARGETS
        table = row_divergence_targets(rows, name, ceiling(ceilings, "copy", chart.gpu, chart.commit), targets)
    elif name in ("fused_linear_orpo_loss", "kto_loss"):
        targets = ORPO_TARGETS if name == "fused_linear_orpo_loss" else KTO_TARGETS
        table = preference_targets(rows, targets)
    elif name in ("fused_linear_jsd", "distill_jsd_loss", "distill_cosine_loss"):
        targets = distillation_targets("torch")
        table = preference_targets(rows, targets, baseline="torch")
    elif name.startswith(("fused_linear_dpo", "fused_linear_cpo", "fused_linear_simpo", "fused_linear_grpo")):
        baseline = get_spec(name).baseline
        targets = issue13_targets(baseline)
        table = preference_targets(rows, targets, baseline=baseline)
    else:
        return pd.DataFrame(columns=["bound", "worst ratio", "best ratio", "worst at x", "status"]).rename_axis("target")
    return target_verdicts(table, targets)


def chart_rows(chart: Chart, ceilings: pd.DataFrame) -> pd.DataFrame:
    """The dashboard rows of one chart (:data:`COLUMNS`): one per peer at :func:`headline_x` (ratios of
    kernels_lib's ``full`` time and memory to the peer's, NaN where either was not measured, and the
    memory ratio NaN where the peer allocates under 1 MB beyond its inputs, as Liger's cross-entropy
    does by writing the gradient over the logits: a ratio to ~0 says nothing), then one per target
    (:func:`verdicts`)."""
    speed, memory = full_medians(chart, "speed"), full_medians(chart, "memory")
    x = headline_x(chart)
    at = lambda table, provider: float(table.loc[x, provider]) if provider in table and x in table.index else float("nan")  # noqa: E731
    common = {"report": chart.report, "chart": chart.title, "kernel_name": chart.kernel_name, "x_name": chart.x_name, "x": x,
              "published x": chart.published_x, "commit": chart.commit, "gpu": chart.gpu, "date": chart.date}
    out = []
    for peer in peers(chart):
        ours_ms, peer_ms, ours_mb, peer_mb = at(speed, chart.ours), at(speed, peer), at(memory, chart.ours), at(memory, peer)
        out.append({**common, "key": f"{chart.key}/{peer}", "kind": "ratio", "peer": peer, "ours ms": ours_ms, "peer ms": peer_ms,
                    "time ratio": ours_ms / peer_ms, "ours MB": ours_mb, "peer MB": peer_mb, "memory ratio": ours_mb / peer_mb if peer_mb >= 1 else float("nan")})
    for target, row in verdicts(chart, ceilings).iterrows():
        out.append({**common, "key": f"{chart.key}/{target}", "kind": "target", "target": target, "bound": row["bound"],
                    "worst ratio": row["worst ratio"], "worst at x": row["worst at x"], "status": row["status"]})
    return pd.DataFrame(out, columns=COLUMNS)


def dashboard(chart_list: list[Chart] | None = None, gpu_name: str = overview.H200) -> pd.DataFrame:
    """Every chart's :func:`chart_rows` (``chart_list``: :func:`charts` of ``gpu_name`` by default), in
    the charts' order, with the ceilings of ``data/measured/ceilings.csv``."""
    chart_list = charts(gpu_name) if chart_list is None else chart_list
    ceilings = data.load_measured("ceilings", latest=False)
    frames = [chart_rows(chart, ceilings) for chart in chart_list]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


def _worst_point(target: str, limit: float, points: pd.DataFrame, x: str) -> dict:
    """One target's line from its judged ``points`` (a ``ratio`` column, the point in column ``x``): the
    largest ratio and where, ``met`` where every ratio is within ``limit``, ``not measured`` without points."""
    worst = points.loc[points.ratio.idxmax()] if len(points) else None
    return {"target": target, "bound": limit, "worst ratio": worst.ratio if worst is not None else float("nan"),
            "worst at x": worst[x] if worst is not None else None,
            "status": "not measured" if worst is None else ("met" if (points.ratio <= limit).all() else "missed")}


def ratio_text(value: float) -> str:
    """How the index writes a ratio: two decimals, or an en dash where not measured."""
    return "–" if pd.isna(value) else f"{value:.2f}"


def x_text(value) -> str:
    """How the index writes an x (an integer size, or the tensor-parallel verdict's label)."""
    return f"{value:g}" if isinstance(value, float | int) else str(value)
