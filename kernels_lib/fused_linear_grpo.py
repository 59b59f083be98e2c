r"""Fused linear + GRPO (group relative policy optimization) without the ``B·T × V`` logits.

``x`` (``B × T × H``) holds the hidden states of ``B`` completions, ``target`` (``B × T``) the
sampled tokens (aligned, no shift). With the policy's per-token log-probs at temperature :math:`\tau`,
:math:`\ell_{kt} = \log\operatorname{softmax}((x_{kt}W^\top + b)/\tau)_{y_{kt}}`, the mask :math:`m_{kt}`
(``completion_mask`` times the valid targets, :math:`n_k = \sum_t m_{kt}`), advantages :math:`A_k` (or
:math:`A_{kt}`), the old policy's :math:`\ell^{\text{old}}` and the reference's :math:`\ell^{\text{ref}}`,

.. math::

    \rho_{kt} = \ell_{kt} - \ell^{\text{old}}_{kt} \ \ (\text{token}), \qquad
    \rho_{k} = \frac{\sum_t m_{kt}(\ell_{kt} - \ell^{\text{old}}_{kt})}{\max(1, n_k)} \ \ (\text{sequence}),
    \qquad c = e^{\rho},

    \mathcal{L}_{kt} = -\min\big(c A,\ \operatorname{clip}(c, 1 - \varepsilon_{\text{low}}, 1 + \varepsilon_{\text{high}})\,A\big)
        + \beta\,\big(e^{\ell^{\text{ref}}_{kt} - \ell_{kt}} - (\ell^{\text{ref}}_{kt} - \ell_{kt}) - 1\big),

    L = \sum_{kt} m_{kt}\, g_k\, \mathcal{L}_{kt},

with the normalization :math:`g_k` of ``loss_type``: ``grpo``, ``sapo`` :math:`1/(B \max(1, n_k))`;
``bnpo`` :math:`1/\max(1, \sum m)`; ``dr_grpo`` :math:`1/(B\,L_{\max})`; ``luspo`` :math:`1/B`;
``dapo``, ``cispo``, ``vespo`` :math:`1/N` (``num_items_in_batch``, else :math:`\max(1, \sum m)`).
``old_logps=None`` means one iteration per generation: :math:`\ell^{\text{old}} = \operatorname{sg}(\ell)`,
so :math:`c = 1` and the gradient is the advantage's. Other loss types replace the clipped term
(``sg``: detached): ``delta`` caps the first argument of the ``min`` at :math:`\min(c, \delta) A`;
``cispo`` is :math:`-\operatorname{sg}(\min(c, \varepsilon_{\text{high}}))\,A\,\ell`; ``sapo``
:math:`-\sigma(\tau_\pm (c - 1))\,\frac{4}{\tau_\pm} A` (:math:`\tau_+` where :math:`A > 0`);
``vespo`` :math:`-\operatorname{sg}(\varphi_k)\,A\,\ell` with the Gamma weight
:math:`\varphi = e^{\lambda + k\log w - \lambda w}` of the sequence's clamped log-ratio sum
:math:`\log w`. ``use_bias_correction_kl`` multiplies the KL term by :math:`c`. ``sampler_logps``
(the rollout engine's log-probs) adds the detached importance-sampling ratio
:math:`r = e^{m(\ell^{\text{old}} - \ell^{\text{sampler}})}` per token or per sequence, truncated or
masked outside ``[clip_min, clip_max]``, which multiplies the policy term (``vespo``: inside
:math:`w`). The outputs and metrics are TRL 1.16's ``GRPOTrainer`` ones
(:func:`kernels_lib.reference.fused_linear_grpo` is the float64 baseline).

Not here: ``top_entropy_quantile < 1`` (the entropy mask needs a quantile over every token before
the first chunk's weights), ``mask_truncated_completions`` (pass that ``completion_mask``), the
off-policy mask and the entropy bonus.

Gradient
--------
Each token's weight :math:`w_{kt} = \partial L / \partial \ell_{kt}` is derived by hand
(:func:`_token_weights`), with :math:`\lambda_{kt} = m_{kt} g_k`, :math:`t_1 = cA`,
:math:`t_2 = \operatorname{clip}(c)A`:

.. math::

    \frac{\partial \mathcal{L}}{\partial \rho} = -A\,c\,\big(s_1 + s_2\,[1-\varepsilon_{\text{low}} \le c \le 1+\varepsilon_{\text{high}}]\big),
    \qquad s_1 = [t_1 < t_2] + \tfrac12[t_1 = t_2], \quad s_2 = [t_2 < t_1] + \tfrac12[t_1 = t_2],

(torch's rules at ties: ``min`` splits the gradient between equal arguments, ``clamp`` passes it on
the closed range; a NaN ratio takes the first branch, so NaN reaches the gradients), then
:math:`w_{kt} = \lambda_{kt}\,\partial\mathcal{L}_{kt}/\partial\rho_{kt}` at the token level, or
:math:`\frac{m_{kt}}{\max(1, n_k)} \sum_{t'} \lambda_{kt'}\,\partial\mathcal{L}_{kt'}/\partial\rho_k` at
the sequence level, plus the KL's :math:`\lambda_{kt}\,\beta\,(1 - e^{\ell^{\text{ref}}_{kt} - \ell_{kt}})`.
Times :math:`\mathrm{onehot}(y) - \mathrm{softmax}` (and :math:`1/\tau`) this is ``dz``. The trade:
a few elementwise ops on the chunk's ``rows`` floats, where autograd of the per-token formula would
build and walk a graph per chunk; ``tests/test_fused_linear_grpo.py`` holds the two equal at ties,
for every loss type.

Design
------
:mod:`kernels_lib._sequence_logprobs` with per-token weights: chunks of whole sequences (a
sequence's weights need that sequence alone, and the normalizers are known before the first chunk),
one logits matmul per chunk, the stats pass's log-probs, the weights, the gradient pass and ``dx``,
``dW``, ``db`` in the same chunk: three matmuls, all in forward; backward only scales by
``grad_output``. A reference head goes through the same chunks first without gradient, keeping only
its ``B·T`` log-probs. Memory: one ``chunk × V`` logits buffer, the gradients and a few ``B × T``
float32 tensors. Deterministic: no atomics, fixed reduction orders.

Vocabulary-parallel (``process_group``, or DTensor heads): each rank holds rows of the policy's
``W`` (and ``b``) and the same rows of a reference head; per chunk the per-token log-probs are
merged over the ranks (:mod:`kernels_lib._vocab_parallel`), so the weights, the loss and the
metrics are the same on every rank; each rank keeps its ``dW``/``db`` slice and ``dx`` is summed
over the ranks once. The entropy (``return_entropy``) is not merged over the shards: refused there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
LEVELS = ("token", "sequence")
#: The loss types of TRL's clipped surrogate ``-min(c A, clip(c) A)``,
#: the ones ``delta`` and the clip-ratio metrics apply to.
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
#: The loss types divided by ``num_items_in_batch`` .
NUM_ITEMS_NORMALIZED = ("dapo", "cispo", "vespo")
SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclasses.dataclass(frozen=True)
class _GRPOOptions:
    """The non-tensor options of one call (the arguments of :func:`fused_linear_grpo` of the same names),
    read by name wherever the loss's formulas need them. Frozen: a call's options cannot change between
    its checks and the chunks that read them. As the caller gave them until
    :meth:`resolved`, whose copy holds the real numbers as floats (the formulas' arithmetic is then the
    same whatever number type was passed) and which gradients are wanted."""

    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    importance_sampling_level: str = "token"
    loss_type: str = "grpo"
    max_completion_length: int | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = False
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    top_entropy_quantile: float = 1.0
    temperature: float = 1.0
    ignore_index: int = -100
    return_entropy: bool = False
    return_per_token: bool = False
    chunk_size: int | None = None
    accurate: bool = False
    skip_ignored: bool = True
    needs: tuple[bool, bool, bool] = (False, False, False)  #: whether dx, dW, db are wanted

    def resolved(self, needs: tuple[bool, bool, bool]) -> "_GRPOOptions":
        """The validated options as the formulas take them: the real numbers as floats, and ``needs``."""
        floats = {k: float(getattr(self, k)) for k in _REAL_OPTIONS}
        floats.update({k: None if getattr(self, k) is None else float(getattr(self, k)) for k in _OPTIONAL_REAL_OPTIONS})
        return dataclasses.replace(self, **floats, needs=needs)


class GRPOOutput(NamedTuple):
    """The GRPO loss and what TRL logs beside it; float32, only ``loss`` carries a gradient. A metric TRL
    does not log for the loss type is None (the clip ratios outside :data:`CLIPPED`, ``cispo_clip_ratio``
    outside ``cispo``, ``vespo_phi_seq_mean`` outside ``vespo``)."""

    loss: torch.Tensor  #: a scalar (TRL's ``policy_loss``: before the gradient-accumulation division)
    per_token_logps: torch.Tensor  #: (B, T) the policy's log-probs, 0 at ignored targets (a next iteration's old_logps)
    clip_ratio_low_mean: torch.Tensor | None  #: ``clip_ratio/low_mean``
    clip_ratio_low_min: torch.Tensor | None  #: ``clip_ratio/low_min`` (nanmin over sequences)
    clip_ratio_high_mean: torch.Tensor | None  #: ``clip_ratio/high_mean``
    clip_ratio_high_max: torch.Tensor | None  #: ``clip_ratio/high_max`` (nanmax over sequences)
    clip_ratio_region_mean: torch.Tensor | None  #: ``clip_ratio/region_mean``
    kl: torch.Tensor | None  #: ``kl``, the mean per-token KL over the active tokens; None without a reference
    entropy: torch.Tensor | None  #: ``entropy``, the mean over the active tokens; None unless ``return_entropy``
    cispo_clip_ratio: torch.Tensor | None = None  #: ``cispo_clip_ratio`` (``loss_type='cispo'``)
    vespo_phi_seq_mean: torch.Tensor | None = None  #: ``vespo/phi_seq_mean`` (``loss_type='vespo'``)
    per_token: GRPOPerToken | None = None  #: the per-token values (``return_per_token=True``), else None


class GRPOPerToken(NamedTuple):
    """Per-token values of the GRPO pass, ``(B, T)``, no gradient (``return_per_token=True``), as TRL's
    ``_compute_loss`` forms them before its means: the clip ratios TRL logs are the means of the flags
    over the active tokens (``completion_mask`` times the valid targets), ``flags.sum() / active.sum()``.
    A sequence-level value (GSPO's ratio, a ``sequence_*`` sampling ratio) is repeated at each token."""

    importance_ratio: torch.Tensor  #: float32 ``coef_1 = exp(log_importance_weights)``, before ``delta``'s cap
    is_low_clipped: torch.Tensor | None  #: bool, ``coef_1 < 1 - epsilon_low`` and ``A < 0``, False at inactive tokens
    is_high_clipped: torch.Tensor | None  #: bool, ``coef_1 > 1 + epsilon_high`` and ``A > 0``; cispo: ``coef_1 > epsilon_high`` and ``A > 0``
    is_region_clipped: torch.Tensor | None  #: bool, either of the two; None outside the clipped loss types
    entropy: torch.Tensor | None  #: float32 per-token entropy, 0 at ignored targets (``return_entropy``), else None
    sampling_ratio: torch.Tensor | None  #: float32 the vLLM importance-sampling ratio (``sampler_logps``), else None


# --------------------------------------------------------------------------- TRL's expressions, on (B, T) floats


def _log_importance_weights(logp, old, mask, level: str):
    """The log-ratio per token, or its masked mean per sequence ``(B, 1)``.
    ``old`` None: the detached current log-probs (``logp - sg(logp)``: 0, of gradient 1; NaN where ``logp`` is
    not finite)."""
    log_ratio = logp - (logp.detach() if old is None else old)
    if level == "token":
        return log_ratio
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def _per_token_kl(logp, ref):
    """The per-token KL ``exp(ref - logp) - (ref - logp) - 1``."""
    return torch.exp(ref - logp) - (ref - logp) - 1


def _clip_bounds(opts):
    return 1 - opts.epsilon_low, 1 + opts.epsilon_high


def _sampling_ratio(logp, old, sampler, mask, opts):
    """The vLLM importance-sampling ratio (detached): ``old - sampler`` masked,
    NaN set to 0 (a token the sampler could not score: ratio 1), summed per sequence in the
    ``sequence_*`` modes, ``exp``, then clamped to ``[clip_min, clip_max]`` (``*_truncate``) or set to
    0 outside it (``*_mask``). ``old`` None: the current log-probs (TRL always computes
    ``old_per_token_logps`` with the correction on: the current policy's when ``num_iterations == 1``).
    None without ``sampler``."""
    if sampler is None:
        return None
    diff = torch.nan_to_num(((logp.detach() if old is None else old) - sampler) * mask, nan=0.0)
    mode = opts.vllm_importance_sampling_mode
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = opts.vllm_importance_sampling_clip_min, opts.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
    return ratio.masked_fill(outside, 0.0)


def _gamma_weights(advantages, logp, old, mask, ratio, opts):
    """TRL's ``get_gamma_weights``: VESPO's detached sequence weight
    :math:`\\varphi(w) = e^{\\lambda + k \\log w - \\lambda w}` with :math:`\\log w` the clamped sum of the
    sequence's log-ratios (plus the clamped log sampling ratios), ``k``, ``λ`` by the sign of ``A``."""
    lower = math.log(1e-8)
    log_ratio = logp.detach() - (logp.detach() if old is None else old)
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if ratio is not None:
        seq = seq + torch.clamp(torch.log(ratio), lower, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, opts.vespo_k_pos, opts.vespo_k_neg)
    lam = torch.where(nonneg, opts.vespo_lambda_pos, opts.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _sapo_temperatures(advantages, opts):
    """``sapo_temperature_pos`` where ``A > 0``, else ``sapo_temperature_neg``."""
    return torch.where(advantages > 0, opts.sapo_temperature_pos, opts.sapo_temperature_neg)


def _per_token_loss(logp, old, ref, sampler, advantages, mask, opts):
    """TRL's per-token loss: ``(per_token_loss, kl, metrics)`` (kl None without a reference; metrics
    the loss type's tensors by :class:`GRPOOutput` name, before their means)."""
    coef_1 = torch.exp(_log_importance_weights(logp, old, mask, opts.importance_sampling_level))
    kl = None if ref is None else _per_token_kl(logp, ref)
    if kl is not None and opts.use_bias_correction_kl:
        kl = kl * coef_1  # before delta clamps coef_1
    ratio = _sampling_ratio(logp, old, sampler, mask, opts)
    loss_type, metrics = opts.loss_type, {}
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=opts.epsilon_high).detach() * advantages * logp
        metrics["cispo_clip_ratio"] = ((coef_1 > opts.epsilon_high) & (advantages > 0)).to(mask.dtype)
    elif loss_type in CLIPPED:
        low, high = _clip_bounds(opts)
        coef_2 = torch.clamp(coef_1, low, high)
        if opts.delta is not None:
            coef_1 = torch.clamp(coef_1, max=opts.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        metrics["coef_1"] = coef_1  # the clip ratios read the delta-clamped ratio
    elif loss_type == "sapo":
        temperatures = _sapo_temperatures(advantages, opts)
        per_token_loss = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * advantages
    else:  # vespo
        phi = _gamma_weights(advantages, logp, old, mask, ratio, opts)
        per_token_loss = -phi * advantages * logp
        metrics["vespo_phi_seq_mean"] = phi
    if ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * ratio
    if opts.beta != 0.0:
        per_token_loss = per_token_loss + opts.beta * kl
    return per_token_loss, kl, metrics


def _normalized(per_token_loss, mask, opts, normalizer):
    """The loss type's normalization of the masked per-token losses."""
    loss_type = opts.loss_type
    if loss_type in ("grpo", "sapo"):
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * opts.max_completion_length)
    if loss_type == "luspo":
        return (per_token_loss * mask).sum(-1).mean()
    return (per_token_loss * mask).sum() / normalizer


def _masked_seq_mean(x, mask):
    """TRL's per-sequence masked mean (the ``(B, 1)`` case unmasked)."""
    if x.shape[1] == 1:
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)


