"""Property tests: every loss against its reference (``kernels_lib.reference``) on float64 copies.

Hypothesis draws the shapes (V = 1, odd V and H, N = 1, leading dims), the ignored positions (none,
some, or every one), every option and reduction, the dtype (float32, bfloat16, float16) and the
upstream gradient; each example compares the loss, the auxiliary outputs and every gradient with the
reference run in float64 on the very values the kernel saw (16-bit inputs upcast exactly).

Sizes stay tiny: on a machine without a GPU the kernels run in Triton's interpreter. Examples are
derandomized (the same draws on every run: CI cannot flake) with budgets that keep this file near
a minute here (about 45 s: KL 150 examples, cross-entropy 250, ORPO 120, KTO 120; then DPO 80 and
CPO/SimPO 80, about 20 s more).

Tolerances, on ``||out - ref|| / ||ref||`` (``kernels_workbench.check.relative_error``), per output:
the larger of a floor and ``BASELINE_FACTOR`` times the error of the reference itself run in the
kernel's arithmetic (float32 on CPU; the matmul dtype on CUDA), i.e. the problem's own conditioning.

- Floors. float32: ``TOLERANCE[float32] = 1e-5``; both sides accumulate in float32 over at most a
  few hundred terms here (observed ~1e-7). bfloat16 / float16 gradients are rounded once to the
  input dtype (unit roundoff u = 2^-8 and 2^-11): ``TOLERANCE`` allows 4u (one rounding is at most
  1u per element, less in norm). ``dW``/``db`` accumulated across chunks in the parameter dtype
  (``accurate=False``, the default) take one rounding of the running sum per chunk, and that sum
  can exceed the final one (the chunks' contributions cancel): ``4u·Σ_k ||S_k|| / ||result||`` over
  the partial sums ``S_k``, computed from the float64 reference's ``dz`` (:func:`lean_floors`), the
  documented price of the lean mode. Losses and auxiliaries are float32
  (from float32 arithmetic) whatever the input dtype: the float32 floor; KL's loss is in the
  promoted input dtype: that dtype's floor.
- The conditioning term: a log-prob near 0 computed as ``z_y - lse`` (or ``lse`` of a row whose
  largest logit dominates) loses digits to cancellation in float32 whoever computes it: the
  float32 reference shows the same 1e-5..1e-4 relative errors. ``BASELINE_FACTOR = 4`` leaves room
  for a different summation order, while a wrong term (a missing factor, a wrong row) is off by O(1).

Deliberate differences from the references, asserted rather than compared:

- cross-entropy, ``reduction="mean"`` with every target ignored: kernels_lib gives 0 with zero
  gradients, torch 0/0 = NaN (stated in ``fused_linear_cross_entropy``'s docstring).
- ORPO with V = 1: every log-prob is exactly 0, ``log1mexp(0) = -inf`` and the log-odds are
  ``-inf - (-inf)``: NaN in both (and in TRL); the loss is undefined there.
- ORPO, KTO, DPO and CPO refuse a sequence without a valid token (tested in their own files), where
  the references would give 0/0 (or, summing, a silent 0); so the drawn masks keep one valid token
  per sequence.
- DPO and CPO's ``dW``/``db`` floors also hold the cancellation of their row sums
  (:func:`cancellation_floors`): at V = 2 every row's ``dz`` is ``[a, -a]`` and ``db`` can be
  1e-3 of the terms it sums, where float32 loses digits whoever sums it.
- DPO and CPO's ``reward_accuracies`` (``chosen_reward > rejected_reward``) is a step function: at a
  near-tie float32 and float64 may land on either side, so it is checked against the kernel's own
  margins (``accuracy == (margin > 0)``) rather than compared.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device, reference
from kernels_lib._sequence_logprobs import chunk_rows
from kernels_workbench.check import TOLERANCE, relative_error
from kernels_lib.fused_linear_cpo import LOSS_TYPES as CPO_LOSS_TYPES
from kernels_lib.fused_linear_cpo import fused_linear_cpo
from kernels_lib.fused_linear_cross_entropy import default_chunk_size, fused_linear_cross_entropy, matmul_dtype
from kernels_lib.fused_linear_dpo import F_DIVERGENCE_LOSS_TYPES, F_DIVERGENCES, LENGTH_NORMALIZED_LOSS_TYPES
from kernels_lib.fused_linear_dpo import LOSS_TYPES as DPO_LOSS_TYPES
from kernels_lib.fused_linear_dpo import fused_linear_dpo
from kernels_lib.fused_linear_kto import fused_linear_kto
from kernels_lib.fused_linear_orpo import fused_linear_orpo
from kernels_lib.kl_div import kl_div

DEVICE = default_device()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BASELINE_FACTOR = 4.0
#: The unit roundoff of each dtype the floors reason about.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
GRADS = ("dx", "dW", "db")

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def examples(n: int) -> int:
    """``n`` examples on a GPU (the GPU target runs them all); half on a CPU, where Triton's interpreter runs each
    kernel about a hundred times slower, so that the suite keeps its time. The examples are derandomized: the CPU's
    are the first half of the GPU's."""
    return n if torch.cuda.is_available() else max(20, n // 2)


@contextmanager
def captured_logits():
    """Collect the logits the reference materializes (those that take a gradient), to read ``dz`` off them."""
    seen, original = [], reference._reference_logits

    def capture(x, weight, bias):
        logits = original(x, weight, bias)
        if logits.requires_grad:
            seen.append(logits)
        return logits

    reference._reference_logits = capture
    try:
        yield seen
    finally:
        reference._reference_logits = original


def lean_floors(dtype, accurate: bool, dz: torch.Tensor, x: torch.Tensor, chunk_of_row: torch.Tensor, want: dict) -> dict:
    """Floors of ``dW``/``db``: one rounding per output, or, accumulated across chunks in the parameter
    dtype (``accurate=False``), one rounding of the running sum per chunk: ``4u·Σ_k ||S_k||`` in norm
    for the partial sums ``S_k`` after chunk ``k`` (from the float64 ``dz``), relative to the result."""
    floors = {"dW": TOLERANCE[dtype], "db": TOLERANCE[dtype]}
    if accurate or dtype == torch.float32:
        return floors
    dz = dz.reshape(-1, dz.shape[-1])
    x, chunk_of_row = x.reshape(-1, x.shape[-1]).to(dz.device, torch.float64), chunk_of_row.to(dz.device)
    partial_w, partial_b, total_w, total_b = 0.0, 0.0, 0.0, 0.0
    for chunk in torch.unique(chunk_of_row):
        rows = chunk_of_row.reshape(-1) == chunk
        partial_w = partial_w + dz[rows].t() @ x[rows]
        partial_b = partial_b + dz[rows].sum(0)
        total_w, total_b = total_w + partial_w.norm().item(), total_b + partial_b.norm().item()
    for name, total in (("dW", total_w), ("db", total_b)):
        if name in want and want[name].norm() > 0:
            floors[name] = max(floors[name], TOLERANCE[dtype] * total / want[name].norm().item())
    return floors


def leaves(tensors, dtype):
    """Fresh leaves of ``dtype`` that take gradients (None stays None)."""
    return [None if t is None else t.detach().to(DEVICE, dtype).requires_grad_() for t in tensors]


def evaluate(call, tensors, upstream, names=GRADS, logits=None) -> dict:
    """``call(*tensors)`` -> dict of outputs, plus the gradients of its ``loss`` under ``upstream``, by
    ``names`` (and ``dz``, the gradient of the logits the reference made, when ``logits`` collects them)."""
    outputs = call(*tensors)
    loss = outputs["loss"]
    present = [t for t in tensors if t is not None]
    logits = [] if logits is None else logits
    got = iter(torch.autograd.grad(loss, present + logits, upstream.to(loss.device, loss.dtype)))
    for name, t in zip(names, tensors):
        if t is not None:
            outputs[name] = next(got)
            assert outputs[name].dtype == t.dtype and outputs[name].shape == t.shape, name
    dz = list(got)  # the gradient of the policy's logits, made once by the reference
    return (outputs, dz[0]) if dz else outputs


def compare(got: dict, want: dict, baseline: dict, floors: dict, case) -> None:
    """Each output of ``got`` within its tolerance of the float64 ``want``: the largest of its floor,
    and ``BASELINE_FACTOR`` times the error of ``want`` rounded to the output's dtype or of ``baseline``."""
    bad = {}
    for name, out in got.items():
        ref = want[name]
        assert out.shape == ref.shape, (name, case)
        if ref.numel() == 0:
            continue
        error = relative_error(out, ref)
        # What the output's dtype can hold at best (the reference correctly rounded: subnormal
        # float16 gradients lose digits), and what the reference's own arithmetic gets.
        best = relative_error(ref.to(out.dtype), ref)
        base_error = relative_error(baseline[name], ref)
        tolerance = max(floors[name], BASELINE_FACTOR * best, 0.0 if math.isnan(base_error) else BASELINE_FACTOR * base_error)
        if math.isnan(error) or error > tolerance:
            bad[name] = (error, tolerance)
    assert not bad, f"{case}: (error, tolerance) {bad}"


def run_three(call, tensors, dtype, upstream, names=GRADS):
    """The kernel's call in ``dtype``, the reference's on float64 copies and in the kernel's arithmetic,
    and the float64 gradient of the reference's logits (None where it makes none)."""
    kernel, ref = call
    tensors = [None if t is None else t.to(dtype) for t in tensors]  # the values the kernel sees, for all three
    got = evaluate(kernel, leaves(tensors, dtype), upstream, names)
    with captured_logits() as logits:
        want = evaluate(ref, leaves(tensors, torch.float64), upstream, names, logits)
    want, dz = want if isinstance(want, tuple) else (want, None)
    baseline = evaluate(ref, leaves(tensors, matmul_dtype(dtype)), upstream, names)
    return got, want, baseline, dz


def valid_mask(gen, shape, fraction):
    """A random mask of valid positions with at least one per row."""
    mask = torch.rand(shape, generator=gen) >= fraction
    mask[torch.arange(shape[0]), torch.randint(0, shape[1], (shape[0],), generator=gen)] = True
    return mask


# --------------------------------------------------------------------------- KL divergence


@st.composite
def kl_cases(draw):
    ndim = draw(st.integers(1, 3))
    return dict(
        shape=tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim))),
        reduction=draw(st.sampled_from(["none", "sum", "mean", "batchmean"])),
        log_target=draw(st.booleans()),
        input_dtype=draw(st.sampled_from(DTYPES)),
        target_dtype=draw(st.sampled_from(DTYPES)),
        zeros=draw(st.booleans()),  # exact zeros in a probability target (0 log 0 = 0)
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=examples(150), **SETTINGS)
@given(kl_cases())
def test_kl_div_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    shape, log_target, reduction = case["shape"], case["log_target"], case["reduction"]
    input = torch.randn(shape, generator=gen).log_softmax(-1).to(case["input_dtype"])
    target = (torch.randn(shape, generator=gen) * 2).log_softmax(-1)
    if not log_target:
        target = target.exp()
        if case["zeros"]:
            target = torch.where(torch.rand(shape, generator=gen) < 0.3, 0.0, target)
    target = target.to(DEVICE, case["target_dtype"])
    out_dtype = torch.promote_types(case["input_dtype"], case["target_dtype"])
    # Rounded to the loss dtype first, as autograd rounds a user's upstream gradient.
    upstream = (torch.rand(shape if reduction == "none" else (), generator=gen) + 0.5).to(out_dtype).double()

    def call(fn):
        return lambda x: {"loss": fn(x, target.to(torch.promote_types(x.dtype, target.dtype)), reduction=reduction, log_target=log_target)}

    got, want, baseline, _ = run_three((call(kl_div), call(reference.kl_div)), [input], input.dtype, upstream, ["dinput"])
    assert got["loss"].dtype == out_dtype
    compare(got, want, baseline, {"loss": TOLERANCE[out_dtype], "dinput": TOLERANCE[input.dtype]}, case)


