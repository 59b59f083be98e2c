r"""Fused linear + KTO (Kahneman–Tversky optimization) without the ``B·T × V`` logits.

Unpaired examples: ``x`` (``B × T × H``), ``target`` (``B × T``), a label per example (desirable
or not). With per-token log-probs :math:`\log p_{kt}` of the policy head over the ``N_k`` valid
tokens of sequence ``k`` (summed; averaged with ``average_log_prob``) and the reference model's
:math:`\ell^{\text{ref}}_k` (computed the same way without gradient, or given),

.. math::

    \ell_k = \sum_t \log p_{kt}\ \Big(\text{or } \tfrac1{N_k}\textstyle\sum_t\Big), \qquad
    r_k = \ell_k - \ell^{\text{ref}}_k, \qquad u_k = \beta\,(r_k - \mathrm{kl}),

    L = \frac1B \sum_k \begin{cases}
        \lambda_D\,\big(1 - \sigma(u_k)\big) & k \text{ desirable} \\
        \lambda_U\,\big(1 - \sigma(-u_k)\big) & k \text{ undesirable,} \end{cases}

with ``kl`` a detached scalar (TRL: ``clamp(mean(KL_logps − ref_KL_logps), min=0)`` over
mismatched pairs, computed by the caller) and the weights :math:`\lambda_D, \lambda_U`. This is
TRL 1.16's ``KTOTrainer`` loss (``loss_type="kto"``; see :func:`kernels_lib.reference.fused_linear_kto`
for the lines it follows), except that a NaN example makes the loss NaN where TRL's ``nanmean``
would drop it silently.

Gradient
--------
With :math:`\sigma'(u) = \sigma(u)\sigma(-u)`, each valid token of sequence ``k`` has the weight

.. math::

    \frac{\partial L}{\partial \log p_{kt}} = \frac{\beta\,\sigma(u_k)\,\sigma(-u_k)}{B\,(N_k)}
        \times \begin{cases} -\lambda_D & \text{desirable} \\ +\lambda_U & \text{undesirable} \end{cases}

(the :math:`N_k` only with ``average_log_prob``); times :math:`\mathrm{onehot}(y) - \mathrm{softmax}`
it is ``dz``.

Design
------
:mod:`kernels_lib._sequence_logprobs`, chunking over whole sequences: a sequence's weight depends
on that sequence alone, so it is known inside its chunk, where ``dz`` is formed in place and
``dx``, ``dW``, ``db`` follow (three matmuls, all in forward; backward only scales by
``grad_output``, with no host sync). The reference model goes through the same chunks first with
no gradient: one matmul and the stats pass per chunk, nothing stored but its ``B`` sums.

Vocabulary-parallel (``process_group``, or a DTensor head): each rank holds rows of the policy's
``W`` (and ``b``) and the same rows of the reference head; per chunk the per-token log-probs are
merged over the ranks (:mod:`kernels_lib._vocab_parallel`: the shards' log-sum-exps, the target's
logit from the rank that owns it), so the sums, the weights and the loss are the same on every
rank; each rank forms its own ``dz`` and keeps its ``dW``/``db`` slice, and ``dx`` is summed over
the ranks once.

Deterministic: the same inputs give bitwise the same loss and gradients run to run (no atomics;
fixed reduction orders).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from . import _validate as v
from . import _vocab_parallel as vp
from ._module import loss_module
from ._sequence_logprobs import (
    SequenceLossCall, SequenceLossResult, chunk_rows, fused_sequence_loss, reference_sums, sequence_logprobs,
    validate_reference, wanted_grads,
)
from ._vocab_parallel import VocabShard
from ._docs import shared_arguments


class KTOOutput(NamedTuple):
    """The KTO loss and what TRL logs beside it; all float32, only ``loss`` carries a gradient."""

    loss: torch.Tensor  #: the mean over the B examples, a scalar
    chosen_rewards: torch.Tensor  #: beta * r of the desirable examples, in batch order
    rejected_rewards: torch.Tensor  #: beta * r of the undesirable examples, in batch order
    chosen_logps: torch.Tensor  #: the policy's log-prob sums (averages) of the desirable examples
    rejected_logps: torch.Tensor  #: the same for the undesirable examples


@dataclasses.dataclass(frozen=True)
class _KTOOptions:
    """The non-tensor options of one call (the arguments of :func:`fused_linear_kto` of the same names), read by
    name. As the caller gave them until :meth:`resolved`, whose copy holds the real numbers as floats and which
    gradients are wanted; frozen, so the chunks read the options the call was checked with."""

    beta: float = 0.1
    ignore_index: int = -100
    average_log_prob: bool = False
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    chunk_size: int | None = None
    accurate: bool = False
    skip_ignored: bool = True
    needs: tuple[bool, bool, bool] = (False, False, False)  #: whether dx, dW, db are wanted

    def resolved(self, needs: tuple[bool, bool, bool]) -> "_KTOOptions":
        return dataclasses.replace(self, beta=float(self.beta), desirable_weight=float(self.desirable_weight),
                                   undesirable_weight=float(self.undesirable_weight), needs=needs)


def _sequence_logps(sums, counts, average: bool):
    return sums / counts if average else sums


def _reference_logps(target, counts, ref_x, ref_weight, ref_bias, ref_logps, opts: _KTOOptions, shard=None):
    """The reference log-probs ``(B,)``: given, or the reference head run without gradient."""
    if ref_logps is not None:
        return ref_logps.detach().to(torch.float32)
    sums = reference_sums(
        ref_x, ref_weight, ref_bias, target, ignore_index=opts.ignore_index, chunk_size=opts.chunk_size, shard=shard,
        skip_ignored=opts.skip_ignored,
    )
    return _sequence_logps(sums, counts, opts.average_log_prob)


class _KTOInputs(NamedTuple):
    """The call's non-differentiable inputs, by name."""

    target: torch.Tensor  #: (B, T) targets
    labels: torch.Tensor  #: (B,) bool, True for a desirable example
    kl: torch.Tensor  #: the detached KL estimate, a float32 device scalar
    ref: torch.Tensor  #: (B,) float32 reference log-probs (sums, or averages)
    counts: torch.Tensor  #: (B,) float32 valid tokens per sequence
    check: v.TargetCheck  #: the targets' check; its extra count (the True labels) sizes the split outputs
    shard: VocabShard | None  #: this rank's slice of a vocabulary-parallel head, or None