def _global_masked_mean(x, mask):
    """TRL's masked mean over the batch on one process (as tensors, not ``.item()``)."""
    if x.shape[1] == 1:
        local_sum, local_count = x.sum(), torch.full((), float(x.shape[0]), device=x.device, dtype=x.dtype)
    else:
        local_sum, local_count = (x * mask).sum(), mask.sum().to(x.dtype)
    return local_sum / local_count.clamp(min=1.0)


def _nan_extreme(x, fn):
    """``trl.trainer.utils.nanmin`` / ``nanmax``: over the non-NaN values, NaN when there are none
    (formed with ``where``, not by indexing: no host sync)."""
    nan = torch.isnan(x)
    value = fn(torch.where(nan, float("inf") if fn is torch.min else -float("inf"), x))
    return torch.where(nan.all(), float("nan"), value)


#: The clip-ratio metrics of :data:`CLIPPED`, by their :class:`GRPOOutput` names.
CLIP_METRICS = ("clip_ratio_low_mean", "clip_ratio_low_min", "clip_ratio_high_mean", "clip_ratio_high_max",
                "clip_ratio_region_mean")


def clip_metrics(coef_1, advantages, mask, opts):
    """The low/high/region clip ratios (means), low min and high max over sequences, by
    their :class:`GRPOOutput` names."""
    low, high = _clip_bounds(opts)
    is_low = ((coef_1 < low) & (advantages < 0)).to(mask.dtype)
    is_high = ((coef_1 > high) & (advantages > 0)).to(mask.dtype)
    is_region = ((is_low > 0) | (is_high > 0)).to(mask.dtype)
    return {
        "clip_ratio_low_mean": _global_masked_mean(is_low, mask),
        "clip_ratio_low_min": _nan_extreme(_masked_seq_mean(is_low, mask), torch.min),
        "clip_ratio_high_mean": _global_masked_mean(is_high, mask),
        "clip_ratio_high_max": _nan_extreme(_masked_seq_mean(is_high, mask), torch.max),
        "clip_ratio_region_mean": _global_masked_mean(is_region, mask),
    }


