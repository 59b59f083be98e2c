"""Numerics at the edges: huge logits, softcap, zeros, p(chosen) → 1, NaN/inf, determinism.

Each loss against its reference (``kernels_lib.reference``) run in float64 on the same values. Where
the float32 problem is itself ill-conditioned (a log-prob near 0 computed as a difference of logits
of 1e4) the kernel's error is held to the float32 reference's own error on the same inputs (the
criterion of ``kernels_workbench.check``), with a factor ``BASELINE_FACTOR`` for summation order.

What the existing per-loss files already test is not repeated here: KL with exact zeros in the
target and NaN in either input, ORPO with a chosen average log-prob that rounds to exactly 0, NaN in
``x`` for every loss and in ``weight``/``bias`` for cross-entropy, NaN ``kl`` for KTO.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device, reference
from kernels_workbench.check import TOLERANCE, relative_error
from kernels_lib.fused_linear_cpo import fused_linear_cpo
from kernels_lib.fused_linear_cross_entropy import fused_linear_cross_entropy
from kernels_lib.fused_linear_dpo import fused_linear_dpo
from kernels_lib.fused_linear_kto import fused_linear_kto
from kernels_lib.fused_linear_orpo import fused_linear_orpo
from kernels_lib.kl_div import kl_div

DEVICE = default_device()
BASELINE_FACTOR = 4.0
# NaN and inf go through the interpreter's NumPy, which warns; the warnings are the point here.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def leaves(tensors, dtype=None):
    return [None if t is None else t.detach().to(DEVICE, dtype or t.dtype).requires_grad_() for t in tensors]


def loss_and_grads(fn, tensors, *args, **kwargs):
    """``fn(*tensors, *args, **kwargs)``: the loss (``.loss`` of a named tuple) and its gradients (upstream 1)."""
    out = fn(*tensors, *args, **kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    present = [t for t in tensors if t is not None]
    return out, loss, torch.autograd.grad(loss.sum(), present)


def assert_matches_reference(fn, ref_fn, tensors, *args, tolerance=TOLERANCE[torch.float32], **kwargs):
    """Finite loss and gradients, each within ``max(tolerance, BASELINE_FACTOR × float32 reference's error)``."""
    _, loss, got = loss_and_grads(fn, leaves(tensors), *args, **kwargs)
    _, want_loss, want = loss_and_grads(ref_fn, leaves(tensors, torch.float64), *args, **kwargs)
    _, base_loss, base = loss_and_grads(ref_fn, leaves(tensors, torch.float32), *args, **kwargs)
    assert torch.isfinite(loss).all() and all(torch.isfinite(g).all() for g in got)
    for name, out, ref, b in zip(("loss", "dx", "dW", "db"), (loss, *got), (want_loss, *want), (base_loss, *base)):
        error, base_error = relative_error(out, ref), relative_error(b, ref)
        limit = max(tolerance, BASELINE_FACTOR * base_error)
        assert error <= limit, f"{name}: error {error:.3g} > {limit:.3g} (float32 reference: {base_error:.3g})"


def huge_logit_inputs(lead=(5,), hidden=8, vocab=13, magnitude=1e4, bias=True, seed=0):
    """``x``, ``W``, ``b`` whose logits reach ``magnitude`` (scaled after the fact), targets random."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen)
    b = torch.randn(vocab, generator=gen) if bias else None
    x = x * (magnitude / (x @ w.t()).abs().max())
    target = torch.randint(0, vocab, lead, generator=gen)
    return x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), target.to(DEVICE)


def flce_calls(target, **options):
    """Kernel and reference as functions of ``(x, weight, bias)``."""
    return (
        lambda x, w, b: fused_linear_cross_entropy(x, w, target, b, **options),
        lambda x, w, b: reference.fused_linear_cross_entropy(x, w, target, b, **options),
    )


def orpo_calls(target, **options):
    return (
        lambda x, w, b=None: fused_linear_orpo(x, w, target, b, **options),
        lambda x, w, b=None: reference.fused_linear_orpo(x, w, target, b, **options),
    )


# --------------------------------------------------------------------------- logits of 1e4


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "options", [{}, {"label_smoothing": 0.1}, {"z_loss_scale": 1e-4}, {"chunk_size": 2}], ids=["plain", "smoothing", "z-loss", "chunks"]
)
def test_cross_entropy_logits_of_1e4(reduction, options):
    x, w, b, target = huge_logit_inputs()
    target[1] = -100
    assert_matches_reference(*flce_calls(target, reduction=reduction, **options), [x, w, b])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cross_entropy_logits_of_1e4_half(dtype):
    """16-bit inputs (fp16 holds 1e4: its largest finite value is 65504): finite, and as close as their
    rounding allows. That floor depends on the device: on CUDA the logits chunk is a 16-bit matmul,
    so logits of 1e4 carry the 16-bit rounding (an absolute ~1e4·2^-9 in bf16), as the baseline's
    do; in the interpreter the matmuls run in float32. So the bound is ``BASELINE_FACTOR`` × the
    error of the baseline on the same 16-bit inputs (logits as a model forms them), or the tolerance,
    whichever is larger: on CPU that is the float32 tolerance, on CUDA the baseline's rounding."""
    x, w, b, target = huge_logit_inputs(bias=False)
    x, w = x.to(dtype), w.to(dtype)
    _, loss, grads = loss_and_grads(fused_linear_cross_entropy, leaves([x, w]), target)
    _, ref, ref_grads = loss_and_grads(reference.fused_linear_cross_entropy, leaves([x, w], torch.float64), target)
    _, base, base_grads = loss_and_grads(reference.fused_linear_cross_entropy, leaves([x, w]), target)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    loss_limit = max(TOLERANCE[torch.float32], BASELINE_FACTOR * relative_error(base, ref))
    assert relative_error(loss, ref) <= loss_limit, (relative_error(loss, ref), loss_limit)
    for name, g, r, bg in zip(("dx", "dW"), grads, ref_grads, base_grads):
        limit = max(TOLERANCE[dtype], BASELINE_FACTOR * relative_error(bg, r))
        assert relative_error(g, r) <= limit, f"{name}: {relative_error(g, r):.3g} > {limit:.3g}"


def test_kl_div_log_probabilities_of_minus_1e4():
    """Log-probabilities down to -1e4 (classes the model rules out) and targets that give them mass."""
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 9, generator=gen) * 1e4).log_softmax(-1).to(DEVICE)
    t = torch.randn(4, 9, generator=gen).softmax(-1).to(DEVICE)
    assert x.min() < -1e4
    for reduction in ("none", "sum", "mean", "batchmean"):
        assert_matches_reference(kl_div, reference.kl_div, [x], t, reduction=reduction)


