"""The baselines of notebook 08 (kernels_workbench.distillation_baselines) against kernels_lib.reference in
float64: TRL's generalized_jsd_loss and the F compositions give the reference's losses, ignored rows and a
temperature included."""

from __future__ import annotations

import pytest
import torch

from kernels_lib import reference
from kernels_workbench import distillation_baselines as baselines


def _heads(seed=0, n=7, h_student=5, h_teacher=6, v=13):
    g = torch.Generator().manual_seed(seed)
    x_s, w_s = torch.randn(n, h_student, generator=g, dtype=torch.float64), torch.randn(v, h_student, generator=g, dtype=torch.float64)
    x_t, w_t = torch.randn(n, h_teacher, generator=g, dtype=torch.float64), torch.randn(v, h_teacher, generator=g, dtype=torch.float64)
    target = torch.randint(0, v, (n,), generator=g)
    target[[1, 4]] = -100
    return (x_s, w_s, x_t, w_t, target), {"student_bias": torch.randn(v, generator=g, dtype=torch.float64),
                                          "teacher_bias": torch.randn(v, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.3, 2.5), (1.0, 0.7)])
def test_trl_gkd_is_the_reference_fused_linear_jsd(beta, temperature):
    args, heads = _heads()
    ours = baselines.trl_gkd(*args, **heads, beta=beta, temperature=temperature)
    ref = reference.fused_linear_jsd(*args, **heads, beta=beta, temperature=temperature)
    assert torch.allclose(ours, getattr(ref, "loss", ref), rtol=1e-10, atol=1e-12)


def test_distillation_compositions_are_the_reference_losses():
    args, heads = _heads(seed=1)
    options = {"beta": 0.5, "temperature": 2.0, "weight_hard_loss": 0.3, "weight_soft_loss": 0.9}
    jsd = baselines.ce_plus_trl_gkd(*args, **heads, **options)
    assert torch.allclose(jsd.loss, reference.distill_jsd_loss(*args, **heads, **options).loss, rtol=1e-10)
    cosine = baselines.ce_plus_cosine(*args, **heads, **{**options, "beta": 2.0})
    assert torch.allclose(cosine.loss, reference.distill_cosine_loss(*args, **heads, **{**options, "beta": 2.0}).loss, rtol=1e-10)
    assert torch.allclose(jsd.loss, 0.3 * jsd[1] + 0.9 * jsd[2])  # hard and soft, weighted


def test_materialized_keeps_the_teacher_out_of_autograd_and_masks_ignored_labels():
    (x_s, w_s, x_t, w_t, target), heads = _heads()
    w_s.requires_grad_()
    student, teacher = baselines.materialized(x_s, w_s, heads["student_bias"], x_t, w_t, heads["teacher_bias"])
    assert student.requires_grad and not teacher.requires_grad and student.shape == teacher.shape == (7, 13)
    labels = baselines.trl_labels(target.masked_fill(target == -100, 42), 42)
    assert (labels == -100).sum() == 2 and baselines.trl_labels(None, -100) is None