# --------------------------------------------------------------------------- the gradient weights


def _token_weights(logp, old, ref, sampler, advantages, mask, scale, opts):
    """``∂L/∂ℓ_kt`` of a block of whole sequences (see the module docstring); ``scale`` is ``g_k`` ``(S, 1)``.

    ``d_rho`` collects ``∂L/∂ρ`` per element of the ratio's broadcast ``(S, T)`` (a sequence-level ratio
    is summed over its tokens, then spread by ``∂ρ_k/∂ℓ_kt = m_kt / n_k``), ``w`` the direct ``∂L/∂ℓ``."""
    lam = mask * scale
    level, loss_type = opts.importance_sampling_level, opts.loss_type
    n = mask.sum(-1, keepdim=True).clamp(min=1.0)
    coef_1 = torch.exp(_log_importance_weights(logp, old, mask, level))
    ratio = _sampling_ratio(logp, old, sampler, mask, opts)
    lam_policy = lam if ratio is None or loss_type == "vespo" else lam * ratio
    w = torch.zeros_like(logp)
    d_rho = None
    if loss_type == "cispo":  # ∂(-c̄ A ℓ)/∂ℓ, c̄ = min(c, ε_high) detached
        w = w + lam_policy * (-torch.clamp(coef_1, max=opts.epsilon_high) * advantages)
    elif loss_type == "vespo":  # ∂(-φ A ℓ)/∂ℓ, φ detached
        w = w + lam_policy * (-_gamma_weights(advantages, logp, old, mask, ratio, opts) * advantages)
    elif loss_type == "sapo":  # ∂/∂ρ of -σ(τ(c-1)) 4/τ A: -4 A c σ(1-σ)
        sig = torch.sigmoid(_sapo_temperatures(advantages, opts) * (coef_1 - 1))
        d_rho = lam_policy * (-4.0 * advantages * coef_1 * sig * (1 - sig))
    else:
        low, high = _clip_bounds(opts)
        delta = opts.delta
        capped = coef_1 if delta is None else torch.clamp(coef_1, max=delta)
        t1 = capped * advantages
        t2 = torch.clamp(coef_1, low, high) * advantages
        tie = t1 == t2
        # torch's backward of min(t1, t2): t1 > t2 gets 0, a tie half, else all (NaN passes through on t1)
        s1 = torch.where(t1 > t2, 0.0, torch.where(tie, 0.5, 1.0))
        if delta is not None:  # clamp(max=delta) passes the gradient where c <= delta
            s1 = s1 * (coef_1 <= delta)
        s2 = torch.where(t2 > t1, 0.0, torch.where(tie, 0.5, 1.0)) * ((coef_1 >= low) & (coef_1 <= high))
        d_rho = lam_policy * (-(s1 + s2) * advantages * coef_1)
    if opts.beta != 0.0:
        d_kl = -lam * opts.beta * torch.expm1(ref - logp)  # ∂KL/∂ℓ = 1 - e^{ref - ℓ}
        if opts.use_bias_correction_kl:  # β KL c: c ∂KL/∂ℓ, and β KL c through ρ
            w = w + d_kl * coef_1
            bias_term = lam * opts.beta * _per_token_kl(logp, ref) * coef_1
            d_rho = bias_term if d_rho is None else d_rho + bias_term
        else:
            w = w + d_kl
    if d_rho is not None:
        if level == "token":
            w = w + d_rho
        else:
            w = w + d_rho.expand_as(logp).sum(-1, keepdim=True) / n * mask
    return w


