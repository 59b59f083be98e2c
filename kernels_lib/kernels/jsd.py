r"""Generalized Jensen–Shannon divergence: one kernel for the loss and, in the same pass, the gradient.

What it computes
----------------
For student log-probabilities :math:`x = \log q` and teacher log-probabilities :math:`y = \log p`
of rows of ``n_cols`` classes, with the mixture :math:`m = \beta p + (1-\beta) q` (TRL's
convention, ``trl/experimental/gkd/gkd_trainer.py`` lines 283-297), elementwise

.. math::

    \ell = \beta\, p\,(y - \log m) + (1-\beta)\, q\,(x - \log m),
    \qquad \frac{\partial \ell}{\partial x} = (1-\beta)\, q\,(x - \log m)

(the terms through :math:`\log m` cancel: :math:`\partial \log m/\partial x = (1-\beta)\,q/m` multiplies
:math:`-(\beta p + (1-\beta) q) = -m`, which leaves :math:`-(1-\beta)\,q`, cancelling the
:math:`+(1-\beta)\,q` from differentiating :math:`q` itself). :math:`\log m` is a two-term log-sum-exp,
:math:`\max + \log(\beta e^{y-\max} + (1-\beta) e^{x-\max})`, so it does not underflow where both
probabilities do. The two ends are the KL divergences TRL special-cases (lines 278-281), since the
formula above tends to 0 there:

* ``BETA_MODE == 0`` (:math:`\beta = 0`): :math:`\ell = p\,(y - x) = \mathrm{KL}(p\,\|\,q)`,
  :math:`\partial\ell/\partial x = -p`;
* ``BETA_MODE == 1`` (:math:`\beta = 1`): :math:`\ell = q\,(x - y) = \mathrm{KL}(q\,\|\,p)`,
  :math:`\partial\ell/\partial x = q\,(x - y + 1)`.

A term whose probability is exactly 0 (log-probability ``-inf``) counts 0 (``0 log 0 = 0``), where
torch's ``kl_div(log_target=True)`` would give ``0 * inf = NaN``; NaN in either input of a counted
row still gives NaN (loss and gradient).

The grid, the ignored rows, the reduction's partial sums, the gradient's ``scale`` and upstream
factor are the shared row-divergence stage (:mod:`.row_blocks`); this file is the pointwise formula.

What it costs
-------------
Per element: 2 loads and, with the gradient, 1 store (12 bytes per fp32 element; 8 without the
gradient), plus one 4- or 8-byte label per program. About 20 FLOPs and 4 ``exp`` + 1 ``log`` per
element for ``0 < beta < 1`` (2 ``exp`` at the ends), i.e. about 2 FLOPs per byte: bandwidth-bound
on a GPU (an H100 needs some 25 fp32 FLOPs per byte of HBM traffic to be compute-bound). Reductions write one float32 partial per program, summed by torch
afterwards in a fixed order (deterministic; no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_blocks import BLOCK, NUM_WARPS, launch_row_kernel, num_programs, row_block, store_row_block

__all__ = ["BLOCK", "NUM_WARPS", "num_programs", "jsd_kernel", "jsd_pointwise", "natural_log", "launch_jsd", "beta_mode"]


@triton.jit
def natural_log(x, FAST_LOG: tl.constexpr):
    """``ln x`` in float32: ``tl.log``, or with ``FAST_LOG`` the GPU's ``lg2.approx`` times ln 2 (inline PTX: CUDA
    only; relative error about 2^-22). On sm_90 ``tl.log`` compiles to a polynomial of about 20 instructions per
    element, where ``tl.exp`` is one ``ex2.approx`` and a multiply."""
    if FAST_LOG:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1) * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def jsd_pointwise(x, y, beta, BETA_MODE: tl.constexpr, FEW_EXP: tl.constexpr, FAST_LOG: tl.constexpr):
    """``(loss, d loss / d x)`` elementwise, float32, for student log-probs ``x`` and teacher log-probs
    ``y`` (the module's formulas; ``BETA_MODE`` as in :func:`jsd_kernel`). Shared with the fused
    two-head stage (:mod:`.distill_chunk`), which applies it to log-softmaxed logits.

    The mixture's ``log m`` has two forms: ``max(x, y) + log(β e^{y - max} + (1-β) e^{x - max})`` (4 ``exp``
    per element with ``q`` and ``p``), or with ``FEW_EXP`` the same from one ``exp(-|x - y|)``, since one of the
    two shifted exponentials is 1 (3 ``exp``). ``FAST_LOG``: that log by :func:`natural_log`'s hardware path."""
    q = tl.exp(x)
    p = tl.exp(y)
    if BETA_MODE == 0:
        loss = tl.where(p == 0.0, 0.0, p * (y - x))
        dx = -p
    elif BETA_MODE == 1:
        loss = tl.where(q == 0.0, 0.0, q * (x - y))
        dx = tl.where(q == 0.0, 0.0, q * (x - y + 1.0))
    else:
        top = tl.maximum(x, y)
        top = tl.where(top == float("-inf"), 0.0, top)  # both -inf: m = 0 and both terms are 0
        if FEW_EXP:
            e = tl.exp(-tl.abs(x - y))  # the smaller shifted exponential; the larger is 1
            log_m = top + natural_log(tl.where(y >= x, beta + (1.0 - beta) * e, beta * e + (1.0 - beta)), FAST_LOG)
        else:
            log_m = top + natural_log(beta * tl.exp(y - top) + (1.0 - beta) * tl.exp(x - top), FAST_LOG)
        teacher_term = tl.where(p == 0.0, 0.0, beta * p * (y - log_m))
        dx = tl.where(q == 0.0, 0.0, (1.0 - beta) * q * (x - log_m))
        loss = teacher_term + dx
    # The zero guards above must not hide a NaN input: NaN in x or y gives NaN (x + y is then NaN).
    nan_in = (x != x) | (y != y)
    return tl.where(nan_in, x + y, loss), tl.where(nan_in, x + y, dx)


