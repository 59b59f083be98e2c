r"""Two-head distillation, per-chunk stage: hard loss, soft loss and, in place, the student's logit gradient.

What it computes
----------------
The caller has formed a chunk of student logits :math:`z` and teacher logits :math:`u` (``rows × V``
each, raw: no temperature). With :math:`T` the temperature, :math:`c = z/T`, :math:`d = u/T`, the
student's log-probs :math:`x = c - \mathrm{lse}(c)`, :math:`q = e^x`, the teacher's
:math:`y = d - \mathrm{lse}(d)`, :math:`p = e^y`, per row:

* the **hard** loss (``HARD``), cross-entropy of the *raw* student logits against the target
  :math:`t` (Liger's chunked distillation takes it before the temperature):
  :math:`h = \mathrm{lse}(z) - z_t`, formed as :math:`(m - z_t) + \log s` (see ``row_logsumexp``);
* the **soft** loss, selected by ``SOFT``:

  - ``SOFT == 0``, generalized JSD with TRL's :math:`\beta` (:mod:`.jsd`'s pointwise formula,
    :func:`.jsd.jsd_pointwise`): :math:`s = \sum_j \ell(x_j, y_j)`;
  - ``SOFT == 1``, cosine: :math:`s = \beta\,(1 - \cos(z, u))`,
    :math:`\cos = z\cdot u / (\max(|z|, \epsilon)\max(|u|, \epsilon))`, :math:`\epsilon = 10^{-12}`
    (``F.normalize``'s); scale-invariant, so the temperature drops out.

Both are 0 at rows whose target is ``ignore_index`` (with ``HAS_TARGET``).

The gradient with respect to the raw student logits, with the caller's factors :math:`f_h` and
:math:`f_s` (the reduction's, the loss weights and the chain factor: :math:`1/T` for JSD, :math:`\beta`
for cosine, so the largest of them bounds :math:`|dz|`), is

.. math::

    dz_j = f_h\,(\mathrm{softmax}(z)_j - \delta_{jt})
         + f_s \begin{cases} g_j - q_j\,G, & g_j = \partial \ell / \partial x_j,\ G = \sum_k g_k
                 \quad \text{(JSD: the log-softmax's Jacobian)} \\
               -\Big(\dfrac{u_j}{|z|\,|u|} - \cos\,\dfrac{z_j}{|z|^2}\Big) & \text{(cosine)} \end{cases}

(:math:`G = (1-\beta)\,\mathrm{KL}(q\,\|\,m)` in the mixture case, :math:`-1` at :math:`\beta = 0`,
:math:`\mathrm{KL}(q\,\|\,p) + 1` at :math:`\beta = 1`; it is summed as it comes, which costs nothing
extra in the pass that sums the loss). It overwrites the student chunk in place (``WRITE_GRAD``), so
no second ``rows × V`` buffer is needed; 0 at ignored rows.

How
---
One program per row, looping over the vocabulary in blocks of ``BLOCK_V``:

1. one read of both rows: the online log-sum-exps (running max and sum, as ``row_logsumexp``) of
   :math:`c` and :math:`d` (JSD), of :math:`z` for the hard loss when it differs from :math:`c`, or
   the three dot products :math:`|z|^2, |u|^2, z\cdot u` (cosine);
2. JSD only: a second read sums the loss and :math:`G`, which need both log-sum-exps;
3. with ``WRITE_GRAD``: a last read writes :math:`dz`.

What it costs
-------------
Per logit of the chunk (``e`` bytes each: 2 for bf16/fp16, 4 for fp32): pass 1 reads both, pass 2
(JSD) both again, pass 3 both and writes one: ``7·rows·V·e`` bytes for JSD with the gradient,
``5·rows·V·e`` for cosine. The JSD mixture takes 3 ``exp`` and 1 ``log`` per element (2 ``exp`` at its ends): its
``log m`` from one ``exp(-|x - y|)`` rather than two shifted exponentials (``jsd_pointwise``'s ``FEW_EXP``), and on
CUDA from the hardware's ``lg2.approx`` (``FAST_LOG``; :func:`hardware_log`) where ``tl.log`` compiles to a
polynomial of about 20 instructions per element; the hard loss adds one ``exp``. Even so the JSD stage is bound by
its per-element instructions more than by its bytes (``studies/distill_chunk_ab.py`` times it in passes over the
logits at the copy bandwidth). Both are small next to the ``2·rows·V·(H_s + H_t)`` FLOPs of the two matmuls
that made the chunk. Offsets are 64-bit, so ``rows·V`` may exceed 2**31.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime import INTERPRETED
from .cross_entropy_chunk import NUM_WARPS, block_v
from .jsd import beta_mode, jsd_pointwise

#: ``SOFT`` of the generalized JSD and of the cosine loss.
SOFT_JSD, SOFT_COSINE = 0, 1
#: The norm clamp of the cosine (``F.normalize``'s ``eps``).
COSINE_EPS: tl.constexpr = tl.constexpr(1e-12)


@triton.jit
def _online_lse(m, s, c, mask):
    """Merge one block ``c`` into the running max ``m`` and sum ``s = Σ e^{c - m}``."""
    m_new = tl.maximum(m, tl.max(tl.where(mask, c, -float("inf")), axis=0))
    s = s * tl.exp(m - m_new) + tl.sum(tl.where(mask, tl.exp(c - m_new), 0.0), axis=0)
    return m_new, s


@triton.jit
def distill_chunk_kernel(
    student_ptr,  # [rows, V] raw student logits z (fp32/bf16/fp16); overwritten with dz when WRITE_GRAD
    stride_s,  # elements between consecutive student rows
    teacher_ptr,  # [rows, V] raw teacher logits u (any of the three float dtypes)
    stride_t,  # elements between consecutive teacher rows
    target_ptr,  # [rows] int32/int64 targets, ignore_index allowed (read with HAS_TARGET)
    hard_ptr,  # float32 [rows]: the hard loss, 0 at ignored rows (written with HARD)
    soft_ptr,  # float32 [rows]: the soft loss, 0 at ignored rows
    factor_ptr,  # float32 [2]: the gradient factors (f_h, f_s) of every counted row (read with WRITE_GRAD)
    n_cols,  # V, the vocabulary size
    ignore_index,  # target value of rows that count nowhere
    inv_t,  # 1 / temperature
    beta,  # JSD: the teacher's weight in the mixture (BETA_MODE 2); cosine: the loss's factor
    SOFT: tl.constexpr,  # SOFT_JSD or SOFT_COSINE
    BETA_MODE: tl.constexpr,  # JSD: 0 (beta = 0), 1 (beta = 1), 2 (mixture), as kernels.jsd
    HAS_TARGET: tl.constexpr,  # a target per row (rows equal to ignore_index are skipped)
    HARD: tl.constexpr,  # compute the hard loss (and its gradient term)
    RAW_LSE: tl.constexpr,  # the hard loss needs lse(z) apart from lse(z / T) (HARD and not (JSD and T == 1))
    WRITE_GRAD: tl.constexpr,  # overwrite the student logits with dz
    FAST_LOG: tl.constexpr,  # the JSD mixture's log in hardware (CUDA only: jsd.natural_log)
    BLOCK_V: tl.constexpr,  # vocabulary elements per loop step (a power of two)
):
    row = tl.program_id(0).to(tl.int64)
    s_row = student_ptr + row * stride_s
    t_row = teacher_ptr + row * stride_t
    cols = tl.arange(0, BLOCK_V)
    if HAS_TARGET:
        y = tl.load(target_ptr + row).to(tl.int64)
        valid = y != ignore_index
        # An out-of-range target (refused by the caller after the call) reads column 0, never past the row.
        y_safe = tl.where(valid & (y >= 0) & (y < n_cols), y, 0)
    else:
        y_safe = row * 0
        valid = y_safe == 0

    # Pass 1: log-sum-exps (JSD, hard) or dot products (cosine), one read of both rows.
    m_s = -float("inf")
    sum_s = 0.0
    m_t = -float("inf")
    sum_t = 0.0
    m_r = -float("inf")
    sum_r = 0.0
    zz = 0.0
    uu = 0.0
    zu = 0.0
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        mask = offs < n_cols
        z = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32)
        if SOFT == 0:
            m_s, sum_s = _online_lse(m_s, sum_s, z * inv_t, mask)
            m_t, sum_t = _online_lse(m_t, sum_t, u * inv_t, mask)
        else:
            zz += tl.sum(z * z, axis=0)
            uu += tl.sum(u * u, axis=0)
            zu += tl.sum(z * u, axis=0)
        if RAW_LSE:
            m_r, sum_r = _online_lse(m_r, sum_r, z, mask)
    if SOFT == 0:
        lse_s = m_s + tl.log(sum_s)
        lse_t = m_t + tl.log(sum_t)
    if HARD:
        if RAW_LSE:
            m_h = m_r
            log_h = tl.log(sum_r)
        else:  # JSD at T = 1: lse(z) is lse(z / T)
            m_h = m_s
            log_h = tl.log(sum_s)
        z_y = tl.load(s_row + y_safe).to(tl.float32)
        tl.store(hard_ptr + row, tl.where(valid, (m_h - z_y) + log_h, 0.0))

    # Pass 2: the soft loss (and, for JSD, G = sum_j dl/dx_j).
    big_g = 0.0
    if SOFT == 0:
        soft = 0.0
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32)
            loss, g = jsd_pointwise(z * inv_t - lse_s, u * inv_t - lse_t, beta, BETA_MODE, True, FAST_LOG)
            soft += tl.sum(tl.where(mask, loss, 0.0), axis=0)
            big_g += tl.sum(tl.where(mask, g, 0.0), axis=0)
    else:
        norm_z = tl.sqrt(zz)
        norm_prod = tl.maximum(norm_z, COSINE_EPS) * tl.maximum(tl.sqrt(uu), COSINE_EPS)
        cos = zu / norm_prod
        soft = beta * (1.0 - cos)
        inv_zz = tl.where(norm_z > COSINE_EPS, 1.0 / zz, 0.0)  # the clamped norm is constant: no gradient
    tl.store(soft_ptr + row, tl.where(valid, soft, 0.0))

    # Pass 3: dz in place.
    if WRITE_GRAD:
        f_h = tl.load(factor_ptr)
        f_s = tl.load(factor_ptr + 1)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32)
            if SOFT == 0:
                x = z * inv_t - lse_s
                _, g = jsd_pointwise(x, u * inv_t - lse_t, beta, BETA_MODE, True, FAST_LOG)
                dz = f_s * (g - tl.exp(x) * big_g)
            else:
                dz = -f_s * (u / norm_prod - cos * z * inv_zz)
            if HARD:
                p = tl.exp((z - m_h) - log_h)
                dz += f_h * (p - tl.where(offs == y_safe, 1.0, 0.0))
            dz = tl.where(valid, dz, 0.0)
            tl.store(s_row + offs, dz.to(student_ptr.dtype.element_ty), mask=mask)


def hardware_log(tensor: torch.Tensor) -> bool:
    """Whether the kernel on ``tensor``'s device takes the hardware's ``lg2.approx`` (compiled CUDA; not Triton's
    interpreter, not ROCm)."""
    return tensor.is_cuda and not INTERPRETED and torch.version.hip is None


def launch_distill_chunk(
    student: torch.Tensor,
    teacher: torch.Tensor,
    target: torch.Tensor | None,
    *,
    soft: torch.Tensor,
    hard: torch.Tensor | None,
    factors: torch.Tensor | None,
    soft_kind: int,
    beta: float,
    temperature: float,
    ignore_index: int,
) -> None:
    """Launch the kernel on a ``rows × V`` student chunk and teacher chunk (unit stride along V).

    ``target``: ``rows`` class indices in ``[0, V)`` or ``ignore_index`` (the caller refuses any other
    once the call is queued; the kernel reads column 0 for it, never past the row), or None (every row counts; no hard loss then). ``soft`` (float32, ``rows``) and ``hard`` (float32,
    ``rows``, or None for no hard loss: its gradient term is then absent too) are written, never read.
    ``factors`` (float32, 2 elements on the device: ``f_h``, ``f_s`` as in the module docstring), when
    given, makes the kernel overwrite ``student`` with ``dz``. ``soft_kind``: :data:`SOFT_JSD` or
    :data:`SOFT_COSINE`.
    """
    if hard is not None and target is None:
        raise ValueError("the hard loss needs a target")
    if soft_kind not in (SOFT_JSD, SOFT_COSINE):
        raise ValueError(f"soft_kind must be SOFT_JSD or SOFT_COSINE; got {soft_kind!r}")
    rows, n_cols = student.shape
    with_hard = hard is not None
    distill_chunk_kernel[(rows,)](
        student, student.stride(0), teacher, teacher.stride(0),
        soft if target is None else target,  # unread without HAS_TARGET
        hard if with_hard else soft, soft, soft if factors is None else factors,
        n_cols, int(ignore_index), 1.0 / float(temperature), float(beta),
        SOFT=soft_kind, BETA_MODE=beta_mode(float(beta)) if soft_kind == SOFT_JSD else 0,
        HAS_TARGET=target is not None, HARD=with_hard,
        RAW_LSE=with_hard and not (soft_kind == SOFT_JSD and float(temperature) == 1.0),
        WRITE_GRAD=factors is not None, FAST_LOG=hardware_log(student), BLOCK_V=block_v(n_cols), num_warps=NUM_WARPS,
    )