def _sequence_scale(mask, opts, normalizer):
    """``g_k`` ``(B, 1)``: the factor of sequence k's masked per-token losses in the loss."""
    n_seqs = mask.shape[0]
    loss_type = opts.loss_type
    if loss_type in ("grpo", "sapo"):
        return 1.0 / (n_seqs * mask.sum(-1, keepdim=True).clamp(min=1.0))
    if loss_type == "bnpo":
        scale = 1.0 / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        scale = torch.full((), 1.0 / (n_seqs * opts.max_completion_length), device=mask.device, dtype=mask.dtype)
    elif loss_type == "luspo":
        scale = torch.full((), 1.0 / n_seqs, device=mask.device, dtype=mask.dtype)
    else:
        scale = 1.0 / normalizer
    return scale.reshape(1, 1).expand(n_seqs, 1)


# --------------------------------------------------------------------------- the pipeline


class _GRPOInputs(NamedTuple):
    """The call's non-differentiable inputs, by name: float32 ``(B, T)`` tensors unless said otherwise."""

    target: torch.Tensor  #: (B, T) targets
    mask: torch.Tensor  #: the completion mask times the valid targets
    advantages: torch.Tensor  #: (B, 1) or (B, T)
    old: torch.Tensor | None  #: the sampling policy's log-probs, or None (the current ones, detached)
    ref: torch.Tensor | None  #: the reference's log-probs, or None
    sampler: torch.Tensor | None  #: the rollout engine's log-probs, or None
    normalizer: torch.Tensor  #: a device scalar: num_items_in_batch, or the active tokens
    shard: VocabShard | None  #: this rank's slice of a vocabulary-parallel head, or None


