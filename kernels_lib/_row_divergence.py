"""The autograd plumbing shared by :mod:`kernels_lib.jsd` and :mod:`kernels_lib.tvd` (row-wise
divergences between two (N, V) tensors, rows optionally ignored by a label), built as
:mod:`kernels_lib.kl_div` is: with a reduction the gradient is written in forward and backward only
scales it (not at all when the upstream gradient is 1, decided on the device); with
``reduction="none"`` backward forms it from the inputs and the upstream gradient in one pass.

The reduction's divisor is a device tensor (the count of non-ignored rows is never read on the
host), so a call makes no host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _validate as v
from .kernels.row_blocks import num_programs
from .kernels.scale_gradient import launch_scale_gradient

REDUCTIONS = ("none", "sum", "mean", "batchmean")


def divisor(reduction: str, shape: torch.Size, label: torch.Tensor | None, ignore_index: int, device) -> torch.Tensor:
    """The float32 device scalar the summed loss is divided by: 1 (``sum``), the non-ignored rows
    (at least 1: ``batchmean``) or those times V (``mean``)."""
    n_rows, n_cols = shape
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    if label is None:
        rows = torch.full((), float(n_rows), dtype=torch.float32, device=device)
    else:
        rows = (label != ignore_index).sum().clamp_min(1).to(torch.float32)
    return rows * n_cols if reduction == "mean" else rows


class RowDivergenceFunction(torch.autograd.Function):
    """``launch(a, b, label=, ignore_index=, partial=, loss=, grad=, scale=, upstream=, **options)``
    is the loss's one launcher (:func:`~.kernels.jsd.launch_jsd`, :func:`~.kernels.tvd.launch_tvd`)."""

    @staticmethod
    def forward(ctx, a, b, label, launch: Callable, options: dict, ignore_index, reduction, needs_grad):
        a, b = a.contiguous(), b.contiguous()
        label = None if label is None else label.contiguous()
        out_dtype = torch.promote_types(a.dtype, b.dtype)
        common = dict(label=label, ignore_index=ignore_index, **options)
        ctx.launch, ctx.common, ctx.reduction = launch, common, reduction
        if reduction == "none":
            loss = torch.empty(a.shape, dtype=out_dtype, device=a.device)
            launch(a, b, loss=loss, **common)
            if needs_grad:
                ctx.save_for_backward(a, b)
            return loss
        div = divisor(reduction, a.shape, label, ignore_index, a.device)
        scale = (1.0 / div).reshape(1)
        partial = torch.empty(num_programs(*a.shape), dtype=torch.float32, device=a.device)
        grad = torch.empty_like(a) if needs_grad else None
        launch(a, b, partial=partial, grad=grad, scale=scale, **common)
        if needs_grad:
            # Saved (not kept on ctx) so autograd releases it after backward and a.grad can be this
            # very buffer. a and b are kept (references, no copies) for a second backward.
            ctx.handed_out = False
            ctx.save_for_backward(grad, scale, a, b)
        return (partial.sum() / div).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        nones = (None,) * 7
        if ctx.reduction == "none":
            a, b = ctx.saved_tensors
            grad = torch.empty_like(a)
            ctx.launch(a, b, grad=grad, upstream=grad_output.contiguous(), **ctx.common)
            return (grad, *nones)
        grad, scale, a, b = ctx.saved_tensors
        if not ctx.handed_out:
            ctx.handed_out = True
            launch_scale_gradient(grad, grad_output)  # in place; nothing moves when it is 1
            return (grad, *nones)
        # A second backward through a retained graph: the buffer is already someone's gradient.
        fresh = torch.empty_like(a)
        ctx.launch(a, b, grad=fresh, scale=scale, **ctx.common)
        launch_scale_gradient(fresh, grad_output)
        return (fresh, *nones)


def validate(names: tuple[str, str], a, b, target, ignore_index, reduction, loss_name: str) -> bool:
    """The checks both losses make; returns whether the gradient is needed."""
    name_a, name_b = names
    v.require_tensor(name_a, a)
    v.require_tensor(name_b, b)
    v.require_float(name_a, a)
    v.require_float(name_b, b)
    v.require_choice("reduction", reduction, REDUCTIONS)
    v.require_int("ignore_index", ignore_index)
    v.require_ndim(name_a, a, 2)
    v.require_same_shape(name_a, a, name_b, b)
    v.require_nonempty(name_a, a)
    tensors = {name_a: a, name_b: b}
    if target is not None:
        v.require_tensor("target", target)
        v.require_index_dtype("target", target)
        v.require_shape("target", target, a.shape[:1], f"{name_a}.shape[:1]")
        tensors["target"] = target
    v.require_same_device(tensors)
    if b.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name_b} requires grad, but kernels_lib.{loss_name} gives no gradient to {name_b}; detach it")
    return a.requires_grad and torch.is_grad_enabled()
