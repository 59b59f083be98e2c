r"""The plain cross-entropy's gradient on class-major logits, written over them.

What it computes
----------------
For logits stored class-major, :math:`z^\top` (``V × N``: the ``N`` rows' logits of class :math:`j`
contiguous), each row's log-sum-exp :math:`\mathrm{lse}_i`, target :math:`y_i` and one factor
:math:`g` (the reduction's: :math:`1/n` for ``mean``, 1 for ``sum``),

.. math::

    dz^\top_{ji} = g\,\big(e^{z_{ij} - \mathrm{lse}_i} - [j = y_i]\big)
    \qquad (0 \text{ where } y_i = \text{ignore\_index}),

the gradient of :math:`g \sum_i (\mathrm{lse}_i - z_{i y_i})`, written in place over :math:`z^\top`.
A NaN logit or lse gives NaN in its row's gradient.

Why class-major: the fused cross-entropy's single-chunk route
(:mod:`kernels_lib._flce.class_major`) keeps :math:`z^\top` in the weight gradient's own
buffer, whose row blocks ``dW[v0:v1] = dz^T[v0:v1] x`` then replace the logits they were formed from.

What it costs
-------------
One read and one write of the ``V × N`` logits (``2·e·N·V`` bytes, ``e`` = 2 for bf16), one ``exp``
per logit, and ``8·N`` bytes of lse and targets per program's column block. One program per
``BLOCK_V × BLOCK_N`` tile, rows of the tile contiguous in memory (along ``N``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Classes and rows per program, and warps: 32 × 256 elements (16 KiB of bf16) per tile.
BLOCK_V, BLOCK_N, NUM_WARPS = 32, 256, 4


@triton.jit
def class_major_gradient_kernel(
    z_ptr,  # [V, N] class-major logits, unit stride along N; overwritten with dz^T (its dtype)
    stride_class,  # elements between classes of z
    lse_ptr,  # float32 [N]: each row's log-sum-exp
    target_ptr,  # int32/int64 [N]: each row's class, or ignore_index
    scale_ptr,  # float32 [1]: the factor g
    n_rows,  # N
    n_cols,  # V
    ignore_index,  # target of rows without a gradient
    BLOCK_V: tl.constexpr,  # classes per tile
    BLOCK_N: tl.constexpr,  # rows per tile
):
    classes = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    y = tl.load(target_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    g = tl.load(scale_ptr)
    ptrs = z_ptr + classes.to(tl.int64)[:, None] * stride_class + rows[None, :]
    mask = (classes < n_cols)[:, None] & row_ok[None, :]
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    onehot = tl.where(classes.to(tl.int64)[:, None] == y[None, :], 1.0, 0.0)
    dz = tl.where((y != ignore_index)[None, :], g * (tl.exp(z - lse[None, :]) - onehot), 0.0)
    tl.store(ptrs, dz.to(z_ptr.dtype.element_ty), mask=mask)


def launch_class_major_gradient(z_t: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor,
                                ignore_index: int) -> None:
    """Overwrite class-major logits ``z_t`` (``V × N``, unit stride along ``N``) with ``dz^T`` (module
    docstring), from float32 ``lse`` ``(N,)``, contiguous ``target`` ``(N,)`` and a one-element float32
    ``scale`` on the device."""
    n_cols, n_rows = z_t.shape
    if z_t.stride(1) != 1 or scale.numel() != 1:
        raise ValueError(f"launch_class_major_gradient: z_t needs unit stride along N (got strides {tuple(z_t.stride())}) "
                         f"and scale one element (got shape {tuple(scale.shape)})")
    grid = (triton.cdiv(n_cols, BLOCK_V), triton.cdiv(n_rows, BLOCK_N))
    class_major_gradient_kernel[grid](z_t, z_t.stride(0), lse, target, scale, n_rows, n_cols, int(ignore_index),
                                      BLOCK_V=BLOCK_V, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS)
