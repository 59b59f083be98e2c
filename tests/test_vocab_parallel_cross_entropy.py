"""Vocabulary-parallel ``kernels_lib.cross_entropy`` over torch.distributed (gloo, CPU): 2 and 3 processes.

Each rank holds an uneven column shard of the logits (V = 1031 split 700 + 331 and 400 + 231 + 400,
or DTensor's own split for the DTensor case), calls ``cross_entropy(..., process_group=...)`` with
the global targets, and saves its loss and its shard's gradient. Here every rank's loss must equal
the single-process call on the whole logits and float64 torch (``kernels_lib.reference``), and the
ranks' gradient shards, concatenated, the whole gradient. Bad inputs must raise on every rank within
seconds, and the group must still work afterwards.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from process_groups import GLOO_CPU_MARKS, outcomes, spawn_group
import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import CrossEntropyLoss, cross_entropy, reference

pytestmark = GLOO_CPU_MARKS

V, ROWS = 1031, 6
SPLITS = {2: (700, 331), 3: (400, 231, 400)}
ERROR_WITHIN_S = 20
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 4e-3}

# name -> options (``weight="cw"``: class weights; ``dtype``; ``dtensor``: DTensor logits; ``module``:
# CrossEntropyLoss; ``ignored``: every row ignore_index)
CASES = {
    "mean": {},
    "sum_smoothing_class_weight": dict(reduction="sum", label_smoothing=0.1, weight="cw"),
    "none_smoothing": dict(reduction="none", label_smoothing=0.2),
    "mean_class_weight": dict(weight="cw"),
    "none_class_weight_ignore_7": dict(reduction="none", weight="cw", ignore_index=7),
    "all_ignored": dict(ignored=True),
    "bfloat16_sum_inplace": dict(reduction="sum", dtype=torch.bfloat16, inplace=True),
    "float16_mean_no_host_checks": dict(dtype=torch.float16, host_checks=False, label_smoothing=0.05),
    "dtensor_smoothing": dict(label_smoothing=0.1, dtensor=True),
    "module_sum": dict(reduction="sum", module=True),
}


def make_inputs(case: str):
    """``(logits, target, options)``: float32 logits, global targets (shard edges, both ends, ignored
    rows), the call's options; the same on every process."""
    options = dict(CASES[case])
    gen = torch.Generator().manual_seed(sorted(CASES).index(case))
    logits = torch.randn(ROWS, V, generator=gen) * 3
    ignore_index = options.get("ignore_index", -100)
    target = torch.randint(0, V, (ROWS,), generator=gen)
    target[1:5] = torch.tensor([0, 399, 700, V - 1])
    target[2] = ignore_index
    if options.pop("ignored", False):
        target.fill_(ignore_index)
    if options.get("weight") == "cw":
        options["weight"] = torch.rand(V, generator=gen) + 0.5
    return logits, target, options


def evaluate(logits, target, options, **group):
    """Loss and the logits' gradient (of the local shard for a DTensor) as float64, a fixed upstream
    gradient for ``none``."""
    options = dict(options)
    dtype = options.pop("dtype", torch.float32)
    if options.pop("module", False):
        function = CrossEntropyLoss(**options, **group)
        options = {}
    else:
        function = functools.partial(cross_entropy, **group)
    leaf = logits if _is_dtensor(logits) else logits.to(dtype).detach().clone().requires_grad_()
    loss = function(leaf, target, **options)
    upstream = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape).to(loss.dtype)
    (grad,) = torch.autograd.grad(loss, leaf, upstream)
    grad = grad.to_local() if _is_dtensor(grad) else grad
    return loss.detach().double(), grad.double()


def _is_dtensor(t) -> bool:
    from kernels_lib._vocab_parallel import is_dtensor

    return is_dtensor(t)


def _columns(t, rank, sizes):
    start = sum(sizes[:rank])
    return t[:, start : start + sizes[rank]].contiguous()


def _run_case(case, rank, world, mesh):
    logits, target, options = make_inputs(case)
    if options.pop("dtensor", False):
        from torch.distributed.tensor import Shard, distribute_tensor

        dtype = options.pop("dtype", torch.float32)
        shard = distribute_tensor(logits.to(dtype), mesh, [Shard(1)]).requires_grad_()
        return evaluate(shard, target, options)
    return evaluate(_columns(logits, rank, SPLITS[world]), target, options, process_group=dist.group.WORLD)


def _error_calls(rank, world, mesh, subgroup):
    """name -> a call that must raise on every rank."""
    logits, target, _ = make_inputs("mean")
    mine = _columns(logits, rank, SPLITS[world])
    beyond = target.clone()
    beyond[0] = V
    other = target.clone()
    other[0] = (other[0] + 1) % V
    from torch.distributed.tensor import Shard, distribute_tensor

    def call(x=mine, t=target, **options):
        return cross_entropy(x, t, **{"process_group": dist.group.WORLD, **options})

    return {
        "target_beyond_global_vocab": lambda: call(t=beyond),
        "weight_of_shard_length": lambda: call(weight=torch.ones(mine.shape[1])),
        "ranks_disagree_on_targets": lambda: call(t=other if rank == 1 else target),
        "ranks_disagree_on_options": lambda: call(label_smoothing=0.1 if rank == 0 else 0.0),
        "one_rank_float_target": lambda: call(t=target.float() if rank == world - 1 else target),
        "dtensor_rows_sharded": lambda: cross_entropy(distribute_tensor(logits, mesh, [Shard(0)]), target),
        "dtensor_on_other_group": lambda: cross_entropy(
            distribute_tensor(logits, mesh, [Shard(1)]), target, process_group=subgroup
        ),
    }


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    subgroup = dist.new_group(ranks=list(range(world - 1)))
    results = {"cases": {case: _run_case(case, rank, world, mesh) for case in CASES}, "errors": {}}
    results["errors"] = outcomes(_error_calls(rank, world, mesh, subgroup))
    results["after_errors"] = _run_case("mean", rank, world, mesh)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@functools.cache
