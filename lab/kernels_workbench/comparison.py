"""What a reader asks of one measured run, per x: kernels_lib's time over each peer's, over the fastest
peer's and over the loss's floor, and its memory over the leanest peer's.

Every ratio is taken inside one run on one GPU (the rows of one ``kernels_lib_commit`` and ``gpu_name``,
refused otherwise), and the floor is :func:`.floor.floor` of that **same** run (its own matmuls' time or
its matmul ceiling, and its copy bandwidth; a run that measured no ceilings has no floor: "not
measured", never another run's). Memory is peak allocated minus the inputs; a peer that allocates
under 1 MB beyond its inputs (Liger's cross-entropy writes the gradient over the logits) has no memory
ratio: a ratio to ~0 says nothing.

:func:`comparison` is the table the notebooks print under each published chart; :func:`summary`
says its extremes in one line per GPU.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from . import data, overview
from .bench.analysis import medians
from .narrative import headline, provenance_line, span
from .bench.fused_linear_cross_entropy import FLOOR
from .floor import floor_ms, own_rates, run_rates  # noqa: F401  (the one floor: :mod:`.floor`; callers read it here too)

#: Below this many MB beyond its inputs a peer's memory is not a base for a ratio.
MIN_PEER_MB = 1.0
#: How a comparison marks a peer whose measured time is far from its own published figure (:func:`far_from_published`).
FAR = "far from its published figure"
#: How many times its published time a peer's measured ``full`` may take, on a GPU faster than the published one,
#: before it is :data:`FAR`.
FAR_FACTOR = 2.0


def published_for(run: pd.DataFrame, kernel_name: str | None = None) -> pd.DataFrame:
    """The published rows of the chart ``run`` re-measures (same loss, axis, sizes and dtype:
    :func:`.overview.belongs`), the published baseline named as the loss's spec names it; empty where none."""
    kernel_name = kernel_name or str(run.kernel_name.iloc[0])
    published = data.load_published(kernel_name)
    if not len(published) or not len(run):
        return published.iloc[:0]
    x_name, config = str(run.x_name.iloc[0]), overview._config(run.extra_benchmark_config_str.iloc[0])
    keep = [(x == x_name) and overview.belongs(config, overview._config(text), x_name)
            for x, text in zip(published.x_name, published.extra_benchmark_config_str)]
    baseline = overview._spec_baseline(kernel_name)
    chosen = published[keep]
    return chosen.replace({"kernel_provider": {"huggingface": baseline}}) if baseline else chosen


def far_from_published(run: pd.DataFrame, published: pd.DataFrame, factor: float = FAR_FACTOR) -> dict[str, float]:
    """The peers whose ``full`` time in ``run`` is more than ``factor`` times their own published time at some x,
    although the published GPU is slower than the run's on both datasheet rates (:data:`.overview.DATASHEETS`):
    peer → the largest measured / published ratio. Such a figure is the peer's setup here, not its kernel, so a
    comparison marks it (:data:`FAR`) and a headline leaves it out of "the fastest peer". {} where the rows do not
    name both GPUs in the datasheets, or share no x."""
    if not len(run) or not len(published):
        return {}
    ours_gpu, theirs_gpu = str(run.gpu_name.iloc[0]), str(published.gpu_name.iloc[0])
    sheets = overview.DATASHEETS
    if ours_gpu not in sheets.index or theirs_gpu not in sheets.index:
        return {}
    slower = (sheets.loc[theirs_gpu] [["bandwidth TB/s", "bf16 dense TFLOP/s"]] < sheets.loc[ours_gpu][["bandwidth TB/s", "bf16 dense TFLOP/s"]]).all()
    if not slower:
        return {}
    measured, theirs = medians(run, "speed", "full"), medians(published, "speed", "full")
    far = {}
    for peer in set(measured.columns) & set(theirs.columns):
        ratio = (measured[peer] / theirs[peer]).dropna()
        if len(ratio) and ratio.max() > factor:
            far[str(peer)] = float(ratio.max())
    return far


def peers_of(run: pd.DataFrame, ours: str = "kernels_lib") -> list[str]:
    """The providers ``ours`` is compared with: every other provider with a ``full`` time in the run, except
    other configurations of any provider (names with ``[``: dial points, ``accurate=True``, ``TP=2``) and the
    measured floor."""
    speed = medians(run, "speed", "full")
    return [p for p in speed.columns if p != ours and "[" not in p and p != FLOOR]


def memory_bases(memory):
    """``memory`` (MB beyond the inputs: a number, a Series or a frame) where it can be the base of a ratio, NaN
    below :data:`MIN_PEER_MB`."""
    if isinstance(memory, pd.Series | pd.DataFrame):
        return memory.where(memory >= MIN_PEER_MB)
    return memory if pd.notna(memory) and memory >= MIN_PEER_MB else math.nan


