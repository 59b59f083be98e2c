"""What the fused sequence-loss tests (ORPO, CPO/SimPO, DPO, KTO, GRPO) share when they compare a
kernel with its float64 reference: the float64 leaves, the gradients of a loss, and the comparison of
``dx``, ``dW``, ``db`` added to the per-field errors a test computed with its own ``rel_err``."""

from __future__ import annotations

import torch

from kernels_workbench.check import BASELINE_MARGIN


def grads_of(loss, tensors, grad_output):
    """``d loss / d t`` for each tensor (None stays None), with upstream gradient ``grad_output``."""
    present = [t for t in tensors if t is not None]
    got = iter(torch.autograd.grad(loss, present, torch.as_tensor(grad_output, dtype=loss.dtype, device=loss.device)))
    return [next(got) if t is not None else None for t in tensors]


def double_leaves(*tensors):
    """Float64 leaf copies that require grad (None stays None): the reference's inputs."""
    return [t.detach().double().requires_grad_() if t is not None else None for t in tensors]


def assert_errors_below(out_loss, want_loss, leaves, ref_leaves, errors: dict, tol: float, grad_output: float, rel_err,
                        baseline: dict | None = None) -> dict:
    """Adds ``dx``, ``dW``, ``db`` (of ``leaves`` = ``(x, w, b)``; ``b`` may be None) against the
    reference's gradients to ``errors`` (each gradient of the leaf's dtype and shape), then asserts every
    error is below ``tol``, or, with ``baseline`` (:func:`baseline_errors`: the same loss's own errors
    in the kernel's dtype on its device), below ``BASELINE_MARGIN`` times the baseline's where that is
    larger. Returns the errors."""
    got = grads_of(out_loss, leaves, grad_output)
    expected = grads_of(want_loss, ref_leaves, grad_output)
    for name, gx, r, t in zip(("dx", "dW", "db"), got, expected, leaves):
        if t is not None:
            assert gx.dtype == t.dtype and gx.shape == t.shape
            errors[name] = rel_err(gx, r)
    bounds = {name: max(tol, BASELINE_MARGIN * (baseline or {}).get(name, 0.0)) for name in errors}
    assert all(e < bounds[name] for name, e in errors.items()), (errors, bounds)
    return errors


def baseline_errors(call, leaves, want, ref_leaves, fields, grad_output: float, rel_err) -> dict:
    """The baseline's own errors: ``call(*fresh copies of leaves)`` (the torch reference in the kernel's
    dtype, on its device) against the float64 ``want`` (its ``fields``) and the gradients of
    ``want.loss`` with respect to ``ref_leaves``, by name (``dx``, ``dW``, ``db``)."""
    fresh = [t.detach().clone().requires_grad_() if t is not None else None for t in leaves]
    base = call(*fresh)
    errors = {name: rel_err(getattr(base, name), getattr(want, name)) for name in fields}
    got = grads_of(base.loss, fresh, grad_output)
    expected = grads_of(want.loss, ref_leaves, grad_output)
    for name, gx, r in zip(("dx", "dW", "db"), got, expected):
        if gx is not None:
            errors[name] = rel_err(gx, r)
    return errors
