r"""Sequence log-probabilities of a linear head, chunked over whole sequences, with their gradient fused.

The machinery shared by the preference losses (ORPO, KTO). For sequences ``k`` of ``T`` tokens,
rows ``x`` (``S·T × H``), head ``W`` (``V × H``), optional bias ``b`` and targets ``y``,

.. math::

    s_k = \sum_t m_{kt} \log \operatorname{softmax}(x_{kt} W^\top + b)_{y_{kt}},
    \qquad m_{kt} = [y_{kt} \ne \text{ignore\_index}],

is computed without the ``S·T × V`` logits: chunks of whole sequences go through one logits matmul
into a reused buffer and the stats pass of :mod:`kernels_lib.kernels.token_logprobs`.

A loss :math:`L` that depends on each sequence only through its own :math:`s_k` (and on constants)
has :math:`\partial L / \partial \log p_{kt} = w_k` for every valid token, with
:math:`w_k = \partial L / \partial s_k` known as soon as the chunk's sums are. So, when a gradient
is wanted, the caller's ``coefficients`` turns the chunk's sums into the :math:`w_k`, the kernel's
gradient pass overwrites the buffer with :math:`dz = w_k(\mathrm{onehot}(y) - p)`, and the three
matmuls follow in the same chunk: ``dx = dz W``, ``dW += dzᵀ x``, ``db += Σ dz``. That is the
arithmetic floor (no logits recomputed in backward), and the logits buffer is the only ``· × V``
memory.

A second target ``y'`` per token (ORPO's ``nll_target``) adds its own sums and weights; the kernel
forms both terms in the same pass.

A frozen reference head (DPO, KTO, GRPO) goes through the same chunks without gradient
(:func:`reference_sums`); :func:`validate_reference` and :func:`validate_reference_model` check it.

A loss that depends on each token's log-prob, not only on the sequence sums (GRPO: a clipped ratio
per token, a KL term per token), gives ``token_coefficients`` instead: it turns the chunk's per-token
log-probs into a weight :math:`w_{kt} = \partial L / \partial \log p_{kt}` per row, and the
gradient pass reads one weight per row. ``token_logps`` (and ``token_entropy``) keep the per-token
values for the caller; ``logit_scale`` multiplies the logits as they are formed (``1/temperature``),
and the pipeline applies the same factor to the weights (the chain rule through the scaled logits).

Masked rows (``skip_ignored``, :func:`row_plan`): the rows whose target is ``ignore_index`` (in both
targets, with ``target2``) add 0 to every sum and every gradient, yet each costs its share of the three
matmuls. With ``skip_ignored`` the valid rows are gathered first (of ``x``, of the targets, with the
sequence each belongs to); a chunk is whole sequences (whole groups: pairs) of gathered rows, up to
``rows_per_chunk`` of them; a sequence's sum is the segment sum of its gathered rows, laid out
``(S_c, T)`` with 0 at the dropped rows (the same terms in the same order as without); a sequence's
weight is read at each of its rows; per-token weights are formed on the chunk's ``(S_c, T)`` block
(log-prob 0 at the dropped rows) and read back at the gathered rows; ``dx``, ``token_logps`` and
``token_entropy`` are scattered back, 0 at the dropped rows. The cost: the valid tokens of each sequence
size the chunks, so they are read on the host (one sync per pipeline run, so per head a loss runs: on
CUDA the CPU waits for the work queued before the loss); nothing is gathered when no row is ignored, nor while a CUDA graph is being
captured. ``skip_ignored=False`` keeps every row, with no sync. With every row ignored, row 0 stands for
them all (it adds 0 everywhere).

Mixed precision: :func:`sequence_logprobs` resolves the head's matmul dtype from its ``x``
(:func:`kernels_lib._autocast.compute_dtype_for`: the autocast dtype inside ``torch.autocast``, else
``x``'s) and runs the chunk loop with autocast off, so every loss built on it, and every reference
head it runs, follows autocast as ``F.linear`` would; the gradients come back in the leaves' dtypes.

Vocabulary-parallel (``shard``, :mod:`kernels_lib._vocab_parallel`): the head is this rank's rows of
``W``. Per chunk the stats pass gives the shard's lse and, where the rank owns the target, the
log-prob under the shard's softmax; :meth:`~kernels_lib._vocab_parallel.VocabShard.merge_token_logprobs`
makes them global (per row 1 float all-reduced MAX and 2, or 3 with a second target, SUM), so the
sums, hence the weights, are the same on every rank; the gradient pass writes this rank's ``dz``,
``dW``/``db`` stay local, and ``dx`` is summed over the ranks once after the last chunk (``N × H``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ._runtime import capturing
from . import _validate as v
from ._autocast import compute_dtype_for
from .chunks.gradient_sums import GradientSums, scaled_to_dtypes
from .chunks.matmuls import logits_chunk
from .chunks.operands import Operands, chunk_slices
from ._vocab_parallel import VocabShard
from .kernels.token_logprobs import launch_token_logprobs, launch_token_logprobs_grad

#: ``coefficients(seqs, sums, sums2) -> (w, w2)``: float32 per-sequence weights of the chunk's
#: sequences ``seqs`` (a slice), from their float32 sums (``sums2``/``w2``: the second target's, or None).
Coefficients = Callable[[slice, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]

#: ``token_coefficients(rows, logp) -> w``: float32 per-token weights ``∂L/∂log p`` of the chunk's rows
#: ``rows`` (a slice of whole sequences), from their float32 log-probs ``logp`` (0 at ignored rows).
TokenCoefficients = Callable[[slice, torch.Tensor], torch.Tensor]


#: The fewest rows of a default chunk of the sequence losses. At a small ``H`` a budget in proportion to ``H``
#: makes the chunk's matmuls small and its ``dW`` passes (one read and write of the whole accumulator each)
#: many: the floor trades a logits buffer of ``1024 × V`` for fewer passes.
MIN_SEQUENCE_CHUNK_ROWS = 1024
#: A default chunk holds up to ``H / SEQUENCE_CHUNK_HIDDEN_DIVISOR`` rows: its logits buffer is then half the weight
#: gradient (bf16). Larger chunks take less time (fewer ``dW`` passes, larger matmuls) for more memory, in
#: proportion to the rows; ``chunk_size`` is that dial.
SEQUENCE_CHUNK_HIDDEN_DIVISOR = 2


def chunk_rows(chunk_size: int | None, group_rows: int, n_rows: int, hidden: int) -> int:
    """Rows per chunk: ``chunk_size`` (or the default budget: ``H / 2`` rows, at least
    :data:`MIN_SEQUENCE_CHUNK_ROWS`) rounded down to whole groups.

    A group is the rows that must share a chunk (one sequence, or an ORPO pair); at least one group
    per chunk, so a group longer than the budget makes a larger chunk.
    """
    budget = chunk_size or max(MIN_SEQUENCE_CHUNK_ROWS, hidden // SEQUENCE_CHUNK_HIDDEN_DIVISOR // 128 * 128)
    return max(1, budget // group_rows) * group_rows


class RowPlan(NamedTuple):
    """The rows a call runs when some are ignored (:func:`row_plan`), and its chunks over them."""

    index: torch.Tensor  #: (n_kept,) int64 the kept rows, ascending
    seq: torch.Tensor  #: (n_kept,) int64 the sequence of each kept row
    chunks: tuple  #: ``(rows, seqs)`` per chunk: a slice of the kept rows and the slice of sequences they cover


def row_plan(target: torch.Tensor, ignore_index: int, seq_len: int, rows_per_chunk: int, group_seqs: int = 1,
             enabled: bool = True, target2: torch.Tensor | None = None) -> RowPlan | None:
    """The valid rows of the flat ``target`` (``S·T``; valid in ``target`` or ``target2``) and chunks of whole groups of ``group_seqs``
    sequences over them (each at most ``rows_per_chunk`` valid rows, or one group), or None to run every
    row (``enabled`` False, a CUDA graph being captured, or no row ignored).

    The valid tokens per sequence are read on the host (the one sync). With every row ignored row 0
    stands for them all (its target ignored: it adds 0 everywhere)."""
    if not enabled or capturing(target.device):
        return None
    n_rows = target.shape[0]
    n_seqs = n_rows // seq_len
    valid = target != ignore_index
    if target2 is not None:
        valid |= target2 != ignore_index
    counts = valid.view(n_seqs, seq_len).sum(1).tolist()  # the host sync: the counts size the chunks
    n_kept = sum(counts)
    if n_kept == n_rows:
        return None
    if n_kept == 0:
        index = torch.zeros(1, dtype=torch.int64, device=target.device)
        return RowPlan(index, index, ((slice(0, 1), slice(0, n_seqs)),))
    # The kept rows in order without a second sync: a stable sort puts the valid rows first.
    index = torch.argsort((~valid).to(torch.int8), stable=True)[:n_kept]
    chunks, first_row, first_seq, rows = [], 0, 0, 0
    for start in range(0, n_seqs, group_seqs):
        group = sum(counts[start:start + group_seqs])
        if rows and rows + group > rows_per_chunk:
            chunks.append((slice(first_row, first_row + rows), slice(first_seq, start)))
            first_row, first_seq, rows = first_row + rows, start, 0
        rows += group
    if rows:
        chunks.append((slice(first_row, first_row + rows), slice(first_seq, n_seqs)))
    else:  # trailing sequences with no valid row join the last chunk
        chunks[-1] = (chunks[-1][0], slice(chunks[-1][1].start, n_seqs))
    return RowPlan(index, index // seq_len, tuple(chunks))


def kept_rows(plan: RowPlan | None, x, target, target2, token_logps, token_entropy, seq_len: int, rows_per_chunk: int):
    """The rows the chunks run on and the chunks: with a ``plan``, the kept rows of ``x`` and the targets gathered
    (the per-token outputs as buffers of the kept length, scattered back afterwards) and the plan's chunks; without
    one, everything as given in chunks of ``rows_per_chunk`` rows. Returns ``(x, target, target2, token_logps,
    token_entropy, chunks)``, each chunk ``(rows, seqs)``."""
    if plan is None:
        n_rows = x.shape[0]
        chunks = [(rows, slice(rows.start // seq_len, rows.stop // seq_len))
                  for rows in chunk_slices(n_rows, min(rows_per_chunk, n_rows))]
        return x, target, target2, token_logps, token_entropy, chunks
    index = plan.index
    kept_logps, kept_entropy = (None if t is None else t.new_empty(index.shape[0]) for t in (token_logps, token_entropy))
    return (x.index_select(0, index), target.index_select(0, index),
            None if target2 is None else target2.index_select(0, index), kept_logps, kept_entropy, list(plan.chunks))


def chunk_buffers(x, weight, bias, n_seqs: int, rows_per_chunk: int, target2, needs, accurate: bool,
                  compute_dtype: torch.dtype, logit_scale: float):
    """What :func:`sequence_logprobs` fills chunk by chunk: the operands, each chunk's ``lse`` and log-probs
    (float32, one chunk long), the per-sequence sums and the gradient sums (None when no gradient is wanted)."""
    ops = Operands(x, weight, bias, rows_per_chunk, compute_dtype, pre=logit_scale)
    lse, logp = (torch.empty(ops.chunk_size, dtype=torch.float32, device=x.device) for _ in range(2))
    logp2 = None if target2 is None else torch.empty_like(logp)
    sums = torch.empty(n_seqs, dtype=torch.float32, device=x.device)
    sums2 = None if target2 is None else torch.empty_like(sums)
    grads = GradientSums(x, weight, bias, needs, accurate, compute_dtype) if any(needs) else None
    return ops, lse, logp, logp2, sums, sums2, grads


def sequence_sums(values: torch.Tensor, seq_len: int, positions: torch.Tensor | None, n_seqs: int) -> torch.Tensor:
    """A chunk's per-row values summed per sequence: whole ``T``-row sequences, or with ``positions`` (each
    kept row's place in the chunk's ``(S_c, T)`` block) the segment sums of the kept rows, laid out in the
    block with 0 at the dropped rows so that each sum adds the same terms in the same order as without."""
    if positions is not None:
        values = values.new_zeros(n_seqs * seq_len).index_copy_(0, positions, values)
    return values.view(-1, seq_len).sum(1)


def keep_chunk_logprobs(rows: slice, seqs: slice, n: int, seq_len: int, target, y2, lse, logp, logp2, sums, sums2,
                        token_logps, shard, ignore_index: int, positions: torch.Tensor | None = None) -> None:
    """A chunk's token log-probs merged across a vocabulary shard, summed per sequence, and kept per token."""
    if shard is not None:
        pairs = [(target[rows], logp[:n])] + ([] if y2 is None else [(y2, logp2[:n])])
        shard.merge_token_logprobs(lse[:n], pairs, ignore_index)
    n_seqs = seqs.stop - seqs.start
    sums[seqs] = sequence_sums(logp[:n], seq_len, positions, n_seqs)
    if sums2 is not None:
        sums2[seqs] = sequence_sums(logp2[:n], seq_len, positions, n_seqs)
    if token_logps is not None:
        token_logps[rows] = logp[:n]