def _token_coefficients(inputs: _GRPOInputs, opts: _GRPOOptions, scale, rows: slice, logp) -> torch.Tensor:
    """The pipeline's per-token weights of the chunk's ``rows`` (whole sequences) from their log-probs:
    :func:`_token_weights` on the chunk's ``(S_c, T)`` block."""
    seq_len = inputs.target.shape[1]
    seqs = slice(rows.start // seq_len, rows.stop // seq_len)

    def pick(t):
        return None if t is None else t[seqs]

    return _token_weights(
        logp.view(-1, seq_len), pick(inputs.old), pick(inputs.ref), pick(inputs.sampler), inputs.advantages[seqs],
        inputs.mask[seqs], scale[seqs], opts,
    ).reshape(-1).to(torch.float32)


def _forward(x, weight, bias, inputs: _GRPOInputs, opts: _GRPOOptions) -> SequenceLossResult:
    """The forward of :class:`FusedSequenceLoss`: per-token log-probs, weights and gradients chunk by
    chunk, then the loss and the metrics from the ``(B, T)`` log-probs, as a :class:`GRPOOutput`."""
    n_seqs, seq_len = inputs.target.shape
    mask, advantages, old, ref, sampler = inputs.mask, inputs.advantages, inputs.old, inputs.ref, inputs.sampler
    scale = _sequence_scale(mask, opts, inputs.normalizer)
    rows = x.reshape(-1, x.shape[-1])
    logps = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    entropy = torch.empty_like(logps) if opts.return_entropy else None
    _, _, grads = sequence_logprobs(
        rows, weight, bias, inputs.target.reshape(-1), seq_len=seq_len, ignore_index=opts.ignore_index,
        rows_per_chunk=chunk_rows(opts.chunk_size, seq_len, rows.shape[0], weight.shape[1]),
        needs=opts.needs, accurate=opts.accurate, logit_scale=1.0 / opts.temperature,
        token_coefficients=functools.partial(_token_coefficients, inputs, opts, scale) if any(opts.needs) else None,
        token_logps=logps, token_entropy=entropy, shard=inputs.shard, skip_ignored=opts.skip_ignored,
    )
    logps = logps.view(n_seqs, seq_len)
    entropy = None if entropy is None else entropy.view(n_seqs, seq_len)
    per_token_loss, kl, metrics = _per_token_loss(logps, old, ref, sampler, advantages, mask, opts)
    clipped = clip_metrics(metrics["coef_1"], advantages, mask, opts) if "coef_1" in metrics else {}
    outputs = GRPOOutput(
        loss=_normalized(per_token_loss, mask, opts, inputs.normalizer),
        per_token_logps=logps,
        **{name: clipped.get(name) for name in CLIP_METRICS},
        kl=None if kl is None else _global_masked_mean(kl, mask),
        entropy=None if entropy is None else _global_masked_mean(entropy, mask),
        **{name: _global_masked_mean(metrics[name], mask) if name in metrics else None
           for name in ("cispo_clip_ratio", "vespo_phi_seq_mean")},
        per_token=_per_token_values(logps, old, sampler, advantages, mask, metrics, entropy, opts)
        if opts.return_per_token else None,
    )
    if grads is not None and grads[0] is not None:
        grads = (grads[0].view(x.shape), *grads[1:])
    return SequenceLossResult(outputs, grads)


def _per_token_values(logps, old, sampler, advantages, mask, metrics, entropy, opts) -> GRPOPerToken:
    """:class:`GRPOPerToken`: the ratio, the flags where the loss type has them, the entropy, the sampling
    ratio, each ``(B, T)`` (None where absent)."""
    shape = logps.shape
    active = mask != 0
    ratio = torch.exp(_log_importance_weights(logps, old, mask, opts.importance_sampling_level))
    is_low = is_high = is_region = None
    if "coef_1" in metrics:  # the delta-capped ratio, as TRL's clip ratios read it
        low, high = _clip_bounds(opts)
        coef = metrics["coef_1"]
        is_low = ((coef < low) & (advantages < 0)).expand(shape) & active
        is_high = ((coef > high) & (advantages > 0)).expand(shape) & active
        is_region = is_low | is_high
    elif "cispo_clip_ratio" in metrics:
        is_high = (metrics["cispo_clip_ratio"] > 0).expand(shape) & active
    sampling = _sampling_ratio(logps, old, sampler, mask, opts)
    return GRPOPerToken(
        importance_ratio=ratio.expand(shape).contiguous(), is_low_clipped=is_low, is_high_clipped=is_high,
        is_region_clipped=is_region, entropy=entropy,
        sampling_ratio=None if sampling is None else sampling.expand(shape).contiguous(),
    )


# --------------------------------------------------------------------------- checks


def _require_bt_float(name, tensor, shape):
    v.require_tensor(name, tensor)
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor; got {tensor.dtype}")
    v.require_shape(name, tensor, shape, "(B, T) = target.shape")


def _validate_tensors(x, weight, target, bias, advantages, old_logps, ref_logps, sampler_logps, completion_mask, ref_model) -> dict:
    """The tensors' types and shapes; returns them by name (for the device check)."""
    v.require_linear_loss_inputs(x, weight, target, x_ndim=3)
    tensors = {"x": x, "weight": weight, "target": target}
    if bias is not None:
        v.require_bias("bias", bias, weight)
        tensors["bias"] = bias
    v.require_tensor("advantages", advantages)
    if not advantages.is_floating_point():
        raise TypeError(f"advantages must be a floating tensor; got {advantages.dtype}")
    if advantages.shape not in (target.shape[:1], target.shape):
        raise ValueError(
            f"advantages must have shape (B,) = {tuple(target.shape[:1])} or (B, T) = {tuple(target.shape)}; "
            f"got {tuple(advantages.shape)}"
        )
    tensors["advantages"] = advantages
    for name, tensor in (("old_logps", old_logps), ("sampler_logps", sampler_logps)):
        if tensor is not None:
            _require_bt_float(name, tensor, target.shape)
            tensors[name] = tensor
    if completion_mask is not None:
        v.require_tensor("completion_mask", completion_mask)
        if completion_mask.is_complex():
            raise TypeError(f"completion_mask must be a bool, integer or floating tensor; got {completion_mask.dtype}")
        v.require_shape("completion_mask", completion_mask, target.shape, "(B, T) = target.shape")
        tensors["completion_mask"] = completion_mask
    ref_x, ref_weight, ref_bias = ref_model
    tensors.update(validate_reference(x, target, weight, ref_x, ref_weight, ref_bias, ref_logps, per_token=True,
                                      required=False))
    return tensors


def _require_positive(name, value) -> None:
    v.require_real(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0; got {value!r}")


def _validate_sampling_options(opts, has_sampler: bool) -> None:
    """TRL's checks of the vLLM correction's options."""
    mode = opts.vllm_importance_sampling_mode
    v.require_choice("vllm_importance_sampling_mode", mode, SAMPLING_MODES)
    low, high = opts.vllm_importance_sampling_clip_min, opts.vllm_importance_sampling_clip_max
    for name, value in (("vllm_importance_sampling_clip_min", low), ("vllm_importance_sampling_clip_max", high)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{name} must be None or a finite real number; got {value!r}")
    if low is not None and high is not None and low >= high:
        raise ValueError(
            f"vllm_importance_sampling_clip_min ({low}) must be less than vllm_importance_sampling_clip_max ({high})"
        )
    if mode.endswith("truncate") and low is None and high is None:
        raise ValueError(
            f"vllm_importance_sampling_mode={mode!r} clamps the ratio: give vllm_importance_sampling_clip_min "
            "or vllm_importance_sampling_clip_max (both are None)"
        )
    if has_sampler and opts.loss_type == "vespo" and mode.startswith("sequence"):
        raise ValueError(
            f"loss_type='vespo' takes the token-level sampling ratios: vllm_importance_sampling_mode must be "
            f"'token_truncate' or 'token_mask'; got {mode!r}"
        )


def _validate_options(opts, has_reference: bool, num_items_in_batch, has_sampler: bool = False) -> None:
    v.require_real("beta", opts.beta)
    v.require_real("epsilon_low", opts.epsilon_low)
    v.require_real("epsilon_high", opts.epsilon_high)
    v.require_choice("importance_sampling_level", opts.importance_sampling_level, LEVELS)
    v.require_choice("loss_type", opts.loss_type, LOSS_TYPES)
    delta = opts.delta
    if delta is not None:
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta):
            raise TypeError(f"delta must be None or a finite real number; got {delta!r}")
        if delta <= 0:
            raise ValueError(f"delta must be > 0 (TRL recommends > 1 + epsilon_high); got {delta!r}")
        if opts.loss_type not in CLIPPED:
            raise ValueError(
                f"delta caps the ratio of the clipped loss types {', '.join(map(repr, CLIPPED))}; "
                f"loss_type={opts.loss_type!r} has no such term (TRL ignores delta there): give delta=None"
            )
    _require_positive("sapo_temperature_pos", opts.sapo_temperature_pos)
    _require_positive("sapo_temperature_neg", opts.sapo_temperature_neg)
    for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        v.require_real(name, getattr(opts, name))
    v.require_bool("use_bias_correction_kl", opts.use_bias_correction_kl)
    _validate_sampling_options(opts, has_sampler)
    quantile = opts.top_entropy_quantile
    v.require_real("top_entropy_quantile", quantile)
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1]; got {quantile!r}")
    if quantile < 1.0:
        raise ValueError(
            f"top_entropy_quantile={quantile!r} < 1 masks the tokens below a quantile of the entropies over the "
            "whole batch (TRL's get_high_entropy_mask, across processes): the weights of the first chunk would "
            "need every chunk's entropies, so it cannot be formed chunk by chunk; only top_entropy_quantile=1.0 "
            "(no entropy mask) is supported"
        )
    v.require_real("temperature", opts.temperature)
    if opts.temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {opts.temperature}")
    v.require_int("ignore_index", opts.ignore_index)
    v.require_chunk_options(opts.chunk_size, opts.accurate)
    v.require_bool("skip_ignored", opts.skip_ignored)
    v.require_bool("return_entropy", opts.return_entropy)
    v.require_bool("return_per_token", opts.return_per_token)
    length = opts.max_completion_length
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise ValueError(f"max_completion_length must be None or a positive int; got {length!r}")
    if opts.loss_type == "dr_grpo" and length is None:
        raise ValueError("loss_type='dr_grpo' divides by B * max_completion_length: give max_completion_length")
    if opts.beta != 0.0 and not has_reference:
        raise ValueError(f"beta={opts.beta} needs the reference: ref_logps, or ref_x and ref_weight")
    if num_items_in_batch is not None:
        if opts.loss_type not in NUM_ITEMS_NORMALIZED:
            raise ValueError(
                f"num_items_in_batch is the normalizer of loss_type 'dapo', 'cispo' or 'vespo'; "
                f"got loss_type={opts.loss_type!r}"
            )
        if isinstance(num_items_in_batch, torch.Tensor):
            if num_items_in_batch.numel() != 1 or num_items_in_batch.is_complex():
                raise ValueError(
                    f"num_items_in_batch must be a positive number or a one-element real tensor; got "
                    f"{num_items_in_batch.dtype} {tuple(num_items_in_batch.shape)}"
                )
        else:
            v.require_real("num_items_in_batch", num_items_in_batch)
            if num_items_in_batch <= 0:
                raise ValueError(f"num_items_in_batch must be > 0; got {num_items_in_batch}")


_REAL_OPTIONS = (
    "beta", "epsilon_low", "epsilon_high", "temperature", "sapo_temperature_pos", "sapo_temperature_neg",
    "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "top_entropy_quantile",
)
_OPTIONAL_REAL_OPTIONS = ("delta", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")


@shared_arguments
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
    skip_ignored: bool = True,
    process_group=None,
) -> GRPOOutput:
    """GRPO loss of the head ``x @ weight.T + bias`` as TRL 1.16's ``GRPOTrainer`` computes it, never materializing the logits.

    Args:
        x: ``(B, T, H)`` hidden states of the completion tokens; float32, bfloat16 or float16.
            Gradients flow to it.
        weight: the head ``(V, H)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        target: ``(B, T)`` int64/int32 completion token ids aligned with ``x`` (no shift inside),
            each in ``[0, V)`` or ``ignore_index`` (padding: masked, log-prob 0, as TRL's ``-100``
            labels). A sequence with no valid token is allowed (it adds 0, as in TRL).
        bias: optional ``(V,)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        advantages: ``(B,)`` (or ``(B, T)``, as TRL accepts from subclasses), detached.
        old_logps: ``(B, T)`` the sampling policy's per-token log-probs (TRL's
            ``old_per_token_logps``), detached; None: the current ones detached (TRL with
            ``num_iterations == 1``: the ratio is 1, its gradient the advantage).
        ref_logps: ``(B, T)`` the reference model's per-token log-probs (TRL's
            ``ref_per_token_logps``), detached. Or instead:
        ref_x, ref_weight, ref_bias: the reference model's hidden states ``(B, T, H_ref)``, head
            ``(V, H_ref)`` and optional bias, run without gradient at the same temperature.
        completion_mask: ``(B, T)`` bool/int/float (TRL's ``completion_mask``, times its
            ``tool_mask`` if any, zeroed for truncated completions under TRL's
            ``mask_truncated_completions``); None: all ones. Multiplied by the valid-target mask.
        sampler_logps: ``(B, T)`` the rollout engine's per-token log-probs (TRL's
            ``sampling_per_token_logps``), detached; given, TRL's vLLM importance-sampling
            correction is applied (``vllm_importance_sampling_correction=True``); None: none.
        beta: the KL coefficient (TRL's default 0.0); non-zero needs the reference.
        epsilon_low, epsilon_high: the clip range ``[1 - epsilon_low, 1 + epsilon_high]`` (TRL's
            ``epsilon`` and ``epsilon_high``); for ``cispo``, ``epsilon_high`` is the cap of the ratio.
        delta: None, or the cap of the unclipped ratio (two-sided clipping; > 0, TRL recommends
            > 1 + epsilon_high); only for grpo, bnpo, dr_grpo, dapo, luspo (refused otherwise).
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO: the masked mean log-ratio
            per sequence). TRL warns that ``sequence`` with ``bnpo``/``dr_grpo``/``dapo`` weights
            sequences by length; it is computed as TRL does.
        loss_type: ``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``, ``"cispo"``, ``"sapo"``,
            ``"luspo"`` or ``"vespo"`` (above). TRL warns that ``luspo`` wants the sequence level and
            ``vespo`` the token level; both levels are computed as TRL does.
        max_completion_length: ``dr_grpo``'s ``L_max`` (required there; TRL's config value).
        num_items_in_batch: ``dapo``'s normalizer (a positive number or a one-element tensor, read
            on the device): TRL divides by ``inputs["num_items_in_batch"].clamp(min=1) /
            num_processes`` (times ``current_gradient_accumulation_steps / steps_per_generation`` in
            training); give that value (also for ``cispo`` and ``vespo``). None: this batch's active
            tokens (at least 1).
        sapo_temperature_pos, sapo_temperature_neg: ``sapo``'s gate temperatures (> 0; TRL's 1.0, 1.05).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: ``vespo``'s Gamma weight
            (TRL's 2.0, 3.0, 3.0, 2.0; λ clamped at 1e-4 as TRL does).
        use_bias_correction_kl: the KL times the ratio (TRL's default True; False here, the
            Liger-comparable loss of the charts).
        vllm_importance_sampling_mode: ``"token_truncate"``, ``"token_mask"``,
            ``"sequence_truncate"`` or ``"sequence_mask"`` (TRL's default); ``vespo`` takes the token
            modes only. Used with ``sampler_logps``.
        vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max: the bounds (None or a
            number; min < max; a ``*_truncate`` mode needs one). TRL's None and 3.0.
        top_entropy_quantile: 1.0 only (TRL's default, no entropy mask); below 1 is refused: the
            quantile over all tokens cannot be formed chunk by chunk.
        temperature: the logits (policy and reference) are divided by it, as TRL's fused head does.
        ignore_index: target value of padding positions.
        return_entropy: also compute the mean entropy over the active tokens (TRL's ``entropy``
            metric; one more accumulator in the stats pass).
        return_per_token: also return :class:`GRPOPerToken` in ``per_token``: the importance ratios,
            the clip flags, the entropy (with ``return_entropy``) and the sampling ratio per token,
            from the same pass (no gradient; for a differentiable entropy, see
            :func:`kernels_lib.fused_linear_token_logprobs`).
        chunk_size: rows (tokens) per logits chunk, rounded down to whole sequences, at least one;
            None for the default (H / 2 rows, at least 1024).
        accurate: accumulate ``dW``/``db`` in float32 across chunks.
        skip_ignored: <shared>
            The positions only ``completion_mask`` leaves out still run (their ``per_token_logps`` are
            read); give them ``ignore_index`` in ``target`` to drop them too (they then read 0).
        process_group: split the vocabulary over this ``torch.distributed`` group (or None with
            DTensor heads sharded ``(Shard(0),)`` over a 1-D mesh): ``weight`` ``(V_r, H)``, ``bias``,
            ``ref_weight`` ``(V_r, H_ref)`` and ``ref_bias`` are this rank's rows (the same rows of
            both heads), in group-rank order, of any sizes; ``x``, ``target`` (global ids), the other
            tensors and the options are the same on every rank, and so are the outputs. ``dx`` comes
            back complete on every rank, ``dW``/``db`` as the local slices. Every option works but
            ``return_entropy`` (refused: the entropy needs a second per-row sum over the shards).
            Wire: once per call an all_gather of 13 int64 per rank (the checks over the ranks); per
            chunk and row 3 float32 (the shards' lse max, sum-exp, the target's logit from its
            owner), for the policy and again for a reference head; once ``dx`` (``B·T × H``).

    Returns:
        :class:`GRPOOutput`: the float32 loss and the metrics TRL logs for the loss type (no
        gradient; the others None). NaN in the inputs
        gives a NaN loss, as in TRL. With ``T = 1`` TRL's metric helpers take the ``(B, 1)`` branch
        (an unmasked mean over the B sequences); so do these.

    Raises:
        TypeError: a non-tensor, a wrong dtype (naming the argument), an option of the wrong type.
        ValueError: shapes that do not fit, tensors on different devices, targets out of range, an
            unknown ``loss_type``, level or sampling mode, ``dr_grpo`` without ``max_completion_length``,
            ``beta != 0`` without a reference, both or an incomplete reference, ``num_items_in_batch``
            outside dapo/cispo/vespo, ``delta`` outside the clipped types, bad clip bounds,
            ``top_entropy_quantile < 1``.
    """
    opts = _GRPOOptions(
        beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
        importance_sampling_level=importance_sampling_level, loss_type=loss_type,
        max_completion_length=max_completion_length, sapo_temperature_pos=sapo_temperature_pos,
        sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos,
        vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg, use_bias_correction_kl=use_bias_correction_kl,
        vllm_importance_sampling_mode=vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_min=vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=vllm_importance_sampling_clip_max, top_entropy_quantile=top_entropy_quantile,
        temperature=temperature, ignore_index=ignore_index, return_entropy=return_entropy, chunk_size=chunk_size,
        accurate=accurate, return_per_token=return_per_token, skip_ignored=skip_ignored,
    )

    def check_arguments(heads):
        tensors = _validate_tensors(
            x, heads["weight"], target, heads["bias"], advantages, old_logps, ref_logps, sampler_logps,
            completion_mask, (ref_x, heads["ref_weight"], heads["ref_bias"]),
        )
        has_reference = ref_logps is not None or ref_x is not None
        _validate_options(opts, has_reference, num_items_in_batch, has_sampler=sampler_logps is not None)
        if isinstance(num_items_in_batch, torch.Tensor):
            tensors["num_items_in_batch"] = num_items_in_batch
        v.require_same_device(tensors)
        if process_group is not None or vp.is_dtensor(weight):
            if return_entropy:
                raise NotImplementedError(
                    "return_entropy with a vocabulary-parallel head (process_group or a DTensor weight): the "
                    "entropy would need a second per-row sum over the shards; not implemented"
                )

    present = [t is not None for t in (bias, old_logps, ref_logps, ref_x, ref_bias, completion_mask, sampler_logps)]
    heads, shard = vp.shard_heads(
        process_group, {"weight": weight, "bias": bias, "ref_weight": ref_weight, "ref_bias": ref_bias}, check_arguments,
        rows=lambda: x.shape[0] * x.shape[1], targets=lambda: {"target": target}, ignore_index=ignore_index,
        options=lambda: (opts, present, x.dtype, wanted_grads(x, weight, bias)),
    )
    weight, bias = heads["weight"], heads["bias"]
    opts = opts.resolved(wanted_grads(x, weight, bias))
    n_cols = weight.shape[0] if shard is None else shard.n_classes
    # The range alone: a sequence without a valid token is allowed (TRL clamps its token count to 1: it adds 0).
    check = v.check_targets(target, n_cols, ignore_index)
    mask = check.valid.to(torch.float32)
    if completion_mask is not None:
        mask = mask * completion_mask.detach().to(torch.float32)
    if ref_logps is not None:
        ref = ref_logps.detach().to(torch.float32)
    elif ref_x is not None:
        ref = reference_sums(ref_x, heads["ref_weight"], heads["ref_bias"], target, ignore_index=ignore_index,
                             chunk_size=chunk_size, shard=shard, logit_scale=1.0 / opts.temperature, per_token=True,
                             skip_ignored=opts.skip_ignored)
    else:
        ref = None
    adv = advantages.detach().to(torch.float32)
    inputs = _GRPOInputs(
        target=target, mask=mask, advantages=adv.unsqueeze(1) if adv.dim() == 1 else adv,
        old=None if old_logps is None else old_logps.detach().to(torch.float32), ref=ref,
        sampler=None if sampler_logps is None else sampler_logps.detach().to(torch.float32),
        normalizer=mask.sum().clamp(min=1.0) if num_items_in_batch is None
        else v.device_scalar(num_items_in_batch, x.device),
        shard=shard,
    )
    out = fused_sequence_loss(x, weight, bias, SequenceLossCall(_forward, inputs, opts))
    check.raise_if_bad()  # the targets' range, read now that the call's kernels are queued
    return out


FusedLinearGRPOLoss = loss_module(
    fused_linear_grpo, "FusedLinearGRPOLoss",
    "``nn.Module`` form of :func:`fused_linear_grpo`: the module holds the options only (checked at construction, "
    "a reference assumed); the tensors go to ``forward`` by keyword.",
    check=lambda **options: _validate_options(_GRPOOptions(**options), has_reference=True, num_items_in_batch=None),
)
