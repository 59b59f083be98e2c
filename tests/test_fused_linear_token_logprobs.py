"""Per-token log-probs and entropy (``fused_linear_token_logprobs``) against the float64 reference and TRL's fused head.

The property test uses the helpers and tolerance rules of ``tests/test_properties.py`` (floors per
dtype, 4x the reference's own error in the kernel's arithmetic, the lean dW floors): the outputs and
the gradients of a per-token combination ``a·ℓ + b·H`` (``a > 0 > b``: both terms of one sign, no
cancellation between them), with the log-probs alone, the entropy alone, or both, on fresh random
inputs with odd sizes, ignored targets, temperatures and chunkings. Then a finite-difference check
of the entropy's gradient (independent of the reference), TRL's own ``ChunkedLogProbFunction`` at a
temperature, the GRPO loss's log-probs, and bad inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
import test_properties as properties
from kernels_lib import default_device, fused_linear_grpo, fused_linear_token_logprobs, reference
from kernels_lib.fused_linear_cross_entropy import default_chunk_size
from kernels_workbench.check import TOLERANCE, relative_error

DEVICE = default_device()


@st.composite
def token_cases(draw):
    ndim = draw(st.integers(1, 3))
    return_entropy = draw(st.booleans())
    lead = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    return dict(
        lead=lead,
        hidden=draw(st.sampled_from([1, 3, 5, 8, 9])),
        vocab=draw(st.sampled_from([1, 2, 3, 7, 13, 17])),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(properties.DTYPES)),
        temperature=draw(st.sampled_from([1.0, 0.6, 1.7])),
        ignore_index=draw(st.sampled_from([-100, -1])),
        ignored=draw(st.sampled_from(["none", "some", "all"])),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, math.prod(lead)))),
        accurate=draw(st.booleans()),
        return_entropy=return_entropy,
        uses=draw(st.sampled_from(["logps", "entropy", "both"])) if return_entropy else "logps",
        scale=draw(st.sampled_from([0.5, 3.0])),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=properties.examples(120), **properties.SETTINGS)
@given(token_cases())
def test_matches_reference(case):
    gen = torch.Generator().manual_seed(case["seed"])
    lead, hidden, vocab, dtype = case["lead"], case["hidden"], case["vocab"], case["dtype"]
    x = torch.randn(*lead, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * case["scale"]
    b = torch.randn(vocab, generator=gen) if case["bias"] else None
    target = torch.randint(0, vocab, lead, generator=gen)
    if case["ignored"] == "some":
        target = torch.where(torch.rand(lead, generator=gen) < 0.4, case["ignore_index"], target)
    elif case["ignored"] == "all":
        target = torch.full(lead, case["ignore_index"])
    target = target.to(DEVICE)
    a = (torch.rand(lead, generator=gen) + 0.5).to(DEVICE)
    c = -(torch.rand(lead, generator=gen) + 0.5).to(DEVICE)
    options = {k: case[k] for k in ("temperature", "ignore_index", "return_entropy", "chunk_size", "accurate")}

    def call(fn):
        def run(x_, w_, b_):
            logps, entropy = fn(x_, w_, target, b_, **options)
            out = {"logps": logps}
            if entropy is not None:
                out["entropy"] = entropy
            uses = case["uses"]
            if uses == "logps":
                out["loss"] = a.to(logps.dtype) * logps
            elif uses == "entropy":
                out["loss"] = c.to(entropy.dtype) * entropy
            else:
                out["loss"] = a.to(logps.dtype) * logps + c.to(entropy.dtype) * entropy
            return out
        return run

    upstream = torch.rand(lead, generator=gen, dtype=torch.float64) + 0.5
    functions = (call(fused_linear_token_logprobs), call(reference.fused_linear_token_logprobs))
    got, want, baseline, dz = properties.run_three(functions, [x, w, b], dtype, upstream)
    assert all(t.dtype == torch.float32 and t.shape == lead for k, t in got.items() if k in ("logps", "entropy")), case
    ignored = target == case["ignore_index"]
    assert bool((got["logps"][ignored] == 0).all()), case
    if "entropy" in got:
        assert bool((got["entropy"][ignored] == 0).all()) and bool((got["entropy"] >= -1e-6).all()), case
    n = math.prod(lead)
    chunk_of_row = torch.arange(n) // (case["chunk_size"] or default_chunk_size(n, hidden))
    floors = dict.fromkeys(got, TOLERANCE[torch.float32]) | {"dx": TOLERANCE[dtype]}
    floors |= properties.lean_floors(dtype, case["accurate"], dz, x.to(dtype), chunk_of_row, want)
    for name, floor in properties.cancellation_floors(dz, x.to(dtype), want, dtype).items():
        floors[name] = max(floors[name], floor)
    t = case["temperature"]
    scaled = dict(case, softcap=None, z_loss_scale=0.0, label_smoothing=0.0, reduction="none")
    cancel = properties.loss_cancellation_floor(
        x.to(dtype), w.to(dtype) / t, None if b is None else b.to(dtype) / t, target, scaled
    )
    for name in ("logps", "loss"):  # z_y - lse cancels for a likely token, whoever computes it
        floors[name] = max(floors[name], cancel)
    # on CUDA the logits are held in the 16-bit dtype (divided by T): u·max|z/T| per row, whoever holds them
    held = (x.to(dtype).double() @ w.to(dtype).double().t() + (0 if b is None else b.to(dtype).double())) / t
    valid = (target != case["ignore_index"]).reshape(-1).cpu()
    for name in ("logps", "loss", "entropy"):
        if name in want:
            floors[name] = max(floors[name], properties.logit_rounding_value_floor(held.reshape(-1, held.shape[-1])[valid], want[name].reshape(-1)[valid.to(want[name].device)], dtype))
    for name, floor in properties.logit_rounding_floors(dz, x.to(dtype), held, want, dtype).items():
        floors[name] = max(floors[name], floor)
    properties.compare(got, want, baseline, floors, case)


def test_entropy_gradient_by_finite_differences():
    """d(Σ c·H)/dx, dW, db along a random direction against central differences of the kernel itself
    (float32, h = 1e-2: truncation ~h², rounding ~u/h; the two agree to ~1e-4 when the gradient is right)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    w = torch.randn(11, 7, generator=gen, dtype=torch.float64) * 0.6
    b = torch.randn(11, generator=gen, dtype=torch.float64)
    target = torch.tensor([3, -100, 0, 10, 5], device=DEVICE)
    c = torch.randn(5, generator=gen, dtype=torch.float64)
    directions = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (x, w, b)]

    def objective(x_, w_, b_):
        entropy = fused_linear_token_logprobs(x_, w_, target, b_, temperature=0.8, return_entropy=True).entropy
        return (c.to(DEVICE, torch.float32) * entropy).sum()

    leaves = [t.to(DEVICE, torch.float32).requires_grad_() for t in (x, w, b)]
    grads = torch.autograd.grad(objective(*leaves), leaves)
    analytic = sum((g.double().cpu() * d).sum().item() for g, d in zip(grads, directions))
    h = 1e-2
    with torch.no_grad():
        plus = objective(*[(t + h * d).to(DEVICE, torch.float32) for t, d in zip((x, w, b), directions)]).item()
        minus = objective(*[(t - h * d).to(DEVICE, torch.float32) for t, d in zip((x, w, b), directions)]).item()
    numeric = (plus - minus) / (2 * h)
    assert abs(analytic) > 1e-2
    assert abs(numeric - analytic) < 2e-3 * abs(analytic), (numeric, analytic)


