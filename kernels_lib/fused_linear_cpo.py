r"""Fused linear + CPO (contrastive preference optimization) and SimPO, without the ``2n·T × V`` logits.

Rows ``0..n−1`` of ``x`` (``2n × T × H``) are the chosen responses, rows ``n..2n−1`` the rejected
ones (pair ``i`` is rows ``i`` and ``i+n``). No reference model. With the policy's log-probs of
sequence ``k``, **summed** over its ``N_k`` valid tokens for ``sigmoid`` and ``hinge``, **averaged**
for ``ipo`` and ``simpo`` (TRL's ``average_log_prob=self.loss_type in ["ipo", "simpo"]``),

.. math::

    \ell_k = \sum_t \log p_{kt}\ \Big(\text{or } \tfrac1{N_k}\textstyle\sum_t\Big), \qquad
    u_k = \begin{cases} \ell_k & \alpha = 0 \\ (1 - e^{-\alpha \ell_k}) / \alpha & \text{AlphaPO} \end{cases},
    \qquad \Delta_i = u_c - u_r,

    f^{\text{sigmoid}}_i = -(1-\varepsilon)\log\sigma(\beta\Delta_i) - \varepsilon\log\sigma(-\beta\Delta_i),
    \qquad f^{\text{simpo}}_i = f^{\text{sigmoid}}\Big|_{\Delta_i \to \Delta_i - \gamma/\beta},

    f^{\text{hinge}}_i = \max(0, 1 - \beta\Delta_i), \qquad f^{\text{ipo}}_i = \big(\Delta_i - \tfrac1{2\beta}\big)^2,

    L = \frac1n \sum_i f_i + \alpha_{\text{CPO}}\,\mathrm{NLL}, \qquad
    \mathrm{NLL} = -\frac1{N'}\sum_{\text{chosen } k}\sum_t \log p'_{kt},

(:math:`c = i`, :math:`r = i + n`; the behaviour-cloning NLL runs over the :math:`N'` valid tokens
of the chosen half, under ``nll_target`` when given, else ``target``; ``cpo_alpha = 0`` leaves it
out and reports 0, as TRL does). SimPO (:func:`fused_linear_simpo`) is ``loss_type="simpo"``: the
length-normalized (averaged) log-probs with the target margin γ (``simpo_gamma``); with
``cpo_alpha = 0`` it is the paper's SimPO, with the default 1 TRL's CPO-SimPO. AlphaPO
(``alpha ≠ 0``) is evaluated as :math:`-\operatorname{expm1}(-\alpha\ell)/\alpha`, TRL's
:math:`(1 - (e^{\ell})^{-\alpha})/\alpha` without the overflow of :math:`e^{\ell}` to 0 for very
negative sums. Rewards are :math:`\beta u_k`. This is TRL 1.16's ``CPOTrainer``
(``trl/experimental/cpo/cpo_trainer.py``; :func:`kernels_lib.reference.fused_linear_cpo` cites the
lines) with targets aligned to ``x`` (its ``is_encoder_decoder`` path: no shift).

Gradient
--------
:math:`\partial L / \partial \log p_{kt} = \frac1n\,\partial f_i / \partial \ell_k` (:math:`\times 1/N_k`
for averages) :math:`- \alpha_{\text{CPO}}/N'` on the chosen tokens; for ``sigmoid``
:math:`\partial f_i / \partial \ell_c = -\beta u'_c\,[(1-\varepsilon)\sigma(-\beta\Delta_i) - \varepsilon\sigma(\beta\Delta_i)]`
and the opposite sign for :math:`\ell_r` (:math:`u' = e^{-\alpha\ell}`, 1 without AlphaPO). The
pipeline takes :math:`\partial f_i / \partial \ell` by autograd of the very per-pair formula
(:func:`kernels_lib._paired_logprobs.autograd_pair_grad`); times :math:`\mathrm{onehot}(y) - \mathrm{softmax}` it is ``dz``.

Design
------
:mod:`kernels_lib._paired_logprobs`, as ORPO: chunks hold whole pairs, ``dz`` is formed in place and
``dx``, ``dW``, ``db`` follow in forward (three matmuls; backward only scales by ``grad_output``).
Memory: one ``chunk × V`` logits buffer, a copy of ``x`` reordered to pairs, and the gradients.

Vocabulary-parallel (``process_group``, or a DTensor head): each rank holds rows of ``W`` (and
``b``); per chunk the per-token log-probs are merged over the ranks (:mod:`kernels_lib._vocab_parallel`),
so the pair values, the weights and the loss are the same on every rank; each rank keeps its
``dW``/``db`` slice and ``dx`` is summed over the ranks once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _validate as v
from ._module import loss_module
from ._paired_logprobs import autograd_pair_grad, paired_logprobs, validate_pairs
from . import _vocab_parallel as vp
from ._sequence_logprobs import SequenceLossCall, SequenceLossResult, fused_sequence_loss, wanted_grads
from ._vocab_parallel import VocabShard
from ._docs import shared_arguments

#: TRL 1.16's CPO loss types (its config's ``"alphapo"`` is ``"simpo"`` with ``cpo_alpha = 0`` and ``alpha``).
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
#: The loss types on averaged log-probs (the others sum).
AVERAGED_LOSS_TYPES = ("ipo", "simpo")


class CPOOutput(NamedTuple):
    """The CPO (or SimPO) loss and what TRL logs beside it (per pair; TRL logs their means); all
    float32, only ``loss`` carries a gradient."""

    loss: torch.Tensor  #: mean of the pair terms + cpo_alpha * nll, a scalar
    chosen_logps: torch.Tensor  #: (n,) log-prob sums (averages for ipo and simpo) of the chosen responses
    rejected_logps: torch.Tensor  #: (n,) the same for the rejected responses
    chosen_rewards: torch.Tensor  #: (n,) beta * chosen_logps (AlphaPO: beta * its transformed reward)
    rejected_rewards: torch.Tensor  #: (n,) the same for the rejected responses
    reward_margins: torch.Tensor  #: (n,) chosen_rewards - rejected_rewards
    reward_accuracies: torch.Tensor  #: (n,) 1.0 where chosen_rewards > rejected_rewards, else 0.0
    nll: torch.Tensor  #: the NLL of the chosen half, a scalar (0 when cpo_alpha = 0, as TRL)


class _Options(NamedTuple):
    """The checked options of one call (:func:`_options`), read by name: the pair loss's, then the pipeline's."""

    beta: float
    loss_type: str
    label_smoothing: float
    simpo_gamma: float
    alpha: float
    cpo_alpha: float = 0.0
    ignore_index: int = -100
    chunk_size: int | None = None
    accurate: bool = False
    skip_ignored: bool = True
    needs: tuple[bool, bool, bool] = (False, False, False)  #: whether dx, dW, db are wanted


def _rewards(logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """``u``: the log-probs, or AlphaPO's ``(1 - p^-α)/α = -expm1(-α·logp)/α``."""
    return logps if alpha == 0 else -torch.expm1(-alpha * logps) / alpha


