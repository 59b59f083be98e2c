r"""Fused linear + DPO (direct preference optimization) without the ``2n·T × V`` logits.

Rows ``0..n−1`` of ``x`` (``2n × T × H``) are the chosen responses, rows ``n..2n−1`` the rejected
ones (pair ``i`` is rows ``i`` and ``i+n``). With the policy's summed log-probs
:math:`\ell_k = \sum_t \log p_{kt}` over the ``N_k`` valid tokens of sequence ``k`` (averaged with
``average_log_prob``) and the reference model's :math:`\ell^{\text{ref}}_k` (the same, run without
gradient through the same chunks, or given as ``ref_logps``),

.. math::

    r_k = \ell_k - \ell^{\text{ref}}_k, \qquad s_k = \phi(r_k), \qquad
    \Delta_i = s_{c} - s_{r} \quad (c = i,\ r = i + n),

with :math:`\phi` the identity (``f_divergence_type="reverse_kl"``, standard DPO),
:math:`1 - e^{-r}` (``"forward_kl"``) or :math:`\log 2 + \log\sigma(r)` (``"js_divergence"``). The
loss is :math:`L = \sum_j w_j \frac1n \sum_i f^{(j)}_i` over the ``loss_type`` list (weights
``loss_weights``), e.g.

.. math::

    f^{\text{sigmoid}}_i = -\log\sigma(\beta\Delta_i), \qquad
    f^{\text{ipo}}_i = \Big(\frac{s_c}{N_c} - \frac{s_r}{N_r} - \frac1{2\beta}\Big)^2, \qquad
    f^{\text{hinge}}_i = \max(0, 1 - \beta\Delta_i),

    f^{\text{robust}}_i = \frac{-(1-\varepsilon)\log\sigma(\beta\Delta_i) + \varepsilon\log\sigma(-\beta\Delta_i)}{1 - 2\varepsilon},

and the other per-pair terms of TRL 1.16 (``exo_pair``, ``nca_pair``, ``bco_pair``, ``sppo_hard``,
``apo_zero``, ``apo_down``, ``discopop``, ``sigmoid_norm``), plus ``sft``: the NLL of the chosen
half (its per-token mean). This is TRL 1.16's ``DPOTrainer._compute_loss``
(``trl/trainer/dpo_trainer.py``; :func:`kernels_lib.reference.fused_linear_dpo` cites the lines) with
targets aligned to ``x``. Rewards are :math:`\beta r_k` (TRL's, whatever the loss type), margins
their pair differences, accuracies ``chosen_reward > rejected_reward``.

Not here: ``aot`` and ``aot_unpaired`` (they sort the log-ratios over the whole batch, so a pair's
gradient depends on every other pair: not formed chunk by chunk), ``f_divergence_type=
"alpha_divergence"``, WPO weighting (``use_weighting``) and ``ld_alpha``.

Gradient
--------
A pair's term depends on the policy only through :math:`\ell_c, \ell_r`, so a valid token of
sequence ``k`` has :math:`\partial L / \partial \log p_{kt} = \frac1n \partial f_i / \partial \ell_k`
(:math:`\times 1/N_k` with ``average_log_prob``), e.g. for ``sigmoid``
:math:`\mp \frac{\beta}{n}\,\sigma(-\beta\Delta_i)\,\phi'(r_k)` (− chosen, + rejected), for ``ipo``
:math:`\pm \frac{2}{n N_k}\big(\frac{s_c}{N_c} - \frac{s_r}{N_r} - \frac1{2\beta}\big)\phi'(r_k)`,
and :math:`-w_{\text{sft}}/N'` more on the chosen tokens for ``sft``. The pipeline takes
:math:`\partial f_i / \partial \ell` by autograd of the very per-pair formula below on the chunk's
``n_c`` pair values (:func:`kernels_lib._paired_logprobs.autograd_pair_grad`); times
:math:`\mathrm{onehot}(y) - \mathrm{softmax}` it is ``dz``.

Design
------
:mod:`kernels_lib._paired_logprobs`, as ORPO: chunks hold whole pairs, ``dz`` is formed in place
and ``dx``, ``dW``, ``db`` follow in forward (three matmuls; backward only scales by
``grad_output``). The reference model goes first, through chunks of whole sequences, with no
gradient (one matmul and the stats pass per chunk; nothing kept but its ``2n`` sums). Memory: one
``chunk × V`` logits buffer, a copy of ``x`` reordered to pairs, and the gradients.

Vocabulary-parallel (``process_group``, or DTensor heads): each rank holds rows of the policy's
``W`` (and ``b``) and the same rows of a reference head; per chunk the per-token log-probs are
merged over the ranks (:mod:`kernels_lib._vocab_parallel`), so the pair values, the weights and the
loss are the same on every rank; each rank keeps its ``dW``/``db`` slice and ``dx`` is summed over
the ranks once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _validate as v
from ._module import loss_module
from ._paired_logprobs import autograd_pair_grad, paired_logprobs, validate_pairs
from . import _vocab_parallel as vp
from ._sequence_logprobs import (
    SequenceLossCall, SequenceLossResult, fused_sequence_loss, reference_sums, validate_reference, wanted_grads,
)
from ._docs import shared_arguments
from ._vocab_parallel import VocabShard

#: The per-pair loss types of TRL 1.16's DPOTrainer that are formed here (``sft``: the chosen NLL).
LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero",
    "apo_down", "discopop", "sft", "sigmoid_norm",
)
#: Loss types of TRL 1.16 not formed here, and why.
UNSUPPORTED_LOSS_TYPES = {
    "aot": "it sorts the log-ratios over the whole batch, so a pair's gradient depends on every other pair",
    "aot_unpaired": "it sorts the log-ratios over the whole batch, so a pair's gradient depends on every other pair",
}
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence")
#: The loss types TRL 1.16 allows with an f-divergence other than reverse KL (dpo_trainer.py line 810).
F_DIVERGENCE_LOSS_TYPES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
#: The loss types that read ``label_smoothing`` (TRL 1.16 also reads it in ``aot``).
SMOOTHED_LOSS_TYPES = ("robust", "exo_pair")
#: The loss types that divide the scores by the completion length themselves.
LENGTH_NORMALIZED_LOSS_TYPES = ("ipo", "sigmoid_norm")


class DPOOutput(NamedTuple):
    """The DPO loss and what TRL logs beside it (per pair, TRL logs their means); all float32, only
    ``loss`` carries a gradient."""

    loss: torch.Tensor  #: the weighted sum of the loss types' means, a scalar
    chosen_logps: torch.Tensor  #: (n,) policy log-prob sums (averages) of the chosen responses
    rejected_logps: torch.Tensor  #: (n,) the same for the rejected responses
    chosen_rewards: torch.Tensor  #: (n,) beta * (chosen_logps - ref chosen log-probs)
    rejected_rewards: torch.Tensor  #: (n,) beta * (rejected_logps - ref rejected log-probs)
    reward_margins: torch.Tensor  #: (n,) chosen_rewards - rejected_rewards
    reward_accuracies: torch.Tensor  #: (n,) 1.0 where chosen_rewards > rejected_rewards, else 0.0


class _Options(NamedTuple):
    """The checked options of one call (:func:`_options`), read by name: the pair loss's, then the pipeline's."""

    beta: float
    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    label_smoothing: float
    discopop_tau: float
    f_divergence_type: str
    ignore_index: int = -100
    average_log_prob: bool = False
    chunk_size: int | None = None
    accurate: bool = False
    skip_ignored: bool = True
    needs: tuple[bool, bool, bool] = (False, False, False)  #: whether dx, dW, db are wanted


def _scores(logratios: torch.Tensor, f_divergence_type: str) -> torch.Tensor:
    """φ(r): the f-divergence's reparameterized reward (TRL 1.16 dpo_trainer.py lines 1353–1363)."""
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    return logratios


