"""The chunked route of the fused linear cross-entropy: the logits ``chunk_size`` rows at a time.

Per chunk the logits are formed into the reused ``chunk_size × V`` buffer (cuBLAS's matmul, or on
Hopper for a plain loss the epilogue GEMM of :mod:`kernels_lib.chunks.epilogue`), the chunk kernel
(:mod:`kernels_lib.kernels.cross_entropy_chunk`, or on one vocabulary shard
:mod:`kernels_lib._flce.vocab_parallel`) gives each row's lse and loss and overwrites the buffer with
``dz``, and :class:`~kernels_lib.chunks.gradient_sums.GradientSums` adds the chunk's three products.

* ``mean``/``sum`` (:func:`chunked_forward`): the gradient is known in forward, so all of the above
  happens there (three matmuls, the floor); backward only multiplies them in place by ``grad_output``,
  read on the device (no host sync; no pass at all when it is 1), and hands the buffers out: a second
  backward through a retained graph is refused.
* ``none`` (:func:`_backward_recompute`): the upstream gradient is per row and arrives only in
  backward, so forward keeps just ``lse`` (4 bytes a row) and backward recomputes each logits chunk
  (a fourth matmul), running the kernel without its first pass.
* Without a gradient (``torch.no_grad()`` or no input requiring grad) only the loss is computed.

Memory: the logits buffer (:mod:`kernels_lib.chunks.chunk_size`) and, with ``mean``/``sum``, the
gradients formed in forward and held until backward (``dx``, ``dW``, ``db``: the size of the inputs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..chunks import triton_backend as backend
from ..chunks.epilogue import logits_with_loss
from ..chunks.gradient_sums import GradientSums, to_dtypes
from ..chunks.matmuls import logits_chunk
from ..chunks.operands import Operands
from .vocab_parallel import _vocab_parallel_chunk


def _max_weight(class_weight: torch.Tensor | None):
    """The largest ``|w_j|`` (1 without class weights): the most a row's weight can scale its gradient."""
    return 1.0 if class_weight is None else class_weight.abs().max()


def _target_probability(logits, target, lse, ignore_index: int, softcap: float | None) -> torch.Tensor:
    """Each row's ``p_y = exp(c_y - lse)`` from the chunk's logits (before pass 2 overwrites
    them): the target's column gathered (``rows`` elements), capped as the kernel caps it; 0 at ignored rows.
    A target outside ``[0, V)`` reads column 0 here (on CUDA an out-of-range gather is a device-side assert that
    ends the context): the call's deferred range check names it when the call ends."""
    valid = target != ignore_index
    column = torch.where(valid & (target >= 0) & (target < logits.shape[1]), target, 0)
    z_y = logits.gather(1, column.long().unsqueeze(1)).squeeze(1).float()
    c_y = z_y if softcap is None else softcap * torch.tanh(z_y / softcap)
    return torch.where(valid, torch.exp(c_y - lse), 0.0)