def test_matches_trl_fused_head():
    """Log-probs, entropy and the gradients of ``Σ a·ℓ + c·H`` against TRL's own ``ChunkedLogProbFunction``
    (the fused head of ``add_fused_lm_head``, trl/trainer/utils.py) at a temperature, ``masked_fill`` at -100."""
    pytest.importorskip("trl")
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 24, generator=gen).to(DEVICE).requires_grad_()
    w = (torch.randn(517, 24, generator=gen) * 0.4).to(DEVICE).requires_grad_()
    b = torch.randn(517, generator=gen).to(DEVICE).requires_grad_()
    target = torch.randint(0, 517, (3, 5), generator=gen)
    target[1, 3:] = -100
    target = target.to(DEVICE)
    a, c = torch.rand(3, 5, generator=gen).to(DEVICE), -torch.rand(3, 5, generator=gen).to(DEVICE)
    valid = target != -100
    logps, entropy = ChunkedLogProbFunction.apply(
        x.reshape(-1, 24), w, b, target.clamp(min=0).reshape(-1), 0.7, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
        ("log_probs", "entropy"),
    )[:2]
    logps, entropy = (t.view(3, 5).masked_fill(~valid, 0) for t in (logps, entropy))
    want = torch.autograd.grad((a * logps + c * entropy).sum(), (x, w, b))
    out = fused_linear_token_logprobs(x, w, target, b, temperature=0.7, return_entropy=True, chunk_size=4)
    got = torch.autograd.grad((a * out.logps + c * out.entropy).sum(), (x, w, b))
    errors = {"logps": relative_error(out.logps, logps), "entropy": relative_error(out.entropy, entropy)}
    errors |= {name: relative_error(g, r) for name, g, r in zip(("dx", "dW", "db"), got, want)}
    assert all(e < 1e-5 for e in errors.values()), errors