def group_run(world: int) -> list[dict]:
    """Spawn ``world`` ranks running :func:`_worker`; their saved results, rank by rank."""
    return spawn_group(_worker, world)


@functools.cache
def single_process(case: str):
    """The case on one process with the whole logits (kernels_lib), and float64 torch."""
    logits, target, options = make_inputs(case)
    options.pop("dtensor", None)
    one = evaluate(logits, target, options)
    plain = {k: v for k, v in options.items() if k not in ("dtype", "module", "inplace", "host_checks")}
    if isinstance(plain.get("weight"), torch.Tensor):
        plain["weight"] = plain["weight"].double()
    dtype = options.get("dtype", torch.float32)
    leaf = logits.to(dtype).double().requires_grad_()  # the float64 copy of the very values the ranks saw
    loss = reference.cross_entropy(leaf, target, **plain)
    upstream = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64).reshape(loss.shape)
    (grad,) = torch.autograd.grad(loss, leaf, upstream)
    return one, (loss.detach(), grad)


def rel_err(out, ref) -> float:
    scale = ref.norm().item()
    return (out - ref).norm().item() / (scale if scale > 0 else 1.0)


def _errors(got, want, world, case) -> dict:
    """Relative errors of every rank's loss and the concatenated gradient shards against ``want``."""
    want_loss, want_grad = want
    errors = {f"rank{r} loss": rel_err(loss, want_loss) for r, (loss, _) in enumerate(got)}
    sizes = [g.shape[1] for _, g in got]
    assert sum(sizes) == V and (CASES[case].get("dtensor") or tuple(sizes) == SPLITS[world])
    errors["grad"] = rel_err(torch.cat([g for _, g in got], 1), want_grad)
    return errors


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process_and_float64(world, case):
    got = [r["cases"][case] for r in group_run(world)]
    one, ref = single_process(case)
    tol = TOL[CASES[case].get("dtype", torch.float32)]
    # Against the single-process call: the shards change only the order of float32 sums (a 16-bit
    # loss or gradient may round the other way: one unit in its last place).
    against_one = _errors(got, one, world, case)
    assert max(against_one.values()) <= min(tol, 1e-2), against_one
    if case == "all_ignored":  # torch's mean over no rows is NaN; ours 0 with a zero gradient
        assert all(loss.item() == 0 and grad.abs().max() == 0 for loss, grad in got)
        return
    against_ref = _errors(got, ref, world, case)
    assert max(against_ref.values()) <= tol, against_ref


EXPECTED_ERRORS = {  # name -> (type on every rank, text in every rank's message)
    "target_beyond_global_vocab": ("ValueError", "outside the global vocabulary [0, 1031)"),
    "weight_of_shard_length": ("ValueError", "disagree on class_weight's length"),
    "ranks_disagree_on_targets": ("ValueError", "disagree on target"),
    "ranks_disagree_on_options": ("ValueError", "disagree on the options"),
    "dtensor_rows_sharded": ("ValueError", "logits takes (Shard(1),)"),
    "dtensor_on_other_group": ("ValueError", "process_group is not the group of logits's device mesh"),
}


@pytest.mark.parametrize("world", [2, 3])
def test_bad_inputs_raise_on_every_rank_without_hanging(world):
    ranks = group_run(world)
    for name, (kind, text) in EXPECTED_ERRORS.items():
        for rank, result in enumerate(ranks):
            got_kind, message, seconds = result["errors"][name]
            assert (got_kind, seconds < ERROR_WITHIN_S) == (kind, True), (name, rank, got_kind, message, seconds)
            assert text in message, (name, rank, message)
    for rank, result in enumerate(ranks):  # the last rank's float target: its own TypeError, the others name it
        got_kind, message, seconds = result["errors"]["one_rank_float_target"]
        assert got_kind == "TypeError" and seconds < ERROR_WITHIN_S, (rank, got_kind, message)
        expected = "target must be" if rank == world - 1 else f"rank(s) [{world - 1}] of the process group rejected"
        assert expected in message, (rank, message)
    one, _ = single_process("mean")
    for result in ranks:  # the group computes as before after every refused call
        assert rel_err(result["after_errors"][0], one[0]) <= 2e-6


def test_single_process_path_needs_no_distributed():
    logits, target, options = make_inputs("mean")
    assert not dist.is_initialized()
    loss, grad = evaluate(logits, target, options, process_group=None)
    _, (ref_loss, ref_grad) = single_process("mean")
    assert rel_err(loss, ref_loss) <= 2e-6 and rel_err(grad, ref_grad) <= 2e-6
