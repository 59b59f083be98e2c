r"""Fused linear + cross-entropy, per-chunk stage: log-sum-exp, per-row loss and, in place, the gradient.

What it computes
----------------
The caller has formed a chunk of logits :math:`z = x_c W^\top + b` (``rows × V``). For each row,
with the optional softcap :math:`c_j = s \tanh(z_j / s)` (else :math:`c_j = z_j`), optional class
weights :math:`w_j` (torch's ``weight``; all 1 without, so :math:`W = \sum_j w_j = V`) and the
row's weight :math:`r = w_y`,

.. math::

    \mathrm{lse} = \log \sum_j e^{c_j}, \qquad
    \ell = (1-\varepsilon)\,r\,(\mathrm{lse} - c_y)
           + \tfrac{\varepsilon}{V} \textstyle\sum_j w_j (\mathrm{lse} - c_j)
           + r\,\lambda\, \mathrm{lse}^2

(label smoothing :math:`\varepsilon`, z-loss :math:`\lambda`), and :math:`\ell = 0` at rows whose
target is ``ignore_index``. On request it also writes what a training logger reads off the logits
it no longer gets: the entropy :math:`H = \mathrm{lse} - \sum_j p_j c_j` and whether the target is
the row's largest logit (top-1 hit, token accuracy). The gradient with respect to the raw logits,
scaled by the row's factor :math:`g` (the reduction's ``1/n_valid`` or ``1``, or the upstream
gradient of that row), is

.. math::

    \frac{\partial \ell}{\partial z_j} = g\,\Big((1-\varepsilon)\,r\,(p_j - \delta_{jy})
        + \tfrac{\varepsilon}{V}(W p_j - w_j) + 2 r \lambda\,\mathrm{lse}\,p_j\Big)\,\big(1 - \tanh^2(z_j/s)\big),
    \qquad p_j = e^{c_j - \mathrm{lse}},

the last factor being :math:`\mathrm d c / \mathrm d z` of the softcap (1 without it), evaluated as
:math:`4e/(1+e)^2` with :math:`e = e^{-2|z_j/s|}` (``1 - (c/s)^2`` cancels for logits a few times
``s``: at logits of 1e4 with ``s = 30`` it gave 1.1e-4 relative error in ``dx`` against float64,
twice torch's float32 error; this form gives 1e-5), and 0 on ignored rows. In the backward of
plain cross-entropy (``one_minus_p``) the target's term :math:`p_y - 1` is read as minus the
forward's :math:`1 - p_y = -\operatorname{expm1}(-\ell)`, where :math:`e^{c_y - \mathrm{lse}} - 1`
would cancel as :math:`p_y \to 1` (the rounding of lse costs :math:`u|\mathrm{lse}|/(1 - p_y)`). It overwrites the logits in place, so the chunk's buffer holds ``dz`` afterwards and
no second ``rows × V`` buffer is needed.

How
---
One program per row loops over the vocabulary in blocks of ``BLOCK_V``. Pass 1 is the online
log-sum-exp of ``row_logsumexp`` (a running maximum :math:`m` and sum :math:`s = \sum e^{c_j - m}`,
merged block by block), which also sums the logits for smoothing. Pass 2 (only when the gradient is wanted) re-reads the row and writes ``dz``.
When ``lse`` is already known (backward of ``reduction="none"``) pass 1 is skipped.

Vocabulary-parallel (one shard of the classes per rank, :mod:`kernels_lib._vocab_parallel`): the
chunk holds the logits of this rank's classes ``[offset, offset + V_r)`` only. ``col_offset`` maps
the global target to the row (``y - offset``; a row whose target another rank owns has no
:math:`\delta_{jy}` here), the class weights are read at ``offset + j`` of the global vector, and
``n_classes`` is the global ``V`` of the smoothing term :math:`\varepsilon/V`. Pass 1 then writes
the row's partial sums (``PARTIAL``: :math:`m_r, \log s_r`, the target's logit where owned, else 0,
:math:`\sum_j w_j c_j`, :math:`\sum_j c_j`, and the entropy's :math:`d_r, q_r`) instead of the loss:
the caller merges them over the ranks into the global lse and loss, and runs pass 2 with that lse.
Single-process, ``col_offset = 0`` and ``n_classes = V``: the same arithmetic as before.

What it costs
-------------
Per logit: pass 1 reads it (2 or 4 bytes), pass 2 reads and writes it; one ``exp`` per pass (two
more with the softcap) and about 10 FLOPs. For a chunk of ``rows`` rows that is ``rows·V·3·e``
bytes with the gradient (``e`` = bytes per logit), ``rows·V·e`` without: memory-bound, and small
next to the ``2·rows·V·H`` FLOPs of the matmul that made the chunk. Offsets are 64-bit, so
``rows·V`` may exceed 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime import INTERPRETED
from .row_logsumexp import row_logsumexp, softcap_and_slope
from .row_logsumexp import softcap as apply_softcap

#: Vocabulary elements per loop step: 4096 on GPU (16 KiB of fp32 per step); in the interpreter a
#: larger block means fewer (slow) Python-level steps.
MAX_BLOCK_V = 16384 if INTERPRETED else 4096
NUM_WARPS = 8


@triton.jit
def cross_entropy_chunk_kernel(
    logits_ptr,  # [rows, V] logits of the chunk (fp32/bf16/fp16); overwritten with dz when WRITE_GRAD
    stride_row,  # elements between consecutive rows of logits
    target_ptr,  # [rows] int32/int64 class indices, ignore_index allowed
    lse_ptr,  # float32 [rows]: written when COMPUTE_LSE, else read (the forward's lse)
    loss_ptr,  # float32 [rows]: per-row loss incl. the z-loss term, 0 at ignored rows (COMPUTE_LSE)
    z_loss_ptr,  # float32 [rows]: per-row z-loss term r*lambda*lse^2, 0 at ignored rows (COMPUTE_LSE)
    partial_ptr,  # float32 [rows, 7]: the row's partial sums over this shard, PARTIAL_COLUMNS (PARTIAL)
    stats_ptr,  # float32 [rows, 3]: entropy H, mean logit, log sum p^2; 0 at ignored rows (written when
    #             COMPUTE_LSE and WITH_STATS; H read when HAS_ENTROPY_GRAD)
    top1_ptr,  # int8 [rows]: 1 where c_y is the row's largest logit, 0 elsewhere and at ignored rows (idem)
    entropy_grad_ptr,  # float32 [rows]: the upstream gradient of H times the factor (HAS_ENTROPY_GRAD)
    scale_ptr,  # float32: the gradient factor of row i at scale_ptr[i * scale_stride]
    scale_stride,  # 0 for one factor shared by all rows, 1 for a per-row factor
    class_weight_ptr,  # float32 [V]: class weights w_j (read only when HAS_WEIGHT)
    weight_sum_ptr,  # float32[1]: W = sum_j w_j (read only when HAS_WEIGHT; on the device: no host sync)
    n_cols,  # the row's length: V, or this rank's V_r when vocabulary-parallel
    n_classes,  # V, the whole vocabulary (= n_cols on one process): the smoothing's eps / V and the mean logit
    col_offset,  # global class index of the row's first logit (0 on one process); targets are global
    ignore_index,  # target value of rows that contribute nothing
    label_smoothing,  # epsilon in [0, 1]
    z_loss_scale,  # lambda >= 0
    softcap,  # s > 0 (read only when HAS_SOFTCAP)
    HAS_SOFTCAP: tl.constexpr,  # apply c = s * tanh(z / s)
    HAS_WEIGHT: tl.constexpr,  # torch's per-class weights
    COMPUTE_LSE: tl.constexpr,  # pass 1: compute lse and the loss; else read lse from lse_ptr
    PARTIAL: tl.constexpr,  # pass 1 writes the shard's partial sums (partial_ptr) instead of lse and the loss
    WITH_STATS: tl.constexpr,  # pass 1 also writes the entropy, the mean logit, log sum p^2 and the top-1 hit
    HAS_ENTROPY_GRAD: tl.constexpr,  # pass 2 adds the entropy's gradient
    WRITE_GRAD: tl.constexpr,  # pass 2: overwrite the logits with dz
    BLOCK_V: tl.constexpr,  # vocabulary elements per loop step (a power of two)
    one_minus_p_ptr=None,  # float32 [rows]: 1 - p_y of the forward, as -expm1(-loss) (pass 2 with HAS_ONE_MINUS_P)
    HAS_ONE_MINUS_P: tl.constexpr = False,  # plain cross-entropy only: dz_y = -(1 - p_y) g from it
    lse_grad_ptr=None,  # float32 [rows]: the upstream gradient of the row's lse times the factor (HAS_LSE_GRAD)
    HAS_LSE_GRAD: tl.constexpr = False,  # pass 2 adds the lse's gradient, g_lse p_j
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    y = tl.load(target_ptr + row).to(tl.int64)
    valid = y != ignore_index
    # An out-of-range target reads class 0's weight: its row is refused after the call (host_checks) or
    # by a device-side assert, and no load leaves the arrays meanwhile.
    y_safe = tl.where(valid & (y >= 0) & (y < n_classes), y, 0)
    # The target's column in this row: y itself on one process; y - offset on the rank that owns it.
    y_local = y - col_offset
    owned = valid & (y_local >= 0) & (y_local < n_cols)
    # r: the row's weight w_y (1 without class weights); the smoothing term's total weight W (V without).
    if HAS_WEIGHT:
        r = tl.load(class_weight_ptr + y_safe).to(tl.float32)
        total = tl.load(weight_sum_ptr)
    else:
        r = 1.0
        total = n_classes * 1.0

    if COMPUTE_LSE:
        m, log_s, sum_c, sum_wc, d, q = row_logsumexp(
            row_ptr, n_cols, softcap, class_weight_ptr + col_offset, HAS_SOFTCAP, HAS_WEIGHT, WITH_STATS, BLOCK_V
        )
        c_y = apply_softcap(tl.load(row_ptr + tl.where(owned, y_local, 0)).to(tl.float32), softcap, HAS_SOFTCAP)
    if PARTIAL:
        out = partial_ptr + row * 7  # the 7 columns of PARTIAL_COLUMNS
        tl.store(out, m)
        tl.store(out + 1, log_s)
        tl.store(out + 2, tl.where(owned, c_y, 0.0))
        tl.store(out + 3, sum_wc)
        tl.store(out + 4, sum_c)
        tl.store(out + 5, d)
        tl.store(out + 6, q)
    elif COMPUTE_LSE:
        lse = m + log_s
        z_term = r * z_loss_scale * lse * lse
        # lse - c_y as (m - c_y) + log s: a confident row's loss is small next to m, and rounding
        # m + log s first would cost an absolute u·|m| (the float32 reference's: u·|loss|).
        # Smoothing: (eps / V) sum_j w_j (lse - c_j) = (eps / V) (W (m + log s) - sum_j w_j c_j).
        ce = (1.0 - label_smoothing) * r * ((m - c_y) + log_s) + (label_smoothing / n_classes) * (
            (total * m - sum_wc) + total * log_s
        )
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(valid, ce + z_term, 0.0))
        tl.store(z_loss_ptr + row, tl.where(valid, z_term, 0.0))
        if WITH_STATS:
            tl.store(stats_ptr + row * 3, tl.where(valid, d / tl.exp(log_s) + log_s, 0.0))
            tl.store(stats_ptr + row * 3 + 1, tl.where(valid, sum_c / n_classes, 0.0))
            tl.store(stats_ptr + row * 3 + 2, tl.where(valid, tl.log(q) - 2.0 * log_s, 0.0))
            tl.store(top1_ptr + row, (valid & (c_y >= m)).to(tl.int8))
    else:
        lse = tl.load(lse_ptr + row)

    if WRITE_GRAD:
        g = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        # dl/dc_j = (1-eps) r (p_j - delta_jy) + (eps/V)(W p_j - w_j) + r 2 lambda lse p_j, written as
        # (p_j a - hit_j - smooth_j) + p_j z_grad with a = (1-eps) r + eps W / V (exactly 1 without
        # class weights). The z-loss term is added after (not folded into a): where p_y -> 1 the
        # rounding of a + 2 lambda lse would leave an absolute error of u in dz_y, all of it when V = 1.
        z_grad = 2.0 * z_loss_scale * lse * r
        if HAS_ENTROPY_GRAD:
            # dH/dc_j = -p_j (log p_j + H), log p_j = c_j - lse
            g_h = tl.load(entropy_grad_ptr + row).to(tl.float32)
            h = tl.load(stats_ptr + row * 3)
        if HAS_WEIGHT:
            a = (1.0 - label_smoothing) * r + label_smoothing * total / n_classes
        else:
            a = 1.0
        if HAS_ONE_MINUS_P:
            q_y = tl.load(one_minus_p_ptr + row)
        if HAS_LSE_GRAD:
            g_lse = tl.load(lse_grad_ptr + row).to(tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            hit = tl.where(offs == y_local, (1.0 - label_smoothing) * r, 0.0)
            if HAS_WEIGHT:
                w_j = tl.load(class_weight_ptr + col_offset + offs, mask=mask, other=0.0)
                smooth = (label_smoothing / n_classes) * w_j
            else:
                smooth = label_smoothing / n_classes
            if HAS_SOFTCAP:
                c, slope = softcap_and_slope(z, softcap)
            else:
                c = z
            p = tl.exp(c - lse)
            if HAS_ONE_MINUS_P:
                # plain cross-entropy (a = 1, no smoothing, no z-loss): at j = y, p_y - 1 is minus the
                # forward's 1 - p_y, not e^{c_y - lse} - 1, which cancels as p_y -> 1 (lse is rounded:
                # an absolute u·|lse| in p_y, 1e-4 relative in dz at p_y = 0.999 and |lse| = 12)
                dc = tl.where(offs == y_local, -q_y, p - hit) * g
            else:
                dc = ((p * a - hit - smooth) + p * z_grad) * g
            if HAS_ENTROPY_GRAD:
                dc -= g_h * (p * ((c - lse) + h))
            if HAS_LSE_GRAD:
                dc += g_lse * p  # d lse / d c_j = p_j
            if HAS_SOFTCAP:
                dc = dc * slope
            dz = tl.where(valid, dc, 0.0)
            tl.store(row_ptr + offs, dz.to(logits_ptr.dtype.element_ty), mask=mask)


def block_v(n_cols: int) -> int:
    """The loop step over the vocabulary for ``n_cols`` classes."""
    return min(triton.next_power_of_2(n_cols), MAX_BLOCK_V)


#: The columns of the partial sums the vocabulary-parallel pass 1 writes per row (``PARTIAL``), over
#: this shard's classes ``j``: ``m`` = max_j c_j; ``log_s`` = log Σ_j e^{c_j - m}; ``target_logit`` = c_y
#: where this shard owns the target, else 0; ``sum_wc`` = Σ_j w_j c_j (= ``sum_c`` without class
#: weights); ``sum_c`` = Σ_j c_j; ``d`` = Σ_j e^{c_j - m}(m - c_j), ``q`` = Σ_j e^{2(c_j - m)} (0 unless
#: ``with_stats``).
PARTIAL_COLUMNS = ("m", "log_s", "target_logit", "sum_wc", "sum_c", "d", "q")


def launch_cross_entropy_chunk(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    lse: torch.Tensor,
    loss: torch.Tensor | None,
    z_loss: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float | None,
    class_weight: torch.Tensor | None = None,
    weight_sum: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    top1: torch.Tensor | None = None,
    entropy_grad: torch.Tensor | None = None,
    col_offset: int = 0,
    n_classes: int | None = None,
    one_minus_p: torch.Tensor | None = None,
    lse_grad: torch.Tensor | None = None,
) -> None:
    """Launch the kernel on a ``rows × V`` logits chunk (unit stride along V) and ``rows`` targets.

    Two modes:

    * ``loss`` and ``z_loss`` given (float32, ``rows``): compute ``lse`` (float32, ``rows``,
      written) and the per-row loss terms; with ``stats`` (float32, ``rows × 3``) and ``top1`` (int8,
      ``rows``) also the entropy of the row's softmax, its mean logit and ``log Σ p²``, and whether
      the target is its largest logit;
    * both ``None``: ``lse`` is read (it holds the forward's values) and ``grad_scale`` is required;
      with ``entropy_grad`` (float32, ``rows``: the upstream gradient of each row's entropy, times
      the same factor as ``grad_scale``) the entropy's gradient is added, ``stats`` then holding the
      forward's values. ``one_minus_p`` (float32, ``rows``; plain cross-entropy only: no smoothing,
      z-loss or class weights) is each row's ``1 - p_y`` from the forward's accurate loss
      (``-expm1(-loss)``): ``dz_y`` is formed from it, without the cancellation of ``p_y - 1``.
      ``lse_grad`` (float32, ``rows``: the upstream gradient of each row's lse, times the same factor
      as ``grad_scale``) adds the lse's gradient ``g_lse · p_j``.

    ``grad_scale`` (float32, 1 element shared by all rows, or ``rows`` elements one per row), when
    given, makes the kernel overwrite ``logits`` with ``grad_scale * dloss/dlogits``.
    ``class_weight`` (float32, ``V``) weighs each row by ``w_y`` and the smoothing term by ``w_j``
    (torch's ``weight``); ``weight_sum`` (float32, 1 element, required with it) is ``Σ_j w_j``. Output buffers are written, never read, so
    callers may pass ``torch.empty`` (tests pass NaN-poisoned ones).

    Vocabulary-parallel (the second mode only; the first is :func:`launch_cross_entropy_partials`
    there): ``logits`` holds the global classes ``[col_offset, col_offset + rows' length)``, ``target``
    and ``class_weight`` are global, ``lse`` (and ``stats``) hold the merged values, and ``n_classes``
    is the global ``V`` (default: the row's length, one process).
    """
    compute_lse = loss is not None
    if compute_lse != (z_loss is not None):
        raise ValueError("give both loss and z_loss (compute lse) or neither (read lse)")
    if not compute_lse and grad_scale is None:
        raise ValueError("with lse given (loss=None) there is nothing to do unless grad_scale is given")
    with_stats = compute_lse and stats is not None
    if compute_lse and (stats is None) != (top1 is None):
        raise ValueError("give stats and top1 together (with loss and z_loss)")
    if entropy_grad is not None and (compute_lse or stats is None or grad_scale is None):
        raise ValueError("entropy_grad goes with the forward's stats, grad_scale and no loss (the backward mode)")
    if lse_grad is not None and (compute_lse or grad_scale is None):
        raise ValueError("lse_grad goes with grad_scale and no loss (the backward mode)")
    if one_minus_p is not None and (compute_lse or label_smoothing or z_loss_scale or class_weight is not None):
        raise ValueError("one_minus_p goes with the backward mode of plain cross-entropy (no smoothing, z-loss or weights)")
    if compute_lse and (col_offset != 0 or (n_classes is not None and n_classes != logits.shape[1])):
        raise ValueError("a vocabulary shard's pass 1 is launch_cross_entropy_partials (its loss needs every shard)")
    _launch(
        logits, target, lse=lse, loss=loss, z_loss=z_loss, partial=None, stats=stats, top1=top1 if with_stats else None,
        entropy_grad=entropy_grad, grad_scale=grad_scale, class_weight=class_weight, weight_sum=weight_sum,
        n_classes=n_classes, col_offset=col_offset, ignore_index=ignore_index, label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale, softcap=softcap, with_stats=with_stats, one_minus_p=one_minus_p,
        lse_grad=lse_grad,
    )


def launch_cross_entropy_partials(
    logits: torch.Tensor,
    target: torch.Tensor,
    partial: torch.Tensor,
    *,
    col_offset: int,
    ignore_index: int,
    softcap: float | None,
    class_weight: torch.Tensor | None = None,
    with_stats: bool = False,
) -> None:
    """Pass 1 on one vocabulary shard: write each row's partial sums, :data:`PARTIAL_COLUMNS`.

    ``logits``: ``rows × V_r``, the classes ``[col_offset, col_offset + V_r)``; ``target``: ``rows``
    global class indices (or ``ignore_index``); ``partial``: float32 ``rows × 7``, written;
    ``class_weight``: the global float32 ``(V,)`` vector; ``with_stats``: also the entropy's sums
    ``d`` and ``q``. Nothing else is written; the caller merges the partials over the ranks.
    """
    if partial.dtype != torch.float32 or partial.shape != (logits.shape[0], len(PARTIAL_COLUMNS)):
        raise ValueError(f"partial must be a float32 ({logits.shape[0]}, {len(PARTIAL_COLUMNS)}) tensor")
    _launch(
        logits, target, lse=partial, loss=None, z_loss=None, partial=partial, stats=None, top1=None,
        entropy_grad=None, grad_scale=None, class_weight=class_weight, weight_sum=None, n_classes=None,
        col_offset=col_offset, ignore_index=ignore_index, label_smoothing=0.0, z_loss_scale=0.0, softcap=softcap,
        with_stats=with_stats,
    )


def _launch(logits, target, *, lse, loss, z_loss, partial, stats, top1, entropy_grad, grad_scale, class_weight,
            weight_sum, n_classes, col_offset, ignore_index, label_smoothing, z_loss_scale, softcap, with_stats,
            one_minus_p=None, lse_grad=None):
    rows, n_cols = logits.shape
    # Unused pointers still need a tensor argument; the constexpr flags keep them unread and unwritten.
    cross_entropy_chunk_kernel[(rows,)](
        logits,
        logits.stride(0),
        target,
        lse,
        loss if loss is not None else lse,
        z_loss if z_loss is not None else lse,
        partial if partial is not None else lse,
        stats if stats is not None else lse,
        top1 if top1 is not None else lse,
        entropy_grad if entropy_grad is not None else lse,
        grad_scale if grad_scale is not None else lse,
        0 if grad_scale is None or grad_scale.numel() == 1 else 1,
        class_weight if class_weight is not None else lse,
        weight_sum if weight_sum is not None else lse,
        n_cols,
        n_cols if n_classes is None else int(n_classes),
        int(col_offset),
        int(ignore_index),
        float(label_smoothing),
        float(z_loss_scale),
        float(softcap) if softcap is not None else 1.0,
        HAS_SOFTCAP=softcap is not None,
        HAS_WEIGHT=class_weight is not None,
        COMPUTE_LSE=loss is not None or partial is not None,
        PARTIAL=partial is not None,
        WITH_STATS=with_stats,
        HAS_ENTROPY_GRAD=entropy_grad is not None,
        WRITE_GRAD=grad_scale is not None,
        BLOCK_V=block_v(n_cols),
        one_minus_p_ptr=one_minus_p if one_minus_p is not None else lse,
        HAS_ONE_MINUS_P=one_minus_p is not None,
        lse_grad_ptr=lse_grad if lse_grad is not None else lse,
        HAS_LSE_GRAD=lse_grad is not None,
        num_warps=NUM_WARPS,
    )
