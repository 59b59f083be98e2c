r"""Fused linear + cross-entropy: the LM-head loss without the ``N × V`` logits.

.. math::

    z = x W^\top + b, \qquad c = s \tanh(z / s)\ \text{(softcap, optional)}, \qquad
    \mathrm{lse}_i = \log \textstyle\sum_j e^{c_{ij}},

    \ell_i = (1-\varepsilon)(\mathrm{lse}_i - c_{i,y_i})
             + \varepsilon\,(\mathrm{lse}_i - \tfrac1V \textstyle\sum_j c_{ij})
             + \lambda\,\mathrm{lse}_i^2
    \quad\text{for valid rows } (y_i \ne \text{ignore\_index}),\ 0 \text{ otherwise},

reduced by ``mean`` (over the valid rows), ``sum`` or ``none``. With :math:`\varepsilon = \lambda = 0`
and no softcap this is ``F.cross_entropy(x @ W.T + b, y)``; with them it is torch's label smoothing,
the z-loss of PaLM, and Gemma 2's logit softcap. The gradient with respect to the logits is

.. math::

    \frac{\partial \ell_i}{\partial z_{ij}} = \Big(p_{ij}(1 + 2\lambda\,\mathrm{lse}_i)
        - (1-\varepsilon)\delta_{j y_i} - \tfrac{\varepsilon}{V}\Big)\big(1 - (c_{ij}/s)^2\big),
    \qquad dx = dz\,W, \quad dW = dz^\top x, \quad db = \textstyle\sum_i dz_i .

Design
------
Rows are processed in chunks of ``chunk_size``. Per chunk: the logits ``x_c W^T + b`` are formed by
one matmul into a reused ``chunk_size × V`` buffer; one Triton kernel
(:mod:`kernels_lib.kernels.cross_entropy_chunk`) computes each row's lse and loss and, when a
gradient is needed, overwrites the buffer in place with ``dz`` already multiplied by the reduction
factor; then ``dx_c = dz W`` (written into ``dx``), ``dW += dz^T x_c`` and ``db += Σ dz``.

This module holds the function, its options and the choice of route (the predicates and dials below,
read by :class:`_FusedLinearCrossEntropyFunction`); each route and stage is a file of
:mod:`kernels_lib._flce`, whose docstring says what it costs and what measured it:

* no gradient, a plain ``mean``/``sum`` (no smoothing, z-loss, softcap, statistics or class weights),
  compiled: the loss from the logits GEMM's epilogue, no logits buffer at all
  (:func:`_loss_in_epilogue`, :mod:`kernels_lib.chunks.epilogue`);
* class-major: the plain loss with a gradient, one chunk of ``N ≤ H`` rows, ``dW`` in the inputs' dtype, on Hopper: forward writes the logits transposed into the weight
  gradient's own buffer, backward forms the gradients there (:func:`_class_major_route_takes`,
  :mod:`kernels_lib._flce.class_major`);
* chunked, every other call (:mod:`kernels_lib._flce.chunked`): ``mean``/``sum`` form the gradients
  in forward, backward multiplies them by ``grad_output``; a plain loss on Hopper with 16-bit operands
  takes each chunk's lse from the epilogue GEMM (:func:`_epilogue_gemm_takes`) and stores the shifted
  exponentials (:data:`STORE_EXPONENTIALS`); ``none`` keeps each row's lse and recomputes the logits
  in backward;
* vocabulary-parallel (``process_group``, or a DTensor ``weight`` sharded on dim 0): the chunked route,
  each chunk's partial sums merged over the ranks (:mod:`kernels_lib._flce.vocab_parallel`,
  :mod:`kernels_lib._vocab_parallel`); without a process group nothing of it runs.

Before any route, the rows whose target is ``ignore_index`` are dropped (``skip_ignored``,
:mod:`kernels_lib._flce.rows`): the routes run on the valid rows alone, so the matmuls' cost follows
the valid tokens.

The shared stages: the arguments' checks (:mod:`kernels_lib._flce.validate`), the rows per chunk
(:mod:`kernels_lib.chunks.chunk_size`: ``H`` rows, at least 2048, halved while the logits buffer would
exceed a quarter of the free memory), the operands and the logits buffer
(:mod:`kernels_lib.chunks.operands`), the GEMM helpers (:mod:`kernels_lib.chunks.matmuls`), the sums of
``dx``, ``dW``, ``db`` over the chunks with ``accurate`` and float16's scaled ``dz``
(:mod:`kernels_lib.chunks.gradient_sums`), and the Triton launchers every route calls
(:mod:`kernels_lib.chunks.triton_backend`).

On a machine without CUDA the matmuls run in float32 (the kernels then run in Triton's
interpreter); on CUDA they run in the input dtype with float32 accumulation inside cuBLAS.

For training (the Hugging Face drop-in, :mod:`kernels_lib.hf`, stands on these): torch's per-class
``class_weight``; ``num_items_in_batch``, the denominator of ``mean`` that gradient accumulation
needs (a count over micro-batches or ranks; a tensor is read on the device, no host sync);
``token_weight`` (per-row weights, ``mean``'s denominator unchanged) and ``token_scaling`` (each row
times its detached target probability, the DFT loss), both applied as a per-row factor between the
kernel's two passes; ``logit_scale`` and ``temperature`` (``c = softcap_s(a·z)/T`` = ``softcap_{s/T}((a/T)·z)``: the factor
rides on the logits matmul's alpha, the cap is divided by ``T``, and the gradient takes ``a/T``
once more, so the kernel is unchanged); ``return_token_stats`` for the per-token entropy and top-1
hit, read in the same pass as the log-sum-exp; and ``torch.autocast``, whose dtype the matmuls take.

Deterministic: the same inputs give bitwise the same loss and gradients run to run (no atomics;
fixed reduction orders), checked at the published sizes on a GPU, three runs each.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _validate as v
from . import _vocab_parallel as vp
from ._autocast import compute_dtype_for
from ._module import loss_module
from .chunks import triton_backend as backend
from .chunks.chunk_size import default_chunk_size, lean_chunk_size
from ._flce.chunked import _backward_recompute, chunked_forward
from ._flce.class_major import _class_major_gradients, _class_major_logits
from .chunks.epilogue import epilogue_loss
from .chunks.gradient_sums import GradientSums, scaled_to_dtypes, unit_scale
from .chunks.matmuls import matmul_dtype
from .chunks.operands import Operands
from ._flce.options import REDUCTIONS, _Options
from ._flce.rows import scatter_rows, valid_rows
from ._flce.reduction import _factor_tensor, _normalizer, _reduce
from ._flce.validate import _validate_num_items, _validate_options, _validate_tensors
from ._runtime import INTERPRETED
from ._target_totals import target_totals

#: What the callers (the package, tests, notebooks, scripts) import from here: the API, the route choice's dials,
#: and the chunk sizes and dtype helpers defined in :mod:`kernels_lib.chunks` (and ``REDUCTIONS``, in :mod:`kernels_lib._flce`).
__all__ = [
    "CrossEntropyOutput",
    "EPILOGUE_GEMM_WHEN_INTERPRETED",
    "FusedLinearCrossEntropyLoss",
    "REDUCTIONS",
    "STORE_EXPONENTIALS",
    "default_chunk_size",
    "fused_linear_cross_entropy",
    "lean_chunk_size",
    "matmul_dtype",
    "unit_scale",
]

#: In Triton's interpreter the epilogue GEMM is a Python loop over tiles, ten times the rest of a test's
#: time: the gradient chunks take it there only when this is True (the tests of that route set it).
EPILOGUE_GEMM_WHEN_INTERPRETED = False

#: The epilogue GEMM of a gradient chunk stores shifted exponentials instead of the logits
#: (:mod:`kernels_lib.kernels.shifted_exponentials`): each row's factor then goes on the matmuls'
#: ``N × H`` side, and no pass reads the ``N × V`` buffer between the GEMM and the matmuls. Not for
#: float16, whose range cannot hold them (its route keeps the logits and the kernel's pass 2); False
#: gives every dtype that route (the A/B of ``studies/flce_frontier.py --parts exponentials``).
STORE_EXPONENTIALS = True


class CrossEntropyOutput(NamedTuple):
    r"""What :func:`fused_linear_cross_entropy` returns with ``return_token_stats=True``.

    ``loss`` and ``z_loss`` as without it (reduced, or per token with ``reduction="none"``). With
    ``return_token_stats``, per token, the target's shape, 0 (False) at ignored tokens, of each token's
    (scaled, capped) distribution :math:`p = \mathrm{softmax}(c)` (None without it):

    * ``entropy``: :math:`H_i = \mathrm{lse}_i - \sum_j p_{ij} c_{ij}`, float32; it carries a gradient
      with ``reduction="none"`` (:math:`\partial H/\partial c_j = -p_j(\log p_j + H)`, added in the
      backward pass that recomputes the logits), none with ``mean``/``sum`` (their gradients are
      formed in forward, before any use of the entropy is known);
    * ``is_top1``: bool, whether the target's logit is the row's largest (ties count as hits; token
      accuracy is ``is_top1.sum() / n_valid``);
    * ``mean_logit``: :math:`\frac1V \sum_j c_{ij}`, float32, no gradient;
    * ``log_sum_sq_prob``: :math:`\log \sum_j p_{ij}^2`, float32, no gradient.

    With ``return_predicted``, ``predicted``: int64, the target's shape, each token's
    :math:`\arg\max_j c_{ij}` (the smallest class of equal largest logits; ``is_top1`` counts a tie
    with the target as a hit, so the two may differ there), ``ignore_index`` at ignored tokens. With
    ``return_lse``, ``lse``: float32, the target's shape, :math:`\mathrm{lse}_i = \log\sum_j e^{c_{ij}}`,
    0 at ignored tokens, with its gradient (:math:`\partial\,\mathrm{lse}/\partial c_j = p_j`) into
    ``x``, ``weight`` and ``bias``. Each is None unless asked for.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor
    entropy: torch.Tensor | None
    is_top1: torch.Tensor | None
    mean_logit: torch.Tensor | None
    log_sum_sq_prob: torch.Tensor | None
    predicted: torch.Tensor | None = None
    lse: torch.Tensor | None = None


