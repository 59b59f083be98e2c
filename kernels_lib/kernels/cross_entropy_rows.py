r"""Cross-entropy on materialized logits: per-row loss and, in the same program, the logits gradient.

What it computes
----------------
For a row of logits :math:`z` (``V`` classes), its target :math:`y`, torch's optional class weights
:math:`w_j` (all 1 without: then :math:`W = \sum_j w_j = V`), the row's weight :math:`r = w_y` and
label smoothing :math:`\varepsilon`,

.. math::

    \mathrm{lse} = \log \sum_j e^{z_j}, \qquad
    \ell = (1-\varepsilon)\,r\,(\mathrm{lse} - z_y)
           + \tfrac{\varepsilon}{V} \textstyle\sum_j w_j (\mathrm{lse} - z_j),

(``F.cross_entropy``'s per-row loss) and :math:`\ell = 0` where :math:`y` is ``ignore_index``. Its
gradient, times the row's factor :math:`g` (the reduction's ``1/Σ r`` or 1, or the upstream
gradient of that row),

.. math::

    \frac{\partial \ell}{\partial z_j} = g\,\big(a\,p_j - (1-\varepsilon)\,r\,\delta_{jy}
        - \tfrac{\varepsilon}{V} w_j\big), \qquad
    p_j = e^{z_j - \mathrm{lse}}, \quad a = (1-\varepsilon)\,r + \varepsilon W / V

(:math:`a = 1` without class weights), and 0 on ignored rows. A target outside ``[0, V)`` that is not
``ignore_index`` gives :math:`\ell = \mathrm{NaN}` (its logit is not read): the caller's range check may
raise only in backward, and the loss must not look right meanwhile.

The kernel
----------
One program per row loops over the vocabulary in blocks of ``BLOCK_V``. Pass 1 is the online
log-sum-exp of :func:`~.row_logsumexp.row_logsumexp` (running maximum :math:`m` and
:math:`s = \sum_j e^{z_j - m}`; it also sums :math:`w_j z_j` for the smoothing term); the loss is
formed as :math:`(1-\varepsilon) r ((m - z_y) + \log s) + \tfrac{\varepsilon}{V}((W m - \sum_j w_j
z_j) + W \log s)`, which keeps a confident row's small loss accurate next to a large :math:`m`.
Pass 2 (with ``WRITE_GRAD``) reads the row again and writes the gradient, into a separate buffer or
over the logits themselves (the launcher's ``grad`` may be ``logits``: each element is read before
it is written, by the same program). With ``RESIDENT`` (the whole row in one block of at most
:data:`RESIDENT_MAX_COLS`, the forward that writes the gradient) the row is read once: pass 2 takes
the gradient from the block pass 1 holds in registers. With ``LSE_GIVEN`` pass 1 is skipped and ``lse`` is read
instead: the backward of ``reduction="none"``, whose per-row factor arrives only then. An ignored
row is not read at all (its loop is empty, its gradient a row of zeros).

Vocabulary-parallel form (:func:`kernels_lib.cross_entropy` with ``process_group``): with the
classes split over ranks, a rank holds columns ``[col_offset, col_offset + n_cols)`` of
``n_classes``. Pass 1 on the shard with ``partial`` (and no ``loss``) writes, per row, the shard's
:math:`m_r`, :math:`\log s_r`, the target's logit :math:`z_y` where this rank owns the target (0
elsewhere) and :math:`\sum_j w_j z_j` over the shard (the plain sum without class weights); the
caller merges them over the ranks into the global lse, :math:`z_y` and :math:`\sum_j w_j z_j`
(:meth:`kernels_lib._vocab_parallel.VocabShard.merge_logsumexp`) and forms the loss from the merged
values with pass 1's formula. Pass 2 with ``lse`` the global values (``LSE_GIVEN``) and the shard's
``col_offset`` writes the shard's gradient: the target's :math:`\delta` lands only on the rank that
owns it, the class weights are read at ``col_offset + j`` of the global vector, and
:math:`\varepsilon / V` uses ``n_classes``. An ignored row writes :math:`m_r = \log s_r = 0` (it
is not read; its merged values are never used), so the merge sees no :math:`-\infty - (-\infty)`.

What it costs
-------------
Per logit: pass 1 reads it (``e`` = 2 or 4 bytes); pass 2 reads it again and writes the gradient;
one ``exp`` per pass and about 10 FLOPs in all: memory-bound. Forward with the gradient moves
``3·N·V·e`` bytes, or its floor ``2·N·V·e`` (one read, one write) with ``RESIDENT`` (``V`` up to
:data:`RESIDENT_MAX_COLS`); without the gradient ``N·V·e``; the
``LSE_GIVEN`` pass ``2·N·V·e``. Plus a few floats per row.
Offsets are 64-bit, so ``N·V`` may exceed 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cross_entropy_chunk import NUM_WARPS, block_v  # the loop step over V, shared with the fused loss's kernel
from .row_logsumexp import row_logsumexp

#: The longest row the fused forward holds whole in registers (``RESIDENT``): 32768 logits, held as float32
#: whatever their dtype, 64 a thread at :func:`resident_warps`'s 16 warps. Longer rows are read twice: at twice
#: this length the registers spill and one read is far slower than two (the A/B of the limits:
#: ``studies/ce_resident_ab.py``).
RESIDENT_MAX_COLS = 32768


def resident_warps(block: int) -> int:
    """Warps for a resident row of ``block`` elements: a warp per 1024 elements, between :data:`NUM_WARPS` and 16,
    so 32 elements a thread up to 16384 and 64 at 32768."""
    return max(NUM_WARPS, min(16, block // 1024))


@triton.jit
def _row_gradient(z, cols, w, y_local, lse, a, r, g, label_smoothing, n_classes, HAS_WEIGHT: tl.constexpr):
    """``g (a p_j - (1-ε) r δ_{j y} - ε w_j / V)`` for a block of logits ``z`` at row columns ``cols``
    (``w`` the block's class weights, read only with ``HAS_WEIGHT``): the module's gradient."""
    hit = tl.where(cols == y_local, (1.0 - label_smoothing) * r, 0.0)
    if HAS_WEIGHT:
        smooth = (label_smoothing / n_classes) * w
    else:
        smooth = label_smoothing / n_classes
    return (tl.exp(z - lse) * a - hit - smooth) * g


@triton.jit
def cross_entropy_rows_kernel(
    logits_ptr,  # [N, n_cols] logits (fp32/bf16/fp16), unit stride along the row
    stride_row,  # elements between consecutive rows of logits
    target_ptr,  # [N] int32/int64 global class indices, ignore_index allowed
    lse_ptr,  # float32 [N]: written by pass 1 (-inf at ignored rows), read when LSE_GIVEN
    loss_ptr,  # float32 [N]: the per-row loss, 0 at ignored rows (WRITE_LOSS)
    partial_ptr,  # float32 [N, 4]: m, log s, z_y where owned (else 0), sum_j w_j z_j of the shard (WRITE_PARTIAL)
    grad_ptr,  # [N, n_cols] the gradient (WRITE_GRAD); may be logits_ptr itself (in place)
    stride_grad_row,  # elements between consecutive rows of grad
    scale_ptr,  # the gradient factor of row i at scale_ptr[i * scale_stride] (any float dtype)
    scale_stride,  # 0 for one factor shared by all rows
    class_weight_ptr,  # float32 [n_classes] class weights (HAS_WEIGHT)
    weight_sum_ptr,  # float32 [1]: W = sum_j w_j over all classes (HAS_WEIGHT; on the device)
    n_cols,  # the row's length: V, or a shard's when vocabulary-parallel
    n_classes,  # V, the whole vocabulary (= n_cols on one device)
    col_offset,  # global class of the row's first logit (0 on one device)
    ignore_index,  # target value of rows that contribute nothing
    label_smoothing,  # epsilon in [0, 1]
    HAS_WEIGHT: tl.constexpr,
    LSE_GIVEN: tl.constexpr,  # skip pass 1, read lse
    WRITE_LOSS: tl.constexpr,  # pass 1 writes the loss (the whole vocabulary only)
    WRITE_PARTIAL: tl.constexpr,  # pass 1 writes the shard's partial sums (vocabulary-parallel)
    WRITE_GRAD: tl.constexpr,  # pass 2 writes the gradient
    RESIDENT: tl.constexpr,  # the row is one block (n_cols <= BLOCK_V): read once, kept for pass 2
    BLOCK_V: tl.constexpr,  # vocabulary elements per loop step (a power of two)
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    y = tl.load(target_ptr + row).to(tl.int64)
    valid = y != ignore_index
    n_read = tl.where(valid, n_cols, 0)  # an ignored row is not read
    y_local = y - col_offset
    owned = valid & (y_local >= 0) & (y_local < n_cols)
    if HAS_WEIGHT:
        r = tl.load(class_weight_ptr + tl.where(valid & (y >= 0) & (y < n_classes), y, 0)).to(tl.float32)
        total = tl.load(weight_sum_ptr)
    else:
        r = 1.0
        total = n_classes * 1.0

    if LSE_GIVEN:
        lse = tl.load(lse_ptr + row)
    else:
        if RESIDENT:  # the whole row, read once (pass 1's online merge with a single block)
            cols = tl.arange(0, BLOCK_V)
            read = cols < n_read
            z_row = tl.load(row_ptr + cols, mask=read, other=0.0).to(tl.float32)
            m = tl.max(tl.where(read, z_row, -float("inf")), axis=0)
            log_s = tl.log(tl.sum(tl.where(read, tl.exp(z_row - m), 0.0), axis=0))
            if HAS_WEIGHT:
                w_row = tl.load(class_weight_ptr + col_offset + cols, mask=read, other=0.0)
                sum_wz = tl.sum(tl.where(read, w_row * z_row, 0.0), axis=0)
            else:
                w_row = 0.0  # no class weights: unread
                sum_wz = tl.sum(tl.where(read, z_row, 0.0), axis=0)
        else:
            m, log_s, _, sum_wz, _, _ = row_logsumexp(
                row_ptr, n_read, 1.0, class_weight_ptr + col_offset, False, HAS_WEIGHT, False, BLOCK_V
            )
        lse = m + log_s
        tl.store(lse_ptr + row, lse)
        z_y = tl.load(row_ptr + tl.where(owned, y_local, 0), mask=owned, other=0.0).to(tl.float32)
        if WRITE_PARTIAL:
            out = partial_ptr + row * 4
            tl.store(out, tl.where(valid, m, 0.0))
            tl.store(out + 1, tl.where(valid, log_s, 0.0))
            tl.store(out + 2, z_y)
            tl.store(out + 3, tl.where(valid, sum_wz, 0.0))
        if WRITE_LOSS:
            loss = (1.0 - label_smoothing) * r * ((m - z_y) + log_s) + (label_smoothing / n_classes) * (
                (total * m - sum_wz) + total * log_s
            )
            # A target outside [0, V) (not ignore_index) gives a NaN loss: the range check may be read
            # only in backward, and until then the loss must not look right.
            stray = valid & ((y < 0) | (y >= n_classes))
            tl.store(loss_ptr + row, tl.where(valid, tl.where(stray, float("nan"), loss), 0.0))

    if WRITE_GRAD:
        g = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        if HAS_WEIGHT:
            a = (1.0 - label_smoothing) * r + label_smoothing * total / n_classes
        else:
            a = 1.0
        out_ptr = grad_ptr + row * stride_grad_row
        cols = tl.arange(0, BLOCK_V)
        if RESIDENT:
            dz = _row_gradient(z_row, cols, w_row, y_local, lse, a, r, g, label_smoothing, n_classes, HAS_WEIGHT)
            tl.store(out_ptr + cols, tl.where(valid, dz, 0.0).to(grad_ptr.dtype.element_ty), mask=cols < n_cols)
        else:
            for start in range(0, n_cols, BLOCK_V):
                offs = start + cols
                read = offs < n_read
                z = tl.load(row_ptr + offs, mask=read, other=0.0).to(tl.float32)
                if HAS_WEIGHT:
                    w = tl.load(class_weight_ptr + col_offset + offs, mask=read, other=0.0)
                else:
                    w = 0.0
                dz = _row_gradient(z, offs, w, y_local, lse, a, r, g, label_smoothing, n_classes, HAS_WEIGHT)
                tl.store(out_ptr + offs, tl.where(valid, dz, 0.0).to(grad_ptr.dtype.element_ty), mask=offs < n_cols)


def launch_cross_entropy_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    lse: torch.Tensor,
    loss: torch.Tensor | None = None,
    partial: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    lse_given: bool = False,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    class_weight: torch.Tensor | None = None,
    weight_sum: torch.Tensor | None = None,
    col_offset: int = 0,
    n_classes: int | None = None,
) -> None:
    """Launch the kernel on ``(N, n_cols)`` logits (unit stride along a row) and ``N`` targets.

    ``lse`` (float32, ``N``) is written by pass 1, or read with ``lse_given`` (then pass 1 is
    skipped). ``loss`` (float32, ``N``), when given, receives the per-row loss (pass 1 over the whole
    vocabulary only). ``partial`` (float32, ``N × 4``, contiguous), when given, receives the shard's
    ``m, log s, z_y`` (where owned, else 0) and ``Σ_j w_j z_j`` (the vocabulary-parallel form; not
    with ``loss`` or ``lse_given``). ``grad`` (``(N, n_cols)``, unit stride along a row; ``logits`` itself for the
    in-place form), when given, receives ``scale * dloss/dlogits``; ``scale`` is a 1-element tensor
    shared by all rows or an ``N``-element one (any stride), on the device. ``class_weight``
    (float32, ``n_classes``) with ``weight_sum`` (float32, 1 element: its sum) are torch's
    ``weight``. ``col_offset``/``n_classes`` place a shard of the vocabulary (see the module's
    vocabulary-parallel hook); by default the row is the whole vocabulary. Output buffers are
    written, never read, so callers may pass ``torch.empty`` (tests pass NaN-poisoned ones).
    """
    n_rows, n_cols = logits.shape
    n_classes = n_cols if n_classes is None else int(n_classes)
    if loss is not None and (lse_given or col_offset != 0 or n_classes != n_cols):
        raise ValueError("loss is formed by pass 1 over the whole vocabulary: not with lse_given or a shard")
    if partial is not None and (loss is not None or lse_given or partial.shape != (n_rows, 4) or not partial.is_contiguous()):
        raise ValueError("partial is a contiguous (N, 4) output of pass 1 on a shard: not with loss or lse_given")
    if grad is not None and scale is None:
        raise ValueError("give scale with grad (the factor of each row's gradient)")
    if lse_given and grad is None:
        raise ValueError("with lse_given there is nothing to do unless grad is given")
    if (class_weight is None) != (weight_sum is None):
        raise ValueError("give class_weight and weight_sum together")
    # The forward that writes the gradient keeps a short row whole: one read instead of two.
    resident = grad is not None and not lse_given and n_cols <= RESIDENT_MAX_COLS
    block = triton.next_power_of_2(n_cols) if resident else block_v(n_cols)
    # Unused pointers still need a tensor argument; the constexpr flags keep them unread and unwritten.
    cross_entropy_rows_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        target,
        lse,
        loss if loss is not None else lse,
        partial if partial is not None else lse,
        grad if grad is not None else logits,
        grad.stride(0) if grad is not None else 0,
        scale if scale is not None else lse,
        0 if scale is None or scale.numel() == 1 else scale.stride(0),
        class_weight if class_weight is not None else lse,
        weight_sum if weight_sum is not None else lse,
        n_cols,
        n_classes,
        int(col_offset),
        int(ignore_index),
        float(label_smoothing),
        HAS_WEIGHT=class_weight is not None,
        LSE_GIVEN=bool(lse_given),
        WRITE_LOSS=loss is not None,
        WRITE_PARTIAL=partial is not None,
        WRITE_GRAD=grad is not None,
        RESIDENT=resident,
        BLOCK_V=block,
        num_warps=resident_warps(block) if resident else NUM_WARPS,
    )
