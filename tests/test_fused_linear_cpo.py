"""Fused linear CPO and SimPO against the float64 reference and TRL 1.16's own ``CPOTrainer`` code.

Errors are relative in norm, ``||out - ref|| / ||ref||``, the reference run on float64 copies of the
very inputs the kernel saw. Shapes are small and odd (H = 40, V = 1031 (prime), T = 7; and n = 1,
T = 1, H = 33, V = 509): on a machine without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import os
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device, reference
from kernels_lib.fused_linear_cpo import (
    LOSS_TYPES,
    CPOOutput,
    FusedLinearCPOLoss,
    FusedLinearSimPOLoss,
    fused_linear_cpo,
    fused_linear_simpo,
)
from sequence_loss_checks import assert_errors_below, baseline_errors, double_leaves, grads_of

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
cpo_trainer = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
CPOTrainer = cpo_trainer.CPOTrainer

DEVICE = default_device()

# Tolerances on the relative error, per input dtype, as the ORPO tests (see tests/test_fused_linear_dpo.py).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
AUX = CPOOutput._fields[1:]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if ref.norm() == 0:
        return out.norm().item()
    return ((out - ref).norm() / ref.norm()).item()


def make_inputs(n=2, seq=7, hidden=40, vocab=1031, dtype=torch.float32, bias=True, seed=0):
    """n pairs; the first two positions of every sequence ignored (a prompt), pair 0's chosen one
    padded at the end (T >= 4)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if bias else None
    target = torch.randint(0, vocab, (2 * n, seq), generator=gen)
    if seq >= 4:
        target[:, :2] = -100
        target[0, -2:] = -100
    leaves = [t.to(DEVICE, dtype).requires_grad_() if t is not None else None for t in (x, w, b)]
    return (*leaves, target.to(DEVICE))


def check_against_reference(x, w, b, target, tol, grad_output=0.7, simpo=False, **options):
    """Loss, auxiliaries and every gradient of the kernel vs the float64 reference."""
    kernel, ref_fn = (fused_linear_simpo, reference.fused_linear_simpo) if simpo else (fused_linear_cpo, reference.fused_linear_cpo)
    out = kernel(x, w, target, b, **options)
    ref_inputs = double_leaves(x, w, b)
    want = ref_fn(*ref_inputs[:2], target, ref_inputs[2], **options)
    assert isinstance(out, CPOOutput) and out.loss.dtype == torch.float32 and out.loss.shape == ()
    errors = {name: rel_err(getattr(out, name), getattr(want, name)) for name in ("loss", *AUX)}
    baseline = None
    if x.dtype != torch.float32:  # 16-bit: no worse than the baseline's own error in that dtype on this device
        ref_inputs_again = double_leaves(x, w, b)
        want_again = ref_fn(*ref_inputs_again[:2], target, ref_inputs_again[2], **options)
        baseline = baseline_errors(lambda x_, w_, b_: ref_fn(x_, w_, target, b_, **options), (x, w, b), want_again,
                                   ref_inputs_again, ("loss", *AUX), grad_output, rel_err)
    assert_errors_below(out.loss, want.loss, (x, w, b), ref_inputs, errors, tol, grad_output, rel_err, baseline)
    return out


