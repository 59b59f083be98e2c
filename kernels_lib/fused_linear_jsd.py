r"""Fused linear + generalized JSD: a student head against a teacher head, neither ``N × V`` logits stored.

.. math::

    x_i = \log\operatorname{softmax}\big((x^s_i W_s^\top + b_s) / T\big), \qquad
    y_i = \log\operatorname{softmax}\big((x^t_i W_t^\top + b_t) / T\big),

    L = \frac{1}{D} \sum_{i\ \text{kept}} \sum_j \ell_\beta(x_{ij}, y_{ij}), \qquad
    \ell_\beta = \beta\,p\,(y - \log m) + (1-\beta)\,q\,(x - \log m), \quad m = \beta p + (1-\beta) q,

with :math:`q = e^x` (student), :math:`p = e^y` (teacher): :func:`kernels_lib.jsd`'s generalized JSD
(TRL's ``beta``: 0 is KL(teacher ‖ student), 1 is KL(student ‖ teacher)) on the two heads'
temperature-scaled log-softmax. Rows whose ``target`` is ``ignore_index`` are skipped. ``D`` is the
number of kept rows, at least 1 (``batchmean``), 1 (``sum``) or that times ``V`` (``mean``).

Gradient (student only; the teacher is a constant): with :math:`g_{ij} = \partial\ell/\partial x_{ij}`
(:mod:`kernels_lib.jsd`) and :math:`G_i = \sum_j g_{ij}`, the log-softmax's Jacobian gives, for the
raw student logits :math:`z`,

.. math:: \frac{\partial L}{\partial z_{ij}} = \frac{1}{D\,T}\,\big(g_{ij} - q_{ij}\,G_i\big),

then ``dx = dz W_s``, ``dW_s = dzᵀ x_s``, ``db_s = Σ dz``; all formed in forward, chunk by chunk
(:mod:`kernels_lib._distillation`, with the two-head kernel :mod:`kernels_lib.kernels.distill_chunk`).

Cost: four matmuls of :math:`2 N V H` FLOPs each order (:math:`2NVH_s` and :math:`2NVH_t` for the
two logits products, :math:`2 \cdot 2NVH_s` for ``dx`` and ``dW``); bytes at least: read both heads'
inputs and weights, write ``dx`` and ``dW``; per chunk the kernel moves ``7 · rows · V`` logits
(:mod:`kernels_lib.kernels.distill_chunk`). Memory: two ``chunk × V`` buffers plus the gradients.

**Against the peers.**

* Liger-Kernel's ``LigerFusedLinearJSD`` (``liger_kernel.transformers``; ``jsd_beta``,
  ``ignore_index``, ``temperature``, ``shift_labels``): the same loss with the same beta, summed over
  non-ignored rows divided by their number. Differences: it has no biases (we take both); with every
  row ignored it divides by 0 (we give 0 with zero gradients, as TRL); it counts the kept rows on
  the host (``.item()``, a sync; ours stays on the device); only ``batchmean``.
* TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` on materialized logits: the same formula, beta and
  temperature; its ``batchmean`` with labels divides by the kept tokens (ours too), without labels
  by the batch dimension of 3-D logits (ours by the rows, ``N = B·T``: flatten its input or use
  ``sum``); its ``mean`` is ours; it gives NaN for ``mean`` with every row ignored (ours 0);
  ``num_items_in_batch``: use ``sum`` and divide.
* TRL 1.16's ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``: the same per-token
  divergence (mixture ``(1 - beta) p_student + beta p_teacher``) from the two heads, unreduced and
  unmasked, with the student's entropy; it recomputes the logits in backward (six matmuls).

Teacher tensors are constants: they are read detached and get no gradient, whether or not they
require grad (a teacher head is usually an ``nn.Parameter``, as Liger's and TRL's examples pass it).
This differs from :func:`kernels_lib.jsd`, which refuses a teacher that requires grad.
"""

from __future__ import annotations

import torch

from ._distillation import (
    TwoHeadInputs, fused_two_head_loss, jsd_soft, kept_rows, teacher_constant, validate_heads, validate_options,
)
from . import _validate as v
from ._module import loss_module
from .jsd import _require_beta

#: The reductions: ``batchmean`` (sum / kept rows), ``sum``, ``mean`` (sum / (kept rows · V)).
REDUCTIONS = ("batchmean", "sum", "mean")


