r"""KL divergence with the semantics of ``torch.nn.functional.kl_div``, gradient written in forward.

.. math::

    L = \operatorname{reduce}\big(t \,(\log t - x)\big), \qquad 0 \log 0 = 0,
    \qquad \frac{\partial L}{\partial x} = -t \cdot s

for log-probabilities ``input`` :math:`x` and probabilities ``target`` :math:`t` (with
``log_target=True`` the target holds :math:`\log t` and the pointwise term is :math:`e^t (t - x)`).
The reduction factor :math:`s` is 1 for ``sum``, ``1/numel`` for ``mean`` and ``1/input.size(0)``
for ``batchmean`` (the mathematically correct KL when rows are distributions, as torch defines it).

Cost: with a reduction and ``input.requires_grad`` one pass reads both inputs and writes the
gradient (12 bytes per fp32 element); backward then only scales it, and not at all when the
upstream gradient is 1 (the usual ``loss.backward()``; decided on the GPU, with no host sync), so
``input.grad`` is the forward buffer itself. Without grad the pass reads 8 bytes per element and writes one float per 4096 elements.
With ``reduction="none"`` forward writes the pointwise loss and backward forms ``-t * g``.

Deterministic: the same inputs give bitwise the same loss and gradients run to run (no atomics;
fixed reduction orders).
"""

from __future__ import annotations

import torch

from . import _validate as v
from ._module import loss_module
from .kernels.kl_div_backward import launch_kl_div_backward
from .kernels.scale_gradient import launch_scale_gradient
from .kernels.kl_div_forward import launch_kl_div_forward, num_programs

REDUCTIONS = ("none", "sum", "mean", "batchmean")


def _reduction_divisor(reduction: str, input: torch.Tensor) -> int:
    return {"sum": 1, "mean": input.numel(), "batchmean": input.shape[0]}[reduction]


class _KLDivFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, target, reduction, log_target, needs_grad):
        x, t = input.contiguous(), target.contiguous()
        out_dtype = torch.promote_types(x.dtype, t.dtype)
        ctx.reduction, ctx.log_target = reduction, log_target
        if reduction == "none":
            loss = torch.empty(x.shape, dtype=out_dtype, device=x.device)
            launch_kl_div_forward(x, t, log_target=log_target, partial=None, loss=loss, grad=None)
            if needs_grad:
                ctx.input_dtype = x.dtype
                ctx.save_for_backward(t)
            return loss
        divisor = _reduction_divisor(reduction, x)
        partial = torch.empty(num_programs(x.numel()), dtype=torch.float32, device=x.device)
        grad = torch.empty_like(x) if needs_grad else None
        launch_kl_div_forward(
            x, t, log_target=log_target, partial=partial, loss=None, grad=grad, grad_scale=1.0 / divisor
        )
        if needs_grad:
            # Saved (not kept on ctx) so autograd releases it after backward and input.grad can
            # take this very buffer instead of a copy. target is kept for a second backward.
            ctx.divisor, ctx.handed_out = divisor, False
            ctx.save_for_backward(grad, t)
        return (partial.sum() / divisor).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none":
            (target,) = ctx.saved_tensors
            grad = torch.empty(target.shape, dtype=ctx.input_dtype, device=target.device)
            launch_kl_div_backward(target, grad_output.contiguous(), log_target=ctx.log_target, grad=grad)
            return grad, None, None, None, None
        grad, target = ctx.saved_tensors
        if not ctx.handed_out:
            # The forward buffer times grad_output, in place, with no host sync (free when it is 1).
            ctx.handed_out = True
            launch_scale_gradient(grad, grad_output)
            return grad, None, None, None, None
        # A second backward through a retained graph: the buffer is already someone's gradient.
        fresh = torch.empty_like(grad)
        launch_kl_div_backward(
            target, grad_output, log_target=ctx.log_target, grad=fresh, grad_scale=1.0 / ctx.divisor
        )
        return fresh, None, None, None, None


def kl_div(
    input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean", log_target: bool = False
) -> torch.Tensor:
    """KL divergence ``KL(target || exp(input))`` as ``torch.nn.functional.kl_div`` computes it.

    Args:
        input: log-probabilities, any shape with at least one dimension (``batchmean`` divides by
            ``input.size(0)``); float32, bfloat16 or float16. Gradients flow to it.
        target: probabilities (or log-probabilities with ``log_target=True``) of the same shape and
            device; any of the three float dtypes. No gradient flows to it: detach it first.
        reduction: ``"batchmean"`` (sum / size(0), default), ``"sum"``, ``"mean"`` (sum / numel)
            or ``"none"`` (pointwise, input's shape).
        log_target: whether ``target`` holds log-probabilities.

    Returns:
        The loss in the promoted dtype of the two inputs; accumulation is float32 throughout.
        ``0 * log 0`` counts as 0, NaN in either input gives NaN, as in torch.

    Raises:
        TypeError: a non-tensor, an integer/bool/complex/float64 tensor, a non-bool ``log_target``.
        ValueError: shapes that differ (torch would broadcast; we do not), empty or 0-dim tensors,
            tensors on different devices or on a device the kernels cannot run on, an unknown
            reduction, a target that requires grad.
    """
    v.require_tensor("input", input)
    v.require_tensor("target", target)
    v.require_float("input", input)
    v.require_float("target", target)
    _validate_options(reduction, log_target)
    v.require_same_shape("input", input, "target", target)
    v.require_nonempty("input", input)
    v.require_same_device({"input": input, "target": target})
    if target.requires_grad and torch.is_grad_enabled():
        raise ValueError("target requires grad, but kernels_lib.kl_div gives no gradient to target; detach it")
    needs_grad = input.requires_grad and torch.is_grad_enabled()
    return _KLDivFunction.apply(input, target, reduction, log_target, needs_grad)


def _validate_options(reduction, log_target) -> None:
    v.require_choice("reduction", reduction, REDUCTIONS)
    if not isinstance(log_target, bool):
        raise TypeError(f"log_target must be a bool; got {type(log_target).__name__}")


KLDivLoss = loss_module(
    kl_div, "KLDivLoss", "``nn.Module`` form of :func:`kl_div` (default ``reduction=\"batchmean\"``, unlike torch's "
    "``\"mean\"``).", check=_validate_options,
)
