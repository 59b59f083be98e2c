r"""Notebook 09's logic: the vocabulary-parallel check on spawned gloo ranks, the comparisons at TP = 2, and
the scaling over 1, 2, 4 and 8 GPUs.

**The check** (:func:`run_check`): ``world`` processes on this machine (torch.multiprocessing,
spawn, gloo), each holding an uneven slice of the classes (``V = 1031``: 700 + 331, or 400 + 231 +
400), run kernels_lib's fused linear cross-entropy (a slice of the head's rows) and its logits-level
cross-entropy (a slice of the logits' columns) with ``process_group``; here the same calls run on
one process with the whole head or logits, and in float64 (``kernels_lib.reference``). A case
passes when every rank's loss, ``dx`` (for the fused loss) and the ranks' gradient slices put
together are within the tolerance of both. The workers live in this module because a spawned
process imports its target by name (a function defined in a notebook cell cannot be imported).

**The comparison** (:func:`tp_comparison`) reads ``data/measured/tensor_parallel.csv`` (written by
``scripts/tensor_parallel_bench.py``), per GPU its newest run (:func:`load_runs_per_gpu`): at each N and TP,
kernels_lib's time over each peer's at the same TP, over the fastest peer's and over the floor of one rank's
share, its memory over the leanest peer's, and its scaling efficiency against its own TP = 1.
**The scaling** (:func:`scaling_efficiency`): every provider at each TP of the same run against its TP = 1.
The logits-level charts (:func:`logits_comparisons`) get :func:`.comparison.comparison` per TP.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels_lib import cross_entropy, fused_linear_cross_entropy, reference
from . import comparison, data, narrative
from .narrative import span as _span

V, H = 1031, 16
SPLITS = {2: (700, 331), 3: (400, 231, 400)}
#: name -> (loss, options): "flce" takes x, a head slice, targets; "ce" a slice of the logits' columns.
CASES = {
    "flce mean": ("flce", {}),
    "flce label smoothing, class weights, sum": ("flce", {"label_smoothing": 0.1, "class_weight": True, "reduction": "sum"}),
    "ce mean": ("ce", {}),
    "ce sum, label smoothing, class weights": ("ce", {"reduction": "sum", "label_smoothing": 0.1, "weight": True}),
    "ce none": ("ce", {"reduction": "none"}),
}
TOLERANCE = 1e-5  # float32 inputs: the shards only reorder float32 sums
COMMAND = (
    "PYTHONPATH=/tmp/site:$PWD KERNELS_LIB_COMMIT=<commit> torchrun --nproc-per-node <GPUs> "
    "scripts/tensor_parallel_bench.py --out data/measured"
)


def case_inputs(case: str, seed: int = 0) -> dict:
    """The case's whole inputs (float32), the same in every process: x, W, logits, targets (some
    ignored, some at the shard edges), class weights and the options."""
    loss, options = CASES[case]
    gen = torch.Generator().manual_seed(seed + list(CASES).index(case))
    rows = 8
    x = torch.randn(rows, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * H**-0.5 * 2
    target = torch.randint(0, V, (rows,), generator=gen)
    target[1:5] = torch.tensor([0, 399, 700, V - 1])
    target[2] = -100
    options = dict(options)
    for key in ("class_weight", "weight"):
        if options.pop(key, False):
            options[key] = torch.rand(V, generator=gen) + 0.5
    return {"loss": loss, "x": x, "weight": weight, "logits": torch.randn(rows, V, generator=gen) * 3,
            "target": target, "options": options}


def evaluate(inputs: dict, columns: slice | None = None, group=None, double: bool = False,
             functions=(fused_linear_cross_entropy, cross_entropy)) -> dict:
    """Loss and gradients (float64) of one case: on the classes ``columns`` with ``group``, or whole."""
    flce, ce = functions
    columns = columns or slice(None)
    cast = (lambda t: t.double()) if double else (lambda t: t)
    options = {k: cast(v) if isinstance(v, torch.Tensor) else v for k, v in inputs["options"].items()}
    group_option = {} if group is None else {"process_group": group}
    target = inputs["target"]
    if inputs["loss"] == "flce":
        x = cast(inputs["x"]).clone().requires_grad_()
        w = cast(inputs["weight"])[columns].clone().requires_grad_()
        loss = flce(x, w, target, **options, **group_option)
        leaves = {"dx": x, "grad": w}
    else:
        z = cast(inputs["logits"])[:, columns].clone().requires_grad_()
        loss = ce(z, target, **options, **group_option)
        leaves = {"grad": z}
    upstream = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).reshape(loss.shape)
    grads = torch.autograd.grad(loss, list(leaves.values()), upstream)
    return {"loss": loss.detach().double(), **{k: g.double() for k, g in zip(leaves, grads)}}


def _slice(world: int, rank: int) -> slice:
    start = sum(SPLITS[world][:rank])
    return slice(start, start + SPLITS[world][rank])


def _quiet_interpreter() -> None:
    """Silence numpy's warnings from Triton's interpreter on ignored rows (a masked ``log 0`` and
    ``0 · inf`` whose results are never used), which would flood the notebook."""
    for message in ("divide by zero encountered in log", "invalid value encountered in multiply"):
        warnings.filterwarnings("ignore", message=message, category=RuntimeWarning)


def _worker(rank: int, world: int, init_file: str, out_dir: str, seed: int) -> None:
    torch.set_num_threads(1)
    _quiet_interpreter()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        results = {case: evaluate(case_inputs(case, seed), _slice(world, rank), dist.group.WORLD) for case in CASES}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_group(world: int, seed: int = 0, deadline_s: float = 240) -> list[dict]:
    """Run every case on ``world`` spawned gloo ranks; each rank's results. Raises RuntimeError when a
    rank fails or the group misses its deadline (a hang in a collective)."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world, str(Path(out_dir) / "init"), out_dir, seed), nprocs=world,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + deadline_s
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {world}-process group did not finish within {deadline_s} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.norm().item()
    return (out - ref).norm().item() / (scale if scale > 0 else 1.0)


