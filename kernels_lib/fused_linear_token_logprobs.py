r"""Per-token log-probabilities and entropy of a linear head at a temperature, both differentiable.

What RL code reads off the policy's head, token by token: with rows :math:`x_i` (any leading shape),
head :math:`W, b`, temperature :math:`\tau` and targets :math:`y_i`,

.. math::

    c_i = (x_i W^\top + b)/\tau, \qquad
    \ell_i = \log\operatorname{softmax}(c_i)_{y_i} = c_{i y_i} - \operatorname{lse}(c_i), \qquad
    H_i = \operatorname{lse}(c_i) - \sum_j p_{ij} c_{ij},

each 0 where :math:`y_i` is ``ignore_index`` (as TRL's fused head gives them: ``add_fused_lm_head``'s
``masked_fill(~mask, 0)``, ``trl/trainer/utils.py`` 1642–1660). An upstream gradient :math:`g_i` on
:math:`\ell_i` and :math:`e_i` on :math:`H_i` reaches the logits as

.. math::

    \frac{\partial L}{\partial c_{ij}} = g_i(\delta_{j y_i} - p_{ij}) - e_i\, p_{ij}(\log p_{ij} + H_i),

then :math:`1/\tau` through the scaled logits, so a loss may use the log-probs (a policy-gradient
term), the entropy (an entropy bonus :math:`-\alpha \sum H`) or both.

Design: this is the ``reduction="none"`` path of :func:`~kernels_lib.fused_linear_cross_entropy`
with its token statistics (the one that serves :func:`kernels_lib.hf.add_fused_lm_head`, TRL's
fused-head protocol), not a second pipeline: ``ℓ = -loss`` and ``H = entropy`` come from the pass
over each logits chunk that forms the log-sum-exp, forward keeps one float per row, and backward
recomputes the logits chunk by chunk and writes :math:`\partial L/\partial c` above in place (one
matmul more than the fused losses, which cannot know :math:`g, e` in forward). Without
``return_entropy`` the token statistics are not formed. The GRPO loss reads its per-token
log-probs inside its own pass (:func:`kernels_lib.fused_linear_grpo`). Positions whose target is
``ignore_index`` are dropped before the matmuls (the fused loss's ``skip_ignored``: one host sync per
call counts them), so a completion's prompt and padding cost nothing. This function is for the
code around it: a next iteration's ``old_logps``, an entropy bonus, a custom objective.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _validate as v
from .fused_linear_cross_entropy import fused_linear_cross_entropy


class TokenLogprobsOutput(NamedTuple):
    """Per-token values of the target's shape, float32, 0 at ignored targets, each with a gradient."""

    logps: torch.Tensor  #: :math:`\log\operatorname{softmax}(c)_y`
    entropy: torch.Tensor | None  #: :math:`H` of :math:`\operatorname{softmax}(c)`; None unless ``return_entropy``


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
) -> TokenLogprobsOutput:
    """Per-token log-probs (and entropy) of ``softmax((x @ weight.T + bias) / temperature)``, never materializing the logits.

    Args:
        x: ``(..., H)`` hidden states; float32, bfloat16 or float16. Gradients flow to it.
        weight: the head ``(V, H)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        target: ``x.shape[:-1]`` int64/int32 token ids aligned with the rows (no shift inside), each
            in ``[0, V)`` or ``ignore_index``.
        bias: optional ``(V,)``. Gradients flow to it.
        temperature: ``τ > 0``; the logits are divided by it (a sampler's temperature).
        ignore_index: target value of positions that give 0 (log-prob and entropy) and no gradient.
        return_entropy: also the entropy of each token's distribution, with its gradient.
        chunk_size, accurate: as :func:`~kernels_lib.fused_linear_cross_entropy`.

    Returns:
        :class:`TokenLogprobsOutput` ``(logps, entropy)``, float32, ``target``'s shape.

    Raises:
        TypeError, ValueError: as :func:`~kernels_lib.fused_linear_cross_entropy` (naming the
            argument); ``return_entropy`` not a bool.
    """
    v.require_bool("return_entropy", return_entropy)
    out = fused_linear_cross_entropy(
        x, weight, target, bias, ignore_index=ignore_index, reduction="none", temperature=temperature,
        chunk_size=chunk_size, accurate=accurate, return_token_stats=return_entropy,
    )
    if return_entropy:
        return TokenLogprobsOutput(-out.loss, out.entropy)
    return TokenLogprobsOutput(-out, None)