def cpo_pair_losses(chosen: torch.Tensor, rejected: torch.Tensor, opts: _Options) -> torch.Tensor:
    """The per-pair term ``f_i`` (module docstring), float32 ``(n,)``."""
    beta, eps = opts.beta, opts.label_smoothing
    logits = _rewards(chosen, opts.alpha) - _rewards(rejected, opts.alpha)
    if opts.loss_type == "simpo":
        logits = logits - opts.simpo_gamma / beta
    if opts.loss_type in ("sigmoid", "simpo"):
        return -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    if opts.loss_type == "hinge":
        return torch.relu(1 - beta * logits)
    return (logits - 1 / (2 * beta)) ** 2  # ipo


class _Inputs(NamedTuple):
    """The call's non-differentiable inputs, by name."""

    target: torch.Tensor  #: (2n, T) targets
    nll_target: torch.Tensor | None  #: (2n, T) the NLL's targets, or None for ``target``
    counts: torch.Tensor  #: (2n,) float32 valid tokens per sequence
    shard: VocabShard | None  #: this rank's slice of a vocabulary-parallel head, or None


def _pair_loss(opts: _Options, chosen, rejected, _pairs) -> torch.Tensor:
    """:func:`cpo_pair_losses` as the paired pipeline calls it."""
    return cpo_pair_losses(chosen, rejected, opts)