def check_unavailable() -> str | None:
    """Why :func:`run_check` cannot run on this machine, or None. Its ranks are gloo processes holding
    CPU tensors, which the kernels take only through Triton's interpreter (a CPU machine, CI); where
    they are compiled for CUDA they refuse CPU tensors. The vocabulary-parallel tests
    (``tests/test_vocab_parallel*.py``) are the same check, run in CI."""
    import kernels_lib

    if kernels_lib.INTERPRETED:
        return None
    return ("this machine compiles the kernels for CUDA, which refuse the CPU tensors of the check's gloo ranks; the check "
            "runs on a CPU machine through Triton's interpreter (CI runs it with tests/test_vocab_parallel*.py)")


def run_check(worlds=(2, 3), seed: int = 0) -> pd.DataFrame:
    """One row per (world, case, reference): the largest relative error over the ranks' losses and
    ``dx``, and that of the ranks' gradient slices concatenated; ``passed`` within :data:`TOLERANCE`."""
    _quiet_interpreter()
    references = {}
    for case in CASES:
        inputs = case_inputs(case, seed)
        functions = (reference.fused_linear_cross_entropy, reference.cross_entropy)
        references[case] = {"one process": evaluate(inputs),
                            "float64": evaluate(inputs, double=True, functions=functions)}
    rows = []
    for world in worlds:
        ranks = spawn_group(world, seed)
        for case in CASES:
            for name, want in references[case].items():
                class_dim = 0 if CASES[case][0] == "flce" else 1  # the head's rows, the logits' columns
                slices = torch.cat([r[case]["grad"] for r in ranks], class_dim)
                errors = {"loss": max(rel_err(r[case]["loss"], want["loss"]) for r in ranks),
                          "gradient slices": rel_err(slices, want["grad"])}
                if "dx" in want:
                    errors["dx"] = max(rel_err(r[case]["dx"], want["dx"]) for r in ranks)
                rows.append({"ranks": world, "split": " + ".join(map(str, SPLITS[world])), "case": case,
                             "against": name, **{f"{k} err": v for k, v in errors.items()},
                             "passed": max(errors.values()) <= TOLERANCE})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# The GPU rows, per GPU

