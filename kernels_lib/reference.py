"""The baselines, with the same signatures as the kernels, so a check or a benchmark swaps one for the other.

Each is the implementation the published charts call the baseline (SPEC §2), run as is: called on
float64 inputs it is also the reference that kernels are checked against.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
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
    token_weight: torch.Tensor | None = None,
    token_scaling: bool = False,
    return_predicted: bool = False,
    return_lse: bool = False,
    skip_ignored: bool = True,
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
    target's logit >= the max). ``token_weight`` and ``token_scaling`` multiply each row's loss by its
    weight and its detached target probability, ``mean`` over the same denominator;
    ``return_predicted`` and ``return_lse`` add the argmax and the log-sum-exp of the logits
    (:func:`_with_row_options`). ``skip_ignored`` is accepted and ignored.
    """
    del chunk_size, accurate, skip_ignored
    if token_weight is not None or token_scaling or return_predicted or return_lse:
        return _with_row_options(
            x, weight, target, bias, token_weight=token_weight, token_scaling=token_scaling,
            return_predicted=return_predicted, return_lse=return_lse, reduction=reduction,
            num_items_in_batch=num_items_in_batch, return_token_stats=return_token_stats, return_z_loss=return_z_loss,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
            class_weight=class_weight, logit_scale=logit_scale, temperature=temperature,
        )
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


def _with_row_options(x, weight, target, bias, *, token_weight, token_scaling, return_predicted, return_lse, reduction,
                      num_items_in_batch, return_token_stats, return_z_loss, **options):
    """The loss per row (and its statistics) from :func:`fused_linear_cross_entropy`, each valid row times
    ``ω_i · sg(p_y)``, reduced (``mean`` over ``num_items_in_batch``, else the valid rows' total class
    weight); with the logits' argmax and log-sum-exp (0 / ``ignore_index`` at ignored rows)."""
    from .fused_linear_cross_entropy import CrossEntropyOutput

    rows = fused_linear_cross_entropy(x, weight, target, bias, reduction="none", return_token_stats=True, **options)
    logits = _reference_logits(x, weight, bias).reshape(-1, weight.shape[0]) * options["logit_scale"]
    if options["softcap"] is not None:
        logits = options["softcap"] * torch.tanh(logits / options["softcap"])
    logits = logits / options["temperature"]
    flat, ignore_index = target.reshape(-1).long(), options["ignore_index"]
    valid = flat != ignore_index
    factor = torch.ones_like(logits[:, 0]) if token_weight is None else token_weight.reshape(-1).to(logits.dtype)
    if token_scaling:
        target_logp = torch.log_softmax(logits, -1).gather(1, torch.where(valid, flat, 0).unsqueeze(1)).squeeze(1)
        factor = factor * target_logp.exp().detach()
    factor = torch.where(valid, factor, 0.0)
    loss, z_loss = (t.reshape(-1) * factor for t in (rows.loss, rows.z_loss))
    if reduction != "none":
        class_weight = options["class_weight"]
        total = valid.sum() if class_weight is None else class_weight.to(logits.dtype)[torch.where(valid, flat, 0)][valid].sum()
        denominator = (num_items_in_batch if num_items_in_batch is not None else total) if reduction == "mean" else 1
        loss, z_loss = loss.sum() / denominator, z_loss.sum() / denominator
    else:
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    if not (return_token_stats or return_predicted or return_lse):
        return (loss, z_loss) if return_z_loss else loss
    fields = dict(loss=loss, z_loss=z_loss)
    if return_token_stats:
        fields.update(entropy=rows.entropy if reduction == "none" else rows.entropy.detach(), is_top1=rows.is_top1,
                      mean_logit=rows.mean_logit, log_sum_sq_prob=rows.log_sum_sq_prob)
    if return_predicted:
        fields["predicted"] = torch.where(valid, logits.argmax(-1), ignore_index).view(target.shape)
    if return_lse:
        fields["lse"] = torch.where(valid, torch.logsumexp(logits, -1), 0.0).view(target.shape)
    return CrossEntropyOutput(**{**dict.fromkeys(CrossEntropyOutput._fields), **fields})


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


