r"""KL divergence, backward stage for ``reduction="none"``.

With a reduction the forward stage already wrote the gradient. With ``none`` the upstream
gradient :math:`g` is a tensor of the input's shape that exists only in backward, so the gradient

.. math:: \partial L / \partial x = -t \cdot g \quad (\text{or } -e^{t} \cdot g)

is formed here in one pass: 2 loads and 1 store per element, about 2 FLOPs. (Writing ``-t`` in
forward would be a copy of the target that backward then reads again: one more pass, not one less.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kl_div_forward import BLOCK, NUM_WARPS


@triton.jit
def kl_div_backward_kernel(
    target_ptr,  # probabilities (or log-probabilities), numel elements, contiguous
    grad_output_ptr,  # upstream gradient of the pointwise loss, numel elements, contiguous
    grad_ptr,  # numel elements: the gradient with respect to input
    numel,  # number of elements (may exceed 2**31)
    LOG_TARGET: tl.constexpr,  # target holds log-probabilities
    BLOCK: tl.constexpr,  # elements per program
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    t = tl.load(target_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_output_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(t) if LOG_TARGET else t
    tl.store(grad_ptr + offsets, (-p * g).to(grad_ptr.dtype.element_ty), mask=mask)


def launch_kl_div_backward(
    target: torch.Tensor, grad_output: torch.Tensor, *, log_target: bool, grad: torch.Tensor
) -> None:
    """Write ``grad = -target * grad_output`` (or ``-exp(target) * grad_output``); all contiguous."""
    numel = target.numel()
    kl_div_backward_kernel[(triton.cdiv(numel, BLOCK),)](
        target, grad_output, grad, numel, LOG_TARGET=bool(log_target), BLOCK=BLOCK, num_warps=NUM_WARPS
    )