def test_same_log_probs_as_grpo():
    """The GRPO loss's per-token log-probs (its own pass) and these agree at the same temperature."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 16, generator=gen).to(DEVICE)
    w = torch.randn(97, 16, generator=gen).to(DEVICE) * 0.5
    target = torch.randint(0, 97, (2, 6), generator=gen)
    target[0, -2:] = -100
    target = target.to(DEVICE)
    ours = fused_linear_token_logprobs(x, w, target, temperature=1.3).logps
    grpo = fused_linear_grpo(x, w, target, advantages=torch.ones(2, device=DEVICE), temperature=1.3).per_token_logps
    assert relative_error(ours, grpo) < 1e-6
    assert relative_error(ours, fused_linear_token_logprobs(x, w, target).logps) > 1e-3  # the temperature acts


def test_entropy_alone_backward():
    """Backward from the entropy alone (the log-probs unused), and no entropy without return_entropy."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 8, generator=gen).to(DEVICE).requires_grad_()
    w = torch.randn(13, 8, generator=gen).to(DEVICE).requires_grad_()
    target = torch.tensor([1, 2, -100, 12], device=DEVICE)
    out = fused_linear_token_logprobs(x, w, target, return_entropy=True)
    out.entropy.sum().backward()
    assert x.grad is not None and bool(x.grad[2].eq(0).all()) and x.grad.abs().sum() > 0
    assert fused_linear_token_logprobs(x, w, target).entropy is None


@pytest.mark.parametrize("change, error, match", [
    (dict(return_entropy=1), TypeError, "return_entropy must be a bool"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(target=torch.tensor([0, 13])), ValueError, "target"),
    (dict(x=torch.randn(2, 5)), ValueError, "x|weight"),
])
def test_bad_inputs_name_the_argument(change, error, match):
    args = dict(x=torch.randn(2, 8), weight=torch.randn(13, 8), target=torch.tensor([0, 1]))
    args |= {k: t for k, t in change.items() if torch.is_tensor(t)}
    args = {k: t.to(DEVICE) for k, t in args.items()}
    with pytest.raises(error, match=match):
        fused_linear_token_logprobs(**args, **{k: v for k, v in change.items() if not torch.is_tensor(v)})

