"""Vocabulary-parallel losses over torch.distributed (gloo, CPU): 2 and 3 processes on one machine.

One spawned group per world size runs every case (process start-up costs seconds, the kernels run
in Triton's interpreter): each rank holds an uneven slice of the head (V = 1031 split 700 + 331 and
400 + 231 + 400, or DTensor's own split), runs the loss with ``process_group`` (or a DTensor head),
and saves its outputs and gradients. Here, in the test process, each case is run on one process with
the whole head and on float64 copies by :mod:`kernels_lib.reference`: every rank's outputs and ``dx``
must equal the single-process ones, the ranks' ``dW``/``db`` slices concatenated must equal the
single-process ``dW``/``db``, and both must match float64. The bad inputs must raise on every rank,
in seconds (a hang would show as the gloo timeout's RuntimeError, or as the group missing its
deadline), and the group must still work after them.
"""

from __future__ import annotations

import functools
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from process_groups import GLOO_CPU_MARKS, outcomes, spawn_group
import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import (
    fused_linear_cpo, fused_linear_cross_entropy, fused_linear_dpo, fused_linear_grpo, fused_linear_kto, fused_linear_orpo,
    fused_linear_simpo, reference,
)

pytestmark = GLOO_CPU_MARKS

V, H = 1031, 32
SPLITS = {2: (700, 331), 3: (400, 231, 400)}
#: A bad input must be refused on every rank well within this (gloo's own timeout is 60 s).
ERROR_WITHIN_S = 20
#: float32: the shards change only summation orders (observed ≤ 2e-7 against one process).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3}

# name -> (loss, options, input kind). Input kinds: flce rows (2 × 8 tokens; every 5th ignored) or
# all ignored; orpo (2 pairs × 4 tokens, also DPO's, CPO's and SimPO's); kto (4 sequences × 4 tokens, a
# reference head or its log-probs, as DPO's); grpo (4 completions × 4 tokens, advantages, old, sampler and
# reference log-probs or a reference head, a completion mask).
CASES = {
    "flce_mean": ("flce", {}, "rows"),
    "flce_sum_smoothing_zloss_softcap": (
        "flce", dict(reduction="sum", label_smoothing=0.1, z_loss_scale=1e-3, softcap=3.0, return_z_loss=True), "rows"
    ),
    "flce_none_token_stats": ("flce", dict(reduction="none", return_token_stats=True, chunk_size=5), "rows"),
    "flce_class_weight_smoothing_chunks": (
        "flce", dict(class_weight="cw", label_smoothing=0.2, chunk_size=6), "rows"
    ),
    "flce_none_class_weight_zloss": ("flce", dict(reduction="none", class_weight="cw", z_loss_scale=1e-2), "rows"),
    "flce_scale_temperature_num_items_accurate": (
        "flce", dict(logit_scale=1.5, temperature=0.7, num_items_in_batch=40, accurate=True, bias=False), "rows"
    ),
    "flce_mean_token_stats_smoothing": ("flce", dict(return_token_stats=True, label_smoothing=0.05), "rows"),
    "flce_all_ignored": ("flce", {}, "ignored"),
    "flce_float16_sum": ("flce", dict(reduction="sum", dtype=torch.float16), "rows"),
    "flce_dtensor": ("flce", dict(label_smoothing=0.1, dtensor=True), "rows"),
    "orpo": ("orpo", dict(beta=0.2), "orpo"),
    "orpo_nll_target_chunks": ("orpo", dict(nll_target="nll", chunk_size=8), "orpo"),
    "orpo_dtensor": ("orpo", dict(dtensor=True), "orpo"),
    "kto_reference_head": ("kto", dict(ref="head", chunk_size=4, desirable_weight=1.3), "kto"),
    "kto_ref_logps_average": ("kto", dict(ref="logps", average_log_prob=True, bias=False), "kto"),
    "kto_dtensor": ("kto", dict(ref="head", dtensor=True), "kto"),
    "dpo_reference_head_sft_chunks": (
        "dpo", dict(ref="head", loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], chunk_size=8), "orpo"
    ),
    "dpo_ref_logps_average_dtensor": ("dpo", dict(ref="logps", average_log_prob=True, loss_type="hinge", dtensor=True), "orpo"),
    "cpo_nll_target_smoothing": ("cpo", dict(nll_target="nll", label_smoothing=0.1, bias=False), "orpo"),
    "simpo_alphapo_dtensor": ("simpo", dict(cpo_alpha=0.0, alpha=0.3, dtensor=True), "orpo"),
    "grpo_reference_head_per_token": (
        "grpo", dict(ref="head", beta=0.1, temperature=0.8, chunk_size=4, return_per_token=True), "grpo"
    ),
    "grpo_sequence_dapo_sampler": (
        "grpo", dict(ref="logps", beta=0.05, importance_sampling_level="sequence", loss_type="dapo", sampler=True,
                     vllm_importance_sampling_mode="sequence_truncate", accurate=True), "grpo"
    ),
    "grpo_cispo_dtensor": ("grpo", dict(ref=None, loss_type="cispo", epsilon_high=1.1, dtensor=True), "grpo"),
}


