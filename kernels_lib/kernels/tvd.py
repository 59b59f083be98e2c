r"""Total variation distance: one kernel for the loss and, in the same pass, the gradient.

What it computes
----------------
For probabilities :math:`p` and :math:`q` in rows of ``n_cols`` classes, elementwise

.. math::

    \ell = \tfrac12\,|p - q|, \qquad \frac{\partial \ell}{\partial p} = \tfrac12\,\operatorname{sign}(p - q)

(0 where :math:`p = q`, as Liger's ``_tv_distance_kernel`` and torch's ``abs`` backward give; NaN
where either is NaN, as torch gives). Summed over a row it is the total variation distance
:math:`\tfrac12 \sum_i |p_i - q_i|` (Liger ``LigerTVDLoss``, ``liger_kernel/ops/tvd.py``).

Rows whose label equals ``ignore_index`` (``HAS_LABEL``) are not read: loss, gradient and partial
sums are 0 there. The gradient is multiplied by ``scale`` read from device memory (the reduction's
factor, computed on the device: no host sync) and, when ``UPSTREAM``, by the pointwise upstream
gradient (``reduction="none"``'s backward). The gradient does not depend on ``|p - q|``, only on its
sign, so with a reduction it is written here, in forward, and backward has nothing left to read.

Grid: one program per (row, block of ``BLOCK`` columns), flattened into one axis.

What it costs
-------------
Per element: 2 loads and, with the gradient, 1 store (12 bytes per fp32 element; 8 without), plus
a 4- or 8-byte label per program; about 4 FLOPs: pure bandwidth. One float32 partial per program
for the reductions, summed by torch in a fixed order (deterministic; no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .jsd import BLOCK, NUM_WARPS, block_for, num_programs

__all__ = ["BLOCK", "NUM_WARPS", "block_for", "num_programs", "tvd_kernel", "launch_tvd"]


@triton.jit
def tvd_kernel(
    p_ptr,  # probabilities p (the argument that takes the gradient), n_rows * n_cols, contiguous
    q_ptr,  # probabilities q, same layout (any of fp32/bf16/fp16)
    label_ptr,  # int32/int64[n_rows]: the row's label, compared with ignore_index (HAS_LABEL only)
    upstream_ptr,  # the upstream gradient, n_rows * n_cols elements (UPSTREAM only)
    scale_ptr,  # float32[1]: the factor applied to the gradient (the reduction's)
    partial_ptr,  # float32[num_programs]: each program's sum of the pointwise loss (REDUCE only)
    loss_ptr,  # n_rows * n_cols elements: the pointwise loss (WRITE_LOSS only), output dtype
    grad_ptr,  # n_rows * n_cols elements: d loss / d p (WRITE_GRAD only), p's dtype
    n_cols,  # classes per row
    blocks_per_row,  # cdiv(n_cols, BLOCK)
    ignore_index,  # int: rows whose label equals it are skipped (HAS_LABEL only)
    HAS_LABEL: tl.constexpr,  # label_ptr is given
    REDUCE: tl.constexpr,  # write one partial sum per program
    WRITE_LOSS: tl.constexpr,  # write the pointwise loss
    WRITE_GRAD: tl.constexpr,  # write the gradient
    UPSTREAM: tl.constexpr,  # multiply the gradient by the pointwise upstream gradient
    BLOCK: tl.constexpr,  # columns per program (a power of two)
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < n_cols
    offsets = row * n_cols + cols
    if HAS_LABEL:
        # An ignored row keeps no column (a scalar select, then one vector compare).
        kept_cols = tl.where(tl.load(label_ptr + row) != ignore_index, n_cols, 0)
        mask = cols < kept_cols
    else:
        mask = in_row
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    diff = p - q
    loss = tl.where(mask, 0.5 * tl.abs(diff), 0.0)
    if REDUCE:
        tl.store(partial_ptr + pid, tl.sum(loss, axis=0))
    if WRITE_LOSS:
        tl.store(loss_ptr + offsets, loss.to(loss_ptr.dtype.element_ty), mask=in_row)
    if WRITE_GRAD:
        # sign(diff) / 2: 0 where p == q, NaN (diff itself) where diff is NaN.
        half_sign = tl.where(diff > 0.0, 0.5, tl.where(diff < 0.0, -0.5, tl.where(diff == 0.0, 0.0, diff)))
        grad = tl.where(mask, half_sign, 0.0) * tl.load(scale_ptr)
        if UPSTREAM:
            grad = grad * tl.load(upstream_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=in_row)


def launch_tvd(
    p: torch.Tensor,
    q: torch.Tensor,
    *,
    label: torch.Tensor | None = None,
    ignore_index: int = -100,
    partial: torch.Tensor | None = None,
    loss: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    scale: torch.Tensor | float = 1.0,
    upstream: torch.Tensor | None = None,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """Launch :func:`tvd_kernel` on contiguous (n_rows, n_cols) ``p`` and ``q``.

    Any of ``partial`` (float32, ``num_programs(n_rows, n_cols, block)`` elements), ``loss`` and
    ``grad`` (n_rows * n_cols elements) is written when given; buffers are written, never read.
    ``scale`` multiplies the gradient (a float or a one-element device tensor); ``upstream``
    multiplies it pointwise; ``label`` (n_rows integers) marks rows equal to ``ignore_index``.
    """
    if partial is None and loss is None and grad is None:
        raise ValueError("give at least one of partial, loss and grad to write")
    if upstream is not None and grad is None:
        raise ValueError("upstream multiplies the gradient: give grad too")
    n_cols = p.shape[-1]
    n_rows = p.numel() // n_cols
    blk = block_for(n_cols, block)
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor([float(scale)], dtype=torch.float32, device=p.device)
    scale = scale.to(torch.float32).reshape(1)
    tvd_kernel[(num_programs(n_rows, n_cols, block),)](
        p,
        q,
        label if label is not None else p,
        upstream if upstream is not None else p,
        scale,
        partial if partial is not None else scale,
        loss if loss is not None else p,
        grad if grad is not None else p,
        n_cols,
        triton.cdiv(n_cols, blk),
        int(ignore_index),
        HAS_LABEL=label is not None,
        REDUCE=partial is not None,
        WRITE_LOSS=loss is not None,
        WRITE_GRAD=grad is not None,
        UPSTREAM=upstream is not None,
        BLOCK=blk,
        num_warps=num_warps,
    )
