"""The reports index's dashboard: per measured chart and per GPU we measured it on, kernels_lib's ratios
to each peer and to the loss's floor.

A *chart* is the measured rows of one loss on one swept axis and configuration on one GPU (CUDA): each
published workload of :func:`kernels_workbench.overview.workloads` that has measured rows, the
measured losses without a published chart (DPO), the tensor-parallel rows
(``data/measured/tensor_parallel.csv``, :mod:`kernels_workbench.tensor_parallel`) and the training
step (``data/measured/training_step.csv``, one chart per model and checkpointing), each once per GPU
it was measured on (:func:`.data.gpus_measured`: no GPU preferred). Only the newest run of a chart on
its GPU is read (:func:`.data.one_run`: one ``kernels_lib_commit`` on one GPU), and every ratio is
paired within it (:func:`.data.same_run_pairs`): a peer the run did not measure is *not measured*,
never a number of another run or another GPU.

:func:`dashboard` returns one tidy row per (chart, GPU, peer) (``kind == "ratio"``): kernels_lib's
``full`` median time and memory and their ratios to the peer's at the headline x (the published chart's
largest x when measured, else the largest measured), each with its tone (``better`` below 1, ``worse``
above, ``not measured`` without a ratio), and one row per chart and GPU (``kind == "floor"``,
:func:`floor_row`): kernels_lib's ``full`` time over the loss's floor at that x from the ceilings its own
run measured. :func:`headlines` reads off it, per chart and GPU, the comparisons a reader asks first:
× the fastest peer's time, × the leanest peer's memory, × the floor.

:func:`chart_section` and :func:`headline_table` render it for the index
(:func:`kernels_workbench.report.write_index`); :func:`ratio_text` prints a ratio.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from . import comparison, data, narrative, overview
from . import floor as one_floor
from . import tensor_parallel as tp
from . import training_step as ts
from .bench.analysis import medians
from .bench.fused_linear_cross_entropy import FLOOR
from .bench.registry import get_spec
from .charts import COLORS

#: The report (notebook stem) that shows each measured loss; ``tensor_parallel`` is the
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
    "training_step": "05_training_step",
}
TENSOR_PARALLEL = "tensor_parallel"
TRAINING_STEP = "training_step"
COLUMNS = ["key", "kind", "report", "chart", "kernel_name", "x_name", "x", "published x", "peer", "ours ms", "peer ms",
           "time ratio", "time tone", "ours MB", "peer MB", "memory ratio", "memory tone", "commit", "gpu", "gpu label", "date", "run",
           "peer note"]
#: What a ratio reads where its peer (or kernels_lib) is missing from the run, on every card alike.
NOT_MEASURED = "not measured"

@dataclass(frozen=True)
class Chart:
    """The newest run of one measured chart on one GPU: its rows, which provider is kernels_lib's, and provenance."""

    kernel_name: str
    title: str
    x_name: str
    rows: pd.DataFrame
    ours: str  # the provider (column of full_medians) whose ratios are shown
    published_x: float | None  # the published chart's largest x; None without a published chart
    commit: str
    gpu: str
    source: pd.DataFrame | None = None  # the training step's own rows (``training_step.csv``)

    @property
    def key(self) -> str:
        return f"{self.kernel_name}/{self.x_name}/{self.title}/{self.gpu_label}"

    @property
    def gpu_label(self) -> str:
        return data.gpu_label(self.gpu)

    @property
    def report(self) -> str:
        return REPORTS[self.kernel_name]

    @property
    def date(self) -> str:
        return str(self.rows.timestamp.max())[:10]

    @property
    def run(self) -> str:
        """Which run the chart's numbers come from (:func:`.data.run_label`); the tensor-parallel chart
        names the run of each workload it shows."""
        if self.kernel_name != TENSOR_PARALLEL:
            return data.run_label(self.rows)
        return "; ".join(f"{name}: {data.run_label(part)}" for name, part in self.rows.groupby("kernel_name", sort=False))