def _forward(x, weight, bias, inputs: _Inputs, opts: _Options) -> SequenceLossResult:
    """The forward of :class:`FusedSequenceLoss`: values and gradients by pairs, then the loss."""
    cpo_alpha = opts.cpo_alpha
    chosen, rejected, nll, grads = paired_logprobs(
        x, weight, bias, inputs.target, inputs.counts, pair_grad=autograd_pair_grad(functools.partial(_pair_loss, opts)),
        average=opts.loss_type in AVERAGED_LOSS_TYPES, nll_weight=cpo_alpha, nll_target=inputs.nll_target,
        ignore_index=opts.ignore_index, chunk_size=opts.chunk_size, accurate=opts.accurate, needs=opts.needs,
        skip_ignored=opts.skip_ignored,
        shard=inputs.shard,
    )
    loss = cpo_pair_losses(chosen, rejected, opts).mean()
    if nll is None:
        nll = torch.zeros((), dtype=torch.float32, device=x.device)
    else:
        loss = loss + cpo_alpha * nll
    chosen_rewards, rejected_rewards = opts.beta * _rewards(chosen, opts.alpha), opts.beta * _rewards(rejected, opts.alpha)
    outputs = CPOOutput(
        loss=loss, chosen_logps=chosen, rejected_logps=rejected, chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards, reward_margins=chosen_rewards - rejected_rewards,
        reward_accuracies=(chosen_rewards > rejected_rewards).to(torch.float32), nll=nll,
    )
    return SequenceLossResult(outputs, grads)


def _options(beta, loss_type, label_smoothing, cpo_alpha, simpo_gamma, alpha, ignore_index, chunk_size, accurate,
             skip_ignored=True) -> _Options:
    """Check every option (the functions' and the modules'); returns the loss's."""
    v.require_real("beta", beta)
    if beta <= 0:
        raise ValueError(f"beta must be > 0; got {beta!r}")
    if loss_type == "alphapo":
        raise ValueError(
            "loss_type 'alphapo' is TRL's shorthand for loss_type='simpo' with cpo_alpha=0.0 and alpha != 0: give those"
        )
    v.require_choice("loss_type", loss_type, LOSS_TYPES)
    v.require_probability("label_smoothing", label_smoothing)
    if label_smoothing != 0 and loss_type in ("hinge", "ipo"):
        raise ValueError(
            f"label_smoothing={label_smoothing!r} is read only by loss_type 'sigmoid' and 'simpo'; TRL 1.16's CPOTrainer"
            f" ignores it for {loss_type!r} (with a warning): use 0.0"
        )
    for name, value in (("cpo_alpha", cpo_alpha), ("simpo_gamma", simpo_gamma), ("alpha", alpha)):
        v.require_real(name, value)
    v.require_int("ignore_index", ignore_index)
    v.require_chunk_options(chunk_size, accurate)
    v.require_bool("skip_ignored", skip_ignored)
    return _Options(float(beta), loss_type, float(label_smoothing), float(simpo_gamma), float(alpha), float(cpo_alpha),
                    ignore_index, chunk_size, accurate, skip_ignored)