def chunked_forward(ops: Operands, grads: GradientSums | None, target, lse, loss, z_loss, stats, top1,
                    scale: torch.Tensor, opts, class_weight, weight_sum, shard, plain: bool, *,
                    store_exponentials: bool, epilogue_takes, row_factor: torch.Tensor | None = None,
                    predicted: torch.Tensor | None = None):
    """Forward of the chunked route, chunk by chunk: each row's ``lse`` and ``loss`` (and ``z_loss``,
    ``stats``, ``top1`` where given) written, and with ``grads`` (``mean``/``sum`` with a gradient) every
    chunk's ``dz``, scaled by ``scale``, added to it. ``plain``: the loss is ``lse - c_y`` alone, so a
    chunk whose operands ``epilogue_takes(x_c, w)`` takes its lse from the epilogue GEMM, which with
    ``store_exponentials`` (not float16) stores the shifted exponentials. With a ``shard`` each chunk
    merges its sums over the ranks, and ``dx`` is summed over them at the end. Returns
    ``grads.result()`` (None without ``grads``).

    ``row_factor`` (float32 ``(rows,)``, with ``opts.row_weighted``): each row's factor, the token
    weights (ones without); with ``opts.token_scaling`` it is multiplied in place by the target's
    probability :math:`p_y` (detached) once pass 1 has the row's lse. Each row's loss and z-loss are
    multiplied by it, and its ``dz`` takes it through the per-row factor of pass 2 (launched apart from
    pass 1, on the logits still in the buffer: no logits recomputed). ``predicted`` (int64 ``(rows,)``,
    with ``opts.with_predicted``): each row's argmax over the classes, written between the same two
    passes (:func:`_argmax`)."""
    fuse_grad = grads is not None
    # float16: dz at the scale that brings the largest factor to [1, 2), undone in float32
    # (see :mod:`kernels_lib.chunks.gradient_sums`); class weights multiply a row's factor by up to max |w|,
    # row factors by up to their max |.| (p_y <= 1 adds nothing).
    if fuse_grad:
        row_peak = (lambda: 1.0) if row_factor is None else (lambda: row_factor.abs().max())
        unscale = grads.dz_unscale(lambda: scale.abs().max() * _max_weight(class_weight) * row_peak())
        scale = scale / unscale
    else:
        unscale = 1.0
    kernel_args = opts.kernel_args(class_weight, weight_sum)
    chunk = backend.launch_cross_entropy_chunk if shard is None else _vocab_parallel_chunk(shard)
    if plain:
        z_loss.zero_()
    epilogue = None  # decided at the first chunk: every chunk's operand is aligned alike
    exponentials = store_exponentials and not grads.wide if fuse_grad else False
    for rows, x_c, buffer in ops.chunks():
        if epilogue is None:
            epilogue = plain and epilogue_takes(x_c, ops.w)
        if epilogue and exponentials:
            # The GEMM stores the shifted exponentials: no pass over them, the factors on x and dx.
            e, factors = logits_with_loss(buffer, x_c, ops, target[rows], lse[rows], loss[rows], opts,
                                          exponentials=True)
            grads.add_exponentials(e, factors, scale, x_c, ops.w, rows)
            continue
        if epilogue:
            # The lse from the GEMM's epilogue: the kernel's pass 2 alone reads the logits.
            logits, _ = logits_with_loss(buffer, x_c, ops, target[rows], lse[rows], loss[rows], opts)
            chunk(logits, target[rows], lse=lse[rows], loss=None, z_loss=None, grad_scale=scale, **kernel_args)
        elif opts.split_passes:
            logits = logits_chunk(buffer, x_c, ops.w, ops.b, ops.pre)
            _split_chunk(chunk, logits, target[rows], lse[rows], loss[rows], z_loss[rows],
                         None if stats is None else stats[rows], None if top1 is None else top1[rows],
                         None if row_factor is None else row_factor[rows], scale if fuse_grad else None, opts,
                         kernel_args, shard, None if predicted is None else predicted[rows])
        else:
            logits = logits_chunk(buffer, x_c, ops.w, ops.b, ops.pre)
            chunk(
                logits,
                target[rows],
                lse=lse[rows],
                loss=loss[rows],
                z_loss=z_loss[rows],
                grad_scale=scale if fuse_grad else None,
                stats=None if stats is None else stats[rows],
                top1=None if top1 is None else top1[rows],
                **kernel_args,
            )
        if fuse_grad:
            grads.add_chunk(logits, x_c, ops.w, rows, unscale)
    if fuse_grad and shard is not None and grads.dx is not None:
        shard.sum_(grads.dx)
    return grads.result() if fuse_grad else None


def _argmax(logits, shard) -> torch.Tensor:
    """Each row's class of the largest logit (the first of equal ones), global: on a vocabulary shard this
    rank's largest value and class are merged over the ranks (all-reduce MAX of the value, then MIN of the
    classes that reach it: the smallest global index, as one process gives). The softcap and a positive
    scale keep the order, so the logits as the buffer holds them give it."""
    if shard is None:
        return logits.argmax(1)
    value, index = logits.float().max(1)
    top = value.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.group)
    index = torch.where(value == top, index + shard.offset, shard.n_classes)
    dist.all_reduce(index, op=dist.ReduceOp.MIN, group=shard.group)
    return index


