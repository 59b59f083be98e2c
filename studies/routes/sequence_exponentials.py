r"""The stored-exponentials route of the sequence losses (DPO, ORPO, CPO, SimPO, KTO, GRPO): a study's copy of
:func:`kernels_lib._sequence_logprobs.sequence_logprobs` that takes it, put in place for an A/B arm's calls.

A chunk's logits come from the fused cross-entropy's epilogue GEMM, which gives each row's lse and target
logit as it goes and stores the shifted exponentials ``ẽ`` (:func:`kernels_lib.chunks.epilogue.logits_with_loss`),
so the stats pass and the gradient pass over the ``chunk × V`` buffer both go. A token's log-prob is
``−(lse − c_y)``, and with ``dz = w (onehot(y) − p) = −w · diag(u) ẽ`` the weights join the row factors ``u``
on ``x`` and ``dx`` (:meth:`~kernels_lib.chunks.gradient_sums.GradientSums.add_exponentials`), as the fused
cross-entropy's default route does at its matmul floor. Taken where that route would be: one target, no
entropy, no vocabulary shard, a gradient wanted, 16-bit operands other than float16 that the epilogue GEMM
takes (Hopper; in Triton's interpreter when
:data:`kernels_lib.fused_linear_cross_entropy.EPILOGUE_GEMM_WHEN_INTERPRETED` asks). Without a gradient (a
reference model's pass, or ``no_grad``) the log-probs come from that GEMM over all rows, no buffer at all,
as the fused CE's loss without a gradient, where that runs. Everything else is the library's two passes.

Not the library's default: it must win against the two passes on the H100 and on the H200
(``python -m studies.bench.sequence_exponentials_ab``). On the H100 (``gpu_runs/sequence_exponentials_ab.csv``)
it took 0.95–1.00× their time at B ≥ 4 for DPO, CPO, ORPO, SimPO and both GRPO levels, and for KTO 0.84–0.87× at
B ≥ 8 but 1.57× and 1.23× at B = 2 and 4; it has not run on an H200. :func:`arm` gives the settings that put it in place
(:func:`studies.bench.arms.constants_set`): every module of the package that calls ``sequence_logprobs``
gets this one for the calls inside.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch

from kernels_lib._autocast import compute_dtype_for
from kernels_lib.chunks.epilogue import epilogue_loss, logits_with_loss
from kernels_lib.chunks.matmuls import logits_chunk
from kernels_lib._sequence_logprobs import (Coefficients, TokenCoefficients, chunk_buffers, chunk_weights,
                                            keep_chunk_logprobs, kept_rows, row_plan, scatter_kept, sequence_sums,
                                            two_pass_gradient)
from kernels_lib._vocab_parallel import VocabShard
from kernels_lib.kernels.token_logprobs import launch_token_logprobs

#: The fused CE's module, for its route predicates (the package's attribute of that name is the function).
FLCE = importlib.import_module("kernels_lib.fused_linear_cross_entropy")
#: The package's modules that call ``sequence_logprobs`` (by the name they imported), where :func:`arm` puts this one.
CALLERS = ("kernels_lib._sequence_logprobs", "kernels_lib._paired_logprobs", "kernels_lib.fused_linear_kto",
           "kernels_lib.fused_linear_grpo")


#: Which calls take the route where it applies: the chunks that form a gradient (``"grad"``) and the pass
#: without one (``"no_grad"``, a reference model's). :func:`arm` sets them; an arm of one part tells which half
#: of the route a difference comes from.
PARTS = ("grad", "no_grad")
TAKE_GRAD = True
TAKE_NO_GRAD = True


class _IgnoreIndex(NamedTuple):
    """What :func:`~kernels_lib.chunks.epilogue.logits_with_loss` and ``epilogue_loss`` read of the fused
    CE's options."""

    ignore_index: int
    pre_scale: float = 1.0


def _route_applies(target2, token_entropy, shard) -> bool:
    """Whether the route can take these log-probs at all: one target, no entropy, no shard."""
    return target2 is None and token_entropy is None and shard is None


def _exponentials_route(x_c: torch.Tensor, w: torch.Tensor, grads) -> bool:
    """Whether a gradient chunk, where :func:`_route_applies`, takes the stored exponentials: the fused
    CE's own predicate on the operands, not float16 (its ``dz`` is scaled: ``grads.wide``)."""
    return grads is not None and not grads.wide and x_c.dtype != torch.float16 and FLCE._epilogue_gemm_takes(x_c, w)