def dpo_pair_losses(chosen_logratios, rejected_logratios, chosen_counts, rejected_counts, opts: _Options) -> torch.Tensor:
    """``Σ_j w_j f^(j)_i`` per pair over the loss types other than ``sft`` (module docstring), float32 ``(n,)``.

    ``*_logratios``: policy minus reference values; ``*_counts``: valid tokens (for ``ipo`` and
    ``sigmoid_norm``, which divide the scores by the completion length as TRL does).
    """
    beta, eps = opts.beta, opts.label_smoothing
    chosen_scores = _scores(chosen_logratios, opts.f_divergence_type)
    rejected_scores = _scores(rejected_logratios, opts.f_divergence_type)
    delta = chosen_scores - rejected_scores
    total = torch.zeros_like(delta)
    for loss_type, loss_weight in zip(opts.loss_types, opts.loss_weights):
        if loss_type == "sigmoid":
            term = -F.logsigmoid(beta * delta)
        elif loss_type == "hinge":
            term = torch.relu(1 - beta * delta)
        elif loss_type == "ipo":
            term = (chosen_scores / chosen_counts - rejected_scores / rejected_counts - 1 / (2 * beta)) ** 2
        elif loss_type == "exo_pair":
            term = torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - math.log1p(-eps)) + torch.sigmoid(
                -beta * delta
            ) * (F.logsigmoid(-beta * delta) - math.log(eps))
        elif loss_type == "nca_pair":
            chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
            term = -F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards) - 0.5 * F.logsigmoid(-rejected_rewards)
        elif loss_type == "robust":
            term = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        elif loss_type == "bco_pair":
            term = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        elif loss_type == "sppo_hard":
            term = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif loss_type == "apo_zero":
            term = 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)
        elif loss_type == "apo_down":
            term = torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
        elif loss_type == "discopop":
            logits = beta * delta
            modulation = torch.sigmoid(logits / opts.discopop_tau)
            term = -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
        elif loss_type == "sigmoid_norm":
            term = -F.logsigmoid(beta * (chosen_scores / chosen_counts - rejected_scores / rejected_counts))
        else:  # "sft": the NLL term, outside the per-pair terms
            continue
        total = total + loss_weight * term
    return total