@pytest.mark.parametrize("chunk_size", [None, 1, 14, 30])  # one chunk; one pair per chunk (2T = 14 rows); 2 pairs
def test_matches_reference_float32_chunks(chunk_size):
    x, w, b, target = make_inputs(n=3)
    check_against_reference(x, w, b, target, TOL[torch.float32], chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("simpo", [False, True], ids=["cpo", "simpo"])
def test_matches_reference_half(dtype, simpo):
    x, w, b, target = make_inputs(dtype=dtype)
    check_against_reference(x, w, b, target, TOL[dtype], simpo=simpo, chunk_size=14, beta=2.0)


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="sigmoid", label_smoothing=0.2, beta=0.5),
        dict(loss_type="hinge", beta=0.05),
        dict(loss_type="ipo", cpo_alpha=0.3),
        dict(loss_type="simpo", simpo_gamma=0.8, beta=2.5, label_smoothing=0.1),
        dict(loss_type="simpo", cpo_alpha=0.0, alpha=0.5, beta=2.0),  # AlphaPO (TRL's "alphapo")
        dict(loss_type="sigmoid", alpha=-0.05, cpo_alpha=2.0),  # AlphaPO on sums
        dict(loss_type="sigmoid", cpo_alpha=0.0),
    ],
    ids=["sigmoid-smoothed", "hinge", "ipo", "simpo", "alphapo", "alpha-sums", "no-nll"],
)
def test_options(options):
    x, w, b, target = make_inputs(n=3)
    out = check_against_reference(x, w, b, target, TOL[torch.float32], chunk_size=14, **options)
    if options.get("cpo_alpha") == 0.0:
        assert out.nll.item() == 0.0


@pytest.mark.parametrize("chunk_size", [None, 14])
@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_nll_target(chunk_size, loss_type):
    x, w, b, target = make_inputs()
    nll_target = torch.randint(0, w.shape[0], target.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    nll_target[1, 0] = -100
    nll_target[2:] = -100  # the rejected half is never read
    out = check_against_reference(x, w, b, target, TOL[torch.float32], nll_target=nll_target, chunk_size=chunk_size, loss_type=loss_type)
    plain = fused_linear_cpo(x, w, target, b, chunk_size=chunk_size, loss_type=loss_type)
    assert abs(out.nll.item() - plain.nll.item()) > 1e-3  # the NLL term did change
    assert torch.equal(out.chosen_rewards, plain.chosen_rewards)


def test_one_pair_one_token_odd_sizes_no_bias():
    """n = 1 pair, T = 1 (one token per sequence), H = 33, V = 509 (prime), no bias; grad_output = 1."""
    x, w, _, target = make_inputs(n=1, seq=1, hidden=33, vocab=509, bias=False)
    for loss_type in LOSS_TYPES:
        check_against_reference(x, w, None, target, TOL[torch.float32], grad_output=1.0, loss_type=loss_type)


def test_simpo_is_cpo_with_loss_type_simpo():
    x, w, b, target = make_inputs()
    options = dict(beta=2.0, simpo_gamma=0.7, label_smoothing=0.05, cpo_alpha=0.5, chunk_size=14)
    simpo = fused_linear_simpo(x, w, target, b, **options)
    cpo = fused_linear_cpo(x, w, target, b, loss_type="simpo", **options)
    assert all(torch.equal(a, c) for a, c in zip(simpo, cpo))
    module = FusedLinearSimPOLoss(beta=2.0, simpo_gamma=0.7, label_smoothing=0.05, cpo_alpha=0.5, chunk_size=14)
    assert "loss_type='simpo'" in repr(module) and torch.equal(module(x, w, target, b).loss, simpo.loss)


# --------------------------------------------------------------------------- TRL's own code


def trl_cpo(x, w, b, target, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, cpo_alpha=1.0, simpo_gamma=0.5, alpha=0.0):
    """``CPOTrainer.get_batch_loss_metrics`` (cpo_trainer.py lines 865-917) on a stand-in trainer
    (encoder-decoder path: labels aligned with the logits, no shift), its ``concatenated_forward``,
    ``get_batch_logps`` and ``cpo_loss`` as they are, and a model that returns our fp32 logits."""
    n = x.shape[0] // 2
    logits = F.linear(x.float(), w.float(), None if b is None else b.float())

    def model(input_ids, attention_mask=None, use_cache=False, **kwargs):
        return SimpleNamespace(logits=logits)

    trainer = SimpleNamespace(
        is_encoder_decoder=True, pad_token_id=0, decoder_start_token_id=0, aux_loss_enabled=False,
        accelerator=SimpleNamespace(device=x.device, gather_for_metrics=lambda t: t),
        beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, cpo_alpha=cpo_alpha, simpo_gamma=simpo_gamma,
        alpha=alpha, concatenated_inputs=CPOTrainer.concatenated_inputs, get_batch_logps=CPOTrainer.get_batch_logps,
    )
    for name in ("_shift_right", "concatenated_forward", "cpo_loss"):
        setattr(trainer, name, partial(getattr(CPOTrainer, name), trainer))
    batch = {
        "prompt_input_ids": torch.zeros(n, 2, dtype=torch.long, device=x.device),
        "prompt_attention_mask": torch.ones(n, 2, dtype=torch.long, device=x.device),
        "chosen_labels": target[:n], "rejected_labels": target[n:],
    }
    return CPOTrainer.get_batch_loss_metrics(trainer, model, batch)


#: Our outputs whose mean TRL logs, by its metric name.
LOGGED = {
    "rewards/chosen": "chosen_rewards", "rewards/rejected": "rejected_rewards", "rewards/accuracies": "reward_accuracies",
    "rewards/margins": "reward_margins", "logps/chosen": "chosen_logps", "logps/rejected": "rejected_logps", "nll_loss": "nll",
}


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(label_smoothing=0.2, beta=0.5, cpo_alpha=0.5),
        dict(loss_type="hinge"),
        dict(loss_type="ipo", beta=0.3),
        dict(loss_type="simpo", beta=2.0, simpo_gamma=0.6, label_smoothing=0.1),
        dict(loss_type="simpo", beta=2.0, cpo_alpha=0.0, alpha=0.25),
    ],
    ids=["sigmoid", "smoothed", "hinge", "ipo", "simpo", "alphapo"],
)
def test_matches_trl(options):
    """Kernel and reference against TRL's code: the loss, its gradients (TRL's autograd) and the logged means."""
    x, w, b, target = make_inputs(n=3)
    target[4, 2:5] = -100  # a shorter rejected completion: the averaged types see it
    trl_loss, logged = trl_cpo(x, w, b, target, **options)
    want = grads_of(trl_loss, (x, w, b), torch.tensor(1.0, device=DEVICE))
    simpo = options.get("loss_type") == "simpo"
    for impl in (fused_linear_cpo, reference.fused_linear_cpo) + ((fused_linear_simpo,) if simpo else ()):
        kwargs = {k: v for k, v in options.items() if not (impl is fused_linear_simpo and k == "loss_type")}
        out = impl(x, w, target, b, chunk_size=14, **kwargs)
        errors = {"loss": rel_err(out.loss, trl_loss)}
        errors |= {name: abs(getattr(out, ours).mean().item() - logged[name]) / max(abs(logged[name]), 1e-3) for name, ours in LOGGED.items()}
        got = grads_of(out.loss, (x, w, b), torch.tensor(1.0, device=DEVICE))
        errors |= {n: rel_err(g, r) for n, g, r in zip(("dx", "dW", "db"), got, want)}
        assert all(e < TOL[torch.float32] for e in errors.values()), (impl.__name__, errors)


