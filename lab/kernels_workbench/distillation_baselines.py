"""The baselines notebook 08 checks the distillation losses against, written as their users write them:
TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` on both heads' materialized logits, and ``torch.nn.functional``
compositions of Liger's distillation losses. Each takes the fused loss's signature, so
:func:`kernels_workbench.check.check_against_reference` calls it where it calls the library.

TRL is imported when a TRL baseline is first called (it is a workbench dependency, not the library's).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from kernels_lib.distillation import DistillationOutput


def _gkd_trainer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL warns that its experimental trainers may change
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
    return GKDTrainer


def materialized(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias):
    """Both heads' logits as models give them (a matmul in the input dtype, then float32; float64 stays float64),
    the teacher's without gradient, as (N, V)."""
    def head(x, w, b):
        z = F.linear(x.reshape(-1, x.shape[-1]), w, b)
        return z if z.dtype == torch.float64 else z.float()

    with torch.no_grad():
        teacher = head(teacher_x, teacher_weight, teacher_bias)
    return head(student_x, student_weight, student_bias), teacher


def trl_labels(target, ignore_index):
    """TRL masks the rows whose label is -100."""
    return None if target is None else target.reshape(-1).masked_fill(target.reshape(-1) == ignore_index, -100)


def trl_gkd(student_x, student_weight, teacher_x, teacher_weight, target=None, *, student_bias=None, teacher_bias=None,
            beta=0.5, temperature=1.0, ignore_index=-100, reduction="batchmean", **_):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss on both heads' materialized logits (the fused linear JSD's signature)."""
    student, teacher = materialized(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias)
    return _gkd_trainer().generalized_jsd_loss(student, teacher, labels=trl_labels(target, ignore_index), beta=beta,
                                               temperature=temperature, reduction=reduction)


def ce_plus_trl_gkd(student_x, student_weight, teacher_x, teacher_weight, target, *, student_bias=None, teacher_bias=None,
                    weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, temperature=1.0, ignore_index=-100, **_):
    """distill_jsd_loss as F.cross_entropy (mean over the kept rows) + TRL's generalized_jsd_loss (batchmean over them)."""
    student, teacher = materialized(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias)
    hard = F.cross_entropy(student, target.reshape(-1), ignore_index=ignore_index)
    soft = _gkd_trainer().generalized_jsd_loss(student, teacher, labels=trl_labels(target, ignore_index), beta=beta,
                                               temperature=temperature)
    return DistillationOutput(weight_hard_loss * hard + weight_soft_loss * soft, hard, soft)


def ce_plus_cosine(student_x, student_weight, teacher_x, teacher_weight, target, *, student_bias=None, teacher_bias=None,
                   weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, temperature=1.0, ignore_index=-100, **_):
    """distill_cosine_loss as F.cross_entropy + β·(1 − F.cosine_similarity) of the raw logits, averaged over the kept
    rows: no temperature (the cosine is scale-invariant) and no F.normalize (Liger's reference normalizes first)."""
    student, teacher = materialized(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias)
    kept = target.reshape(-1) != ignore_index
    hard = F.cross_entropy(student, target.reshape(-1), ignore_index=ignore_index)
    soft = (beta * (1 - F.cosine_similarity(student[kept], teacher[kept], dim=-1))).mean()
    return DistillationOutput(weight_hard_loss * hard + weight_soft_loss * soft, hard, soft)