# --------------------------------------------------------------------------- cross-entropy


@st.composite
def flce_cases(draw):
    ndim = draw(st.integers(1, 3))
    lead = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    return dict(
        lead=lead,
        hidden=draw(st.sampled_from([1, 2, 3, 5, 8, 9])),
        vocab=draw(st.sampled_from([1, 2, 3, 5, 8, 13, 17])),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0])),
        z_loss_scale=draw(st.sampled_from([0.0, 0.0, 1e-3, 0.1])),
        softcap=draw(st.sampled_from([None, None, 0.7, 3.0])),
        ignore_index=draw(st.sampled_from([-100, -1, 0])),  # 0: a real class used as the ignore value
        ignored=draw(st.sampled_from(["none", "some", "all"])),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, math.prod(lead)))),
        accurate=draw(st.booleans()),
        return_z_loss=draw(st.booleans()),
        scale=draw(st.sampled_from([0.5, 3.0])),  # logit magnitude
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=examples(250), **SETTINGS)
@given(flce_cases())
def test_fused_linear_cross_entropy_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    lead, hidden, vocab, dtype = case["lead"], case["hidden"], case["vocab"], case["dtype"]
    ignore_index = case["ignore_index"]
    x = torch.randn(*lead, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * case["scale"]
    b = torch.randn(vocab, generator=gen) if case["bias"] else None
    target = torch.randint(0, vocab, lead, generator=gen)
    if vocab == 1 and case["z_loss_scale"]:
        # V = 1: the cross-entropy gradient p - (1 - ε) - ε/V is 0 but for the rounding of 1 - ε and
        # ε (2e-8 at ε = 0.1), while the true gradient is the z-loss's alone, 2λ·lse, possibly ~1e-6:
        # an absolute float32 error, meaningless as a relative one. Smoothing a single class is moot.
        case = {**case, "label_smoothing": 0.0}
    if ignore_index >= 0:  # the ignore value is a class: move the other targets off it
        assume(vocab > 1)
        target = torch.where(target == ignore_index, 1, target)
    if case["ignored"] == "some":
        target = torch.where(torch.rand(lead, generator=gen) < 0.4, ignore_index, target)
    elif case["ignored"] == "all":
        target = torch.full(lead, ignore_index)
    target = target.to(DEVICE)
    options = {k: case[k] for k in ("ignore_index", "reduction", "label_smoothing", "z_loss_scale", "softcap", "chunk_size", "accurate")}
    upstream = torch.rand(lead if case["reduction"] == "none" else (), generator=gen, dtype=torch.float64) + 0.5

    def call(fn):
        def run(x_, w_, b_):
            loss, z_loss = fn(x_, w_, target, b_, return_z_loss=True, **options)
            return {"loss": loss, "z_loss": z_loss} if case["return_z_loss"] else {"loss": loss}
        return run

    if case["reduction"] == "mean" and bool((target == ignore_index).all()):
        # Deliberate difference: torch's mean is 0/0 = NaN; ours is 0 with zero gradients.
        got = evaluate(call(fused_linear_cross_entropy), leaves([x, w, b], dtype), upstream)
        assert all(torch.all(t == 0) for t in got.values()), case
        return
    functions = (call(fused_linear_cross_entropy), call(reference.fused_linear_cross_entropy))
    got, want, baseline, dz = run_three(functions, [x, w, b], dtype, upstream)
    assert got["loss"].dtype == torch.float32 and got["loss"].shape == (lead if case["reduction"] == "none" else ())
    n = math.prod(lead)
    chunk_of_row = torch.arange(n) // (case["chunk_size"] or default_chunk_size(n, hidden))
    floors = {"loss": TOLERANCE[torch.float32], "z_loss": TOLERANCE[torch.float32], "dx": TOLERANCE[dtype]}
    floors |= lean_floors(dtype, case["accurate"], dz, x.to(dtype), chunk_of_row, want)
    floors["loss"] = max(floors["loss"], loss_cancellation_floor(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype), target, case))
    compare(got, want, baseline, floors, case)