def _split_chunk(chunk, logits, target, lse, loss, z_loss, stats, top1, factor, scale, opts, kernel_args, shard,
                 predicted) -> None:
    """One chunk with its two passes apart: pass 1 (lse, loss, stats); the predicted classes; the row
    factor (times :math:`p_y` with token scaling, read from the logits pass 2 has not yet overwritten; on a
    vocabulary shard the merged target logit) and the loss and z-loss scaled by it; then pass 2 with
    ``scale`` (times the factor) per row."""
    target_logit = torch.empty_like(lse) if opts.token_scaling and shard is not None else None
    extra = {} if target_logit is None else {"target_logit": target_logit}
    chunk(logits, target, lse=lse, loss=loss, z_loss=z_loss, grad_scale=None, stats=stats, top1=top1,
          **kernel_args, **extra)
    if predicted is not None:
        predicted.copy_(_argmax(logits, shard))
    if opts.token_scaling:
        if target_logit is None:
            p_y = _target_probability(logits, target, lse, opts.ignore_index, kernel_args["softcap"])
        else:
            p_y = torch.where(target != opts.ignore_index, torch.exp(target_logit - lse), 0.0)
        factor.mul_(p_y)
    if factor is not None:
        loss.mul_(factor)
        z_loss.mul_(factor)
    if scale is not None:
        backend.launch_cross_entropy_chunk(
            logits, target, lse=lse, loss=None, z_loss=None,
            grad_scale=scale if factor is None else (scale * factor).contiguous(),
            **kernel_args, **({} if shard is None else shard.kernel_args()),
        )


def _backward_recompute(ctx, saved, grad_output: torch.Tensor | None, grad_entropy: torch.Tensor | None = None,
                        grad_lse: torch.Tensor | None = None):
    """Backward of ``reduction="none"``: recompute each logits chunk, form ``dz`` from the saved lse
    (and the saved entropy, when the entropy has an upstream gradient; for plain cross-entropy the
    saved ``1 - p_y``, so that ``dz_y`` keeps its relative accuracy where ``p_y -> 1``). With
    ``grad_lse`` (the returned lse's upstream gradient) ``g_lse · p`` is added; with ``mean``/``sum``
    this is the whole of this pass (``grad_output`` None: the loss's gradients were formed in forward).
    ``saved``: ``(x, weight, bias, target, lse, class_weight, stats, one_minus_p, row_factor)``."""
    x, weight, bias, target, lse, class_weight, stats, one_minus_p, row_factor = saved
    opts = ctx.opts

    def row_factors(grad):  # per row, times the gradient's factor with respect to the raw logits
        if grad is None:
            return torch.zeros_like(lse)
        return (grad.reshape(-1).to(torch.float32) * opts.pre_scale).contiguous()

    scale, entropy_scale = row_factors(grad_output), None if grad_entropy is None else row_factors(grad_entropy)
    lse_scale = None if grad_lse is None else row_factors(grad_lse)
    if row_factor is not None:  # the loss's row factors (not the entropy's: it is not weighted)
        scale = (scale * row_factor).contiguous()
    with torch.autocast(x.device.type, enabled=False):
        ops = Operands(x, weight, bias, opts.chunk_size, ctx.compute_dtype, opts.pre_scale)
        grads = GradientSums(x, weight, bias, ctx.needs, opts.accurate, ctx.compute_dtype)

        def peak():  # float16: the largest |grad_output · pre · w| (and |grad_entropy · pre|, |grad_lse · pre|) to [1, 2)
            peak = scale.abs().max() * _max_weight(class_weight)
            for other in (entropy_scale, lse_scale):
                peak = peak if other is None else torch.maximum(peak, other.abs().max())
            return peak

        unscale = grads.dz_unscale(peak)
        if unscale != 1.0:
            scale = scale / unscale
            entropy_scale = None if entropy_scale is None else entropy_scale / unscale
            lse_scale = None if lse_scale is None else lse_scale / unscale
        kernel_args = opts.kernel_args(class_weight, ctx.weight_sum)
        if ctx.shard is not None:  # the saved lse and entropy are the merged ones: pass 2 needs nothing more
            kernel_args.update(ctx.shard.kernel_args())
        for rows, x_c, logits in ops:
            backend.launch_cross_entropy_chunk(
                logits, target[rows], lse=lse[rows], loss=None, z_loss=None, grad_scale=scale[rows],
                stats=None if entropy_scale is None else stats[rows],
                entropy_grad=None if entropy_scale is None else entropy_scale[rows],
                one_minus_p=None if one_minus_p is None else one_minus_p[rows],
                lse_grad=None if lse_scale is None else lse_scale[rows],
                **kernel_args,
            )
            grads.add_chunk(logits, x_c, ops.w, rows, unscale)
        if ctx.shard is not None and grads.dx is not None:
            ctx.shard.sum_(grads.dx)
    return to_dtypes(grads.result(), ctx.dtypes)