def _coefficients(inputs: _KTOInputs, opts: _KTOOptions, seqs: slice, sums, _sums2):
    """``∂L/∂log p`` of the chunk's sequences ``seqs`` from their sums (the module docstring's weight)."""
    beta, counts = opts.beta, inputs.counts[seqs]
    u = beta * (_sequence_logps(sums, counts, opts.average_log_prob) - inputs.ref[seqs] - inputs.kl)
    desirable = inputs.labels[seqs].to(torch.float32)
    # d loss_k / d r_k = beta * sigma(u) sigma(-u) * sign_weight_k / B.
    sign_weight = (opts.undesirable_weight - (opts.desirable_weight + opts.undesirable_weight) * desirable)
    w = beta * torch.sigmoid(u) * torch.sigmoid(-u) * sign_weight / inputs.labels.shape[0]
    return (w / counts if opts.average_log_prob else w), None


def _forward(x, weight, bias, inputs: _KTOInputs, opts: _KTOOptions) -> SequenceLossResult:
    """The forward of :class:`FusedSequenceLoss`: policy sums, per-sequence weights, gradients, loss."""
    beta, labels = opts.beta, inputs.labels
    n_seqs, seq_len = inputs.target.shape
    rows = x.reshape(-1, x.shape[-1])
    sums, _, grads = sequence_logprobs(
        rows, weight, bias, inputs.target.reshape(-1), seq_len=seq_len, ignore_index=opts.ignore_index,
        rows_per_chunk=chunk_rows(opts.chunk_size, seq_len, rows.shape[0], weight.shape[1]),
        coefficients=functools.partial(_coefficients, inputs, opts), needs=opts.needs, accurate=opts.accurate,
        shard=inputs.shard, skip_ignored=opts.skip_ignored,
    )
    logps = _sequence_logps(sums, inputs.counts, opts.average_log_prob)
    r = logps - inputs.ref
    u = beta * (r - inputs.kl)
    per_example = torch.where(
        labels, opts.desirable_weight * (1 - torch.sigmoid(u)), opts.undesirable_weight * (1 - torch.sigmoid(-u))
    )
    if grads is not None and grads[0] is not None:
        grads = (grads[0].view(x.shape), *grads[1:])
    # The outputs split by label, in batch order, without boolean indexing (a host sync): the desirable
    # examples' positions sort first, and the host knows how many there are.
    positions = torch.arange(n_seqs, device=labels.device)
    order = torch.argsort(torch.where(labels, positions, positions + n_seqs))
    n = inputs.check.extra_counts()[0]
    chosen, rejected = order[:n], order[n:]
    outputs = KTOOutput(loss=per_example.mean(), chosen_rewards=beta * r[chosen], rejected_rewards=beta * r[rejected],
                        chosen_logps=logps[chosen], rejected_logps=logps[rejected])
    return SequenceLossResult(outputs, grads)


