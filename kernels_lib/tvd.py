r"""Total variation distance between two (N, V) probability tensors, gradient written in forward.

.. math::

    \mathrm{TVD}(p, q) = \tfrac12 \sum_i |p_i - q_i| \ \text{per row}, \qquad
    \frac{\partial}{\partial p_i} = \tfrac12 \operatorname{sign}(p_i - q_i)\ (0 \text{ where } p_i = q_i)

with the semantics of Liger's ``LigerTVDLoss`` (``liger_kernel/transformers/tvd.py``;
``liger_kernel/ops/tvd.py``: ``_tv_distance_kernel`` computes ``0.5 * abs(p - q)`` and the gradient
``0.5 * sgn(p - q) * scale``, 0 where ``p == q``; ``tv_distance_forward_triton`` sets ``scale`` to
``1 / n_non_ignore`` for ``batchmean``, ``1 / (n_non_ignore * V)`` for ``mean``, 1 for ``sum``, and
zeroes ignored rows' loss and gradient). The gradient goes to ``p`` only (the first argument), as in
Liger, where ``q`` gets ``None``; a ``q`` that requires grad is refused (detach it).

**Rows and reductions.** ``target`` (N,) integers, when given, ignores the rows where it equals
``ignore_index``; with ``R`` kept rows (``N`` without ``target``): ``"batchmean"`` (default) sum /
``max(R, 1)``, ``"sum"``, ``"mean"`` sum / ``(max(R, 1) * V)``, ``"none"`` the (N, V) pointwise loss
with ignored rows 0. Liger divides by ``R`` itself (a ``ZeroDivisionError`` when every row is
ignored); we give 0 there. Liger's ``"sum"`` is a scalar too (``output_tensor.sum(dim=0)`` of its
(N,) per-row sums).

**Cost.** One pass reads both inputs and writes the gradient (12 bytes per fp32 element); backward
scales it only when the upstream gradient is not 1. float32 accumulation; fp32, bf16, fp16 inputs
(the loss has the promoted dtype, the gradient ``p``'s). NaN in a kept row gives NaN in the loss and
its gradient (torch's ``sign``). Deterministic; no host sync.
"""

from __future__ import annotations

import torch

from . import _validate as v
from ._module import loss_module
from ._row_divergence import REDUCTIONS, RowDivergenceFunction, validate
from .kernels.tvd import launch_tvd

__all__ = ["tvd", "TVDLoss", "REDUCTIONS"]


def tvd(
    p: torch.Tensor,
    q: torch.Tensor,
    *,
    ignore_index: int = -100,
    target: torch.Tensor | None = None,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Total variation distance ``0.5 * sum |p - q|`` per row of (N, V) probabilities, reduced.

    Args:
        p: (N, V) probabilities; float32, bfloat16 or float16. Gradients flow to it.
        q: (N, V) probabilities, same device; no gradient (detach it).
        ignore_index: rows whose ``target`` equals it are ignored (only with ``target``).
        target: optional (N,) int64/int32 labels; only compared with ``ignore_index``.
        reduction: ``"batchmean"`` (sum / kept rows), ``"sum"``, ``"mean"`` (sum / (kept rows * V))
            or ``"none"`` ((N, V), ignored rows 0).

    Returns:
        The loss in the promoted dtype of ``p`` and ``q`` (float32 accumulation).

    Raises:
        TypeError: non-tensors, integer/bool/complex/float64 ``p``/``q``, non-integer ``target``,
            a non-int ``ignore_index``.
        ValueError: shapes that differ or are not 2-D, empty tensors, a ``target`` not of shape (N,),
            different devices or one the kernels cannot run on, an unknown reduction, a ``q`` that
            requires grad.
    """
    needs_grad = validate(("p", "q"), p, q, target, ignore_index, reduction, "tvd")
    return RowDivergenceFunction.apply(p, q, target, launch_tvd, {}, ignore_index, reduction, needs_grad)


def _validate_options(ignore_index, reduction) -> None:
    v.require_int("ignore_index", ignore_index)
    v.require_choice("reduction", reduction, REDUCTIONS)


TVDLoss = loss_module(tvd, "TVDLoss", "``nn.Module`` form of :func:`tvd`: ``TVDLoss()(p, q, target=None)``.",
                      check=_validate_options)