@triton.jit
def jsd_kernel(
    student_ptr,  # student log-probabilities x, n_rows * n_cols elements, contiguous (fp32/bf16/fp16)
    teacher_ptr,  # teacher log-probabilities y, same layout (any of the three float dtypes)
    label_ptr,  # int32/int64[n_rows]: the row's label, compared with ignore_index (HAS_LABEL only)
    upstream_ptr,  # the upstream gradient, n_rows * n_cols elements (UPSTREAM only)
    scale_ptr,  # float32[1]: the factor applied to the gradient (the reduction's)
    partial_ptr,  # float32[num_programs]: each program's sum of the pointwise loss (REDUCE only)
    loss_ptr,  # n_rows * n_cols elements: the pointwise loss (WRITE_LOSS only), output dtype
    grad_ptr,  # n_rows * n_cols elements: d loss / d x (WRITE_GRAD only), student's dtype
    n_cols,  # classes per row
    blocks_per_row,  # cdiv(n_cols, BLOCK)
    ignore_index,  # int: rows whose label equals it are skipped (HAS_LABEL only)
    beta,  # float in (0, 1): the teacher's weight in the mixture (unused when BETA_MODE != 2)
    HAS_LABEL: tl.constexpr,  # label_ptr is given
    REDUCE: tl.constexpr,  # write one partial sum per program
    WRITE_LOSS: tl.constexpr,  # write the pointwise loss
    WRITE_GRAD: tl.constexpr,  # write the gradient
    UPSTREAM: tl.constexpr,  # multiply the gradient by the pointwise upstream gradient
    BLOCK: tl.constexpr,  # columns per program (a power of two)
    BETA_MODE: tl.constexpr,  # 0: beta == 0 (KL(p||q)), 1: beta == 1 (KL(q||p)), 2: 0 < beta < 1
):
    pid, offsets, in_row, mask = row_block(label_ptr, ignore_index, n_cols, blocks_per_row, HAS_LABEL, BLOCK)
    # Masked lanes (and ignored rows) load x = y = 0: q = p = m = 1 and every term is 0.
    x = tl.load(student_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(teacher_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    loss, dx = jsd_pointwise(x, y, beta, BETA_MODE, False, False)
    store_row_block(pid, offsets, in_row, mask, loss, dx, partial_ptr, loss_ptr, grad_ptr, scale_ptr, upstream_ptr,
                    REDUCE, WRITE_LOSS, WRITE_GRAD, UPSTREAM)


def beta_mode(beta: float) -> int:
    """The kernel's ``BETA_MODE``: 0 and 1 are TRL's two KL ends, 2 the mixture."""
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


def launch_jsd(
    student: torch.Tensor,
    teacher: torch.Tensor,
    *,
    beta: float,
    label: torch.Tensor | None = None,
    ignore_index: int = -100,
    partial: torch.Tensor | None = None,
    loss: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    scale: torch.Tensor | float = 1.0,
    upstream: torch.Tensor | None = None,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """Launch :func:`jsd_kernel` on contiguous (n_rows, n_cols) ``student`` and ``teacher``.

    The buffers and factors as :func:`.row_blocks.launch_row_kernel` takes them.
    """
    beta = float(beta)
    launch_row_kernel(
        jsd_kernel, student, teacher, (beta if 0.0 < beta < 1.0 else 0.5,), {"BETA_MODE": beta_mode(beta)},
        label=label, ignore_index=ignore_index, partial=partial, loss=loss, grad=grad, scale=scale,
        upstream=upstream, block=block, num_warps=num_warps,
    )
