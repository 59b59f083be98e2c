r"""Vocabulary-parallel (tensor-parallel) LM-head losses on 1, 2, 4 and 8 GPUs: time, per-GPU memory, bytes on the wire.

On a machine of G H200s (kind ``nvidia-h200-x2``, ``-x4`` or ``-x8``), with the peers' wheels installed into
/tmp/site::

    PYTHONPATH=/tmp/site:$PWD KERNELS_LIB_COMMIT=<commit> \
        torchrun --nproc-per-node G scripts/tensor_parallel_bench.py --out data/measured

(about 5 minutes on two GPUs; ``--budget-s`` caps it, default 420 s: what is left when it is spent is
written as NaN rows noted ``skipped: time budget``). On a CPU, for CI: ``python
scripts/tensor_parallel_bench.py --small --out DIR`` spawns ``--ranks`` gloo processes itself (2 by
default; tiny sizes, Triton's interpreter; also runs under ``torchrun --nproc-per-node G ... --small``).

One launch measures every TP of :func:`tensor_parallel_sizes`: 1, 2, 4, … up to G. At TP = k the G
ranks form G/k groups of k consecutive ranks, and every group runs the same call at once, so the row
is the slowest rank of any group. TP = 1: every rank runs the one-GPU form on its own GPU (kernels_lib
without a process group; the peers on a one-rank group of their own). TP = k > 1: the ranks of a group
split the vocabulary (V/k classes each) and run together over NCCL. What is measured (every provider
gets the same inputs, drawn from one seed on every rank; a rank's shard is its slice within its group):

* **Fused linear cross-entropy** (``kernel_name = fused_linear_cross_entropy``), N ∈ {8192, 16384}
  tokens, H = 4096, V = 128256, bf16, ``mean``; each rank holds ``x`` (N × H) and its rows
  ``W_r`` of the head. Providers: ``kernels_lib`` (``fused_linear_cross_entropy(x, W_r, target,
  process_group=...)``); ``torch_loss_parallel`` (``x`` as a Replicate DTensor, ``W_r`` as a
  Shard(0) DTensor on the 1-D mesh, logits ``x Wᵀ`` Shard(1), then ``F.cross_entropy`` under
  ``torch.distributed.tensor.parallel.loss_parallel()``, backward included; DTensor all-reduces
  ``dx``); ``megatron-core`` (each rank's logits ``x W_rᵀ`` materialized, as ``[s, b, v] = [N, 1,
  V_r]``, into ``megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`` on the
  tensor-parallel group; ``x`` enters through an identity whose backward all-reduces ``dx``, as
  a column-parallel output layer's input does); ``liger_tp`` (Liger 0.8.5's native TP kernel,
  ``liger_fused_linear_scaled_cross_entropy_tp``, where its native package ``liger_cute_kernels``
  is installed: it ships in the 81 MB ``liger-cute-kernels`` wheel, more than the 64 MiB one device
  call carries, so it is usually recorded as skipped with that reason).
* **Cross-entropy on logits**, the published charts' workloads: ``megatron_cross_entropy`` (S·B =
  2048 × 4 rows, bf16, ``sum``) and ``cross_entropy`` (B·T = 8 × 2048 rows, fp32, ``mean``), V =
  4096 … 131072. Providers: ``kernels_lib`` (``kernels_lib.cross_entropy``, TP = 1 and 2 with
  ``process_group`` on a column shard); ``megatron-unfused`` and ``megatron-fused``
  (``vocab_parallel_cross_entropy`` and ``fused_vocab_parallel_cross_entropy``, TP = 1 and 2, with
  the bench spec's conventions: ignored rows zeroed, fp32 logits copied because Megatron works on
  them in place); ``liger`` and ``torch`` at TP = 1 only (the bench specs' providers: Liger's
  Megatron module for the Megatron chart, ``liger_cross_entropy`` for the other; ``F.cross_entropy``
  on fp32 logits).

Modes ``forward`` (inputs require grad, as in the published harness) and ``full`` (forward and
backward). Per (provider, point, mode, TP):

* **time**: each rank times the call as the bench does (:func:`kernels_workbench.bench.timing.time_after_setup`:
  CUDA events around the call alone, the L2 cache flushed and the gradients cleared before each repeat),
  with ``agree``: the repeat count comes from the largest estimate over the ranks, so every rank calls a
  function that holds collectives equally often (a count from each rank's own estimate, as
  ``triton.testing.do_bench`` picks it, would hang), and the ranks start the repeats together. Median
  and p20/p80 in ms; the row holds the slowest rank's median (and its quantiles), ``rank_medians``
  every rank's.
* **memory**: per GPU, the bench's :func:`~kernels_workbench.bench.timing.peak_memory_mib`: the peak allocated
  during one call, the ranks in step before it, minus what was allocated before it (the inputs: ``x``, ``W_r``,
  targets; the logits shard for the logits-level loss), in MiB; the largest over the ranks.
* **bytes on the wire** (``comm_bytes``): every collective of one call is counted, per rank, by a
  ``TorchDispatchMode`` that sums the bytes each rank contributes to ``c10d`` and
  ``_c10d_functional`` collectives (all-reduce: the tensor; all-gather: the rank's input);
  DTensor's collectives are seen after DTensor lowers them. ``comm_bytes_analytic``: kernels_lib's
  wire format as its docstrings give it (:mod:`kernels_lib._vocab_parallel`,
  :mod:`kernels_lib.fused_linear_cross_entropy`, :mod:`kernels_lib.cross_entropy`): the check's
  ``all_gather`` of 13 int64, per row one float32 (MAX) and two (SUM: S and the owner's target
  logit), and for the fused linear loss ``dx`` (N × H in x's dtype) all-reduced once.
* **communication time** (``comm_ms``, TP > 1): the same collectives (kinds, sizes, dtypes, in
  order) replayed alone on the group and timed as above: the share of the call that is the wire.

Output: ``tensor_parallel.csv`` in ``--out`` (appended; the measured CSV's columns,
:data:`kernels_workbench.bench.sweep.MEASURED_COLUMNS`, plus ``megatron_version``, ``tp``,
``comm_bytes``, ``comm_bytes_analytic``, ``comm_ms``, ``rank_medians``), and the logits-level rows
again in the published layout into ``megatron_cross_entropy.csv`` and ``cross_entropy.csv`` (the
configuration of the bench specs' sweeps, so the overview places the TP = 1 rows on the published
charts; TP = k > 1 rows carry ``"TP": k`` and the provider suffix ``[TP=k]``), each through
:func:`kernels_workbench.data.append_measured` into ``--out``. A provider that cannot
run (package missing, no CUDA) gives NaN rows with the reason in ``note``; one that fails at a point
gives NaN rows with the error, agreed over the ranks so that no rank waits in a collective the
others left.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_lib import cross_entropy as kernels_lib_cross_entropy  # noqa: E402
from kernels_lib import fused_linear_cross_entropy  # noqa: E402
from kernels_lib._vocab_parallel import FACTS  # noqa: E402
from kernels_workbench import data  # noqa: E402
from kernels_workbench.bench import cross_entropy as ce_bench  # noqa: E402
from kernels_workbench.bench import fused_linear_cross_entropy as flce_bench  # noqa: E402
from kernels_workbench.bench import megatron_cross_entropy as mce_bench  # noqa: E402
from kernels_workbench.bench.environment import package_version, provenance  # noqa: E402
from kernels_workbench.bench.ceilings import measure_ceilings  # noqa: E402
from kernels_workbench.bench.sweep import MEASURED_COLUMNS  # noqa: E402
from kernels_workbench.bench.timing import Timing, peak_memory_mib, time_after_setup  # noqa: E402

COLUMNS = MEASURED_COLUMNS + ["megatron_version", "tp", "comm_bytes", "comm_bytes_analytic", "comm_ms", "rank_medians"]
MODES = ("forward", "full")
VOCABS = [4096, 8192, 16384, 32768, 65536, 131072]

#: Sizes and timing per preset. ``timing``: per workload, the options of :func:`time_after_setup` (``rep_ms``:
#: about how long the timed repeats of one measurement last on a GPU; ``cpu_repeats``: how many on a CPU).
PRESETS = {
    "full": {
        "flce": {"N": [8192, 16384], "H": 4096, "V": 128256, "dtype": torch.bfloat16},
        "megatron_cross_entropy": {"sizes": {"S": 2048, "B": 4}, "V": VOCABS, "dtype": torch.bfloat16},
        "cross_entropy": {"sizes": {"B": 8, "T": 2048}, "V": VOCABS, "dtype": torch.float32},
        "timing": {"flce": {"rep_ms": 1000.0}, "logits": {"rep_ms": 200.0}},
    },
    "small": {
        "flce": {"N": [16], "H": 32, "V": 1024, "dtype": torch.float32},
        "megatron_cross_entropy": {"sizes": {"S": 8, "B": 2}, "V": [512], "dtype": torch.bfloat16},
        "cross_entropy": {"sizes": {"B": 2, "T": 8}, "V": [512], "dtype": torch.float32},
        "timing": {"flce": {"cpu_repeats": 2}, "logits": {"cpu_repeats": 2}},
    },
}


# ---------------------------------------------------------------------------------------------
# The process groups, and decisions every rank takes alike


@dataclass
class World:
    """This process's place: the global rank and size, the device, a gloo group for the harness's own
    agreement (objects, barriers: never the measured traffic), and the groups of each TP."""

    rank: int
    size: int
    device: torch.device
    meta: object
    groups: dict = field(default_factory=dict)  # tp -> this rank's group (TP = 1: a group of itself)

    def agree(self, value: float, op=dist.ReduceOp.MAX) -> float:
        """``value`` reduced over the ranks (the harness's gloo group)."""
        tensor = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(tensor, op=op, group=self.meta)
        return float(tensor.item())

    def gather(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.meta)
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.meta)


