r"""The sequence losses' gradient pass in row × vocabulary tiles, with the bias gradient's column sums on the way:
a variant of ``kernels_lib.kernels.token_logprobs``'s gradient pass under study.

What it computes
----------------
Exactly what :func:`kernels_lib.kernels.token_logprobs.launch_token_logprobs_grad` writes in place of a chunk's
logits ``z`` (``rows × V``), with the same arguments:

.. math::

    dz_{ij} = w_i\,(\delta_{j y_i} - p_{ij}) + w'_i\,(\delta_{j y'_i} - p_{ij}), \qquad p_{ij} = e^{z_{ij} - \mathrm{lse}_i},

the target's :math:`1 - p_{iy}` taken from the stored log-prob (``-expm1(log p(y))``), and, when asked, the
column sums of the ``dz`` it stored (rounded to the chunk's dtype first, so they are the sums of the very
values the matmuls read) per block of ``BLOCK_R`` rows: ``partial[k, j] = Σ_{i in block k} dz_ij`` in float32.
The chunk's bias gradient is then ``partial.sum(0)`` (a fixed order: deterministic, no atomics).

Why a variant
-------------
The library's pass runs one program per row over the whole vocabulary, so a column sum over rows would need
atomics across programs; the library instead reads the finished ``dz`` once more (``dz.sum(0)``, torch's reduce).
At KTO's published workload (``H = 1024``, with a bias) that reduce took 1.71 ms of a 28.5 ms call on the H100
(``data/measured/gpu_runs/loss_profile_kernels.csv``, B = 32): one more read of every chunk's logits. Here a
program holds a ``BLOCK_R × BLOCK_V`` tile, so its column sums come from registers; the extra traffic is the
partial sums, ``4·V·rows/BLOCK_R`` bytes per chunk against ``rows·V·e`` for the read it replaces
(``e = 2``: 1/8 of it at ``BLOCK_R = 16``). Without a bias only the tiling differs (more programs, each
reading a row's ``lse``, weights and target once per tile instead of once per row).

What it costs
-------------
Per logit: one read, one write, one ``exp``, ~6 FLOPs (as the library's pass); per tile ``BLOCK_V`` float32
partial sums written; the reduce of the partials reads ``rows / BLOCK_R × V`` float32.

Not the library's default: :mod:`studies.token_grad_tiles_ab` measures it against the library's pass on a GPU.
:func:`arm` gives the settings that put it in place for an A/B's calls (:func:`studies.bench.arms.constants_set`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: (BLOCK_R, BLOCK_V, num_warps) of the default tile.
TILE = (16, 1024, 8)


@triton.jit
def token_grad_tiles_kernel(
    logits_ptr,  # [rows, V] logits of the chunk (fp32/bf16/fp16); overwritten with dz
    stride_row,  # elements between consecutive rows of logits
    target_ptr,  # [rows] int32/int64 targets y, ignore_index allowed
    target2_ptr,  # [rows] second targets y' (read only when HAS_SECOND)
    lse_ptr,  # float32 [rows]
    one_minus_p_ptr,  # float32 [rows]: 1 - p(y) = -expm1(log p(y))
    weight_ptr,  # float32: w of row i at weight_ptr[i // rows_per_weight]
    weight2_ptr,  # float32: w' (HAS_SECOND)
    partial_ptr,  # float32 [cdiv(rows, BLOCK_R), n_cols]: per row block, the column sums of dz (WITH_SUMS)
    n_rows,
    rows_per_weight,
    n_cols,
    col_offset,
    ignore_index,
    HAS_SECOND: tl.constexpr,
    WITH_SUMS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    block = tl.program_id(0).to(tl.int64)
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_rows = rows < n_rows
    in_cols = cols < n_cols
    # Targets are global; a target outside this row's columns (another shard's, or out of range on one
    # process, which the caller refuses once the call is queued) matches no column here.
    y = tl.load(target_ptr + rows, mask=in_rows, other=ignore_index).to(tl.int64)
    valid = (y != ignore_index) & in_rows
    y -= col_offset
    seq = rows // rows_per_weight
    w = tl.where(valid, tl.load(weight_ptr + seq, mask=in_rows, other=0.0), 0.0)
    w_total = w
    w_at_y = w
    if HAS_SECOND:
        y2 = tl.load(target2_ptr + rows, mask=in_rows, other=ignore_index).to(tl.int64)
        valid2 = (y2 != ignore_index) & in_rows
        y2 -= col_offset
        w2 = tl.where(valid2, tl.load(weight2_ptr + seq, mask=in_rows, other=0.0), 0.0)
        w_total += w2
        w_at_y += tl.where(y2 == y, w2, 0.0)
    lse = tl.load(lse_ptr + rows, mask=in_rows, other=0.0)
    q_y = tl.load(one_minus_p_ptr + rows, mask=in_rows, other=0.0)

    mask = in_rows[:, None] & in_cols[None, :]
    ptrs = logits_ptr + rows[:, None] * stride_row + cols[None, :]
    z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(z - lse[:, None])
    at_y = cols[None, :] == y[:, None]
    dz = tl.where(at_y, (w_at_y * q_y)[:, None] - (w_total - w_at_y)[:, None] * p, -w_total[:, None] * p)
    if HAS_SECOND:
        dz += tl.where((cols[None, :] == y2[:, None]) & (y2 != y)[:, None], w2[:, None], 0.0)
    stored = dz.to(logits_ptr.dtype.element_ty)
    tl.store(ptrs, stored, mask=mask)
    if WITH_SUMS:
        sums = tl.sum(tl.where(mask, stored.to(tl.float32), 0.0), axis=0)
        tl.store(partial_ptr + block * n_cols + cols, sums, mask=in_cols)


def launch_token_grad_tiles(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    lse: torch.Tensor,
    logp: torch.Tensor,
    weight: torch.Tensor,
    rows_per_weight: int,
    ignore_index: int,
    target2: torch.Tensor | None = None,
    weight2: torch.Tensor | None = None,
    col_offset: int = 0,
    column_sums: bool = False,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor | None:
    """The library's gradient pass (same arguments, ``dz`` in place); with ``column_sums`` also returns the
    float32 ``(V,)`` column sums of the stored ``dz`` (the chunk's bias gradient before ``unscale``), else None.
    ``tile``: ``(BLOCK_R, BLOCK_V, num_warps)``, :data:`TILE` by default."""
    if (target2 is None) != (weight2 is None):
        raise ValueError("give target2 and weight2 together")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a rows x V chunk with unit stride along V, got shape {tuple(logits.shape)}")
    block_r, block_v, num_warps = tile or TILE
    rows, n_cols = logits.shape
    one_minus_p = torch.expm1(logp).neg_()
    n_blocks = triton.cdiv(rows, block_r)
    partial = torch.empty((n_blocks, n_cols) if column_sums else (1,), dtype=torch.float32, device=logits.device)
    token_grad_tiles_kernel[(n_blocks, triton.cdiv(n_cols, block_v))](
        logits, logits.stride(0), target, target if target2 is None else target2, lse, one_minus_p,
        weight, weight if weight2 is None else weight2, partial, rows, int(rows_per_weight), n_cols, int(col_offset),
        int(ignore_index), HAS_SECOND=target2 is not None, WITH_SUMS=column_sums, BLOCK_R=block_r, BLOCK_V=block_v,
        num_warps=num_warps,
    )
    return partial.sum(0) if column_sums else None


def make_two_pass_gradient(tile: tuple[int, int, int] | None = None):
    """A drop-in for :func:`kernels_lib._sequence_logprobs.two_pass_gradient` that runs the tiled pass with
    ``tile`` and adds the bias gradient from its column sums (no second read of ``dz``)."""

    def two_pass_gradient(grads, logits, x_c, w_ops, rows, target, y2, lse, logp, w, w2, rows_per_weight,
                          ignore_index, col_offset):
        unscale = grads.dz_unscale(lambda: torch.stack([w.abs().max()] + ([] if w2 is None else [w2.abs().max()])).max())
        if unscale != 1.0:
            w, w2 = w / unscale, None if w2 is None else w2 / unscale
        db = grads.db
        sums = launch_token_grad_tiles(
            logits, target[rows], lse=lse, logp=logp, weight=w.contiguous(), rows_per_weight=rows_per_weight,
            ignore_index=ignore_index, target2=y2, weight2=None if w2 is None else w2.contiguous(),
            col_offset=col_offset, column_sums=db is not None, tile=tile,
        )
        first = grads.first
        grads.db = None  # the library's add_chunk would read dz again for it
        try:
            grads.add_chunk(logits, x_c, w_ops, rows, unscale)
        finally:
            grads.db = db
        if db is not None:
            if first:
                db.copy_(sums.mul_(unscale))
            else:
                db.add_(sums, alpha=unscale)

    return two_pass_gradient


def arm(tile: tuple[int, int, int] | None = None) -> dict[str, dict[str, object]]:
    """The :func:`studies.bench.arms.constants_set` settings that put the tiled pass in every sequence loss."""
    return {"kernels_lib._sequence_logprobs": {"two_pass_gradient": make_two_pass_gradient(tile)}}
