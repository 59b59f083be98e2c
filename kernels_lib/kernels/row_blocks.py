r"""Shared stage of the elementwise row divergences (JSD, TVD): the grid, the row mask, the outputs.

Both kernels read two ``(n_rows, n_cols)`` inputs and compute, per element, a loss :math:`\ell` and
its derivative with respect to the first input. What they share lives here:

- the grid: one program per (row, block of ``BLOCK`` columns), flattened into one axis (so any
  number of rows fits and the row's label is loaded once per program); :func:`row_block` gives a
  program its element offsets and mask, the mask empty on a row whose label is ``ignore_index``
  (``HAS_LABEL``), so such a row is not read and contributes 0;
- the outputs, :func:`store_row_block`: one float32 partial sum per program for the reductions
  (summed afterwards by torch in a fixed order: deterministic, no atomics), the pointwise loss, and
  the gradient times ``scale`` (read from device memory: no host sync) and, with ``UPSTREAM``, times
  the pointwise upstream gradient (``reduction="none"``'s backward);
- the launcher, :func:`launch_row_kernel`: the checks, the scale as a device tensor, the grid.

Cost of this part: the loads and stores (12 bytes per fp32 element with the gradient, 8 without)
plus one label per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Columns per program (at most; the launcher shrinks it to the next power of two of ``n_cols``).
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def row_block(
    label_ptr,  # int32/int64[n_rows]: the row's label (read only when HAS_LABEL)
    ignore_index,  # int: rows whose label equals it are not read
    n_cols,  # classes per row
    blocks_per_row,  # cdiv(n_cols, BLOCK)
    HAS_LABEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``(pid, offsets, in_row, mask)`` of this program: ``in_row`` the columns inside the row,
    ``mask`` those to read (none on an ignored row)."""
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
    return pid, offsets, in_row, mask


@triton.jit
def store_row_block(
    pid, offsets, in_row, mask,  # from row_block
    loss,  # float32 [BLOCK]: the pointwise loss
    grad,  # float32 [BLOCK]: d loss / d (first input), before scale and upstream
    partial_ptr,  # float32[num_programs]: each program's sum of the loss (REDUCE)
    loss_ptr,  # the pointwise loss, n_rows * n_cols elements (WRITE_LOSS)
    grad_ptr,  # the gradient, n_rows * n_cols elements (WRITE_GRAD)
    scale_ptr,  # float32[1]: the gradient's factor (the reduction's)
    upstream_ptr,  # the pointwise upstream gradient (UPSTREAM)
    REDUCE: tl.constexpr,
    WRITE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    UPSTREAM: tl.constexpr,
):
    """Write what the flags ask for; masked lanes (and ignored rows) write 0."""
    loss = tl.where(mask, loss, 0.0)
    if REDUCE:
        tl.store(partial_ptr + pid, tl.sum(loss, axis=0))
    if WRITE_LOSS:
        tl.store(loss_ptr + offsets, loss.to(loss_ptr.dtype.element_ty), mask=in_row)
    if WRITE_GRAD:
        grad = tl.where(mask, grad, 0.0) * tl.load(scale_ptr)
        if UPSTREAM:
            grad = grad * tl.load(upstream_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_ptr + offsets, grad.to(grad_ptr.dtype.element_ty), mask=in_row)


def block_for(n_cols: int, block: int = BLOCK) -> int:
    """Columns per program: ``block``, or the next power of two of ``n_cols`` when that is smaller."""
    return min(block, triton.next_power_of_2(n_cols))


def num_programs(n_rows: int, n_cols: int, block: int = BLOCK) -> int:
    """The grid size (the length of the partial-sum buffer): rows times column blocks."""
    return n_rows * triton.cdiv(n_cols, block_for(n_cols, block))


def launch_row_kernel(
    kernel,
    first: torch.Tensor,
    second: torch.Tensor,
    scalars: tuple,
    constexprs: dict,
    *,
    label: torch.Tensor | None,
    ignore_index: int,
    partial: torch.Tensor | None,
    loss: torch.Tensor | None,
    grad: torch.Tensor | None,
    scale: torch.Tensor | float,
    upstream: torch.Tensor | None,
    block: int,
    num_warps: int,
) -> None:
    """Launch a row-divergence ``kernel`` whose arguments are ``(first, second, label, upstream, scale,
    partial, loss, grad, n_cols, blocks_per_row, ignore_index, *scalars, HAS_LABEL, REDUCE,
    WRITE_LOSS, WRITE_GRAD, UPSTREAM, BLOCK, **constexprs)`` on contiguous ``(n_rows, n_cols)`` inputs.

    Any of ``partial`` (float32, :func:`num_programs` elements), ``loss`` and ``grad`` (n_rows * n_cols
    elements) is written when given; buffers are written, never read (tests pass NaN-poisoned ones).
    ``scale`` multiplies the gradient (a float, or a one-element tensor on the device: then no host
    sync); ``upstream`` multiplies it pointwise; ``label`` (n_rows integers) marks ignored rows.
    """
    if partial is None and loss is None and grad is None:
        raise ValueError("give at least one of partial, loss and grad to write")
    if upstream is not None and grad is None:
        raise ValueError("upstream multiplies the gradient: give grad too")
    n_cols = first.shape[-1]
    n_rows = first.numel() // n_cols
    blk = block_for(n_cols, block)
    if not isinstance(scale, torch.Tensor):
        scale = torch.full((1,), float(scale), dtype=torch.float32, device=first.device)  # a fill: no host copy
    scale = scale.to(torch.float32).reshape(1)
    # Unused pointers still need a tensor argument; the constexpr flags keep them unread and unwritten.
    kernel[(num_programs(n_rows, n_cols, block),)](
        first,
        second,
        label if label is not None else first,
        upstream if upstream is not None else first,
        scale,
        partial if partial is not None else scale,
        loss if loss is not None else first,
        grad if grad is not None else first,
        n_cols,
        triton.cdiv(n_cols, blk),
        int(ignore_index),
        *scalars,
        HAS_LABEL=label is not None,
        REDUCE=partial is not None,
        WRITE_LOSS=loss is not None,
        WRITE_GRAD=grad is not None,
        UPSTREAM=upstream is not None,
        BLOCK=blk,
        num_warps=num_warps,
        **constexprs,
    )
