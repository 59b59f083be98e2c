"""The targets' preamble shared by the cross-entropy losses: the ``mean`` normalizer and the range check.

One launch (:mod:`kernels_lib.kernels.target_totals`) gives the valid rows' total weight, the
normalizer and the number of targets outside ``[0, V)``; the range check then either reads that count
on the host behind an event (``host_checks=True``: a ValueError naming a bad target, raised by the
caller once the call's work is queued) or asserts it on the device (``torch._assert_async``: on
CUDA a device-side assert, as torch's own ``cross_entropy`` gives; on a CPU an immediate
RuntimeError), with no host sync.
"""

from __future__ import annotations

import torch

from . import _validate as v
from .kernels.target_totals import launch_target_totals


def target_totals(target: torch.Tensor, n_cols: int, ignore_index: int, class_weight: torch.Tensor | None,
                  host_checks: bool):
    """``(valid_weight, normalizer, weight_sum, check)`` for ``target`` (any shape, int32/int64) over
    ``n_cols`` classes: the valid rows' total weight ``Σ w_y`` (their count without class weights) and
    ``mean``'s denominator (that total, or 1 where it is 0), both 0-dim float32 device tensors;
    ``Σ_j w_j`` as a ``(1,)`` float32 tensor for the kernels (None without class weights, which must
    be contiguous float32); and the :class:`~kernels_lib._validate.RangeCheck` whose ``raise_if_bad``
    the caller runs at the end of the call (None without ``host_checks``)."""
    totals = launch_target_totals(target.reshape(-1).contiguous(), n_cols, ignore_index, class_weight)
    valid_weight, normalizer, n_bad = totals.unbind(0)
    check = None
    if host_checks:
        check = v.RangeCheck(target, n_bad, n_cols, ignore_index)
    else:
        torch._assert_async(n_bad == 0, f"target holds values outside [0, {n_cols}) that are not ignore_index={ignore_index}")
    weight_sum = None if class_weight is None else class_weight.sum().reshape(1)
    return valid_weight, normalizer, weight_sum, check
