r"""Cross-entropy on materialized ``(N, V)`` logits, as ``torch.nn.functional.cross_entropy``, gradient written in forward.

.. math::

    \ell_i = (1-\varepsilon)\,w_{y_i}\,(\mathrm{lse}_i - z_{i,y_i})
             + \tfrac{\varepsilon}{V} \textstyle\sum_j w_j\,(\mathrm{lse}_i - z_{ij}),
    \qquad \mathrm{lse}_i = \log \textstyle\sum_j e^{z_{ij}},

for each row whose target :math:`y_i` is not ``ignore_index`` (0 otherwise), with torch's class
weights :math:`w` (all 1 without) and label smoothing :math:`\varepsilon`; reduced by ``mean``
(divided by :math:`\sum_{\text{valid}} w_{y_i}`, the valid rows' count without weights), ``sum``
or ``none``. The gradient with respect to the logits is
:math:`g_i\,\big(a_i\,p_{ij} - (1-\varepsilon) w_{y_i} \delta_{j y_i} - \tfrac{\varepsilon}{V} w_j\big)`,
:math:`p = \mathrm{softmax}(z_i)`, :math:`a_i = (1-\varepsilon) w_{y_i} + \tfrac{\varepsilon}{V}\sum_j w_j`,
:math:`g_i` the reduction's factor (or the upstream gradient of row :math:`i`).

Bytes and FLOPs. The kernel (:mod:`kernels_lib.kernels.cross_entropy_rows`) runs one program per
row with an online log-sum-exp over ``V`` in blocks, about 10 FLOPs and two ``exp`` per logit:
memory-bound. For ``e`` bytes per logit:

* ``mean``/``sum`` with a gradient: the gradient is known in forward, so one call reads the row
  twice and writes the gradient (``3·N·V·e`` bytes); backward hands that buffer out as is when the
  upstream gradient is 1 (decided on the device: no host sync), else scales it in place
  (``2·N·V·e``).
* ``none``: forward reads once (``N·V·e``) and keeps the log-sum-exp (4 bytes a row); backward, where
  the per-row upstream gradient arrives, reads the logits again and writes the gradient
  (``2·N·V·e``).
* without a gradient: one read.

Memory. ``inplace=False`` (the default): the gradient is a new ``N × V`` buffer in the logits'
dtype, held from forward to backward (``mean``/``sum``) or made in backward (``none``): peak
``2·N·V·e`` with the logits. ``inplace=True``: the gradient overwrites the logits (as Liger's
kernel does), so the peak is the logits alone; afterwards the logits tensor holds its gradient,
which flows on to the op that made the logits (a leaf's ``.grad`` is autograd's own copy: it does
not take a leaf's storage as its gradient). Its autograd version is bumped, so any other
use that saved the logits for its own backward fails loudly rather than reading the gradient; a
second backward through the same graph is refused. The materializing baseline (``F.cross_entropy``
on float32 logits, :func:`kernels_lib.reference.cross_entropy`) keeps the log-softmax and its
gradient besides.

Numerics: accumulation in float32 whatever the logits' dtype; the loss comes back in the logits'
dtype (as torch's), the gradient too. NaN in a kept row gives NaN in its loss and gradient; an
ignored row is never read (loss 0, gradient 0 whatever it holds: torch's gradient there is NaN
when the row is). With ``mean`` and every row ignored the loss is 0 and the gradient 0 (torch gives
NaN), so a batch of pure padding does not poison training. float16 gradients below 6e-8 flush to
zero, as torch's own do.

Vocabulary-parallel (``process_group``, or DTensor logits sharded on the class dimension): rank
:math:`r` holds the columns ``[o_r, o_r + V_r)`` of the logits (shards in group rank order, any
sizes: ``V`` need not divide by the ranks), the targets are global class indices and ``weight`` the
whole ``(V,)`` vector, the same on every rank. Pass 1 on the shard gives, per row, :math:`m_r`,
:math:`\log s_r`, the target's logit where rank :math:`r` owns it (0 elsewhere) and
:math:`\sum_{j \in r} w_j z_{ij}`; one all-reduce MAX of :math:`N` floats and one SUM of
:math:`N \times (2 + [\varepsilon > 0])` floats (:meth:`~kernels_lib._vocab_parallel.VocabShard.merge_logsumexp`)
make the global

.. math::

    M_i = \max_r m_{r,i}, \quad S_i = \textstyle\sum_r s_{r,i}\, e^{m_{r,i} - M_i}, \quad
    \mathrm{lse}_i = M_i + \log S_i, \quad z_{i,y_i} = \textstyle\sum_r [\,y_i \in r\,]\, z_{i,y_i},

and the loss :math:`\ell_i = (1-\varepsilon) w_{y_i} ((M_i - z_{i,y_i}) + \log S_i) + \tfrac{\varepsilon}{V}
((W M_i - \sum_j w_j z_{ij}) + W \log S_i)`, :math:`W = \sum_j w_j`, the same on every rank. Pass 2
with the global lse writes the shard's own gradient (the :math:`\delta_{j y_i}` only on the owner):
no gradient crosses the wire, and the backward has no collective. Before any collective, one
``all_gather`` of a few int64 per rank checks the call on every rank alike
(:func:`~kernels_lib._vocab_parallel.establish`: a rank that rejects its arguments makes every rank
raise, targets outside the global ``[0, V)`` raise everywhere), so no rank is left waiting. Bytes:
the passes read the shard's logits twice and write its gradient, ``3·N·V_r·e`` (the fused
single-process call's ``3·N·V·e``, split); wire ``4·N·(3 + [ε > 0])`` bytes and ``8·13`` per rank.

Deterministic: no atomics; each row is one program, the reductions sum in a fixed order.
"""