def head_token_logps(hidden, weight, bias, target, ignore_index: int, temperature: float = 1.0, entropy: bool = False):
    r"""An LM head's per-token log-probabilities on materialized logits, as the trainers' heads give them:
    ``log_softmax((hidden @ weight.T + bias) / temperature)[target]`` in float32 (float64 stays), 0 at
    ``ignore_index``; with ``entropy``, also the per-token entropy :math:`\log Z - \sum_v p_v z_v`
    (0 at ignored positions), else None. Any leading shape; returns ``(logps, entropy)``."""
    logits = _reference_logits(hidden, weight, bias)
    if temperature != 1.0:
        logits = logits / temperature
    valid = target != ignore_index
    logp = torch.log_softmax(logits, -1)
    per_token = logp.gather(-1, torch.where(valid, target, 0).long().unsqueeze(-1)).squeeze(-1).masked_fill(~valid, 0)
    if not entropy:
        return per_token, None
    return per_token, (torch.logsumexp(logits, -1) - (logp.exp() * logits).sum(-1)).masked_fill(~valid, 0)


#: The head the preference references (DPO, CPO, SimPO, GRPO) take their per-token log-probs from.
_TOKEN_LOGPS_HEAD = contextvars.ContextVar("token_logps_head", default=head_token_logps)


@contextlib.contextmanager
def token_logps_from(head):
    """Within the block, the DPO, CPO, SimPO and GRPO references take their per-token log-probs (and
    GRPO its entropy) from ``head``, a function with :func:`head_token_logps`'s signature, and run
    their trainer's loss on them unchanged: TRL's own path is its fused head (``ChunkedLogProbFunction``)
    followed by the trainer's loss, which is this with TRL's head (the workbench's ``trl`` providers)."""
    token = _TOKEN_LOGPS_HEAD.set(head)
    try:
        yield
    finally:
        _TOKEN_LOGPS_HEAD.reset(token)


def _token_logps(hidden, weight, bias, target, ignore_index: int, temperature: float = 1.0, entropy: bool = False):
    """Per-token log-probs (and entropy) from the head in effect (:func:`token_logps_from`)."""
    return _TOKEN_LOGPS_HEAD.get()(hidden, weight, bias, target, ignore_index, temperature, entropy)


def fused_linear_token_logprobs(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    accurate: bool = False,
):
    """Per-token ``log_softmax((x @ weight.T + bias) / temperature)[target]`` and entropy on
    materialized logits (:func:`head_token_logps`: float32, float64 stays), 0 at ``ignore_index``,
    both differentiable. ``chunk_size`` and ``accurate`` are accepted and ignored. Returns a
    ``TokenLogprobsOutput``."""
    from .fused_linear_token_logprobs import TokenLogprobsOutput

    del chunk_size, accurate
    return TokenLogprobsOutput(*head_token_logps(x, weight, bias, target, ignore_index, temperature, return_entropy))


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


