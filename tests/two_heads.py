"""Inputs and runners shared by the tests of the two-head losses (fused_linear_jsd, the distillation losses)."""

from __future__ import annotations

import pytest
import torch

from kernels_lib import default_device

DEVICE = default_device()


def make(n=6, hs=7, ht=9, v=37, dtype=torch.float32, *, seed=0, bias=True, teacher_dtype=None, lead=None):
    """Student and teacher heads of unit-scale logits, and targets with rows 1 and 4 ignored (when n > 4)."""
    gen = torch.Generator().manual_seed(seed)
    lead = lead or (n,)
    teacher_dtype = teacher_dtype or dtype
    t = {
        "student_x": torch.randn(*lead, hs, generator=gen).to(DEVICE, dtype),
        "student_weight": (torch.randn(v, hs, generator=gen) * hs**-0.5).to(DEVICE, dtype),
        "teacher_x": torch.randn(*lead, ht, generator=gen).to(DEVICE, teacher_dtype),
        "teacher_weight": (torch.randn(v, ht, generator=gen) * 2 * ht**-0.5).to(DEVICE, teacher_dtype),
        "student_bias": (torch.randn(v, generator=gen) * 0.5).to(DEVICE, dtype) if bias else None,
        "teacher_bias": (torch.randn(v, generator=gen) * 0.5).to(DEVICE, teacher_dtype) if bias else None,
    }
    target = torch.randint(0, v, lead, generator=gen)
    if target.numel() > 4:
        target.view(-1)[[1, 4]] = -100
    t["target"] = target.to(DEVICE)
    return t


STUDENT = ("student_x", "student_weight", "student_bias")


def run(fn, tensors, **options):
    """``(output, grads of the student's x, weight, bias)`` of ``fn`` on fresh leaves: the output
    detached (a tensor, or a NamedTuple of them such as ``DistillationOutput``), the gradients of its
    loss (the tensor, or its ``.loss``)."""
    leaves = {k: (None if t is None else t.detach().clone().requires_grad_(k in STUDENT)) for k, t in tensors.items()}
    args = [leaves[k] for k in ("student_x", "student_weight", "teacher_x", "teacher_weight", "target")]
    out = fn(*args, student_bias=leaves["student_bias"], teacher_bias=leaves["teacher_bias"], **options)
    wanted = [leaves[k] for k in STUDENT if leaves[k] is not None]
    if isinstance(out, torch.Tensor):
        return out.detach(), torch.autograd.grad(out, wanted)
    return type(out)(*(t.detach() for t in out)), torch.autograd.grad(out.loss, wanted)


def float64(tensors):
    return {k: (t if t is None or not t.is_floating_point() else t.double()) for k, t in tensors.items()}


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Every ``torch.empty``/``empty_like`` of a floating dtype comes NaN-filled: a row of dx, a row's
    loss or a logits buffer the pipeline fails to write shows as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