from __future__ import annotations

import torch

from . import _validate as v
from . import _vocab_parallel as vp
from ._module import loss_module
from ._target_totals import target_totals
from .kernels.cross_entropy_rows import launch_cross_entropy_rows
from .kernels.scale_gradient import launch_scale_gradient

__all__ = ["cross_entropy", "CrossEntropyLoss", "REDUCTIONS"]

REDUCTIONS = ("mean", "sum", "none")


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, weight_sum, scale, ignore_index, reduction, label_smoothing,
                inplace, needs_grad, shard, range_check):
        common = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, class_weight=weight,
                      weight_sum=weight_sum, **({} if shard is None else shard.kernel_args()))
        ctx.common, ctx.reduction, ctx.inplace, ctx.range_check = common, reduction, inplace, range_check
        n_rows = logits.shape[0]
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        fused = shard is None and reduction != "none" and needs_grad  # pass 1 and pass 2 in one launch
        grad = (logits if inplace else torch.empty_like(logits)) if reduction != "none" and needs_grad else None
        if fused:
            launch_cross_entropy_rows(logits, target, lse=lse, loss=loss, grad=grad, scale=scale, **common)
        elif shard is None:
            launch_cross_entropy_rows(logits, target, lse=lse, loss=loss, **common)
        else:
            _merged_pass_one(logits, target, lse, loss, shard, common)
        if grad is None:
            if needs_grad:
                ctx.save_for_backward(logits, target, lse)
            return (loss if reduction == "none" else _reduced(loss, reduction, scale)).to(logits.dtype)
        if not fused:
            launch_cross_entropy_rows(logits, target, lse=lse, grad=grad, scale=scale, lse_given=True, **common)
        if inplace:
            torch.autograd.graph.increment_version(logits)
        # Saved (not kept on ctx) so autograd releases it after backward and logits.grad can be this
        # very buffer; the logits (a reference, no copy) and lse serve a second backward.
        ctx.handed_out = False
        ctx.save_for_backward(grad, logits, target, lse, scale)
        return _reduced(loss, reduction, scale).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        nones = (None,) * 11
        if ctx.range_check is not None:  # the forward's targets, read here (see cross_entropy)
            check, ctx.range_check = ctx.range_check, None
            check.raise_if_bad()
        if ctx.reduction == "none":
            # inplace: a second backward finds the saved logits' version bumped and autograd refuses it.
            logits, target, lse = ctx.saved_tensors
            grad = logits if ctx.inplace else torch.empty_like(logits)
            launch_cross_entropy_rows(logits, target, lse=lse, grad=grad, scale=grad_output, lse_given=True, **ctx.common)
            if ctx.inplace:
                torch.autograd.graph.increment_version(logits)
            return (grad, *nones)
        grad, logits, target, lse, scale = ctx.saved_tensors
        if not ctx.handed_out:
            ctx.handed_out = True
            launch_scale_gradient(grad, grad_output)  # in place; nothing moves when it is 1
            return (grad, *nones)
        if ctx.inplace:
            raise RuntimeError(
                "kernels_lib.cross_entropy(inplace=True) wrote the gradient over the logits: a second backward "
                "through the same graph cannot recompute it; use inplace=False"
            )
        # A second backward through a retained graph: the buffer is already someone's gradient.
        fresh = torch.empty_like(logits)
        launch_cross_entropy_rows(logits, target, lse=lse, grad=fresh, scale=scale, lse_given=True, **ctx.common)
        launch_scale_gradient(fresh, grad_output)
        return (fresh, *nones)


