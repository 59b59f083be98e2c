r"""Distillation losses: a hard loss on the labels plus a soft loss against a teacher head, both fused.

Liger-Kernel's chunked distillation semantics (``liger_kernel.chunked_loss``,
``LigerFusedLinearDistillationBase``: ``LigerFusedLinearJSDLoss``, ``LigerFusedLinearCosineSimilarityLoss``).
With the raw student logits :math:`z_i = x^s_i W_s^\top + b_s`, the teacher's
:math:`u_i = x^t_i W_t^\top + b_t`, the temperature :math:`T`, the targets :math:`t_i`, and
:math:`n = \max(1, \#\{i : t_i \ne \text{ignore\_index}\})`,

.. math::

    \text{hard} = \frac1n \sum_{i\ \text{kept}} \big(\mathrm{lse}(z_i) - z_{i,t_i}\big), \qquad
    \text{soft} = \frac1n \sum_{i\ \text{kept}} s(z_i / T,\ u_i / T),

    \text{loss} = w_h\,\text{hard} + w_s\,\text{soft},

so the hard loss is the cross-entropy of the *raw* logits (no temperature), and the soft loss per row is

* :func:`distill_jsd_loss`: the generalized JSD of the two ``log_softmax`` summed over the vocabulary,
  :math:`s = \sum_j \beta\,p_j(y_j - \log m_j) + (1-\beta)\,q_j(x_j - \log m_j)`, TRL's ``beta``
  (0: KL(teacher ‖ student), 1: KL(student ‖ teacher); as :func:`kernels_lib.jsd`);
* :func:`distill_cosine_loss`: :math:`s = \beta\,(1 - \cos(z_i, u_i))` (Liger normalizes both rows
  and takes ``F.cosine_similarity``; the cosine does not depend on :math:`T`).

Gradient (student only; the teacher is a constant), for the raw student logits of a kept row,

.. math::

    \frac{\partial\,\text{loss}}{\partial z_{ij}} = \frac{w_h}{n}\big(\mathrm{softmax}(z_i)_j - \delta_{j t_i}\big)
        + \frac{w_s}{n}\,\frac{\partial s}{\partial z_{ij}},

with :math:`\partial s/\partial z = \frac1T (g - q\,G)` for the JSD (:mod:`kernels_lib.fused_linear_jsd`) and
:math:`-\beta\,\big(u_j / (|z||u|) - \cos\, z_j / |z|^2\big)` for the cosine; formed in forward chunk
by chunk with one kernel (:mod:`kernels_lib.kernels.distill_chunk`), the pipeline shared with
:func:`kernels_lib.fused_linear_jsd` (:mod:`kernels_lib._distillation`).

Cost: the two logits matmuls (:math:`2NVH_s + 2NVH_t` FLOPs) and ``dx``, ``dW`` (:math:`4NVH_s`);
per chunk the kernel reads both logits chunks three times (JSD; twice for the cosine) and writes
``dz`` once. Memory: two ``chunk × V`` buffers and the gradients. The targets' range is counted on the
device and read once the call's kernels are queued: no host sync in bfloat16 and float32 (in float16
the gradient's scale is read on the host, from its largest factor).

**Where we differ from Liger** (0.8.5): ``hard_loss`` and ``soft_loss`` are always returned, for
logging, and carry no gradient (Liger returns them only with ``return_soft_hard_loss``; its
``loss`` then still carries the gradient, as ours); the hard loss is always computed (Liger skips it
when ``weight_hard_loss == 0`` and it is not returned); both heads must have the same ``V`` (Liger
pads a smaller student vocabulary with zero logits); a row whose student logits are all 0 has cosine
0 as in Liger, but its gradient is taken with the norm clamped (Liger's autograd through
``F.normalize`` likewise); chunks are our row chunks (Liger: ``N // chunk_size`` ``torch.chunk``
pieces, ``torch.compile``\d), which changes rounding only. Everything else -- weights, beta,
temperature, ``ignore_index``, biases, the normalization by the non-ignored targets clamped to 1 --
is Liger's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from ._distillation import (
    SoftLoss, TwoHeadInputs, cosine_soft, fused_two_head_loss, jsd_soft, kept_rows, teacher_constant,
    validate_heads, validate_options,
    two_head_chunk_size,
)
from . import _validate as v
from ._module import loss_module
from .jsd import _require_beta


class DistillationOutput(NamedTuple):
    """What the distillation losses return; all float32 scalars, only ``loss`` carries a gradient."""

    loss: torch.Tensor  #: ``weight_hard_loss · hard_loss + weight_soft_loss · soft_loss``
    hard_loss: torch.Tensor  #: the cross-entropy of the raw student logits over the kept rows / n
    soft_loss: torch.Tensor  #: the soft loss (JSD or ``beta · (1 − cos)``) over the kept rows / n


def _distill(soft: SoftLoss, student_x, student_weight, teacher_x, teacher_weight, target, student_bias, teacher_bias,
             weight_hard_loss, weight_soft_loss, temperature, ignore_index, chunk_size, accurate) -> DistillationOutput:
    """The shared body of the two losses: validate, count, run the two-head pipeline, weigh."""
    validate_heads(student_x, student_weight, teacher_x, teacher_weight, target, student_bias, teacher_bias,
                   target_required=True)
    opts = validate_options(temperature, ignore_index, chunk_size, accurate)
    for name, value in (("weight_hard_loss", weight_hard_loss), ("weight_soft_loss", weight_soft_loss)):
        v.require_real(name, value)
    flat_target = target.reshape(-1).contiguous()
    check = v.check_targets(flat_target, student_weight.shape[0], ignore_index)
    count = kept_rows(flat_target, flat_target.numel(), ignore_index, student_x.device).clamp_min(1.0)
    inputs = TwoHeadInputs(teacher_constant(teacher_x, teacher_weight, teacher_bias), flat_target, soft, count,
                           with_hard=True)
    opts = replace(opts, hard_weight=float(weight_hard_loss), soft_weight=float(weight_soft_loss))
    out = DistillationOutput(*fused_two_head_loss(student_x, student_weight, student_bias, inputs, opts))
    check.raise_if_bad()  # the targets' range, read now that the call's kernels are queued
    return out


_ARGS_DOC = """
    Args:
        student_x: ``(..., H_s)`` student hidden states (leading dims flatten to ``N`` rows); float32,
            bfloat16 or float16. Gradients flow to it.
        student_weight: ``(V, H_s)``, the dtype of ``student_x`` (any inside ``torch.autocast``). Gradients flow to it.
        teacher_x: ``(..., H_t)`` with ``student_x``'s leading dims; any of the three float dtypes.
            A constant: read detached, no gradient, whether or not it requires grad.
        teacher_weight: ``(V, H_t)``, the dtype of ``teacher_x`` (any inside ``torch.autocast``). A constant.
        target: ``student_x.shape[:-1]`` int64/int32 labels aligned with the rows (no shift inside),
            each in ``[0, V)`` or ``ignore_index``.
        student_bias, teacher_bias: optional ``(V,)`` in their head's dtype; gradients flow to the student's.
        weight_hard_loss, weight_soft_loss: ``w_h``, ``w_s`` (0.5 each, as Liger).
        beta: see the soft loss above (0.5, as Liger's modules).
        temperature: ``T > 0``, dividing both heads' logits in the soft loss only.
        ignore_index: the target value of rows that count nowhere (nor in ``n``).
        chunk_size: rows per chunk, or None for the default (``H_s / 8`` rows, at least 2048: two
            ``chunk × V`` buffers; a smaller chunk holds less memory for more time).
        accurate: accumulate ``dW``/``db`` across chunks in float32.

    Returns:
        :class:`DistillationOutput` ``(loss, hard_loss, soft_loss)``, float32 scalars. Every row
        ignored gives 0 for all three and zero gradients (Liger's clamp of ``n`` to 1). NaN in a kept
        row of either head gives NaN.

    Raises:
        TypeError: a non-tensor, a dtype other than float32/bfloat16/float16 or differing within a
            head, a non-integer or missing ``target``, an option of the wrong type.
        ValueError: shapes that do not fit (naming the argument), empty inputs, different devices or
            one the kernels cannot run on, targets outside ``[0, V)`` other than ``ignore_index``,
            ``temperature <= 0``{beta_error}.
"""


@torch.compiler.disable
def distill_jsd_loss(student_x: torch.Tensor, student_weight: torch.Tensor, teacher_x: torch.Tensor,
                     teacher_weight: torch.Tensor, target: torch.Tensor, *, student_bias: torch.Tensor | None = None,
                     teacher_bias: torch.Tensor | None = None, weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5, beta: float = 0.5,
                     temperature: float = 1.0, ignore_index: int = -100, chunk_size: int | None = None,
                     accurate: bool = False) -> DistillationOutput:
    return _distill(jsd_soft(_require_beta(beta)), student_x, student_weight, teacher_x, teacher_weight, target,
                    student_bias, teacher_bias, weight_hard_loss, weight_soft_loss, temperature, ignore_index,
                    chunk_size, accurate)


distill_jsd_loss.__doc__ = (
    """Hard cross-entropy plus generalized-JSD soft loss against a teacher head, fused (Liger's
    ``LigerFusedLinearJSDLoss``; see the module docstring). ``beta`` in [0, 1] is TRL's and Liger's: 0
    is KL(teacher ‖ student), 1 KL(student ‖ teacher).
""" + _ARGS_DOC.format(beta_error=", ``beta`` outside [0, 1]")
)


@torch.compiler.disable
def distill_cosine_loss(student_x: torch.Tensor, student_weight: torch.Tensor, teacher_x: torch.Tensor,
                        teacher_weight: torch.Tensor, target: torch.Tensor, *, student_bias: torch.Tensor | None = None,
                        teacher_bias: torch.Tensor | None = None, weight_hard_loss: float = 0.5, weight_soft_loss: float = 0.5,
                        beta: float = 0.5, temperature: float = 1.0, ignore_index: int = -100,
                        chunk_size: int | None = None, accurate: bool = False) -> DistillationOutput:
    v.require_real("beta", beta)
    return _distill(cosine_soft(beta), student_x, student_weight, teacher_x, teacher_weight, target,
                    student_bias, teacher_bias, weight_hard_loss, weight_soft_loss, temperature, ignore_index,
                    chunk_size, accurate)


distill_cosine_loss.__doc__ = (
    """Hard cross-entropy plus cosine soft loss ``beta · (1 − cos(z_s, z_t))`` per row against a teacher
    head, fused (Liger's ``LigerFusedLinearCosineSimilarityLoss``; see the module docstring). ``beta``
    is the soft loss's factor, any finite real.
""" + _ARGS_DOC.format(beta_error="")
)


def _validate_module_options(weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index, chunk_size, accurate):
    """The options the functions check at each call, checked once when a module is built."""
    for name, value in (("weight_hard_loss", weight_hard_loss), ("weight_soft_loss", weight_soft_loss), ("beta", beta)):
        v.require_real(name, value)
    validate_options(temperature, ignore_index, chunk_size, accurate)


def _validate_jsd_module_options(beta, **options):
    _validate_module_options(beta=beta, **options)
    _require_beta(beta)


DistillJSDLoss = loss_module(
    distill_jsd_loss, "DistillJSDLoss",
    "``nn.Module`` form of :func:`distill_jsd_loss` (Liger's ``LigerFusedLinearJSDLoss``, x before weight): the "
    "module holds the options; both heads stay with their models and are passed at each call.",
    check=_validate_jsd_module_options,
)
DistillCosineLoss = loss_module(
    distill_cosine_loss, "DistillCosineLoss",
    "``nn.Module`` form of :func:`distill_cosine_loss` (Liger's ``LigerFusedLinearCosineSimilarityLoss``): the "
    "module holds the options; both heads stay with their models and are passed at each call.",
    check=_validate_module_options,
)


__all__ = ["DistillationOutput", "distill_jsd_loss", "distill_cosine_loss", "DistillJSDLoss", "DistillCosineLoss",
           "two_head_chunk_size"]