def make_inputs(case: str, dtype=torch.float32):
    """The case's full inputs, the same on every process: ``(x, weight, bias, target, options, extra)``;
    ``extra`` holds KTO's labels and kl and the reference head (sharded like the policy's)."""
    loss, options, kind = CASES[case]
    options = dict(options)
    seed = sorted(CASES).index(case)
    gen = torch.Generator().manual_seed(seed)
    lead = {"rows": (2, 8), "ignored": (2, 8), "orpo": (4, 4), "kto": (4, 4), "grpo": (4, 4)}[kind]
    x = torch.randn(*lead, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * H**-0.5 * 2
    b = torch.randn(V, generator=gen) if options.pop("bias", True) else None
    target = torch.randint(0, V, lead, generator=gen)
    # Targets near the shard boundaries and at both ends of the vocabulary; ignored rows (every
    # sequence keeps valid tokens), or all of them.
    target.view(-1)[1:5] = torch.tensor([0, 399, 400, V - 1])
    target.view(-1)[:: 5 if kind == "rows" else 4] = -100
    if kind == "ignored":
        target.fill_(-100)
    if options.get("class_weight") == "cw":
        options["class_weight"] = torch.rand(V, generator=gen) + 0.5
    if options.get("nll_target") == "nll":
        options["nll_target"] = torch.where(target == -100, torch.randint(0, V, lead, generator=gen), target)
    extra = {}
    if loss == "kto":
        extra["labels"] = torch.tensor([True, False, False, True])
        extra["kl"] = 0.05
    if loss == "grpo":
        extra["advantages"] = torch.randn(lead[0], generator=gen)
        extra["old_logps"] = -torch.rand(*lead, generator=gen) * 8
        extra["completion_mask"] = (torch.rand(*lead, generator=gen) > 0.2).float()
        if options.pop("sampler", False):
            extra["sampler_logps"] = extra["old_logps"] + torch.randn(*lead, generator=gen) * 0.1
    ref = options.pop("ref", None)
    if ref == "head":
        extra["ref_x"] = torch.randn(*lead, H, generator=gen)
        extra["ref_weight"] = torch.randn(V, H, generator=gen) * H**-0.5 * 2
        extra["ref_bias"] = torch.randn(V, generator=gen)
    elif ref == "logps":
        extra["ref_logps"] = -torch.rand(*(lead if loss == "grpo" else lead[:1]), generator=gen) * 8
    dtype = options.pop("dtype", dtype)
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), target, options, extra


def evaluate(case: str, x, w, b, target, options, extra, *, functions=None, **group):
    """Run the case's loss on these tensors (leaves with requires_grad) and backpropagate a fixed
    upstream gradient through every differentiable output. Returns ``(outputs, (dx, dW, db))``,
    float64 copies, the gradients of DTensor leaves as their local shards."""
    loss_name = CASES[case][0]
    functions = functions or FUNCTIONS
    leaves = [t.detach().clone().requires_grad_() if isinstance(t, torch.Tensor) and not _is_dtensor(t) else t
              for t in (x, w, b)]
    x, w, b = leaves
    loss = functions[loss_name]
    if loss_name == "kto":
        ref = {k: extra[k] for k in ("ref_x", "ref_weight", "ref_bias", "ref_logps") if k in extra}
        out = loss(x, w, target, extra["labels"], extra["kl"], bias=b, **ref, **options, **group)
    else:  # the other tensors (a reference, GRPO's) by keyword
        out = loss(x, w, target, b, **extra, **options, **group)
    outputs = list(_tensors(out))
    # The loss, and the entropy where it has a gradient (reduction "none"); the rest are logged values.
    with_entropy = options.get("return_token_stats") and options.get("reduction") == "none"
    differentiable = outputs[:1] + (outputs[2:3] if with_entropy else [])
    gen = torch.Generator().manual_seed(7)
    upstream = [torch.rand(o.shape, generator=gen).to(o.dtype) + 0.5 for o in differentiable]
    wanted = [t for t in leaves if t is not None]
    got = iter(torch.autograd.grad(differentiable, wanted, upstream))
    grads = [None if t is None else next(got) for t in leaves]
    grads = [None if g is None else (g.to_local() if _is_dtensor(g) else g).detach().double() for g in grads]
    return [o.detach().double() for o in outputs], grads