#: No ceilings measured: a comparison's floor reads "not measured".
NO_CEILINGS = pd.DataFrame(columns=["kernel_name", "gpu_name", "kernels_lib_commit", "y_value_50", "timestamp"])


def load_runs(gpu_name: str | None = None) -> pd.DataFrame:
    """The rows of ``tensor_parallel.csv`` measured on ``gpu_name`` (CUDA; None: the GPU of the newest row), per
    workload (``kernel_name``) the newest run (commit) only, as its ratios compare rows of one run; empty when none."""
    path = data.measured_path("tensor_parallel")
    if not path.exists():
        return pd.DataFrame()
    rows = data.read_rows(path)
    rows = rows[rows.device == "cuda"]
    if gpu_name is None and len(rows):
        gpu_name = str(rows.sort_values("timestamp", kind="stable").gpu_name.iloc[-1])
    rows = rows[rows.gpu_name == gpu_name]
    if not len(rows):
        return rows
    newest = rows.sort_values("timestamp").groupby("kernel_name").kernels_lib_commit.last()
    return rows[rows.kernels_lib_commit == rows.kernel_name.map(newest)].reset_index(drop=True)


def load_runs_per_gpu() -> dict[str, pd.DataFrame]:
    """Per GPU whose CUDA rows ``tensor_parallel.csv`` holds (:func:`.data.gpus_measured`: by short label, none
    preferred), its :func:`load_runs`; {} without the file or its CUDA rows."""
    path = data.measured_path("tensor_parallel")
    if not path.exists():
        return {}
    return {gpu: load_runs(gpu) for gpu in data.gpus_measured(data.read_rows(path))}


def scaling_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Fused linear CE per (N, provider, TP): forward and full time, memory, bytes on the wire, the
    replayed collectives' time and their share of ``full``."""
    flce = rows[rows.kernel_name == "fused_linear_cross_entropy"]
    speed = flce[flce.metric_name == "speed"]
    memory = flce[(flce.metric_name == "memory") & (flce.kernel_operation_mode == "full")]
    key = ["x_value", "kernel_provider", "tp"]
    table = speed.pivot_table(index=key, columns="kernel_operation_mode", values="y_value_50")
    table = table.rename(columns={m: f"{m} ms" for m in table.columns})
    full = speed[speed.kernel_operation_mode == "full"].set_index(key)
    table["memory MiB (full)"] = memory.set_index(key).y_value_50
    table["wire bytes (full)"] = full.comm_bytes
    table["collectives alone ms"] = full.comm_ms
    table["comm share of full"] = full.comm_ms / full.y_value_50
    return table.rename_axis(index=["N", "provider", "TP"])


def scaling_efficiency(rows: pd.DataFrame) -> pd.DataFrame:
    r"""The fused linear CE per (N, provider, mode, TP) against the same provider's TP = 1 row of the run:
    time, speed-up :math:`t_1 / t_k`, scaling efficiency :math:`t_1 / (k\,t_k)` (1: every GPU added
    takes its full share), and the per-GPU memory beyond the inputs of the same mode with its ratio to
    TP = 1 (the inputs, ``x`` and the head's rows, are not counted, so :math:`1/k` is what sharding the
    head alone would give). Providers with no TP = 1 row get NaN ratios."""
    flce = rows[rows.kernel_name == "fused_linear_cross_entropy"]
    key = ["x_value", "kernel_provider", "kernel_operation_mode"]
    speed = flce[flce.metric_name == "speed"].set_index(key + ["tp"]).y_value_50
    memory = flce[flce.metric_name == "memory"].set_index(key + ["tp"]).y_value_50
    out = []
    for (n, provider, mode, k), ms in speed.items():
        base = speed.get((n, provider, mode, 1), float("nan"))
        mib = memory.get((n, provider, mode, k), float("nan"))
        base_mib = memory.get((n, provider, mode, 1), float("nan"))
        out.append({"N": n, "provider": provider, "mode": mode, "TP": k, "ms": ms, "speed-up": base / ms,
                    "efficiency": base / (k * ms), "MiB": mib, "MiB / TP = 1": mib / base_mib})
    table = pd.DataFrame(out, columns=["N", "provider", "mode", "TP", "ms", "speed-up", "efficiency", "MiB", "MiB / TP = 1"])
    return table.sort_values(["N", "provider", "mode", "TP"]).reset_index(drop=True)


