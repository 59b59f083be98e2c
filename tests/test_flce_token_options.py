"""Per-token weights, DFT token scaling, predicted classes and a differentiable lse of the fused linear
cross-entropy, against float64 logits.

The reference forms the logits in float64 (``(x W^T + b)``, softcap, temperature), each row's loss as
``F.cross_entropy`` defines it with smoothing and the z-loss, times ``ω_i`` (``token_weight``) and
the detached ``p_y`` (``token_scaling``), reduced with ``mean``'s denominator unchanged (the valid
rows, or ``num_items_in_batch``). The vocabulary-parallel route is checked on a 2-rank gloo group
against the single process.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib.fused_linear_cross_entropy import fused_linear_cross_entropy
from process_groups import GLOO_CPU_MARKS, spawn_group
from test_fused_linear_cross_entropy import DEVICE, rel_err

N, H, V = 43, 21, 269
TOL = 1e-5


def inputs(seed: int, masked: float = 0.3, lead=(N,)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * H**-0.5 * 2
    b = torch.randn(V, generator=gen) / 4
    target = torch.randint(0, V, lead, generator=gen)
    target[torch.rand(lead, generator=gen) < masked] = -100
    weight = torch.rand(lead, generator=gen) * 2
    return x, w, b, target, weight


def reference(x, w, b, target, *, reduction="mean", token_weight=None, token_scaling=False, softcap=None,
              label_smoothing=0.0, z_loss_scale=0.0, temperature=1.0, num_items_in_batch=None):
    """float64 logits, each valid row's loss times its factor, mean over the valid rows (or the count given)."""
    z = x @ w.T + b
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    valid = target != -100
    log_p = torch.log_softmax(z, -1)
    nll = -log_p.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    loss = (1 - label_smoothing) * nll - label_smoothing * log_p.mean(-1) + z_loss_scale * torch.logsumexp(z, -1) ** 2
    if token_weight is not None:
        loss = loss * token_weight.double()
    if token_scaling:
        loss = loss * torch.exp(-nll).detach()
    loss = torch.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / (num_items_in_batch or valid.sum().clamp(min=1)) if reduction == "mean" else total


def check(seed, *, lead=(N,), masked=0.3, dtype=torch.float32, tol=TOL, **options):
    x, w, b, target, weight = inputs(seed, masked, lead)
    if options.pop("token_weight", False):
        options["token_weight"] = weight.to(DEVICE)
    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (x, w, b)]
    loss = fused_linear_cross_entropy(*leaves[:2], target.to(DEVICE), leaves[2], chunk_size=16, **options)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]  # on the kernel's device, as its inputs
    ref = reference(*ref_leaves, target.to(DEVICE), **options)
    upstream = (torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed)) + 0.5).to(DEVICE)
    got = torch.autograd.grad(loss, leaves, upstream)
    want = torch.autograd.grad(ref, ref_leaves, upstream.double())
    errors = {"loss": rel_err(loss, ref), **{n: rel_err(g, r) for n, g, r in zip(("dx", "dW", "db"), got, want)}}
    assert all(e < tol for e in errors.values()), errors
    return loss