FUNCTIONS = {
    "flce": fused_linear_cross_entropy, "orpo": fused_linear_orpo, "kto": fused_linear_kto, "dpo": fused_linear_dpo,
    "cpo": fused_linear_cpo, "simpo": fused_linear_simpo, "grpo": fused_linear_grpo,
}
REFERENCE_FUNCTIONS = {name: getattr(reference, function.__name__) for name, function in FUNCTIONS.items()}


def _tensors(out):
    """The tensors of an output, depth first (nested named tuples: GRPO's per-token values), None left out."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, tuple):
        for item in out:
            yield from _tensors(item)


def _is_dtensor(t) -> bool:
    from kernels_lib._vocab_parallel import is_dtensor

    return is_dtensor(t)


# ---------------------------------------------------------------------------------------------
# The spawned ranks


def _shard_rows(t, rank, sizes):
    start = sum(sizes[:rank])
    return None if t is None else t[start : start + sizes[rank]].contiguous()


def _run_case(case, rank, world, mesh):
    x, w, b, target, options, extra = make_inputs(case)
    if options.pop("dtensor", False):
        from torch.distributed.tensor import Shard, distribute_tensor

        def shard(t):
            return None if t is None else distribute_tensor(t, mesh, [Shard(0)]).requires_grad_()

        group = {}
    else:

        def shard(t):
            return None if t is None else _shard_rows(t, rank, SPLITS[world])

        group = {"process_group": dist.group.WORLD}
    extra = dict(extra)
    for key in ("ref_weight", "ref_bias"):
        if key in extra:
            extra[key] = shard(extra[key])
    return evaluate(case, x, shard(w), shard(b), target, options, extra, **group)


def _flce_call(rank, world, *, x=None, weight=None, target=None, sizes=None, **options):
    """FLCE on this rank's slice (of ``sizes``, default the world's split) of the ``flce_mean``
    inputs, any of them replaced."""
    x0, w0, b0, t0, _, _ = make_inputs("flce_mean")
    sizes = sizes or SPLITS[world]
    weight = _shard_rows(w0, rank, sizes) if weight is None else weight
    group = options.pop("process_group", dist.group.WORLD)
    return fused_linear_cross_entropy(x0 if x is None else x, weight, t0 if target is None else target,
                                      _shard_rows(b0, rank, sizes), process_group=group, **options)


def _error_calls(rank, world, mesh, subgroup):
    """name -> a call that must raise on every rank (each builds its own bad input)."""
    x0, w0, b0, t0, _, _ = make_inputs("flce_mean")
    last = world - 1
    beyond = t0.clone()
    beyond.view(-1)[0] = V
    negative = t0.clone()
    negative.view(-1)[0] = -5
    other_target = t0.clone()
    other_target.view(-1)[2] = (other_target.view(-1)[2] + 1) % V
    xo, wo, bo, to, _, _ = make_inputs("orpo")
    xk, wk, bk, tk, ko, ke = make_inputs("kto_reference_head")
    tk_bad = tk.clone()
    tk_bad.view(-1)[-1] = V + 3
    xg, wg, _, tg, _, eg = make_inputs("grpo_reference_head_per_token")
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {
        "target_beyond_global_vocab": lambda: _flce_call(rank, world, target=beyond),
        "negative_target": lambda: _flce_call(rank, world, target=negative),
        "one_rank_weight_of_other_hidden": lambda: _flce_call(
            rank, world, weight=torch.randn(SPLITS[world][rank], H + (rank == last))
        ),
        "class_weight_one_short": lambda: _flce_call(rank, world, class_weight=torch.ones(V - 1)),
        "one_rank_float_target": lambda: _flce_call(rank, world, target=t0.float() if rank == 0 else t0),
        "class_weight_of_shard_length": lambda: _flce_call(rank, world, class_weight=torch.ones(SPLITS[world][rank])),
        "ranks_disagree_on_rows": lambda: _flce_call(
            rank, world, x=x0[:, :-1] if rank == 0 else x0, target=t0[:, :-1] if rank == 0 else t0
        ),
        "ranks_disagree_on_targets": lambda: _flce_call(rank, world, target=other_target if rank == 1 else t0),
        "ranks_disagree_on_options": lambda: _flce_call(rank, world, label_smoothing=0.1 if rank == 0 else 0.0),
        "orpo_one_rank_odd_batch": lambda: fused_linear_orpo(
            xo[:3] if rank == last else xo, _shard_rows(wo, rank, SPLITS[world]), to[:3] if rank == last else to,
            process_group=dist.group.WORLD,
        ),
        "kto_target_beyond_global_vocab": lambda: fused_linear_kto(
            xk, _shard_rows(wk, rank, SPLITS[world]), tk_bad, ke["labels"], ref_logps=torch.zeros(4),
            process_group=dist.group.WORLD,
        ),
        "grpo_entropy_on_a_shard": lambda: fused_linear_grpo(
            xg, _shard_rows(wg, rank, SPLITS[world]), tg, advantages=eg["advantages"], return_entropy=True,
            process_group=dist.group.WORLD,
        ),
        "dpo_ranks_disagree_on_options": lambda: fused_linear_dpo(
            xo, _shard_rows(wo, rank, SPLITS[world]), to, ref_logps=torch.zeros(4), beta=0.1 + 0.1 * (rank == 0),
            process_group=dist.group.WORLD,
        ),
        "dtensor_on_other_group": lambda: fused_linear_cross_entropy(
            x0, distribute_tensor(w0, mesh, [Shard(0)]), t0, process_group=subgroup
        ),
        "dtensor_replicated": lambda: fused_linear_cross_entropy(x0, distribute_tensor(w0, mesh, [Replicate()]), t0),
    }


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    subgroup = dist.new_group(ranks=list(range(world - 1)))  # every rank but the last
    results = {"cases": {}, "errors": {}}
    for case in CASES:
        results["cases"][case] = _run_case(case, rank, world, mesh)
    results["errors"] = outcomes(_error_calls(rank, world, mesh, subgroup))
    # A process outside the group is refused at once; the members run on their own split.
    x0, w0, _, t0, _, _ = make_inputs("flce_mean")
    member_sizes = tuple(torch.tensor_split(torch.arange(V), world - 1)[r].numel() for r in range(world - 1))
    try:
        if rank == world - 1:
            fused_linear_cross_entropy(x0, w0[:10], t0, process_group=subgroup)
            results["not_a_member"] = None
        else:
            results["member_loss"] = float(_flce_call(rank, world, sizes=member_sizes, process_group=subgroup))
    except ValueError as error:
        results["not_a_member"] = str(error)
    # The group still works after all of that.
    results["after_errors"] = float(_flce_call(rank, world))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@functools.cache
def group_run(world: int) -> list[dict]:
    """Spawn ``world`` ranks running :func:`_worker`; their saved results, rank by rank."""
    return spawn_group(_worker, world)


@functools.cache
def single_process(case: str):
    """The case on one process with the whole head, and on float64 copies by the reference."""
    x, w, b, target, options, extra = make_inputs(case)
    options.pop("dtensor", None)
    one = evaluate(case, x, w, b, target, options, extra)

    def double(t):
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    ref_options = {k: double(val) for k, val in options.items()}
    ref_extra = {k: double(val) for k, val in extra.items()}
    ref = evaluate(case, double(x), double(w), double(b), target, ref_options, ref_extra, functions=REFERENCE_FUNCTIONS)
    return one, ref


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    scale = ref.norm().item()
    return (out - ref).norm().item() / (scale if scale > 0 else 1.0)


def _compare(got, want, tol) -> dict:
    """Relative errors of outputs, dx, the concatenated dW/db slices (``got``: one (outputs, grads) per rank)."""
    (want_out, want_grads), errors = want, {}
    for rank, (outputs, grads) in enumerate(got):
        assert len(outputs) == len(want_out)
        for k, (o, r) in enumerate(zip(outputs, want_out)):
            assert o.shape == r.shape
            errors[f"rank{rank} output{k}"] = rel_err(o, r)
        errors[f"rank{rank} dx"] = rel_err(grads[0], want_grads[0])
    for k, name in ((1, "dW"), (2, "db")):
        if want_grads[k] is not None:
            errors[name] = rel_err(torch.cat([grads[k] for _, grads in got]), want_grads[k])
    return {name: e for name, e in errors.items() if not e <= tol}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_single_process_and_float64(world, case):
    ranks = group_run(world)
    one, ref = single_process(case)
    got = [r["cases"][case] for r in ranks]
    tol = TOL[make_inputs(case)[0].dtype]
    assert not _compare(got, one, tol), _compare(got, one, tol)
    if case == "flce_all_ignored":  # every target ignored: loss 0 and no gradient (torch's reference: NaN)
        for outputs, grads in got:
            assert outputs[0].item() == 0 and all(g.abs().max() == 0 for g in grads if g is not None)
    else:
        assert not _compare(got, ref, tol), _compare(got, ref, tol)


EXPECTED_ERRORS = {  # name -> (type on every rank, text in every rank's message)
    "target_beyond_global_vocab": ("ValueError", "outside the global vocabulary [0, 1031)"),
    "negative_target": ("ValueError", "(e.g. -5)"),
    "class_weight_one_short": ("ValueError", "class_weight must hold one weight per class of the whole"),
    "class_weight_of_shard_length": ("ValueError", "disagree on class_weight's length"),
    "ranks_disagree_on_rows": ("ValueError", "disagree on the number of rows"),
    "ranks_disagree_on_targets": ("ValueError", "disagree on target"),
    "ranks_disagree_on_options": ("ValueError", "disagree on the options"),
    "kto_target_beyond_global_vocab": ("ValueError", "outside the global vocabulary"),
    "grpo_entropy_on_a_shard": ("NotImplementedError", "return_entropy with a vocabulary-parallel head"),
    "dpo_ranks_disagree_on_options": ("ValueError", "disagree on the options"),
    "dtensor_on_other_group": ("ValueError", "process_group is not the group of weight's device mesh"),
    "dtensor_replicated": ("ValueError", "(Shard(0),)"),
}
ONE_RANK_ERRORS = {  # name -> (the failing rank, or -1 for the last; its type; its own message)
    "one_rank_weight_of_other_hidden": (-1, "ValueError", "weight must have shape"),
    "one_rank_float_target": (0, "TypeError", "target must be an int64 or int32 tensor"),
    "orpo_one_rank_odd_batch": (-1, "ValueError", "odd batch"),
}


@pytest.mark.parametrize("world", [2, 3])
def test_bad_inputs_raise_on_every_rank_without_hanging(world):
    ranks = group_run(world)
    for name, (kind, text) in EXPECTED_ERRORS.items():
        for rank, result in enumerate(ranks):
            got_kind, message, seconds = result["errors"][name]
            assert (got_kind, seconds < ERROR_WITHIN_S) == (kind, True), (name, rank, got_kind, message, seconds)
            assert text in message, (name, rank, message)
    for name, (bad_rank, kind, text) in ONE_RANK_ERRORS.items():
        bad_rank %= world
        for rank, result in enumerate(ranks):
            got_kind, message, seconds = result["errors"][name]
            assert (got_kind, seconds < ERROR_WITHIN_S) == (kind, True), (name, rank, got_kind, message, seconds)
            expected = text if rank == bad_rank else f"rank(s) [{bad_rank}] of the process group rejected"
            assert expected in message, (name, rank, message)


@pytest.mark.parametrize("world", [2, 3])
def test_group_membership_and_recovery(world):
    ranks = group_run(world)
    assert "is not a member of process_group" in ranks[-1]["not_a_member"]
    one, _ = single_process("flce_mean")
    for result in ranks[:-1]:  # the members ran on their own split of the head
        assert rel_err(torch.tensor(result["member_loss"]), one[0][0]) < 1e-6
    for result in ranks:  # after every refused call, the group computes as before
        assert rel_err(torch.tensor(result["after_errors"]), one[0][0]) < 1e-6


def test_single_process_path_unchanged_without_group():
    """process_group=None with plain tensors takes the one-process path: no torch.distributed needed."""
    x, w, b, target, options, extra = make_inputs("flce_mean")
    assert not dist.is_initialized()
    outputs, grads = evaluate("flce_mean", x, w, b, target, options, extra, process_group=None)
    (ref_out, ref_grads) = single_process("flce_mean")[1]
    assert rel_err(outputs[0], ref_out[0]) < TOL[torch.float32]
    assert all(rel_err(g, r) < TOL[torch.float32] for g, r in zip(grads, ref_grads))


def test_process_group_without_init_is_refused():
    x, w, b, target, _, _ = make_inputs("flce_mean")
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        fused_linear_cross_entropy(x, w, target, process_group=object())


if __name__ == "__main__":  # a quick look at one group's timings
    start = time.monotonic()
    try:
        group_run(3)
    except BaseException:
        traceback.print_exc()
    print(f"{time.monotonic() - start:.1f} s")
