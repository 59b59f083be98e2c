r"""KL divergence, backward stage: forming the gradient.

With a reduction the forward stage already wrote :math:`-t\,s`, and backward only scales it by the
upstream scalar (:mod:`kernels_lib.kernels.scale_gradient`, shared with the other losses).

``kl_div_backward_kernel``: with ``reduction="none"`` the upstream
gradient :math:`g` is a tensor of the input's shape that exists only in backward, so

.. math:: \partial L / \partial x = -t \cdot g \cdot s \quad (\text{or } -e^{t} \cdot g \cdot s)

is formed here in one pass: 2 loads and 1 store per element, about 3 FLOPs. (Writing ``-t`` in
forward would be a copy of the target that backward then reads again: one more pass, not one
less.) The same kernel with a scalar :math:`g` re-forms a reduced loss's gradient when backward
runs a second time through a retained graph (the forward buffer was already handed out).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kl_div_forward import BLOCK, NUM_WARPS


@triton.jit
def kl_div_backward_kernel(
    target_ptr,  # probabilities (or log-probabilities), numel elements, contiguous
    grad_output_ptr,  # upstream gradient: numel elements, or one element when SCALAR_UPSTREAM
    grad_ptr,  # numel elements: the gradient with respect to input
    numel,  # number of elements (may exceed 2**31)
    grad_scale,  # float: the reduction's factor (1 for "none")
    LOG_TARGET: tl.constexpr,  # target holds log-probabilities
    SCALAR_UPSTREAM: tl.constexpr,  # grad_output is one element (a reduced loss)
    BLOCK: tl.constexpr,  # elements per program
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    t = tl.load(target_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if SCALAR_UPSTREAM:
        g = tl.load(grad_output_ptr).to(tl.float32)
    else:
        g = tl.load(grad_output_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(t) if LOG_TARGET else t
    tl.store(grad_ptr + offsets, (-p * g * grad_scale).to(grad_ptr.dtype.element_ty), mask=mask)


def launch_kl_div_backward(
    target: torch.Tensor, grad_output: torch.Tensor, *, log_target: bool, grad: torch.Tensor, grad_scale: float = 1.0
) -> None:
    """Write ``grad = -target * grad_output * grad_scale`` (or with ``exp(target)``); all contiguous.

    ``grad_output`` has either target's numel or one element (then it multiplies every element).
    """
    numel = target.numel()
    kl_div_backward_kernel[(triton.cdiv(numel, BLOCK),)](
        target, grad_output, grad, numel, float(grad_scale),
        LOG_TARGET=bool(log_target), SCALAR_UPSTREAM=grad_output.shape != target.shape,
        BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