class _Inputs(NamedTuple):
    """The call's non-differentiable inputs, by name."""

    target: torch.Tensor  #: (2n, T) targets
    counts: torch.Tensor  #: (2n,) float32 valid tokens per sequence
    ref: torch.Tensor  #: (2n,) float32 reference log-probs (sums, or averages), chosen then rejected
    shard: VocabShard | None  #: this rank's slice of a vocabulary-parallel head, or None


def _pair_loss(inputs: _Inputs, opts: _Options, chosen, rejected, pairs: slice) -> torch.Tensor:
    """:func:`dpo_pair_losses` of the pairs ``pairs`` from the policy's values, against the reference's."""
    n = inputs.ref.shape[0] // 2
    ref, counts = inputs.ref.view(2, n), inputs.counts.view(2, n)
    return dpo_pair_losses(chosen - ref[0, pairs], rejected - ref[1, pairs], counts[0, pairs], counts[1, pairs], opts)


def _forward(x, weight, bias, inputs: _Inputs, opts: _Options) -> SequenceLossResult:
    """The forward of :class:`FusedSequenceLoss`: policy values and gradients by pairs, then the loss."""
    n = x.shape[0] // 2
    pair_loss = functools.partial(_pair_loss, inputs, opts)
    sft_weight = sum(w for t, w in zip(opts.loss_types, opts.loss_weights) if t == "sft")
    chosen, rejected, nll, grads = paired_logprobs(
        x, weight, bias, inputs.target, inputs.counts, pair_grad=autograd_pair_grad(pair_loss),
        average=opts.average_log_prob, nll_weight=sft_weight, nll_target=None, ignore_index=opts.ignore_index,
        chunk_size=opts.chunk_size, accurate=opts.accurate, needs=opts.needs, shard=inputs.shard,
        skip_ignored=opts.skip_ignored,
    )
    loss = pair_loss(chosen, rejected, slice(None)).mean()
    if nll is not None:
        loss = loss + sft_weight * nll
    chosen_rewards, rejected_rewards = opts.beta * (chosen - inputs.ref[:n]), opts.beta * (rejected - inputs.ref[n:])
    outputs = DPOOutput(
        loss=loss, chosen_logps=chosen, rejected_logps=rejected, chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards, reward_margins=chosen_rewards - rejected_rewards,
        reward_accuracies=(chosen_rewards > rejected_rewards).to(torch.float32),
    )
    return SequenceLossResult(outputs, grads)


def _loss_types(loss_type, loss_weights) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """``loss_type`` (a name or a sequence of names) and ``loss_weights`` (None: all 1), checked."""
    types = (loss_type,) if isinstance(loss_type, str) else loss_type
    if not isinstance(types, Sequence) or not types or not all(isinstance(t, str) for t in types):
        raise TypeError(f"loss_type must be a str or a non-empty list of str; got {loss_type!r}")
    for name in types:
        if name in UNSUPPORTED_LOSS_TYPES:
            raise ValueError(f"loss_type {name!r} is not supported by fused_linear_dpo: {UNSUPPORTED_LOSS_TYPES[name]}")
        v.require_choice("loss_type", name, LOSS_TYPES)
    if loss_weights is None:
        return tuple(types), (1.0,) * len(types)
    if isinstance(loss_weights, (str, bytes)) or not isinstance(loss_weights, Sequence) or len(loss_weights) != len(types):
        raise ValueError(
            f"loss_weights must be None or a list of {len(types)} number(s), one per loss_type; got {loss_weights!r}"
        )
    for weight in loss_weights:
        v.require_real("loss_weights", weight)
    return tuple(types), tuple(float(w) for w in loss_weights)


