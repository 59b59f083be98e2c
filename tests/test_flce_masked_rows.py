"""Ignored rows dropped before the head's matmuls: the loss and every gradient against float64 on the valid subset.

Each case draws fresh inputs at odd sizes, ignores 0 %, part or all of the rows, and checks the fused
loss (``skip_ignored`` on, the default) against :func:`kernels_lib.reference.fused_linear_cross_entropy`
run in float64 on the valid rows alone (so the ignored rows cannot matter to the reference), with
``mean``'s denominator and the per-row outputs placed as the full call defines them: ``dx`` 0 at
ignored rows, per-row values 0 there.
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import linear_cross_entropy, reference
from kernels_lib.fused_linear_cross_entropy import fused_linear_cross_entropy
from kernels_lib.fused_linear_token_logprobs import fused_linear_token_logprobs
from test_fused_linear_cross_entropy import DEVICE, rel_err

flce_module = importlib.import_module("kernels_lib.fused_linear_cross_entropy")

N, H, V = 41, 19, 263  # odd sizes; chunks of 16 rows: several chunks, the last one short
TOL = 1e-5  # float32 kernels against float64: summation order only


def inputs(masked: float, seed: int, lead=(N,)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * H**-0.5 * 2
    b = torch.randn(V, generator=gen) / 4
    target = torch.randint(0, V, lead, generator=gen)
    drop = torch.rand(lead, generator=gen) < masked
    if masked == 1.0:
        drop[:] = True
    target[drop] = -100
    leaves = [t.to(DEVICE).requires_grad_() for t in (x, w, b)]
    return (*leaves, target.to(DEVICE))


def subset_reference(x, w, b, target, reduction, options):
    """float64 reference on the valid rows alone; ``mean`` over the same denominator as the full call."""
    valid = target.reshape(-1) != -100
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    x_valid = ref_leaves[0].reshape(-1, H)[valid]
    options = dict(options)
    class_weight = options.get("class_weight")
    if class_weight is not None:
        options["class_weight"] = class_weight.double()
    inner = "sum" if reduction == "mean" else reduction
    options.pop("num_items_in_batch", None)
    loss = reference.fused_linear_cross_entropy(x_valid, ref_leaves[1], target.reshape(-1)[valid], ref_leaves[2],
                                                reduction=inner, **options)
    if reduction == "mean":
        denominator = normalizer(target, class_weight, options)
        loss = loss / denominator
    elif reduction == "none":
        loss = loss.new_zeros(target.numel()).index_put((valid.nonzero().squeeze(1),), loss)
        loss = loss.reshape(target.shape)
    return loss, ref_leaves


NUM_ITEMS = 29


def normalizer(target, class_weight, options):
    valid = target.reshape(-1) != -100
    if options.get("num_items", False):
        return NUM_ITEMS
    if class_weight is not None:
        total = class_weight.double()[target.reshape(-1)[valid]].sum().item()
    else:
        total = float(valid.sum())
    return total or 1.0  # all ignored: the documented 0, with zero gradients


OPTIONS = {
    "plain": {},
    "smoothing+zloss+softcap": {"label_smoothing": 0.15, "z_loss_scale": 1e-2, "softcap": 4.0},
    "class_weight+scale+temperature": {"class_weight": "w", "logit_scale": 1.5, "temperature": 0.7},
    "num_items_in_batch": {"num_items_in_batch": NUM_ITEMS},
}


def resolve(name):
    options = dict(OPTIONS[name])
    if options.get("class_weight") == "w":
        options["class_weight"] = (torch.rand(V, generator=torch.Generator().manual_seed(5)) + 0.5).to(DEVICE)
    return options


@pytest.mark.parametrize("masked", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("option_set", list(OPTIONS))
def test_loss_and_gradients_match_the_valid_subset(masked, reduction, option_set):
    if option_set == "num_items_in_batch" and reduction != "mean":
        pytest.skip("num_items_in_batch is mean's denominator")
    seed = zlib.crc32(f"{masked}{reduction}{option_set}".encode()) % 1000
    x, w, b, target = inputs(masked, seed, lead=(N,) if reduction != "none" else (3, 14))
    options = resolve(option_set)
    loss = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_size=16, **options)
    ref_options = {k: v for k, v in options.items() if k != "num_items_in_batch"}
    if "num_items_in_batch" in options:
        ref_options["num_items"] = True
    ref_opts = {k: v for k, v in ref_options.items() if k != "num_items"}
    ref, leaves = subset_reference(x, w, b, target, reduction, ref_opts)
    if reduction == "mean" and "num_items" in ref_options:
        ref = ref * normalizer(target, options.get("class_weight"), {}) / NUM_ITEMS
    assert loss.shape == ref.shape and loss.dtype == torch.float32
    upstream = (torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed)) + 0.5).to(DEVICE)
    got = torch.autograd.grad(loss, (x, w, b), upstream)
    want = torch.autograd.grad(ref, leaves, upstream.double())
    ignored = target.reshape(-1) == -100
    if masked == 1.0:
        assert (loss == 0).all() and all((g == 0).all() for g in got)
        return
    assert rel_err(loss, ref) < TOL, ("loss", rel_err(loss, ref))
    for name, g, r in zip(("dx", "dW", "db"), got, want):
        assert rel_err(g, r) < TOL, (name, rel_err(g, r))
    assert (got[0].reshape(-1, H)[ignored] == 0).all()
    if reduction == "none":
        assert (loss.reshape(-1)[ignored] == 0).all()


def rows_seen(monkeypatch):
    """The number of rows each call hands to the autograd Function (what the matmuls see)."""
    seen = []
    apply = flce_module._FusedLinearCrossEntropyFunction.apply

    def spy(x, *args):
        seen.append(x.shape[0])
        return apply(x, *args)

    monkeypatch.setattr(flce_module._FusedLinearCrossEntropyFunction, "apply", spy)
    return seen


def test_the_matmuls_see_the_valid_rows_alone(monkeypatch):
    seen = rows_seen(monkeypatch)
    x, w, b, target = inputs(0.5, 11)
    n_valid = int((target != -100).sum())
    assert 0 < n_valid < N
    kept = fused_linear_cross_entropy(x, w, target, b, chunk_size=16)
    every = fused_linear_cross_entropy(x, w, target, b, chunk_size=16, skip_ignored=False)
    fused_linear_cross_entropy(x, w, torch.full_like(target, -100), b)
    fused_linear_cross_entropy(x, w, target.clamp(min=0), b)
    assert seen == [n_valid, N, 1, N], "valid rows; every row when asked; one row of an all-ignored batch; no gather"
    assert rel_err(kept, every) < TOL
    for g, h in zip(torch.autograd.grad(kept, (x, w, b)), torch.autograd.grad(every, (x, w, b))):
        assert rel_err(g, h) < TOL


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_token_stats_are_scattered_back(reduction):
    x, w, b, target = inputs(0.35, 21, lead=(5, 9))
    got = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, return_token_stats=True, softcap=6.0)
    want = reference.fused_linear_cross_entropy(*(t.detach().double() for t in (x, w)), target, b.detach().double(),
                                                reduction=reduction, return_token_stats=True, softcap=6.0)
    ignored = target == -100
    for name in ("entropy", "mean_logit", "log_sum_sq_prob"):
        value = getattr(got, name)
        assert value.shape == target.shape and (value[ignored] == 0).all(), name
        assert rel_err(value, getattr(want, name).masked_fill(ignored, 0)) < TOL, name
    assert got.is_top1.dtype == torch.bool and torch.equal(got.is_top1, want.is_top1 & ~ignored)


def test_token_logprobs_with_ignored_rows():
    x, w, b, target = inputs(0.5, 31, lead=(4, 7))
    out = fused_linear_token_logprobs(x, w, target, b, temperature=0.8, return_entropy=True)
    logits = (x.detach().double() @ w.detach().double().T + b.detach().double()) / 0.8
    logp = torch.log_softmax(logits, -1)
    valid = target != -100
    want = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    entropy = -(logp.exp() * logp).sum(-1) * valid
    assert rel_err(out.logps, want) < TOL and rel_err(out.entropy, entropy) < TOL
    g = torch.autograd.grad((out.logps * 1.3 + out.entropy * 0.4).sum(), x)[0]
    assert (g[~valid] == 0).all() and (g[valid] != 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_linear_cross_entropy_with_ignored_rows(reduction):
    x, w, b, target = inputs(0.5, 41)
    class_weight = (torch.rand(V, generator=torch.Generator().manual_seed(2)) + 0.5).to(DEVICE)
    loss = linear_cross_entropy(x, w, target, linear_bias=b, weight=class_weight, reduction=reduction,
                                label_smoothing=0.1)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = torch.nn.functional.cross_entropy(leaves[0] @ leaves[1].T + leaves[2], target, weight=class_weight.double(),
                                            reduction=reduction, label_smoothing=0.1)
    assert rel_err(loss, ref) < TOL
    for g, r in zip(torch.autograd.grad(loss.sum(), (x, w, b)), torch.autograd.grad(ref.sum(), leaves)):
        assert rel_err(g, r) < TOL


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy on NaN, in the interpreter
def test_nan_in_a_valid_row_gives_nan():
    x, w, b, target = inputs(0.5, 51)
    row = int((target != -100).nonzero()[0])
    with torch.no_grad():
        x[row, 2] = float("nan")
    loss = fused_linear_cross_entropy(x, w, target, b)
    assert loss.isnan() and torch.autograd.grad(loss, w)[0].isnan().any()


def test_skip_ignored_must_be_a_bool():
    x, w, b, target = inputs(0.5, 61)
    with pytest.raises(TypeError, match="skip_ignored"):
        fused_linear_cross_entropy(x, w, target, b, skip_ignored="yes")
