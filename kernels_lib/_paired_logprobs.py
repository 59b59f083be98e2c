r"""The paired layer of the sequence log-prob pipeline: chosen/rejected pairs, a per-pair loss, a chosen NLL.

The paired preference losses (ORPO, DPO, CPO, SimPO) share one layout and one structure. ``x`` is
``(2n, T, H)``: rows ``0..n−1`` the chosen responses, rows ``n..2n−1`` the rejected ones (pair
``i`` is rows ``i`` and ``i+n``). With :math:`\ell_k` the summed (or averaged) log-prob of sequence
``k`` under the head (:mod:`kernels_lib._sequence_logprobs`), each loss is

.. math::

    L = \frac1n \sum_i f_i(\ell_{c_i}, \ell_{r_i}) + \alpha\,\mathrm{NLL}, \qquad
    \mathrm{NLL} = -\frac1{N'} \sum_{\text{chosen } k} \sum_t \log p'_{kt},

with a per-pair term :math:`f_i` (the loss's formula; it may read constants of pair ``i``, such as
the reference model's log-probs) and the NLL of the chosen half over its :math:`N'` valid tokens
(under a second target ``nll_target`` when given). A valid token of sequence ``k`` then has

.. math::

    \frac{\partial L}{\partial \log p_{kt}} = \frac1{n}\,\frac{\partial f_i}{\partial \ell_k}
        \Big(\times \frac1{N_k} \text{ for averages}\Big) - \frac{\alpha}{N'}[k \text{ chosen}],

known as soon as the chunk holding both sequences of the pair has its sums. So chunks hold whole
pairs: ``x`` is reordered once to chosen/rejected interleaved (a copy of ``x``, and of ``dx`` back),
and :func:`paired_logprobs` hands :func:`~kernels_lib._sequence_logprobs.sequence_logprobs` the
weights above. A loss gives :math:`\partial f_i / \partial \ell` explicitly (ORPO, whose
stable form matters where the plain one is 0·∞), or only :math:`f_i`, whose derivative
:func:`autograd_pair_grad` takes by autograd on the chunk's ``n_c`` pair values (a few elementwise
ops on ``n_c`` floats, nothing of size ``T`` or ``V``): the gradient is then by construction that
of the very formula the loss evaluates.

A reference model (DPO, KTO) goes through the same chunks first, without gradient
(:func:`kernels_lib._sequence_logprobs.reference_sums`): one matmul and the stats pass per chunk, nothing kept but its sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import _validate as v
from ._sequence_logprobs import chunk_rows, sequence_logprobs

#: ``pair_loss(chosen, rejected, pairs) -> f``: the per-pair term ``(n_c,)`` of the pairs ``pairs``
#: (a slice of pair indices) from their float32 sequence values (sums, or averages).
PairLoss = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]
#: ``pair_grad(chosen, rejected, pairs) -> (∂f/∂chosen, ∂f/∂rejected)``, each ``(n_c,)``.
PairGrad = Callable[[torch.Tensor, torch.Tensor, slice], tuple[torch.Tensor, torch.Tensor]]


def interleave(t: torch.Tensor) -> torch.Tensor:
    """``(2n, T, ...)`` chosen-then-rejected to pair order ``c0, r0, c1, r1, ...``, flattened to rows
    (``(2n,)`` per-sequence values stay ``(2n,)``, in pair order)."""
    n = t.shape[0] // 2
    return t.reshape(2, n, *t.shape[1:]).transpose(0, 1).reshape(-1, *t.shape[2:])


def deinterleave(rows: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of :func:`interleave`: rows in pair order back to ``shape`` ``(2n, T, ...)``."""
    n = shape[0] // 2
    return rows.reshape(n, 2, *shape[1:]).transpose(0, 1).reshape(shape)


def autograd_pair_grad(pair_loss: PairLoss) -> PairGrad:
    """``(∂f_i/∂chosen_i, ∂f_i/∂rejected_i)`` of ``pair_loss`` by autograd on the chunk's pair values.

    Runs under ``torch.enable_grad()`` (the fused losses form their gradients inside an autograd
    Function's forward, where grad mode is off). A term that does not depend on one side gives 0 there.
    """

    def grad(chosen: torch.Tensor, rejected: torch.Tensor, pairs: slice):
        with torch.enable_grad():
            c, r = chosen.detach().requires_grad_(), rejected.detach().requires_grad_()
            total = pair_loss(c, r, pairs).sum()
            if not total.requires_grad:  # a constant term (e.g. only DPO's "sft")
                return torch.zeros_like(chosen), torch.zeros_like(rejected)
            d_c, d_r = torch.autograd.grad(total, (c, r), allow_unused=True)
        return (torch.zeros_like(chosen) if d_c is None else d_c), (torch.zeros_like(rejected) if d_r is None else d_r)

    return grad


class PairedLogprobs(NamedTuple):
    chosen: torch.Tensor  #: (n,) float32 values (sums, or averages) of the chosen sequences
    rejected: torch.Tensor  #: (n,) the same for the rejected sequences
    nll: torch.Tensor | None  #: the chosen half's NLL (a float32 scalar), None when its weight is 0
    grads: tuple | None  #: (dx, dW, db) as sequence_logprobs gives them (dx back in x's layout), or None