def _plain_loss(opts: _Options, class_weight, shard) -> bool:
    """Whether a row's loss is ``lse - c_y`` alone, so that the log-sum-exp in the epilogue of the logits
    GEMM (:mod:`kernels_lib.kernels.logits_logsumexp`) gives it: plain cross-entropy (no smoothing,
    z-loss, softcap, statistics, class weights, token weights or token scaling), reduced, on one process. ``reduction="none"`` keeps
    the chunked kernel, whose per-token ``(m - z_y) + log s`` keeps the relative accuracy of a loss near
    0 that ``lse - z_y`` would lose."""
    options = (opts.label_smoothing or opts.z_loss_scale or opts.softcap is not None or opts.with_stats
               or opts.split_passes or opts.with_lse)
    return not options and opts.reduction != "none" and class_weight is None and shard is None


def _loss_in_epilogue(opts: _Options, needs, class_weight, shard) -> bool:
    """Whether the loss alone (no input takes a gradient) comes from the epilogue GEMM, with no chunks
    (the logits never exist): a plain loss (:func:`_plain_loss`), compiled. In Triton's interpreter the
    GEMM is a Python loop over its tiles: at N = 96, H = 64, V = 32000 the loss under ``no_grad`` took
    79-94 s that way against 1.2-1.6 s for forward and backward on the chunks (torch's matmul and the
    kernel's two passes), so there the no-grad loss takes the chunks too, unless
    :data:`EPILOGUE_GEMM_WHEN_INTERPRETED` asks for the GEMM (its tests)."""
    return _no_grad_epilogue_runs() and not any(needs) and _plain_loss(opts, class_weight, shard)