def init_world(small: bool) -> World:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = torch.cuda.is_available() and not small
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=300),
                            **({"device_id": device} if use_cuda else {}))
    meta = dist.new_group(backend="gloo")
    world = World(rank, size, device, meta)
    for tp in tensor_parallel_sizes(size):  # every rank creates every group, in the same order
        blocks = [dist.new_group(list(range(first, first + tp))) if tp < size else dist.group.WORLD
                  for first in range(0, size, tp)]
        world.groups[tp] = blocks[rank // tp]
    return world


def tensor_parallel_sizes(world_size: int) -> list[int]:
    """The TP sizes one launch measures: 1, 2, 4, … up to ``world_size`` (a power of two), or 1 and
    ``world_size`` otherwise. At TP = k the ranks form ``world_size / k`` groups of k consecutive ranks
    (Megatron's layout), all measured at once; a row holds the slowest rank of any group."""
    if world_size & (world_size - 1):
        return sorted({1, world_size})
    return [1 << i for i in range(world_size.bit_length())]


# ---------------------------------------------------------------------------------------------
# Counting the bytes of collectives


class CommCounter(TorchDispatchMode):
    """Counts the collectives dispatched while active: ``calls`` is a list of ``(kind, numel, dtype)``,
    ``bytes`` their sum (what this rank contributes: an all-reduce's tensor, an all-gather's input).

    DTensor operations are let through (``NotImplemented``) so that DTensor lowers them first and the
    functional collectives it issues are seen here, as ``CommDebugMode`` does."""

    #: op name -> (kind, index of the argument that holds this rank's contribution)
    OPS = {
        "c10d.allreduce_": ("all_reduce", 0),
        "c10d.allreduce_coalesced_": ("all_reduce", 0),
        "c10d.allgather_": ("all_gather", 1),
        "c10d._allgather_base_": ("all_gather", 1),
        "c10d.allgather_into_tensor_coalesced_": ("all_gather", 1),
        "c10d.reduce_scatter_": ("reduce_scatter", 1),
        "c10d._reduce_scatter_base_": ("reduce_scatter", 1),
        "c10d.broadcast_": ("broadcast", 0),
        "_c10d_functional.all_reduce": ("all_reduce", 0),
        "_c10d_functional.all_reduce_": ("all_reduce", 0),
        "_c10d_functional.all_reduce_coalesced": ("all_reduce", 0),
        "_c10d_functional.all_gather_into_tensor": ("all_gather", 0),
        "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", 0),
        "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
        "_c10d_functional.broadcast": ("broadcast", 0),
        "_c10d_functional.all_to_all_single": ("all_to_all", 0),
    }

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int, torch.dtype]] = []

    @property
    def bytes(self) -> int:
        return sum(numel * torch.empty((), dtype=dtype).element_size() for _, numel, dtype in self.calls)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        known = self.OPS.get(f"{func.namespace}.{func._overloadpacket.__name__}")
        if known is not None:
            kind, index = known
            for tensor in _tensors(args[index]):
                self.calls.append((kind, tensor.numel(), tensor.dtype))
        return func(*args, **(kwargs or {}))


