r"""The targets' totals in one launch: the valid rows' weight, the ``mean`` normalizer, the bad targets.

What it computes
----------------
For targets :math:`y` (``N``), a vocabulary of ``V`` classes, ``ignore_index`` and optional class
weights :math:`w` (``V``), with :math:`\text{valid}_i = [y_i \ne \text{ignore\_index}]` and
:math:`\text{bad}_i = \text{valid}_i \wedge (y_i < 0 \vee y_i \ge V)`:

.. math::

    T = \sum_i [\text{valid}_i \wedge \neg\text{bad}_i]\, w_{y_i} \ \ (\text{the valid count without weights}),
    \qquad D = T \text{ if } T \ne 0 \text{ else } 1, \qquad B = \sum_i \text{bad}_i,

written as float32 ``out = [T, D, B, [B = 0], 1/D, 1]``. ``D`` is the denominator of
``reduction="mean"`` (1 when no row counts, so an all-ignored batch gives 0, not 0/0); ``B > 0`` is
what the range check reports. The last three are what the losses would otherwise make with one small
launch each: the flag that a device-side assert takes, ``mean``'s gradient factor and ``sum``'s.

Why a kernel
------------
The same totals in torch take about ten small ops (compare, mask, sum, cast, where, …), each a
launch and its host-side cost: at a small vocabulary the logits-level loss's GPU work is shorter than
that host time. One program walks the targets in blocks of
``BLOCK`` and sums in a fixed order (deterministic, no atomics): ``N`` reads of 4 or 8 bytes, nothing
next to the loss's pass over the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Targets per loop step of the one program.
BLOCK = 4096
#: The columns of ``out``.
TOTALS = ("valid_weight", "normalizer", "n_bad", "in_range", "mean_factor", "sum_factor")


@triton.jit
def target_totals_kernel(
    target_ptr,  # [N] int32/int64 class indices, ignore_index allowed
    class_weight_ptr,  # float32 [V] class weights (read only when HAS_WEIGHT)
    out_ptr,  # float32 [6]: T, D, B, [B = 0], 1/D, 1 (written)
    n_rows,  # N
    n_cols,  # V
    ignore_index,  # target value of rows that count for nothing
    HAS_WEIGHT: tl.constexpr,  # weigh each valid row by w_y (else count it)
    BLOCK: tl.constexpr,  # targets per loop step
):
    offsets = tl.arange(0, BLOCK)
    weight_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    bad_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + offsets
        in_range = rows < n_rows
        y = tl.load(target_ptr + rows, mask=in_range, other=ignore_index).to(tl.int64)
        valid = in_range & (y != ignore_index)
        bad = valid & ((y < 0) | (y >= n_cols))
        good = valid & ~bad
        if HAS_WEIGHT:
            weight_sum += tl.load(class_weight_ptr + tl.where(good, y, 0), mask=good, other=0.0)
        else:
            weight_sum += good.to(tl.float32)
        bad_sum += bad.to(tl.float32)
    total = tl.sum(weight_sum, axis=0)
    normalizer = tl.where(total != 0.0, total, 1.0)
    n_bad = tl.sum(bad_sum, axis=0)
    tl.store(out_ptr, total)
    tl.store(out_ptr + 1, normalizer)
    tl.store(out_ptr + 2, n_bad)
    tl.store(out_ptr + 3, tl.where(n_bad == 0.0, 1.0, 0.0))
    tl.store(out_ptr + 4, 1.0 / normalizer)
    tl.store(out_ptr + 5, 1.0)


def launch_target_totals(target: torch.Tensor, n_cols: int, ignore_index: int,
                         class_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``out = [T, D, B, [B = 0], 1/D, 1]`` (float32, on ``target``'s device) for contiguous ``target`` and, optionally,
    a contiguous float32 ``class_weight`` of ``n_cols`` classes."""
    out = torch.empty(len(TOTALS), dtype=torch.float32, device=target.device)
    target_totals_kernel[(1,)](
        target, class_weight if class_weight is not None else out, out, target.numel(), int(n_cols), int(ignore_index),
        HAS_WEIGHT=class_weight is not None, BLOCK=BLOCK, num_warps=8,
    )
    return out