def _options(beta, loss_type, loss_weights, label_smoothing, discopop_tau, f_divergence_type, ignore_index,
             average_log_prob, chunk_size, accurate, skip_ignored=True) -> _Options:
    """Check every option (the function's and the module's); returns the loss's."""
    v.require_real("beta", beta)
    if beta <= 0:
        raise ValueError(f"beta must be > 0; got {beta!r}")
    types, weights = _loss_types(loss_type, loss_weights)
    v.require_real("label_smoothing", label_smoothing)
    smoothed = [t for t in types if t in SMOOTHED_LOSS_TYPES]
    if label_smoothing != 0 and not smoothed:
        raise ValueError(
            f"label_smoothing={label_smoothing!r} is read only by loss_type 'robust' and 'exo_pair'; TRL 1.16's "
            f"DPOTrainer ignores it for {', '.join(map(repr, types))} (its 'sigmoid' has no smoothing): use 0.0"
        )
    if "robust" in types and not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) for loss_type 'robust'; got {label_smoothing!r}")
    if "exo_pair" in types and not 0 < label_smoothing < 1:
        raise ValueError(f"label_smoothing must be in (0, 1) for loss_type 'exo_pair' (the EXO paper: 1e-3); got {label_smoothing!r}")
    v.require_real("discopop_tau", discopop_tau)
    if discopop_tau <= 0:
        raise ValueError(f"discopop_tau must be > 0; got {discopop_tau!r}")
    if f_divergence_type == "alpha_divergence":
        raise ValueError("f_divergence_type 'alpha_divergence' is not supported by fused_linear_dpo")
    v.require_choice("f_divergence_type", f_divergence_type, F_DIVERGENCES)
    if f_divergence_type != "reverse_kl" and not set(types) <= set(F_DIVERGENCE_LOSS_TYPES):
        raise ValueError(
            f"f_divergence_type {f_divergence_type!r} goes only with loss_type among {', '.join(F_DIVERGENCE_LOSS_TYPES)}"
            f" (as in TRL 1.16); got {', '.join(types)}"
        )
    v.require_int("ignore_index", ignore_index)
    v.require_bool("average_log_prob", average_log_prob)
    normalized = [t for t in types if t in LENGTH_NORMALIZED_LOSS_TYPES]
    if average_log_prob and normalized:
        raise ValueError(
            f"average_log_prob=True with loss_type {normalized[0]!r}, which divides by the completion length itself:"
            " the length would count twice"
        )
    v.require_chunk_options(chunk_size, accurate)
    v.require_bool("skip_ignored", skip_ignored)
    return _Options(float(beta), types, weights, float(label_smoothing), float(discopop_tau), f_divergence_type,
                    ignore_index, average_log_prob, chunk_size, accurate, skip_ignored)