def chunk_weights(rows: slice, seqs: slice, n: int, seq_len: int, logp, sums, sums2, coefficients,
                  token_coefficients, logit_scale: float, local: torch.Tensor | None = None,
                  positions: torch.Tensor | None = None):
    """``(w, w2, rows_per_weight)``: a chunk's ``∂L/∂z`` weights per sequence (or per token), times ``logit_scale``.

    With kept rows (``local``: each row's sequence within the chunk, ``positions``: its row within the
    chunk's ``(S_c, T)`` block) the weights are read per row: a sequence's at its rows, and the per-token
    weights formed on the block (log-prob 0 at the dropped rows) at the kept rows."""
    if token_coefficients is not None:
        if positions is None:
            w, w2, rows_per_weight = token_coefficients(rows, logp[:n]), None, 1
        else:
            block = logp.new_zeros((seqs.stop - seqs.start) * seq_len).index_copy_(0, positions, logp[:n])
            w = token_coefficients(slice(seqs.start * seq_len, seqs.stop * seq_len), block).index_select(0, positions)
            w2, rows_per_weight = None, 1
    else:
        w, w2 = coefficients(seqs, sums[seqs], None if sums2 is None else sums2[seqs])
        rows_per_weight = seq_len
        if local is not None:
            w, w2 = w.index_select(0, local), None if w2 is None else w2.index_select(0, local)
            rows_per_weight = 1
    if logit_scale != 1.0:  # dL/dz = logit_scale · dL/d(logit_scale · z)
        w, w2 = w * logit_scale, None if w2 is None else w2 * logit_scale
    return w, w2, rows_per_weight


