"""The baselines, with the same signatures as the kernels, so a check or a benchmark swaps one for the other.

Each is the implementation the published charts call the baseline (SPEC §2), run as is: called on
float64 inputs it is also the reference that kernels are checked against.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


def kl_div(
    input: torch.Tensor, target: torch.Tensor, reduction: str = "batchmean", log_target: bool = False
) -> torch.Tensor:
    """``torch.nn.functional.kl_div``: the published "torch" provider (it materializes the pointwise loss).

    torch warns on every ``reduction="mean"`` call that the mean runs over all elements; that is the
    documented semantics here, so the warning is silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="reduction: 'mean' divides the total loss")
        return F.kl_div(input, target, reduction=reduction, log_target=log_target)


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
):
    """Materialized logits, as a Transformers model computes them: ``x @ weight.T + bias`` in the
    input dtype (a bf16 matmul for bf16 inputs; under autocast, as ``F.linear`` runs there), upcast
    to float32 (float64 stays float64), then ``torch.nn.functional.cross_entropy`` (what
    ``ForCausalLMLoss`` does), plus the z-loss ``λ·w_y·lse²`` over the valid rows.

    ``chunk_size`` and ``accurate`` are accepted and ignored. The logits are multiplied by
    ``logit_scale``, capped ``s·tanh(z/s)`` and divided by ``temperature``, in that order.
    ``class_weight`` is ``F.cross_entropy``'s ``weight``. ``num_items_in_batch`` (``mean`` only)
    makes the loss the sum divided by it, as ``ForCausalLMLoss`` does. With ``mean`` and every
    target ignored the result is NaN, as torch gives. The returned z-loss (``return_z_loss``) is the
    same term reduced alone; ``return_token_stats`` gives the kernels' ``CrossEntropyOutput`` from
    the materialized logits (entropy, mean logit and ``log Σ p²`` from ``log_softmax``, top-1 as the
    target's logit >= the max).
    """
    del chunk_size, accurate
    logits = _reference_logits(x, weight, bias).reshape(-1, weight.shape[0])
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:
        logits = logits / temperature
    flat = target.reshape(-1).long()
    valid = flat != ignore_index
    ce_reduction = "sum" if num_items_in_batch is not None else reduction
    weight_rows = None if class_weight is None else class_weight.to(logits.dtype)
    loss = F.cross_entropy(
        logits, flat, weight=weight_rows, ignore_index=ignore_index, reduction=ce_reduction,
        label_smoothing=label_smoothing,
    )
    z_rows = None
    if z_loss_scale:  # no z-loss: nothing more over the logits (a baseline must not pay for it)
        row_w = 1.0 if weight_rows is None else weight_rows[torch.where(valid, flat, 0)]
        z_rows = torch.where(valid, z_loss_scale * row_w * torch.logsumexp(logits, dim=-1).square(), 0.0)
        denominator = valid.sum() if weight_rows is None else (row_w * valid).sum()
        z_loss = {"none": z_rows, "sum": z_rows.sum(), "mean": z_rows.sum() / denominator}[ce_reduction]
        loss = loss + (z_loss.view(target.shape) if reduction == "none" else z_loss).reshape(loss.shape)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    if reduction == "none":
        loss = loss.view(target.shape)
    z_loss = _reduced_z_loss(z_rows, reduction, loss, num_items_in_batch, valid, weight_rows, flat, target.shape)
    if return_token_stats:
        from .fused_linear_cross_entropy import CrossEntropyOutput

        logp = torch.log_softmax(logits, dim=-1)
        entropy = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0).view(target.shape)
        if reduction != "none":  # as the kernels: the entropy's gradient only where backward recomputes
            entropy = entropy.detach()
        with torch.no_grad():
            target_logit = logits.gather(-1, torch.where(valid, flat, 0).unsqueeze(-1)).squeeze(-1)
            top1 = (valid & (target_logit >= logits.max(-1).values)).view(target.shape)
            mean_logit = torch.where(valid, logits.mean(-1), 0.0).view(target.shape)
            log_sum_sq = torch.where(valid, torch.logsumexp(2 * logp, dim=-1), 0.0).view(target.shape)
        return CrossEntropyOutput(loss, z_loss, entropy, top1, mean_logit, log_sum_sq)
    return (loss, z_loss) if return_z_loss else loss


def _reduced_z_loss(z_rows, reduction, loss, num_items_in_batch, valid, weight_rows, flat, shape):
    """The z-loss term alone, reduced as the loss is (zeros without a z-loss)."""
    if z_rows is None:
        return torch.zeros_like(loss)
    if reduction == "none":
        return z_rows.view(shape)
    if reduction == "sum":
        return z_rows.sum()
    if num_items_in_batch is not None:
        return z_rows.sum() / num_items_in_batch
    row_w = valid if weight_rows is None else weight_rows[torch.where(valid, flat, 0)] * valid
    return z_rows.sum() / row_w.sum()


def _reference_logits(x, weight, bias):
    """Materialized logits as a model's LM head makes them: ``x @ weight.T + bias`` in the input
    dtype, then upcast to float32 (float64 inputs stay float64)."""
    logits = F.linear(x, weight, bias)
    return logits if logits.dtype == torch.float64 else logits.float()


