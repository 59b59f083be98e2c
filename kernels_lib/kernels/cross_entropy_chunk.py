r"""Fused linear + cross-entropy, per-chunk stage: log-sum-exp, per-row loss and, in place, the gradient.

What it computes
----------------
The caller has formed a chunk of logits :math:`z = x_c W^\top + b` (``rows × V``). For each row,
with the optional softcap :math:`c_j = s \tanh(z_j / s)` (else :math:`c_j = z_j`),

.. math::

    \mathrm{lse} = \log \sum_j e^{c_j}, \qquad
    \ell = (1-\varepsilon)(\mathrm{lse} - c_y) + \varepsilon\,(\mathrm{lse} - \tfrac1V \textstyle\sum_j c_j)
           + \lambda\, \mathrm{lse}^2

(label smoothing :math:`\varepsilon`, z-loss :math:`\lambda`), and :math:`\ell = 0` at rows whose
target is ``ignore_index``. The gradient with respect to the raw logits, scaled by the row's
factor :math:`g` (the reduction's ``1/n_valid`` or ``1``, or the upstream gradient of that row), is

.. math::

    \frac{\partial \ell}{\partial z_j} = g\,\Big(p_j (1 + 2\lambda\,\mathrm{lse})
        - (1-\varepsilon)\,\delta_{jy} - \tfrac{\varepsilon}{V}\Big)\,\big(1 - \tanh^2(z_j/s)\big),
    \qquad p_j = e^{c_j - \mathrm{lse}},

the last factor being :math:`\mathrm d c / \mathrm d z` of the softcap (1 without it), evaluated as
:math:`4e/(1+e)^2` with :math:`e = e^{-2|z_j/s|}` (``1 - (c/s)^2`` cancels for logits a few times
``s``: at logits of 1e4 with ``s = 30`` it gave 1.1e-4 relative error in ``dx`` against float64,
twice torch's float32 error; this form gives 1e-5), and 0 on ignored rows. It overwrites the logits in place, so the chunk's buffer holds ``dz`` afterwards and
no second ``rows × V`` buffer is needed.

How
---
One program per row loops over the vocabulary in blocks of ``BLOCK_V``. Pass 1 is the online
log-sum-exp of ``row_logsumexp`` (a running maximum :math:`m` and sum :math:`s = \sum e^{c_j - m}`,
merged block by block), which also sums the logits for smoothing. Pass 2 (only when the gradient is wanted) re-reads the row and writes ``dz``.
When ``lse`` is already known (backward of ``reduction="none"``) pass 1 is skipped.

What it costs
-------------
Per logit: pass 1 reads it (2 or 4 bytes), pass 2 reads and writes it; one ``exp`` per pass (two
more with the softcap) and about 10 FLOPs. For a chunk of ``rows`` rows that is ``rows·V·3·e``
bytes with the gradient (``e`` = bytes per logit), ``rows·V·e`` without: memory-bound, and small
next to the ``2·rows·V·H`` FLOPs of the matmul that made the chunk. Offsets are 64-bit, so
``rows·V`` may exceed 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime import INTERPRETED
from .row_logsumexp import row_logsumexp, softcap_and_slope
from .row_logsumexp import softcap as apply_softcap

#: Vocabulary elements per loop step: 4096 on GPU (16 KiB of fp32 per step); in the interpreter a
#: larger block means fewer (slow) Python-level steps.
MAX_BLOCK_V = 16384 if INTERPRETED else 4096
NUM_WARPS = 8


@triton.jit
def cross_entropy_chunk_kernel(
    logits_ptr,  # [rows, V] logits of the chunk (fp32/bf16/fp16); overwritten with dz when WRITE_GRAD
    stride_row,  # elements between consecutive rows of logits
    target_ptr,  # [rows] int32/int64 class indices, ignore_index allowed
    lse_ptr,  # float32 [rows]: written when COMPUTE_LSE, else read (the forward's lse)
    loss_ptr,  # float32 [rows]: per-row loss incl. the z-loss term, 0 at ignored rows (COMPUTE_LSE)
    z_loss_ptr,  # float32 [rows]: per-row z-loss term lambda*lse^2, 0 at ignored rows (COMPUTE_LSE)
    scale_ptr,  # float32: the gradient factor of row i at scale_ptr[i * scale_stride]
    scale_stride,  # 0 for one factor shared by all rows, 1 for a per-row factor
    n_cols,  # V, the vocabulary size
    ignore_index,  # target value of rows that contribute nothing
    label_smoothing,  # epsilon in [0, 1]
    z_loss_scale,  # lambda >= 0
    softcap,  # s > 0 (read only when HAS_SOFTCAP)
    HAS_SOFTCAP: tl.constexpr,  # apply c = s * tanh(z / s)
    COMPUTE_LSE: tl.constexpr,  # pass 1: compute lse and the loss; else read lse from lse_ptr
    WRITE_GRAD: tl.constexpr,  # pass 2: overwrite the logits with dz
    BLOCK_V: tl.constexpr,  # vocabulary elements per loop step (a power of two)
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    y = tl.load(target_ptr + row).to(tl.int64)
    valid = y != ignore_index

    if COMPUTE_LSE:
        m, log_s, sum_c = row_logsumexp(row_ptr, n_cols, softcap, HAS_SOFTCAP, BLOCK_V)
        lse = m + log_s
        c_y = apply_softcap(tl.load(row_ptr + tl.where(valid, y, 0)).to(tl.float32), softcap, HAS_SOFTCAP)
        z_term = z_loss_scale * lse * lse
        # lse - c_y as (m - c_y) + log s: a confident row's loss is small next to m, and rounding
        # m + log s first would cost an absolute u·|m| (the float32 reference's: u·|loss|).
        ce = (1.0 - label_smoothing) * ((m - c_y) + log_s) + label_smoothing * ((m - sum_c / n_cols) + log_s)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(valid, ce + z_term, 0.0))
        tl.store(z_loss_ptr + row, tl.where(valid, z_term, 0.0))
    else:
        lse = tl.load(lse_ptr + row)

    if WRITE_GRAD:
        g = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        # The z-loss term p·2λ·lse is added after p - δ (not as p·(1 + 2λ·lse) - δ): where p_y → 1
        # the rounding of 1 + 2λ·lse would leave an absolute error of u in dz_y, all of it when V = 1.
        z_grad = 2.0 * z_loss_scale * lse
        smooth = label_smoothing / n_cols
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            hit = tl.where(offs == y, 1.0 - label_smoothing, 0.0)
            if HAS_SOFTCAP:
                c, slope = softcap_and_slope(z, softcap)
                p = tl.exp(c - lse)
                dc = ((p - hit - smooth) + p * z_grad) * slope
            else:
                p = tl.exp(z - lse)
                dc = (p - hit - smooth) + p * z_grad
            dz = tl.where(valid, dc * g, 0.0)
            tl.store(row_ptr + offs, dz.to(logits_ptr.dtype.element_ty), mask=mask)


def block_v(n_cols: int) -> int:
    """The loop step over the vocabulary for ``n_cols`` classes."""
    return min(triton.next_power_of_2(n_cols), MAX_BLOCK_V)


def launch_cross_entropy_chunk(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    lse: torch.Tensor,
    loss: torch.Tensor | None,
    z_loss: torch.Tensor | None,
    grad_scale: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float | None,
) -> None:
    """Launch the kernel on a ``rows × V`` logits chunk (unit stride along V) and ``rows`` targets.

    Two modes:

    * ``loss`` and ``z_loss`` given (float32, ``rows``): compute ``lse`` (float32, ``rows``,
      written) and the per-row loss terms;
    * both ``None``: ``lse`` is read (it holds the forward's values) and ``grad_scale`` is required.

    ``grad_scale`` (float32, 1 element shared by all rows, or ``rows`` elements one per row), when
    given, makes the kernel overwrite ``logits`` with ``grad_scale * dloss/dlogits``. Output buffers
    are written, never read, so callers may pass ``torch.empty`` (tests pass NaN-poisoned ones).
    """
    compute_lse = loss is not None
    if compute_lse != (z_loss is not None):
        raise ValueError("give both loss and z_loss (compute lse) or neither (read lse)")
    if not compute_lse and grad_scale is None:
        raise ValueError("with lse given (loss=None) there is nothing to do unless grad_scale is given")
    rows, n_cols = logits.shape
    # Unused pointers still need a tensor argument; the constexpr flags keep them unread and unwritten.
    cross_entropy_chunk_kernel[(rows,)](
        logits,
        logits.stride(0),
        target,
        lse,
        loss if compute_lse else lse,
        z_loss if compute_lse else lse,
        grad_scale if grad_scale is not None else lse,
        0 if grad_scale is None or grad_scale.numel() == 1 else 1,
        n_cols,
        int(ignore_index),
        float(label_smoothing),
        float(z_loss_scale),
        float(softcap) if softcap is not None else 1.0,
        HAS_SOFTCAP=softcap is not None,
        COMPUTE_LSE=compute_lse,
        WRITE_GRAD=grad_scale is not None,
        BLOCK_V=block_v(n_cols),
        num_warps=NUM_WARPS,
    )
