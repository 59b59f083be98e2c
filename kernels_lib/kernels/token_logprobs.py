r"""Per-token log-probabilities of a logits chunk, and their weighted gradient written in place.

What it computes
----------------
The caller has formed a chunk of logits :math:`z = x_c W^\top + b` (``rows × V``) whose rows are
the tokens of whole sequences, ``T`` consecutive rows per sequence. Two launches of one kernel:

**Stats** (``launch_token_logprobs``). For each row, with target :math:`y` (and optionally a second
target :math:`y'`),

.. math::

    \mathrm{lse} = \log \sum_j e^{z_j}, \qquad
    \log p(y) = z_y - \mathrm{lse} \quad (0 \text{ where } y = \text{ignore\_index}),

evaluated as :math:`(z_y - m) - \log s` with :math:`m` the row's maximum and :math:`s = \sum_j e^{z_j - m}`
(so a log-prob near 0 keeps its relative accuracy),

and the same for :math:`y'`. Optionally (``entropy``) the same pass also gives the entropy of the
row's softmax, :math:`H = \mathrm{lse} - \sum_j p_j z_j`, from the online sums of ``row_logsumexp``
(``WITH_STATS``; 0 where :math:`y` is ``ignore_index``, as TRL's fused head gives).

The caller sums them per sequence and, from those sums alone, forms each sequence's weight
:math:`w = \partial L / \partial \log p(y_t)` (the same for every valid token of a sequence: the
preference losses depend on a sequence only through its summed or averaged log-prob), or, for a
loss with a term per token (GRPO), a weight per token from the token's log-prob
(``rows_per_weight = 1``).

**Gradient** (``launch_token_logprobs_grad``). With the weights :math:`w` (and :math:`w'` for the
second target) of the row's sequence and :math:`\partial \log p(y) / \partial z_j = \delta_{jy} - p_j`,

.. math::

    \frac{\partial L}{\partial z_j} = w\,(\delta_{jy} - p_j) + w'\,(\delta_{jy'} - p_j),
    \qquad p_j = e^{z_j - \mathrm{lse}},

each term 0 where its target is ``ignore_index``; at :math:`j = y` the factor :math:`1 - p_y` is
taken as :math:`-\operatorname{expm1}(\log p(y))` from the stats pass (exact where :math:`p_y \to 1`,
where :math:`1 - e^{z_y - \mathrm{lse}}` would cancel). It overwrites the logits in place, so the
chunk's buffer holds ``dz`` afterwards and the caller's three matmuls read it from there.

Vocabulary-parallel (:mod:`kernels_lib._vocab_parallel`): the chunk holds this rank's classes
``[col_offset, col_offset + V_r)`` and the targets stay global. The stats pass then gives the
shard's own :math:`\mathrm{lse}_r` and, only where this shard owns the target, the log-prob under
the shard's softmax :math:`z_y - \mathrm{lse}_r` (0 elsewhere); the caller merges them over the
ranks and runs the gradient pass with the global lse and log-probs, whose :math:`\delta_{jy}` lands
on the owner only. On one process ``col_offset = 0``: a valid target is owned unless it lies outside
``[0, V)``; such a target (refused by the caller once the call is queued) is read nowhere.

How
---
One program per row loops over the vocabulary in blocks of ``BLOCK_V``. The stats pass is the
online log-sum-exp of ``row_logsumexp`` (running maximum :math:`m` and sum
:math:`s = \sum e^{z_j - m}`, merged block by block), then reads :math:`z_y` once. The gradient pass reads the saved lse and the row's two weights and re-reads the row once.

What it costs
-------------
Per logit: the stats pass reads it (``e`` = 2 or 4 bytes) with one ``exp`` and ~4 FLOPs; the
gradient pass reads and writes it with one ``exp`` and ~6 FLOPs: ``3·rows·V·e`` bytes for both,
memory-bound and small next to the ``2·rows·V·H`` FLOPs of the matmul that made the chunk. Per row
a few floats more (targets, lse, log-probs). Offsets are 64-bit, so ``rows·V`` may exceed 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .cross_entropy_chunk import NUM_WARPS, block_v
from .row_logsumexp import row_logsumexp


@triton.jit
def token_logprobs_kernel(
    logits_ptr,  # [rows, V] logits of the chunk (fp32/bf16/fp16); overwritten with dz when WRITE_GRAD
    stride_row,  # elements between consecutive rows of logits
    target_ptr,  # [rows] int32/int64 targets y, ignore_index allowed
    target2_ptr,  # [rows] int32/int64 second targets y' (read only when HAS_SECOND)
    lse_ptr,  # float32 [rows]: written by the stats pass, read by the gradient pass
    logp_ptr,  # float32 [rows]: log p(y), 0 at ignored rows (written by the stats pass)
    logp2_ptr,  # float32 [rows]: log p(y'), 0 at ignored rows (stats pass with HAS_SECOND)
    one_minus_p_ptr,  # float32 [rows]: 1 - p(y), formed as -expm1(log p(y)) by the launcher (gradient pass)
    weight_ptr,  # float32: w of row i at weight_ptr[i // rows_per_weight] (gradient pass)
    weight2_ptr,  # float32: w' of row i at weight2_ptr[i // rows_per_weight] (gradient pass, HAS_SECOND)
    rows_per_weight,  # T: consecutive rows sharing one weight (the tokens of one sequence); 1: a weight per row
    n_cols,  # the row's length: V, or this rank's V_r when vocabulary-parallel
    col_offset,  # global class index of the row's first logit (0 on one process); targets are global
    ignore_index,  # target value of rows that contribute nothing
    HAS_SECOND: tl.constexpr,  # a second target y' with its own log-prob and weight
    WRITE_GRAD: tl.constexpr,  # False: stats pass (lse, log-probs); True: gradient pass (dz in place)
    BLOCK_V: tl.constexpr,  # vocabulary elements per loop step (a power of two)
    entropy_ptr=None,  # float32 [rows]: the softmax's entropy, 0 at ignored rows (stats pass with WITH_ENTROPY)
    WITH_ENTROPY: tl.constexpr = False,  # the stats pass also writes the entropy
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    # Targets are global; y (y') below is the target's column in this row, in [0, n_cols) where this
    # shard owns it. The owned test also keeps a target outside [0, V) on one process (refused by the
    # caller after the call's kernels are queued) from reading past the row: keep it.
    y = tl.load(target_ptr + row).to(tl.int64)
    valid = y != ignore_index
    y -= col_offset
    owned = valid & (y >= 0) & (y < n_cols)
    if HAS_SECOND:
        y2 = tl.load(target2_ptr + row).to(tl.int64)
        valid2 = y2 != ignore_index
        y2 -= col_offset
        owned2 = valid2 & (y2 >= 0) & (y2 < n_cols)

    if not WRITE_GRAD:
        m, log_s, _, _, d, _ = row_logsumexp(row_ptr, n_cols, 1.0, row_ptr, False, False, WITH_ENTROPY, BLOCK_V)
        tl.store(lse_ptr + row, m + log_s)
        if WITH_ENTROPY:
            # H = d / s + log s with d = sum_j e^{z_j - m} (m - z_j) (row_logsumexp's note)
            tl.store(entropy_ptr + row, tl.where(valid, d * tl.exp(-log_s) + log_s, 0.0))
        # (z_y - m) - log s, not z_y - (m + log s): for a likely token log p is small next to m,
        # and rounding m + log s first would cost an absolute u·|m| (the float32 reference's: u·|log p|).
        z_y = tl.load(row_ptr + tl.where(owned, y, 0)).to(tl.float32)
        tl.store(logp_ptr + row, tl.where(owned, (z_y - m) - log_s, 0.0))
        if HAS_SECOND:
            z_y2 = tl.load(row_ptr + tl.where(owned2, y2, 0)).to(tl.float32)
            tl.store(logp2_ptr + row, tl.where(owned2, (z_y2 - m) - log_s, 0.0))
    else:
        lse = tl.load(lse_ptr + row)
        seq = row // rows_per_weight
        w = tl.where(valid, tl.load(weight_ptr + seq), 0.0)
        w_total = w
        if HAS_SECOND:
            w2 = tl.where(valid2, tl.load(weight2_ptr + seq), 0.0)
            w_total += w2
        # At j = y the term w (1 - p_y) is w times the stored 1 - p_y, not w - w p_y: as p_y -> 1 that
        # difference cancels (1 - e^{z_y - lse} with a rounded lse: 2e-5 relative error at p_y = 0.99).
        # y' shares it where y' = y; elsewhere its +w' is added as is.
        w_at_y = w
        if HAS_SECOND:
            w_at_y += tl.where(y2 == y, w2, 0.0)
        q_y = tl.load(one_minus_p_ptr + row)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(z - lse)
            dz = tl.where(offs == y, w_at_y * q_y - (w_total - w_at_y) * p, -w_total * p)
            if HAS_SECOND:
                dz += tl.where((offs == y2) & (y2 != y), w2, 0.0)
            tl.store(row_ptr + offs, dz.to(logits_ptr.dtype.element_ty), mask=mask)


def launch_token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    lse: torch.Tensor,
    logp: torch.Tensor,
    ignore_index: int,
    target2: torch.Tensor | None = None,
    logp2: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    col_offset: int = 0,
) -> None:
    """Stats pass on a ``rows × V`` chunk (unit stride along V): write ``lse``, ``logp`` (and ``logp2``).

    ``target`` (and ``target2``, given together with ``logp2``): ``rows`` class indices, each in
    ``[0, V)`` or ``ignore_index`` (the caller refuses any other after the call; the kernel reads
    nothing for it). ``lse``, ``logp``, ``logp2``: float32
    ``rows`` output buffers, written, never read (``torch.empty`` is fine). ``entropy``: optional
    float32 ``rows`` buffer for each row's softmax entropy (0 at ignored rows). ``col_offset``: the
    global class of the chunk's first column (a vocabulary shard; module docstring): ``lse`` and
    ``logp`` are then the shard's, ``logp`` 0 where another shard owns the target; no ``entropy`` there.
    """
    if (target2 is None) != (logp2 is None):
        raise ValueError("give target2 and logp2 together")
    if entropy is not None and col_offset != 0:
        raise ValueError("entropy is the whole row's: not on a vocabulary shard")
    rows, n_cols = logits.shape
    # Unused pointers still need a tensor argument; the constexpr flags keep them unread and unwritten.
    token_logprobs_kernel[(rows,)](
        logits, logits.stride(0), target, target if target2 is None else target2,
        lse, logp, logp if logp2 is None else logp2, lse, lse, lse, 1, n_cols, int(col_offset), int(ignore_index),
        HAS_SECOND=target2 is not None, WRITE_GRAD=False, BLOCK_V=block_v(n_cols),
        entropy_ptr=lse if entropy is None else entropy, WITH_ENTROPY=entropy is not None, num_warps=NUM_WARPS,
    )


def launch_token_logprobs_grad(
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
) -> None:
    """Gradient pass: overwrite the chunk ``logits`` with ``dz = w (onehot(y) - p) + w' (onehot(y') - p)``.

    ``lse``, ``logp``: float32 ``rows``, the stats pass's values for these very logits (``logp``
    gives the target's ``1 - p(y) = -expm1(log p(y))`` without cancellation). ``weight`` (and
    ``weight2``, given together with ``target2``): float32, one weight per ``rows_per_weight``
    consecutive rows (per sequence), ``rows / rows_per_weight`` of them; ``rows_per_weight=1``
    gives every row (token) its own weight. On a vocabulary shard (``col_offset``), ``lse`` and
    ``logp`` are the merged, global values.
    """
    if (target2 is None) != (weight2 is None):
        raise ValueError("give target2 and weight2 together")
    rows, n_cols = logits.shape
    one_minus_p = torch.expm1(logp).neg_()
    token_logprobs_kernel[(rows,)](
        logits, logits.stride(0), target, target if target2 is None else target2,
        lse, lse, lse, one_minus_p, weight, weight if weight2 is None else weight2, int(rows_per_weight), n_cols,
        int(col_offset), int(ignore_index),
        HAS_SECOND=target2 is not None, WRITE_GRAD=True, BLOCK_V=block_v(n_cols), entropy_ptr=lse,
        num_warps=NUM_WARPS,
    )