def test_orpo_logits_of_1e4():
    x, w, b, _ = huge_logit_inputs(lead=(4, 3))
    target = torch.randint(0, 13, (4, 3), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert_matches_reference(*orpo_calls(target, beta=0.5), [x, w, b])


def test_kto_logits_of_1e4():
    x, w, b, _ = huge_logit_inputs(lead=(4, 3))
    target = torch.randint(0, 13, (4, 3), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    labels = torch.tensor([True, False, False, True], device=DEVICE)
    ref_logps = torch.tensor([-2e4, -1e4, -3e4, -5.0], device=DEVICE)
    for beta in (0.1, 1e-4):  # saturated sigmoids (gradient ~0), and unsaturated at this scale
        assert_matches_reference(
            lambda x_, w_, b_: fused_linear_kto(x_, w_, target, labels, 0.5, bias=b_, ref_logps=ref_logps, beta=beta),
            lambda x_, w_, b_: reference.fused_linear_kto(x_, w_, target, labels, 0.5, bias=b_, ref_logps=ref_logps.double(), beta=beta),
            [x, w, b],
        )


# --------------------------------------------------------------------------- softcap


@pytest.mark.parametrize("softcap", [1.0, 30.0])
@pytest.mark.parametrize("magnitude", [1e2, 1e4])
def test_softcap_with_large_logits(softcap, magnitude):
    """tanh saturates: the capped logits sit at ±s and the slope 1 - tanh² is tiny; the kernel forms it as
    4e/(1+e)², not 1 - (c/s)², which cancelled (1.1e-4 error in dx at 1e4, twice torch's float32 error)."""
    x, w, b, target = huge_logit_inputs(magnitude=magnitude)
    for reduction in ("mean", "none"):
        assert_matches_reference(*flce_calls(target, softcap=softcap, reduction=reduction, label_smoothing=0.1), [x, w, b])


def test_softcap_bounds_the_loss():
    """With cap s every capped logit is in [-s, s], so a row's loss is at most 2s + log V, whatever the logits."""
    x, w, b, target = huge_logit_inputs(magnitude=1e4)
    loss = fused_linear_cross_entropy(x.to(DEVICE), w.to(DEVICE), target, b.to(DEVICE), softcap=5.0, reduction="none")
    assert torch.all(loss <= 2 * 5.0 + math.log(13)) and torch.all(loss >= 0)


# --------------------------------------------------------------------------- KL: zeros meeting -inf


def test_kl_div_zero_target_meeting_minus_inf_input_is_nan_as_in_torch():
    """A class with target 0 and log-prob -inf: torch gives 0·(-inf) = NaN (xlogy(0, 0) - 0·x); so does kl_div.
    Deliberately torch's semantics: mask such classes out of ``input`` (e.g. with a finite floor) first."""
    x = torch.randn(2, 6, device=DEVICE).log_softmax(-1)
    t = torch.randn(2, 6, device=DEVICE).softmax(-1)
    x[0, 2], t[0, 2] = -math.inf, 0.0
    for reduction in ("sum", "batchmean"):
        assert torch.isnan(F.kl_div(x, t, reduction=reduction)) and torch.isnan(kl_div(x, t, reduction=reduction))
    pointwise = kl_div(x, t, reduction="none")
    assert torch.isnan(pointwise[0, 2]) and torch.isfinite(pointwise[1]).all()


def test_kl_div_log_target_of_minus_inf_is_nan_as_in_torch():
    """``log_target=True`` with t = -inf (probability 0): e^t·(t - x) = 0·(-inf) = NaN in torch and here."""
    x = torch.randn(2, 6, device=DEVICE).log_softmax(-1)
    t = torch.randn(2, 6, device=DEVICE).log_softmax(-1)
    t[1, 4] = -math.inf
    assert torch.isnan(F.kl_div(x, t, reduction="sum", log_target=True))
    assert torch.isnan(kl_div(x, t, reduction="sum", log_target=True))


# --------------------------------------------------------------------------- ORPO: p(chosen) → 1


def confident_orpo_inputs(chosen_logp: float, rejected_logp: float, seq=3, vocab=8):
    """One pair whose every valid token has log-prob ``chosen_logp`` (chosen) or ``rejected_logp``
    (rejected): ``x`` one-hot scaled so that the target's logit leads the others by the needed margin."""
    target = torch.tensor([[1, 4, -100], [2, 5, 6]], device=DEVICE)[:, :seq]
    x = torch.zeros(2, seq, vocab)
    for row, logp in ((0, chosen_logp), (1, rejected_logp)):
        # log p = -log(1 + (V-1) e^{-margin})  =>  margin = log(V-1) - log(expm1(-log p))
        margin = math.log(vocab - 1) - math.log(math.expm1(-logp))
        for t in range(seq):
            if target[row, t] >= 0:
                x[row, t, target[row, t]] = margin
    return x.to(DEVICE), torch.eye(vocab, device=DEVICE), target


@pytest.mark.parametrize("chosen_logp", [-1e-2, -1e-4, -1e-6], ids=lambda v: f"chosen{v:g}")
def test_orpo_chosen_probability_near_one(chosen_logp):
    """log1mexp(a) near a = 0 (p(chosen) → 1 but not rounded to 1): finite loss and gradients, as exact
    as float32 logits allow (the float32 reference's own error), with the log-odds → +∞ side of logσ."""
    x, w, target = confident_orpo_inputs(chosen_logp, -2.0)
    out = fused_linear_orpo(x.to(DEVICE), w.to(DEVICE), target)
    assert out.chosen_logps.item() == pytest.approx(chosen_logp, rel=0.05)
    assert_matches_reference(*orpo_calls(target), [x, w])


@pytest.mark.parametrize("rejected_logp", [-1e-2, -1e-4], ids=lambda v: f"rejected{v:g}")
def test_orpo_rejected_probability_near_one(rejected_logp):
    """The other side: p(rejected) → 1 drives the log-odds to -∞ and logσ with it: a large, finite loss."""
    x, w, target = confident_orpo_inputs(-1.0, rejected_logp)
    out = fused_linear_orpo(x.to(DEVICE), w.to(DEVICE), target)
    # log-odds ≈ log|a_r| + O(1) → -∞, so the odds-ratio term β·(-logσ) grows as β·log(1/|a_r|).
    assert (out.loss - out.nll).item() > 0.1 * (-math.log(-rejected_logp) - 2)
    assert_matches_reference(*orpo_calls(target), [x, w])


def test_orpo_both_near_one():
    """Every token near-certain: ORPO's weight 1/(1 - e^a) ~ 1/|a| magnifies any absolute error in
    1 - p_y (it was 3% of dx while 1 - p_y came from the rounded lse; -expm1(log p) fixed it)."""
    x, w, target = confident_orpo_inputs(-1e-5, -1e-3)
    assert_matches_reference(*orpo_calls(target, beta=1.0), [x, w])


# --------------------------------------------------------------------------- NaN and inf propagate


def small_inputs(lead=(4, 3), hidden=5, vocab=7, seed=3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen)
    b = torch.randn(vocab, generator=gen)
    target = torch.randint(0, vocab, lead, generator=gen)
    return x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), target.to(DEVICE)


def poisoned(tensors: dict, name: str, value: float, index=0) -> dict:
    tensors = {k: v.clone() for k, v in tensors.items()}
    tensors[name].view(-1)[index] = value
    return tensors


@pytest.mark.parametrize("value", [math.inf, -math.inf], ids=["+inf", "-inf"])
@pytest.mark.parametrize("where", ["x", "weight", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_inf_gives_non_finite_loss(where, value, reduction):
    x, w, b, target = small_inputs()
    t = poisoned({"x": x, "weight": w, "bias": b}, where, value)
    loss = fused_linear_cross_entropy(t["x"], t["weight"], target, t["bias"], reduction=reduction)
    ref = reference.fused_linear_cross_entropy(t["x"].double(), t["weight"].double(), target, t["bias"].double(), reduction=reduction)
    assert not torch.isfinite(ref) and not torch.isfinite(loss), (loss, ref)


@pytest.mark.parametrize("skip_ignored", [True, False], ids=["ignored-dropped", "ignored-kept"])
def test_cross_entropy_nan_in_an_ignored_row_stays_out_of_the_loss_as_in_torch(skip_ignored):
    """An ignored row counts nowhere, in torch as here: its NaN leaves the loss finite. Kept in the matmuls
    (``skip_ignored=False``), dW = dzᵀx still multiplies its 0 by NaN: the gradient shows it, as torch's does;
    dropped before the matmuls (the default), it reaches nothing."""
    x, w, b, target = small_inputs()
    target[1, 2] = -100
    x = poisoned({"x": x}, "x", math.nan, index=(1 * 3 + 2) * 5)["x"]
    _, loss, (dx, dw) = loss_and_grads(fused_linear_cross_entropy, leaves([x, w]), target, skip_ignored=skip_ignored)
    _, ref, (ref_dx, ref_dw) = loss_and_grads(reference.fused_linear_cross_entropy, leaves([x, w], torch.float64), target)
    assert torch.isfinite(ref) and torch.isfinite(loss)
    assert relative_error(loss, ref) < TOLERANCE[torch.float32]
    assert torch.isnan(ref_dw).any()
    assert torch.isnan(dw).any() != skip_ignored, "a dropped row's NaN must reach no gradient; a kept one's dW, as torch's"
    assert torch.isfinite(dx[target != -100]).all()


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["weight", "bias"])
def test_orpo_non_finite_head_gives_non_finite_loss(where, value):
    x, w, b, target = small_inputs()
    t = poisoned({"weight": w, "bias": b}, where, value, index=target[0, 0].item() * (5 if where == "weight" else 1))
    out = fused_linear_orpo(x.to(DEVICE), t["weight"], target, t["bias"])
    ref = reference.fused_linear_orpo(x.double(), t["weight"].double(), target, t["bias"].double())
    assert not torch.isfinite(ref.loss) and not torch.isfinite(out.loss)


@pytest.mark.parametrize(
    "where, value",
    [("x", math.nan), ("weight", math.nan), ("bias", math.nan), ("ref_x", math.nan), ("ref_weight", math.nan), ("ref_logps", math.nan)],
)
def test_kto_nan_gives_nan_loss(where, value):
    """KTO's reference (TRL) takes a nanmean: a NaN example would be dropped silently there, never here."""
    out, _ = kto_poisoned(where, value)
    assert torch.isnan(out.loss), out


@pytest.mark.parametrize("where", ["x", "weight", "ref_x", "ref_weight", "ref_logps"])
@pytest.mark.parametrize("value", [math.inf, -math.inf], ids=["+inf", "-inf"])
def test_kto_inf_as_the_reference(where, value):
    """An infinite input gives NaN where it meets a logit of the other sign (inf - inf), or a log-ratio of
    ±inf that the sigmoid saturates: 1 - σ(±inf) is 0 or 1, a finite loss that is the right limit. Either
    way the same as the float64 reference, never a finite loss where the reference has none."""
    out, want = kto_poisoned(where, value)
    assert torch.isfinite(out.loss) == torch.isfinite(want.loss), (out.loss, want.loss)
    if torch.isfinite(want.loss):
        assert relative_error(out.loss, want.loss) < TOLERANCE[torch.float32]


def kto_poisoned(where, value):
    """KTO with ``value`` at one element of ``where`` (on the first token's target row for a head): kernel and float64 reference."""
    x, w, b, target = small_inputs()
    labels = torch.tensor([True, False, True, False], device=DEVICE)
    index = {"weight": target[0, 0].item() * 5, "ref_weight": target[0, 0].item() * 5, "bias": target[0, 0].item()}.get(where, 0)
    tensors = {"x": x, "weight": w, "bias": b, "ref_x": x * 0.5, "ref_weight": w, "ref_logps": torch.full((4,), -5.0, device=DEVICE)}
    t = poisoned(tensors, where, value, index)
    ref_args = {"ref_logps": t["ref_logps"]} if where == "ref_logps" else {"ref_x": t["ref_x"], "ref_weight": t["ref_weight"]}
    out = fused_linear_kto(t["x"], t["weight"], target, labels, bias=t["bias"], **ref_args)
    want = reference.fused_linear_kto(
        t["x"].double(), t["weight"].double(), target, labels, bias=t["bias"].double(), **{k: v.double() for k, v in ref_args.items()}
    )
    return out, want


@pytest.mark.parametrize("value", [math.inf, -math.inf], ids=["+inf", "-inf"])
def test_kl_div_inf_input_gives_non_finite_loss(value):
    x = torch.randn(3, 5, device=DEVICE).log_softmax(-1)
    t = torch.randn(3, 5, device=DEVICE).softmax(-1)
    x[1, 1] = value
    for reduction in ("sum", "mean", "batchmean"):
        loss = kl_div(x, t, reduction=reduction)
        ref = reference.kl_div(x.double(), t.double(), reduction=reduction)
        assert not torch.isfinite(loss) and not torch.isfinite(ref)
        assert torch.sign(loss) == torch.sign(ref)  # -inf input: +inf loss; +inf input: -inf loss


# --------------------------------------------------------------------------- determinism


def _run_twice(fn):
    first, second = fn(), fn()
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b) or (torch.isnan(a).any() and torch.equal(a.nan_to_num(), b.nan_to_num()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_kl_div(dtype):
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)).log_softmax(-1).to(DEVICE, dtype)
    t = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)).softmax(-1).to(DEVICE, dtype)

    def run():
        out = []
        for reduction in ("none", "sum", "batchmean"):
            (leaf,) = leaves([x])
            loss = kl_div(leaf, t, reduction=reduction)
            loss.sum().backward()
            out += [loss.detach(), leaf.grad]
        return out

    _run_twice(run)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_deterministic_cross_entropy(dtype, reduction):
    x, w, b, target = small_inputs(lead=(3, 7), hidden=16, vocab=33)
    target[0, :3] = -100

    def run():
        tensors = leaves([x, w, b], dtype)
        loss = fused_linear_cross_entropy(
            *tensors[:2], target, tensors[2], reduction=reduction, chunk_size=5, label_smoothing=0.1, z_loss_scale=1e-3, softcap=3.0
        )
        loss.sum().backward()
        return [loss.detach()] + [t.grad for t in tensors]

    _run_twice(run)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_orpo_and_kto(dtype):
    x, w, b, target = small_inputs(lead=(4, 5), hidden=16, vocab=33)
    labels = torch.tensor([True, False, False, True], device=DEVICE)
    ref = {"ref_x": x.to(DEVICE, dtype) * 0.5, "ref_weight": w.to(DEVICE, dtype)}

    def run():
        out = []
        for loss_fn in (
            lambda xs, ws, bs: fused_linear_orpo(xs, ws, target, bs, chunk_size=10, nll_target=target.flip(1)),
            lambda xs, ws, bs: fused_linear_kto(xs, ws, target, labels, 0.1, bias=bs, chunk_size=5, **ref),
        ):
            tensors = leaves([x, w, b], dtype)
            result = loss_fn(*tensors)
            result.loss.backward()
            out += [t.detach() for t in result] + [t.grad for t in tensors]
        return out

    _run_twice(run)