def paired_logprobs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    counts: torch.Tensor,
    *,
    pair_grad: PairGrad,
    average: bool,
    nll_weight: float,
    nll_target: torch.Tensor | None,
    ignore_index: int,
    chunk_size: int | None,
    accurate: bool,
    needs: tuple[bool, bool, bool],
    shard=None,
    skip_ignored: bool = False,
) -> PairedLogprobs:
    """The chosen and rejected values of every pair, the NLL, and the gradients of ``L`` (module docstring).

    Args:
        x, target: ``(2n, T, H)`` and ``(2n, T)``, chosen then rejected (``target`` checked by the caller's
            :class:`~kernels_lib._validate.TargetCheck`, read once the call is queued).
        counts: ``(2n,)`` float32 valid tokens per sequence (:func:`~kernels_lib._validate.check_targets`).
        pair_grad: ``∂f_i/∂ℓ`` of the loss's per-pair term (see :func:`autograd_pair_grad`); called
            once per chunk, only when a gradient is wanted.
        average: ``ℓ`` is the average over valid tokens (else the sum).
        nll_weight: ``α``; 0 leaves the NLL out (not computed; ``nll`` is None).
        nll_target: optional ``(2n, T)`` targets of the NLL (the chosen half is read), else ``target``.
        chunk_size: rows per chunk, rounded down to whole pairs (``2T`` rows), at least one pair.
        accurate, needs, shard, skip_ignored: as :func:`~kernels_lib._sequence_logprobs.sequence_logprobs`
            (a chunk holds whole pairs of kept rows).
    """
    n_pairs, seq_len = x.shape[0] // 2, x.shape[1]
    counts = interleave(counts)  # pair order
    y, y2 = interleave(target), None
    with_nll = nll_weight != 0
    if nll_target is None:
        n_nll = counts.view(n_pairs, 2)[:, 0].sum()
    elif with_nll:
        # Only the chosen half enters the NLL: the rejected rows' second targets are all ignored.
        y2 = interleave(torch.cat([nll_target[:n_pairs], torch.full_like(nll_target[n_pairs:], ignore_index)]))
        n_nll = (y2 != ignore_index).sum().to(torch.float32)

    def coefficients(seqs, sums, sums2):
        pair_counts = counts[seqs].view(-1, 2)
        values = sums.view(-1, 2) / pair_counts if average else sums.view(-1, 2)
        d_chosen, d_rejected = pair_grad(values[:, 0], values[:, 1], slice(seqs.start // 2, seqs.stop // 2))
        w = torch.stack([d_chosen, d_rejected], 1) / n_pairs
        w = (w / pair_counts if average else w).reshape(-1)
        if not with_nll:
            return w, None
        nll_w = torch.stack([torch.full_like(d_chosen, -nll_weight) / n_nll, torch.zeros_like(d_chosen)], 1).view(-1)
        return (w + nll_w, None) if sums2 is None else (w, nll_w)

    x_rows = interleave(x)
    rows = chunk_rows(chunk_size, 2 * seq_len, x_rows.shape[0], weight.shape[1])
    sums, sums2, grads = sequence_logprobs(
        x_rows, weight, bias, y, seq_len=seq_len, rows_per_chunk=rows, ignore_index=ignore_index,
        target2=y2, coefficients=coefficients, needs=needs, accurate=accurate, shard=shard,
        skip_ignored=skip_ignored, group_seqs=2,
    )
    values = (sums / counts if average else sums).view(n_pairs, 2)
    nll = None
    if with_nll:
        nll = -(sums.view(n_pairs, 2)[:, 0].sum() if sums2 is None else sums2.sum()) / n_nll
    if grads is not None and grads[0] is not None:
        grads = (deinterleave(grads[0], x.shape), *grads[1:])
    return PairedLogprobs(values[:, 0], values[:, 1], nll, grads)


def validate_pairs(x, weight, target, bias, nll_target=None) -> dict:
    """The checks of every paired loss's inputs: ``x`` ``(2n, T, H)`` (an even batch, the chosen then
    the rejected), the head, ``target``, the optional bias and NLL targets; returns them by name (for
    :func:`~kernels_lib._validate.require_same_device` with whatever else the loss takes)."""
    v.require_linear_loss_inputs(x, weight, target, x_ndim=3)
    if x.shape[0] % 2:
        raise ValueError(
            f"x must hold 2n sequences, the n chosen then the n rejected; got an odd batch of {x.shape[0]}"
        )
    tensors = {"x": x, "weight": weight, "target": target}
    if bias is not None:
        v.require_bias("bias", bias, weight)
        tensors["bias"] = bias
    if nll_target is not None:
        v.require_tensor("nll_target", nll_target)
        v.require_index_dtype("nll_target", nll_target)
        v.require_shape("nll_target", nll_target, target.shape, "target.shape")
        tensors["nll_target"] = nll_target
    return tensors
