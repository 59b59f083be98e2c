r"""Total variation distance: one kernel for the loss and, in the same pass, the gradient.

What it computes
----------------
For probabilities :math:`p` and :math:`q` in rows of ``n_cols`` classes, elementwise

.. math::

    \ell = \tfrac12\,|p - q|, \qquad \frac{\partial \ell}{\partial p} = \tfrac12\,\operatorname{sign}(p - q)

(0 where :math:`p = q`, as Liger's ``_tv_distance_kernel`` and torch's ``abs`` backward give; NaN
where either is NaN, as torch gives). Summed over a row it is the total variation distance
:math:`\tfrac12 \sum_i |p_i - q_i|` (Liger ``LigerTVDLoss``, ``liger_kernel/ops/tvd.py``).

The gradient does not depend on ``|p - q|``, only on its sign, so with a reduction it is written
here, in forward, and backward has nothing left to read. The grid, the ignored rows, the partial
sums, the gradient's ``scale`` and upstream factor are the shared stage of :mod:`.row_blocks`.

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

from .row_blocks import BLOCK, NUM_WARPS, launch_row_kernel, num_programs, row_block, store_row_block

__all__ = ["BLOCK", "NUM_WARPS", "num_programs", "tvd_kernel", "launch_tvd"]


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
    pid, offsets, in_row, mask = row_block(label_ptr, ignore_index, n_cols, blocks_per_row, HAS_LABEL, BLOCK)
    p = tl.load(p_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    diff = p - q
    loss = 0.5 * tl.abs(diff)
    # sign(diff) / 2: 0 where p == q, NaN (diff itself) where diff is NaN.
    half_sign = tl.where(diff > 0.0, 0.5, tl.where(diff < 0.0, -0.5, tl.where(diff == 0.0, 0.0, diff)))
    store_row_block(pid, offsets, in_row, mask, loss, half_sign, partial_ptr, loss_ptr, grad_ptr, scale_ptr,
                    upstream_ptr, REDUCE, WRITE_LOSS, WRITE_GRAD, UPSTREAM)


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

    The buffers and factors as :func:`.row_blocks.launch_row_kernel` takes them.
    """
    launch_row_kernel(
        tvd_kernel, p, q, (), {},
        label=label, ignore_index=ignore_index, partial=partial, loss=loss, grad=grad, scale=scale,
        upstream=upstream, block=block, num_warps=num_warps,
    )