def _rank_floor(run: pd.DataFrame, ceilings: pd.DataFrame, k: int) -> pd.Series:
    """Per x of one run's rows at TP = ``k``: the floor of one rank's share (:func:`.comparison.floor_ms` with the
    vocabulary ``V / k``: each rank's matmuls and bytes are its slice's), at the run's own ceilings; NaN where the
    run measured none."""
    x_name = str(run.x_name.iloc[0]) if "x_name" in run else "x"

    def shard(text):
        config = _config(text)
        if isinstance(config.get("V"), int):
            config["V"] = config["V"] // k
        return json.dumps(config)

    part = run.assign(extra_benchmark_config_str=run.extra_benchmark_config_str.map(shard))
    if x_name == "V":
        part = part.assign(x_value=part.x_value / k)
    floor = comparison.floor_ms(part, ceilings)
    if x_name == "V":
        floor.index = floor.index * k
    return floor


def _at_tp(rows: pd.DataFrame, k: int) -> pd.DataFrame:
    """The rows measured at TP = ``k``, providers named without their ``[TP=k]`` suffix: by the ``tp`` column
    (``tensor_parallel.csv``) or, in the logits-level charts' CSVs, by the suffix (none: TP = 1)."""
    if "tp" in rows.columns and rows.tp.notna().all():
        return rows[rows.tp == k]
    chosen = rows[_tp_suffix(rows) == k]
    return chosen.assign(kernel_provider=chosen.kernel_provider.astype(str).str.replace(_TP_SUFFIX, "", regex=True))


#: A provider measured at TP = k in the logits-level charts' CSVs: ``kernels_lib[TP=2]``.
_TP_SUFFIX = r"\[TP=(\d+)\]$"


def _tp_suffix(rows: pd.DataFrame) -> pd.Series:
    """Per row, the TP its provider's ``[TP=k]`` suffix names (none: 1)."""
    return rows.kernel_provider.astype(str).str.extract(_TP_SUFFIX)[0].fillna("1").astype(int)


def tp_sizes(rows: pd.DataFrame) -> list[int]:
    """The TPs ``rows`` measured (the ``tp`` column, else the providers' ``[TP=k]`` suffixes; none: 1)."""
    if "tp" in rows.columns and rows.tp.notna().all():
        return sorted(int(k) for k in rows.tp.unique())
    return sorted({1, *_tp_suffix(rows)})


def comparison_at_tp(rows: pd.DataFrame, ceilings: pd.DataFrame, k: int) -> pd.DataFrame:
    """:func:`.comparison.comparison` of one run's rows of one workload at TP = ``k`` (peers at the same TP only),
    its ``× floor`` against the floor of one rank's share (:func:`_rank_floor`); empty where kernels_lib has no
    ``full`` time at that TP."""
    part = _at_tp(rows, k)
    if not len(part) or "kernels_lib" not in set(part[(part.metric_name == "speed") & (part.kernel_operation_mode == "full")
                                                       & part.y_value_50.notna()].kernel_provider):
        return pd.DataFrame()
    table = comparison.comparison(part, ceilings)
    if k > 1:
        table["× floor"] = table["kernels_lib ms"] / _rank_floor(part, ceilings, k).reindex(table.index)
    return table


def tp_comparison(runs: pd.DataFrame, ceilings: pd.DataFrame) -> pd.DataFrame:
    r"""The fused linear CE of one GPU's :func:`load_runs`, per (N, TP): :func:`comparison_at_tp` (kernels_lib's
    ``full`` time over each peer's at the same TP, the fastest peer's, the floor of one rank's share; its memory
    over the leanest peer's), then kernels_lib's scaling ``efficiency`` :math:`t_1 / (k\,t_k)` and per-GPU
    ``memory / TP = 1`` against its own TP = 1 row (:func:`scaling_efficiency`). Empty without rows."""
    flce = runs[runs.kernel_name == "fused_linear_cross_entropy"] if len(runs) else runs
    if not len(flce):
        return pd.DataFrame()
    scaling = scaling_efficiency(flce)
    ours = scaling[(scaling.provider == "kernels_lib") & (scaling["mode"] == "full")].set_index(["N", "TP"])
    tables = {k: comparison_at_tp(flce, ceilings, k) for k in tp_sizes(flce)}
    table = pd.concat({k: t for k, t in tables.items() if len(t)}, names=["TP", "N"]).swaplevel().sort_index()
    table["efficiency"] = ours.efficiency.reindex(table.index)
    table["memory / TP = 1"] = ours["MiB / TP = 1"].reindex(table.index)
    return table


