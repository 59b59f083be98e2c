r"""Generalized Jensen–Shannon divergence for distillation, on log-probabilities, gradient written in forward.

.. math::

    \mathrm{JSD}_\beta = \beta\,\mathrm{KL}(p\,\|\,m) + (1-\beta)\,\mathrm{KL}(q\,\|\,m),
    \qquad m = \beta\,p + (1-\beta)\,q,

per row, for teacher probabilities :math:`p = e^{y}` and student probabilities :math:`q = e^{x}`
(``teacher_logp`` :math:`y`, ``student_logp`` :math:`x`). The formula tends to 0 at both ends, so,
as TRL does, :math:`\beta = 0` is :math:`\mathrm{KL}(p\,\|\,q)` (forward KL, teacher || student) and
:math:`\beta = 1` is :math:`\mathrm{KL}(q\,\|\,p)` (reverse KL, student || teacher).

**Conventions.** TRL 1.16, ``trl/experimental/gkd/gkd_trainer.py``, ``GKDTrainer.generalized_jsd_loss``
(lines 238-321): lines 278-279 ``beta == 0`` is ``F.kl_div(student_log_probs, teacher_log_probs,
log_target=True)`` = KL(teacher || student); lines 280-281 ``beta == 1`` is KL(student || teacher);
lines 285-297 the mixture is ``logsumexp([student + log1p(-beta), teacher + log(beta)])``, i.e.
``m = beta * teacher + (1 - beta) * student``, and the loss ``beta * KL(teacher || m) +
(1 - beta) * KL(student || m)``. Liger 0.x, ``liger_kernel/transformers/jsd.py`` ``LigerJSD`` and
``liger_kernel/ops/jsd.py`` ``_jsd_kernel``: ``JSD(beta)(P || Q) = beta * KL(P || M) + (1 - beta) *
KL(Q || M)``, ``M = beta * P + (1 - beta) * Q`` with ``P`` the teacher (its ``log_p``, second argument)
and ``Q`` the student (``log_q``, first argument); its ``beta == 0`` branch computes ``P * (Y - X)``
= KL(teacher || student), "forward KL", and ``beta == 1`` ``Q * (X - Y)`` = KL(student || teacher),
"reverse KL". So the two libraries *name* the distributions differently (Liger's docstring calls the
teacher P and writes the student first, ``LigerJSD()(student, teacher)``; TRL passes
``(student_logits, teacher_logits)``) but weight them the same way: **our beta = TRL's beta =
Liger's beta**, at every beta, including the KL ends (tests/test_jsd_tvd.py checks both numerically).
What differs is the reduction, below.

**Rows and reductions.** Inputs are (N, V); ``target`` (N,) integers, when given, ignores the rows
where it equals ``ignore_index`` (they are not read, contribute 0 and get gradient 0). With ``R`` the
count of non-ignored rows (``N`` without ``target``):

* ``"batchmean"`` (default): sum over kept rows / ``max(R, 1)`` -- TRL's ``jsd.sum() /
  mask.sum().clamp_min(1)`` (lines 311-316) and Liger's ``1 / n_non_ignore`` (which divides by 0
  when every row is ignored; we give 0, as TRL).
* ``"sum"``: the sum over kept rows (TRL, line 317).
* ``"mean"``: sum / ``(max(R, 1) * V)``: TRL's ``jsd[mask].mean()`` (line 319), except that TRL gives
  NaN (the mean of an empty tensor) when every row is ignored, and we give 0. Liger has no ``mean``.
* ``"none"``: the pointwise loss, (N, V), ignored rows 0. (TRL returns ``jsd[mask]``, the kept rows
  only; ``out[target != ignore_index]`` is that.)

TRL's ``temperature`` and ``num_items_in_batch`` are not arguments: divide the logits before the
log-softmax, and use ``"sum"`` then divide, respectively.

**Gradient** flows to ``student_logp`` only, the log-probabilities taken as free variables (as
autograd through TRL's composition gives them w.r.t. ``student_log_probs``):
:math:`(1-\beta)\,q\,(x - \log m)` per element, :math:`-p` at :math:`\beta=0`,
:math:`q\,(x - y + 1)` at :math:`\beta=1`, times the reduction's factor. The teacher gets none, as in
distillation: a ``teacher_logp`` that requires grad is refused; detach it.

**Cost and numerics.** One pass reads both inputs and writes the gradient (12 bytes per fp32
element); backward then scales it only when the upstream gradient is not 1. Accumulation is float32;
inputs fp32, bf16 or fp16 (mixed allowed; the loss has the promoted dtype, the gradient the student's).
A log-probability of ``-inf`` is probability 0 and its terms count 0 (TRL's ``F.kl_div`` gives NaN
there); NaN in a kept row gives NaN. Deterministic (no atomics; fixed reduction order). No host sync.
"""

from __future__ import annotations


import torch

from . import _validate as v
from ._module import loss_module
from ._row_divergence import REDUCTIONS, RowDivergenceFunction, validate
from .kernels.jsd import launch_jsd

__all__ = ["jsd", "JSDLoss", "REDUCTIONS"]


def _require_beta(beta) -> float:
    v.require_real("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (the teacher's weight in the mixture); got {beta!r}")
    return float(beta)


def _validate_options(beta, ignore_index, reduction) -> None:
    _require_beta(beta)
    v.require_int("ignore_index", ignore_index)
    v.require_choice("reduction", reduction, REDUCTIONS)


def jsd(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    *,
    beta: float = 0.5,
    ignore_index: int = -100,
    target: torch.Tensor | None = None,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Generalized JSD of TRL's ``generalized_jsd_loss`` on (N, V) log-probabilities (see the module docstring).

    Args:
        student_logp: (N, V) student log-probabilities; float32, bfloat16 or float16. Gradients flow to it.
        teacher_logp: (N, V) teacher log-probabilities, same device; no gradient (detach it).
        beta: the teacher's weight in the mixture, in [0, 1]; 0 is KL(teacher || student), 1 is
            KL(student || teacher) (TRL's and Liger's beta alike).
        ignore_index: rows whose ``target`` equals it are ignored (only with ``target``).
        target: optional (N,) int64/int32 labels; only compared with ``ignore_index``.
        reduction: ``"batchmean"`` (sum / kept rows), ``"sum"``, ``"mean"`` (sum / (kept rows * V)) or
            ``"none"`` ((N, V), ignored rows 0).

    Returns:
        The loss in the promoted dtype of the two inputs (float32 accumulation).

    Raises:
        TypeError: non-tensors, integer/bool/complex/float64 log-probabilities, non-integer
            ``target``, a non-real ``beta``, a non-int ``ignore_index``.
        ValueError: shapes that differ or are not 2-D, empty tensors, a ``target`` not of shape (N,),
            different devices or one the kernels cannot run on, ``beta`` outside [0, 1], an unknown
            reduction, a teacher that requires grad.
    """
    needs_grad = validate(
        ("student_logp", "teacher_logp"), student_logp, teacher_logp, target, ignore_index, reduction, "jsd"
    )
    beta = _require_beta(beta)
    return RowDivergenceFunction.apply(
        student_logp, teacher_logp, target, launch_jsd, {"beta": beta}, ignore_index, reduction, needs_grad
    )


JSDLoss = loss_module(
    jsd, "JSDLoss", "``nn.Module`` form of :func:`jsd`: ``JSDLoss(beta=0.5)(student_logp, teacher_logp, target=None)``.",
    check=_validate_options,
)