def _newest_run(rows: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The rows of the newest run (:func:`data.newest_run`) of one GPU's rows, and its commit."""
    newest = data.newest_run(rows)
    return newest, str(newest.kernels_lib_commit.iloc[0]) if len(newest) else None


def charts(gpu_name: str | None = None) -> list[Chart]:
    """Every chart of :data:`REPORTS` with measured rows, once per GPU it was measured on (only
    ``gpu_name`` when given), the GPUs of a chart side by side: the published workloads (in the published
    CSV's order), then the measured losses without one, then the tensor-parallel rows and the training step."""
    result = []
    published_names = set()
    for workload in overview.workloads(gpu_name):
        published_names.add(workload.kernel_name)
        if workload.kernel_name not in REPORTS:
            continue
        for gpu in workload.gpus:
            run, commit = _newest_run(workload.on(gpu))  # the run the notebooks compare (comparison.chart_runs)
            result.append(Chart(workload.kernel_name, workload.title, workload.x_name, run, "kernels_lib",
                                float(workload.published.x_value.max()), commit, gpu))
    for kernel_name in REPORTS:
        if kernel_name in published_names or kernel_name in (TENSOR_PARALLEL, TRAINING_STEP):
            continue
        everything = overview.measured_on(kernel_name, gpu_name, latest=False)
        for gpu in data.gpus_measured(everything):
            run, commit = _newest_run(everything[everything.gpu_name == gpu])
            x_name = str(run.x_name.iloc[0])
            title = overview.chart_title(kernel_name, json.loads(run.extra_benchmark_config_str.iloc[0]), x_name)
            result.append(Chart(kernel_name, title, x_name, run, "kernels_lib", None, commit, gpu))
    result += tensor_parallel_charts(gpu_name)
    result += training_step_charts(gpu_name)
    result += training_step_charts(gpu_name, data.measured_file(TRAINING_STEP_TORCH_LCE), TORCH_LCE_LABEL)
    return result


def tensor_parallel_charts(gpu_name: str | None = None) -> list[Chart]:
    """The tensor-parallel chart of each GPU of ``tensor_parallel.csv`` (only ``gpu_name`` when given):
    per workload its newest run on that GPU (:func:`.tensor_parallel.load_runs`), kernels_lib at its
    largest TP beside the peers at that TP and itself at TP = 1."""
    path = data.measured_path(TENSOR_PARALLEL)
    if not path.exists():
        return []
    every = data.read_rows(path)
    gpus = [g for g in data.gpus_measured(every) if gpu_name is None or g == gpu_name]
    out = []
    for gpu in gpus:
        runs = tp.load_runs(gpu)
        flce = runs[runs.kernel_name == "fused_linear_cross_entropy"] if len(runs) else runs
        if not len(flce):
            continue
        config = json.loads(flce.extra_benchmark_config_str.iloc[0])
        title = "tensor-parallel " + overview.chart_title("fused_linear_cross_entropy", config, "N").replace("TP = 1, ", "")
        out.append(Chart(TENSOR_PARALLEL, title, "N", runs.reset_index(drop=True), f"kernels_lib TP={max(flce.tp)}", None,
                         str(flce.kernels_lib_commit.iloc[0]), gpu))
    return out


#: The training step's run beside torch's ``F.linear_cross_entropy`` (``torch_lce`` with Hugging Face
#: and kernels_lib only, kept apart from the sweep with every peer; notebook 05).
TRAINING_STEP_TORCH_LCE = "gpu_runs/training_step_torch_lce.csv"  # inside data/measured/
#: How its charts' titles go on: ``training step, beside torch's F.linear_cross_entropy, <model>, …``.
TORCH_LCE_LABEL = "beside torch's F.linear_cross_entropy, "


def training_step_charts(gpu_name: str | None = None, path: Path | None = None, label: str = "") -> list[Chart]:
    """The training step's charts: per GPU (only ``gpu_name`` when given) and (model, checkpointing) of the
    newest run of each model on that GPU (:func:`.training_step.latest_run`), its rows in the measured CSVs'
    columns (``speed``: the median step time in ms, ``memory``: the peak in MB, both as mode ``full``,
    x = tokens per step). ``path``: another file of training-step rows (default ``training_step.csv``), its
    charts' titles starting ``training step {label}``."""
    path = data.measured_path(TRAINING_STEP) if path is None else Path(path)
    if not path.exists():
        return []
    every = data.read_table(path)
    every = every[every.device == "cuda"]
    out = []
    for gpu in data.gpus_measured(every):
        if gpu_name is not None and gpu != gpu_name:
            continue
        raw = every[every.gpu_name == gpu]
        for (model, ckpt), group in ts.latest_run(raw).groupby(["model", "checkpointing"], sort=False):
            ok = ts.measured(group)
            if not len(ok) or "kernels_lib" not in set(ok.provider):
                continue
            common = {"kernel_name": TRAINING_STEP, "kernel_operation_mode": "full", "x_name": "tokens", "x_value": ok.tokens.astype(float),
                      "kernel_provider": ok.provider, "gpu_name": ok.gpu_name, "kernels_lib_commit": ok.kernels_lib_commit.astype(str),
                      "timestamp": ok.timestamp, "extra_benchmark_config_str": "{}",
                      **{c: ok[c] for c in ("torch_version", "triton_version") if c in ok.columns}}
            rows = pd.concat([pd.DataFrame({**common, "metric_name": "speed", "y_value_50": ok.step_ms_50}),
                              pd.DataFrame({**common, "metric_name": "memory", "y_value_50": ok.peak_gib * 1024})], ignore_index=True)
            title = f"training step, {label}{model}, checkpointing {'on' if bool(ckpt) else 'off'}"
            out.append(Chart(TRAINING_STEP, title, "tokens", rows, "kernels_lib", None, str(rows.kernels_lib_commit.iloc[0]), gpu,
                             group.reset_index(drop=True)))
    return out


def _paired_rows(chart: Chart) -> pd.DataFrame:
    """The rows whose ``full`` medians the chart's ratios pair: its own rows, or on the tensor-parallel
    chart the fused linear cross-entropy rows of its run with each provider named ``"provider TP=n"``."""
    if chart.kernel_name != TENSOR_PARALLEL:
        return chart.rows
    rows = chart.rows[chart.rows.kernel_name == "fused_linear_cross_entropy"]
    return rows.assign(kernel_provider=[f"{p} TP={n}" for p, n in zip(rows.kernel_provider, rows.tp)])


def full_medians(chart: Chart, metric: str) -> pd.DataFrame:
    """The chart's ``full`` medians of ``metric`` (``speed``: ms, ``memory``: MB) per x (index) and provider
    (columns); for the tensor-parallel chart the fused linear cross-entropy rows, one column per
    ``"provider TP=n"``."""
    return medians(_paired_rows(chart), metric, "full")


def peers(chart: Chart) -> list[str]:
    """The providers kernels_lib is compared with: every other provider measured in ``full`` in the run,
    except points of a dial or other configurations (names with ``[``) and the measured floor
    (:data:`.bench.fused_linear_cross_entropy.FLOOR`); on the tensor-parallel chart
    the providers at kernels_lib's TP, and kernels_lib at TP = 1."""
    providers = [p for p in full_medians(chart, "speed").columns if p != chart.ours and "[" not in p and p != FLOOR]
    if chart.kernel_name == TENSOR_PARALLEL:
        same_tp = chart.ours.rsplit(" ", 1)[1]
        providers = [p for p in providers if p.endswith(f" {same_tp}") or p == "kernels_lib TP=1"]
    return providers


def headline_x(chart: Chart) -> float:
    """The x of the headline ratios: the published chart's largest x where kernels_lib's ``full`` time
    was measured in the run, else the largest such x (for the training step, the largest step that
    every provider of the run measured)."""
    speed = full_medians(chart, "speed")
    measured = speed[chart.ours].dropna().index
    if chart.kernel_name == TRAINING_STEP:  # no published chart: the largest step every provider ran, where there is one
        everyone = speed.dropna().index
        return float(max(everyone) if len(everyone) else max(measured))
    return float(chart.published_x if chart.published_x in measured else max(measured))


def tone(ratio: float) -> str:
    """How a ratio of kernels_lib's to a peer's reads on the index, as printed (two decimals,
    :func:`ratio_text`): ``better`` below 1.00 (faster or smaller), ``worse`` above, ``even`` where it
    prints as 1.00, ``not measured`` without one."""
    if pd.isna(ratio):
        return NOT_MEASURED
    shown = round(float(ratio), 2)
    return "better" if shown < 1 else "worse" if shown > 1 else "even"


def chart_rows(chart: Chart, ceilings: pd.DataFrame) -> pd.DataFrame:
    """The dashboard rows of one chart on its GPU (:data:`COLUMNS`): one per peer at :func:`headline_x`
    (ratios of kernels_lib's ``full`` time and memory to the peer's, paired within the run by
    :func:`.data.same_run_pairs`, NaN where either was not measured, and the memory ratio NaN where the peer
    allocates under 1 MB beyond its inputs, as Liger's cross-entropy does by writing the gradient over the
    logits: a ratio to ~0 says nothing), each with its :func:`tone`, then the floor's (:func:`floor_row`)."""
    paired = _paired_rows(chart)
    peer_list = peers(chart)
    x = headline_x(chart)
    speed = data.same_run_pairs(paired, chart.ours, peer_list, "speed").set_index(["peer", "x"])
    memory = data.same_run_pairs(paired, chart.ours, peer_list, "memory").set_index(["peer", "x"])
    common = {"report": chart.report, "chart": chart.title, "kernel_name": chart.kernel_name, "x_name": chart.x_name, "x": x,
              "published x": chart.published_x, "commit": chart.commit, "gpu": chart.gpu, "gpu label": chart.gpu_label,
              "date": chart.date, "run": chart.run}
    nan = {"ours": float("nan"), "peer value": float("nan"), "ratio": float("nan")}
    far = {} if chart.kernel_name in (TENSOR_PARALLEL, TRAINING_STEP) else comparison.far_from_published(
        chart.rows, comparison.published_for(chart.rows, chart.kernel_name))
    out = []
    for peer in peer_list:
        t = speed.loc[(peer, x)] if (peer, x) in speed.index else pd.Series(nan)
        m = memory.loc[(peer, x)] if (peer, x) in memory.index else pd.Series(nan)
        memory_ratio = m["ratio"] if pd.notna(comparison.memory_bases(m["peer value"])) else float("nan")
        out.append({**common, "key": f"{chart.key}/{peer}", "kind": "ratio", "peer": peer, "ours ms": t["ours"], "peer ms": t["peer value"],
                    "time ratio": t["ratio"], "time tone": tone(t["ratio"]), "ours MB": m["ours"], "peer MB": m["peer value"],
                    "memory ratio": memory_ratio, "memory tone": tone(memory_ratio), "peer note": comparison.FAR if peer in far else ""})
    floor = floor_row(chart, ceilings, x)
    if floor is not None:
        out.append({**common, **floor})
    return pd.DataFrame(out, columns=COLUMNS)


def floor_row(chart: Chart, ceilings: pd.DataFrame, x: float) -> dict | None:
    """The chart's ratio to its loss's floor at ``x``: kernels_lib's ``full`` median over :func:`.floor.floor` of
    the chart's **own** run (a run that measured no ceilings has its floor *not measured*, never another run's).
    None for the tensor-parallel and training-step charts (their floors are their notebooks'), and for a loss
    without a bench spec."""
    if chart.kernel_name in (TENSOR_PARALLEL, TRAINING_STEP):
        return None
    try:
        get_spec(chart.kernel_name)
    except ValueError:
        return None
    speed = full_medians(chart, "speed")
    ours = float(speed.at[x, chart.ours]) if x in speed.index and chart.ours in speed.columns else float("nan")
    row = {"key": f"{chart.key}/floor", "kind": "floor", "ours ms": ours, "ours MB": float("nan"), "peer MB": float("nan"),
           "memory ratio": float("nan"), "time tone": None, "memory tone": None}
    at = one_floor.floor(chart.rows, ceilings, chart.kernel_name, "full", [x]).loc[x]
    if pd.isna(at.ms):
        return {**row, "peer": f"floor ({NOT_MEASURED} in this run: no ceilings)", "peer ms": float("nan"), "time ratio": float("nan")}
    what = "its matmuls" if at.bound == "matmul" else "its minimal bytes"
    return {**row, "peer": f"floor ({what}, this run)", "peer ms": at.ms, "time ratio": ours / at.ms}


def dashboard(chart_list: list[Chart] | None = None, gpu_name: str | None = None) -> pd.DataFrame:
    """Every chart's :func:`chart_rows` (``chart_list``: :func:`charts` of every GPU, or of ``gpu_name``,
    by default), in the charts' order, with the ceilings of ``data/measured/ceilings.csv``."""
    chart_list = charts(gpu_name) if chart_list is None else chart_list
    ceilings = data.load_measured("ceilings", latest=False)
    frames = [chart_rows(chart, ceilings) for chart in chart_list]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


HEADLINE_COLUMNS = ["report", "chart", "gpu", "gpu label", "x_name", "x", "fastest peer", "fastest key", "time ratio", "leanest peer",
                    "leanest key", "memory ratio", "floor key", "floor ratio", "run"]


def headlines(board: pd.DataFrame) -> pd.DataFrame:
    """Per (chart, GPU) of a :func:`dashboard`, the comparisons a reader asks first, at the chart's
    headline x and within its run: kernels_lib's ``full`` time over the **fastest** peer's (the peer with
    the least time there), its memory over the **leanest** peer's (the least memory), and its time over
    the floor; each with the key of the dashboard row it is read from. kernels_lib's own other configurations
    (the tensor-parallel chart's TP = 1) are no peer here, as in the notebooks' comparisons. NaN (and no peer) where the run
    measured none."""
    out = []
    for (chart, gpu), rows in board.groupby(["chart", "gpu"], sort=False):
        ratios = rows[rows.kind == "ratio"]
        ratios = ratios[~ratios.peer.str.startswith("kernels_lib")]  # kernels_lib at TP = 1 is its own baseline, not a peer
        by_peer = ratios.set_index("peer")
        far = set(by_peer.index[by_peer["peer note"] == comparison.FAR])  # a far peer is not the fastest
        fastest_peer, _ = comparison.fastest_peers(by_peer[["peer ms"]].T.where(by_peer[["time ratio"]].T.notna().values), far)
        leanest_peer, _ = comparison.leanest_peers(by_peer[["peer MB"]].T.where(by_peer[["memory ratio"]].T.notna().values))
        fastest = by_peer.loc[fastest_peer.iloc[0]].rename(fastest_peer.iloc[0]) if len(fastest_peer) else None
        leanest = by_peer.loc[leanest_peer.iloc[0]].rename(leanest_peer.iloc[0]) if len(leanest_peer) else None
        floor = rows[rows.kind == "floor"]
        first = rows.iloc[0]
        out.append({"report": first.report, "chart": chart, "gpu": gpu, "gpu label": first["gpu label"], "x_name": first.x_name,
                    "x": first.x, "run": first.run,
                    "fastest peer": None if fastest is None else fastest.name, "fastest key": None if fastest is None else fastest.key,
                    "time ratio": float("nan") if fastest is None else fastest["time ratio"],
                    "leanest peer": None if leanest is None else leanest.name, "leanest key": None if leanest is None else leanest.key,
                    "memory ratio": float("nan") if leanest is None else leanest["memory ratio"],
                    "floor key": floor.key.iloc[0] if len(floor) else None,
                    "floor ratio": floor["time ratio"].iloc[0] if len(floor) else float("nan")})
    return pd.DataFrame(out, columns=HEADLINE_COLUMNS)


def ratio_text(value: float, bound: float | None = None) -> str:
    """How the index writes a ratio (:func:`.narrative.span` of one value, without ``×``): two decimals, more where two
    would hide which side of ``bound`` it lies on (1.0004 against 1.0 reads ``1.0004``, not ``1.00``; up to six);
    ``not measured`` where there is none."""
    if pd.isna(value):
        return NOT_MEASURED
    digits = 2
    if bound is not None and value != bound:
        while digits < 6 and round(value, digits) == round(bound, digits):
            digits += 1
    return narrative.span([value], digits, suffix="")


def x_text(value) -> str:
    """How the index writes an x (an integer size, or a point's label)."""
    return f"{value:g}" if isinstance(value, float | int) else str(value)


# --------------------------------------------------------------------------- the index's HTML

#: The dashboard's part of the index's style (the cells' tones, the sparkline's axes).
STYLE = """
td.better, span.better { color: #1a7f37; } td.worse, span.worse { color: #cf222e; }
td.not-measured, span.not-measured { color: #57606a; font-style: italic; }
figure.spark svg text { font-size: 9px; fill: #57606a; font-family: system-ui, sans-serif; }
.card.grpo-family { border: 1px solid #d0d7de; border-radius: 8px; padding: 1rem 1.25rem; margin: 1rem 0; }
table.grpo-family, table.headlines { border-collapse: collapse; font-size: .9rem; }
table.grpo-family td, table.grpo-family th,
table.headlines td, table.headlines th { padding: .2rem .6rem; border-bottom: 1px solid #eaeef2; text-align: left; }
.gpu-run { margin: .5rem 0 1rem; } .gpu-run h4 { margin: .25rem 0; font-size: .95rem; }
"""
#: Colours of providers without one of their own in :data:`.charts.COLORS`, and of kernels_lib's other
#: configurations (TP = 1 beside TP = 2): never kernels_lib's red, which is only the line of ``ours``.
_OTHER_COLORS = ("#7f7f7f", "#8c564b", "#e377c2", "#bcbd22", "#aec7e8", "#98df8a")


def num(key: str, column: str, text: str) -> str:
    """A number of the dashboard on the index: marked with its row's key and column (the browser test
    compares each with :func:`dashboard`)."""
    return f'<span class="num" data-key="{html.escape(key)}" data-col="{html.escape(column)}">{html.escape(text)}</span>'


def _x_scale(xs: list[float]) -> str:
    """How the sparkline spaces its x: evenly, which is a log scale when the sizes grow by one factor."""
    if len(xs) < 3:
        return "evenly spaced"
    factors = {round(b / a, 6) for a, b in zip(xs, xs[1:]) if a > 0}
    if len(factors) == 1:
        factor = factors.pop()
        return "log₂ scale" if factor == 2 else f"log scale (×{factor:g} per step)"
    return "evenly spaced (not to scale)"


def sparkline(times: pd.DataFrame, ours: str, x_name: str = "x", width: int = 280, height: int = 96) -> str:
    """An inline SVG of each provider's ``full`` time (``times``: x index, provider columns, ms) over x, with
    its axes named and scaled: x evenly spaced in sorted order (the charts' sizes are powers of two: a log₂
    axis, labelled at its ends), y linear from 0 ms to the largest time (labelled). ``ours`` is drawn last
    and thickest, in kernels_lib's red, so no peer hides it; the legend below it as text, so no label overlaps."""
    times = times.sort_index()
    top = float(times.max().max())
    top_label = f"{top:.3g} ms" if top < 100 else f"{top:.0f} ms"  # never 1e+03: people read 1002
    # The y labels end 3 px left of the axis, in 9 px type (under 6 px a character): room for the longest.
    left, right, top_pad, bottom = max(40, 6 * len(top_label) + 6), 8, 6, 18
    span_x, span_y = width - left - right, height - top_pad - bottom
    index = [float(x) for x in times.index]
    xs = {x: left + i * span_x / max(len(index) - 1, 1) for i, x in enumerate(times.index)}
    others = iter(_OTHER_COLORS)
    order = [p for p in times.columns if p != ours] + ([ours] if ours in times.columns else [])
    lines, legend = [], []
    for provider in order:
        series = times[provider].dropna()
        base = provider.split("[")[0].split(" ")[0]
        own = COLORS.get(base) if (base != "kernels_lib" or provider == ours) else None
        color = own or next(others, "#7f7f7f")
        dash = "" if own else ' stroke-dasharray="4 2"'
        points = " ".join(f"{xs[x]:.1f},{top_pad + span_y * (1 - v / top):.1f}" for x, v in series.items())
        lines.append(f'<polyline fill="none" stroke="{color}"{dash} stroke-width="{3 if provider == ours else 1.5}" points="{points}"/>')
        legend.append(f'<span style="color:{color}">■ {html.escape(provider)}</span>')
    legend = legend[-1:] + legend[:-1]  # ours first in the legend
    x0, y0 = left, top_pad + span_y
    axes = (f'<line x1="{x0}" y1="{top_pad}" x2="{x0}" y2="{y0}" stroke="#8c959f"/>'
            f'<line x1="{x0}" y1="{y0}" x2="{width - right}" y2="{y0}" stroke="#8c959f"/>'
            f'<text x="{x0 - 3}" y="{top_pad + 8}" text-anchor="end">{top_label}</text>'
            f'<text x="{x0 - 3}" y="{y0}" text-anchor="end">0</text>'
            f'<text x="{x0}" y="{height - 4}" text-anchor="start">{x_text(index[0])}</text>'
            f'<text x="{width - right}" y="{height - 4}" text-anchor="end">{x_text(index[-1])}</text>'
            f'<text x="{x0 + span_x / 2:.0f}" y="{height - 4}" text-anchor="middle">{html.escape(x_name)}</text>')
    scale = _x_scale(index)
    return (f'<figure class="spark"><svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img"><title>full time (ms) over {html.escape(x_name)}, per provider</title>'
            f'<rect width="{width}" height="{height}" fill="#fafbfc"/>{axes}{"".join(lines)}</svg>'
            f'<figcaption>full time (ms, linear from 0) over {html.escape(x_name)} ({scale}, {x_text(index[0])} to '
            f'{x_text(index[-1])}) · {"".join(legend)}</figcaption></figure>')




def _ratio_cell(key: str, column: str, value: float, tone_of: str | None) -> str:
    """A table cell of a ratio: its number (:func:`num`), ``×``, and its tone as the cell's class."""
    tone_class = "" if not isinstance(tone_of, str) else f' class="{tone_of.replace(" ", "-")}"'
    return f"<td{tone_class}>{num(key, column, ratio_text(value))}{'' if pd.isna(value) else '×'}</td>"


def gpu_block(chart: Chart, rows: pd.DataFrame) -> str:
    """One GPU's part of a chart's section: its run (a generated provenance line), the ratios of
    kernels_lib's ``full`` time and memory to each peer's and its time to the floor, each cell toned
    (:func:`tone`), and a sparkline of the run's ``full`` times (``rows``: the chart's rows of :func:`dashboard`
    on that GPU)."""
    ratios = rows[rows.kind == "ratio"]
    first = rows.iloc[0]
    x_key = ratios.key.iloc[0] if len(ratios) else first.key
    published = "" if pd.isna(first["published x"]) or first["published x"] == first.x else f" (published up to {x_text(first['published x'])})"
    scope = "the published chart's largest" if published == "" and not pd.isna(first["published x"]) else "the largest measured"
    run = (f'<p class="run">{html.escape(first.run)}; kernels_lib&#39;s <code>full</code> over each peer&#39;s at {scope} '
           f'{html.escape(first.x_name)} = {num(x_key, "x", x_text(first.x))}{published}. Below 1: kernels_lib is faster or smaller.</p>')
    body = []
    for _, row in ratios.iterrows():
        note = f" ({row['peer note']})" if isinstance(row["peer note"], str) and row["peer note"] else ""
        body.append(f"<tr><td>{html.escape(row.peer + note)}</td>" + _ratio_cell(row.key, "time ratio", row["time ratio"], row["time tone"])
                    + _ratio_cell(row.key, "memory ratio", row["memory ratio"], row["memory tone"]) + "</tr>")
    for _, row in rows[rows.kind == "floor"].iterrows():  # time only: a floor of memory is the inputs
        body.append(f'<tr class="floor"><td>{html.escape(row.peer)}</td><td>{num(row.key, "time ratio", ratio_text(row["time ratio"]))}'
                    f'{"" if pd.isna(row["time ratio"]) else "×"}</td><td>time only</td></tr>')
    table = ('<table class="ratios"><thead><tr><th>kernels_lib / peer</th><th>time</th><th>memory</th></tr></thead>'
             f"<tbody>{''.join(body)}</tbody></table>") if body else ""
    times = full_medians(chart, "speed")[[chart.ours, *peers(chart)]]
    return (f'<div class="gpu-run" data-gpu="{html.escape(chart.gpu)}"><h4>{html.escape(chart.gpu_label)}</h4>{run}'
            f'<div class="row">{table}{sparkline(times, chart.ours, chart.x_name)}</div></div>')


def chart_section(chart: Chart | list[Chart], rows: pd.DataFrame) -> str:
    """One chart of a card: the chart's title, then per GPU it was measured on (``chart``: the chart of
    one GPU, or the same chart's charts of each GPU) a :func:`gpu_block` of that GPU's rows of ``rows``
    (the chart's rows of :func:`dashboard`)."""
    chart_list = [chart] if isinstance(chart, Chart) else list(chart)
    blocks = "".join(gpu_block(c, rows[rows.gpu == c.gpu].reset_index(drop=True)) for c in chart_list if (rows.gpu == c.gpu).any())
    first = chart_list[0]
    return (f'<section class="chart" data-chart="{html.escape(first.title)}"><h3>{html.escape(first.title)}</h3>{blocks}</section>')


def headline_table(board: pd.DataFrame, links: dict[str, str] | None = None) -> str:
    """The index's first table: per chart (its report linked through ``links``: report → href) and per GPU
    of :func:`headlines`, kernels_lib's ``full`` time × the fastest peer's, its memory × the leanest
    peer's, and its time × the floor, each number marked as in the chart's own section."""
    heads = headlines(board)
    if not len(heads):
        return "<p>Nothing measured on a GPU yet (<code>data/measured/</code>).</p>"
    links = links or {}
    body = []
    for _, row in heads.iterrows():
        href = links.get(row.report)
        title = html.escape(row.chart)
        name = f'<a href="{html.escape(href)}">{title}</a>' if href else title
        fastest = f" ({html.escape(row['fastest peer'])})" if isinstance(row["fastest peer"], str) else ""
        leanest = f" ({html.escape(row['leanest peer'])})" if isinstance(row["leanest peer"], str) else ""
        cells = [f"<td>{name}</td>", f"<td>{html.escape(row['gpu label'])}</td>",
                 f"<td>{html.escape(row.x_name)} = {x_text(row.x)}</td>",
                 _headline_cell(row["fastest key"], "time ratio", row["time ratio"], fastest),
                 _headline_cell(row["leanest key"], "memory ratio", row["memory ratio"], leanest),
                 _headline_cell(row["floor key"], "time ratio", row["floor ratio"], "", toned=False, missing="in its report")]
        body.append(f'<tr data-chart="{title}" data-gpu="{html.escape(row.gpu)}">' + "".join(cells) + "</tr>")
    return ('<table class="headlines"><thead><tr><th>loss (chart)</th><th>GPU</th><th>at</th><th>time × fastest peer</th>'
            f'<th>memory × leanest peer</th><th>time × floor</th></tr></thead><tbody>{"".join(body)}</tbody></table>')


def _headline_cell(key: str | None, column: str, value: float, who: str, toned: bool = True, missing: str = NOT_MEASURED) -> str:
    """A cell of :func:`headline_table`: the ratio of dashboard row ``key``'s ``column`` and whose it is; ``missing`` without a row."""
    if not isinstance(key, str):
        return f'<td class="not-measured">{html.escape(missing)}</td>'
    tone_class = f' class="{tone(value).replace(" ", "-")}"' if toned else ""
    return f"<td{tone_class}>{num(key, column, ratio_text(value))}{'' if pd.isna(value) else '×'}{who}</td>"


GRPO_LOSS_TYPES = "gpu_runs/fused_linear_grpo_loss_types.csv"  # inside data/measured/


def grpo_family_card(path: Path | str | None = None, gpu_name: str | None = None) -> str:
    """The index's card *GRPO family*: per GPU of the file (only ``gpu_name`` when given) the newest run of
    ``scripts/grpo_loss_types.py`` (every loss type of TRL 1.16 at the published GRPO workload), per loss
    type kernels_lib's ``full`` time, its ratio to the floor (:func:`.floor.floor_at` at the run's own rates) and to
    each peer's time, and its memory over Liger's, all within that run (:func:`.bench.fused_linear_grpo.loss_type_table`); *not measured*
    where the file has no such run."""
    head = '<div class="card grpo-family" data-card="grpo-family"><h2>GRPO family: every loss type of TRL 1.16</h2>'
    path = data.measured_file(GRPO_LOSS_TYPES) if path is None else Path(path)
    rows = data.read_rows(path) if path.exists() else pd.DataFrame()
    runs = data.newest_run_per_gpu(rows) if len(rows) else {}
    if gpu_name is not None:
        runs = {g: r for g, r in runs.items() if g == gpu_name}
    if not runs:
        where = f" on {html.escape(data.gpu_label(gpu_name))}" if gpu_name else " on a GPU"
        return head + (f"<p>Not measured{where} (<code>scripts/grpo_loss_types.py --out DIR</code> on a "
                       "GPU writes <code>gpu_runs/fused_linear_grpo_loss_types.csv</code>).</p></div>")
    return head + "".join(_grpo_family_table(gpu, run) for gpu, run in runs.items()) + "</div>"


def _grpo_family_table(gpu: str, run: pd.DataFrame) -> str:
    """The GRPO family card's table of one GPU's newest run."""
    from .bench import fused_linear_grpo as grpo_bench

    table = grpo_bench.loss_type_table(run)
    peer_columns = [c for c in table.columns if c.startswith("kernels_lib / ") and not c.endswith("floor")]
    header = "".join(f"<th>{html.escape(h)}</th>" for h in
                     ["loss type", "kernels_lib full (ms)", "× floor", *(f"× {c.split(' / ')[1]}" for c in peer_columns),
                      "memory × liger"])
    body = []
    for loss_type, row in table.iterrows():
        memory = (row["kernels_lib MB"] / row["liger MB"]) if "liger MB" in row and "kernels_lib MB" in row else float("nan")
        cells = [html.escape(str(loss_type)), f"{row['kernels_lib ms']:.1f}", ratio_text(row["kernels_lib / floor"]),
                 *(ratio_text(row[c]) for c in peer_columns), ratio_text(memory)]
        body.append(f'<tr data-loss-type="{html.escape(str(loss_type))}">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    sizes = json.loads(run.extra_benchmark_config_str.iloc[0])
    rates = one_floor.run_rates(run, data.load_measured("ceilings", latest=False))  # the rates loss_type_table's floor used
    said = " and ".join(f"{what} at {rates[kind]:.0f} {unit}" for kind, what, unit in
                        (("matmul", "the four matmuls of <code>full</code>", "TFLOP/s"), ("copy", "its minimal bytes", "GB/s"))
                        if kind in rates)
    floor = (f"the floor: the longer of {said}, measured in the same run" if len(rates) == 2
             else f"the floor {NOT_MEASURED}: the run measured {'only ' + said if said else 'no ceiling'}")
    caption = (f"{html.escape(data.run_label(run))}; B = {int(run.x_value.iloc[0])}, T = {sizes['T']}, H = {sizes['H']}, "
               f"V = {sizes['V']}, {html.escape(sizes['dtype'].replace('torch.', ''))}; {floor}. Below 1: "
               "kernels_lib is faster or smaller.")
    return (f'<div class="gpu-run" data-gpu="{html.escape(gpu)}"><h4>{html.escape(data.gpu_label(gpu))}</h4><p class="run">{caption}</p>'
            f'<table class="grpo-family"><thead><tr>{header}</tr></thead><tbody>{"".join(body)}</tbody></table></div>')
