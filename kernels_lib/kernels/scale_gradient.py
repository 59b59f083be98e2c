r"""Scaling a gradient formed in forward by the upstream scalar, in place, without a host sync.

The losses that form their gradient in forward (a reduced loss: the factor is known there) must
still multiply it by the upstream gradient :math:`g` in backward, the chain rule's last step:
``grad *= g``. Each program reads :math:`g` from device memory and returns at once when
:math:`g = 1` (the usual ``loss.backward()``), so the common case moves no bytes and, unlike
comparing :math:`g` with 1 on the host, never makes the host wait for the GPU (a wait that leaves
the GPU idle until the CPU has launched the next step's first kernel). Otherwise it scales its
blocks: one read and one write per element, one multiply in float32.

The grid is capped at :data:`MAX_PROGRAMS` programs that stride over the blocks: with one program
per block, the early exit alone cost the fused linear cross-entropy measurable device time per step
(its two calls, ``dx`` and the ``128256 × 4096`` ``dW``: 8k and 128k programs that moved nothing); a
capped grid exits after a
few microseconds and still fills the GPU when it scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Elements per loop step of a program (16 KiB of float32).
BLOCK = 4096
NUM_WARPS = 8
#: The most programs launched: a few per SM on current GPUs, each striding over the blocks.
MAX_PROGRAMS = 1024


@triton.jit
def scale_gradient_kernel(
    grad_ptr,  # numel elements, scaled in place
    grad_output_ptr,  # the upstream gradient: one element
    numel,  # number of elements of grad (may exceed 2**31)
    BLOCK: tl.constexpr,  # elements per loop step
):
    g = tl.load(grad_output_ptr).to(tl.float32)
    if g != 1.0:
        first = tl.program_id(0).to(tl.int64) * BLOCK
        for start in range(first, numel, tl.num_programs(0) * BLOCK):  # blocks pid, pid + programs, ...
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < numel
            grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            tl.store(grad_ptr + offsets, (grad * g).to(grad_ptr.dtype.element_ty), mask=mask)


def launch_scale_gradient(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """``grad *= grad_output`` in place (contiguous ``grad``, one-element ``grad_output``); nothing moves when it is 1."""
    if not grad.is_contiguous() or grad_output.numel() != 1:
        raise ValueError(
            f"launch_scale_gradient: grad must be contiguous (got strides {tuple(grad.stride())}) and grad_output "
            f"one element (got shape {tuple(grad_output.shape)})"
        )
    numel = grad.numel()
    programs = min(triton.cdiv(numel, BLOCK), MAX_PROGRAMS)
    scale_gradient_kernel[(programs,)](grad, grad_output, numel, BLOCK=BLOCK, num_warps=NUM_WARPS)