def fused_linear_grpo(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    ref_x: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
    sampler_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    loss_type: str = "grpo",
    max_completion_length: int | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    use_bias_correction_kl: bool = False,
    vllm_importance_sampling_mode: str = "sequence_mask",
    vllm_importance_sampling_clip_min: float | None = None,
    vllm_importance_sampling_clip_max: float | None = 3.0,
    top_entropy_quantile: float = 1.0,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_per_token: bool = False,
    chunk_size: int | None = None,
    accurate: bool = False,
):
    """TRL 1.16's GRPO loss (``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss``) on
    materialized float32 logits: the published "torch" provider of the GRPO charts.

    The per-token log-probs are what TRL's fused head returns (``trl/trainer/utils.py``,
    ``add_fused_lm_head``, lines 1642–1660: logits divided by ``temperature``, ``masked_fill(~mask,
    0)`` at ``-100`` labels, here ``ignore_index``), from full ``log_softmax``; the reference model's
    likewise under ``torch.no_grad()`` (``ref_per_token_logps`` of ``_generate_and_score_completions``,
    ``grpo_trainer.py`` 2709–2720).
    With ``sampler_logps`` (TRL's ``sampling_per_token_logps``, the rollout engine's), the vLLM
    importance-sampling ratio of ``_generate_and_score_completions`` (2660–2706: ``(old - sampler) *
    mask``, NaN to 0, summed per sequence in the ``sequence_*`` modes, ``exp``, clamped or masked to
    ``[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]``), from
    ``old_logps``, else from the current log-probs detached (TRL computes ``old_per_token_logps``
    whenever the correction is on).
    Then, in ``grpo_trainer.py``: the mask (line 3027, ``completion_mask``, times the valid
    targets); advantages unsqueezed (3058–3059); ``old_per_token_logps`` defaulting to
    ``per_token_logps.detach()`` (3065–3066); ``log_ratio`` and the token or sequence level
    (3083–3093); ``coef_1 = exp`` (3095); ``per_token_kl`` (3100–3102), times ``coef_1`` with
    ``use_bias_correction_kl`` (3104–3105; TRL's default is True, this function's False); the loss
    types (3109–3137: ``cispo``'s detached ``min(coef_1, epsilon_high)`` times ``A`` and the
    log-probs; the clipped ``-min`` with ``delta`` capping ``coef_1`` for grpo, bnpo, dr_grpo, dapo,
    luspo; ``sapo``'s gate ``sigmoid(τ(coef_1 - 1)) 4/τ``; ``vespo``'s ``get_gamma_weights``,
    2972–3017); times the sampling ratio except for vespo (3146–3147); ``+ beta * per_token_kl``
    (3149–3150); the normalizations (3153–3183; ``dapo``, ``cispo``, ``vespo`` divide by
    ``num_items_in_batch`` as given, else by the active tokens clamped to 1, which TRL's
    ``num_items_in_batch`` is on one process with one accumulation step); the metrics ``kl``,
    ``entropy``, the clip ratios, ``cispo_clip_ratio`` and ``vespo/phi_seq_mean`` (3254–3289, on one
    process). The loss is TRL's ``policy_loss`` (before the gradient-accumulation division).
    ``top_entropy_quantile`` must be 1.0 (no entropy mask, as the kernel). ``chunk_size`` and
    ``accurate`` are accepted and ignored. With ``return_per_token`` the ``GRPOPerToken`` of TRL's
    per-token tensors before their means (``coef_1`` of 3095, the flags of 3272–3274 or cispo's of
    3284–3285, each and-ed with the active tokens, the entropies, the sampling ratio), broadcast to
    ``(B, T)``. Returns a ``GRPOOutput``.
    """
    from .fused_linear_grpo import GRPOOutput, GRPOPerToken

    del chunk_size, accurate
    if top_entropy_quantile != 1.0:
        raise ValueError(f"top_entropy_quantile must be 1.0 here (no entropy mask); got {top_entropy_quantile!r}")
    valid = target != ignore_index

    per_token_logps, entropies = _token_logps(x, weight, bias, target, ignore_index, temperature, return_entropy)
    dtype = per_token_logps.dtype
    mask = valid.to(dtype) if completion_mask is None else valid.to(dtype) * completion_mask.to(dtype)
    if ref_logps is None and ref_x is not None:
        with torch.no_grad():
            ref_logps = _token_logps(ref_x, ref_weight, ref_bias, target, ignore_index, temperature)[0]
    advantages = advantages.detach().to(dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_per_token_logps = per_token_logps.detach() if old_logps is None else old_logps.detach().to(dtype)

    importance_sampling_ratio = None
    if sampler_logps is not None:
        diff = torch.nan_to_num((old_per_token_logps - sampler_logps.detach().to(dtype)) * mask, nan=0.0)
        if vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate"):
            diff = diff.sum(dim=-1, keepdim=True)
        importance_sampling_ratio = torch.exp(diff)
        if vllm_importance_sampling_mode in ("sequence_truncate", "token_truncate"):
            importance_sampling_ratio = torch.clamp(
                importance_sampling_ratio, min=vllm_importance_sampling_clip_min, max=vllm_importance_sampling_clip_max
            )
        else:
            low = -math.inf if vllm_importance_sampling_clip_min is None else vllm_importance_sampling_clip_min
            high = math.inf if vllm_importance_sampling_clip_max is None else vllm_importance_sampling_clip_max
            outside = (importance_sampling_ratio < low) | (importance_sampling_ratio > high)
            importance_sampling_ratio = importance_sampling_ratio.masked_fill(outside, 0.0)

    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    importance_ratio = coef_1
    per_token_kl = None
    if ref_logps is not None:
        ref_per_token_logps = ref_logps.detach().to(dtype)
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    def where(cond, a, b):
        return torch.where(cond, torch.tensor(a, dtype=dtype, device=cond.device), torch.tensor(b, dtype=dtype, device=cond.device))

    phi_seq = None
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temperatures = where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        per_token_loss = -soft_coef_1 * advantages
    elif loss_type == "vespo":
        with torch.no_grad():
            lower_clamp = math.log(1e-8)
            seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
            if importance_sampling_ratio is not None:
                log_is_ratio = torch.clamp(torch.log(importance_sampling_ratio), lower_clamp, 20.0)
                seq_log_ratio = seq_log_ratio + torch.sum(log_is_ratio, dim=-1, keepdim=True)
            log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
            is_nonneg_adv = advantages >= 0
            k_seq = where(is_nonneg_adv, vespo_k_pos, vespo_k_neg)
            lambda_seq = where(is_nonneg_adv, vespo_lambda_pos, vespo_lambda_neg).clamp(min=1e-4)
            log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * torch.exp(log_w_seq)
            phi_seq = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token_loss = -phi_seq * advantages * per_token_logps
    else:
        raise ValueError(f"loss_type must be one of 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo', 'vespo'; got {loss_type!r}")
    if importance_sampling_ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl

    if loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
    else:
        if num_items_in_batch is None:
            normalizer = mask.sum().clamp(min=1.0)
        else:
            normalizer = torch.as_tensor(num_items_in_batch, device=mask.device).to(dtype).reshape(())
        loss = (per_token_loss * mask).sum() / normalizer

    def masked_seq_mean(t):
        return t.squeeze(1) if t.shape[1] == 1 else (t * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(t):
        if t.shape[1] == 1:
            local_sum, local_count = t.sum(), torch.tensor(float(t.shape[0]), dtype=t.dtype, device=t.device)
        else:
            local_sum, local_count = (t * mask).sum(), mask.sum()
        return (local_sum / local_count.clamp(min=1.0)).detach()

    def nan_extreme(t, fn):
        kept = t[~torch.isnan(t)]
        return torch.full((), float("nan"), dtype=t.dtype, device=t.device) if kept.numel() == 0 else fn(kept).detach()

    clips = [None] * 5
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        is_low_clipped = ((coef_1 < 1 - epsilon_low) & (advantages < 0)).to(dtype)
        is_high_clipped = ((coef_1 > 1 + epsilon_high) & (advantages > 0)).to(dtype)
        is_region_clipped = ((is_low_clipped > 0) | (is_high_clipped > 0)).to(dtype)
        clips = [
            global_masked_mean(is_low_clipped),
            nan_extreme(masked_seq_mean(is_low_clipped), torch.min),
            global_masked_mean(is_high_clipped),
            nan_extreme(masked_seq_mean(is_high_clipped), torch.max),
            global_masked_mean(is_region_clipped),
        ]
    cispo_clip_ratio = None
    if loss_type == "cispo":
        cispo_clip_ratio = global_masked_mean(((coef_1 > epsilon_high) & (advantages > 0)).to(dtype))
    per_token = None
    if return_per_token:
        shape, active = per_token_logps.shape, mask != 0
        flags = [None] * 3
        if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            flags = [(f > 0).expand(shape) & active for f in (is_low_clipped, is_high_clipped, is_region_clipped)]
        elif loss_type == "cispo":
            flags[1] = ((coef_1 > epsilon_high) & (advantages > 0)).expand(shape) & active
        per_token = GRPOPerToken(
            importance_ratio.detach().expand(shape),
            *flags,
            entropies.detach() if return_entropy else None,
            None if importance_sampling_ratio is None else importance_sampling_ratio.expand(shape),
        )
    return GRPOOutput(
        loss,
        per_token_logps.detach(),
        *clips,
        None if per_token_kl is None else global_masked_mean(per_token_kl),
        global_masked_mean(entropies) if return_entropy else None,
        cispo_clip_ratio,
        None if phi_seq is None else global_masked_mean(phi_seq),
        per_token,
    )


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
    loss_type="sigmoid",
    loss_weights=None,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    ignore_index: int = -100,
    average_log_prob: bool = False,
    chunk_size: int | None = None,
    accurate: bool = False,
):
    """TRL 1.16's DPO loss (``trl/trainer/dpo_trainer.py``, ``DPOTrainer._compute_loss``) on
    materialized float32 logits.

    Re-implements, in that file: the completion log-probs summed over the valid tokens (line 1304:
    ``per_token_logps.sum(dim=1)``, the fused head giving 0 at the ``-100`` labels of line 1298)
    and split chosen/rejected (1316); the reference log-probs, precomputed (1318–1319) or from the
    reference model under ``torch.no_grad()`` (1320–1347); the log-ratios (1350–1351); the
    f-divergence scores (1353–1363: reverse KL, forward KL ``1 - exp(-r)``, JS ``log 2 +
    logsigmoid(r)``) and ``delta_score`` (1383); every per-pair loss type but ``aot`` /
    ``aot_unpaired`` (1386–1510: sigmoid 1387–1388, hinge 1390–1391, ipo 1393–1404 (scores over the
    completion lengths), exo_pair 1406–1417, nca_pair 1419–1426, robust 1428–1431, bco_pair
    1433–1436, sppo_hard 1438–1445, apo_zero 1467–1473, apo_down 1475–1481, discopop 1483–1493, sft
    1495–1502, sigmoid_norm 1504–1509); ``loss += per_sequence_loss.mean() * loss_weight`` (1528);
    rewards ``beta * logratios`` (1582–1583), accuracies ``chosen_rewards > rejected_rewards``
    (1590) and margins (1595). Targets are aligned with ``x`` (no shift); ``ref_logps`` is
    ``(2n,)``, chosen then rejected. ``average_log_prob=True`` divides the sums by the valid counts
    (TRL 1.16 has no such switch). ``chunk_size`` and ``accurate`` are accepted and ignored. Returns
    a ``DPOOutput``. The argument checks are the kernel's (``fused_linear_dpo._options``).
    """
    import math

    from .fused_linear_dpo import DPOOutput, _options

    del chunk_size, accurate
    opts = _options(beta, loss_type, loss_weights, label_smoothing, discopop_tau, f_divergence_type, ignore_index,
                    average_log_prob, None, False)
    n = x.shape[0] // 2
    valid = target != ignore_index
    completion_lengths = valid.sum(-1).clamp(min=1)  # completion_mask.sum(dim=1).clamp(min=1.0), 1400-1401 and 1506-1507

    def sequence_logps(hidden, head, head_bias):
        per_token_logps = _token_logps(hidden, head, head_bias, target, ignore_index)[0]
        logps = per_token_logps.sum(-1)
        return (logps / valid.sum(-1) if average_log_prob else logps), per_token_logps

    logps, per_token_logps = sequence_logps(x, weight, bias)
    chosen_logps, rejected_logps = logps[:n], logps[n:]
    if ref_logps is None:
        with torch.no_grad():
            ref_logps, _ = sequence_logps(ref_x, ref_weight, ref_bias)
    ref_logps = ref_logps.detach().to(logps.dtype)
    ref_chosen_logps, ref_rejected_logps = ref_logps[:n], ref_logps[n:]
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    if opts.f_divergence_type == "reverse_kl":
        chosen_scores, rejected_scores = chosen_logratios, rejected_logratios
    elif opts.f_divergence_type == "forward_kl":
        chosen_scores, rejected_scores = 1 - torch.exp(-chosen_logratios), 1 - torch.exp(-rejected_logratios)
    else:  # js_divergence
        chosen_scores = math.log(2) + F.logsigmoid(chosen_logratios)
        rejected_scores = math.log(2) + F.logsigmoid(rejected_logratios)
    delta_score = chosen_scores - rejected_scores
    chosen_lengths, rejected_lengths = completion_lengths[:n], completion_lengths[n:]
    b, eps = opts.beta, opts.label_smoothing
    loss = 0.0
    for name, loss_weight in zip(opts.loss_types, opts.loss_weights):
        if name == "sigmoid":
            per_sequence_loss = -F.logsigmoid(b * delta_score)
        elif name == "hinge":
            per_sequence_loss = torch.relu(1 - b * delta_score)
        elif name == "ipo":
            ipo_delta = chosen_scores / chosen_lengths - rejected_scores / rejected_lengths
            per_sequence_loss = (ipo_delta - 1 / (2 * b)) ** 2
        elif name == "exo_pair":
            epsilon = torch.tensor(eps, dtype=delta_score.dtype, device=delta_score.device)
            qw, log_qw = torch.sigmoid(b * delta_score), F.logsigmoid(b * delta_score)
            ql, log_ql = torch.sigmoid(-b * delta_score), F.logsigmoid(-b * delta_score)
            per_sequence_loss = qw * (log_qw - torch.log1p(-epsilon)) + ql * (log_ql - torch.log(epsilon))
        elif name == "nca_pair":
            chosen_rewards, rejected_rewards = b * chosen_logratios, b * rejected_logratios
            per_sequence_loss = (
                -F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards) - 0.5 * F.logsigmoid(-rejected_rewards)
            )
        elif name == "robust":
            clean_loss_term = -(1 - eps) * F.logsigmoid(b * delta_score)
            flipped_loss_term = -eps * F.logsigmoid(-b * delta_score)
            per_sequence_loss = (clean_loss_term - flipped_loss_term) / (1 - 2 * eps)
        elif name == "bco_pair":
            per_sequence_loss = -F.logsigmoid(b * chosen_logratios) - F.logsigmoid(-b * rejected_logratios)
        elif name == "sppo_hard":
            per_sequence_loss = (chosen_logratios - 0.5 / b) ** 2 + (rejected_logratios + 0.5 / b) ** 2
        elif name == "apo_zero":
            per_sequence_loss = 1 - torch.sigmoid(b * chosen_logratios) + torch.sigmoid(b * rejected_logratios)
        elif name == "apo_down":
            per_sequence_loss = torch.sigmoid(b * chosen_logratios) + (
                1 - torch.sigmoid(b * (chosen_logratios - rejected_logratios))
            )
        elif name == "discopop":
            logits = delta_score * b
            log_ratio_modulation = torch.sigmoid(logits / opts.discopop_tau)
            per_sequence_loss = -F.logsigmoid(logits) * (1 - log_ratio_modulation) + torch.exp(-logits) * log_ratio_modulation
        elif name == "sft":
            per_sequence_loss = (-per_token_logps[:n][valid[:n]].mean()).expand(n)
        else:  # sigmoid_norm
            delta = chosen_scores / chosen_lengths - rejected_scores / rejected_lengths
            per_sequence_loss = -F.logsigmoid(b * delta)
        loss = loss + per_sequence_loss.mean() * loss_weight
    chosen_rewards = b * chosen_logratios.detach()
    rejected_rewards = b * rejected_logratios.detach()
    return DPOOutput(
        loss, chosen_logps.detach(), rejected_logps.detach(), chosen_rewards, rejected_rewards,
        chosen_rewards - rejected_rewards, (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype),
    )


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
):
    """TRL 1.16's CPO (``trl/experimental/cpo/cpo_trainer.py``) on materialized float32 logits.

    Follows, in that file: ``get_batch_logps`` (752–790: masked per-token log-probs summed, or
    divided by the valid count) with ``average_log_prob=self.loss_type in ["ipo", "simpo"]``
    (847–852); ``cpo_loss`` (678–749: the AlphaPO rewards 696–710, here ``-expm1(-alpha·logp)/alpha``,
    TRL's ``(1 - exp(logp)^-alpha)/alpha`` without the underflow of ``exp(logp)``; simpo 715–722,
    sigmoid 723–728, hinge 729–730, ipo 731–733; rewards 740–747); the NLL of
    ``concatenated_forward`` (826–845: ``nn.CrossEntropyLoss`` over the chosen half, a zero tensor
    when ``cpo_alpha == 0``; here over ``nll_target`` when given); ``loss = losses.mean() +
    self.cpo_alpha * policy_nll_loss`` and the reward accuracies (890–891); margins as logged
    (897–899). Targets are aligned with ``x`` (no shift, TRL's ``is_encoder_decoder`` path).
    ``chunk_size`` and ``accurate`` are accepted and ignored. Returns a ``CPOOutput``; a sequence
    with no valid token gives NaN under ``ipo``/``simpo`` (0/0), as TRL does. The argument checks
    are the kernel's (``fused_linear_cpo._options``).
    """
    from .fused_linear_cpo import CPOOutput, _options

    del chunk_size, accurate
    opts = _options(beta, loss_type, label_smoothing, cpo_alpha, simpo_gamma, alpha, ignore_index, None, False)
    n = x.shape[0] // 2
    per_token_logps = _token_logps(x, weight, bias, target, ignore_index)[0]
    valid = target != ignore_index
    all_logps = per_token_logps.sum(-1)
    if loss_type in ("ipo", "simpo"):
        all_logps = all_logps / valid.sum(-1)
    chosen_logps, rejected_logps = all_logps[:n], all_logps[n:]
    if alpha != 0.0:
        chosen_u, rejected_u = -torch.expm1(-alpha * chosen_logps) / alpha, -torch.expm1(-alpha * rejected_logps) / alpha
    else:
        chosen_u, rejected_u = chosen_logps, rejected_logps
    logratios = chosen_u - rejected_u
    eps = opts.label_smoothing
    if loss_type == "simpo":
        logratios = logratios - simpo_gamma / beta
    if loss_type in ("simpo", "sigmoid"):
        losses = -F.logsigmoid(beta * logratios) * (1 - eps) - F.logsigmoid(-beta * logratios) * eps
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logratios)
    else:  # ipo
        losses = (logratios - 1 / (2 * beta)) ** 2
    if cpo_alpha == 0:
        nll = torch.zeros((), dtype=per_token_logps.dtype, device=per_token_logps.device)
    else:  # nn.CrossEntropyLoss (mean over the valid labels) as the mean of the labels' negative log-probs
        nll_labels = (target if nll_target is None else nll_target)[:n]
        nll_logps = per_token_logps[:n] if nll_target is None else _token_logps(x[:n], weight, bias, nll_labels, ignore_index)[0]
        nll = -nll_logps.sum() / (nll_labels != ignore_index).sum()
    loss = losses.mean() + cpo_alpha * nll
    chosen_rewards, rejected_rewards = beta * chosen_u.detach(), beta * rejected_u.detach()
    return CPOOutput(
        loss, chosen_logps.detach(), rejected_logps.detach(), chosen_rewards, rejected_rewards,
        chosen_rewards - rejected_rewards, (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype), nll.detach(),
    )


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
):
    """TRL 1.16's SimPO: :func:`fused_linear_cpo` with ``loss_type="simpo"`` (``CPOTrainer`` lines 715–722,
    averaged log-probs as line 850 asks)."""
    return fused_linear_cpo(
        x, weight, target, bias, beta=beta, loss_type="simpo", label_smoothing=label_smoothing, cpo_alpha=cpo_alpha,
        simpo_gamma=simpo_gamma, alpha=alpha, ignore_index=ignore_index, nll_target=nll_target,
        chunk_size=chunk_size, accurate=accurate,
    )