def floor_table(runs: pd.DataFrame, ceilings: pd.DataFrame) -> pd.DataFrame:
    """The fused linear CE of one GPU's run, per (N, TP): the floor of one rank's share at the run's own ceilings
    (``floor ms``, NaN where the run measured none) and every provider's ``full`` time over it."""
    flce = runs[runs.kernel_name == "fused_linear_cross_entropy"] if len(runs) else runs
    out = []
    for k in tp_sizes(flce) if len(flce) else []:
        part = _at_tp(flce, k)
        floor = _rank_floor(part, ceilings, k)
        times = part[(part.metric_name == "speed") & (part.kernel_operation_mode == "full")].pivot_table(
            index="x_value", columns="kernel_provider", values="y_value_50")
        for n in times.index:
            out.append({"N": n, "TP": k, "floor ms": floor.get(n, math.nan),
                        **{f"{p} / floor": times.at[n, p] / floor.get(n, math.nan) for p in times.columns}})
    return pd.DataFrame(out).set_index(["N", "TP"]) if out else pd.DataFrame()


# ---------------------------------------------------------------------------------------------
# What notebook 09 draws and says, from the rows


def time_chart(scaling: pd.DataFrame, gpu: str):
    """:func:`scaling_table` of one GPU's run as grouped bars: each provider's ``full`` time per N at each TP (TP = 1
    opaque), and beside each TP > 1 bar the same collectives replayed alone (hatched, the provider's colour)."""
    import plotly.graph_objects as go

    from . import charts

    figure = go.Figure()
    for (provider, k), part in scaling.reset_index().groupby(["provider", "TP"]):
        if part["full ms"].notna().any():
            figure.add_bar(name=f"{provider} TP = {k}", x=[f"N = {n}" for n in part.N], y=part["full ms"],
                           marker_color=charts.provider_color(provider), opacity=1.0 if k == 1 else 0.6)
            if k > 1:
                figure.add_bar(name=f"{provider} TP = {k}: collectives alone", x=[f"N = {n}" for n in part.N],
                               y=part["collectives alone ms"], marker_color=charts.provider_color(provider),
                               marker_pattern_shape="/", opacity=0.5)
    figure.update_layout(barmode="group", yaxis_title="time (ms)",
                         title=f"Fused linear CE, full (forward + backward), per GPU, at each TP measured ({data.gpu_label(gpu)})")
    return charts.kernels_lib_on_top(figure)


def efficiency_chart(efficiency: pd.DataFrame, gpu: str):
    r""":func:`scaling_efficiency` of one GPU's run, ``full``: the efficiency :math:`t_1 / (k\,t_k)` against TP, a line
    per (provider, N); the dotted line at 1 is every GPU added taking its full share."""
    import plotly.graph_objects as go

    from . import charts

    full = efficiency[(efficiency["mode"] == "full") & efficiency.ms.notna()]
    figure = go.Figure()
    for (provider, n), part in full.groupby(["provider", "N"]):
        figure.add_scatter(x=part.TP, y=part.efficiency, mode="lines+markers", name=f"{provider}, N = {n}",
                           line=dict(color=charts.provider_color(provider), dash="solid" if n == full.N.min() else "dash"))
    figure.add_hline(y=1.0, line_dash="dot", annotation_text="each GPU its full share", annotation_position="bottom right")
    figure.update_layout(title=f"Fused linear CE, full: scaling efficiency t₁ / (k·t_k) per GPU count ({data.gpu_label(gpu)})",
                         xaxis=dict(title="TP", type="log", tickvals=[1, 2, 4, 8], range=[-0.1, 0.95]),
                         yaxis=dict(title="efficiency", range=[0, 1.1]))
    return charts.kernels_lib_on_top(figure)