def sequence_logprobs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    seq_len: int,
    rows_per_chunk: int,
    ignore_index: int,
    target2: torch.Tensor | None = None,
    coefficients: Coefficients | None = None,
    needs: tuple[bool, bool, bool] = (False, False, False),
    accurate: bool = False,
    logit_scale: float = 1.0,
    token_coefficients: TokenCoefficients | None = None,
    token_logps: torch.Tensor | None = None,
    token_entropy: torch.Tensor | None = None,
    shard: VocabShard | None = None,
    skip_ignored: bool = False,
    group_seqs: int = 1,
):
    """:func:`kernels_lib._sequence_logprobs.sequence_logprobs` with the stored-exponentials route taken
    where it applies (module docstring); the same arguments and results, the ignored rows dropped as the
    library drops them (``skip_ignored``: its row plan) on both routes. Per-sequence summed log-probs of
    ``target`` (and ``target2``), and the fused gradients.

    Args:
        x: ``(S·T, H)`` rows, sequence after sequence (``T = seq_len`` rows each).
        weight, bias: the head ``(V, H)`` and optional ``(V,)``.
        target, target2: ``(S·T,)`` class indices in ``[0, V)`` or ``ignore_index`` (checked by the caller).
        rows_per_chunk: a multiple of ``seq_len`` (see :func:`chunk_rows`); chunks never split a
            sequence, nor anything the caller's ``coefficients`` needs together.
        coefficients: turns a chunk's sums into the per-sequence weights ``w`` (and ``w2``);
            called only when ``any(needs)``.
        needs: whether ``dx``, ``dW``, ``db`` are wanted.
        accurate: float32 accumulation of ``dW``/``db`` across chunks (as in cross-entropy).
        logit_scale: the logits are ``logit_scale · (x Wᵀ + b)`` (e.g. ``1/temperature``); the weights
            stay ``∂L/∂log p`` and the pipeline multiplies them by ``logit_scale``.
        token_coefficients: instead of ``coefficients`` (and without ``target2``): per-token weights
            from the chunk's per-token log-probs, one weight per row in the gradient pass.
        token_logps, token_entropy: optional float32 ``(S·T,)`` outputs: each row's log-prob of
            ``target`` (0 at ignored rows) and its softmax's entropy (0 at ignored rows).
        shard: this rank's slice of a vocabulary split over a process group (module docstring);
            ``weight``/``bias`` are then the shard's rows, the targets global. No ``token_entropy``.
        skip_ignored, group_seqs: as the library's (its row plan, :func:`kernels_lib._sequence_logprobs.row_plan`).

    Returns:
        ``(sums, sums2, grads)``: float32 ``(S,)`` sums (``sums2`` None without ``target2``), and
        ``(dx, dW, db)`` (None where not needed) or None when nothing is needed; in the inputs'
        dtypes, or float32 where the head runs in float16: there each chunk's ``dz`` is formed at a power-of-two
        scale that brings its largest weight to [1, 2), undone in float32 (``w ≈ β/(n·T)·p`` would
        otherwise underflow float16; the note in :mod:`kernels_lib.chunks.gradient_sums`).
    """
    if token_coefficients is not None and (coefficients is not None or target2 is not None):
        raise ValueError("token_coefficients replaces coefficients and takes no target2")
    if shard is not None and token_entropy is not None:
        raise NotImplementedError("token_entropy on a vocabulary shard (process_group): not implemented")
    compute_dtype = compute_dtype_for(x)  # the autocast dtype inside torch.autocast, else x's
    n_rows, n_seqs = x.shape[0], x.shape[0] // seq_len
    with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen: compute_dtype
        col_offset = 0 if shard is None else shard.offset
        route = _route_applies(target2, token_entropy, shard)
        epilogue_opts = _IgnoreIndex(ignore_index, logit_scale)
        plan = row_plan(target, ignore_index, seq_len, rows_per_chunk, group_seqs, skip_ignored, target2)
        kept_x, kept_target, kept_target2, kept_logps, kept_entropy, chunk_list = kept_rows(
            plan, x, target, target2, token_logps, token_entropy, seq_len, rows_per_chunk)
        if route and TAKE_NO_GRAD and not any(needs) and FLCE._no_grad_epilogue_runs():  # no chunks, buffer or stats pass
            every_logp = -epilogue_loss(kept_x, weight, bias, kept_target, epilogue_opts, compute_dtype)
            if token_logps is not None and plan is None:
                token_logps.copy_(every_logp)
            elif token_logps is not None:
                scatter_kept(every_logp, plan, n_rows, token_logps)
            return sequence_sums(every_logp, seq_len, None if plan is None else plan.index, n_seqs), None, None
        ops, lse, logp, logp2, sums, sums2, grads = chunk_buffers(
            kept_x, weight, bias, n_seqs, max(r.stop - r.start for r, _ in chunk_list), kept_target2, needs, accurate,
            compute_dtype, logit_scale,
        )
        exponentials = None  # decided at the first chunk: every chunk's operand is aligned alike
        one = torch.ones(1, dtype=torch.float32, device=x.device)  # the route's scale: the weights are in the factors
        for (rows, seqs), (_, x_c, buffer) in zip(chunk_list, ops.chunks([r for r, _ in chunk_list])):
            n = rows.stop - rows.start
            local = positions = None
            if plan is not None:
                local = plan.seq[rows] - seqs.start
                positions = plan.index[rows] - seqs.start * seq_len
            y2 = None if kept_target2 is None else kept_target2[rows]
            if exponentials is None:
                exponentials = route and TAKE_GRAD and _exponentials_route(x_c, ops.w, grads)
            if exponentials:
                # lse and target logit from the GEMM's epilogue, the buffer left holding ẽ, the factors u
                e, factors = logits_with_loss(buffer, x_c, ops, kept_target[rows], lse[:n], logp[:n], epilogue_opts,
                                              exponentials=True)
                logp[:n].neg_()  # lse − c_y (0 at ignored rows) → the log-prob
            else:
                logits = logits_chunk(buffer, x_c, ops.w, ops.b, ops.pre)
                launch_token_logprobs(
                    logits, kept_target[rows], lse=lse[:n], logp=logp[:n], ignore_index=ignore_index,
                    target2=y2, logp2=None if y2 is None else logp2[:n],
                    entropy=None if kept_entropy is None else kept_entropy[rows], col_offset=col_offset,
                )
            keep_chunk_logprobs(rows, seqs, n, seq_len, kept_target, y2, lse, logp, logp2, sums, sums2, kept_logps,
                                shard, ignore_index, positions)
            if grads is None:
                continue
            w, w2, rows_per_weight = chunk_weights(rows, seqs, n, seq_len, logp, sums, sums2, coefficients,
                                                   token_coefficients, logit_scale, local, positions)
            if exponentials:  # dz = −w · diag(u) ẽ: the weights, one per row, join the factors
                row_w = w if rows_per_weight == 1 else w.repeat_interleave(rows_per_weight)
                grads.add_exponentials(e, factors * -row_w, one, x_c, ops.w, rows)
                continue
            two_pass_gradient(grads, logits, x_c, ops.w, rows, kept_target, y2, lse[:n], logp[:n], w, w2,
                              rows_per_weight, ignore_index, col_offset)
        if shard is not None and grads is not None and grads.dx is not None:
            shard.sum_(grads.dx)
        result = None if grads is None else grads.result()
        if plan is not None:
            for kept, out in ((kept_logps, token_logps), (kept_entropy, token_entropy)):
                if out is not None:
                    scatter_kept(kept, plan, n_rows, out)
            if result is not None and result[0] is not None:
                result = (scatter_kept(result[0], plan, n_rows), *result[1:])
    return sums, sums2, result


def arm(interpreted_gemm: bool = True, parts: tuple[str, ...] = PARTS) -> dict:
    """The settings for :func:`studies.bench.arms.constants_set` that put the route in place: this
    :func:`sequence_logprobs` in every caller (:data:`CALLERS`), taking the route for ``parts`` of :data:`PARTS`
    only, and, with ``interpreted_gemm``, the epilogue GEMM in Triton's interpreter too (there the route is
    otherwise never taken)."""
    unknown = set(parts) - set(PARTS)
    if unknown or not parts:
        raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {tuple(parts)!r}")
    settings = {name: {"sequence_logprobs": sequence_logprobs} for name in CALLERS}
    settings[__name__] = {"TAKE_GRAD": "grad" in parts, "TAKE_NO_GRAD": "no_grad" in parts}
    if interpreted_gemm:
        settings[FLCE.__name__] = {"EPILOGUE_GEMM_WHEN_INTERPRETED": True}
    return settings
