r"""Shared ``tl`` helpers of the logits stages: the online log-sum-exp of one row, and the softcap.

Both per-chunk kernels (``cross_entropy_chunk``, ``token_logprobs``) start the same way: one program
reads one row of ``V`` logits in blocks of ``BLOCK_V`` and keeps a running maximum :math:`m` and a
running sum :math:`s = \sum_j e^{c_j - m}`, merged block by block,

.. math::

    m' = \max(m, \max_{\text{block}} c_j), \qquad
    s \leftarrow s\,e^{m - m'} + \textstyle\sum_{\text{block}} e^{c_j - m'},

so that :math:`\mathrm{lse} = m + \log s` without a second read of the row and without overflow
(every exponent is :math:`\le 0`). The helpers return :math:`m` and :math:`\log s` apart rather
than their sum: a log-prob :math:`c_y - \mathrm{lse}` is then formed as :math:`(c_y - m) - \log s`,
which keeps its relative accuracy when the token is likely (rounding :math:`m + \log s` first
would cost an absolute :math:`u\,|m|`).

Cost: one read of the row (``V`` × 2 or 4 bytes) and one ``exp`` per logit (two more with the
softcap). These are ``@triton.jit`` functions: inlined into the calling kernel, no launch of
their own.
"""

from __future__ import annotations

import triton
import triton.language as tl


#: Below this ``|u|`` the softcap's ``tanh(u)`` is its odd series to ``u⁹`` (truncation under 1e-12
#: relative): there ``1 - e^{-2|u|}`` cancels, and a rounding ``ε`` of the exponential (CUDA's is
#: approximate, about 2^-22 relative) becomes a relative error of about ``ε / |u|`` in ``tanh(u)``.
TANH_SERIES_BELOW: tl.constexpr = tl.constexpr(0.125)


@triton.jit
def _tanh_and_e(u):
    """``(tanh(u), e^{-2|u|})``: the closed form ``sign(u) (1 - e) / (1 + e)`` (no overflow), its odd
    Taylor series where ``|u| < TANH_SERIES_BELOW``."""
    e = tl.exp(-2.0 * tl.abs(u))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(u >= 0.0, t, -t)
    u2 = u * u
    series = u * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0 + u2 * (62.0 / 2835.0)))))
    return tl.where(tl.abs(u) < TANH_SERIES_BELOW, series, t), e


@triton.jit
def softcap(z, cap, HAS_SOFTCAP: tl.constexpr):
    """``cap * tanh(z / cap)`` (:func:`_tanh_and_e`); ``z`` unchanged without ``HAS_SOFTCAP``."""
    if HAS_SOFTCAP:
        t, _e = _tanh_and_e(z / cap)
        z = cap * t
    return z


@triton.jit
def softcap_and_slope(z, cap):
    """``(cap tanh(z/cap), 1 - tanh²(z/cap))`` from one ``e = e^{-2|u|}``: the slope as
    ``4e / (1 + e)²``, which keeps its relative accuracy where ``1 - tanh²`` would cancel (|z| a
    few times ``cap``)."""
    t, e = _tanh_and_e(z / cap)
    return cap * t, 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def row_logsumexp(
    row_ptr,  # pointer to the row's first logit (unit stride along V)
    n_cols,  # V, the row's length
    cap,  # softcap s > 0 (read only when HAS_SOFTCAP)
    class_weight_ptr,  # float32 [V] class weights w_j (read only when HAS_WEIGHT)
    HAS_SOFTCAP: tl.constexpr,  # the row is c = s tanh(z / s) of the stored z
    HAS_WEIGHT: tl.constexpr,  # the fourth result is the weighted sum Σ_j w_j c_j
    WITH_STATS: tl.constexpr,  # also accumulate the entropy's and Σ p² 's sums (else 0 is returned)
    BLOCK_V: tl.constexpr,  # elements per loop step (a power of two)
):
    r"""One pass over the row: ``(m, log s, Σ_j c_j, Σ_j w_j c_j, d, q)`` (float32 scalars), ``lse = m + log s``.

    The sums of the (capped) logits, plain and weighted by the class weights (the same number
    without them), are what label smoothing and the mean logit need; one add per element, nothing
    next to the read in this memory-bound loop. With ``WITH_STATS``, ``d = Σ_j e^{c_j - m} (m - c_j)``
    and ``q = Σ_j e^{2 (c_j - m)}``, merged online like ``s``
    (``d' = e^{m - m'} (d + (m' - m) s) + Σ_block e^{c_j - m'} (m' - c_j)``, ``q' = e^{2(m - m')} q + …``;
    every term ≥ 0, no cancellation), so that for ``p = softmax(c)``

    .. math:: H = \mathrm{lse} - \textstyle\sum_j p_j c_j = d / s + \log s, \qquad
              \log \textstyle\sum_j p_j^2 = \log q - 2 \log s .
    """
    cols = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    sum_c = 0.0
    sum_wc = 0.0
    d = 0.0
    q = 0.0
    for start in range(0, n_cols, BLOCK_V):
        mask = start + cols < n_cols
        z = tl.load(row_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        c = softcap(z, cap, HAS_SOFTCAP)
        m_new = tl.maximum(m, tl.max(tl.where(mask, c, -float("inf")), axis=0))
        e = tl.where(mask, tl.exp(c - m_new), 0.0)
        decay = tl.exp(m - m_new)
        if WITH_STATS:
            shift = tl.where(s > 0.0, m_new - m, 0.0) * s  # s = 0 (m = -inf) before the first block: no shift
            d = decay * (d + shift) + tl.sum(e * (m_new - tl.where(mask, c, m_new)), axis=0)
            q = q * decay * decay + tl.sum(e * e, axis=0)
        s = s * decay + tl.sum(e, axis=0)
        sum_c += tl.sum(tl.where(mask, c, 0.0), axis=0)
        if HAS_WEIGHT:
            w = tl.load(class_weight_ptr + start + cols, mask=mask, other=0.0)
            sum_wc += tl.sum(tl.where(mask, w * c, 0.0), axis=0)
        m = m_new
    if not HAS_WEIGHT:
        sum_wc = sum_c
    return m, tl.log(s), sum_c, sum_wc, d, q