def _no_grad_epilogue_runs() -> bool:
    """Whether a loss without a gradient may come from the epilogue GEMM here: compiled, or in the
    interpreter when :data:`EPILOGUE_GEMM_WHEN_INTERPRETED` asks (:func:`_loss_in_epilogue`; the
    sequence losses' reference pass, :mod:`kernels_lib._sequence_logprobs`)."""
    return not INTERPRETED or EPILOGUE_GEMM_WHEN_INTERPRETED


def _epilogue_gemm_takes(x_c: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a gradient chunk's logits come from the epilogue GEMM: where its Hopper (TMA) kernel runs
    for 16-bit operands (its logits within 2% of cuBLAS's, and the kernel's first pass saved); elsewhere
    cuBLAS's matmul and the kernel's two passes are the faster route. In Triton's interpreter: when
    :data:`EPILOGUE_GEMM_WHEN_INTERPRETED` says so."""
    if INTERPRETED:
        return EPILOGUE_GEMM_WHEN_INTERPRETED
    return x_c.dtype in (torch.bfloat16, torch.float16) and backend.tma_unsupported_reason(x_c, w) is None


def _class_major_route_takes(ops: "Operands", weight: torch.Tensor, needs, accurate: bool,
                             chunk_size: int | None) -> bool:
    """Whether a plain loss with a gradient takes the class-major route (:func:`_class_major_gradients`):
    one chunk of at most ``H`` rows (within ``ops.chunk_size``; the rows left once the ignored ones are
    dropped); ``dW`` wanted, ``x``, ``W`` and the matmuls
    in one dtype (so ``dW`` and the logits can share a buffer; not ``accurate``, not float16, whose sums are
    float32), on the epilogue GEMM's machine. Beyond ``H`` rows the logits would outgrow ``dW``'s buffer,
    and ``weight.grad``, a view of it, would keep them alive until the optimizer clears it."""
    n_rows, hidden = ops.x.shape
    fits = n_rows <= min(ops.chunk_size, hidden)
    return (needs[1] and fits and not accurate
            and ops.x.dtype == weight.dtype == ops.w.dtype != torch.float16
            and _epilogue_gemm_takes(ops.operand(slice(0, 1)), ops.w))


class _FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, class_weight, shape, counts, opts: _Options, needs, compute_dtype,
                shard: vp.VocabShard | None = None, row_factor: torch.Tensor | None = None):
        normalizer, weight_sum = counts
        if _loss_in_epilogue(opts, needs, class_weight, shard):
            with torch.autocast(x.device.type, enabled=False):
                loss = epilogue_loss(x, weight, bias, target, opts, compute_dtype)
            z_loss = torch.zeros_like(loss)
            ctx.mark_non_differentiable(z_loss)
            return _reduce(loss, opts.reduction, normalizer, shape), _reduce(z_loss, opts.reduction, normalizer, shape)
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen: compute_dtype
            ops = Operands(x, weight, bias, opts.chunk_size, compute_dtype, opts.pre_scale)
            n_rows = x.shape[0]
            lse, loss, z_loss = (torch.empty(n_rows, dtype=torch.float32, device=x.device) for _ in range(3))
            stats = torch.empty((n_rows, 3), dtype=torch.float32, device=x.device) if opts.with_stats else None
            top1 = torch.empty(n_rows, dtype=torch.int8, device=x.device) if opts.with_stats else None
            predicted = torch.empty(n_rows, dtype=torch.int64, device=x.device) if opts.with_predicted else None
            fuse_grad = any(needs) and opts.reduction != "none"
            scale = _factor_tensor(opts.pre_scale, normalizer, opts.reduction, x.device)
            plain = fuse_grad and _plain_loss(opts, class_weight, shard)
            class_major = plain and _class_major_route_takes(ops, weight, needs, opts.accurate, opts.chunk_size)
            if class_major:  # the gradients wait for backward, in the buffer that will be dW
                z_loss.zero_()
                storage, x_c, factors = _class_major_logits(ops, target, lse, loss, opts,
                                                             exponentials=STORE_EXPONENTIALS)
                result = (storage, x_c, ops.w, target, lse, scale, factors)
            else:
                grads = GradientSums(x, weight, bias, needs, opts.accurate, compute_dtype) if fuse_grad else None
                result = chunked_forward(ops, grads, target, lse, loss, z_loss, stats, top1, scale, opts, class_weight,
                                         weight_sum, shard, plain, store_exponentials=STORE_EXPONENTIALS,
                                         epilogue_takes=_epilogue_gemm_takes, row_factor=row_factor,
                                         predicted=predicted)
        ctx.opts, ctx.needs, ctx.compute_dtype, ctx.weight_sum = opts, needs, compute_dtype, weight_sum
        ctx.shard, ctx.handed_out, ctx.class_major = shard, False, fuse_grad and class_major
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        # What a recomputing backward reads: reduction "none"'s, and with return_lse the lse's gradient's.
        ctx.n_fused = len(result) if fuse_grad else 0
        if any(needs) and (not fuse_grad or opts.with_lse):
            # Plain cross-entropy: the backward's dz_y from 1 - p_y = -expm1(-loss) (the kernel's note)
            # (not with row factors: the loss is then weighted)
            plain_rows = not (opts.label_smoothing or opts.z_loss_scale or opts.row_weighted) and class_weight is None
            one_minus_p = torch.expm1(-loss).neg_() if plain_rows and not fuse_grad else None
            recompute = (x, weight, bias, target, lse, class_weight, stats, one_minus_p, row_factor)
        else:
            recompute = ()
        if fuse_grad or recompute:
            ctx.save_for_backward(*(result if fuse_grad else ()), *recompute)
        ctx.set_materialize_grads(False)  # a gradient that does not arrive is None, not zeros
        z_loss = _reduce(z_loss, opts.reduction, normalizer, shape)
        outputs = [_reduce(loss, opts.reduction, normalizer, shape), z_loss]
        differentiable = [outputs[0]]
        if opts.with_stats:
            entropy, mean_logit, log_sum_sq = (stats[:, k].reshape(shape).clone() for k in range(3))
            outputs += [entropy, top1.view(shape).bool(), mean_logit, log_sum_sq]
            # The entropy is differentiable only where backward recomputes the logits (reduction "none").
            if not fuse_grad and any(needs):
                differentiable.append(entropy)
        valid = target != opts.ignore_index
        if opts.with_predicted:
            outputs.append(torch.where(valid, predicted, opts.ignore_index).view(shape))
        if opts.with_lse:
            outputs.append(torch.where(valid, lse, 0.0).view(shape))
            if any(needs):
                differentiable.append(outputs[-1])
        ctx.mark_non_differentiable(*[t for t in outputs if not any(t is d for d in differentiable)])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_output, _grad_z_loss, *grads):
        grad_entropy = grads[0] if ctx.opts.with_stats else None
        grad_lse = grads[-1] if ctx.opts.with_lse else None

        def recompute():  # read only where used: a second backward must meet the check below first
            return ctx.saved_tensors[ctx.n_fused:]

        if ctx.opts.reduction == "none":
            dx, dw, db = _backward_recompute(ctx, recompute(), grad_output, grad_entropy, grad_lse)
        elif grad_output is None and grad_lse is None:
            return (None,) * 12
        elif grad_output is None:  # the lse's gradient alone
            dx, dw, db = _backward_recompute(ctx, recompute(), None, None, grad_lse)
        else:
            if ctx.handed_out:
                raise RuntimeError(
                    "backward ran twice through kernels_lib.fused_linear_cross_entropy (retain_graph=True): with "
                    "reduction 'mean' or 'sum' its gradients are formed once, over the logits' buffer, and were "
                    "already handed out; "
                    "call the loss again, or use reduction='none' (whose backward recomputes them)"
                )
            ctx.handed_out = True
            if ctx.class_major:
                storage, x_c, w, target, lse, scale, factors = ctx.saved_tensors
                factor = scale * grad_output.reshape(1).to(torch.float32)
                dx, dw, db = _class_major_gradients(storage, x_c, w, target, lse, factor, ctx.opts.ignore_index,
                                                    ctx.needs, ctx.dtypes, factors)
            else:
                # The host never waits here (a wait would leave the GPU idle until the next step's first launch).
                dx, dw, db = scaled_to_dtypes(ctx.saved_tensors[:ctx.n_fused], grad_output, ctx.dtypes)
            if grad_lse is not None:  # the gradients were formed in forward; the lse's needs the logits again
                extra = _backward_recompute(ctx, recompute(), None, None, grad_lse)
                dx, dw, db = (a if b is None else b if a is None else a + b for a, b in zip((dx, dw, db), extra))
        return dx, dw, db, None, None, None, None, None, None, None, None, None


@torch.compiler.disable
def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    chunk_size: int | None = None,
    accurate: bool = False,
    class_weight: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
    return_token_stats: bool = False,
    host_checks: bool = True,
    process_group=None,
    skip_ignored: bool = True,
    token_weight: torch.Tensor | None = None,
    token_scaling: bool = False,
    return_predicted: bool = False,
    return_lse: bool = False,
):
    """Cross-entropy of the logits ``x @ weight.T + bias`` against ``target``, never materializing them.

    Args:
        x: hidden states, shape ``(..., H)`` (leading dims flatten to ``N`` rows); float32,
            bfloat16 or float16. Gradients flow to it.
        weight: the LM head, ``(V, H)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        target: class indices of shape ``x.shape[:-1]``, int64 or int32, aligned with the rows (no
            shift inside), each in ``[0, V)`` or equal to ``ignore_index``.
        bias: optional ``(V,)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        ignore_index: target value of rows that contribute nothing (loss and gradient 0).
        reduction: ``"mean"`` (over the valid rows), ``"sum"`` or ``"none"`` (per row, shape of
            ``target``, 0 at ignored rows).
        label_smoothing: ε in [0, 1], as ``torch.nn.functional.cross_entropy`` defines it.
        z_loss_scale: λ ≥ 0; adds ``λ·lse²`` per valid row to the loss.
        softcap: ``s > 0`` replaces the logits by ``s·tanh(z/s)`` before everything, or None.
        return_z_loss: also return the z-loss term alone (same reduction), for logging: it is
            already included in the loss, and no gradient flows through this second output.
        chunk_size: rows per chunk, or None for :func:`default_chunk_size` (``H`` rows, at least 2048,
            fewer when the device's free memory is short).
        accurate: accumulate ``dW``/``db`` over chunks in float32 rather than in the parameter dtype
            (default False: saves a ``V × H`` float32 buffer; about 20% more dW error at 16 chunks).
        class_weight: torch's per-class ``weight`` ``(V,)``: a row's loss is multiplied by
            ``w_y`` and ``mean`` divides by ``Σ_valid w_y``; with label smoothing the smoothing term is
            ``(ε/V) Σ_j w_j (lse − c_j)``, as ``F.cross_entropy(weight=...)`` computes it. The z-loss
            term of a row is weighted by ``w_y`` too.
        num_items_in_batch: with ``mean``, divide the summed loss by this count instead of by the
            valid rows of this call: Hugging Face's gradient-accumulation normalizer (the
            ``Trainer`` passes the valid-token count of the whole accumulated batch), and the way to
            normalize by a global token count over micro-batches or data-parallel ranks. An int, or a
            one-element tensor (read on the device: no host sync).
        logit_scale: the logits are multiplied by it before the softcap (models with a logit scale).
        temperature: ``T > 0``; the (scaled, capped) logits are divided by it:
            ``c = softcap_s(logit_scale · z) / T``, the order of TRL's fused head.
        return_token_stats: return a :class:`CrossEntropyOutput` with the per-token entropy (with its
            gradient under ``reduction="none"``), top-1 hit, mean logit and ``log Σ p²``, computed in
            the same pass over the logits (what training loggers and TRL's trainers read off the
            logits this function never returns).
        host_checks: True (default): the targets' range is checked on the host, so a bad target
            raises a ValueError naming it (on CUDA read at the end of the call behind an event that
            waits for the check alone, not for the matmuls). False: no host sync for the check (none at
            all with ``skip_ignored=False``), for a training step whose
            CPU must run ahead of the GPU (small steps are launch-bound): the valid-token count stays
            on the device, the range is asserted there (``torch._assert_async``: a device-side assert
            on CUDA, as torch's ``cross_entropy`` gives). :func:`kernels_lib.hf.patch` uses False. (With a process group the
            call's one check over the ranks reads the targets' range on the host in any case.)
        process_group: a ``torch.distributed`` group over which the vocabulary is split
            (:mod:`kernels_lib._vocab_parallel`): ``weight`` (``V_r × H``) and ``bias`` (``V_r``) are
            this rank's rows ``[o_r, o_r + V_r)`` of the head, in group-rank order, of any sizes;
            ``x``, ``target`` (global class indices), ``class_weight`` (global, ``(V,)``) and every
            option are the same on every rank, and so is the returned loss. Or None with a DTensor
            ``weight`` (and ``bias``) sharded ``(Shard(0),)`` over a 1-D device mesh: the mesh's group.
            Every option works; the result equals the single-process one up to float rounding. The
            gradient of ``x`` is complete on every rank (summed over the ranks inside; do not reduce
            it again); those of ``weight`` and ``bias`` are the local shard's. Every rank of the group
            must make the call (and, with ``reduction="none"``, the backward). Wire: once per call an
            all_gather of 13 int64 per rank (the check) and, when ``x`` needs a gradient, one
            all-reduce of ``dx`` (``N × H``, in ``dx``'s dtype: float32 for float16 inputs); per chunk
            and row, float32: 1 (max) + 2 (sum-exp, the target's logit from its owner), +1 with
            label smoothing (the sum of the logits), +3 with ``return_token_stats`` (the entropy's
            and ``Σ p²``'s sums, the sum of the logits). Nothing of size ``V`` crosses.
        skip_ignored: True (default): rows whose target is ``ignore_index`` are dropped before the
            head's matmuls (:mod:`kernels_lib._flce.rows`): the valid rows of ``x`` are gathered (one
            read and write of ``n_valid × H``), the loss runs on them, and ``dx`` is 0 at the ignored
            rows; the loss and every gradient are the same as without it (up to summation order), for
            every reduction and option. Counting the valid rows is one host sync per call (the CPU
            waits for the work queued before the loss); nothing is gathered when no row is ignored.
            False: every row through the matmuls, no sync (with ``host_checks=False``, none at all):
            for a launch-bound step whose CPU must run ahead of the GPU. Off by itself while a CUDA
            graph is being captured.
        token_weight: per-token weights ``ω_i`` of ``target``'s shape (float), or None: each valid row's
            loss (z-loss included) and gradient are multiplied by ``ω_i``; no gradient flows into
            ``token_weight``. ``mean`` keeps its denominator: ``Σ_i ω_i ℓ_i / n_valid`` (or
            ``/ num_items_in_batch``, or ``/ Σ_valid w_y`` with class weights), not ``/ Σ ω_i``: the
            weights scale tokens against each other inside one normalization, so that a micro-batch's
            loss sums correctly under gradient accumulation with Hugging Face's token count (a
            ``Σ ω``-normalized mean is ``reduction="sum"`` divided by ``token_weight.sum()``, or that
            sum passed as ``num_items_in_batch``). With a process group, the same on every rank.
        token_scaling: multiply each valid row's loss and gradient by the target's probability
            ``p_y = exp(c_y - lse)`` of the (scaled, capped) logits, detached (the
            dynamic fine-tuning loss, DFT: ``-p_y·log p_y`` with a gradient ``-p_y ∇log p_y``); with
            ``token_weight``, by both. ``p_y`` is read from the logits the chunk already holds
            (no logits recomputed): the chunk's kernel runs its two passes as two launches.
        return_predicted: return a :class:`CrossEntropyOutput` whose ``predicted`` holds each token's
            predicted class (the argmax of its logits; ``ignore_index`` at ignored tokens), read from
            each logits chunk between the kernel's two passes (one more read of the chunk; with a
            process group two all-reduces of ``N`` values per chunk).
        return_lse: return a :class:`CrossEntropyOutput` whose ``lse`` holds each token's log-sum-exp
            (0 at ignored tokens), differentiable: its gradient ``g_lse · p`` reaches ``x``, ``weight``
            and ``bias``. With ``reduction="none"`` it joins the loss's in the backward that recomputes
            the logits anyway; with ``mean``/``sum``, whose gradients are formed in forward, a backward
            that receives a gradient for the lse recomputes the logits for it (three matmuls more, and
            forward keeps ``x``, ``weight``, ``bias`` for it): for a loss built on the lse,
            ``reduction="none"`` reduced by the caller costs one matmul less.

    Returns:
        The loss in float32 whatever the input dtype (as Transformers' ``ForCausalLMLoss``, which
        upcasts the logits); or ``(loss, z_loss)`` with ``return_z_loss``; or a
        :class:`CrossEntropyOutput` with ``return_token_stats``, ``return_predicted`` or ``return_lse``
        (its fields not asked for are None). With ``reduction="none"`` the loss
        is per token, ``−log p(target)`` at ``ε = λ = 0`` (its negative is the token log-prob, with
        gradient). With ``mean`` and every target ignored the loss is 0 and all gradients are 0
        (torch gives NaN), so a batch of pure padding does not poison training. NaN in ``x``,
        ``weight`` or ``bias`` gives a NaN loss; a NaN in a row of ``x`` whose target is ignored reaches
        nothing (the row is dropped; with ``skip_ignored=False`` it reaches ``dW`` through ``0 · NaN``).

    Mixed precision: under ``torch.autocast`` the head's matmuls run in the autocast dtype (the
    operands are rounded to it, as ``nn.Linear`` would be, so ``x``, ``weight`` and ``bias`` may differ
    in dtype there: half hidden states and a float32 head), the loss is float32, and the gradients
    come back in each input's own dtype, accumulated in float32 across chunks for float32 parameters
    (:mod:`kernels_lib._autocast`; every fused loss does the same).

    Memory: with ``mean``/``sum`` the gradients are formed in forward and held until backward
    (``dx``, ``dW``, ``db``: the size of the inputs). With ``none`` forward keeps one float per row
    (the log-sum-exp) and backward recomputes the logits chunk by chunk (one more matmul).

    Under ``torch.compile`` this function is not traced (``torch.compiler.disable``): one graph break
    per call, the kernels run as they do eagerly.

    Raises:
        TypeError: a non-tensor, a dtype other than float32/bfloat16/float16 for ``x``/``weight``/
            ``bias`` or differing between them, a non-integer ``target``, an option of the wrong type.
        ValueError: shapes that do not fit (naming the argument), empty ``x``, tensors on different
            devices or one the kernels cannot run on, targets outside ``[0, V)`` other than
            ``ignore_index``, an option out of range, ``num_items_in_batch`` with a reduction other
            than ``mean``. With a process group, on every rank: any of these on any rank (the
            others raise the same type, naming it), ranks that disagree on ``x``'s shape, the
            targets or the options, targets outside the global ``[0, V)``, a DTensor not sharded
            ``(Shard(0),)`` over a 1-D mesh or on another group than ``process_group``.
    """
    group = vp.find_group(process_group, {"weight": weight, "bias": bias})
    grad_on = torch.is_grad_enabled()

    def check():
        _validate_tensors(x, weight, target, bias, class_weight, vocab_parallel=group is not None)
        _validate_options(
            ignore_index, reduction, label_smoothing, z_loss_scale, softcap, return_z_loss, chunk_size, accurate,
            logit_scale, temperature, return_token_stats,
        )
        _validate_num_items(num_items_in_batch, reduction)
        v.require_bool("host_checks", host_checks)
        v.require_bool("skip_ignored", skip_ignored)
        v.require_bool("token_scaling", token_scaling)
        v.require_bool("return_predicted", return_predicted)
        v.require_bool("return_lse", return_lse)
        if token_weight is not None:
            v.require_tensor("token_weight", token_weight)
            v.require_float("token_weight", token_weight)
            v.require_shape("token_weight", token_weight, target.shape, "target.shape")
            v.require_same_device({"x": x, "token_weight": token_weight})

    shard = None
    if group is None:
        check()
    else:
        dtensor_vocab = weight.shape[0] if vp.is_dtensor(weight) else None
        weight, bias = vp.local(weight), vp.local(bias)

        def options():
            return (
                ignore_index, reduction, label_smoothing, z_loss_scale, softcap, return_z_loss, chunk_size, accurate,
                logit_scale, temperature, return_token_stats, host_checks, skip_ignored, token_scaling,
                return_predicted, return_lse,
                token_weight is None, bias is None, x.dtype,
                num_items_in_batch if not isinstance(num_items_in_batch, torch.Tensor) else "tensor",
                tuple(bool(t is not None and t.requires_grad and grad_on) for t in (x, weight, bias)),
            )

        shard = vp.establish(
            group, weight, check, rows=lambda: x.numel() // x.shape[-1], targets=lambda: {"target": target},
            ignore_index=ignore_index, options=options, class_weight=lambda: class_weight,
            dtensor_vocab=dtensor_vocab,
        )
    n_classes = weight.shape[0] if shard is None else shard.n_classes
    float_weight = None if class_weight is None else class_weight.detach().float().contiguous()
    # With a shard, establish has checked the range on the host already (as in kernels_lib.cross_entropy).
    totals = target_totals(target, n_classes, ignore_index, float_weight, host_checks and shard is None)
    weight_sum, range_check = totals.weight_sum, totals.check
    normalizer = _normalizer(num_items_in_batch, totals.normalizer)
    needs = tuple(bool(t is not None and t.requires_grad and grad_on) for t in (x, weight, bias))
    opts = _Options(
        ignore_index, reduction, float(label_smoothing), float(z_loss_scale),
        None if softcap is None else float(softcap), chunk_size, accurate,
        float(logit_scale), float(temperature), return_token_stats, host_checks,
        token_weight is not None, token_scaling, return_predicted, return_lse,
    )
    rows_x, rows_target = x.reshape(-1, x.shape[-1]), target.reshape(-1).contiguous()
    # The rows whose target is ignore_index are dropped before the matmuls (kernels_lib._flce.rows).
    kept = valid_rows(rows_target, ignore_index, skip_ignored)
    row_factor = None  # each row's factor: the token weights, times p_y with token scaling (in forward)
    if opts.row_weighted:
        row_factor = (torch.ones(rows_target.shape, dtype=torch.float32, device=x.device) if token_weight is None
                      else token_weight.detach().reshape(-1).to(torch.float32, copy=True))
    if kept is not None:
        rows_x, rows_target = rows_x.index_select(0, kept), rows_target.index_select(0, kept)
        row_factor = None if row_factor is None else row_factor.index_select(0, kept)
    outputs = _FusedLinearCrossEntropyFunction.apply(
        rows_x, weight, bias, rows_target, float_weight, target.shape if kept is None else kept.shape,
        (normalizer, weight_sum), opts, needs, compute_dtype_for(x), shard, row_factor,
    )
    outputs = list(outputs)
    named = {"loss": outputs.pop(0), "z_loss": outputs.pop(0)}
    if return_token_stats:
        named.update(zip(("entropy", "is_top1", "mean_logit", "log_sum_sq_prob"), outputs[:4]))
        outputs = outputs[4:]
    if return_predicted:
        named["predicted"] = outputs.pop(0)
    if return_lse:
        named["lse"] = outputs.pop(0)
    if kept is not None:  # per-row outputs (1-D, one per kept row) back to the target's shape, 0 at ignored rows
        named = {name: t if not t.dim() else scatter_rows(t, kept, target.numel(), target.shape,
                                                          ignore_index if name == "predicted" else 0)
                 for name, t in named.items()}
    if range_check is not None:
        range_check.raise_if_bad()
    if return_token_stats or return_predicted or return_lse:
        return CrossEntropyOutput(**{**dict.fromkeys(CrossEntropyOutput._fields), **named})
    return (named["loss"], named["z_loss"]) if return_z_loss else named["loss"]


FusedLinearCrossEntropyLoss = loss_module(
    fused_linear_cross_entropy, "FusedLinearCrossEntropyLoss",
    "``nn.Module`` form of :func:`fused_linear_cross_entropy`: the module holds the options (and ``class_weight`` "
    "as a buffer, as ``nn.CrossEntropyLoss`` holds its ``weight``); the LM head's ``weight`` (and ``bias``) stay "
    "with the model and are passed at each call.",
    check=_validate_options, buffers=("class_weight",),
)
