"""The baselines, with the same signatures as the kernels, so a check or a benchmark swaps one for the other.

Each is the implementation the published charts call the baseline (SPEC §2), run as is: called on
float64 inputs it is also the reference that kernels are checked against.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def kl_div(
    input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean", log_target: bool = False
) -> torch.Tensor:
    """``torch.nn.functional.kl_div``: the published "torch" provider (it materializes the pointwise loss).

    torch warns on every ``reduction="mean"`` call that the mean runs over all elements; that is the
    documented semantics here, so the warning is silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="reduction: 'mean' divides the total loss")
        return F.kl_div(input, target, reduction=reduction, log_target=log_target)
