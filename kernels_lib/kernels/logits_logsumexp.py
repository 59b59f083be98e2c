r"""Log-sum-exp of the LM head's logits in the epilogue of their matmul: the logits need not reach memory.

What it computes
----------------
For hidden states :math:`x` (``N × H``), a head :math:`W` (``V × H``), an optional bias :math:`b`
(``V``) and a scale :math:`\alpha`, the logits are :math:`z = \alpha\,(x W^\top + b)` and, per row,

.. math::

    \mathrm{lse}_i = \log \sum_{j < V} e^{z_{ij}}, \qquad
    t_i = z_{i, y_i} \quad (0 \text{ where } y_i = \text{ignore\_index}),

both float32; :math:`t` only with targets :math:`y` (``N``). On request (``logits_out``) the
epilogue also stores :math:`z` itself, in the inputs' dtype: the fused loss's gradient pass
(:mod:`kernels_lib._flce.chunked`) then reads the logits once with the log-sum-exp
known, instead of twice; or class-major, :math:`z^\top` (``V × N``, given as the ``.t()`` of such a
buffer: the tile goes out transposed), for the route that keeps the logits inside the weight
gradient's buffer. Then :math:`\mathrm{lse}` and :math:`t` are those of the logits as stored
(rounded to that dtype), so that :math:`e^{z_{ij} - \mathrm{lse}_i}` over the stored row sums to 1: a
float32 lse beside bf16 logits gave dW a larger error than the two-pass kernel's, the softmax's
rounding no longer normalized away. A NaN anywhere in row :math:`i` of
:math:`z` gives :math:`\mathrm{lse}_i = \mathrm{NaN}`; a target outside ``[0, V)`` (and not
``ignore_index``) gives :math:`t_i = \mathrm{NaN}` (no host sync to check it).

How
---
**Tiles.** One program per ``BLOCK_M × BLOCK_N`` tile of :math:`z`, ordered in groups of
``GROUP_M`` row blocks that sweep the vocabulary together, so that a tile of :math:`W` read by one
of them is still in L2 for the others (the swizzle of Triton's matmul tutorial). The program runs
the ``H`` loop with ``tl.dot`` (bf16/fp16/fp32 inputs, fp32 accumulator), then, on the
accumulator in registers: adds the bias, scales by :math:`\alpha`, sets columns ``≥ V`` to
:math:`-\infty`, and reduces each row of the tile to its maximum and shifted sum

.. math:: m_{bi} = \max_{j \in \text{block } b} z_{ij}, \qquad s_{bi} = \sum_{j \in \text{block } b} e^{z_{ij} - m_{bi}},

stored to float32 partials ``[n_blocks, N]`` (``n_blocks = ceil(V / BLOCK_N)``). The target
logit lies in exactly one tile, which stores it: no race, no atomics.

**Merge.** A second, small kernel (one program per ``BLOCK_R`` rows) walks the ``n_blocks``
partials of its rows ``BLOCK_B`` blocks at a time with the online rule: per step the steps' maximum
:math:`M' = \max(M, \max_b m_b)` and :math:`S \leftarrow S e^{M - M'} + \sum_b s_b e^{m_b - M'}`; it writes
:math:`\mathrm{lse} = M + \log S`, and :math:`t_i = 0` at ignored rows (NaN at out-of-range targets),
which no tile touches. (One block per step, 128 rows per program, left 32 programs at N = 4096 each
waiting on 501 dependent loads; 64-block steps over 32 rows put enough loads in flight to fill the GPU.)

**NaN.** ``tl.max`` ignores NaN operands (``maxnum``, compiled and interpreted alike), so :math:`m_b`
may be finite, or :math:`-\infty`, beside a NaN logit; but that logit reaches :math:`s_b` through
:math:`e^{z - m_b}` and from there the merged :math:`S` (:math:`\mathrm{NaN} \cdot 0 = \mathrm{NaN}`), so the
row's lse is NaN.

**Hopper path** (``config["TMA"] = True``). The same tiles and epilogue, but the ``H`` loop loads its
tiles with TMA through tensor descriptors built on the device (``tl.make_tensor_descriptor``; their
scratch comes from ``triton.set_allocator``, set to a torch allocation unless one is already set).
The descriptors pad out-of-bounds rows, columns and ``H`` elements with zeros, so no index wraps or
masks remain in the loop. With ``PERSISTENT`` a grid of one program per SM walks the tiles (same
grouped order, stride = number of SMs) in one flattened loop, so the next tile's loads are issued
while this tile's epilogue runs; ``TMA_STORE`` stores the logits tile (``logits_out``) by TMA from
shared memory instead of by each thread; ``WARP_SPECIALIZE`` asks Triton to split that loop between
producer (TMA) and consumer (wgmma) warps. TMA needs compute capability >= 9.0, contiguous ``x``
and ``W`` with 16-byte aligned data pointers and rows of a multiple of 16 bytes (``H`` a multiple
of 8 for 16-bit inputs, of 4 for float32); otherwise :func:`tma_unsupported_reason` says why and the
launch falls back to the pointer kernel with a :class:`TmaFallbackWarning` naming that reason.

What it costs
-------------
FLOPs: :math:`2 N H V` in the matmul, plus about 5 and one ``exp`` per logit in the epilogue
(nothing next to the :math:`2H` of the dot product). Bytes: ``x`` is read once per vocabulary block
(``e·N·H·ceil(V/BLOCK_N)``, ``e`` = 2 or 4 bytes) and ``W`` once per row block
(``e·V·H·ceil(N/BLOCK_M)``), mostly from L2 thanks to the grouping, as in any tiled matmul. Written
are only the partials, ``8·N·ceil(V/BLOCK_N)`` bytes (8/BLOCK_N bytes per logit: 1/32 of a bf16
logit at ``BLOCK_N = 256``), read once more by the merge, and ``4·N`` (``8·N``) bytes of output;
with ``logits_out``, the ``e·N·V`` bytes of the logits besides, as any logits matmul writes them.
The unfused path (``torch.logsumexp(x @ W.T, -1)``) writes the ``N·V`` logits and reads them back,
``2·e·N·V`` bytes and ``e·N·V`` of memory (8 GiB for 32k tokens × 128k classes in bf16), a
memory-bound pass after the matmul; here the stage is bound by the matmul alone. Offsets are 64-bit
where ``N·V`` or ``V·H`` may exceed 2**31.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
import triton
import triton.language as tl

from .. import _validate as v
from .._autocast import compute_dtype_for
from .._runtime import INTERPRETED
from .shifted_exponentials import EXP_HEADROOM, launch_rescale_flagged_rows

_TILE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64)
#: The launch without ``config`` where the TMA kernel can take 16-bit inputs (Hopper): tiles loaded by TMA
#: from tensor descriptors, one program per SM looping over the tiles in groups of 16 row blocks: the
#: fastest of the Hopper candidates measured beside cuBLAS's logits matmul (notebook 01).
TMA_DEFAULT_CONFIG = dict(_TILE, GROUP_M=16, num_warps=8, num_stages=3, TMA=True, PERSISTENT=True)
#: The same where ``logits_out`` is given: the logits tile stored by TMA from shared memory rather than by
#: each thread (one bulk copy per tile, no per-thread stores).
TMA_LOGITS_OUT_CONFIG = dict(TMA_DEFAULT_CONFIG, TMA_STORE=True)
#: The launch without ``config`` otherwise: the fastest measured pointer-based (``tl.load``) config.
DEFAULT_CONFIG = dict(_TILE, GROUP_M=8, num_warps=8, num_stages=3)
#: The configs the default routes launch, the Hopper one first (the other candidates measured against
#: them are the studies': ``studies/kernels/logits_logsumexp_configs.py``).
CONFIGS = [TMA_DEFAULT_CONFIG, DEFAULT_CONFIG]
#: In Triton's interpreter every program is a Python loop: small tiles keep tests fast and still
#: cover several row, vocabulary and ``H`` blocks.
INTERPRETED_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=1)
#: Boolean config keys, all False unless given: the Hopper path and its variants.
FLAG_KEYS = ("TMA", "PERSISTENT", "WARP_SPECIALIZE", "TMA_STORE")
#: "SMs" of the interpreter: the persistent grid's size there (small, so programs take several tiles).
INTERPRETED_NUM_SMS = 3
#: Rows per program of the merge kernel, and the vocabulary blocks' partials it reads per step.
BLOCK_R, BLOCK_B = 32, 64
#: :math:`\log_2 e`: the epilogue forms its exponentials as ``exp2`` of the logits in base-2 units.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _store_tile(stored, rows, cols, off_m, pid_n, out_ptr, out_desc, stride_out, row_ok, col_ok,
                OUT_TMA: tl.constexpr, OUT_TRANSPOSED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store a tile of the output: by TMA through ``out_desc`` with ``OUT_TMA`` (which clips the rows and
    columns beyond N and V), else by masked stores; transposed into a class-major ``[V, N]`` output
    with ``OUT_TRANSPOSED``."""
    if OUT_TMA and OUT_TRANSPOSED:
        out_desc.store([tl.cast(pid_n * BLOCK_N, tl.int32), off_m], tl.trans(stored))
    elif OUT_TMA:
        out_desc.store([off_m, tl.cast(pid_n * BLOCK_N, tl.int32)], stored)
    elif OUT_TRANSPOSED:
        out = out_ptr + cols.to(tl.int64)[None, :] * stride_out + rows[:, None]
        tl.store(out, stored, mask=row_ok[:, None] & col_ok[None, :])
    else:
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out, stored, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _tile_epilogue(
    acc, rows, cols, off_m, pid_n, b_ptr, target_ptr, m_ptr, s_ptr, target_logit_ptr, out_ptr, out_desc, stride_out,
    shift_ptr, flag_ptr, n_rows, n_cols, alpha, ignore_index, HAS_BIAS: tl.constexpr, HAS_TARGET: tl.constexpr,
    STORE_LOGITS: tl.constexpr, SHIFTED: tl.constexpr, HEADROOM: tl.constexpr, OUT_TMA: tl.constexpr,
    OUT_TRANSPOSED: tl.constexpr, EVEN_N: tl.constexpr, ALPHA_POSITIVE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    r"""Bias, scale, -inf beyond V; store the tile's row maxima and shifted sums, the target logits it
    holds and, with ``STORE_LOGITS``, the tile itself (:func:`_store_tile`). With ``SHIFTED``, the
    tile's shifted exponentials instead (:mod:`~kernels_lib.kernels.shifted_exponentials`) and no target
    logit (the merge takes the shift's): the row's shift ``max(c_i, tile max - HEADROOM)`` stored as the
    partial maximum, the row flagged where that is not ``c_i``, zeros stored at ignored rows.

    Unless the logits themselves are stored, the scale rides in the exponent: with ``ALPHA_POSITIVE``
    (``alpha > 0``) a row's maximum is ``alpha · max_j acc_ij`` and each exponential one FMA and one
    ``exp2``, :math:`2^{\,acc \cdot \alpha \log_2 e \;-\; m \log_2 e}`; an ignored row's exponent
    bias is :math:`+\infty`, so its exponentials are 0 with no select per element (NaN where its
    logits are NaN). ``EVEN_N`` (``V`` a multiple of ``BLOCK_N``) drops the column mask. Per logit that
    is a max, an FMA, an ``exp2``, the rounding to the stored dtype and back, and an add."""
    col_ok = cols < n_cols
    row_ok = rows < n_rows
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if STORE_LOGITS and not SHIFTED:
        z = tl.where(col_ok[None, :], acc * alpha, -float("inf"))
        stored = z.to(out_ptr.dtype.element_ty)
        _store_tile(stored, rows, cols, off_m, pid_n, out_ptr, out_desc, stride_out, row_ok, col_ok, OUT_TMA,
                    OUT_TRANSPOSED, BLOCK_N)
        # The statistics of the logits as stored: a softmax of the stored row then sums to 1.
        z = stored.to(tl.float32)
        m = tl.max(z, axis=1)
        s = tl.sum(tl.exp(z - m[:, None]), axis=1)
    else:
        # t · k is the logit in base-2 units: t the raw accumulator (alpha > 0) or the logit itself.
        if ALPHA_POSITIVE:
            t = acc
            k = alpha * LOG2E
        else:
            t = acc * alpha
            k = LOG2E
        if not EVEN_N:
            t = tl.where(col_ok[None, :], t, -float("inf"))
        m = tl.max(t, axis=1)
        if ALPHA_POSITIVE:
            m = m * alpha
        if SHIFTED:
            c = tl.load(shift_ptr + rows, mask=row_ok, other=-float("inf"))
            m = tl.maximum(c, m - HEADROOM)
            kept = tl.load(target_ptr + rows, mask=row_ok, other=ignore_index) != ignore_index
            bias = tl.where(kept, m * LOG2E, float("inf"))
            e = tl.math.exp2(t * k - bias[:, None]).to(out_ptr.dtype.element_ty)
            _store_tile(e, rows, cols, off_m, pid_n, out_ptr, out_desc, stride_out, row_ok, col_ok, OUT_TMA,
                        OUT_TRANSPOSED, BLOCK_N)
            tl.store(flag_ptr + rows, tl.full((BLOCK_M,), 1, tl.int32), mask=row_ok & kept & (m > c))
            # The sums of the exponentials as stored: the softmax of the stored row sums to 1.
            s = tl.sum(e.to(tl.float32), axis=1)
        else:
            s = tl.sum(tl.math.exp2(t * k - (m * LOG2E)[:, None]), axis=1)
            z = t
    partial = pid_n.to(tl.int64) * n_rows + rows
    tl.store(m_ptr + partial, m, mask=row_ok)
    tl.store(s_ptr + partial, s, mask=row_ok)

    if HAS_TARGET and not SHIFTED:
        y = tl.load(target_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
        mine = row_ok & (y != ignore_index) & (y >= pid_n * BLOCK_N) & (y < pid_n * BLOCK_N + BLOCK_N) & (y < n_cols)
        z_y = tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        if ALPHA_POSITIVE and not STORE_LOGITS:  # z is the raw accumulator
            z_y = z_y * alpha
        tl.store(target_logit_ptr + rows, z_y, mask=mine)


@triton.jit
def logits_lse_partials_kernel(
    x_ptr,  # [N, H] hidden states (bf16/fp16/fp32)
    w_ptr,  # [V, H] head, dtype of x
    b_ptr,  # [V] bias, dtype of x (read only when HAS_BIAS)
    target_ptr,  # [N] int32/int64 targets, ignore_index allowed (read only when HAS_TARGET)
    m_ptr,  # float32 [n_blocks, N]: per tile row maxima m_bi (written)
    s_ptr,  # float32 [n_blocks, N]: per tile row sums s_bi = sum_j exp(z_ij - m_bi) (written)
    target_logit_ptr,  # float32 [N]: z_{i, y_i}, written by the tile holding column y_i (HAS_TARGET)
    out_ptr,  # [N, V] the logits z, dtype of x, unit stride along V, or [V, N] with OUT_TRANSPOSED (STORE_LOGITS)
    stride_out,  # elements between rows of out (between classes with OUT_TRANSPOSED)
    shift_ptr,  # float32 [N]: each row's shift c_i, -inf at ignored rows (SHIFTED)
    flag_ptr,  # int32 [N], zeros: set to 1 where a row's tiles take shifts of their own (SHIFTED)
    n_rows,  # N
    n_cols,  # V
    hidden,  # H
    stride_xn, stride_xk,  # strides of x (elements)
    stride_wv, stride_wk,  # strides of W (elements)
    alpha,  # the logits' scale
    ignore_index,  # target value of rows without a target logit
    HAS_BIAS: tl.constexpr,  # add b before scaling
    HAS_TARGET: tl.constexpr,  # store the target logits
    STORE_LOGITS: tl.constexpr,  # also store the logits themselves (the fused loss's gradient pass reads them)
    SHIFTED: tl.constexpr,  # store the shifted exponentials exp(z - shift) instead of the logits
    HEADROOM: tl.constexpr,  # the largest exponent stored with SHIFTED
    OUT_TRANSPOSED: tl.constexpr,  # store them class-major: out is [V, N] with unit stride along N
    EVEN_N: tl.constexpr,  # V is a multiple of BLOCK_N: no column beyond V to mask
    ALPHA_POSITIVE: tl.constexpr,  # alpha > 0: the scale goes into the exponent's FMA (see _tile_epilogue)
    INPUT_PRECISION: tl.constexpr,  # tl.dot's precision for fp32 inputs: "ieee" or "tf32" (ignored for 16-bit)
    DOT_IN_FP32: tl.constexpr,  # upcast the tiles before tl.dot (Triton's interpreter multiplies bf16's raw bits)
    BLOCK_M: tl.constexpr,  # rows per tile
    BLOCK_N: tl.constexpr,  # vocabulary columns per tile
    BLOCK_K: tl.constexpr,  # hidden elements per step of the dot-product loop
    GROUP_M: tl.constexpr,  # row blocks that sweep the vocabulary together (W tiles reused from L2)
):
    # Grouped order: consecutive programs take GROUP_M row blocks × every vocabulary block, column-major.
    pid = tl.program_id(0)
    n_row_blocks = tl.cdiv(n_rows, BLOCK_M)
    n_col_blocks = tl.cdiv(n_cols, BLOCK_N)
    per_group = GROUP_M * n_col_blocks
    first_row_block = (pid // per_group) * GROUP_M
    group_rows = min(n_row_blocks - first_row_block, GROUP_M)
    pid_m = first_row_block + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Rows ≥ N and columns ≥ V wrap onto valid ones: loads stay in bounds without a mask, and those
    # rows are never stored, those columns set to -inf below. Only the H tail is masked.
    x_tile = x_ptr + (rows % n_rows).to(tl.int64)[:, None] * stride_xn + ks[None, :] * stride_xk
    w_tile = w_ptr + (cols % n_cols).to(tl.int64)[None, :] * stride_wv + ks[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        a = tl.load(x_tile, mask=(k + ks)[None, :] < hidden, other=0.0)
        b = tl.load(w_tile, mask=(k + ks)[:, None] < hidden, other=0.0)
        if DOT_IN_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_tile += BLOCK_K * stride_xk
        w_tile += BLOCK_K * stride_wk

    _tile_epilogue(acc, rows, cols, pid_m * BLOCK_M, pid_n, b_ptr, target_ptr, m_ptr, s_ptr, target_logit_ptr, out_ptr,
                   out_ptr, stride_out, shift_ptr, flag_ptr, n_rows, n_cols, alpha, ignore_index, HAS_BIAS, HAS_TARGET,
                   STORE_LOGITS, SHIFTED, HEADROOM, False, OUT_TRANSPOSED, EVEN_N, ALPHA_POSITIVE, BLOCK_M, BLOCK_N)


@triton.jit
def _tile_coordinates(tile, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Row and vocabulary block of tile number ``tile`` in the grouped order (see the pointer kernel)."""
    n_row_blocks = tl.cdiv(n_rows, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(n_cols, BLOCK_N)
    first_row_block = (tile // per_group) * GROUP_M
    group_rows = min(n_row_blocks - first_row_block, GROUP_M)
    return first_row_block + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _tma_tile(
    tile, x_desc, w_desc, b_ptr, target_ptr, m_ptr, s_ptr, target_logit_ptr, out_ptr, out_desc, stride_out, shift_ptr,
    flag_ptr, n_rows, n_cols, hidden, alpha, ignore_index,
    HAS_BIAS: tl.constexpr, HAS_TARGET: tl.constexpr, STORE_LOGITS: tl.constexpr, SHIFTED: tl.constexpr,
    HEADROOM: tl.constexpr, OUT_TMA: tl.constexpr, OUT_TRANSPOSED: tl.constexpr, EVEN_N: tl.constexpr,
    ALPHA_POSITIVE: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    K_WARP_SPECIALIZE: tl.constexpr,
):
    """One tile: the H loop on TMA-loaded tiles (zero-padded beyond N, V and H), then the epilogue."""
    pid_m, pid_n = _tile_coordinates(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = tl.cast(pid_m * BLOCK_M, tl.int32)  # TMA coordinates are 32-bit
    off_n = tl.cast(pid_n * BLOCK_N, tl.int32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(hidden, BLOCK_K), warp_specialize=K_WARP_SPECIALIZE):
        a = x_desc.load([off_m, tl.cast(k * BLOCK_K, tl.int32)])
        b = w_desc.load([off_n, tl.cast(k * BLOCK_K, tl.int32)])
        if DOT_IN_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    _tile_epilogue(acc, rows, cols, off_m, pid_n, b_ptr, target_ptr, m_ptr, s_ptr, target_logit_ptr, out_ptr, out_desc,
                   stride_out, shift_ptr, flag_ptr, n_rows, n_cols, alpha, ignore_index, HAS_BIAS, HAS_TARGET,
                   STORE_LOGITS, SHIFTED, HEADROOM, OUT_TMA, OUT_TRANSPOSED, EVEN_N, ALPHA_POSITIVE, BLOCK_M, BLOCK_N)


@triton.jit
def logits_lse_partials_tma_kernel(
    x_ptr,  # [N, H] hidden states, contiguous, 16-byte aligned, rows of a multiple of 16 bytes
    w_ptr,  # [V, H] head, same requirements
    b_ptr,  # [V] bias (read only when HAS_BIAS)
    target_ptr,  # [N] targets (read only when HAS_TARGET)
    m_ptr,  # float32 [n_blocks, N]: per tile row maxima (written)
    s_ptr,  # float32 [n_blocks, N]: per tile shifted row sums (written)
    target_logit_ptr,  # float32 [N]: target logits (HAS_TARGET)
    out_ptr,  # [N, V] the logits, or [V, N] with OUT_TRANSPOSED (STORE_LOGITS)
    stride_out,  # elements between rows of out (between classes with OUT_TRANSPOSED)
    shift_ptr,  # float32 [N]: each row's shift (SHIFTED)
    flag_ptr,  # int32 [N]: rows whose tiles take shifts of their own (SHIFTED)
    n_rows,  # N
    n_cols,  # V
    hidden,  # H (also the row stride of x and W)
    alpha,  # the logits' scale
    ignore_index,  # target value of rows without a target logit
    HAS_BIAS: tl.constexpr,
    HAS_TARGET: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    SHIFTED: tl.constexpr,
    HEADROOM: tl.constexpr,
    OUT_TMA: tl.constexpr,  # store the logits by TMA (16-byte aligned out and row stride)
    OUT_TRANSPOSED: tl.constexpr,  # store them class-major ([V, N], unit stride along N)
    EVEN_N: tl.constexpr,
    ALPHA_POSITIVE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,  # NUM_SMS programs, each taking every NUM_SMS-th tile; else one program per tile
    NUM_SMS: tl.constexpr,  # the persistent grid's stride
    WARP_SPECIALIZE: tl.constexpr,  # warp-specialize the tile loop (persistent) or the H loop
    FLATTEN: tl.constexpr,  # flatten the persistent tile and H loops (not with WARP_SPECIALIZE)
):
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[n_rows, hidden], strides=[hidden, 1],
                                       block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[n_cols, hidden], strides=[hidden, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    if OUT_TMA and OUT_TRANSPOSED:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[n_cols, n_rows], strides=[stride_out, 1],
                                             block_shape=[BLOCK_N, BLOCK_M])
    elif OUT_TMA:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[n_rows, n_cols], strides=[stride_out, 1],
                                             block_shape=[BLOCK_M, BLOCK_N])
    else:
        out_desc = out_ptr
    if PERSISTENT:
        n_tiles = tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N)
        # Flattening the tile and H loops lets the pipeliner issue the next tile's loads during this
        # tile's epilogue (FLATTEN; Triton's Hopper warp specialization does not take a flattened loop).
        for tile in tl.range(tl.program_id(0), n_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            _tma_tile(tile, x_desc, w_desc, b_ptr, target_ptr, m_ptr, s_ptr, target_logit_ptr, out_ptr, out_desc,
                      stride_out, shift_ptr, flag_ptr, n_rows, n_cols, hidden, alpha, ignore_index, HAS_BIAS, HAS_TARGET,
                      STORE_LOGITS, SHIFTED, HEADROOM, OUT_TMA, OUT_TRANSPOSED, EVEN_N, ALPHA_POSITIVE, INPUT_PRECISION, DOT_IN_FP32, BLOCK_M,
                      BLOCK_N, BLOCK_K, GROUP_M, False)
    else:
        _tma_tile(tl.program_id(0), x_desc, w_desc, b_ptr, target_ptr, m_ptr, s_ptr, target_logit_ptr, out_ptr,
                  out_desc, stride_out, shift_ptr, flag_ptr, n_rows, n_cols, hidden, alpha, ignore_index, HAS_BIAS,
                  HAS_TARGET, STORE_LOGITS, SHIFTED, HEADROOM, OUT_TMA, OUT_TRANSPOSED, EVEN_N, ALPHA_POSITIVE, INPUT_PRECISION, DOT_IN_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
                  GROUP_M, WARP_SPECIALIZE)


@triton.jit
def merge_lse_partials_kernel(
    m_ptr,  # float32 [n_blocks, N]: the tiles' row maxima
    s_ptr,  # float32 [n_blocks, N]: the tiles' shifted row sums
    target_ptr,  # [N] int32/int64 targets (read only when HAS_TARGET)
    lse_ptr,  # float32 [N]: log-sum-exp of each row (written)
    target_logit_ptr,  # float32 [N]: set to 0 at ignored rows, NaN at out-of-range targets (HAS_TARGET), the shift c elsewhere (SHIFTED)
    n_rows,  # N
    n_cols,  # V
    n_blocks,  # ceil(V / BLOCK_N) of the tile kernel
    ignore_index,  # target value of rows without a target logit
    out_ptr,  # the stored exponentials, element (i, j) at i * stride_row + j * stride_col (SHIFTED)
    stride_row,  # elements between rows of out (SHIFTED)
    stride_col,  # elements between classes of out (SHIFTED)
    shift_ptr,  # float32 [N]: each row's largest shift c*_i = max of its partial maxima (written with SHIFTED)
    factor_ptr,  # float32 [N]: each row's factor exp(c*_i - lse_i), 0 at ignored rows, NaN at stray targets (SHIFTED)
    flag_ptr,  # int32 [N]: rows whose tiles took shifts of their own (SHIFTED; their one-hot term is the rescaling's)
    HAS_TARGET: tl.constexpr,  # finish the target logits
    SHIFTED: tl.constexpr,  # the tiles stored shifted exponentials: subtract exp(lse - c*) at each target
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_B: tl.constexpr,  # vocabulary blocks' partials read per step
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    blocks = tl.arange(0, BLOCK_B)
    big_m = tl.full((BLOCK_R,), -float("inf"), tl.float32)
    big_s = tl.zeros((BLOCK_R,), tl.float32)
    for first in range(0, n_blocks, BLOCK_B):
        b = first + blocks
        partial = b.to(tl.int64)[:, None] * n_rows + rows[None, :]
        # Blocks beyond n_blocks read as m = -inf, s = 0: they add 0 (rows beyond N are never stored).
        mask = (b < n_blocks)[:, None] & row_ok[None, :]
        m = tl.load(m_ptr + partial, mask=mask, other=-float("inf"))
        s = tl.load(s_ptr + partial, mask=mask, other=0.0)
        new_m = tl.maximum(big_m, tl.max(m, axis=0))
        # exp(-inf - new_m) = 0 before the first step; a NaN in s (or m) reaches big_s through the sum.
        big_s = big_s * tl.exp(big_m - new_m) + tl.sum(s * tl.exp(m - new_m[None, :]), axis=0)
        big_m = new_m
    lse = big_m + tl.log(big_s)
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    if HAS_TARGET:
        y = tl.load(target_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        ignored = y == ignore_index
        stray = ~ignored & ((y < 0) | (y >= n_cols))
        tl.store(target_logit_ptr + rows, tl.where(ignored, 0.0, float("nan")), mask=row_ok & (ignored | stray))
        if SHIFTED:
            # The target logit is the shift c the caller passed in factor_ptr (the tiles store none).
            c = tl.load(factor_ptr + rows, mask=row_ok, other=0.0)
            tl.store(target_logit_ptr + rows, c, mask=row_ok & ~ignored & ~stray)
            # The one-hot term: the target's exponential minus exp(lse - c*), where every tile of the row
            # took the shift c* (unflagged rows).
            tl.store(shift_ptr + rows, big_m, mask=row_ok)
            factor = tl.where(ignored, 0.0, tl.where(stray, float("nan"), tl.exp(big_m - lse)))
            tl.store(factor_ptr + rows, factor, mask=row_ok)
            flagged = tl.load(flag_ptr + rows, mask=row_ok, other=0) != 0
            mine = row_ok & ~ignored & ~stray & ~flagged
            y = tl.where(mine, y, 0)
            at_target = out_ptr + rows.to(tl.int64) * stride_row + y * stride_col
            e_y = tl.load(at_target, mask=mine, other=0.0).to(tl.float32)
            tl.store(at_target, (e_y - tl.exp(lse - big_m)).to(out_ptr.dtype.element_ty), mask=mine)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int | None) -> int:
    """The streaming multiprocessors of a CUDA device: the persistent grid's size."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class TmaFallbackWarning(UserWarning):
    """A config asked for the TMA kernel and the inputs or the machine cannot take it: the pointer kernel ran."""


def _config(config: dict | None, dtype: torch.dtype) -> dict:
    """The launch's tile sizes: the interpreter's, or the default (``BLOCK_K`` halved for 4-byte inputs,
    keeping shared memory per stage at 48 KiB), updated by ``config``; the flags of :data:`FLAG_KEYS`
    False unless given."""
    if INTERPRETED:
        chosen = dict(INTERPRETED_CONFIG)
    elif dtype == torch.float32:
        chosen = dict(DEFAULT_CONFIG, BLOCK_K=DEFAULT_CONFIG["BLOCK_K"] // 2)
    else:
        chosen = dict(DEFAULT_CONFIG)
    chosen.update({key: chosen.get(key, False) for key in FLAG_KEYS})
    if config is not None:
        if not isinstance(config, dict) or not set(config) <= set(chosen):
            raise ValueError(f"config must be a dict with keys among {sorted(chosen)}; got {config!r}")
        for key, value in config.items():
            if key in FLAG_KEYS:
                if not isinstance(value, bool):
                    raise ValueError(f"config[{key!r}] must be a bool; got {value!r}")
                continue
            positive = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            if not positive or (key.startswith("BLOCK_") and (value < 16 or value & (value - 1))):
                raise ValueError(f"config[{key!r}] must be a positive int (BLOCK_*: a power of two >= 16); got {value!r}")
        chosen.update(config)
    if chosen["TMA"]:
        # A TMA box spans at most 256 elements per dimension.
        for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            if chosen[key] > 256:
                raise ValueError(f"config[{key!r}] must be <= 256 with TMA (a TMA box's limit); got {chosen[key]}")
    else:
        for key in ("PERSISTENT", "WARP_SPECIALIZE", "TMA_STORE"):
            if chosen[key]:
                raise ValueError(f"config[{key!r}] needs config['TMA'] = True (it applies to the TMA kernel only)")
    if chosen["WARP_SPECIALIZE"] and "warp_specialize" not in inspect.signature(tl.range.__init__).parameters:
        raise ValueError(f"config['WARP_SPECIALIZE'] needs tl.range(warp_specialize=...), absent from triton {triton.__version__}")
    return chosen


def tma_unsupported_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the TMA kernel cannot take ``x`` and ``weight`` (as the launcher passes them: contiguous), or
    None when it can. TMA needs Hopper or newer, 16-byte aligned data pointers and row strides."""
    if not hasattr(tl, "make_tensor_descriptor"):
        return f"triton {triton.__version__} has no tl.make_tensor_descriptor"
    if not INTERPRETED:
        if x.device.type != "cuda":
            return f"TMA needs a CUDA device; the inputs are on {x.device}"
        major, minor = torch.cuda.get_device_capability(x.device)
        if major < 9:
            return f"TMA needs compute capability >= 9.0 (Hopper); {torch.cuda.get_device_name(x.device)} has {major}.{minor}"
    for name, t in (("x", x), ("weight", weight)):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16:
            return f"{name}'s data pointer ({t.data_ptr():#x}) is not 16-byte aligned"
        row_bytes = t.stride(0) * t.element_size()
        if row_bytes % 16:
            return (f"{name}'s rows are {row_bytes} bytes, not a multiple of 16 "
                    f"(H = {t.shape[1]} must be a multiple of {16 // t.element_size()} for {t.dtype})")
    return None



def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the device-side TMA descriptors (128 bytes each, per program)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _ensure_allocator() -> None:
    """``tl.make_tensor_descriptor`` needs ``triton.set_allocator``: set ours unless the caller set one."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # another Triton layout: set ours
        pass
    triton.set_allocator(_descriptor_scratch)


def logits_logsumexp(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    *,
    alpha: float = 1.0,
    ignore_index: int = -100,
    config: dict | None = None,
    logits_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(lse, target_logit)`` of the logits ``alpha * (x @ weight.T + bias)``, never formed in memory
    unless ``logits_out`` asks for them.

    ``x``: ``(N, H)`` float32/bfloat16/float16; ``weight``: ``(V, H)`` of the same dtype; ``bias``:
    optional ``(V,)`` of that dtype (inside ``torch.autocast`` any of the three: all are cast to its
    dtype, as the fused losses do, :mod:`kernels_lib._autocast`); ``target``: optional ``(N,)``
    int32/int64 class indices in ``[0, V)`` or ``ignore_index``. Returns float32 ``lse`` ``(N,)`` and
    float32 ``target_logit`` ``(N,)`` (0 at ignored rows, NaN at targets outside ``[0, V)``), or
    ``None`` without ``target``. ``config``: optional dict overriding ``BLOCK_M``, ``BLOCK_N``,
    ``BLOCK_K``, ``GROUP_M``, ``num_warps``, ``num_stages``, and the bools ``TMA``, ``PERSISTENT``,
    ``WARP_SPECIALIZE``, ``TMA_STORE`` (see :data:`CONFIGS`; the last three need ``TMA``; ``TMA_STORE``
    stores ``logits_out``'s tiles by TMA where its base and row stride are 16-byte aligned). When
    ``TMA`` is asked for and :func:`tma_unsupported_reason` gives a reason, the pointer kernel runs and
    a :class:`TmaFallbackWarning` says why. Float32 inputs use TF32 exactly when torch's matmuls do
    (``torch.backends.cuda.matmul.allow_tf32``). ``logits_out``: optional ``(N, V)`` tensor of x's dtype
    (the autocast dtype inside autocast) with unit stride along ``V`` (a slice of a larger buffer's rows
    will do), or along ``N`` (the ``.t()`` of a class-major ``(V, N)`` buffer), into which the epilogue
    also writes the logits (``e·N·V`` more bytes written; the fused loss's gradient pass reads them, its
    log-sum-exp already done).
    """
    if target is None:
        v.require_head_inputs(x, weight, x_ndim=2)
    else:
        v.require_linear_loss_inputs(x, weight, target, x_ndim=2)
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        v.require_bias("bias", bias, weight)
        tensors["bias"] = bias
    if target is not None:
        tensors["target"] = target
    dtype = compute_dtype_for(x)  # inside torch.autocast its dtype, for every operand (as F.linear)
    x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    if logits_out is not None:
        v.require_tensor("logits_out", logits_out)
        v.require_shape("logits_out", logits_out, (x.shape[0], weight.shape[0]), "(N, V)")
        v.require_same_dtype("x", x, "logits_out", logits_out)
        if logits_out.stride(1) != 1 and logits_out.stride(0) != 1:
            raise ValueError("logits_out must have unit stride along V, or along N (a class-major buffer's .t()); "
                             f"got strides {tuple(logits_out.stride())}")
        tensors["logits_out"] = logits_out
    v.require_same_device(tensors)
    v.require_real("alpha", alpha)
    v.require_int("ignore_index", ignore_index)
    return launch_logits_logsumexp(x.contiguous(), weight.contiguous(), bias, target, alpha=alpha,
                                   ignore_index=ignore_index, config=config, logits_out=logits_out)


def launch_logits_logsumexp(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor | None,
    *,
    alpha: float,
    ignore_index: int,
    config: dict | None = None,
    logits_out: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r""":func:`logits_logsumexp` without its argument checks, for callers that made them (the fused
    loss, once per call rather than once per chunk): contiguous ``x`` and ``weight``.

    ``shift`` (with ``logits_out`` and ``target``): float32 ``(N,)``, each row's target logit from
    :func:`~kernels_lib.kernels.shifted_exponentials.launch_target_logit_shift`. Then ``logits_out``
    receives the shifted exponentials with the one-hot term subtracted at each target, :math:`\tilde e`
    of :mod:`~kernels_lib.kernels.shifted_exponentials` (zeros at ignored rows), and ``shift`` is
    overwritten with each row's factor :math:`u_i = e^{c^*_i - \mathrm{lse}_i}` (:math:`c^*_i` the shift
    the row's exponentials are relative to; 0 at ignored rows, NaN at targets outside ``[0, V)``): the
    gradient of the plain loss is :math:`g\,u_i\,\tilde e_{ij}`. The target logit returned is then the
    shift's (the tiles form none)."""
    reason = tma_unsupported_reason(x, weight)
    if config is None and not INTERPRETED and x.dtype != torch.float32 and reason is None:
        config = TMA_DEFAULT_CONFIG if logits_out is None else TMA_LOGITS_OUT_CONFIG
    cfg = _config(config, x.dtype)

    n_rows, hidden = x.shape
    n_cols = weight.shape[0]
    n_blocks = triton.cdiv(n_cols, cfg["BLOCK_N"])
    m = torch.empty((n_blocks, n_rows), dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    lse = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    target_logit = torch.empty_like(lse) if target is not None else None
    # Unused pointers still need a tensor argument; the constexpr flags keep them unread and unwritten.
    target_arg = target.contiguous() if target is not None else lse
    bias_arg = bias.contiguous() if bias is not None else x
    # "tf32" is tl.dot's default and ignored for 16-bit inputs; fp32 inputs get IEEE products unless torch allows TF32.
    ieee = x.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    # A class-major logits_out (unit stride along N: the .t() of a [V, N] buffer) takes the tiles transposed.
    transposed = logits_out is not None and logits_out.stride(1) != 1
    stride_out = 0 if logits_out is None else logits_out.stride(1 if transposed else 0)
    inner = n_rows if transposed else n_cols
    out_arg = logits_out if logits_out is not None else lse
    shifted = shift is not None
    if shifted and (logits_out is None or target is None):
        raise ValueError("launch_logits_logsumexp: shift needs logits_out and target")
    flags = torch.zeros(n_rows, dtype=torch.int32, device=x.device) if shifted else None
    row_shift = torch.empty_like(lse) if shifted else None  # c*: the merge's, for the rescaling
    shift_args = (shift, flags) if shifted else (lse, lse)
    common = dict(
        HAS_BIAS=bias is not None, HAS_TARGET=target is not None, STORE_LOGITS=logits_out is not None,
        SHIFTED=shifted, HEADROOM=EXP_HEADROOM, OUT_TRANSPOSED=transposed,
        EVEN_N=n_cols % cfg["BLOCK_N"] == 0, ALPHA_POSITIVE=float(alpha) > 0,
        INPUT_PRECISION="ieee" if ieee else "tf32",
        DOT_IN_FP32=INTERPRETED and x.dtype == torch.bfloat16,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    n_tiles = triton.cdiv(n_rows, cfg["BLOCK_M"]) * n_blocks
    if cfg["TMA"] and reason is not None:
        warnings.warn(f"logits_logsumexp: config {config!r} asks for the TMA kernel, but {reason}; "
                      "running the pointer-based kernel instead", TmaFallbackWarning, stacklevel=3)
    # TMA stores need a 16-byte aligned base and row stride, and a row of whole 16-byte units (on
    # Hopper a store clipped at V = 33 bf16 columns also wrote columns 33–39, up to the next 16 bytes);
    # otherwise the tile goes by masked stores.
    itemsize = x.element_size()
    out_tma = (cfg["TMA_STORE"] and logits_out is not None and logits_out.data_ptr() % 16 == 0
               and stride_out * itemsize % 16 == 0 and inner * itemsize % 16 == 0)
    if cfg["TMA"] and reason is None:
        if not INTERPRETED:
            _ensure_allocator()
        num_sms = INTERPRETED_NUM_SMS if INTERPRETED else _num_sms(x.device.index)
        grid = (min(num_sms, n_tiles) if cfg["PERSISTENT"] else n_tiles,)
        logits_lse_partials_tma_kernel[grid](
            x, weight, bias_arg, target_arg, m, s, target_logit if target is not None else lse, out_arg,
            stride_out, *shift_args, n_rows, n_cols, hidden, float(alpha), int(ignore_index),
            PERSISTENT=cfg["PERSISTENT"], NUM_SMS=num_sms, WARP_SPECIALIZE=cfg["WARP_SPECIALIZE"],
            FLATTEN=cfg["PERSISTENT"] and not cfg["WARP_SPECIALIZE"], OUT_TMA=out_tma, **common,
        )
    else:
        logits_lse_partials_kernel[(n_tiles,)](
            x, weight, bias_arg, target_arg, m, s, target_logit if target is not None else lse, out_arg,
            stride_out, *shift_args, n_rows, n_cols, hidden, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
            float(alpha), int(ignore_index), **common,
        )
    merge_lse_partials_kernel[(triton.cdiv(n_rows, BLOCK_R),)](
        m, s, target_arg, lse, target_logit if target is not None else lse, n_rows, n_cols, n_blocks,
        int(ignore_index), out_arg, *(logits_out.stride() if shifted else (0, 0)), *((row_shift, shift, flags) if shifted else (lse,) * 3), HAS_TARGET=target is not None, SHIFTED=shifted, BLOCK_R=BLOCK_R, BLOCK_B=BLOCK_B, num_warps=4,
    )
    if shifted:
        launch_rescale_flagged_rows(logits_out, m, row_shift, flags, lse, target_arg, cfg["BLOCK_N"])
    return lse, target_logit