def efficiency_line(efficiency: pd.DataFrame, gpu: str) -> str:
    """One sentence: the TPs one GPU's run measured and, at each beyond 1, kernels_lib's ``full`` efficiency and the
    peers' (:func:`scaling_efficiency`), as measured."""
    full = efficiency[(efficiency["mode"] == "full") & efficiency.ms.notna()]
    tps = sorted(int(k) for k in full.TP.unique())
    said = []
    for k, at in full[full.TP > 1].groupby("TP"):
        ours, peers = at[at.provider == "kernels_lib"].efficiency, at[at.provider != "kernels_lib"].efficiency
        said.append(f"at TP = {k} kernels_lib's `full` efficiency is {_span(ours, suffix='')} (the peers {_span(peers, suffix='')})")
    return (f"On the {data.gpu_label(gpu)} this run measured TP = {', '.join(map(str, tps))}"
            + (": " + "; ".join(said) if said else ": no TP beyond 1, no scaling to state") + ".")


def _config(text: str) -> dict:
    """A row's ``extra_benchmark_config_str`` as a dict ({} when it is not JSON)."""
    try:
        return json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {}


def same_sizes(config_text: str, published_config: dict) -> bool:
    """Whether a measured row's configuration is the published workload's, whatever its TP: every size the
    published configuration names (upper-case keys) but TP and the swept V agrees."""
    config = _config(config_text)
    return all(config.get(k) == v for k, v in published_config.items() if k.isupper() and k not in ("TP", "V"))


def logits_rows(name: str, published: pd.DataFrame, gpu_name: str | None) -> pd.DataFrame:
    """The measured rows of the logits-level chart ``name`` beside ``published``: ``gpu_name``'s CUDA rows (every
    GPU's when None) of the same workload (:func:`same_sizes`), every run's (pick one with :func:`.data.one_run`);
    empty when none."""
    measured = data.load_measured(name, latest=False)
    if not len(measured):
        return measured
    published_config = _config(published.extra_benchmark_config_str.iloc[0])
    chosen = (measured.device == "cuda") & ((measured.gpu_name == gpu_name) if gpu_name is not None else True)
    return measured[chosen & measured.extra_benchmark_config_str.map(lambda t: same_sizes(t, published_config))].reset_index(drop=True)


def logits_comparisons(run: pd.DataFrame, ceilings: pd.DataFrame | None = None) -> dict[int, pd.DataFrame]:
    """A logits-level chart's run on one GPU (one commit), per TP it measured: :func:`comparison_at_tp` (kernels_lib
    against the peers at the same TP: ``kernels_lib`` with Liger, torch and Megatron-core at TP = 1,
    ``kernels_lib[TP=2]`` with ``megatron-*[TP=2]`` at TP = 2); TPs where kernels_lib has no time are left out."""
    ceilings = NO_CEILINGS if ceilings is None else ceilings
    tables = {k: comparison_at_tp(run, ceilings, k) for k in tp_sizes(run)} if len(run) else {}
    return {k: t for k, t in tables.items() if len(t)}


