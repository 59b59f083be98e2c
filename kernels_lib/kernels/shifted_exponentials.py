r"""Shifted exponentials instead of logits: the cross-entropy gradient with no pass over the logits.

What it computes
----------------
The fused cross-entropy's gradient with respect to the logits :math:`z = \alpha(xW^\top + b)` is
:math:`dz_{ij} = g_i\,(e^{z_{ij} - \mathrm{lse}_i} - [j = y_i])`. Formed as such it costs a pass
over the ``N × V`` logits after their log-sum-exp is known (read and write, 2 GB per 4096 rows at
V = 128256 in bf16). Instead the logits GEMM's epilogue
(:mod:`kernels_lib.kernels.logits_logsumexp`, its ``shift`` argument) stores, per row :math:`i`,

.. math::

    e_{ij} = e^{z_{ij} - c_i}, \qquad c_i = z_{i y_i} \text{ computed before the GEMM (this module)},

and after the log-sum-exp the target's element becomes :math:`\tilde e_{i y_i} = e_{i y_i} - e^{\mathrm{lse}_i - c_i}`
(the merge of the log-sum-exp partials writes it; for flagged rows, below, the rescaling).
Then :math:`dz = \mathrm{diag}(r)\,\tilde e` with one factor per row, :math:`r_i = g_i\,e^{c_i - \mathrm{lse}_i}`, so

.. math::

    dx = \mathrm{diag}(r)\,(\tilde e\,W), \qquad dW = \tilde e^\top (\mathrm{diag}(r)\,x), \qquad db = \tilde e^\top r:

the matmuls read :math:`\tilde e` as they would read :math:`dz`, and the row factors go on their
``N × H`` operand or result, not on the ``N × V`` buffer. The one-hot term rides inside the
matmuls' float32 sums.

Why :math:`c_i = z_{iy_i}`: it is never above the row's maximum (up to the rounding of two ways of
forming it), so the elements that matter, those within a few tens of the maximum, are at least
:math:`e^{-20}` or so: no underflow in bf16, whose exponent is float32's. A row whose maximum lies
more than :data:`EXP_HEADROOM` above :math:`c_i` (a loss of over 64 nats) would overflow: there the
epilogue shifts each ``BLOCK_N``-column tile by :math:`c'_{it} = \max(c_i, \max_{j \in t} z_{ij} - 64)`
instead, stores :math:`c'_{it}` as that tile's partial maximum, and flags the row;
:func:`launch_rescale_flagged_rows` then brings every tile of a flagged row to the row's largest
shift :math:`c^*_i = \max_t c'_{it}` (the merge's maximum), multiplying by :math:`e^{c'_{it} - c^*_i} \le 1`,
and subtracts the one-hot term :math:`e^{\mathrm{lse}_i - c^*_i}` at the target (for the other rows
:math:`c^*_i = c_i`).
Every stored element is at most :math:`e^{64}`, and a product over ``V`` of them stays finite in
float32. Ignored rows (and out-of-range targets) get :math:`c_i = -\infty`: ignored rows store
zeros (the epilogue's exponent bias is :math:`+\infty` there; a NaN logit of an ignored row stays NaN,
as it does in ``dW`` through :math:`0 \cdot \mathrm{NaN}`), their factor is 0.

Precision: the exponentials are rounded once (relative :math:`2^{-9}` in bf16), where the logits'
own rounding (absolute :math:`2^{-9}|z|`) entered the softmax before; the row factors add one
rounding of the ``N × H`` operand.

What it costs
-------------
:func:`launch_target_logit_shift`: one dot product of ``H`` per row (``x`` and the target rows of
``W``: ``2·e·N·H`` bytes). :func:`launch_rescale_flagged_rows`: a flag read per row and program, and
nothing else unless a row is flagged (then one read and write of that row's stored exponentials).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: The most a stored exponent may reach, :math:`e^{64}` (6e27): a sum of ``V`` such terms times a
#: weight stays far from float32's 3.4e38, and a row's target logit may lie 64 below its maximum
#: before the tiles are shifted apart.
EXP_HEADROOM = 64.0
#: Rows per program and hidden elements per step of the shift kernel (16 × 256 gave 256 programs at
#: N = 4096, too few loads in flight for its 64 MB read).
SHIFT_BLOCK_R, SHIFT_BLOCK_H = 4, 512
#: Rows per program, and vocabulary tiles each program walks, of the rescaling kernel.
RESCALE_BLOCK_R, RESCALE_TILES = 64, 16
#: Columns per program of the row-scaling kernel.
SCALE_BLOCK_H = 1024


@triton.jit
def target_logit_shift_kernel(
    x_ptr,  # [N, H] hidden states (unit stride along H)
    w_ptr,  # [V, H] head (unit stride along H)
    b_ptr,  # [V] bias (read only when HAS_BIAS)
    target_ptr,  # [N] int32/int64 targets
    shift_ptr,  # float32 [N]: c_i = alpha (x_i . W_{y_i} + b_{y_i}), -inf at ignored and out-of-range targets (written)
    n_rows,  # N
    n_cols,  # V
    hidden,  # H
    stride_x,  # elements between rows of x
    stride_w,  # elements between rows of W
    alpha,  # the logits' scale
    ignore_index,  # target of rows without a gradient
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # hidden elements per step
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    y = tl.load(target_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    valid = row_ok & (y != ignore_index) & (y >= 0) & (y < n_cols)
    y = tl.where(valid, y, 0)
    acc = tl.zeros((BLOCK_R,), tl.float32)
    for h in range(0, hidden, BLOCK_H):
        hs = h + tl.arange(0, BLOCK_H)
        mask = valid[:, None] & (hs < hidden)[None, :]
        xv = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + hs[None, :], mask=mask, other=0.0)
        wv = tl.load(w_ptr + y[:, None] * stride_w + hs[None, :], mask=mask, other=0.0)
        acc += tl.sum(xv.to(tl.float32) * wv.to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + y, mask=valid, other=0.0).to(tl.float32)
    tl.store(shift_ptr + rows, tl.where(valid, alpha * acc, -float("inf")), mask=row_ok)


@triton.jit
def rescale_flagged_rows_kernel(
    out_ptr,  # the stored exponentials, element (i, j) at i * stride_row + j * stride_col (rescaled in place)
    stride_row,  # elements between rows i
    stride_col,  # elements between classes j
    m_ptr,  # float32 [n_tiles, N]: each tile's shift c'_it (the GEMM's partial maxima)
    shift_ptr,  # float32 [N]: each row's largest shift c*_i
    flag_ptr,  # int32 [N]: nonzero where a row's tiles were shifted apart
    lse_ptr,  # float32 [N]: each row's log-sum-exp
    target_ptr,  # int32/int64 [N]: each row's target (flagged rows: not ignore_index)
    n_rows,  # N
    n_cols,  # V
    n_tiles,  # ceil(V / BLOCK_C)
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,  # the GEMM's BLOCK_N: columns per tile
    TILES: tl.constexpr,  # tiles per program
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    flagged = (tl.load(flag_ptr + rows, mask=row_ok, other=0) != 0) & row_ok
    if tl.sum(flagged.to(tl.int32), axis=0) > 0:  # almost never: the other programs only read their flags
        row_shift = tl.load(shift_ptr + rows, mask=flagged, other=0.0)
        # The one-hot term, at the target's column: exp(lse - c*) (at most V e^HEADROOM).
        onehot = tl.exp(tl.load(lse_ptr + rows, mask=flagged, other=0.0) - row_shift)
        y = tl.load(target_ptr + rows, mask=flagged, other=-1).to(tl.int64)
        first = tl.program_id(1) * TILES
        for t in range(first, min(first + TILES, n_tiles)):
            tile_shift = tl.load(m_ptr + t * n_rows + rows, mask=flagged, other=0.0)
            factor = tl.exp(tile_shift - row_shift)
            cols = t * BLOCK_C + tl.arange(0, BLOCK_C)
            ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_row + cols.to(tl.int64)[None, :] * stride_col
            mask = flagged[:, None] & (cols < n_cols)[None, :]
            e = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            e = e * factor[:, None] - tl.where(cols.to(tl.int64)[None, :] == y[:, None], onehot[:, None], 0.0)
            tl.store(ptrs, e.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def scale_rows_kernel(
    src_ptr,  # [N, H] rows to scale (unit stride along H)
    dst_ptr,  # [N, H] the scaled rows, in its dtype (may be src itself)
    factor_ptr,  # float32 [N]: each row's factor u_i
    scale_ptr,  # float32 [1]: one more factor g for every row
    hidden,  # H
    stride_src,  # elements between rows of src
    stride_dst,  # elements between rows of dst
    BLOCK_H: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    factor = tl.load(factor_ptr + row) * tl.load(scale_ptr)
    v = tl.load(src_ptr + row * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + row * stride_dst + cols, (v * factor).to(dst_ptr.dtype.element_ty), mask=mask)


def launch_target_logit_shift(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                              alpha: float, ignore_index: int) -> torch.Tensor:
    """Each row's target logit :math:`c_i` (float32 ``(N,)``, ``-inf`` at ignored and out-of-range
    targets), the shift of the stored exponentials; ``x`` and ``weight`` with unit stride along ``H``."""
    n_rows, hidden = x.shape
    shift = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    target_logit_shift_kernel[(triton.cdiv(n_rows, SHIFT_BLOCK_R),)](
        x, weight, bias if bias is not None else x, target, shift, n_rows, weight.shape[0], hidden, x.stride(0),
        weight.stride(0), float(alpha), int(ignore_index), HAS_BIAS=bias is not None, BLOCK_R=SHIFT_BLOCK_R,
        BLOCK_H=SHIFT_BLOCK_H, num_warps=4,
    )
    return shift


def launch_rescale_flagged_rows(out: torch.Tensor, partial_shift: torch.Tensor, shift: torch.Tensor,
                                flags: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, tile_cols: int) -> None:
    """Bring the tiles of each flagged row of ``out`` (``(N, V)``, any strides: a class-major buffer's
    ``.t()`` too) from their own shifts (``partial_shift``, ``(n_tiles, N)``) to the row's ``shift``,
    and subtract the one-hot term ``exp(lse - shift)`` at its target (the merge does it for the others)."""
    n_rows, n_cols = out.shape
    n_tiles = partial_shift.shape[0]
    grid = (triton.cdiv(n_rows, RESCALE_BLOCK_R), triton.cdiv(n_tiles, RESCALE_TILES))
    rescale_flagged_rows_kernel[grid](
        out, out.stride(0), out.stride(1), partial_shift, shift, flags, lse, target, n_rows, n_cols, n_tiles,
        BLOCK_R=RESCALE_BLOCK_R, BLOCK_C=tile_cols, TILES=RESCALE_TILES, num_warps=4,
    )


def launch_scale_rows(src: torch.Tensor, factors: torch.Tensor, scale: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = src[i] · factors[i] · scale`` (rounded once to ``out``'s dtype; ``out`` a new tensor like
    ``src`` unless given, ``src`` itself allowed): the gradient's row factors on an ``N × H`` operand or
    result. ``src``/``out`` with unit stride along ``H``; ``factors`` float32 ``(N,)``, ``scale`` a
    one-element float32 tensor on the device."""
    out = torch.empty_like(src) if out is None else out
    n_rows, hidden = src.shape
    if n_rows:
        scale_rows_kernel[(n_rows, triton.cdiv(hidden, SCALE_BLOCK_H))](
            src, out, factors, scale, hidden, src.stride(0), out.stride(0), BLOCK_H=SCALE_BLOCK_H, num_warps=4)
    return out