def _validate(x, weight, target, labels, kl, bias, options: _KTOOptions) -> dict:
    """Check the policy's tensors and the options; returns the tensors by name (for the device check)."""
    v.require_linear_loss_inputs(x, weight, target, x_ndim=3)
    v.require_tensor("preference_labels", labels)
    if labels.dtype != torch.bool:
        raise TypeError(f"preference_labels must be a bool tensor (True = desirable); got {labels.dtype}")
    v.require_shape("preference_labels", labels, x.shape[:1], "(B,) with B = x.shape[0]")
    tensors = {"x": x, "weight": weight, "target": target, "preference_labels": labels}
    if bias is not None:
        v.require_bias("bias", bias, weight)
        tensors["bias"] = bias
    if isinstance(kl, torch.Tensor):
        if not kl.is_floating_point() or kl.numel() != 1:
            raise ValueError(
                f"kl must be None, a real number or a one-element floating tensor; got {kl.dtype} {tuple(kl.shape)}"
            )
        tensors["kl"] = kl
    elif kl is not None:
        v.require_real("kl", kl)
    _validate_options(options)
    return tensors


def _validate_options(options: _KTOOptions) -> None:
    v.require_real("beta", options.beta)
    v.require_int("ignore_index", options.ignore_index)
    v.require_bool("average_log_prob", options.average_log_prob)
    for name in ("desirable_weight", "undesirable_weight"):
        v.require_real(name, getattr(options, name))
    v.require_chunk_options(options.chunk_size, options.accurate)
    v.require_bool("skip_ignored", options.skip_ignored)