def loss_cancellation_floor(x, w, b, target, case) -> float:
    """The loss's floor where ``lse - z_target`` cancels (V = 1: exactly, leaving the z-loss alone): its
    two terms are float32 numbers of size ``|z|`` formed by different sums (the logsumexp from the
    GEMM tile, the target logit on its own), so the difference is no better than ``u·(|lse| + |z_t|)``
    per row; relative to the loss, ``BASELINE_FACTOR·u·Σ(|lse| + |z_t| + λ·lse²) / |Σ loss|`` (per
    row in norm for ``reduction='none'``). Seen on the H200: float32, H = V = 1, z-loss, softcap 0.7:
    1.4e-4 against 3e-5."""
    z = x.reshape(-1, x.shape[-1]).double() @ w.double().t()
    if b is not None:
        z = z + b.double()
    if case["softcap"]:
        z = case["softcap"] * torch.tanh(z / case["softcap"])
    valid = (target.reshape(-1) != case["ignore_index"]).cpu()
    if not valid.any():
        return 0.0
    z, t = z[valid], target.reshape(-1).cpu()[valid]
    lse = torch.logsumexp(z, -1)
    zt = z.gather(1, t[:, None]).squeeze(1)
    lam, eps = case["z_loss_scale"] or 0.0, case["label_smoothing"] or 0.0
    terms = lse.abs() + (1 - eps) * zt.abs() + eps * z.abs().mean(-1) + lam * lse**2
    loss = lse - (1 - eps) * zt - eps * z.mean(-1) + lam * lse**2
    if case["reduction"] == "none":
        ratio = (terms.norm() / loss.norm()).item() if loss.norm() > 0 else 0.0
    else:
        ratio = (terms.sum() / loss.sum().abs()).item() if loss.sum() != 0 else 0.0
    return BASELINE_FACTOR * UNIT_ROUNDOFF[torch.float32] * ratio