def _two_head_logits(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias):
    """Both heads' materialized logits, ``(N, V)`` each (:func:`_reference_logits`); the teacher's
    without gradient (a constant, as in distillation)."""
    n_cols = student_weight.shape[0]
    student = _reference_logits(student_x, student_weight, student_bias).reshape(-1, n_cols)
    with torch.no_grad():
        teacher = _reference_logits(teacher_x, teacher_weight, teacher_bias).reshape(-1, n_cols)
    return student, teacher


def fused_linear_jsd(
    student_x: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_x: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor | None = None,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    chunk_size: int | None = None,
    accurate: bool = False,
) -> torch.Tensor:
    """Both heads' logits materialized (:func:`_two_head_logits`), divided by ``temperature``,
    ``log_softmax``, then :func:`jsd` (TRL's ``generalized_jsd_loss`` composition) with the rows of
    ``target == ignore_index`` skipped: the published "torch" provider of ``fused_linear_jsd``.
    ``chunk_size`` and ``accurate`` are accepted and ignored."""
    del chunk_size, accurate
    student, teacher = _two_head_logits(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias)
    student_logp = torch.log_softmax(student / temperature, -1)
    teacher_logp = torch.log_softmax(teacher / temperature, -1)
    flat = None if target is None else target.reshape(-1)
    return jsd(student_logp, teacher_logp, beta=beta, ignore_index=ignore_index, target=flat, reduction=reduction)