def _tensors(arg) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


def replay(calls, group, device):
    """A function issuing ``calls``' collectives alone (same kinds, sizes, dtypes, order) on ``group``."""
    size = dist.get_world_size(group)
    buffers = []
    for kind, numel, dtype in calls:
        source = torch.zeros(numel, dtype=dtype, device=device)
        out = torch.empty(numel * size, dtype=dtype, device=device) if kind == "all_gather" else None
        buffers.append((kind, source, out))

    def issue():
        for kind, source, out in buffers:
            if kind == "all_gather":
                dist.all_gather_into_tensor(out, source, group=group)
            else:  # all-reduce (and anything else: the same bytes each way)
                dist.all_reduce(source, group=group)

    return issue


# ---------------------------------------------------------------------------------------------
# Timing and memory, with the ranks in step


def time_in_step(world: World, fn, grads: list[torch.Tensor], options: dict) -> Timing:
    """:func:`time_after_setup` of ``fn`` on this rank (``options``: the preset's), the gradients cleared before
    each call and the repeat count agreed over the ranks (module docstring)."""

    def clear_grads():
        for t in grads:
            t.grad = None

    return time_after_setup(clear_grads, fn, world.device, agree=world.agree, **options)


# ---------------------------------------------------------------------------------------------
# Providers: each builds, for one point, ``(call, context, grads)``: ``call()`` returns the loss,
# ``context()`` wraps forward and backward (loss_parallel), ``grads`` the leaves to clear.


