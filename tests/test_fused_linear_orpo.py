"""Fused linear ORPO against the float64 reference and TRL 1.16's own ORPO code.

Errors are relative in norm, ``||out - ref|| / ||ref||``, the reference run on float64 copies of the
very inputs the kernel saw. Shapes are small and odd (H = 40, V = 1031, T = 7): on a machine without
a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device, reference
from kernels_lib.fused_linear_orpo import FusedLinearORPOLoss, ORPOOutput, fused_linear_orpo, log1mexp
from sequence_loss_checks import assert_errors_below, double_leaves, grads_of

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
orpo_trainer = pytest.importorskip("trl.experimental.orpo.orpo_trainer")
ORPOTrainer = orpo_trainer.ORPOTrainer

DEVICE = default_device()

# Tolerances on the relative error, per input dtype. float32: only summation order differs from the
# float64 reference (observed ~2e-7). In half precision the inputs are the same rounded values for
# both sides; what differs is that dx and dW are rounded once to the input dtype (unit roundoff
# 2^-11 ≈ 4.9e-4 for float16, 2^-8 ≈ 3.9e-3 for bfloat16) and, on CUDA, the logits chunk and dz are
# held in it too: 8u and 5u leave room for a few compounded roundings, while a wrong term is off by O(1).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
AUX = ("chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards", "log_odds_ratio", "log_odds_chosen", "nll")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm()).item()


def make_inputs(n=2, seq=7, hidden=40, vocab=1031, dtype=torch.float32, bias=True, seed=0):
    """n pairs; the first two positions of every sequence ignored (a prompt), pair 0's chosen one padded at the end."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if bias else None
    target = torch.randint(0, vocab, (2 * n, seq), generator=gen)
    target[:, :2] = -100
    target[0, -2:] = -100
    leaves = [t.to(DEVICE, dtype).requires_grad_() if t is not None else None for t in (x, w, b)]
    return (*leaves, target.to(DEVICE))


def check_against_reference(x, w, b, target, tol, grad_output=0.7, **options):
    """Loss, auxiliaries and every gradient of the kernel vs the float64 reference."""
    out = fused_linear_orpo(x, w, target, b, **options)
    ref_inputs = double_leaves(x, w, b)
    want = reference.fused_linear_orpo(*ref_inputs[:2], target, ref_inputs[2], **options)
    assert isinstance(out, ORPOOutput) and out.loss.dtype == torch.float32 and out.loss.shape == ()
    errors = {name: rel_err(getattr(out, name), getattr(want, name)) for name in ("loss", *AUX)}
    assert_errors_below(out.loss, want.loss, (x, w, b), ref_inputs, errors, tol, grad_output, rel_err)
    return out