def _distillation(soft_rows, student_x, student_weight, teacher_x, teacher_weight, target, student_bias, teacher_bias,
                  weight_hard_loss, weight_soft_loss, temperature, ignore_index):
    """Liger's chunked distillation (``LigerFusedLinearDistillationBase._compute_loss``) on whole logits:
    hard = ``F.cross_entropy`` of the raw student logits (sum) / n, soft = ``soft_rows(z_s / T, z_t / T)``
    summed over kept rows / n, with n the non-ignored targets clamped to at least 1;
    ``loss = weight_hard_loss · hard + weight_soft_loss · soft``."""
    from .distillation import DistillationOutput

    student, teacher = _two_head_logits(student_x, student_weight, student_bias, teacher_x, teacher_weight, teacher_bias)
    flat = target.reshape(-1)
    kept = flat != ignore_index
    count = kept.sum().clamp_min(1)
    hard = F.cross_entropy(student, flat.long(), ignore_index=ignore_index, reduction="sum") / count
    rows = soft_rows(student / temperature, teacher / temperature)
    soft = torch.where(kept, rows, torch.zeros((), dtype=rows.dtype, device=rows.device)).sum() / count
    return DistillationOutput(weight_hard_loss * hard + weight_soft_loss * soft, hard, soft)


def distill_jsd_loss(
    student_x: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_x: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    accurate: bool = False,
):
    """Liger's ``LigerFusedLinearJSDLoss`` semantics on materialized logits (:func:`_distillation`), the
    soft loss per row being TRL's generalized JSD (:func:`jsd` on the two ``log_softmax``, summed over
    the vocabulary): the published "torch" provider of ``distill_jsd_loss``. Returns
    :class:`kernels_lib.distillation.DistillationOutput`; ``chunk_size``/``accurate`` are ignored."""
    del chunk_size, accurate

    def soft_rows(student, teacher):
        return jsd(torch.log_softmax(student, -1), torch.log_softmax(teacher, -1), beta=beta, reduction="none").sum(-1)

    return _distillation(soft_rows, student_x, student_weight, teacher_x, teacher_weight, target, student_bias,
                         teacher_bias, weight_hard_loss, weight_soft_loss, temperature, ignore_index)