# --------------------------------------------------------------------------- behaviour


def test_alphapo_stays_finite_where_trl_overflows():
    """AlphaPO on sums of log-probs below -104: TRL's exp(logp) underflows to 0 and 0^-alpha is inf; our
    -expm1(-alpha·logp)/alpha is the same function without the round trip, finite."""
    x, w, b, target = make_inputs()
    with torch.no_grad():
        x.mul_(8.0)  # confident, mostly wrong: sequence sums far below -104
    out = fused_linear_cpo(x, w, target, b, alpha=0.01)
    assert out.chosen_logps.max() < -104 and torch.isfinite(out.loss)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out.loss, (x, w, b)))
    trl_loss, _ = trl_cpo(x, w, b, target, alpha=0.01)
    assert not torch.isfinite(trl_loss)


def test_module_and_no_grad():
    x, w, b, target = make_inputs()
    module = FusedLinearCPOLoss(beta=0.2, loss_type="hinge", chunk_size=14)
    assert "beta=0.2" in repr(module) and "'hinge'" in repr(module)
    out = module(x, w, target, b)
    assert torch.equal(out.loss, fused_linear_cpo(x, w, target, b, beta=0.2, loss_type="hinge", chunk_size=14).loss)
    assert all(not getattr(out, name).requires_grad for name in AUX)
    with torch.no_grad():
        assert fused_linear_cpo(x, w, target, b).loss.grad_fn is None


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Every ``torch.empty``/``empty_like`` of a floating dtype comes NaN-filled: an output element (a
    sequence's sum, a row of dx, the logits buffer) that the pipeline fails to write shows as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


@pytest.mark.parametrize("chunk_size", [None, 14, 30])  # 3 pairs: one chunk, one pair each, 2 + 1
@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_every_output_written(poisoned_allocations, chunk_size, loss_type):
    x, w, b, target = make_inputs(n=3)
    nll_target = target.flip(1)
    out = check_against_reference(x, w, b, target, TOL[torch.float32], chunk_size=chunk_size, loss_type=loss_type, nll_target=nll_target)
    assert not any(torch.isnan(t).any() for t in out)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
@pytest.mark.parametrize("where", ["x", "weight", "bias"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_nan_propagates(where, loss_type):
    """A NaN in sequence 3's path (pair 1's rejected response) makes the loss NaN, that pair's rewards
    NaN, and the gradient NaN."""
    x, w, b, target = make_inputs()
    hit = target[3, 4].item()
    index = {"x": (3, 4, 0), "weight": (hit, 0), "bias": (hit,)}[where]
    with torch.no_grad():
        {"x": x, "weight": w, "bias": b}[where][index] = float("nan")
    out = fused_linear_cpo(x, w, target, b, loss_type=loss_type)
    assert torch.isnan(out.loss) and torch.isnan(out.rejected_rewards[1])
    if where == "x":
        assert not torch.isnan(out.chosen_rewards).any() and not torch.isnan(out.nll)
    assert torch.isnan(torch.autograd.grad(out.loss, w)[0]).any()


def bad_inputs():
    x, w, b, target = make_inputs()
    empty = target.clone()
    empty[2] = -100
    return [
        (dict(x=x[:3], target=target[:3]), ValueError, "odd batch"),
        (dict(target=empty), ValueError, "target has 1 sequence"),
        (dict(nll_target=torch.full_like(target, -100)), ValueError, "nll_target has no valid token"),
        (dict(nll_target=target[:, 1:]), ValueError, "nll_target must have shape"),
        (dict(loss_type="alphapo"), ValueError, "loss_type='simpo' with cpo_alpha=0.0"),
        (dict(loss_type="dpo"), ValueError, "loss_type must be one of"),
        (dict(loss_type="hinge", label_smoothing=0.1), ValueError, "label_smoothing=0.1 is read only by loss_type 'sigmoid' and 'simpo'"),
        (dict(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\]"),
        (dict(beta=-0.1), ValueError, "beta must be > 0"),
        (dict(cpo_alpha=float("inf")), TypeError, "cpo_alpha must be a finite"),
        (dict(simpo_gamma="0.5"), TypeError, "simpo_gamma must be a finite"),
        (dict(alpha=None), TypeError, "alpha must be a finite"),
        (dict(bias=b[1:]), ValueError, "bias must have shape"),
    ]


@pytest.mark.parametrize("change,error,match", bad_inputs())
def test_bad_inputs_name_the_argument(change, error, match):
    x, w, b, target = make_inputs()
    args = dict(x=x, weight=w, target=target, bias=b) | change
    with pytest.raises(error, match=match):
        fused_linear_cpo(**args)


def test_cpo_alpha_zero_skips_the_nll_target():
    """cpo_alpha = 0: no NLL, so an nll_target (even one with no valid token) is not read, as TRL never builds it."""
    x, w, b, target = make_inputs()
    out = fused_linear_cpo(x, w, target, b, cpo_alpha=0.0, nll_target=torch.full_like(target, -100))
    assert out.nll.item() == 0.0 and torch.equal(out.loss, fused_linear_cpo(x, w, target, b, cpo_alpha=0.0).loss)
