r"""The two-head pipeline shared by :mod:`kernels_lib.fused_linear_jsd` and :mod:`kernels_lib.distillation`.

A student head (``x_s`` ``N × H_s``, ``W_s`` ``V × H_s``, optional ``b_s``) and a teacher head (``x_t``
``N × H_t``, ``W_t`` ``V × H_t``, optional ``b_t``) are compared row by row without either ``N × V``
logits matrix: chunks of rows go through one logits matmul per head into two reused ``chunk × V``
buffers, then one Triton kernel (:mod:`kernels_lib.kernels.distill_chunk`) computes each row's soft
loss (the variable part, :class:`SoftLoss`: the generalized JSD or the cosine), optionally the hard
loss (cross-entropy of the raw student logits against the target) and, when a gradient is wanted,
overwrites the student buffer with ``dz``; then ``dx_c = dz W_s``, ``dW_s += dzᵀ x_c``,
``db_s += Σ dz`` (:class:`~kernels_lib.chunks.gradient_sums.GradientSums`, the cross-entropy's).

The losses are sums over rows divided by a count known before the loop (the non-ignored rows), so
each row's gradient factor is known in forward and all gradients are formed there: four matmuls
(two logits products, ``dx``, ``dW``), the floor; backward only scales them by ``grad_output``
(:class:`~kernels_lib._sequence_logprobs.FusedSequenceLoss`, no host sync). The teacher is a
constant: no gradient flows to it, and its tensors are read detached.

Memory: two ``chunk × V`` buffers (the student's, which becomes ``dz``, and the teacher's) in the
matmul dtype, plus the gradients themselves. The default chunk (:func:`two_head_chunk_size`) holds at
least :data:`MIN_TWO_HEAD_CHUNK_ROWS` rows: each chunk's ``dW_s += dzᵀ x_c`` reads and writes the whole
accumulator, and each chunk's kernel runs one program per row, so small chunks pay in both; 2048 rows
hold 1 GiB of bf16 buffers at ``V = 128256``, and ``chunk_size`` trades that memory back for time.

float16: each chunk's ``dz`` is formed at the power-of-two scale that brings the largest gradient
factor to [1, 2) and undone in float32, as in cross-entropy (its module docstring says why).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from . import _validate as v
from ._autocast import compute_dtype_for
from .chunks.chunk_size import lean_chunk_size
from .chunks.gradient_sums import GradientSums
from .chunks.operands import Operands
from ._sequence_logprobs import SequenceLossCall, SequenceLossResult, fused_sequence_loss, wanted_grads
from .kernels.distill_chunk import SOFT_COSINE, SOFT_JSD, launch_distill_chunk


#: The fewest rows of a default chunk of the two-head losses: below it the per-chunk ``dW`` pass and the
#: kernel's one-program-per-row launch cost more time than the two smaller ``chunk × V`` buffers save memory
#: (the A/B of the chunk sizes: ``studies/``).
MIN_TWO_HEAD_CHUNK_ROWS = 2048


def two_head_chunk_size(n_rows: int, hidden: int) -> int:
    """Rows per chunk of the two-head losses by default: the lean budget of the student's ``hidden``
    (:func:`~kernels_lib.chunks.chunk_size.lean_chunk_size`) or :data:`MIN_TWO_HEAD_CHUNK_ROWS`, whichever is
    larger, at most ``n_rows``."""
    return max(1, min(n_rows, max(MIN_TWO_HEAD_CHUNK_ROWS, lean_chunk_size(n_rows, hidden))))


@dataclass(frozen=True)
class SoftLoss:
    """The soft loss's formula (the kernel's ``SOFT``) and its ``beta``.

    ``chain(T)`` is the factor between the kernel's soft gradient and ``∂s/∂z`` of the raw logits:
    ``1/T`` for the JSD (its log-probs are of ``z/T``), ``beta`` for the cosine (temperature-free;
    the kernel's gradient is that of ``1 - cos``)."""

    kind: int
    beta: float

    def chain(self, temperature: float) -> float:
        return 1.0 / temperature if self.kind == SOFT_JSD else self.beta


def jsd_soft(beta: float) -> SoftLoss:
    return SoftLoss(SOFT_JSD, float(beta))


def cosine_soft(beta: float) -> SoftLoss:
    return SoftLoss(SOFT_COSINE, float(beta))


@dataclass(frozen=True)
class Options:
    """The options every two-head loss takes, validated; the loss weights of the call and which gradients
    are wanted (:func:`dataclasses.replace` them in before the call)."""

    temperature: float
    ignore_index: int
    chunk_size: int | None
    accurate: bool
    hard_weight: float = 0.0  #: ``w_h``; 0 with ``TwoHeadInputs.with_hard`` False: no hard loss at all
    soft_weight: float = 1.0  #: ``w_s``
    needs: tuple[bool, bool, bool] = (False, False, False)  #: whether the student's dx, dW, db are wanted


class TwoHeadInputs(NamedTuple):
    """A two-head call's non-differentiable inputs, by name."""

    teacher: tuple  #: the teacher's ``(x2d, weight, bias)``, detached (:func:`teacher_constant`)
    target: torch.Tensor | None  #: ``(N,)`` targets, or None
    soft: SoftLoss  #: the soft loss's formula
    divisor: torch.Tensor  #: a float32 device scalar dividing both losses' row sums
    with_hard: bool  #: whether the hard loss is computed (needs ``target``)


class TwoHeadOutput(NamedTuple):
    """A two-head loss's outputs; float32 scalars, only ``loss`` carries a gradient."""

    loss: torch.Tensor  #: ``w_h · hard_loss + w_s · soft_loss`` (``soft_loss`` alone without the hard loss)
    hard_loss: torch.Tensor | None  #: the hard loss's row sum / divisor, None without it
    soft_loss: torch.Tensor  #: the soft loss's row sum / divisor


def two_head_rows(student, teacher, target, soft: SoftLoss, opts: Options, *, with_hard: bool, factors, needs):
    """Per-row hard and soft losses and the fused student gradients, chunk by chunk.

    Args:
        student, teacher: ``(x, weight, bias)`` with ``x`` 2-D ``(N, H)``; the teacher's detached.
        target: ``(N,)`` class indices in ``[0, V)`` or ``ignore_index`` (any other refused by the caller's
            :func:`~kernels_lib._validate.check_targets` once the call is queued; the stage reads column 0 for it), or None.
        with_hard: compute the hard loss (needs ``target``).
        factors: a function ``() -> float32 (2,)`` device tensor ``(f_h, f_s)``: the gradient factors
            of every counted row (loss weight × reduction × ``soft.chain``); called when ``any(needs)``.
        needs: whether ``dx``, ``dW``, ``db`` of the student are wanted.

    Returns:
        ``(hard, soft, grads)``: float32 ``(N,)`` rows (``hard`` None without ``with_hard``), 0 at
        ignored rows; ``(dx, dW, db)`` (None entries where not needed) or None; in the student's
        dtypes, or float32 for float16 inputs (rounded by :class:`FusedSequenceLoss` after backward).
    """
    x, weight, bias = student
    n_rows = x.shape[0]
    rows_per_chunk = opts.chunk_size or two_head_chunk_size(n_rows, x.shape[1])
    # Each head's matmul dtype (the autocast dtype inside torch.autocast), resolved before autocast is
    # turned off for the chunk loop: inside that block every head would read as outside autocast.
    dtypes = compute_dtype_for(x), compute_dtype_for(teacher[0])
    with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen: dtypes
        ops = Operands(x, weight, bias, rows_per_chunk, dtypes[0])
        teacher_ops = Operands(*teacher, rows_per_chunk, dtypes[1])
        soft_rows = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        hard_rows = torch.empty_like(soft_rows) if with_hard else None
        grads, scaled, unscale = None, None, 1.0
        if any(needs):
            grads = GradientSums(x, weight, bias, needs, opts.accurate, ops.compute_dtype)
            scaled = factors()
            unscale = grads.dz_unscale(lambda: scaled.abs().max())
            scaled = scaled / unscale if unscale != 1.0 else scaled
        for (rows, x_c, logits), (_, _, teacher_logits) in zip(ops, teacher_ops, strict=True):
            launch_distill_chunk(
                logits, teacher_logits, None if target is None else target[rows],
                soft=soft_rows[rows], hard=None if hard_rows is None else hard_rows[rows], factors=scaled,
                soft_kind=soft.kind, beta=soft.beta, temperature=opts.temperature, ignore_index=opts.ignore_index,
            )
            if grads is not None:
                grads.add_chunk(logits, x_c, ops.w, rows, unscale)
    return hard_rows, soft_rows, None if grads is None else grads.result()


def two_head_forward(x, weight, bias, inputs: TwoHeadInputs, opts: Options) -> SequenceLossResult:
    """The forward of :class:`~kernels_lib._sequence_logprobs.FusedSequenceLoss` for a two-head loss: the rows'
    losses and the student's gradients (``dx`` in ``x``'s shape), then the weighted loss."""
    hard_rows, soft_rows, grads = two_head_rows(
        (x.reshape(-1, x.shape[-1]), weight, bias), inputs.teacher, inputs.target, inputs.soft, opts,
        with_hard=inputs.with_hard, factors=functools.partial(_factors, inputs, opts), needs=opts.needs,
    )
    soft = soft_rows.sum() / inputs.divisor
    hard = None if hard_rows is None else hard_rows.sum() / inputs.divisor
    loss = soft if hard is None else opts.hard_weight * hard + opts.soft_weight * soft
    if grads is not None and grads[0] is not None:
        grads = (grads[0].view(x.shape), *grads[1:])
    return SequenceLossResult(TwoHeadOutput(loss, hard, soft), grads)


def _factors(inputs: TwoHeadInputs, opts: Options) -> torch.Tensor:
    """``(f_h, f_s) = (w_h / D, w_s · chain / D)``: each counted row's gradient factors, a float32 ``(2,)``."""
    chain = opts.soft_weight * inputs.soft.chain(opts.temperature)
    return torch.stack([opts.hard_weight / inputs.divisor, chain / inputs.divisor])


def fused_two_head_loss(student_x, student_weight, student_bias, inputs: TwoHeadInputs, opts: Options) -> TwoHeadOutput:
    """The two-head loss of a call as an autograd node whose gradients (student only) are formed in forward."""
    call = SequenceLossCall(two_head_forward, inputs, replace(opts, needs=wanted_grads(student_x, student_weight, student_bias)))
    return fused_sequence_loss(student_x, student_weight, student_bias, call)


def teacher_constant(teacher_x, teacher_weight, teacher_bias):
    """The teacher's ``(x2d, weight, bias)``, detached: no gradient flows to it."""
    return (
        teacher_x.detach().reshape(-1, teacher_x.shape[-1]),
        teacher_weight.detach(),
        None if teacher_bias is None else teacher_bias.detach(),
    )


def kept_rows(target: torch.Tensor | None, n_rows: int, ignore_index: int, device) -> torch.Tensor:
    """The number of non-ignored rows, a float32 device tensor (``n_rows`` without a target); never
    read on the host."""
    if target is None:
        return torch.full((), float(n_rows), dtype=torch.float32, device=device)
    return (target != ignore_index).sum().to(torch.float32)


def validate_heads(student_x, student_weight, teacher_x, teacher_weight, target, student_bias, teacher_bias,
                   *, target_required: bool) -> None:
    """Tensors, dtypes, shapes and devices of the two heads, each error naming its argument.

    The student's ``x``, ``weight`` and ``bias`` share one float dtype, the teacher's another (may
    differ from the student's), except under ``torch.autocast``, which casts them all
    (:mod:`kernels_lib._autocast`); ``teacher_x`` has ``student_x``'s leading shape; both heads have
    the same ``V``; ``target`` (int64/int32) has that leading shape."""
    heads = {"student_x": student_x, "student_weight": student_weight, "teacher_x": teacher_x, "teacher_weight": teacher_weight}
    for name, tensor in heads.items():
        v.require_tensor(name, tensor)
        v.require_float(name, tensor)
    v.require_head_dtype("student_x", student_x, "student_weight", student_weight)
    v.require_head_dtype("teacher_x", teacher_x, "teacher_weight", teacher_weight)
    v.require_nonempty("student_x", student_x)
    v.require_nonempty("teacher_x", teacher_x)
    v.require_linear_head("student_weight", student_weight, student_x.shape[-1])
    if teacher_x.shape[:-1] != student_x.shape[:-1]:
        raise ValueError(
            f"teacher_x must have the leading shape of student_x, {tuple(student_x.shape[:-1])} (one teacher row per "
            f"student row); got {tuple(teacher_x.shape)}"
        )
    v.require_linear_head("teacher_weight", teacher_weight, teacher_x.shape[-1], student_weight.shape[0])
    tensors = dict(heads)
    for name, bias, head_name, head in (("student_bias", student_bias, "student_weight", student_weight),
                                        ("teacher_bias", teacher_bias, "teacher_weight", teacher_weight)):
        if bias is not None:
            v.require_bias(name, bias, head, head_name)
            tensors[name] = bias
    if target is None:
        if target_required:
            raise TypeError("target must be a torch.Tensor of class indices (the hard loss's labels); got None")
    else:
        v.require_tensor("target", target)
        v.require_index_dtype("target", target)
        v.require_shape("target", target, student_x.shape[:-1], "student_x.shape[:-1]")
        tensors["target"] = target
    v.require_same_device(tensors)


def validate_options(temperature, ignore_index, chunk_size, accurate) -> Options:
    v.require_real("temperature", temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    v.require_int("ignore_index", ignore_index)
    v.require_chunk_options(chunk_size, accurate)
    return Options(float(temperature), ignore_index, chunk_size, accurate)
