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

**The verdicts** (:func:`verdicts`) read ``data/measured/tensor_parallel.csv`` (written by
``scripts/tensor_parallel_bench.py``): the newest run's medians on the H200, against
:data:`TARGETS` (at TP = 2). **The scaling** (:func:`scaling_efficiency`, :func:`scaling_verdicts`):
each TP of the same run against TP = 1, and :data:`SCALING_TARGETS` at TP = 8.
"""

from __future__ import annotations

import json
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import cross_entropy, fused_linear_cross_entropy, reference
from . import data

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
# The GPU rows and the targets at TP = 2

#: name -> (what, limit): each a ratio of medians of the same run that must be <= limit.
TARGETS = {
    "tp2_time": ("kernels_lib TP = 2 full / kernels_lib TP = 1 full", 0.6),
    "tp2_memory": ("kernels_lib TP = 2 / TP = 1 per-GPU memory beyond the inputs (full)", 0.55),
    "vs_loss_parallel_time": ("kernels_lib / torch loss_parallel full time, TP = 2", 0.5),
    "vs_megatron_time": ("kernels_lib / megatron-core (materialized logits) full time, TP = 2", 0.5),
    "vs_loss_parallel_memory": ("kernels_lib / torch loss_parallel per-GPU memory, TP = 2", 0.2),
    "vs_megatron_memory": ("kernels_lib / megatron-core per-GPU memory, TP = 2", 0.2),
    "logits_vs_liger": ("kernels_lib.cross_entropy / Liger full time, TP = 1", 1.0),
}


#: The targets at TP = 8 (name -> (what, limit)): ratios to kernels_lib's own TP = 1 row of the same run.
SCALING_TARGETS = {
    "tp8_memory": ("kernels_lib TP = 8 / TP = 1 per-GPU memory beyond the inputs (full)", 0.2),
    "tp8_time": ("kernels_lib TP = 8 / TP = 1 full time", 0.25),
}
#: The TP those targets are judged at.
SCALING_TP = 8


def load_runs(gpu_name: str | None = None) -> pd.DataFrame:
    """The rows of ``tensor_parallel.csv`` measured on ``gpu_name`` (CUDA; None: the GPU of the newest row), per
    workload (``kernel_name``) the newest run (commit) only, as its targets compare rows of one run; empty when none."""
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


def pivot(rows: pd.DataFrame, kernel_name: str, metric: str, mode: str) -> pd.DataFrame:
    """Medians by x (index) and (provider, tp) (columns)."""
    chosen = rows[(rows.kernel_name == kernel_name) & (rows.metric_name == metric) & (rows.kernel_operation_mode == mode)]
    return chosen.pivot_table(index="x_value", columns=["kernel_provider", "tp"], values="y_value_50")


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


def scaling_verdicts(rows: pd.DataFrame) -> pd.DataFrame:
    """:data:`SCALING_TARGETS` at each N, judged at :data:`SCALING_TP` where the run measured it (``met``
    True or False), else ``not measured`` with the largest TP the run had."""
    table = scaling_efficiency(rows)
    ours = table[(table.provider == "kernels_lib") & (table["mode"] == "full")]
    out = []
    for n, group in ours.groupby("N"):
        at = group[group.TP == SCALING_TP]
        ratios = {"tp8_memory": at["MiB / TP = 1"], "tp8_time": 1 / at["speed-up"]}
        for name, (what, limit) in SCALING_TARGETS.items():
            ratio = float(ratios[name].iloc[0]) if len(at) else float("nan")
            status = ("met" if ratio <= limit else "missed") if ratio == ratio else f"not measured (TP ≤ {group.TP.max()} in this run)"
            out.append({"target": name, "what": what, "N": n, "ratio": ratio, "limit": limit, "status": status})
    return pd.DataFrame(out, columns=["target", "what", "N", "ratio", "limit", "status"])


def verdicts(rows: pd.DataFrame) -> pd.DataFrame:
    """Every target of :data:`TARGETS` at every point where both sides were measured: the ratio, the
    limit, met or not, and by how much a miss exceeds it (``ratio / limit - 1``). These targets
    are at TP = 2, whatever larger TP the run also measured."""
    out = []
    tp2 = 2

    def judge(name, x, num, den):
        what, limit = TARGETS[name]
        if pd.isna(num) or pd.isna(den):
            return
        ratio = num / den
        out.append({"target": name, "what": what, "x": x, "ratio": ratio, "limit": limit, "met": ratio <= limit,
                    "over by": max(0.0, ratio / limit - 1)})

    full = pivot(rows, "fused_linear_cross_entropy", "speed", "full")
    memory = pivot(rows, "fused_linear_cross_entropy", "memory", "full")

    def get(table, x, provider, tp):
        return table.loc[x, (provider, tp)] if (provider, tp) in table.columns else float("nan")

    for n in full.index:
        ours = get(full, n, "kernels_lib", tp2)
        ours_memory = get(memory, n, "kernels_lib", tp2)
        judge("tp2_time", n, ours, get(full, n, "kernels_lib", 1))
        judge("tp2_memory", n, ours_memory, get(memory, n, "kernels_lib", 1))
        judge("vs_loss_parallel_time", n, ours, get(full, n, "torch_loss_parallel", tp2))
        judge("vs_megatron_time", n, ours, get(full, n, "megatron-core", tp2))
        judge("vs_loss_parallel_memory", n, ours_memory, get(memory, n, "torch_loss_parallel", tp2))
        judge("vs_megatron_memory", n, ours_memory, get(memory, n, "megatron-core", tp2))
    for workload in ("megatron_cross_entropy", "cross_entropy"):
        logits = pivot(rows, workload, "speed", "full")
        for v in logits.index:
            judge("logits_vs_liger", f"{workload} V={v}", get(logits, v, "kernels_lib", 1), get(logits, v, "liger", 1))
    return pd.DataFrame(out, columns=["target", "what", "x", "ratio", "limit", "met", "over by"])


# ---------------------------------------------------------------------------------------------
# What notebook 09 draws and says, from the rows


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


def _why(name: str, worst, runs: pd.DataFrame, scaling: pd.DataFrame, limit: float) -> str:
    """What the measurement says about a missed target's worst point."""
    config = _config(runs[runs.kernel_name == "fused_linear_cross_entropy"].extra_benchmark_config_str.iloc[0])
    element = torch.empty((), dtype=getattr(torch, str(config.get("dtype", "bfloat16")).replace("torch.", ""))).element_size()
    if name == "tp2_time":
        ours = scaling.xs(("kernels_lib", 2), level=("provider", "TP")).loc[worst.x]
        single = scaling.xs(("kernels_lib", 1), level=("provider", "TP")).loc[worst.x]
        rest = (ours["full ms"] - ours["collectives alone ms"]) / single["full ms"]
        dx_share = int(worst.x) * config["H"] * element / ours["wire bytes (full)"]
        return (f" At N = {worst.x}: TP = 2 takes {ours['full ms']:.1f} ms, of which the collectives alone "
                f"{ours['collectives alone ms']:.1f} ms ({ours['comm share of full']:.0%}; {ours['wire bytes (full)'] / 1e6:.1f} MB "
                f"per rank, {dx_share:.0%} of it $dx$); without them {rest:.2f}× TP = 1, against the 0.5× of a perfect split.")
    if name == "tp2_memory":
        ours = scaling.xs(("kernels_lib", 2), level=("provider", "TP")).loc[worst.x, "memory MiB (full)"]
        whole = int(worst.x) * config["H"] * element / 2**20
        return (f" At N = {int(worst.x)}: {ours:.0f} MiB per GPU at TP = 2; what does not split with the vocabulary is "
                f"N × H-sized: $dx$ alone is {whole:.0f} MiB on every rank, plus the chunk's buffers.")
    return f" Worst at {worst.x}: {worst.ratio:.2f}× against ≤ {limit}."