OPTION_SETS = {
    "plain": {},
    "smoothing+zloss+softcap+temperature": dict(label_smoothing=0.1, z_loss_scale=1e-2, softcap=4.0, temperature=0.7),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighting", ["token_weight", "token_scaling", "both"])
@pytest.mark.parametrize("option_set", list(OPTION_SETS))
def test_against_float64(reduction, weighting, option_set):
    options = dict(OPTION_SETS[option_set], reduction=reduction)
    options["token_weight"] = weighting in ("token_weight", "both")
    options["token_scaling"] = weighting in ("token_scaling", "both")
    check(zlib.crc32(f"{reduction}{weighting}{option_set}".encode()) % 1000, lead=(N,) if reduction != "none" else (3, 13),
          **options)


def test_no_and_every_row_ignored():
    check(5, masked=0.0, token_weight=True, token_scaling=True)
    x, w, b, target, weight = inputs(6, masked=1.0)
    leaves = [t.to(DEVICE).requires_grad_() for t in (x, w, b)]
    for reduction in ("mean", "sum", "none"):
        loss = fused_linear_cross_entropy(*leaves[:2], target.to(DEVICE), leaves[2], reduction=reduction,
                                          token_weight=weight.to(DEVICE), token_scaling=True)
        assert (loss == 0).all() and all((g == 0).all() for g in torch.autograd.grad(loss.sum(), leaves))


def test_mean_keeps_its_denominator():
    """``mean`` = Σ ω ℓ / n_valid, and with ``num_items_in_batch`` Σ ω ℓ / that count (not / Σ ω)."""
    check(7, token_weight=True, num_items_in_batch=50)
    x, w, b, target, weight = (t.to(DEVICE) for t in inputs(8))
    valid = target != -100
    weighted = fused_linear_cross_entropy(x, w, target, b, token_weight=weight)
    summed = fused_linear_cross_entropy(x, w, target, b, token_weight=weight, reduction="sum")
    assert torch.allclose(weighted, summed / valid.sum(), rtol=1e-6)


def test_token_scaling_is_dft():
    """With only token scaling, each row's loss is ``-p_y log p_y`` and its gradient ``-p_y ∇ log p_y``."""
    x, w, b, target, _ = (t.to(DEVICE) for t in inputs(9))
    nll = fused_linear_cross_entropy(x, w, target, b, reduction="none")
    dft = fused_linear_cross_entropy(x, w, target, b, reduction="none", token_scaling=True)
    assert rel_err(dft, nll * torch.exp(-nll)) < TOL


def test_half_precision_token_options():
    check(10, dtype=torch.bfloat16, tol=2e-2, token_weight=True, token_scaling=True)


@pytest.mark.parametrize("name, value, error, fragment", [
    ("token_weight", [1.0], TypeError, "token_weight"),
    ("token_weight", torch.ones(N + 1), ValueError, "token_weight must have shape"),
    ("token_weight", torch.ones(N, dtype=torch.int64), TypeError, "token_weight"),
    ("token_scaling", 1, TypeError, "token_scaling"),
])
def test_bad_options_name_the_argument(name, value, error, fragment):
    x, w, b, target, _ = inputs(11)
    if isinstance(value, torch.Tensor):
        value = value.to(DEVICE)
    with pytest.raises(error, match=fragment):
        fused_linear_cross_entropy(x.to(DEVICE), w.to(DEVICE), target.to(DEVICE), b.to(DEVICE), **{name: value})


@pytest.mark.parametrize("bad", [V, -5])
def test_a_target_out_of_range_is_named_with_token_scaling(bad):
    """The target's probability is read before the call's range check: a bad target must still meet that check
    (its message), not an indexing error of the read (on CUDA a device-side assert that ends the context)."""
    x, w, b, target, _ = (t.to(DEVICE) for t in inputs(15))
    target[2] = bad
    with pytest.raises(ValueError, match=rf"target holds 1 value\(s\) outside \[0, {V}\).*\(e\.g\. {bad}\)"):
        fused_linear_cross_entropy(x, w, target, b, token_scaling=True, chunk_size=16)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy on NaN, in the interpreter
def test_nan_weight_gives_nan():
    x, w, b, target, weight = (t.to(DEVICE) for t in inputs(12, masked=0.0))
    weight[4] = float("nan")
    assert fused_linear_cross_entropy(x, w, target, b, token_weight=weight).isnan()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option_set", list(OPTION_SETS))
@pytest.mark.parametrize("skip_ignored", [True, False])
def test_lse_output_and_its_gradient(reduction, option_set, skip_ignored):
    """The lse against float64 (0 at ignored rows), and the gradient of ``loss + Σ g·lse`` (and of the lse
    alone) against autograd through the float64 logits; the predicted classes are the argmax."""
    options = dict(OPTION_SETS[option_set], reduction=reduction)
    x, w, b, target, _ = inputs(zlib.crc32(f"lse{reduction}{option_set}".encode()) % 1000)
    leaves = [t.to(DEVICE).requires_grad_() for t in (x, w, b)]
    target = target.to(DEVICE)  # the float64 reference runs beside the kernel, on its device
    out = fused_linear_cross_entropy(*leaves[:2], target, leaves[2], chunk_size=16, return_lse=True,
                                     return_predicted=True, skip_ignored=skip_ignored, **options)
    assert out.entropy is None and out.lse.shape == target.shape and out.lse.dtype == torch.float32
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    z = ref_leaves[0] @ ref_leaves[1].T + ref_leaves[2]
    if options.get("softcap"):
        z = options["softcap"] * torch.tanh(z / options["softcap"])
    z = z / options.get("temperature", 1.0)
    valid = target != -100
    ref_lse = torch.where(valid, torch.logsumexp(z, -1), 0.0)
    assert torch.equal(out.predicted, torch.where(valid, z.argmax(-1), -100))
    ref_loss = reference(*ref_leaves, target, **options)
    g_lse = torch.randn(target.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    upstream = (torch.rand(out.loss.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.5).to(DEVICE)
    total = (out.loss * upstream.float()).sum() + (out.lse * g_lse.float()).sum()
    ref_total = (ref_loss * upstream).sum() + (ref_lse * g_lse).sum()
    assert rel_err(out.lse, ref_lse) < TOL
    got = torch.autograd.grad(total, leaves)
    want = torch.autograd.grad(ref_total, ref_leaves, retain_graph=True)
    assert all(rel_err(a, c) < TOL for a, c in zip(got, want)), [rel_err(a, c) for a, c in zip(got, want)]
    alone = fused_linear_cross_entropy(*leaves[:2], target, leaves[2], chunk_size=16, return_lse=True, **options)
    got = torch.autograd.grad((alone.lse * g_lse.float()).sum(), leaves)
    want = torch.autograd.grad((ref_lse * g_lse).sum(), ref_leaves)
    assert all(rel_err(a, c) < TOL for a, c in zip(got, want)), "the lse's gradient alone"


def test_predicted_beside_is_top1():
    x, w, b, target, _ = (t.to(DEVICE) for t in inputs(14, masked=0.3))
    target[::3] = (x @ w.T + b).argmax(-1)[::3]  # some hits
    target[1] = -100
    out = fused_linear_cross_entropy(x, w, target, b, return_token_stats=True, return_predicted=True)
    assert out.predicted.dtype == torch.int64 and out.predicted[1] == -100
    assert torch.equal(out.is_top1, (out.predicted == target) & (target != -100))
    with pytest.raises(TypeError, match="return_predicted"):
        fused_linear_cross_entropy(x, w, target, b, return_predicted=1)


# ------------------------------------------------------------------ vocabulary-parallel: 2 ranks over gloo

SPLIT = (150, 119)
VP_OPTIONS = {
    "mean": dict(token_weight=True, token_scaling=True, softcap=3.0, label_smoothing=0.1),
    "none": dict(reduction="none", token_scaling=True, chunk_size=5),
    "lse_predicted": dict(return_lse=True, return_predicted=True, softcap=5.0, chunk_size=7),
}


def _vp_call(options, x, w, b, target, weight, group=None, rank=0):
    options = dict(options)
    if options.pop("token_weight", False):
        options["token_weight"] = weight
    if group is not None:
        lo = sum(SPLIT[:rank])
        w, b = w[lo:lo + SPLIT[rank]], b[lo:lo + SPLIT[rank]]
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    out = fused_linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], process_group=group, **options)
    if isinstance(out, tuple):  # the lse joins the loss's gradient; the predicted classes come back as they are
        loss = torch.stack([out.loss, (out.lse * torch.linspace(-1, 1, out.lse.numel()).reshape(out.lse.shape)).sum()])
        extra = out.predicted
    else:
        loss, extra = out, None
    grads = torch.autograd.grad(loss, leaves, torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape))
    return loss.detach(), grads, extra


