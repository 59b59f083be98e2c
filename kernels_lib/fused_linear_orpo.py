r"""Fused linear + ORPO (odds-ratio preference optimization) without the ``2n·T × V`` logits.

Rows ``0..n−1`` of ``x`` (``2n × T × H``) are the chosen responses, rows ``n..2n−1`` the rejected
ones (pair ``i`` is rows ``i`` and ``i+n``). With per-token log-probs
:math:`\log p_{kt} = \log\operatorname{softmax}(x_{kt}W^\top + b)_{y_{kt}}` over the ``N_k`` valid
tokens of sequence ``k``,

.. math::

    a_k = \frac1{N_k}\sum_t \log p_{kt}, \qquad
    \operatorname{log1mexp}(a) = \log(1 - e^a) =
        \begin{cases} \operatorname{log1p}(-e^a) & a < -\ln 2 \\ \log(-\operatorname{expm1}(a)) & \text{else,} \end{cases}

    o_i = (a_{c} - a_{r}) - (\operatorname{log1mexp} a_{c} - \operatorname{log1mexp} a_{r}),
    \qquad L_{OR} = -\frac{\beta}{n}\sum_i \log\sigma(o_i),

    \mathrm{NLL} = -\frac1{N'}\sum_{\text{chosen } k}\sum_t \log p'_{kt}, \qquad L = \mathrm{NLL} + L_{OR},

(:math:`c = i`, :math:`r = i + n`; the NLL runs over the :math:`N'` valid tokens of the chosen
half, under ``nll_target`` when given — TRL takes it over prompt and response — else ``target``).
log1mexp splits at :math:`-\ln 2` because :math:`1 - e^a` cancels for :math:`a \to 0^-` (use
expm1) and :math:`\log` of a value near 1 loses digits for :math:`a \ll 0` (use log1p).

Gradient
--------
:math:`\partial o / \partial a_c = 1/(1 - e^{a_c})` and :math:`\partial o / \partial a_r = -1/(1 - e^{a_r})`, so

.. math::

    \frac{\partial L}{\partial \log p_{ct}} = -\frac{\beta}{n N_c}\,\frac{\sigma(-o)}{1 - e^{a_c}} - \frac1{N'},
    \qquad
    \frac{\partial L}{\partial \log p_{rt}} = \frac{\beta}{n N_r}\,\frac{\sigma(-o)}{1 - e^{a_r}},

(the :math:`-1/N'` on the chosen tokens is the NLL's, on the second target's tokens when
``nll_target`` is given). The chosen factor is evaluated as
:math:`1/(1 - e^{a_c} + e^{a_c - a_r + \operatorname{log1mexp} a_r})`, the same value, which stays
finite when :math:`a_c` rounds to 0 (every chosen token certain: :math:`o = \infty`, where the
plain form gives 0·∞). These per-token weights times :math:`\mathrm{onehot}(y) - \mathrm{softmax}`
are ``dz``.

Vocabulary-parallel (``process_group``, or a DTensor head): each rank holds rows of ``W`` (and
``b``); the per-token log-probs are merged over the ranks chunk by chunk
(:mod:`kernels_lib._vocab_parallel`: the shards' log-sum-exps, the target's logit from the rank
that owns it), so the averages, the pair weights and the loss are the same on every rank, each
rank forms its own ``dz``, keeps its ``dW``/``db`` slice, and ``dx`` is summed over the ranks once.

Design
------
:mod:`kernels_lib._paired_logprobs` (the paired layer of :mod:`kernels_lib._sequence_logprobs`,
shared with DPO, CPO and SimPO; ORPO gives its derivative explicitly, in the stable form above):
chunks hold whole pairs, so a pair's two averages, hence its weights, are known inside the chunk
that holds both; ``dz`` is formed in place there and ``dx``, ``dW``, ``db`` follow: three matmuls
in all, done in forward (backward only scales by ``grad_output``, with no host sync). To make a
pair's rows contiguous, ``x`` is reordered once to chosen/rejected interleaved (a copy of ``x``, and
of ``dx`` back: ``2·2n·T·H`` elements, small next to the logits). Memory: one ``chunk × V`` logits buffer, plus ``dx``, ``dW``, ``db`` (``dW`` in
float32 while accumulating when ``accurate``).

Deterministic: the same inputs give bitwise the same loss and gradients run to run (no atomics;
fixed reduction orders).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _validate as v
from . import _vocab_parallel as vp
from ._module import loss_module
from ._paired_logprobs import paired_logprobs, validate_pairs
from ._sequence_logprobs import SequenceLossCall, SequenceLossResult, fused_sequence_loss, wanted_grads
from ._vocab_parallel import VocabShard
from ._docs import shared_arguments


class ORPOOutput(NamedTuple):
    """The ORPO loss and what TRL logs beside it; all float32, only ``loss`` carries a gradient."""

    loss: torch.Tensor  #: NLL + L_OR, a scalar
    chosen_logps: torch.Tensor  #: (n,) average log-probs of the chosen responses
    rejected_logps: torch.Tensor  #: (n,) average log-probs of the rejected responses
    chosen_rewards: torch.Tensor  #: (n,) beta * chosen_logps
    rejected_rewards: torch.Tensor  #: (n,) beta * rejected_logps
    log_odds_ratio: torch.Tensor  #: mean of logsigmoid(log_odds), a scalar
    log_odds_chosen: torch.Tensor  #: mean of log_odds, a scalar
    nll: torch.Tensor  #: the NLL term, a scalar


def log1mexp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(a))`` for ``a <= 0``: ``log1p(-exp a)`` below ``-ln 2``, ``log(-expm1 a)`` above."""
    return torch.where(a < -math.log(2), torch.log1p(-torch.exp(a)), torch.log(-torch.expm1(a)))