def verdict_lines(runs: pd.DataFrame) -> str:
    """A bullet per target of :data:`TARGETS`: the measured range, met or by how much it is missed, and for
    a miss what the measurement says about why (markdown)."""
    verdict, scaling = verdicts(runs), scaling_table(runs)
    lines = []
    for name, (what, limit) in TARGETS.items():
        rows = verdict[verdict.target == name]
        if not len(rows):
            lines.append(f"- {what} ≤ {limit}: **not measured** (a provider's rows are missing or NaN; see the notes above)")
            continue
        missed = rows[~rows.met]
        head = f"- {what} ≤ {limit}: {rows.ratio.min():.2f}–{rows.ratio.max():.2f}×, "
        if not len(missed):
            lines.append(head + "**met** at every point")
            continue
        worst = missed.sort_values("over by").iloc[-1]
        lines.append(head + f"**missed** at {len(missed)} of {len(rows)} points, by up to {worst['over by']:.1%}."
                     + _why(name, worst, runs, scaling, limit))
    return "\n".join(lines)


def conclusion(runs: pd.DataFrame) -> str:
    """The scaling in one paragraph, from the run: kernels_lib's and the peers' efficiency of ``full`` and
    kernels_lib's per-GPU memory at each TP measured beyond 1 (markdown); "not measured" without rows."""
    if not len(runs):
        return "No GPU rows yet: the scaling is not measured."
    table = scaling_efficiency(runs)
    full = table[(table["mode"] == "full") & table.efficiency.notna() & (table.TP > 1)]
    if not len(full):
        return "The run measured TP = 1 only: no scaling to state."
    parts = []
    for k, at in full.groupby("TP"):
        ours, peers = at[at.provider == "kernels_lib"], at[at.provider != "kernels_lib"]
        said = f"at TP = {k} kernels_lib's `full` scales at an efficiency of {_range(ours.efficiency)}"
        if len(peers):
            said += f" (the peers {_range(peers.efficiency)})"
        said += f", its per-GPU memory {_range(ours['MiB / TP = 1'])}× TP = 1's"
        parts.append(said)
    gpu = str(runs.gpu_name.iloc[0]).replace("NVIDIA ", "")
    return f"On the {gpu}, " + "; ".join(parts) + f" (the {data.run_label(runs[runs.kernel_name == 'fused_linear_cross_entropy'])})."


def _range(values: pd.Series) -> str:
    values = values.dropna()
    if not len(values):
        return "not measured"
    low, high = f"{values.min():.2f}", f"{values.max():.2f}"
    return low if low == high else f"{low}–{high}"