@shared_arguments
def fused_linear_kto(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    preference_labels: torch.Tensor,
    kl: torch.Tensor | float | None = None,
    *,
    bias: torch.Tensor | None = None,
    ref_x: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.1,
    ignore_index: int = -100,
    average_log_prob: bool = False,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    chunk_size: int | None = None,
    accurate: bool = False,
    skip_ignored: bool = True,
    process_group=None,
) -> KTOOutput:
    """KTO loss of the head ``x @ weight.T + bias`` against a reference (SPEC §2.4), never materializing logits.

    Args:
        x: ``(B, T, H)`` hidden states of the policy; float32, bfloat16 or float16. Gradients flow to it.
        weight: the policy head ``(V, H)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        target: ``(B, T)`` int64/int32 next-token ids aligned with ``x`` (no shift inside), each in
            ``[0, V)`` or ``ignore_index``; every sequence needs at least one valid token.
        preference_labels: ``(B,)`` bool, True for a desirable example. All-desirable and
            all-undesirable batches are fine (the other side's outputs are then empty).
        kl: the KL estimate, a real number or one-element tensor, detached (no gradient flows to
            it); None for 0 (TRL without ``calculate_KL``).
        bias: optional ``(V,)`` policy bias, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        ref_x, ref_weight, ref_bias: the reference model's hidden states ``(B, T, H_ref)``, head
            ``(V, H_ref)`` and optional bias ``(V,)`` (one dtype among them, any of the three; any
            inside ``torch.autocast``), run without gradient and without stored logits, on the same ``target``.
        ref_logps: instead of the reference model, its precomputed ``(B,)`` log-probs (sums, or
            averages with ``average_log_prob``); detached.
        beta: the temperature β (0.1 by default, as TRL).
        ignore_index: target value of positions that count nowhere.
        average_log_prob: average the log-probs over the valid tokens instead of summing them (TRL
            1.16 always sums; older TRL had this switch).
        desirable_weight, undesirable_weight: λ_D, λ_U.
        chunk_size: rows (tokens) per logits chunk, rounded down to whole sequences, at least one;
            None for the default (H / 2 rows, at least 1024).
        accurate: accumulate ``dW``/``db`` in float32 across chunks.
        skip_ignored: <shared>
        process_group: split the vocabulary over this ``torch.distributed`` group (or None with
            DTensor heads sharded ``(Shard(0),)`` over a 1-D mesh): ``weight`` ``(V_r, H)``, ``bias``,
            ``ref_weight`` ``(V_r, H_ref)`` and ``ref_bias`` are this rank's rows (the same rows of
            both heads), in group-rank order, of any sizes; ``x``, ``target`` (global ids), the
            labels, the reference inputs and the options are the same on every rank, and so are the
            outputs. ``dx`` comes back complete on every rank, ``dW``/``db`` as the local slices.
            Every option works. Wire: once per call an all_gather of 13 int64 per rank (the checks
            over the ranks); per chunk and row 3 float32 (the shards' lse max, sum-exp, the
            target's logit from its owner), for the policy and again for a reference head; once
            ``dx`` (``B·T × H``).

    Returns:
        :class:`KTOOutput`: the float32 loss (mean over the B examples) and the auxiliaries, which
        carry no gradient. NaN anywhere in the inputs gives a NaN loss (TRL's ``nanmean`` would skip
        that example).

    Raises:
        TypeError: a non-tensor, a wrong dtype (naming the argument), an option of the wrong type.
        ValueError: shapes that do not fit (labels not of length B, a reference of other shapes),
            tensors on different devices, targets out of range, a sequence with no valid target,
            both or neither of ``ref_logps`` and the reference model. With a process group: on every
            rank, as ``fused_linear_cross_entropy`` says.
    """
    options = _KTOOptions(beta, ignore_index, average_log_prob, desirable_weight, undesirable_weight, chunk_size, accurate,
                          skip_ignored)

    def check_arguments(heads):
        tensors = _validate(x, heads["weight"], target, preference_labels, kl, heads["bias"], options)
        tensors.update(validate_reference(x, target, heads["weight"], ref_x, heads["ref_weight"], heads["ref_bias"],
                                          ref_logps))
        v.require_same_device(tensors)

    heads, shard = vp.shard_heads(
        process_group, {"weight": weight, "bias": bias, "ref_weight": ref_weight, "ref_bias": ref_bias}, check_arguments,
        rows=lambda: x.shape[0] * x.shape[1], targets=lambda: {"target": target}, ignore_index=ignore_index,
        options=lambda: (options, bias is None, ref_logps is None, ref_bias is None, x.dtype,
                         wanted_grads(x, weight, bias)),
    )
    weight, bias = heads["weight"], heads["bias"]
    n_cols = weight.shape[0] if shard is None else shard.n_classes
    # With a process group every rank passed the check above on the same targets: this decides alike.
    check = v.check_targets(target, n_cols, ignore_index, sequences="every", extra=(preference_labels.sum(),))
    counts = check.counts
    ref = _reference_logps(target, counts, ref_x, heads["ref_weight"], heads["ref_bias"], ref_logps, options, shard)
    inputs = _KTOInputs(target, preference_labels, v.device_scalar(0.0 if kl is None else kl, x.device), ref, counts,
                        check, shard)
    opts = options.resolved(wanted_grads(x, weight, bias))
    out = fused_sequence_loss(x, weight, bias, SequenceLossCall(_forward, inputs, opts))
    check.raise_if_bad()  # the targets' checks, read now that the call's kernels are queued
    return out


FusedLinearKTOLoss = loss_module(
    fused_linear_kto, "FusedLinearKTOLoss", "``nn.Module`` form of :func:`fused_linear_kto`: the module holds the options only.",
    check=lambda **options: _validate_options(_KTOOptions(**options)),
)