def log_odds(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``log(odds(chosen) / odds(rejected))`` with ``odds(a) = e^a / (1 - e^a)``."""
    return (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))


def _pair_weights(chosen, rejected, beta: float):
    """``(∂f/∂a_c, ∂f/∂a_r)`` of each pair's term ``f = -β logσ(o)`` (the module docstring; ``L_OR`` is their mean)."""
    o = log_odds(chosen, rejected)
    d_chosen = -beta / (-torch.expm1(chosen) + torch.exp(chosen - rejected + log1mexp(rejected)))
    d_rejected = beta * torch.sigmoid(-o) / -torch.expm1(rejected)
    return d_chosen, d_rejected


@dataclasses.dataclass(frozen=True)
class _ORPOOptions:
    """The non-tensor options of one call (the arguments of :func:`fused_linear_orpo` of the same names), read by
    name, ``beta`` a float; and which gradients are wanted. Frozen: the chunks read what was checked."""

    beta: float
    ignore_index: int
    chunk_size: int | None
    accurate: bool
    skip_ignored: bool
    needs: tuple[bool, bool, bool]  #: whether dx, dW, db are wanted


class _ORPOInputs(NamedTuple):
    """The call's non-differentiable inputs, by name."""

    target: torch.Tensor  #: (2n, T) targets
    nll_target: torch.Tensor | None  #: (2n, T) the NLL's targets, or None for ``target``
    counts: torch.Tensor  #: (2n,) float32 valid tokens per sequence
    shard: VocabShard | None  #: this rank's slice of a vocabulary-parallel head, or None


def _pair_grad(opts: _ORPOOptions, chosen, rejected, _pairs):
    """:func:`_pair_weights` at the call's ``beta``, as the paired pipeline calls it."""
    return _pair_weights(chosen, rejected, opts.beta)


def _forward(x, weight, bias, inputs: _ORPOInputs, opts: _ORPOOptions) -> SequenceLossResult:
    """The forward of :class:`FusedSequenceLoss`: sums chunk by chunk, weights, gradients, then the loss."""
    beta = opts.beta
    chosen, rejected, nll, grads = paired_logprobs(
        x, weight, bias, inputs.target, inputs.counts, pair_grad=functools.partial(_pair_grad, opts), average=True,
        nll_weight=1.0, nll_target=inputs.nll_target, ignore_index=opts.ignore_index, chunk_size=opts.chunk_size,
        accurate=opts.accurate, needs=opts.needs, shard=inputs.shard, skip_ignored=opts.skip_ignored,
    )
    o = log_odds(chosen, rejected)
    ratio = F.logsigmoid(o)
    outputs = ORPOOutput(
        loss=nll - beta * ratio.mean(), chosen_logps=chosen, rejected_logps=rejected, chosen_rewards=beta * chosen,
        rejected_rewards=beta * rejected, log_odds_ratio=ratio.mean(), log_odds_chosen=o.mean(), nll=nll,
    )
    return SequenceLossResult(outputs, grads)


def _validate(x, weight, target, bias, nll_target, beta, ignore_index, chunk_size, accurate, skip_ignored) -> None:
    tensors = validate_pairs(x, weight, target, bias, nll_target)
    v.require_same_device(tensors)
    _validate_options(beta, ignore_index, chunk_size, accurate, skip_ignored)


def _validate_options(beta, ignore_index, chunk_size, accurate, skip_ignored=True) -> None:
    v.require_real("beta", beta)
    v.require_int("ignore_index", ignore_index)
    v.require_chunk_options(chunk_size, accurate)
    v.require_bool("skip_ignored", skip_ignored)


@shared_arguments
def fused_linear_orpo(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    ignore_index: int = -100,
    nll_target: torch.Tensor | None = None,
    chunk_size: int | None = None,
    accurate: bool = False,
    skip_ignored: bool = True,
    process_group=None,
) -> ORPOOutput:
    """ORPO loss of the head ``x @ weight.T + bias`` (SPEC §2.3), never materializing the logits.

    Args:
        x: ``(2n, T, H)`` hidden states, the ``n`` chosen sequences then the ``n`` rejected ones
            (pair ``i`` = rows ``i`` and ``i+n``); float32, bfloat16 or float16. Gradients flow to it.
        weight: the head ``(V, H)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        target: ``(2n, T)`` int64/int32 next-token ids aligned with ``x`` (no shift inside), each in
            ``[0, V)`` or ``ignore_index``; every sequence needs at least one valid token.
        bias: optional ``(V,)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        beta: the weight of the odds-ratio term (TRL's default 0.1).
        ignore_index: target value of positions that count nowhere.
        nll_target: optional ``(2n, T)`` targets for the NLL term only (its chosen half is read),
            e.g. prompt and response where ``target`` masks the prompt; the NLL over it needs at
            least one valid token.
        chunk_size: rows (tokens) per logits chunk, rounded down to whole pairs (``2T`` rows), at
            least one pair; None for the default (H / 2 rows, at least 1024). The speed/memory dial.
        accurate: accumulate ``dW``/``db`` in float32 across chunks (see ``fused_linear_cross_entropy``).
        skip_ignored: <shared>
        process_group: <shared:paired_process_group>

    Returns:
        :class:`ORPOOutput`: the float32 ``loss`` (= TRL's ``policy_nll_loss - losses.mean()``) and
        the auxiliaries, which carry no gradient. NaN in ``x``/``weight``/``bias`` gives NaN.

    Raises:
        TypeError: a non-tensor, a wrong dtype (naming the argument), an option of the wrong type.
        ValueError: an odd batch, shapes that do not fit, tensors on different devices, targets out
            of range, a sequence with no valid target, an NLL with no valid token. With a process
            group: on every rank, as ``fused_linear_cross_entropy`` says.
    """
    def check_arguments(heads):
        _validate(x, heads["weight"], target, heads["bias"], nll_target, beta, ignore_index, chunk_size, accurate,
                  skip_ignored)

    def targets():
        named = {"target": target}
        return named if nll_target is None else {**named, "nll_target": nll_target[: x.shape[0] // 2]}

    heads, shard = vp.shard_heads(
        process_group, {"weight": weight, "bias": bias}, check_arguments, rows=lambda: x.shape[0] * x.shape[1],
        targets=targets, ignore_index=ignore_index,
        options=lambda: (beta, ignore_index, chunk_size, accurate, skip_ignored, bias is None, x.dtype,
                         wanted_grads(x, weight, bias)),
    )
    weight, bias = heads["weight"], heads["bias"]
    n_cols = weight.shape[0] if shard is None else shard.n_classes
    # With a process group every rank passed the check above on the same targets: these decide alike.
    checks = [v.check_targets(target, n_cols, ignore_index, sequences="every")]
    if nll_target is not None:
        checks.append(v.check_targets(nll_target[: x.shape[0] // 2], n_cols, ignore_index, "nll_target", sequences="any"))
    opts = _ORPOOptions(float(beta), ignore_index, chunk_size, accurate, skip_ignored, wanted_grads(x, weight, bias))
    inputs = _ORPOInputs(target, nll_target, checks[0].counts, shard)
    out = fused_sequence_loss(x, weight, bias, SequenceLossCall(_forward, inputs, opts))
    for check in checks:  # the targets' checks, read now that the call's kernels are queued
        check.raise_if_bad()
    return out


FusedLinearORPOLoss = loss_module(
    fused_linear_orpo, "FusedLinearORPOLoss",
    "``nn.Module`` form of :func:`fused_linear_orpo`: the module holds the options only; the head's ``weight`` and "
    "``bias`` stay with the model.",
    check=_validate_options,
)
