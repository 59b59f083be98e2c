r"""KL divergence, forward stage: the loss and, in the same pass, the gradient.

What it computes
----------------
For log-probabilities :math:`x` and target probabilities :math:`t` (or log-probabilities
:math:`t` when ``LOG_TARGET``), elementwise

.. math::

    \ell = t\,(\log t - x)\ \text{with}\ 0 \log 0 = 0, \qquad
    \ell = e^{t}\,(t - x)\ \text{(log target)},

and, because :math:`\partial \ell / \partial x = -t` (or :math:`-e^t`) does not depend on :math:`x`,
the gradient of the reduced loss is ``-t * grad_scale`` where ``grad_scale`` is the reduction's
factor (1 for ``sum``, 1/numel for ``mean``, 1/size(0) for ``batchmean``). It is written here,
while ``t`` is in registers, so backward has nothing left to read.

The loss is pointwise, so the kernel sees both tensors as flat arrays of ``numel`` elements and
ignores the row structure; ``batchmean`` only changes ``grad_scale`` and the final division.

What it costs
-------------
Per element: 2 loads (input, target) and, with the gradient, 1 store; about 5 FLOPs and one
``log`` or ``exp``. At 4 bytes an element that is 8 bytes read without the gradient and 12 bytes
moved with it: pure bandwidth. Reductions write one float32 partial sum per program, summed by
torch afterwards (a fixed order, so the result is deterministic; no atomics).

Offsets are 64-bit, so ``numel`` may exceed 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Elements per program. 4096 float32 = 16 KiB per operand per program.
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def kl_div_forward_kernel(
    input_ptr,  # log-probabilities, numel elements, contiguous (fp32/bf16/fp16)
    target_ptr,  # probabilities (or log-probabilities), numel elements, contiguous
    partial_ptr,  # float32[num_programs]: each program's sum of the pointwise loss (REDUCE only)
    loss_ptr,  # numel elements: the pointwise loss (when not REDUCE), in the output dtype
    grad_ptr,  # numel elements: d(reduced loss)/d(input) = -t * grad_scale (WRITE_GRAD only)
    numel,  # number of elements of input (may exceed 2**31)
    grad_scale,  # float: the reduction's factor, 1, 1/numel or 1/size(0)
    LOG_TARGET: tl.constexpr,  # target holds log-probabilities
    REDUCE: tl.constexpr,  # write partial sums (sum/mean/batchmean) instead of the pointwise loss
    WRITE_GRAD: tl.constexpr,  # also write the gradient
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    # Masked lanes load x = t = 0, whose loss is 0 in both forms.
    x = tl.load(input_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(target_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if LOG_TARGET:
        p = tl.exp(t)
        loss = p * (t - x)
    else:
        p = t
        # xlogy(t, t) - t * x, as torch computes it: 0 log 0 = 0 (log 1 stands in for log 0),
        # while NaN in t or x still gives NaN.
        loss = t * tl.log(tl.where(t == 0.0, 1.0, t)) - t * x
    if REDUCE:
        tl.store(partial_ptr + pid, tl.sum(loss, axis=0))
    else:
        tl.store(loss_ptr + offsets, loss.to(loss_ptr.dtype.element_ty), mask=mask)
    if WRITE_GRAD:
        grad = -p * grad_scale
        tl.store(grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def num_programs(numel: int, block: int = BLOCK) -> int:
    """The grid size for ``numel`` elements (the length of the partial-sum buffer)."""
    return triton.cdiv(numel, block)


def launch_kl_div_forward(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    log_target: bool,
    partial: torch.Tensor | None,
    loss: torch.Tensor | None,
    grad: torch.Tensor | None,
    grad_scale: float = 1.0,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """Launch the forward kernel on contiguous ``input`` and ``target`` of the same numel.

    Exactly one of ``partial`` (float32, ``num_programs(numel)`` elements: reduce) and ``loss``
    (``numel`` elements: pointwise) is given; ``grad`` (``numel`` elements) when the gradient is
    wanted. Buffers are written, never read, so callers may pass ``torch.empty`` (tests pass
    NaN-poisoned ones to prove every element is written). ``block`` and ``num_warps`` are the tuning
    dials (``partial`` then has ``num_programs(numel, block)`` elements).
    """
    if (partial is None) == (loss is None):
        raise ValueError("give exactly one of partial (reduce) and loss (pointwise)")
    numel = input.numel()
    # Unused pointers still need a tensor argument; the constexpr flags keep them unread and unwritten.
    kl_div_forward_kernel[(num_programs(numel, block),)](
        input,
        target,
        partial if partial is not None else input,
        loss if loss is not None else input,
        grad if grad is not None else input,
        numel,
        float(grad_scale),
        LOG_TARGET=bool(log_target),
        REDUCE=partial is not None,
        WRITE_GRAD=grad is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