def fastest_peers(speed: pd.DataFrame, far=()) -> tuple[pd.Series, pd.Series]:
    """Per x (row) of the peers' ``full`` times (a column each): the fastest peer and its time, the peers in ``far``
    (:func:`far_from_published`) left out; rows where no peer has a time are dropped."""
    timed = speed[[p for p in speed.columns if p not in far]].dropna(how="all")
    if not timed.shape[1] or not len(timed):
        return pd.Series(dtype=object), pd.Series(dtype=float)
    return timed.idxmin(axis=1), timed.min(axis=1)


def leanest_peers(memory: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Per x (row) of the peers' memory (a column each): the leanest peer and its MB, among :func:`memory_bases`;
    rows where no peer has a base are dropped."""
    lean = memory_bases(memory).dropna(how="all")
    if not lean.shape[1] or not len(lean):
        return pd.Series(dtype=object), pd.Series(dtype=float)
    return lean.idxmin(axis=1), lean.min(axis=1)


def comparison(run: pd.DataFrame, ceilings: pd.DataFrame, *, ours: str = "kernels_lib", kernel_name: str | None = None,
               published: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per x (index, named after the run's axis) of one run: ``ours``' ``full`` time in ms, its time over each
    peer's (``× <peer>``), the fastest peer and the time over its (``× fastest peer``), over the floor
    (:func:`floor_ms`, ``× floor``), ``ours``' memory in MB, the leanest peer and the memory over its
    (``memory × leanest``). NaN where a provider was not measured at that x. A peer :func:`far_from_published`
    (against ``published``, by default the chart's published rows: :func:`published_for`) has its column
    ``× <peer> (far from its published figure)`` and is not the fastest peer. Rows of two runs are refused
    (``ValueError`` naming them, :func:`.data.run_label`)."""
    if not len(run):
        raise ValueError("comparison: no rows (expected the rows of one measured run)")
    data.run_label(run)  # refuses two runs
    speed, memory = medians(run, "speed", "full"), medians(run, "memory", "full")
    if ours not in speed:
        raise ValueError(f"comparison: ours={ours!r} has no full time in the run (providers: {sorted(speed.columns)})")
    peers = peers_of(run, ours)
    try:
        far = far_from_published(run, published_for(run, kernel_name) if published is None else published)
    except ValueError:  # a loss without published rows
        far = {}
    table = pd.DataFrame(index=speed.index)
    table["kernels_lib ms" if ours == "kernels_lib" else f"{ours} ms"] = speed[ours]
    for peer in peers:
        table[f"× {peer} ({FAR})" if peer in far else f"× {peer}"] = speed[ours] / speed[peer]
    fastest, fastest_ms = fastest_peers(speed[peers], far)
    table["fastest peer"] = fastest.reindex(table.index) if len(fastest) else None
    table["× fastest peer"] = speed[ours] / fastest_ms.reindex(table.index) if len(fastest) else math.nan
    table["× floor"] = speed[ours] / floor_ms(run, ceilings, kernel_name).reindex(table.index)
    memory = memory.reindex(table.index)
    table["kernels_lib MB" if ours == "kernels_lib" else f"{ours} MB"] = memory.get(ours)
    leanest, leanest_mb = leanest_peers(memory[[p for p in peers if p in memory]])
    table["leanest peer"] = leanest.reindex(table.index) if len(leanest) else None
    table["memory × leanest"] = (memory.get(ours) / leanest_mb.reindex(table.index)) if len(leanest) and ours in memory else math.nan
    table.index.name = str(run.x_name.iloc[0]) if "x_name" in run else "x"
    return table


def tables(runs: dict[str, pd.DataFrame], ceilings: pd.DataFrame, kernel_name: str | None = None) -> dict[str, pd.DataFrame]:
    """:func:`comparison` of each GPU's run (``runs``: GPU → its run), for :func:`.narrative.headline`; a run
    without kernels_lib's ``full`` time is left out."""
    out = {}
    for gpu, run in runs.items():
        try:
            out[gpu] = comparison(run, ceilings, kernel_name=kernel_name)
        except ValueError:
            continue
    return out


#: What each loss notebook's headline covers: report (notebook stem) → (the loss as the sentence names it, its
#: measured losses by ``kernel_name``). The notebook's opening cell and the index both say :func:`report_headline`.
HEADLINES = {
    "01_cross_entropy": ("Fused linear cross-entropy", ("fused_linear_cross_entropy",)),
    "02_kl_divergence": ("KL divergence", ("kl_div",)),
    "03_orpo": ("ORPO", ("fused_linear_orpo_loss",)),
    "04_kto": ("KTO", ("kto_loss",)),
    "06_preference_dpo_cpo_simpo_grpo": ("DPO, CPO, SimPO and GRPO", (
        "fused_linear_dpo_loss", "fused_linear_cpo_loss", "fused_linear_simpo_loss", "fused_linear_grpo_loss_token",
        "fused_linear_grpo_loss_sequence")),
    "07_divergences_jsd_tvd": ("JSD and TVD", ("jsd", "tvd")),
    "08_distillation": ("Distillation losses", ("fused_linear_jsd", "distill_jsd_loss", "distill_cosine_loss")),
}


def chart_runs(kernel_names) -> list[tuple[str, str, str, pd.DataFrame]]:
    """``(kernel_name, chart title, GPU, run)`` of every chart of ``kernel_names`` with measured rows, per GPU:
    each published chart's newest run on that GPU (:meth:`.overview.Workload.on`), then for a loss without a
    published chart (DPO) its newest run per GPU. The index's charts (:func:`.dashboard.charts`) are these runs."""
    out, published = [], set()
    for workload in overview.workloads():
        if workload.kernel_name not in kernel_names:
            continue
        published.add(workload.kernel_name)
        for gpu in workload.gpus:
            out.append((workload.kernel_name, workload.title, gpu, data.one_run(workload.on(gpu))))
    for kernel_name in kernel_names:
        if kernel_name in published:
            continue
        for gpu, run in data.newest_run_per_gpu(overview.measured_on(kernel_name, latest=False)).items():
            config = json.loads(run.extra_benchmark_config_str.iloc[0])
            out.append((kernel_name, overview.chart_title(kernel_name, config, str(run.x_name.iloc[0])), gpu, run))
    return out


#: The reports whose headline is not a published loss chart's (:data:`HEADLINES`) but their own data's, through the
#: same :func:`.narrative.headline`: notebook 05's training step (:func:`.training_step.headline`) and notebook 09's
#: tensor-parallel chart (:func:`.tensor_parallel.headline`).
OWN_HEADLINES = ("05_training_step", "09_tensor_parallel")


def headline_reports() -> list[str]:
    """Every report that opens with :func:`report_headline` (and whose card on the index says it), in notebook order."""
    return sorted([*HEADLINES, *OWN_HEADLINES])


def report_headline(report: str, ceilings: pd.DataFrame) -> str:
    """The headline sentence of ``report`` (:func:`headline_reports`): :func:`.narrative.headline` of the
    :func:`comparison` of every chart run of its losses (:data:`HEADLINES`, :func:`chart_runs`), per GPU; for
    :data:`OWN_HEADLINES`, of the training step's or the tensor-parallel launch's own comparison tables."""
    if report == "05_training_step":
        from . import training_step

        return training_step.headline(training_step.measured_rows())
    if report == "09_tensor_parallel":
        from . import tensor_parallel

        return tensor_parallel.headline(tensor_parallel.load_runs_per_gpu(), ceilings)
    what, kernel_names = HEADLINES[report]
    per_gpu: dict[str, list[pd.DataFrame]] = {}
    for kernel_name, _, gpu, run in chart_runs(kernel_names):
        try:
            per_gpu.setdefault(gpu, []).append(comparison(run, ceilings, kernel_name=kernel_name))
        except ValueError:  # kernels_lib not timed in that run
            continue
    ordered = {gpu: per_gpu[gpu] for gpu in sorted(per_gpu, key=lambda g: (data.gpu_label(g), g))}
    return headline(what, ordered)


def report_provenance(report: str) -> str:
    """One :func:`.narrative.provenance_line` per run behind :func:`report_headline` (markdown bullets)."""
    if report == "05_training_step":
        from . import training_step

        return training_step.provenance_lines(training_step.measured_rows())
    if report == "09_tensor_parallel":
        from . import tensor_parallel

        return tensor_parallel.provenance_lines(tensor_parallel.load_runs_per_gpu())
    lines = dict.fromkeys(f"- {title}: {provenance_line(run)}" for _, title, _, run in chart_runs(HEADLINES[report][1]))
    return "\n".join(lines) or "No GPU run yet."


def summary(tables: dict[str, pd.DataFrame]) -> str:
    """One markdown bullet per GPU (``tables``: GPU name → its :func:`comparison`): the range over x of
    kernels_lib's time over the fastest peer's, over the floor, and its memory over the leanest peer's."""
    if not tables:
        return "Not measured on a GPU yet: no comparison to state."
    lines = []
    for gpu, table in tables.items():
        xs = sorted(int(x) if float(x).is_integer() else x for x in table.index)
        where = f"{table.index.name} = {xs[0]}" if len(xs) == 1 else f"{table.index.name} = {xs[0]}–{xs[-1]}"
        said = [f"{span(table[column])} {what}" if table[column].notna().any() else missing
                for column, what, missing in (("× fastest peer", "the fastest peer's time", "no peer measured"),
                                              ("× floor", "the floor", "no floor (the run measured no ceilings)"),
                                              ("memory × leanest", "the leanest peer's memory", "no peer's memory measured"))]
        lines.append(f"- **{data.gpu_label(gpu)}** ({where}): " + ", ".join(said) + ".")
    return "\n".join(lines)