def _worker(rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    x, w, b, target, weight = inputs(13, lead=(2, 9))
    results = {name: _vp_call(options, x, w, b, target, weight, dist.group.WORLD, rank)
               for name, options in VP_OPTIONS.items()}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_vocabulary_parallel_matches_one_process():
    assert sum(SPLIT) == V
    ranks = spawn_group(_worker, 2)
    x, w, b, target, weight = inputs(13, lead=(2, 9))
    for name, options in VP_OPTIONS.items():
        loss, (dx, dw, db), predicted = _vp_call(options, x, w, b, target, weight)
        for rank, result in enumerate(ranks):
            got_loss, (got_dx, got_dw, got_db), got_predicted = result[name]
            assert (predicted is None) == (got_predicted is None)
            assert predicted is None or torch.equal(got_predicted, predicted), (name, rank)
            lo = sum(SPLIT[:rank])
            errors = [rel_err(got_loss, loss), rel_err(got_dx, dx), rel_err(got_dw, dw[lo:lo + SPLIT[rank]]),
                      rel_err(got_db, db[lo:lo + SPLIT[rank]])]
            assert max(errors) < TOL, (name, rank, errors)


for _mark in GLOO_CPU_MARKS:  # gloo present, CPU tensors (the interpreter's)
    test_vocabulary_parallel_matches_one_process = _mark(test_vocabulary_parallel_matches_one_process)