class Skip(Exception):
    """The provider cannot run here (a missing package, no CUDA): a row with the reason."""


def _shard(sizes_total: int, tp: int, rank: int) -> slice:
    """This rank's equal slice of ``sizes_total`` classes (Megatron and Liger need equal shards)."""
    per = sizes_total // tp
    if per * tp != sizes_total:
        raise ValueError(f"V = {sizes_total} does not split evenly over {tp} ranks")
    return slice(rank * per, (rank + 1) * per)


def _megatron_function(fused: bool):
    module, name = (
        ("megatron.core.fusions.fused_cross_entropy", "fused_vocab_parallel_cross_entropy") if fused
        else ("megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy")
    )
    try:
        return mce_bench._import_megatron(module, name)
    except ImportError as error:
        raise Skip(str(error)) from error


def _megatron_on(function, group):
    """``call(logits_3d, target_2d)`` on ``group``: as ``tp_group`` where the function takes one, else
    through Megatron's ``parallel_state`` (older releases), initialized for this TP."""
    if "tp_group" in inspect.signature(function).parameters:
        return lambda logits, target: function(logits, target, tp_group=group)
    parallel_state = mce_bench._import_megatron("megatron.core", "parallel_state")
    tp = dist.get_world_size(group)
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() != tp:
        parallel_state.destroy_model_parallel()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    return function


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group (the input of a
    column-parallel layer: ``dx = Σ_r dz_r W_r``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def flce_inputs(point: dict, tp: int, world: World):
    """``x`` (N × H), this rank's rows of ``W`` and the targets: the bench spec's draw (one seed, the
    same on every rank), sliced."""
    inputs = flce_bench.make_inputs(point, point["dtype"], world.device, {})
    x, weight, target, _ = inputs.args
    rows = _shard(weight.shape[0], tp, world.rank % tp)
    shard = weight.detach()[rows].clone().requires_grad_()
    del inputs, weight
    return x, shard, target


def flce_provider(name: str, point: dict, tp: int, world: World):
    group = world.groups[tp]
    if name == "liger_tp":
        return _liger_tp(point, tp, world, group)
    if name == "megatron-core":  # resolved first: a missing package skips before any input is drawn
        per_token = _megatron_on(_megatron_function(fused=False), group)
    x, weight, target = flce_inputs(point, tp, world)
    grads = [x, weight]
    if name == "kernels_lib":
        options = {"process_group": group} if tp > 1 else {}
        return (lambda: fused_linear_cross_entropy(x, weight, target, **options)), contextlib.nullcontext, grads
    if name == "torch_loss_parallel":
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        mesh = DeviceMesh.from_group(group, world.device.type)
        target_dt = DTensor.from_local(target, mesh, [Replicate()], run_check=False)

        def call():
            x_dt = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            w_dt = DTensor.from_local(weight, mesh, [Shard(0)], run_check=False)
            return F.cross_entropy(x_dt @ w_dt.T, target_dt)

        return call, loss_parallel, grads
    if name == "megatron-core":

        def call():
            x_in = _CopyToTensorParallel.apply(x, group) if tp > 1 else x
            logits = (x_in @ weight.T).unsqueeze(1)
            return mce_bench._reduce(per_token(logits, target.unsqueeze(1)).reshape(-1), target, -100, "mean")

        return call, contextlib.nullcontext, grads
    raise ValueError(f"unknown provider {name}")


LIGER_TP_REASON = (
    "Liger's native TP kernel (liger_kernel.ops.cute.fused_linear_scaled_cross_entropy_tp) needs the separate "
    "package liger_cute_kernels from the 81 MB liger-cute-kernels wheel (CUTLASS + NVSHMEM), more than the 64 MiB "
    "one device call carries; not installed here"
)


def _liger_tp(point, tp, world, group):
    if world.device.type != "cuda":
        raise Skip("Liger's native TP kernel needs CUDA")
    try:
        from liger_kernel.ops.cute.fused_linear_scaled_cross_entropy_tp import is_available
        from liger_kernel.transformers.functional import liger_fused_linear_scaled_cross_entropy_tp
    except ImportError as error:
        raise Skip(f"{LIGER_TP_REASON} ({type(error).__name__}: {error})") from error
    if not is_available():
        raise Skip(LIGER_TP_REASON)
    x, weight, target = flce_inputs(point, tp, world)

    def call():
        out = liger_fused_linear_scaled_cross_entropy_tp(x, weight, target, group)
        nll = out[0] if isinstance(out, tuple) else out
        return mce_bench._reduce(nll.float(), target, -100, "mean")

    return call, contextlib.nullcontext, [x, weight]


def logits_provider(workload: str, name: str, point: dict, tp: int, world: World):
    """Providers of the logits-level loss on this rank's column shard of the logits."""
    group = world.groups[tp]
    spec = mce_bench if workload == "megatron_cross_entropy" else ce_bench
    reduction = spec.SPEC.default_options["reduction"]
    if name in ("liger", "torch"):
        if tp > 1:
            raise Skip(f"{name} runs TP = 1 only")
        try:
            function = spec.PROVIDERS[name].load()
        except (ImportError, RuntimeError) as error:
            raise Skip(f"{type(error).__name__}: {error}") from error
    elif name.startswith("megatron"):
        per_token = _megatron_on(_megatron_function(fused=name == "megatron-fused"), group)

        def function(logits, target, reduction):
            # Megatron works on fp32 logits in place: those get a copy (the bench spec's adapter does the same).
            logits_3d = (logits.clone() if logits.dtype == torch.float32 else logits).unsqueeze(1)
            return mce_bench._reduce(per_token(logits_3d, target.unsqueeze(1)).reshape(-1), target, -100, reduction)
    elif name == "kernels_lib":
        options = {"process_group": group} if tp > 1 else {}

        def function(logits, target, reduction):
            return kernels_lib_cross_entropy(logits, target, reduction=reduction, **options)
    else:
        raise ValueError(f"unknown provider {name}")
    inputs = ce_bench.make_inputs(point, point["dtype"], world.device, {})
    logits, target = inputs.args
    columns = _shard(logits.shape[1], tp, world.rank % tp)
    shard = logits.detach()[:, columns].clone().requires_grad_() if tp > 1 else logits
    del inputs, logits
    return (lambda: function(shard, target, reduction=reduction)), contextlib.nullcontext, [shard]


def analytic_bytes(kind: str, provider: str, point: dict, tp: int, mode: str) -> float:
    """kernels_lib's wire per rank and call, from its documented format (module docstring); NaN for others."""
    if provider != "kernels_lib":
        return float("nan")
    if tp == 1:
        return 0.0
    rows = point["N"] if kind == "flce" else ce_bench.n_rows(point)
    check = len(FACTS) * 8  # establish's all_gather of int64 facts
    merge = rows * 4 * (1 + 2)  # MAX of m; SUM of S and the owner's target logit (float32)
    dx = rows * point["H"] * torch.empty((), dtype=point["dtype"]).element_size() if kind == "flce" else 0
    return float(check + merge + dx)  # the fused linear loss forms (and reduces) dx in forward already


# ---------------------------------------------------------------------------------------------
# One measurement, the ranks in step


def measure(world: World, build, mode: str, timing: dict, tp: int) -> tuple[dict, tuple | None]:
    """Memory, bytes, time and (TP > 1) communication time of one (provider, point, mode, TP) on this
    rank: ``(figures, failure)``. After each stage the ranks exchange whether it failed; from the first
    failure of an essential stage on (``("skip", reason)`` or ``("error", text)``, the same on every
    rank) no stage runs, so no rank enters a collective the others have left. Counting and replaying
    the collectives are not essential: their failure is a note (``figures["notes"]``), the time stands."""
    result, state = {"notes": []}, {}

    def stage(name, action, essential=True):
        failure = None
        if "stop" not in state:
            try:
                action()
            except Skip as why:
                failure = ("skip", str(why))
            except Exception as error:  # noqa: BLE001 (a failed point is a NaN row, not a lost run)
                failure = ("error", f"{name}: {type(error).__name__}: {next(iter(str(error).splitlines()), '')}")
        failures = [f for f in world.gather(failure) if f is not None]
        if failures and "stop" not in state:
            if essential:
                state["stop"] = failures[0]
            else:
                result["notes"].append(f"{name} not measured ({failures[0][1]})")

    def build_stage():
        call, context, grads = build()

        def run():
            with context():
                loss = call()
                if mode == "full":
                    loss.backward()

        state.update(run=run, grads=grads)

    def count():
        with CommCounter() as counter:
            state["run"]()
        result.update(comm_bytes=counter.bytes, calls=counter.calls)

    def comm_time():
        calls = result["calls"]
        result["comm_ms"] = time_in_step(world, replay(calls, world.groups[tp], world.device), [], timing).p50 if calls else 0.0

    stage("inputs", build_stage)
    stage("memory", lambda: result.update(memory=peak_memory_mib(state["run"], world.device, state["grads"], setup=world.sync)))
    stage("bytes", count, essential=False)
    stage("time", lambda: result.update(timing=time_in_step(world, state["run"], state["grads"], timing)))
    if tp > 1 and "calls" in result:
        stage("comm time", comm_time, essential=False)
    failure = state.get("stop")
    state.clear()
    result.pop("calls", None)
    gc.collect()
    if world.device.type == "cuda":
        torch.cuda.empty_cache()
    return result, failure


def run_point(world: World, build, mode: str, timing: dict, tp: int) -> dict:
    """:func:`measure` on every rank, then gathered: the slowest rank's timing, the largest memory and
    bytes; or ``{"skip"|"error": text}``."""
    result, failure = measure(world, build, mode, timing, tp)
    gathered = world.gather(result)
    if failure is not None:
        return {failure[0]: failure[1]}
    timings = [g["timing"] for g in gathered]
    return {
        "timing": max(timings, key=lambda t: t.p50),
        "rank_medians": json.dumps([round(t.p50, 5) for t in timings]),
        "memory": max(g["memory"] for g in gathered),
        "comm_bytes": max(g.get("comm_bytes", float("nan")) for g in gathered),
        "comm_ms": max(g.get("comm_ms", float("nan")) for g in gathered),
        "notes": gathered[0]["notes"],
    }


# ---------------------------------------------------------------------------------------------
# The run: points in order of importance (the fused linear loss first), rows written per section


FLCE_PROVIDERS = ("kernels_lib", "torch_loss_parallel", "megatron-core", "liger_tp")
LOGITS_PROVIDERS = ("kernels_lib", "megatron-unfused", "megatron-fused", "liger", "torch")
TP1_ONLY = ("liger", "torch")


def published_config(workload: str, point: dict, tp: int) -> dict:
    """The configuration the bench spec's sweep writes (so the overview matches the rows to the
    published chart), with ``"TP": k`` for the rows of k > 1 ranks."""
    spec = mce_bench.SPEC if workload == "megatron_cross_entropy" else ce_bench.SPEC
    sizes = {k: v for k, v in point.items() if k.isupper()}
    if workload == "megatron_cross_entropy":
        sizes["TP"] = tp
    elif tp > 1:
        sizes = {**{k: v for k, v in sizes.items() if k != "V"}, "TP": tp, "V": sizes["V"]}
    return {**sizes, "dtype": str(point["dtype"]), **spec.default_options}


def make_rows(kernel_name, provider, mode, x_name, x_label, x_value, config, tp, outcome, stamp, extra) -> list[dict]:
    """A speed row and a memory row of one measurement (NaN with the reason in ``note`` when it failed)."""
    timing = outcome.get("timing")
    note = "; ".join([f"{k}: {outcome[k]}" if k == "error" else f"skipped: {outcome[k]}" for k in ("skip", "error")
                      if k in outcome] + outcome.get("notes", []))
    base = {
        "kernel_name": kernel_name, "kernel_provider": provider, "kernel_operation_mode": mode, "x_name": x_name,
        "x_label": x_label, "x_value": int(x_value), "extra_benchmark_config_str": json.dumps(config), **stamp,
        "megatron_version": package_version("megatron-core"), "tp": tp,
        "comm_bytes": outcome.get("comm_bytes", float("nan")), "comm_ms": outcome.get("comm_ms", float("nan")),
        "rank_medians": outcome.get("rank_medians", ""), "note": note, **extra,
    }
    nan = float("nan")
    speed = dict(zip(("y_value_50", "y_value_20", "y_value_80"), (timing.p50, timing.p20, timing.p80) if timing else (nan, nan, nan)))
    memory = outcome.get("memory", nan)
    return [
        {**base, "metric_name": "speed", "metric_unit": "ms", **speed, "timer": timing.timer if timing else ""},
        {**base, "metric_name": "memory", "metric_unit": "MB", "y_value_50": memory, "y_value_20": memory,
         "y_value_80": memory, "timer": "torch.cuda.max_memory_allocated"},
    ]


class Run:
    """The measurement loop of one process (every rank runs it; rank 0 writes)."""

    def __init__(self, world: World, preset: dict, out: Path, budget_s: float):
        self.world, self.preset, self.out, self.budget_s = world, preset, out, budget_s
        self.start = time.monotonic()
        self.skipped: dict[tuple, str] = {}
        self.timing = preset["timing"]
        self.tps = tensor_parallel_sizes(world.size)

    def point(self, key: tuple, build, mode: str, timing: dict, tp: int) -> dict:
        if key in self.skipped:
            return {"skip": self.skipped[key]}
        if self.world.agree(time.monotonic() - self.start > self.budget_s):
            return {"skip": f"time budget ({self.budget_s:.0f} s, --budget-s) spent"}
        outcome = run_point(self.world, build, mode, timing, tp)
        if "skip" in outcome:
            self.skipped[key] = outcome["skip"]
        return outcome

    def log(self, text: str) -> None:
        if self.world.rank == 0:
            print(f"[{time.monotonic() - self.start:6.1f} s] {text}", flush=True)

    def flce(self) -> None:
        sizes = self.preset["flce"]
        stamp = {**provenance(self.world.device), "device": self.world.device.type}
        rows = []
        for n in sizes["N"]:
            point = {"N": n, "H": sizes["H"], "V": sizes["V"], "dtype": sizes["dtype"]}
            for tp in self.tps:
                config = {"N": n, "H": sizes["H"], "V": sizes["V"], "TP": tp, "dtype": str(sizes["dtype"]), "reduction": "mean"}
                for provider in FLCE_PROVIDERS:
                    for mode in MODES:
                        build = lambda: flce_provider(provider, point, tp, self.world)  # noqa: E731,B023
                        outcome = self.point(("flce", provider, tp), build, mode, self.timing["flce"], tp)
                        extra = {"comm_bytes_analytic": analytic_bytes("flce", provider, point, tp, mode)}
                        rows += make_rows("fused_linear_cross_entropy", provider, mode, "N", "tokens", n, config, tp,
                                          outcome, stamp, extra)
                        self.log(f"flce N={n} TP={tp} {provider} {mode}: {_summary(outcome)}")
        if self.world.rank == 0:
            data.append_measured(pd.DataFrame(rows).reindex(columns=COLUMNS), "tensor_parallel", directory=self.out)

    def logits(self, workload: str) -> None:
        sizes = self.preset[workload]
        spec = mce_bench.SPEC if workload == "megatron_cross_entropy" else ce_bench.SPEC
        axis = spec.published_preset("V")
        stamp = {**provenance(self.world.device), "device": self.world.device.type}
        rows, published = [], []
        # TP outermost: Megatron's parallel_state (releases without ``tp_group``) is re-initialized only
        # when TP changes. Each initialization creates NCCL communicators that destroy_model_parallel
        # leaves alive; with TP inside the V loop, the run of commit 32bd3a1 held 127 GiB outside
        # PyTorch's allocator by V = 65536 (fp32) and ran out of memory: the likely cause.
        for tp in self.tps:
            for v in sizes["V"]:
                point = {**sizes["sizes"], "V": v, "dtype": sizes["dtype"]}
                for provider in LOGITS_PROVIDERS:
                    if tp > 1 and provider in TP1_ONLY:
                        continue
                    for mode in MODES:
                        build = lambda: logits_provider(workload, provider, point, tp, self.world)  # noqa: E731,B023
                        outcome = self.point((workload, provider, tp), build, mode, self.timing["logits"], tp)
                        config = published_config(workload, point, tp)
                        extra = {"comm_bytes_analytic": analytic_bytes("logits", provider, point, tp, mode)}
                        made = make_rows(workload, provider, mode, "V", axis["x_label"], v, config, tp, outcome, stamp, extra)
                        rows += made
                        shown = provider if tp == 1 else f"{provider}[TP={tp}]"
                        published += [
                            {**row, "kernel_provider": shown} for row in made
                            if row["metric_name"] == "speed" or self.world.device.type == "cuda"
                        ]
                        self.log(f"{workload} V={v} TP={tp} {provider} {mode}: {_summary(outcome)}")
        if self.world.rank == 0:
            data.append_measured(pd.DataFrame(rows).reindex(columns=COLUMNS), "tensor_parallel", directory=self.out)
            data.append_measured(pd.DataFrame(published).reindex(columns=MEASURED_COLUMNS), workload, directory=self.out)


def _summary(outcome: dict) -> str:
    if "timing" not in outcome:
        return next(f"{k}: {outcome[k]}" for k in ("skip", "error") if k in outcome)
    return (f"{outcome['timing'].p50:.3f} ms (ranks {outcome['rank_medians']}), {outcome['memory']:.0f} MiB, "
            f"{outcome['comm_bytes']:.0f} B on the wire, comm {outcome['comm_ms']:.3f} ms")


def ceilings_of_the_run(world, out: Path) -> None:
    """On CUDA, rank 0 measures the matmul and copy ceilings after the workloads and appends them to
    ``out/ceilings.csv``: notebook 09's floors are taken at the rate of the same run, never another's."""
    if world.device.type != "cuda" or world.rank != 0:
        return
    data.append_measured(measure_ceilings(world.device), "ceilings", directory=out)


def run(args) -> None:
    world = init_world(args.small)
    try:
        preset = PRESETS["small" if args.small else "full"]
        bench = Run(world, preset, Path(args.out), args.budget_s)
        bench.log(f"{world.size} ranks on {world.device.type}; TP in {bench.tps}; writing to {args.out}")
        if "flce" in args.workloads:
            bench.flce()
        for workload in ("megatron_cross_entropy", "cross_entropy"):
            if workload in args.workloads:
                bench.logits(workload)
        ceilings_of_the_run(world, Path(args.out))
        bench.log("done")
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, size: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    run(args)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "measured"),
                        help="folder of the CSVs (appended)")
    parser.add_argument("--small", action="store_true", help="tiny sizes on CPU with gloo (CI)")
    parser.add_argument("--workloads", type=lambda t: t.split(","), default=["flce", "megatron_cross_entropy", "cross_entropy"],
                        help="comma-separated, among flce, megatron_cross_entropy, cross_entropy (default: all)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop measuring after this many seconds")
    parser.add_argument("--ranks", type=int, default=2, help="with --small: how many gloo ranks to spawn")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:
        run(args)
        return
    if not args.small:
        parser.error("launch the GPU run with torchrun --nproc-per-node <GPUs> (see the docstring); --small spawns its own ranks")
    if args.ranks < 1:
        parser.error(f"--ranks: expected at least 1 rank, got {args.ranks}")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The gloo ranks hold CPU tensors: their kernels run in Triton's interpreter on a CUDA machine too
    # (kernels_lib reads the variable when each rank imports it).
    os.environ["TRITON_INTERPRET"] = "1"
    mp.start_processes(_spawned, args=(args.ranks, port, args), nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()