@shared_arguments
def fused_linear_cpo(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    ignore_index: int = -100,
    nll_target: torch.Tensor | None = None,
    chunk_size: int | None = None,
    accurate: bool = False,
    skip_ignored: bool = True,
    process_group=None,
) -> CPOOutput:
    """CPO loss of the head ``x @ weight.T + bias``, never materializing the logits (TRL 1.16's ``CPOTrainer``).

    Args:
        x: ``(2n, T, H)`` hidden states, the ``n`` chosen sequences then the ``n`` rejected ones
            (pair ``i`` = rows ``i`` and ``i+n``); float32, bfloat16 or float16. Gradients flow to it.
        weight: the head ``(V, H)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        target: ``(2n, T)`` int64/int32 next-token ids aligned with ``x`` (no shift inside), each in
            ``[0, V)`` or ``ignore_index``; every sequence needs at least one valid token.
        bias: optional ``(V,)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        beta: β > 0 (TRL's default 0.1).
        loss_type: ``"sigmoid"`` (CPO), ``"hinge"``, ``"ipo"`` or ``"simpo"``; ``ipo`` and ``simpo``
            average the log-probs over the valid tokens, the others sum them (as TRL).
        label_smoothing: ε in [0, 1] of ``sigmoid`` and ``simpo`` (conservative); must be 0 for
            ``hinge`` and ``ipo`` (TRL ignores it there, with a warning).
        cpo_alpha: weight of the chosen half's NLL (TRL's default 1.0); 0 leaves it out.
        simpo_gamma: SimPO's target margin γ (``simpo`` only; TRL's default 0.5).
        alpha: AlphaPO's reward shape (0: the log-probs themselves).
        ignore_index: target value of positions that count nowhere.
        nll_target: optional ``(2n, T)`` targets for the NLL term only (its chosen half is read);
            the NLL over it needs at least one valid token.
        chunk_size: rows (tokens) per logits chunk, rounded down to whole pairs (``2T`` rows), at
            least one pair; None for the default (H / 2 rows, at least 1024).
        accurate: accumulate ``dW``/``db`` in float32 across chunks.
        skip_ignored: <shared>
        process_group: <shared:paired_process_group>

    Returns:
        :class:`CPOOutput`: the float32 loss (TRL's ``losses.mean() + cpo_alpha * policy_nll_loss``)
        and the per-pair auxiliaries, which carry no gradient. NaN in ``x``/``weight``/``bias`` gives NaN.

    Raises:
        TypeError: a non-tensor, a wrong dtype (naming the argument), an option of the wrong type.
        ValueError: an odd batch, shapes that do not fit, tensors on different devices, targets out
            of range, a sequence with no valid target, an NLL with no valid token, an unknown loss
            type, an option out of its range or one the loss type does not read. With a process
            group: on every rank, as ``fused_linear_cross_entropy`` says.
    """
    opts = _options(beta, loss_type, label_smoothing, cpo_alpha, simpo_gamma, alpha, ignore_index, chunk_size, accurate,
                    skip_ignored)
    with_nll_target = nll_target is not None and cpo_alpha != 0

    def check_arguments(heads):
        v.require_same_device(validate_pairs(x, heads["weight"], target, heads["bias"], nll_target))

    def targets():
        named = {"target": target}
        return {**named, "nll_target": nll_target[: x.shape[0] // 2]} if with_nll_target else named

    heads, shard = vp.shard_heads(
        process_group, {"weight": weight, "bias": bias}, check_arguments, rows=lambda: x.shape[0] * x.shape[1],
        targets=targets, ignore_index=ignore_index,
        options=lambda: (opts, bias is None, nll_target is None, x.dtype, wanted_grads(x, weight, bias)),
    )
    weight, bias = heads["weight"], heads["bias"]
    n_cols = weight.shape[0] if shard is None else shard.n_classes
    # With a process group every rank passed the check above on the same targets: these decide alike.
    checks = [v.check_targets(target, n_cols, ignore_index, sequences="every")]
    if with_nll_target:
        checks.append(v.check_targets(nll_target[: x.shape[0] // 2], n_cols, ignore_index, "nll_target", sequences="any"))
    opts = opts._replace(needs=wanted_grads(x, weight, bias))
    inputs = _Inputs(target, nll_target, checks[0].counts, shard)
    out = fused_sequence_loss(x, weight, bias, SequenceLossCall(_forward, inputs, opts))
    for check in checks:  # the targets' checks, read now that the call's kernels are queued
        check.raise_if_bad()
    return out


def fused_linear_simpo(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    simpo_gamma: float = 0.5,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 1.0,
    alpha: float = 0.0,
    ignore_index: int = -100,
    nll_target: torch.Tensor | None = None,
    chunk_size: int | None = None,
    accurate: bool = False,
    skip_ignored: bool = True,
    process_group=None,
) -> CPOOutput:
    """SimPO loss of the head, never materializing the logits: :func:`fused_linear_cpo` with ``loss_type="simpo"``.

    Per pair :math:`-(1-ε)\\log\\sigma(β(a_c - a_r) - γ) - ε\\log\\sigma(γ - β(a_c - a_r))` on the
    **averaged** log-probs :math:`a`, plus ``cpo_alpha`` times the chosen NLL (TRL 1.16's
    ``CPOTrainer(loss_type="simpo")``; ``cpo_alpha=0.0`` for the paper's SimPO, which has no NLL;
    ``alpha ≠ 0`` for AlphaPO). Arguments as :func:`fused_linear_cpo`; returns a :class:`CPOOutput`.
    """
    return fused_linear_cpo(
        x, weight, target, bias, beta=beta, loss_type="simpo", label_smoothing=label_smoothing, cpo_alpha=cpo_alpha,
        simpo_gamma=simpo_gamma, alpha=alpha, ignore_index=ignore_index, nll_target=nll_target,
        chunk_size=chunk_size, accurate=accurate, skip_ignored=skip_ignored, process_group=process_group,
    )


FusedLinearCPOLoss = loss_module(
    fused_linear_cpo, "FusedLinearCPOLoss",
    "``nn.Module`` form of :func:`fused_linear_cpo`: the module holds the options only (checked at construction); "
    "the head's ``weight`` and ``bias`` stay with the model.",
    check=_options,
)
FusedLinearSimPOLoss = loss_module(
    fused_linear_simpo, "FusedLinearSimPOLoss",
    "``nn.Module`` form of :func:`fused_linear_simpo` (:func:`fused_linear_cpo` with ``loss_type=\"simpo\"``).",
    check=_options, fixed={"loss_type": "simpo"},
)