@shared_arguments
def fused_linear_dpo(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_x: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    ignore_index: int = -100,
    average_log_prob: bool = False,
    chunk_size: int | None = None,
    accurate: bool = False,
    skip_ignored: bool = True,
    process_group=None,
) -> DPOOutput:
    """DPO loss of the head ``x @ weight.T + bias`` against a reference, never materializing the logits.

    Args:
        x: ``(2n, T, H)`` hidden states, the ``n`` chosen sequences then the ``n`` rejected ones
            (pair ``i`` = rows ``i`` and ``i+n``); float32, bfloat16 or float16. Gradients flow to it.
        weight: the policy head ``(V, H)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        target: ``(2n, T)`` int64/int32 next-token ids aligned with ``x`` (no shift inside), each in
            ``[0, V)`` or ``ignore_index`` (TRL's completion mask: the prompt and padding are
            ignored); every sequence needs at least one valid token.
        bias: optional ``(V,)`` policy bias, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        ref_x, ref_weight, ref_bias: the reference model's hidden states ``(2n, T, H_ref)``, head
            ``(V, H_ref)`` and optional bias (one dtype among them, any inside ``torch.autocast``), run
            without gradient and without stored logits, on the same ``target``.
        ref_logps: instead of the reference model, its precomputed ``(2n,)`` log-probs, chosen then
            rejected (TRL's ``ref_chosen_logps`` and ``ref_rejected_logps`` concatenated; sums, or
            averages with ``average_log_prob``); detached.
        beta: β > 0 (TRL's default 0.1; for ``ipo`` the τ of the paper).
        loss_type: one of :data:`LOSS_TYPES` or a list of them (TRL's ``loss_type`` list), summed
            with ``loss_weights`` (None: all 1).
        label_smoothing: ε of ``robust`` ([0, 0.5)) and ``exo_pair`` ((0, 1)); must be 0 otherwise
            (TRL 1.16 ignores it there, its ``sigmoid`` included: the conservative-DPO smoothing of
            older TRL is gone).
        discopop_tau: τ of ``discopop`` (TRL's default 0.05).
        f_divergence_type: ``"reverse_kl"`` (standard DPO), ``"forward_kl"`` or ``"js_divergence"``
            (only with the loss types TRL allows them with).
        ignore_index: target value of positions that count nowhere.
        average_log_prob: average the log-probs over the valid tokens instead of summing them (TRL
            1.16 sums; not with ``ipo``/``sigmoid_norm``, which divide by the length themselves).
        chunk_size: rows (tokens) per logits chunk, rounded down to whole pairs (``2T`` rows), at
            least one pair; None for the default (H / 2 rows, at least 1024).
        accurate: accumulate ``dW``/``db`` in float32 across chunks.
        skip_ignored: <shared>
        process_group: split the vocabulary over this ``torch.distributed`` group (or None with
            DTensor heads sharded ``(Shard(0),)`` over a 1-D mesh): ``weight`` ``(V_r, H)``, ``bias``,
            ``ref_weight`` ``(V_r, H_ref)`` and ``ref_bias`` are this rank's rows (the same rows of
            both heads), in group-rank order, of any sizes; ``x``, ``target`` (global ids), the
            reference inputs and the options are the same on every rank, and so are the outputs.
            ``dx`` comes back complete on every rank, ``dW``/``db`` as the local slices. Every option
            works. Wire: once per call an all_gather of 13 int64 per rank (the checks over the
            ranks); per chunk and row 3 float32 (the shards' lse max, sum-exp, the target's logit
            from its owner), for the policy and again for a reference head; once ``dx`` (``2n·T × H``).

    Returns:
        :class:`DPOOutput`: the float32 loss and the per-pair auxiliaries, which carry no gradient.
        NaN in any input gives a NaN loss.

    Raises:
        TypeError: a non-tensor, a wrong dtype (naming the argument), an option of the wrong type.
        ValueError: an odd batch, shapes that do not fit, tensors on different devices, targets out
            of range, a sequence with no valid target, both or neither of ``ref_logps`` and the
            reference model, an unknown or unsupported loss type, an option out of its range or
            one the loss type does not read. With a process group: on every rank, as
            ``fused_linear_cross_entropy`` says.
    """
    opts = _options(beta, loss_type, loss_weights, label_smoothing, discopop_tau, f_divergence_type, ignore_index,
                    average_log_prob, chunk_size, accurate, skip_ignored)

    def check_arguments(heads):
        tensors = validate_pairs(x, heads["weight"], target, heads["bias"])
        tensors.update(validate_reference(x, target, heads["weight"], ref_x, heads["ref_weight"], heads["ref_bias"],
                                          ref_logps, batch="2n"))
        v.require_same_device(tensors)

    heads, shard = vp.shard_heads(
        process_group, {"weight": weight, "bias": bias, "ref_weight": ref_weight, "ref_bias": ref_bias}, check_arguments,
        rows=lambda: x.shape[0] * x.shape[1], targets=lambda: {"target": target}, ignore_index=ignore_index,
        options=lambda: (opts, bias is None, ref_logps is None, ref_bias is None, x.dtype, wanted_grads(x, weight, bias)),
    )
    weight, bias = heads["weight"], heads["bias"]
    n_cols = weight.shape[0] if shard is None else shard.n_classes
    # With a process group every rank passed the check above on the same targets: this decides alike.
    check = v.check_targets(target, n_cols, ignore_index, sequences="every")
    counts = check.counts
    if ref_logps is not None:
        ref = ref_logps.detach().to(torch.float32)
    else:
        ref = reference_sums(ref_x, heads["ref_weight"], heads["ref_bias"], target, ignore_index=ignore_index,
                             chunk_size=chunk_size, shard=shard, skip_ignored=skip_ignored)
        ref = ref / counts if average_log_prob else ref
    opts = opts._replace(needs=wanted_grads(x, weight, bias))
    out = fused_sequence_loss(x, weight, bias, SequenceLossCall(_forward, _Inputs(target, counts, ref, shard), opts))
    check.raise_if_bad()  # the targets' checks, read now that the call's kernels are queued
    return out


FusedLinearDPOLoss = loss_module(
    fused_linear_dpo, "FusedLinearDPOLoss",
    "``nn.Module`` form of :func:`fused_linear_dpo`: the module holds the options only (checked at construction).",
    check=_options,
)