def two_pass_gradient(grads, logits, x_c, w_ops, rows: slice, target, y2, lse, logp, w, w2, rows_per_weight: int,
                      ignore_index: int, col_offset: int) -> None:
    """The gradient pass over a chunk's logits (``dz`` in place) and its products into ``grads``."""
    # float16: dz at the scale that brings the chunk's largest |w| to [1, 2)
    unscale = grads.dz_unscale(lambda: torch.stack([w.abs().max()] + ([] if w2 is None else [w2.abs().max()])).max())
    if unscale != 1.0:
        w, w2 = w / unscale, None if w2 is None else w2 / unscale
    launch_token_logprobs_grad(
        logits, target[rows], lse=lse, logp=logp, weight=w.contiguous(), rows_per_weight=rows_per_weight,
        ignore_index=ignore_index, target2=y2, weight2=None if w2 is None else w2.contiguous(), col_offset=col_offset,
    )
    grads.add_chunk(logits, x_c, w_ops, rows, unscale)


def scatter_kept(values: torch.Tensor, plan: RowPlan, n_rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The kept rows' ``values`` written at their rows of ``out`` (or of a new tensor) of ``n_rows`` rows,
    0 at the dropped rows."""
    out = values.new_empty((n_rows, *values.shape[1:])) if out is None else out
    return out.zero_().index_copy_(0, plan.index, values)


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
    """Per-sequence summed log-probs of ``target`` (and ``target2``), and the fused gradients.

    Args:
        x: ``(S·T, H)`` rows, sequence after sequence (``T = seq_len`` rows each).
        weight, bias: the head ``(V, H)`` and optional ``(V,)``.
        target, target2: ``(S·T,)`` class indices in ``[0, V)`` or ``ignore_index`` (any other refused by the
            caller's :class:`~kernels_lib._validate.TargetCheck` once the call is queued; the kernels read nothing for it).
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
        skip_ignored: drop the rows whose ``target`` (and ``target2``) is ``ignore_index`` before the
            matmuls (the module docstring).
        group_seqs: the sequences the caller's ``coefficients`` needs in one chunk (2: a pair);
            ``rows_per_chunk`` is a multiple of ``group_seqs · seq_len``.

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
        plan = row_plan(target, ignore_index, seq_len, rows_per_chunk, group_seqs, skip_ignored, target2)
        kept_x, kept_target, kept_target2, kept_logps, kept_entropy, chunk_list = kept_rows(
            plan, x, target, target2, token_logps, token_entropy, seq_len, rows_per_chunk)
        ops, lse, logp, logp2, sums, sums2, grads = chunk_buffers(
            kept_x, weight, bias, n_seqs, max(r.stop - r.start for r, _ in chunk_list), kept_target2, needs, accurate,
            compute_dtype, logit_scale,
        )
        for (rows, seqs), (_, x_c, buffer) in zip(chunk_list, ops.chunks([r for r, _ in chunk_list])):
            n = rows.stop - rows.start
            local = positions = None
            if plan is not None:
                local = plan.seq[rows] - seqs.start
                positions = plan.index[rows] - seqs.start * seq_len
            y2 = None if kept_target2 is None else kept_target2[rows]
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


class SequenceLossResult(NamedTuple):
    """What a sequence loss's forward (:attr:`SequenceLossCall.forward`) hands back."""

    outputs: NamedTuple  #: the loss's outputs by name, its ``loss`` field the float32 scalar; none carries a gradient
    grads: tuple | None  #: ``(dx, dW, db)`` in the leaves' shapes (None entries where not wanted), or None


class SequenceLossCall(NamedTuple):
    """One call of a sequence loss, as :class:`FusedSequenceLoss` receives it beside ``x``, ``weight``, ``bias``.

    ``forward(x, weight, bias, inputs, options)`` is a module-level function of the loss (no closure):
    it runs the pipeline, whose chunk weights it forms with its own named functions from ``inputs`` and
    ``options``, and returns a :class:`SequenceLossResult`. ``inputs`` holds the call's
    non-differentiable tensors (targets, counts, reference log-probs, ...) by name; ``options`` the
    call's frozen options, which gradients are wanted among them.
    """

    forward: Callable[..., SequenceLossResult]
    inputs: NamedTuple
    options: object


class FusedSequenceLoss(torch.autograd.Function):
    """A scalar loss whose gradients the call's forward forms; backward scales them by the upstream gradient.

    ``apply(x, weight, bias, call)`` with a :class:`SequenceLossCall` returns ``(loss, outputs)``: the
    loss as an autograd node and the loss's outputs by name (:func:`fused_sequence_loss` puts the node
    in their ``loss`` field). Backward multiplies the saved gradients in place by ``grad_output``
    with a kernel that reads it on the device (no host sync) and moves nothing when it is 1, then
    hands the buffers out (float16's float32 gradients rounded to float16 only then, after the loss
    scale is applied): a second backward through the same graph is refused.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, call: SequenceLossCall):
        outputs, grads = call.forward(x, weight, bias, call.inputs, call.options)
        ctx.save_for_backward(*(grads or (None, None, None)))
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.handed_out = False
        return outputs.loss, outputs

    @staticmethod
    def backward(ctx, grad_output, _outputs_grad):
        if ctx.handed_out:
            raise RuntimeError(
                "backward ran twice through a fused preference loss: its gradients are formed in forward and "
                "were already handed out; call the loss again instead of retain_graph=True"
            )
        ctx.handed_out = True
        return (*scaled_to_dtypes(ctx.saved_tensors, grad_output, ctx.dtypes), None)


def fused_sequence_loss(x, weight, bias, call: SequenceLossCall) -> NamedTuple:
    """The loss's outputs by name, their ``loss`` the differentiable scalar (:class:`FusedSequenceLoss`)."""
    loss, outputs = FusedSequenceLoss.apply(x, weight, bias, call)
    return outputs._replace(loss=loss)


def wanted_grads(*tensors) -> tuple[bool, ...]:
    """Which of ``tensors`` (None allowed) a gradient is wanted for, under the current grad mode."""
    grad_on = torch.is_grad_enabled()
    return tuple(bool(t is not None and t.requires_grad and grad_on) for t in tensors)


def reference_sums(
    ref_x: torch.Tensor,
    ref_weight: torch.Tensor,
    ref_bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    ignore_index: int,
    chunk_size: int | None,
    shard: VocabShard | None = None,
    logit_scale: float = 1.0,
    per_token: bool = False,
    skip_ignored: bool = False,
) -> torch.Tensor:
    """The reference head's log-probs of ``target`` ``(S, T)``, float32, without gradient: summed per
    sequence ``(S,)``, or with ``per_token`` each token's ``(S, T)`` (0 at ignored targets).

    ``logit_scale`` multiplies the reference logits (``1/temperature``); ``shard``: the reference head is
    this rank's slice of a vocabulary-parallel head; ``skip_ignored``: the ignored rows dropped before the
    matmuls, as in :func:`sequence_logprobs`."""
    seq_len = target.shape[1]
    rows = ref_x.reshape(-1, ref_x.shape[-1])
    tokens = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device) if per_token else None
    with torch.no_grad():
        sums, _, _ = sequence_logprobs(
            rows, ref_weight, ref_bias, target.reshape(-1), seq_len=seq_len, ignore_index=ignore_index,
            rows_per_chunk=chunk_rows(chunk_size, seq_len, rows.shape[0], ref_weight.shape[1]), shard=shard,
            logit_scale=logit_scale, token_logps=tokens, skip_ignored=skip_ignored,
        )
    return tokens.view(target.shape) if per_token else sums


def validate_reference(x, target, weight, ref_x, ref_weight, ref_bias, ref_logps, batch: str = "B", *,
                       per_token: bool = False, required: bool = True) -> dict:
    """Exactly one of ``ref_logps`` and ``(ref_x, ref_weight[, ref_bias])``, shaped to fit; returns them by name.

    ``batch`` names the leading size in the messages (``"B"``, or ``"2n"`` for pairs). ``ref_logps`` is
    ``(batch,)``, or with ``per_token`` ``target.shape``. ``required=False`` allows neither (returns ``{}``).
    """
    model = (ref_x, ref_weight, ref_bias)
    if ref_logps is not None:
        if any(t is not None for t in model):
            raise ValueError("give either ref_logps or the reference model (ref_x, ref_weight, ref_bias), not both")
        v.require_tensor("ref_logps", ref_logps)
        if not ref_logps.is_floating_point():
            raise TypeError(f"ref_logps must be a floating tensor; got {ref_logps.dtype}")
        if per_token:
            v.require_shape("ref_logps", ref_logps, target.shape, f"({batch}, T) = target.shape")
        else:
            v.require_shape("ref_logps", ref_logps, x.shape[:1], f"({batch},)")
        return {"ref_logps": ref_logps}
    if all(t is None for t in model):
        if not required:
            return {}
        raise ValueError("give ref_logps, or the reference model: ref_x and ref_weight (and optionally ref_bias)")
    if ref_x is None or ref_weight is None:
        raise ValueError("the reference model needs ref_x and ref_weight (and optionally ref_bias), or give ref_logps instead")
    return validate_reference_model(target, weight, ref_x, ref_weight, ref_bias, batch)


def validate_reference_model(target, weight, ref_x, ref_weight, ref_bias, batch: str = "B") -> dict:
    """A reference head that fits the policy's: ``ref_x`` ``(batch, T, H_ref)`` over ``target``'s
    tokens, ``ref_weight`` ``(V, H_ref)`` with the policy's ``V``, the optional ``ref_bias``; returns
    them by name."""
    v.require_head_inputs(ref_x, ref_weight, x_ndim=3, names=("ref_x", "ref_weight"), n_cols=weight.shape[0])
    v.require_shape("ref_x", ref_x, (*target.shape, ref_x.shape[-1]), f"({batch}, T, H_ref) with ({batch}, T) = target.shape")
    tensors = {"ref_x": ref_x, "ref_weight": ref_weight}
    if ref_bias is not None:
        v.require_bias("ref_bias", ref_bias, ref_weight, "ref_weight")
        tensors["ref_bias"] = ref_bias
    return tensors