# --------------------------------------------------------------------------- ORPO


@st.composite
def orpo_cases(draw):
    pairs, seq = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    return dict(
        pairs=pairs,
        seq=seq,
        hidden=draw(st.sampled_from([1, 3, 5, 8, 9])),
        vocab=draw(st.sampled_from([2, 3, 7, 13])),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        beta=draw(st.sampled_from([0.1, 0.1, 0.5, 2.0])),
        nll_target=draw(st.booleans()),
        ignored=draw(st.sampled_from([0.0, 0.5])),
        ignore_index=draw(st.sampled_from([-100, -1])),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, 2 * pairs * seq))),
        accurate=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=examples(120), **SETTINGS)
@given(orpo_cases())
def test_fused_linear_orpo_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    pairs, seq, hidden, vocab, dtype = (case[k] for k in ("pairs", "seq", "hidden", "vocab", "dtype"))
    ignore_index = case["ignore_index"]
    x = torch.randn(2 * pairs, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if case["bias"] else None
    target = torch.randint(0, vocab, (2 * pairs, seq), generator=gen)
    target = torch.where(valid_mask(gen, target.shape, case["ignored"]), target, ignore_index).to(DEVICE)
    nll_target = None
    if case["nll_target"]:  # e.g. prompt + response: other tokens than target's
        other = torch.randint(0, vocab, target.shape, generator=gen)
        nll_target = torch.where(valid_mask(gen, target.shape, case["ignored"] / 2), other, ignore_index).to(DEVICE)
    options = {k: case[k] for k in ("beta", "ignore_index", "chunk_size", "accurate")}

    def call(fn):
        return lambda x_, w_, b_: fn(x_, w_, target, b_, nll_target=nll_target, **options)._asdict()

    upstream = torch.rand((), generator=gen, dtype=torch.float64) + 0.5
    got, want, baseline, dz = run_three((call(fused_linear_orpo), call(reference.fused_linear_orpo)), [x, w, b], dtype, upstream)
    assert got["loss"].dtype == torch.float32
    # Chunks hold whole pairs (sequences i and i + n), pair after pair.
    pairs_per_chunk = chunk_rows(case["chunk_size"], 2 * seq, 2 * pairs * seq, hidden) // (2 * seq)
    chunk_of_row = (torch.arange(2 * pairs) % pairs // pairs_per_chunk)[:, None].expand(-1, seq)
    floors = dict.fromkeys(got, TOLERANCE[matmul_dtype(dtype)]) | {"dx": TOLERANCE[dtype]}
    floors |= lean_floors(dtype, case["accurate"], dz, x.to(dtype), chunk_of_row, want)
    for name, floor in cancellation_floors(dz, x.to(dtype), want, dtype).items():
        floors[name] = max(floors[name], floor)
    compare(got, want, baseline, floors, case)


def test_orpo_single_class_vocabulary_is_nan_like_the_reference():
    """V = 1: every log-prob is 0, log1mexp(0) = -inf, the log-odds -inf - (-inf): undefined, NaN in both."""
    x, w = torch.randn(2, 3, 4, device=DEVICE), torch.randn(1, 4, device=DEVICE)
    target = torch.zeros(2, 3, dtype=torch.long, device=DEVICE)
    out = fused_linear_orpo(x, w, target)
    ref = reference.fused_linear_orpo(x.double(), w.double(), target)
    assert torch.isnan(ref.loss) and torch.isnan(out.loss)
    assert out.chosen_logps.tolist() == [0.0] and out.nll.item() == 0.0


# --------------------------------------------------------------------------- KTO


@st.composite
def kto_cases(draw):
    batch, seq = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    return dict(
        batch=batch,
        seq=seq,
        hidden=draw(st.sampled_from([1, 3, 5, 8, 9])),
        vocab=draw(st.sampled_from([1, 2, 3, 7, 13])),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        labels=draw(st.lists(st.booleans(), min_size=batch, max_size=batch)),
        kl=draw(st.sampled_from([None, 0.0, 0.3, "tensor"])),
        reference=draw(st.sampled_from(["model", "model+bias", "logps"])),
        ref_hidden=draw(st.sampled_from([2, 5])),
        ref_dtype=draw(st.sampled_from(DTYPES)),
        beta=draw(st.sampled_from([0.1, 0.5, 2.0])),
        ignore_index=draw(st.sampled_from([-100, -1])),
        average_log_prob=draw(st.booleans()),
        desirable_weight=draw(st.sampled_from([1.0, 1.33])),
        undesirable_weight=draw(st.sampled_from([1.0, 0.5])),
        ignored=draw(st.sampled_from([0.0, 0.5])),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, batch * seq))),
        accurate=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=examples(120), **SETTINGS)