def _reduced(loss: torch.Tensor, reduction: str, scale: torch.Tensor) -> torch.Tensor:
    """The per-row losses summed, times ``mean``'s factor ``scale`` (``sum``'s is 1: no op)."""
    total = loss.sum()
    return total * scale.reshape(()) if reduction == "mean" else total


def _merged_pass_one(logits, target, lse, loss, shard: vp.VocabShard, common: dict) -> None:
    r"""Pass 1 on this rank's shard, merged over the ranks: the global ``lse`` and per-row ``loss``
    written in place (module docstring, "Vocabulary-parallel"). Wire: ``N`` floats (MAX), then
    ``N × (2 + [ε > 0])`` floats (SUM: :math:`S`, the owner's :math:`z_y`, :math:`\sum_j w_j z_j`)."""
    partial = torch.empty((logits.shape[0], 4), dtype=torch.float32, device=logits.device)
    launch_cross_entropy_rows(logits, target, lse=lse, partial=partial, **common)
    m, log_s, z_y, sum_wz = partial.unbind(1)
    smoothing, weight, weight_sum = common["label_smoothing"], common["class_weight"], common["weight_sum"]
    big_m, log_big_s, sums = shard.merge_logsumexp(m, log_s, lambda shift: [z_y] + ([sum_wz] if smoothing else []))
    valid = target != common["ignore_index"]
    r = 1.0 if weight is None else weight[torch.where(valid, target, 0).long()]
    total = shard.n_classes if weight is None else weight_sum
    ce = (1.0 - smoothing) * r * ((big_m - sums[0]) + log_big_s)
    if smoothing:
        ce = ce + (smoothing / shard.n_classes) * ((total * big_m - sums[1]) + total * log_big_s)
    lse.copy_(big_m + log_big_s)
    loss.copy_(torch.where(valid, ce, 0.0))


def _validate(logits, target, weight, ignore_index, reduction, label_smoothing, inplace, host_checks,
              vocab_parallel: bool = False) -> None:
    v.require_tensor("logits", logits)
    v.require_tensor("target", target)
    v.require_float("logits", logits)
    v.require_ndim("logits", logits, 2)
    v.require_nonempty("logits", logits)
    v.require_index_dtype("target", target)
    v.require_shape("target", target, logits.shape[:1], "logits.shape[:1]")
    tensors = {"logits": logits, "target": target}
    if weight is not None:
        v.require_tensor("weight", weight)
        v.require_float("weight", weight)
        if vocab_parallel:  # the whole (V,) vector: its length is checked against the shards' sum over the ranks
            v.require_ndim("weight", weight, 1)
        else:
            v.require_shape("weight", weight, logits.shape[1:], "(V,) = logits.shape[1:]")
        if weight.requires_grad and torch.is_grad_enabled():
            raise ValueError("weight requires grad, but cross_entropy gives no gradient to the class weights (nor does torch); detach it")
        tensors["weight"] = weight
    v.require_same_device(tensors)
    v.require_int("ignore_index", ignore_index)
    v.require_choice("reduction", reduction, REDUCTIONS)
    v.require_probability("label_smoothing", label_smoothing)
    v.require_bool("inplace", inplace)
    v.require_bool("host_checks", host_checks)