def _reference_token_logps(logits, target, ignore_index):
    """Per-token ``log_softmax(logits)[target]``, 0 at ignored positions, and the validity mask."""
    valid = target != ignore_index
    logps = torch.log_softmax(logits, -1).gather(-1, torch.where(valid, target, 0).long().unsqueeze(-1))
    return logps.squeeze(-1) * valid, valid


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
):
    """TRL 1.16's ORPO (``trl/experimental/orpo/orpo_trainer.py``) on materialized float32 logits.

    Follows, in that file: ``log1mexp`` (lines 87–91: ``log1p(-exp x)`` below ``-ln 2``, else
    ``log(-expm1 x)``); ``get_batch_logps(average_log_prob=True)`` (705–741: masked per-token
    log-probs summed and divided by the valid count); ``odds_ratio_loss`` (690–702: log-odds,
    ``losses = beta * logsigmoid``, rewards ``beta * logps``, the two means); the NLL of
    ``concatenated_forward`` (779–800: ``nn.CrossEntropyLoss`` over the chosen half, TRL's labels
    being prompt + response, here ``nll_target`` or else ``target``); ``loss = policy_nll_loss -
    losses.mean()`` (848). Targets are aligned with ``x`` (no shift, TRL's ``is_encoder_decoder``
    path). ``chunk_size`` and ``accurate`` are accepted and ignored. Returns an ``ORPOOutput``; a
    sequence with no valid token gives NaN, as TRL does.
    """
    from .fused_linear_orpo import ORPOOutput

    del chunk_size, accurate
    n = x.shape[0] // 2
    logits = _reference_logits(x, weight, bias)
    logps, valid = _reference_token_logps(logits, target, ignore_index)
    average = logps.sum(-1) / valid.sum(-1)
    chosen, rejected = average[:n], average[n:]

    def log1mexp(a):
        return torch.where(a < -0.6931471805599453, torch.log1p(-torch.exp(a)), torch.log(-torch.expm1(a)))

    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    nll_labels = (target if nll_target is None else nll_target)[:n]
    nll = F.cross_entropy(logits[:n].flatten(0, 1), nll_labels.flatten().long(), ignore_index=ignore_index)
    loss = nll - (beta * ratio).mean()
    return ORPOOutput(
        loss, chosen.detach(), rejected.detach(), beta * chosen.detach(), beta * rejected.detach(),
        ratio.mean().detach(), log_odds.mean().detach(), nll.detach(),
    )


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
):
    """TRL 1.16's KTO loss (``trl/trainer/kto_trainer.py``, ``_compute_loss``, ``loss_type="kto"``) on
    materialized float32 logits.

    Re-implements, in that file: completion log-probs summed over the valid tokens (line 1401:
    ``per_token_logps.sum(-1)``, the fused head giving 0 at ``-100`` labels); the split into chosen
    and rejected by the labels (1410–1415, ``index_select``) and the reference log-probs, precomputed
    (1417–1419) or from the reference model under ``torch.no_grad()`` (1426–1440); ``kl`` detached,
    or zero without ``calculate_KL`` (1442–1446); ``chosen_losses = 1 - sigmoid(beta * (logratios -
    kl))`` and ``chosen_rewards = beta * logratios`` (1449–1459); ``rejected_losses = 1 - sigmoid(beta
    * (kl - logratios))`` and its rewards (1467–1474); the weights and the concatenation (1479–1482);
    ``loss = losses.nanmean()`` (1548), here a plain mean so that a NaN is not dropped silently.
    ``average_log_prob=True`` divides the sums by the valid counts (TRL 1.16 has no such switch).
    ``chunk_size`` and ``accurate`` are accepted and ignored. Returns a ``KTOOutput``.
    """
    from .fused_linear_kto import KTOOutput

    del chunk_size, accurate

    def sequence_logps(hidden, head, head_bias):
        logps, valid = _reference_token_logps(_reference_logits(hidden, head, head_bias), target, ignore_index)
        return logps.sum(-1) / valid.sum(-1) if average_log_prob else logps.sum(-1)

    policy = sequence_logps(x, weight, bias)
    if ref_logps is None:
        with torch.no_grad():
            ref_logps = sequence_logps(ref_x, ref_weight, ref_bias)
    kl = torch.zeros((), dtype=policy.dtype) if kl is None else torch.as_tensor(kl).detach().to(policy.dtype)
    labels = preference_labels.to(torch.bool)
    chosen_idx = torch.nonzero(labels).view(-1)
    rejected_idx = torch.nonzero(~labels).view(-1)
    chosen_logps, rejected_logps = policy.index_select(0, chosen_idx), policy.index_select(0, rejected_idx)
    ref = ref_logps.detach().to(policy.dtype)
    chosen_logratios = chosen_logps - ref.index_select(0, chosen_idx)
    rejected_logratios = rejected_logps - ref.index_select(0, rejected_idx)
    chosen_losses = 1 - torch.sigmoid(beta * (chosen_logratios - kl))
    rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected_logratios))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    return KTOOutput(
        losses.mean(), beta * chosen_logratios.detach(), beta * rejected_logratios.detach(),
        chosen_logps.detach(), rejected_logps.detach(),
    )