@given(kto_cases())
def test_fused_linear_kto_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    batch, seq, hidden, vocab, dtype = (case[k] for k in ("batch", "seq", "hidden", "vocab", "dtype"))
    x = torch.randn(batch, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if case["bias"] else None
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    target = torch.where(valid_mask(gen, target.shape, case["ignored"]), target, case["ignore_index"]).to(DEVICE)
    labels = torch.tensor(case["labels"], dtype=torch.bool, device=DEVICE)
    ref = {}
    if case["reference"] == "logps":
        ref["ref_logps"] = (-torch.rand(batch, generator=gen) * 3 * seq).to(DEVICE)
    else:  # the reference model, in its own width and dtype; the reference implementation gets it in float64
        h = case["ref_hidden"]
        ref["ref_x"] = torch.randn(batch, seq, h, generator=gen).to(DEVICE, case["ref_dtype"])
        ref["ref_weight"] = (torch.randn(vocab, h, generator=gen) * h**-0.5 * 2).to(DEVICE, case["ref_dtype"])
        if case["reference"] == "model+bias":
            ref["ref_bias"] = torch.randn(vocab, generator=gen).to(DEVICE, case["ref_dtype"])
    kl = torch.tensor(0.2, device=DEVICE) if case["kl"] == "tensor" else case["kl"]
    options = {
        k: case[k]
        for k in ("beta", "ignore_index", "average_log_prob", "desirable_weight", "undesirable_weight", "chunk_size", "accurate")
    }

    def call(fn):
        def run(x_, w_, b_):
            # The float64 reference upcasts the reference model; the baseline keeps it in its own dtype.
            ref_ = ref if fn is fused_linear_kto or x_.dtype != torch.float64 else {k: v.to(x_.dtype) for k, v in ref.items()}
            return fn(x_, w_, target, labels, kl, bias=b_, **ref_, **options)._asdict()
        return run

    upstream = torch.rand((), generator=gen, dtype=torch.float64) + 0.5
    got, want, baseline, dz = run_three((call(fused_linear_kto), call(reference.fused_linear_kto)), [x, w, b], dtype, upstream)
    assert got["loss"].dtype == torch.float32
    sequences_per_chunk = chunk_rows(case["chunk_size"], seq, batch * seq, hidden) // seq
    chunk_of_row = (torch.arange(batch) // sequences_per_chunk)[:, None].expand(-1, seq)
    floors = dict.fromkeys(got, TOLERANCE[matmul_dtype(dtype)]) | {"dx": TOLERANCE[dtype]}
    floors |= lean_floors(dtype, case["accurate"], dz, x.to(dtype), chunk_of_row, want)
    compare(got, want, baseline, floors, case)


# --------------------------------------------------------------------------- DPO, CPO and SimPO


def pair_inputs(case, gen):
    """``x`` ``(2n, T, H)``, head, bias and targets (one valid token per sequence at least) of a pair case."""
    pairs, seq, hidden, vocab = (case[k] for k in ("pairs", "seq", "hidden", "vocab"))
    x = torch.randn(2 * pairs, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if case["bias"] else None
    target = torch.randint(0, vocab, (2 * pairs, seq), generator=gen)
    target = torch.where(valid_mask(gen, target.shape, case["ignored"]), target, case["ignore_index"]).to(DEVICE)
    return x, w, b, target


def compare_pairs(got, want, baseline, dz, case, x):
    """:func:`compare` for a paired loss: every output but the accuracies (checked against the margins)."""
    accuracies = got.pop("reward_accuracies")
    assert torch.equal(accuracies, (got["reward_margins"] > 0).to(accuracies.dtype)), case
    pairs, seq, hidden, dtype = (case[k] for k in ("pairs", "seq", "hidden", "dtype"))
    # Chunks hold whole pairs (sequences i and i + n), pair after pair.
    pairs_per_chunk = chunk_rows(case["chunk_size"], 2 * seq, 2 * pairs * seq, hidden) // (2 * seq)
    chunk_of_row = (torch.arange(2 * pairs) % pairs // pairs_per_chunk)[:, None].expand(-1, seq)
    floors = dict.fromkeys(got, TOLERANCE[matmul_dtype(dtype)]) | {"dx": TOLERANCE[dtype]}
    floors |= lean_floors(dtype, case["accurate"], dz, x.to(dtype), chunk_of_row, want)
    for name, floor in cancellation_floors(dz, x.to(dtype), want, dtype).items():
        floors[name] = max(floors[name], floor)
    compare(got, want, baseline, floors, case)


def cancellation_floors(dz: torch.Tensor, x: torch.Tensor, want: dict, dtype: torch.dtype = torch.float32) -> dict:
    """Floors of ``dW``/``db`` where their sums over rows cancel: each ``dz`` element comes with a
    relative error of a few float32 units ``u`` whoever computes it, so a sum is no more accurate
    than ``u·Σ|terms|``; relative to the result, ``BASELINE_FACTOR·u·‖Σ|dz|·|x|‖ / ‖dW‖`` (and
    ``‖Σ|dz|‖ / ‖db‖``). It matters at V = 2, where every row's ``dz`` is ``[a, -a]`` and ``db`` a
    difference of near-equal sums (seen: ``|db| ~ 1e-3·Σ|dz|``, where the float32 reference happened
    to land 4× closer than the kernel, both at the float32 rounding of the terms). ``u`` is the unit
    roundoff of the dtype ``dz`` is held in (:func:`matmul_dtype` of the inputs' ``dtype``: float32 in
    the interpreter, the 16-bit dtype itself on CUDA)."""
    u = UNIT_ROUNDOFF[matmul_dtype(dtype)]
    dz = dz.reshape(-1, dz.shape[-1]).abs()
    x = x.reshape(-1, x.shape[-1]).to(dz.device, torch.float64).abs()
    terms = {"dW": dz.t() @ x, "db": dz.sum(0)}
    return {name: BASELINE_FACTOR * u * (terms[name].norm() / want[name].norm()).item()
            for name in terms if name in want and want[name].norm() > 0}


def logit_rounding_floors(dz: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, want: dict, dtype: torch.dtype) -> dict:
    """Floors of ``dW``/``db`` where the logits are held in a 16-bit dtype (CUDA: :func:`matmul_dtype`;
    the published baseline rounds its logits too): each logit carries an absolute error ``u·|z|``, which
    moves every ``p`` of its row, so each ``dz`` element of row ``r`` is no better than ``u·m_r`` relative
    (``m_r`` the row's largest ``|z|``, as the softmax is held: already divided by a temperature or not);
    ``BASELINE_FACTOR·u·‖Σ_r m_r|dz_r|·|x_r|‖ / ‖dW‖`` (and likewise ``db``). 0 where the logits are
    float32 (the interpreter). Seen on the H200: bf16, V = 2, temperature 0.6, |z| ~ 3: dW 4.5u against a
    baseline that landed under u by chance."""
    held = matmul_dtype(dtype)
    if held == torch.float32:
        return {}
    u = UNIT_ROUNDOFF[held]
    dz = dz.reshape(-1, dz.shape[-1]).abs()
    m = logits.reshape(-1, logits.shape[-1]).to(dz.device, torch.float64).abs().amax(-1, keepdim=True)
    x = x.reshape(-1, x.shape[-1]).to(dz.device, torch.float64).abs()
    terms = {"dW": (m * dz).t() @ x, "db": (m * dz).sum(0)}
    return {name: BASELINE_FACTOR * u * (terms[name].norm() / want[name].norm()).item()
            for name in terms if name in want and want[name].norm() > 0}


def logit_rounding_value_floor(logits: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> float:
    """:func:`logit_rounding_floors` for a per-row value formed from the held logits (a log-prob, an
    entropy): ``u·m_r`` absolute per row whoever holds them in 16 bits, relative to ``value`` in norm."""
    held = matmul_dtype(dtype)
    if held == torch.float32 or value.norm() == 0:
        return 0.0
    u = UNIT_ROUNDOFF[held]
    m = logits.reshape(-1, logits.shape[-1]).double().abs().amax(-1)
    return BASELINE_FACTOR * u * (m.norm() / value.double().norm().cpu()).item()


def pair_common(draw) -> dict:
    pairs, seq = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    return dict(
        pairs=pairs,
        seq=seq,
        hidden=draw(st.sampled_from([1, 3, 5, 8, 9])),
        vocab=draw(st.sampled_from([1, 2, 3, 7, 13])),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        beta=draw(st.sampled_from([0.1, 0.5, 2.0])),
        ignored=draw(st.sampled_from([0.0, 0.5])),
        ignore_index=draw(st.sampled_from([-100, -1])),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, 2 * pairs * seq))),
        accurate=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def dpo_cases(draw):
    case = pair_common(draw)
    types = draw(st.lists(st.sampled_from(DPO_LOSS_TYPES), min_size=1, max_size=2))
    smoothing = 0.0
    if "exo_pair" in types:
        smoothing = draw(st.sampled_from([1e-3, 0.2]))
    elif "robust" in types:
        smoothing = draw(st.sampled_from([0.0, 0.2, 0.4]))
    allowed_f = set(types) <= set(F_DIVERGENCE_LOSS_TYPES)
    return case | dict(
        loss_type=types[0] if len(types) == 1 else types,
        loss_weights=draw(st.one_of(st.none(), st.lists(st.sampled_from([0.5, 2.0]), min_size=len(types), max_size=len(types)))),
        label_smoothing=smoothing,
        discopop_tau=draw(st.sampled_from([0.05, 0.5])),
        f_divergence_type=draw(st.sampled_from(F_DIVERGENCES)) if allowed_f else "reverse_kl",
        average_log_prob=False if set(types) & set(LENGTH_NORMALIZED_LOSS_TYPES) else draw(st.booleans()),
        reference=draw(st.sampled_from(["model", "model+bias", "logps"])),
        ref_hidden=draw(st.sampled_from([2, 5])),
        ref_dtype=draw(st.sampled_from(DTYPES)),
    )


@settings(max_examples=examples(80), **SETTINGS)
@given(dpo_cases())
def test_fused_linear_dpo_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    x, w, b, target = pair_inputs(case, gen)
    pairs, seq, vocab = case["pairs"], case["seq"], case["vocab"]
    ref = {}
    if case["reference"] == "logps":
        ref["ref_logps"] = (-torch.rand(2 * pairs, generator=gen) * 3 * (1 if case["average_log_prob"] else seq)).to(DEVICE)
    else:  # the reference model, in its own width and dtype; the reference implementation gets it in float64
        h = case["ref_hidden"]
        ref["ref_x"] = torch.randn(2 * pairs, seq, h, generator=gen).to(DEVICE, case["ref_dtype"])
        ref["ref_weight"] = (torch.randn(vocab, h, generator=gen) * h**-0.5 * 2).to(DEVICE, case["ref_dtype"])
        if case["reference"] == "model+bias":
            ref["ref_bias"] = torch.randn(vocab, generator=gen).to(DEVICE, case["ref_dtype"])
    options = {
        k: case[k]
        for k in ("beta", "loss_type", "loss_weights", "label_smoothing", "discopop_tau", "f_divergence_type", "ignore_index",
                  "average_log_prob", "chunk_size", "accurate")
    }

    def call(fn):
        def run(x_, w_, b_):
            # The float64 reference upcasts the reference model; the baseline keeps it in its own dtype.
            ref_ = ref if fn is fused_linear_dpo or x_.dtype != torch.float64 else {k: v.to(x_.dtype) for k, v in ref.items()}
            return fn(x_, w_, target, b_, **ref_, **options)._asdict()
        return run

    upstream = torch.rand((), generator=gen, dtype=torch.float64) + 0.5
    got, want, baseline, dz = run_three((call(fused_linear_dpo), call(reference.fused_linear_dpo)), [x, w, b], case["dtype"], upstream)
    assert got["loss"].dtype == torch.float32
    compare_pairs(got, want, baseline, dz, case, x)


@st.composite
def cpo_cases(draw):
    case = pair_common(draw)
    loss_type = draw(st.sampled_from(CPO_LOSS_TYPES))
    return case | dict(
        loss_type=loss_type,
        label_smoothing=0.0 if loss_type in ("hinge", "ipo") else draw(st.sampled_from([0.0, 0.1, 0.5])),
        cpo_alpha=draw(st.sampled_from([0.0, 1.0, 0.5])),
        simpo_gamma=draw(st.sampled_from([0.5, 1.5])),
        alpha=draw(st.sampled_from([0.0, 0.0, 0.3, -0.2])),
        nll_target=draw(st.booleans()),
    )


@settings(max_examples=examples(80), **SETTINGS)
@given(cpo_cases())
def test_fused_linear_cpo_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    x, w, b, target = pair_inputs(case, gen)
    nll_target = None
    if case["nll_target"]:  # e.g. prompt + response: other tokens than target's
        other = torch.randint(0, case["vocab"], target.shape, generator=gen)
        nll_target = torch.where(valid_mask(gen, target.shape, case["ignored"] / 2), other, case["ignore_index"]).to(DEVICE)
    options = {k: case[k] for k in ("beta", "loss_type", "label_smoothing", "cpo_alpha", "simpo_gamma", "alpha", "ignore_index",
                                    "chunk_size", "accurate")}

    def call(fn):
        return lambda x_, w_, b_: fn(x_, w_, target, b_, nll_target=nll_target, **options)._asdict()

    upstream = torch.rand((), generator=gen, dtype=torch.float64) + 0.5
    got, want, baseline, dz = run_three((call(fused_linear_cpo), call(reference.fused_linear_cpo)), [x, w, b], case["dtype"], upstream)
    assert got["loss"].dtype == torch.float32
    compare_pairs(got, want, baseline, dz, case, x)
