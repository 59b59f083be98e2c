"""float16 gradients that would underflow: dz formed at a power-of-two scale, kept in float32 until backward.

On CUDA the logits chunk (and so ``dz``) is float16 for float16 inputs; a token's ``g·(p - δ)`` with
``g = 1/n_valid`` and ``p ≈ 1/V`` falls below float16's smallest subnormal (6e-8) at the published
sizes. On the CPU the interpreter's buffers are float32, so the underflow itself shows only on CUDA
(the last test); the scaling and the late rounding run on both and are checked on both.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels_lib import default_device, fused_linear_cross_entropy, fused_linear_kto, fused_linear_orpo, reference
from kernels_workbench.check import relative_error
from kernels_lib.fused_linear_cross_entropy import unit_scale

DEVICE = default_device()


@pytest.mark.parametrize("peak", [1e-9, 2.4e-4, 0.75, 1.0, 3.0, 6e4])
def test_unit_scale_is_a_power_of_two_bringing_the_peak_to_one_two(peak):
    scale = unit_scale(peak)
    assert math.log2(scale) == int(math.log2(scale))
    assert 1.0 <= scale * peak < 2.0


@pytest.mark.parametrize("peak", [0.0, float("nan"), float("inf")])
def test_unit_scale_leaves_zero_and_non_finite_alone(peak):
    assert unit_scale(peak) == 1.0


def _inputs(n=64, h=24, v=257, lead=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*(lead or (n,)), h, generator=g)
    w = torch.randn(v, h, generator=g) * h**-0.5
    b = torch.randn(v, generator=g) * 0.1
    y = torch.randint(0, v, lead or (n,), generator=g)
    return x, w, b, y.to(DEVICE)


def _grads(fn, tensors, upstream):
    leaves = [t.detach().clone().to(DEVICE).requires_grad_() for t in tensors]
    out = fn(*leaves)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward(torch.as_tensor(upstream, dtype=loss.dtype, device=DEVICE).expand_as(loss))
    return [t.grad for t in leaves]


#: name -> (y -> loss function of (x, w, b), leading shape, loss scale). The per-row loss takes 2^9 per
#: row: its 64 rows then sum to 2^15, as a scalar loss's (2^15 per row would overflow dW, rightly).
LOSSES = {
    "cross_entropy mean": (lambda y: lambda x, w, b: fused_linear_cross_entropy(x, w, y, b), (64,), 2.0**15),
    "cross_entropy none": (lambda y: lambda x, w, b: fused_linear_cross_entropy(x, w, y, b, reduction="none"), (64,), 2.0**9),
    "orpo": (lambda y: lambda x, w, b: fused_linear_orpo(x, w, y, b), (4, 16), 2.0**15),
    "kto": (lambda y: lambda x, w, b: fused_linear_kto(x, w, y, torch.tensor([True, False, True, False], device=DEVICE), 0.1, bias=b,
                                                      ref_logps=torch.tensor([-90.0, -85.0, -95.0, -88.0], device=DEVICE)), (4, 16), 2.0**15),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_half_gradients_are_float16_and_follow_a_loss_scale(name):
    """A GradScaler-style upstream (a power of two) gives that multiple of the gradients at upstream 1
    (the scaling inside is exact), each rounded to float16 once, after the scale."""
    make, lead, loss_scale = LOSSES[name]
    x, w, b, y = _inputs(lead=lead)
    fn = make(y)
    half = [t.half() for t in (x, w, b)]
    unit, scaled = _grads(fn, half, 1.0), _grads(fn, half, loss_scale)
    for g1, gs in zip(unit, scaled):
        assert g1.dtype == gs.dtype == torch.float16 and torch.isfinite(gs).all()
        assert relative_error(gs.float() / loss_scale, g1.float()) < 2e-3
    reference_fn = {"cross_entropy mean": lambda x_, w_, b_: reference.fused_linear_cross_entropy(x_, w_, y, b_)}.get(name)
    if reference_fn is not None:
        exact = _grads(reference_fn, [t.double() for t in half], 1.0)
        assert all(relative_error(g, e) < 2e-3 for g, e in zip(unit, exact))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the float16 logits buffer exists only on CUDA (float32 in the interpreter)")
@pytest.mark.gpu_memory(3)
def test_half_cross_entropy_gradients_do_not_underflow_on_cuda():
    """N = 2048, V = 32768: g·p ≈ 1.5e-8, below float16's smallest subnormal. The gradients stay within
    float16's rounding of float64 (the model-style baseline, which casts g·(p - δ) to float16, loses
    the p part: its error is shown beside)."""
    x, w, _, y = _inputs(n=2048, h=256, v=32768, seed=1)
    half = [x.half(), w.half()]
    ours = _grads(lambda x_, w_: fused_linear_cross_entropy(x_, w_, y), half, 1.0)
    base = _grads(lambda x_, w_: reference.fused_linear_cross_entropy(x_, w_, y), half, 1.0)
    exact = _grads(lambda x_, w_: reference.fused_linear_cross_entropy(x_, w_, y), [t.double() for t in half], 1.0)
    ours_err = [relative_error(g, e) for g, e in zip(ours, exact)]
    base_err = [relative_error(g, e) for g, e in zip(base, exact)]
    assert max(ours_err) < 2e-3, (ours_err, base_err)