def conclusion(runs_by_gpu: dict[str, pd.DataFrame] | pd.DataFrame, ceilings: pd.DataFrame | None = None) -> str:
    """The scaling in a sentence per GPU (``runs_by_gpu``: GPU → :func:`load_runs`, or rows of one GPU): at each TP
    measured beyond 1, kernels_lib's ``full`` time over the fastest peer's at that TP and its memory over the
    leanest peer's (:func:`tp_comparison`), its scaling efficiency and the peers', its per-GPU memory against
    TP = 1's (markdown); "not measured" without rows. No commit or date: :func:`provenance_lines` says the runs."""
    if isinstance(runs_by_gpu, pd.DataFrame):
        runs_by_gpu = {str(g): r for g, r in runs_by_gpu.groupby("gpu_name", sort=False)} if len(runs_by_gpu) else {}
    flce = {g: r[r.kernel_name == "fused_linear_cross_entropy"] for g, r in runs_by_gpu.items() if len(r)}
    flce = {g: r for g, r in flce.items() if len(r)}
    if not flce:
        return "No GPU rows yet: the scaling is not measured."
    ceilings = NO_CEILINGS if ceilings is None else ceilings
    sentences = []
    for gpu, runs in flce.items():
        table, compared = scaling_efficiency(runs), tp_comparison(runs, ceilings)
        full = table[(table["mode"] == "full") & table.efficiency.notna() & (table.TP > 1)]
        parts = []
        for k, at in full.groupby("TP"):
            ours, peers = at[at.provider == "kernels_lib"], at[at.provider != "kernels_lib"]
            said = f"at TP = {k} kernels_lib's `full` scales at an efficiency of {_span(ours.efficiency, suffix='')}"
            if len(peers):
                said += f" (the peers {_span(peers.efficiency, suffix='')})"
            said += f", its per-GPU memory {_span(ours['MiB / TP = 1'], suffix='')}× TP = 1's"
            here = compared.xs(k, level="TP") if len(compared) and k in compared.index.get_level_values("TP") else pd.DataFrame()
            if len(here) and here["× fastest peer"].notna().any():
                fastest = ", ".join(dict.fromkeys(here["fastest peer"].dropna()))
                said += (f"; it takes {_span(here['× fastest peer'], suffix='')}× the fastest peer's time at that TP ({fastest}) "
                         f"at {_span(here['memory × leanest'], suffix='')}× the leanest peer's memory")
            parts.append(said)
        where = f"On the {data.gpu_label(gpu)}, "
        if not parts:
            sentences.append(where + "the run measured TP = 1 only: no scaling to state.")
            continue
        sentences.append(where + "; ".join(parts) + ".")
    return " ".join(sentences)


def _flce(runs_by_gpu: dict[str, pd.DataFrame]) -> dict[str, pd.DataFrame]:
    """Per GPU, the fused linear cross-entropy rows of its :func:`load_runs` (GPUs without them left out)."""
    flce = {g: r[r.kernel_name == "fused_linear_cross_entropy"] for g, r in runs_by_gpu.items() if len(r)}
    return {g: r for g, r in flce.items() if len(r)}


def headline_tables(runs_by_gpu: dict[str, pd.DataFrame], ceilings: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Per GPU (``runs_by_gpu``: :func:`load_runs_per_gpu`), :func:`comparison_at_tp` of its fused linear
    cross-entropy at the largest TP its launch measured (kernels_lib against the peers at that TP, the floor of
    one rank's share): the tensor-parallel chart the index shows, indexed by ``N``, for :func:`.narrative.headline`."""
    out = {}
    for gpu, flce in _flce(runs_by_gpu).items():
        table = comparison_at_tp(flce, ceilings, max(tp_sizes(flce)))
        if len(table):
            out[gpu] = table
    return out


def headline(runs_by_gpu: dict[str, pd.DataFrame], ceilings: pd.DataFrame) -> str:
    """Notebook 09's opening sentence (and its card's on the index): :func:`.narrative.headline` of
    :func:`headline_tables`; the TP named where every GPU's launch reached the same one. No commit, no date."""
    largest = {max(tp_sizes(flce)) for flce in _flce(runs_by_gpu).values()}
    at = f"at TP = {largest.pop()}" if len(largest) == 1 else "at each GPU's largest TP"
    return narrative.headline(f"Vocabulary-parallel fused linear cross-entropy {at} (the peers at the same TP)",
                              headline_tables(runs_by_gpu, ceilings), unmeasured="not measured on GPUs yet")


def provenance_lines(runs_by_gpu: dict[str, pd.DataFrame]) -> str:
    """One :func:`.narrative.provenance_line` per GPU and workload of the launches behind :func:`headline` and
    :func:`conclusion` (markdown bullets)."""
    lines = [f"- `{name}`: {narrative.provenance_line(part)}" for runs in runs_by_gpu.values() if len(runs)
             for name, part in runs.groupby("kernel_name", sort=False)]
    return "\n".join(lines) or "No GPU launch yet."
