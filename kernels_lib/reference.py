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


def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    chunk_size: int | None = None,
    accurate: bool = True,
):
    """Materialized logits ``x @ weight.T + bias`` in float32 (float64 for float64 inputs), then
    ``torch.nn.functional.cross_entropy``, plus the z-loss ``λ·lse²`` over the valid rows.

    ``chunk_size`` and ``accurate`` are accepted and ignored. Softcap ``s·tanh(z/s)`` is applied to
    the logits first. With ``mean`` and every target ignored the result is NaN, as torch gives.
    The returned z-loss (``return_z_loss``) is the same term reduced alone.
    """
    del chunk_size, accurate
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    logits = logits.reshape(-1, weight.shape[0])
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = target.reshape(-1).long()
    loss = F.cross_entropy(
        logits, flat, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
    valid = flat != ignore_index
    z_rows = torch.where(valid, z_loss_scale * torch.logsumexp(logits, dim=-1).square(), 0.0)
    z_loss = {"none": z_rows, "sum": z_rows.sum(), "mean": z_rows.sum() / valid.sum()}[reduction]
    if reduction == "none":
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    loss = loss + z_loss
    return (loss, z_loss) if return_z_loss else loss