def distill_cosine_loss(
    student_x: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_x: torch.Tensor,
    teacher_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    accurate: bool = False,
):
    """Liger's ``LigerFusedLinearCosineSimilarityLoss`` semantics on materialized logits
    (:func:`_distillation`), the soft loss per row ``beta · (1 − cos)`` of ``F.normalize``-d logits
    (``F.cosine_similarity``, as Liger's ``distillation_loss_fn``): the published "torch" provider of
    ``distill_cosine_loss``. Returns :class:`kernels_lib.distillation.DistillationOutput`."""
    del chunk_size, accurate

    def soft_rows(student, teacher):
        cosine = F.cosine_similarity(F.normalize(student, p=2, dim=-1), F.normalize(teacher, p=2, dim=-1), dim=-1)
        return beta * (1 - cosine)

    return _distillation(soft_rows, student_x, student_weight, teacher_x, teacher_weight, target, student_bias,
                         teacher_bias, weight_hard_loss, weight_soft_loss, temperature, ignore_index)


def _kept_rows(n_rows: int, target, ignore_index: int, device) -> torch.Tensor:
    """The (N,) bool mask of rows that count: ``target != ignore_index``, or all rows without a target."""
    if target is None:
        return torch.ones(n_rows, dtype=torch.bool, device=device)
    return target != ignore_index


