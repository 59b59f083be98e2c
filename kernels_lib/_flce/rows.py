r"""The valid rows of the fused linear cross-entropy: ignored rows dropped before the head's matmuls.

A row whose target is ``ignore_index`` contributes 0 to the loss and 0 to every gradient, yet on the
chunked routes it costs its share of the three matmuls (``x W^T``, ``dz W``, ``dz^T x``). When some row
is ignored, :func:`valid_rows` gives the indices of the others; the call then gathers those rows of
``x`` and of the targets (one read and one write of ``n_valid × H``), runs on them alone, and
``x``'s gradient comes back through the gather's own backward (a zeroed ``N × H`` with the valid
rows' ``dx`` written in: 0 at ignored rows). Per-row outputs (``reduction="none"``, the token
statistics) are scattered back by :func:`scatter_rows`, 0 (False) at ignored rows. ``mean``'s
denominator is formed from the full targets, so nothing else changes.

What it costs: the number of valid rows sizes the gathered tensor, so it is read on the host (one
``nonzero``, a host sync: on CUDA the CPU waits for the work queued before the loss). Then nothing is
gathered when no row is ignored. The matmuls saved are ``6·m·H·V`` FLOPs for ``m`` ignored rows; the
gather and the scatter move about ``4·n_valid·H`` elements more: at ``V = 32000`` on an H100
(about 200 FLOPs per byte in bf16) the gather pays for itself from about 1 % of the rows ignored.
``skip_ignored=False`` keeps every row (no sync, no gather): for a launch-bound step whose CPU must run
ahead of the GPU. While a CUDA graph is being captured (where a sync is an error) nothing is gathered.

With every row ignored one row is kept (its loss and gradient are 0), so the documented results of an
all-ignored batch hold (``mean`` 0, every gradient 0).
"""

from __future__ import annotations

import torch

from .._runtime import capturing


def valid_rows(target: torch.Tensor, ignore_index: int, enabled: bool) -> torch.Tensor | None:
    """The indices (int64, ascending) of the rows of the flat ``target`` to run, or None to run them all
    (``enabled`` False, a CUDA graph being captured, or no row ignored). With every row ignored: row 0."""
    if not enabled or capturing(target.device):
        return None
    index = torch.nonzero(target != ignore_index).squeeze(1)  # the host sync: the count sizes the result
    if index.numel() == target.numel():
        return None
    if index.numel() == 0:  # one ignored row stands for them all
        return None if target.numel() == 1 else index.new_zeros(1)
    return index


def scatter_rows(values: torch.Tensor, index: torch.Tensor, n_rows: int, shape, fill=0) -> torch.Tensor:
    """``values`` of the kept rows written at ``index`` of ``n_rows`` elements ``fill`` (0: False for
    bool), in the target's ``shape``; differentiable (the gradient of a kept row is read back at its index)."""
    full = values.new_full((n_rows, *values.shape[1:]), fill)
    return full.index_copy(0, index, values).view(*shape, *values.shape[1:])