def _divisor(kept: torch.Tensor, reduction: str, n_cols: int) -> torch.Tensor:
    """The float32 device scalar the summed loss is divided by (kept rows clamped to at least 1)."""
    if reduction == "sum":
        return torch.ones_like(kept)
    rows = kept.clamp_min(1.0)
    return rows * n_cols if reduction == "mean" else rows


def _validate_options(beta, temperature, ignore_index, reduction, chunk_size, accurate):
    """The options checked: ``(soft loss, two-head options)``."""
    soft = jsd_soft(_require_beta(beta))
    opts = validate_options(temperature, ignore_index, chunk_size, accurate)
    v.require_choice("reduction", reduction, REDUCTIONS)
    return soft, opts


@torch.compiler.disable
def fused_linear_jsd(
    student_x: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_x: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    chunk_size: int | None = None,
    accurate: bool = False,
) -> torch.Tensor:
    """Generalized JSD between a student and a teacher LM head (see the module docstring), fused.

    Args:
        student_x: ``(..., H_s)`` student hidden states (leading dims flatten to ``N`` rows); float32,
            bfloat16 or float16. Gradients flow to it.
        student_weight: ``(V, H_s)``, the dtype of ``student_x`` (any inside ``torch.autocast``). Gradients flow to it.
        teacher_x: ``(..., H_t)`` with ``student_x``'s leading dims; any of the three float dtypes
            (the teacher's own). A constant: no gradient.
        teacher_weight: ``(V, H_t)``, the dtype of ``teacher_x`` (any inside ``torch.autocast``). A constant.
        target: optional ``student_x.shape[:-1]`` int64/int32 labels, only compared with ``ignore_index``
            (rows equal to it are skipped); None counts every row.
        student_bias, teacher_bias: optional ``(V,)`` in their head's dtype; gradients flow to the student's.
        beta: the teacher's weight in the mixture, in [0, 1]: 0 is KL(teacher ‖ student), 1 is
            KL(student ‖ teacher).
        temperature: ``T > 0``; both heads' logits are divided by it before the log-softmax.
        ignore_index: the ``target`` value of skipped rows.
        reduction: ``"batchmean"`` (sum over kept rows / their number, at least 1), ``"sum"`` or
            ``"mean"`` (``batchmean / V``). No ``"none"``: the pointwise loss is the ``N × V`` matrix
            this function exists not to store.
        chunk_size: rows per chunk, or None for the default (``H_s / 8`` rows, at least 2048: two
            ``chunk × V`` buffers; a smaller chunk holds less memory for more time).
        accurate: accumulate ``dW``/``db`` across chunks in float32 (as cross-entropy's option).

    Returns:
        The float32 loss, a scalar. Every row ignored gives 0 and zero gradients. NaN in a kept row
        of either head gives NaN.

    Raises:
        TypeError: a non-tensor, a dtype other than float32/bfloat16/float16 or differing within a
            head, a non-integer ``target``, an option of the wrong type.
        ValueError: shapes that do not fit (naming the argument), empty inputs, different devices or
            one the kernels cannot run on, ``beta`` outside [0, 1], ``temperature <= 0``, an unknown
            reduction.
    """
    validate_heads(student_x, student_weight, teacher_x, teacher_weight, target, student_bias, teacher_bias,
                   target_required=False)
    soft, opts = _validate_options(beta, temperature, ignore_index, reduction, chunk_size, accurate)
    flat_target = None if target is None else target.reshape(-1).contiguous()
    n_cols = student_weight.shape[0]
    divisor = _divisor(kept_rows(flat_target, student_x.numel() // student_x.shape[-1], ignore_index, student_x.device),
                       reduction, n_cols)
    inputs = TwoHeadInputs(teacher_constant(teacher_x, teacher_weight, teacher_bias), flat_target, soft, divisor,
                           with_hard=False)
    return fused_two_head_loss(student_x, student_weight, student_bias, inputs, opts).loss


FusedLinearJSDLoss = loss_module(
    fused_linear_jsd, "FusedLinearJSDLoss",
    "``nn.Module`` form of :func:`fused_linear_jsd`: the module holds the options; both heads stay with their "
    "models and are passed at each call.", check=_validate_options,
)
__all__ = ["fused_linear_jsd", "FusedLinearJSDLoss", "REDUCTIONS"]