# --------------------------------------------------------------------------- DPO, CPO and SimPO


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "apo_down"])
def test_dpo_logits_of_1e4(loss_type):
    """Log-probs of -1e4 (sums to -3e4): the log-ratios are differences of such sums; with β small the
    terms are unsaturated at that scale, with β = 0.1 saturated (gradient ~0), both as the reference."""
    x, w, b, _ = huge_logit_inputs(lead=(4, 3))
    target = torch.randint(0, 13, (4, 3), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ref_logps = torch.tensor([-2e4, -1e4, -3e4, -5.0], device=DEVICE)
    for beta in (0.1, 1e-4):
        options = dict(ref_logps=ref_logps, beta=beta, loss_type=loss_type)
        assert_matches_reference(
            lambda x_, w_, b_: fused_linear_dpo(x_, w_, target, b_, **options),
            lambda x_, w_, b_: reference.fused_linear_dpo(x_, w_, target, b_, **(options | {"ref_logps": ref_logps.double()})),
            [x, w, b],
        )


@pytest.mark.parametrize("options", [dict(loss_type="sigmoid"), dict(loss_type="simpo", beta=2.0), dict(loss_type="hinge", beta=1e-4),
                                     dict(loss_type="simpo", alpha=1e-3, cpo_alpha=0.0)])
def test_cpo_logits_of_1e4(options):
    x, w, b, _ = huge_logit_inputs(lead=(4, 3))
    target = torch.randint(0, 13, (4, 3), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    assert_matches_reference(
        lambda x_, w_, b_: fused_linear_cpo(x_, w_, target, b_, **options),
        lambda x_, w_, b_: reference.fused_linear_cpo(x_, w_, target, b_, **options),
        [x, w, b],
    )


@pytest.mark.parametrize("where", ["x", "weight", "ref_logps_chosen", "ref_logps_rejected"])
@pytest.mark.parametrize("value", [math.inf, -math.inf], ids=["+inf", "-inf"])
def test_dpo_inf_as_the_reference(where, value):
    """An infinite input gives NaN where it meets a logit of the other sign, or a log-ratio of ±inf that
    logσ saturates to a finite loss (the right limit) or to +inf: the same as the float64 reference."""
    x, w, b, target = small_inputs()
    ref_logps = torch.tensor([-5.0, -6.0, -7.0, -8.0], device=DEVICE)
    tensors = {"x": x, "weight": w, "ref_logps_chosen": ref_logps, "ref_logps_rejected": ref_logps}
    index = {"x": 0, "weight": target[0, 0].item() * 5, "ref_logps_chosen": 0, "ref_logps_rejected": 2}[where]
    t = poisoned(tensors, where, value, index)
    ref = t["ref_logps_chosen"] if where == "ref_logps_chosen" else t["ref_logps_rejected"]
    out = fused_linear_dpo(t["x"], t["weight"], target, b, ref_logps=ref)
    want = reference.fused_linear_dpo(t["x"].double(), t["weight"].double(), target, b.double(), ref_logps=ref.double())
    assert torch.isfinite(out.loss) == torch.isfinite(want.loss), (out.loss, want.loss)
    assert torch.isnan(out.loss) == torch.isnan(want.loss), (out.loss, want.loss)
    if torch.isfinite(want.loss):
        assert relative_error(out.loss, want.loss) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_dpo_cpo_simpo(dtype):
    x, w, b, target = small_inputs(lead=(4, 5), hidden=16, vocab=33)
    ref = {"ref_x": x.to(DEVICE, dtype) * 0.5, "ref_weight": w.to(DEVICE, dtype)}

    def run():
        out = []
        for loss_fn in (
            lambda xs, ws, bs: fused_linear_dpo(xs, ws, target, bs, chunk_size=10, loss_type=["sigmoid", "sft"], **ref),
            lambda xs, ws, bs: fused_linear_cpo(xs, ws, target, bs, chunk_size=10, nll_target=target.flip(1)),
            lambda xs, ws, bs: fused_linear_cpo(xs, ws, target, bs, chunk_size=5, loss_type="simpo", alpha=0.2),
        ):
            tensors = leaves([x, w, b], dtype)
            result = loss_fn(*tensors)
            result.loss.backward()
            out += [t.detach() for t in result] + [t.grad for t in tensors]
        return out

    _run_twice(run)
