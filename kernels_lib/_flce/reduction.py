"""The reduction of the fused linear cross-entropy: ``mean``'s denominator, each row's gradient factor.

``mean`` divides by ``num_items_in_batch`` when given, else by the valid rows' total weight
(:func:`kernels_lib._target_totals.target_totals`); either may be a device tensor, and neither is ever
read on the host (a host sync would leave the GPU idle until the next step's first launch), so the
factor of each row's gradient, ``pre / normalizer``, is formed on the device as a one-element tensor
that the kernels read.
"""

from __future__ import annotations

import torch


def _normalizer(num_items_in_batch, valid_normalizer: torch.Tensor):
    """The denominator of ``mean``: ``num_items_in_batch`` when given, else the valid rows' total
    weight (their number without class weights; 1 where that is 0, so an all-ignored batch gives 0),
    a device tensor never read on the host."""
    if num_items_in_batch is not None:
        return num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else float(num_items_in_batch)
    return valid_normalizer


def _reduce(per_row: torch.Tensor, reduction: str, normalizer, shape) -> torch.Tensor:
    """``none``: reshape to the target's shape; ``sum``; ``mean``: the sum divided by ``normalizer``
    (a float, or a one-element tensor such as the Trainer's ``num_items_in_batch``)."""
    if reduction == "none":
        return per_row.view(shape)
    total = per_row.sum()
    return total / normalizer if reduction == "mean" else total


def _factor_tensor(pre: float, normalizer, reduction: str, device) -> torch.Tensor:
    """The gradient factor of every row, ``pre / normalizer`` (``mean``) or ``pre`` (``sum``), as a
    one-element float32 tensor, formed on the device (a tensor normalizer is never read on the host)."""
    if reduction != "mean":
        return torch.full((1,), pre, dtype=torch.float32, device=device)
    if isinstance(normalizer, torch.Tensor):
        return pre / normalizer.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), pre / normalizer, dtype=torch.float32, device=device)