def _reduce_rows(pointwise: torch.Tensor, kept: torch.Tensor, reduction: str) -> torch.Tensor:
    """TRL's reductions (``generalized_jsd_loss``, lines 300-321) of a (N, V) pointwise loss, rows masked:
    ``none`` keeps the shape with ignored rows zero; ``batchmean`` and ``mean`` divide by the kept rows
    (times V for ``mean``) clamped to at least 1, so every row ignored gives 0."""
    masked = torch.where(kept[:, None], pointwise, torch.zeros((), dtype=pointwise.dtype, device=pointwise.device))
    if reduction == "none":
        return masked
    total = masked.sum()
    rows = kept.sum().clamp_min(1)
    if reduction == "sum":
        return total
    if reduction == "batchmean":
        return total / rows
    if reduction == "mean":
        return total / (rows * pointwise.shape[-1])
    raise ValueError(f"reduction must be one of 'none', 'sum', 'mean', 'batchmean'; got {reduction!r}")


def jsd(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    *,
    beta: float = 0.5,
    ignore_index: int = -100,
    target: torch.Tensor | None = None,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` composition (``trl/experimental/gkd/gkd_trainer.py``
    lines 278-297: ``F.kl_div`` with ``log_target=True``, the mixture by ``logsumexp``), on
    log-probabilities (TRL's ``log_softmax`` of them is the identity, temperature 1), with
    :func:`kernels_lib.jsd`'s row masking and reductions (ignored rows zero under ``none``; TRL drops them).
    It materializes the mixture and both pointwise KL terms: the published "torch" provider."""
    if beta == 0:
        pointwise = F.kl_div(student_logp, teacher_logp, reduction="none", log_target=True)
    elif beta == 1:
        pointwise = F.kl_div(teacher_logp, student_logp, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student_logp.dtype, device=student_logp.device)
        mixture = torch.logsumexp(torch.stack([student_logp + torch.log1p(-b), teacher_logp + torch.log(b)]), dim=0)
        kl_teacher = F.kl_div(mixture, teacher_logp, reduction="none", log_target=True)
        kl_student = F.kl_div(mixture, student_logp, reduction="none", log_target=True)
        pointwise = b * kl_teacher + (1 - b) * kl_student
    kept = _kept_rows(student_logp.shape[0], target, ignore_index, student_logp.device)
    return _reduce_rows(pointwise, kept, reduction)


def tvd(
    p: torch.Tensor,
    q: torch.Tensor,
    *,
    ignore_index: int = -100,
    target: torch.Tensor | None = None,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Total variation distance as torch ops: ``0.5 * (p - q).abs()``, rows masked and reduced as
    :func:`kernels_lib.tvd` (Liger ``LigerTVDLoss`` semantics). Autograd gives ``0.5 * sign(p - q)``
    (0 where equal), Liger's gradient. The published "torch" provider."""
    pointwise = 0.5 * (p - q).abs()
    kept = _kept_rows(p.shape[0], target, ignore_index, p.device)
    return _reduce_rows(pointwise, kept, reduction)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    inplace: bool = False,
    host_checks: bool = True,
) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` on the logits upcast to float32 (float64 stays float64),
    the loss in that dtype: both published baselines (``nn.CrossEntropyLoss`` on float32 logits in
    the ``cross_entropy`` chart, ``F.cross_entropy(logits.float())`` in ``megatron_cross_entropy``).
    It materializes the log-softmax and its gradient. With ``mean`` and every target ignored the
    result is NaN, as torch gives. ``inplace`` and ``host_checks`` are accepted and ignored."""
    del inplace, host_checks
    upcast = logits if logits.dtype == torch.float64 else logits.float()
    weight = None if weight is None else weight.to(upcast.dtype)
    return F.cross_entropy(
        upcast, target.long(), weight=weight, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing,
    )