@pytest.mark.parametrize("chunk_size", [None, 1, 14, 30])  # one chunk; one pair per chunk (2T = 14 rows); 2 pairs
def test_matches_reference_float32_chunks(chunk_size):
    x, w, b, target = make_inputs(n=3)
    check_against_reference(x, w, b, target, TOL[torch.float32], chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_half(dtype):
    x, w, b, target = make_inputs(dtype=dtype)
    check_against_reference(x, w, b, target, TOL[dtype], chunk_size=14)


def test_no_bias_beta_and_odd_shapes():
    x, w, _, target = make_inputs(n=1, seq=5, hidden=33, vocab=517, bias=False)
    check_against_reference(x, w, None, target, TOL[torch.float32], beta=0.5)


@pytest.mark.parametrize("chunk_size", [None, 14])
def test_nll_target(chunk_size):
    x, w, b, target = make_inputs()
    nll_target = torch.randint(0, w.shape[0], target.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    nll_target[1, 0] = -100
    nll_target[2:] = -100  # the rejected half is never read
    out = check_against_reference(x, w, b, target, TOL[torch.float32], nll_target=nll_target, chunk_size=chunk_size)
    # the same chunking: cuBLAS may round a 14-row product differently from a 28-row one (one ulp on CUDA)
    plain = fused_linear_orpo(x, w, target, b, chunk_size=chunk_size)
    assert abs(out.nll.item() - plain.nll.item()) > 1e-3  # the NLL term did change
    assert torch.equal(out.log_odds_ratio, plain.log_odds_ratio)


def test_backward_with_unit_grad_output():
    """``loss.backward()`` (grad_output = 1: the scaling kernel moves nothing) matches the reference."""
    x, w, b, target = make_inputs()
    check_against_reference(x, w, b, target, TOL[torch.float32], grad_output=1.0)


def trl_orpo(x, w, b, target, nll_target=None, beta=0.1):
    """TRL 1.16's ORPO on fp32 logits: its get_batch_logps and odds_ratio_loss, its NLL, its total."""
    logits = F.linear(x.float(), w.float(), None if b is None else b.float())
    n = x.shape[0] // 2
    logps = ORPOTrainer.get_batch_logps(logits, target, average_log_prob=True, is_encoder_decoder=True)
    stand_in = SimpleNamespace(beta=beta, accelerator=SimpleNamespace(device=x.device))
    losses, chosen_rewards, rejected_rewards, ratio, log_odds = ORPOTrainer.odds_ratio_loss(stand_in, logps[:n], logps[n:])
    labels = (target if nll_target is None else nll_target)[:n]
    nll = torch.nn.CrossEntropyLoss()(logits[:n].reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return dict(
        loss=nll - losses.mean(), chosen_logps=logps[:n], rejected_logps=logps[n:], chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards, log_odds_ratio=ratio, log_odds_chosen=log_odds, nll=nll,
    )


@pytest.mark.parametrize("with_nll_target", [False, True])
def test_matches_trl(with_nll_target):
    """Kernel and reference against TRL's own functions, values and the gradients of its autograd path."""
    x, w, b, target = make_inputs(n=3)
    nll_target = None
    if with_nll_target:
        nll_target = torch.randint(0, w.shape[0], target.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    trl = trl_orpo(x, w, b, target, nll_target)
    want = grads_of(trl["loss"], (x, w, b), torch.tensor(1.0, device=DEVICE))
    for impl in (fused_linear_orpo, reference.fused_linear_orpo):
        out = impl(x, w, target, b, nll_target=nll_target, chunk_size=14)
        errors = {name: rel_err(getattr(out, name), trl[name]) for name in trl}
        errors.update(
            {n: rel_err(g, r) for n, g, r in zip(("dx", "dW", "db"), grads_of(out.loss, (x, w, b), torch.tensor(1.0, device=DEVICE)), want)}
        )
        assert all(e < TOL[torch.float32] for e in errors.values()), (impl.__module__, errors)


def test_log1mexp_matches_trl_and_is_accurate():
    # float32 values held in float64, down to -79 (below, log(1 - e^a) ~ -e^a is a float32 subnormal)
    a = (-torch.logspace(-12, 1.9, 300, dtype=torch.float64).float().double()).to(DEVICE)
    exact = log1mexp(a)  # the same stable split, in float64: far below float32's rounding
    ours = log1mexp(a.float())
    assert torch.equal(ours, orpo_trainer.log1mexp(a.float()))
    assert ((ours.double() - exact).abs() / exact.abs()).max() < 1e-6
    naive = torch.log(1 - torch.exp(a.float()))  # what the split avoids: -inf near 0, 0 far below
    assert ((naive.double() - exact).abs() / exact.abs()).max() > 0.5


def test_certain_chosen_sequence_has_finite_gradient():
    """A chosen average log-prob that rounds to 0 gives log-odds +inf, loss finite and a finite gradient."""
    x, w, b, target = make_inputs(n=1, bias=False)
    with torch.no_grad():
        w[5] = x[0, 3] * 50  # logit ~2000 for class 5 at the chosen sequence's one valid token
    target = torch.full_like(target, -100)
    target[0, 3] = 5
    target[1, 2:] = 7
    out = fused_linear_orpo(x, w, target)
    assert out.chosen_logps.item() == 0.0 and torch.isinf(out.log_odds_chosen)
    assert torch.isfinite(out.loss)
    dx, dw = torch.autograd.grad(out.loss, (x, w))
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()


def test_module_and_no_grad():
    x, w, b, target = make_inputs()
    module = FusedLinearORPOLoss(beta=0.2, chunk_size=14)
    assert "beta=0.2" in repr(module)
    out = module(x, w, target, b)
    assert torch.equal(out.loss, fused_linear_orpo(x, w, target, b, beta=0.2, chunk_size=14).loss)
    with torch.no_grad():
        quiet = fused_linear_orpo(x, w, target, b)
    assert quiet.loss.grad_fn is None
    assert all(not getattr(out, name).requires_grad for name in AUX)


def test_second_backward_is_refused():
    x, w, b, target = make_inputs()
    loss = fused_linear_orpo(x, w, target, b).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
def test_nan_propagates():
    x, w, b, target = make_inputs()
    with torch.no_grad():
        x[3, 4, 0] = float("nan")
    out = fused_linear_orpo(x, w, target, b)
    assert torch.isnan(out.loss) and torch.isnan(out.rejected_logps[1])
    assert torch.isnan(torch.autograd.grad(out.loss, w)[0]).any()


def bad_inputs():
    x, w, b, target = make_inputs()
    empty = target.clone()
    empty[2] = -100
    out_of_range = target.clone()
    out_of_range[1, 4] = w.shape[0]
    return [
        (dict(x=x[:3], target=target[:3]), ValueError, "odd batch"),
        (dict(x=x[0]), ValueError, "x must have 3"),
        (dict(target=target[:, :-1]), ValueError, "target must have shape"),
        (dict(target=target.float()), TypeError, "target must be an int64"),
        (dict(target=out_of_range), ValueError, "target holds 1 value"),
        (dict(target=empty), ValueError, "target has 1 sequence"),
        (dict(nll_target=torch.full_like(target, -100)), ValueError, "nll_target has no valid token"),
        (dict(nll_target=target[:, 1:]), ValueError, "nll_target must have shape"),
        (dict(weight=w.double()), TypeError, "weight must be a floating tensor"),
        (dict(weight=w.half()), TypeError, "weight must have the dtype of x"),
        (dict(weight=w[:, 1:]), ValueError, "weight must have shape"),
        (dict(bias=b[1:]), ValueError, "bias must have shape"),
        (dict(bias=b.half()), TypeError, "bias must have the dtype of weight"),
        (dict(x=x.detach().to("meta")), ValueError, "x on meta"),
        (dict(beta=float("nan")), TypeError, "beta must be a finite"),
        (dict(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
    ]


@pytest.mark.parametrize("change,error,match", bad_inputs())
def test_bad_inputs_name_the_argument(change, error, match):
    x, w, b, target = make_inputs()
    args = dict(x=x, weight=w, target=target, bias=b) | change
    with pytest.raises(error, match=match):
        fused_linear_orpo(**args)
