"""The targets' preamble shared by the cross-entropy losses: the ``mean`` normalizer and the range check.

One launch (:mod:`kernels_lib.kernels.target_totals`) gives the valid rows' total weight, the
normalizer and the number of targets outside ``[0, V)``; the range check then either reads that count
on the host behind an event (``host_checks=True``: a ValueError naming a bad target, raised by the
caller once the call's work is queued) or asserts it on the device (``torch._assert_async``: on
CUDA a device-side assert, as torch's own ``cross_entropy`` gives; on a CPU an immediate
RuntimeError), with no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _validate as v
from .kernels.target_totals import launch_target_totals


class TargetTotals(NamedTuple):
    """What :func:`target_totals` gives, float32 device tensors (views of one launch's output)."""

    valid_weight: torch.Tensor  #: 0-dim: the valid rows' total weight Σ w_y (their count without class weights)
    normalizer: torch.Tensor  #: 0-dim: mean's denominator, that total or 1 where it is 0
    mean_factor: torch.Tensor  #: (1,): 1 / normalizer, the gradient factor of reduction="mean"
    sum_factor: torch.Tensor  #: (1,): 1, the gradient factor of reduction="sum"
    weight_sum: torch.Tensor | None  #: (1,): Σ_j w_j for the kernels; None without class weights
    check: v.TargetCheck | None  #: its raise_if_bad ends the call; None without host_checks


def target_totals(target: torch.Tensor, n_cols: int, ignore_index: int, class_weight: torch.Tensor | None,
                  host_checks: bool) -> TargetTotals:
    """The :class:`TargetTotals` of ``target`` (any shape, int32/int64) over ``n_cols`` classes, with
    optional class weights (contiguous float32). With ``host_checks`` the range check is a
    :class:`~kernels_lib._validate.TargetCheck` whose ``raise_if_bad`` the caller runs at the end of the
    call; without, a device-side assert on the launch's ``[B = 0]`` flag. One launch and no other op
    (but the class weights' sum)."""
    totals = launch_target_totals(target.reshape(-1).contiguous(), n_cols, ignore_index, class_weight)
    check = None
    if host_checks:
        check = v.TargetCheck(target, n_cols, ignore_index, n_bad=totals[2])
    else:
        torch._assert_async(totals[3], f"target holds values outside [0, {n_cols}) that are not ignore_index={ignore_index}")
    weight_sum = None if class_weight is None else class_weight.sum().reshape(1)
    return TargetTotals(totals[0], totals[1], totals[4:5], totals[5:6], weight_sum, check)