@torch.compiler.disable
def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    inplace: bool = False,
    host_checks: bool = True,
    process_group=None,
) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy(logits, target, ...)`` on ``(N, V)`` logits (see the module docstring).

    Args:
        logits: ``(N, V)`` unnormalized scores; float32, bfloat16 or float16. Gradients flow to it.
        target: ``(N,)`` int64/int32 class indices, each in ``[0, V)`` or equal to ``ignore_index``.
        weight: optional ``(V,)`` class weights (torch's ``weight``), any float dtype, no gradient.
        ignore_index: target value of rows that contribute nothing (loss and gradient 0).
        reduction: ``"mean"`` (over the valid rows' total weight), ``"sum"`` or ``"none"`` (``(N,)``,
            0 at ignored rows).
        label_smoothing: ε in [0, 1], as torch defines it.
        inplace: write the gradient over the logits (no ``N × V`` gradient buffer; the logits are
            then lost, see the module's "Memory").
        host_checks: True: a target out of range raises a ValueError naming it, read on the host behind
            an event that waits for the check alone, not for the kernel: at the end of the call, or,
            when the call forms a gradient, by its backward (the forward then returns without waiting
            for the GPU, and its loss is NaN at such rows). False: no host sync; the range is asserted
            on the device (``torch._assert_async``: a device-side assert on CUDA, as torch's own gives).
        process_group: a ``torch.distributed`` group over which the classes are split: ``logits`` is
            this rank's ``(N, V_r)`` column shard (ranks in group order, any sizes), ``target`` the
            global class indices and ``weight`` the whole ``(V,)`` vector, the same on every rank;
            every rank gets the whole loss, and the gradient of its own shard (module docstring,
            "Vocabulary-parallel"). Or None, with ``logits`` a DTensor placed ``(Shard(1),)`` on a 1-D
            device mesh: its mesh's group, its local shard (the gradient returns to the DTensor).
            The targets' range is then always checked on the host (one ``all_gather``), whatever
            ``host_checks`` says.

    Returns:
        The loss in the logits' dtype (float32 accumulation): a scalar, or ``(N,)`` with ``none``.
        With ``mean`` and every row ignored: 0, with zero gradients (torch: NaN).

    Raises:
        TypeError: non-tensors, integer/bool/complex/float64 logits or weight, non-integer targets,
            a non-int ``ignore_index``, a non-real ``label_smoothing``, non-bool flags.
        ValueError: logits not 2-D or empty, a target not of shape ``(N,)``, a weight not of shape
            ``(V,)`` or requiring grad, tensors on different devices or on one the kernels cannot
            run on, an unknown reduction, ``label_smoothing`` outside [0, 1], targets outside
            ``[0, V)`` other than ``ignore_index`` (with ``host_checks``; from backward when the call
            forms a gradient). With a process group, on
            every rank: any of these on any rank (the others raise the same type, naming it), ranks
            that disagree on the rows, the targets or the options, a ``weight`` whose length is not
            the shards' sum, targets outside the global ``[0, V)``, DTensor logits not placed
            ``(Shard(1),)`` on a 1-D mesh or on another group than ``process_group``, a DTensor
            ``target`` or ``weight``.
    """
    group = vp.find_group(process_group, {"logits": logits}, shard_dim=1)
    shard = None
    if group is None:
        _validate(logits, target, weight, ignore_index, reduction, label_smoothing, inplace, host_checks)
    else:
        dtensor_vocab = logits.shape[1] if vp.is_dtensor(logits) else None
        logits = vp.local(logits)
        grad_on = torch.is_grad_enabled()

        def check():
            _validate(logits, target, weight, ignore_index, reduction, label_smoothing, inplace, host_checks,
                      vocab_parallel=True)
            if vp.is_dtensor(target) or vp.is_dtensor(weight):
                raise TypeError("give target and weight as plain tensors, the same on every rank (only logits is split)")

        def options():
            return (ignore_index, reduction, label_smoothing, inplace, host_checks, logits.dtype, weight is None,
                    bool(logits.requires_grad and grad_on))

        shard = vp.establish(
            group, None, check, rows=lambda: logits.shape[0], targets=lambda: {"target": target},
            ignore_index=ignore_index, options=options, class_weight=lambda: weight, dtensor_vocab=dtensor_vocab,
            shard_size=lambda: logits.shape[1],
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    target = target.contiguous()
    weight = None if weight is None else weight.to(torch.float32).contiguous()
    n_classes = logits.shape[1] if shard is None else shard.n_classes
    # With a shard, establish has checked the range on the host already. mean's denominator is 1 where
    # no row counts (the loss is then 0, not 0/0); on the device.
    totals = target_totals(target, n_classes, ignore_index, weight, host_checks and shard is None)
    needs_grad = logits.requires_grad and torch.is_grad_enabled()
    scale = totals.mean_factor if reduction == "mean" else totals.sum_factor  # each row's gradient factor
    # The range check: read at the end of the call, or, when a gradient is formed, at the start of
    # backward (the count is long on the host by then: no wait for the GPU in forward).
    deferred = totals.check if needs_grad else None
    loss = _CrossEntropyFunction.apply(
        logits, target, weight, totals.weight_sum, scale, ignore_index, reduction, float(label_smoothing),
        inplace, needs_grad, shard, deferred,
    )
    if totals.check is not None and deferred is None:
        totals.check.raise_if_bad()
    return loss


def _validate_options(ignore_index, reduction, label_smoothing, inplace) -> None:
    v.require_choice("reduction", reduction, REDUCTIONS)
    v.require_int("ignore_index", ignore_index)
    v.require_probability("label_smoothing", label_smoothing)
    v.require_bool("inplace", inplace)


CrossEntropyLoss = loss_module(
    cross_entropy, "CrossEntropyLoss",
    "``nn.Module`` form of :func:`cross_entropy`, as ``torch.nn.CrossEntropyLoss`` (``weight`` a buffer; "
    "``process_group`` for logits split by class over its ranks).",
    check=_validate_options, buffers=("weight",), held=("process_group",),
)
