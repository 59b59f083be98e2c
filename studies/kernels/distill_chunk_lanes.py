r"""The two-head distillation stage with per-lane sums: a variant of ``kernels_lib.kernels.distill_chunk`` under study.

What it computes
----------------
Exactly what :func:`kernels_lib.kernels.distill_chunk.launch_distill_chunk` computes, with the same arguments:
per row of a ``rows × V`` student chunk ``z`` and teacher chunk ``u``, the hard loss, the soft loss (generalized
JSD or cosine) and, in place of ``z``, the student's logit gradient ``dz`` (the library module's docstring has the
formulas). Three sweeps over each row, as there: the log-sum-exps (or the cosine's dot products), the JSD's loss
and ``G = Σ_j ∂ℓ/∂x_j``, then ``dz``.

Why a variant
-------------
On the H100 the library's stage took the time of 12.7–13.8 passes over one head's logits at the copy bandwidth
(``kernels_workbench.profiles``, "logits passes") where its three sweeps read both heads three times and write
one: 7. The stage runs one program per row; each step of its vocabulary loop reduces its block across the
program's warps (a running max and sum per head in sweep 1, two sums in sweep 2), a barrier per reduction. The
dials here remove those and trim the mixture's transcendental functions:

- ``lane_sums``: sweep 2's loss and ``G`` (and the cosine's dot products) accumulate per lane, one reduction
  after the loop;
- ``lane_lse``: sweep 1's running max and sum per lane, merged once after the loop (one more ``exp`` per element
  and head: the rescale of each lane's sum);
- ``few_exp`` and ``fast_log``: ``jsd_pointwise``'s dials (``kernels_lib/kernels/jsd.py``): the mixture's
  ``log m`` from one ``exp(-|x - y|)`` (3 ``exp`` and 1 ``log`` per element instead of 4 and 1), and that log as the
  GPU's ``lg2.approx`` (inline PTX: CUDA only) where ``tl.log`` compiles to a polynomial of about 20 instructions
  per element. Both won their same-run A/B and are now the library stage's (``few_exp`` everywhere, ``fast_log``
  on CUDA); with both off the stage is the two-exponential ``tl.log`` form it had before;
- ``block_v``, ``num_warps``: the loop step and the program's warps.

What it costs
-------------
The bytes are the library's: ``7·rows·V·e`` for the JSD with the gradient, ``5·rows·V·e`` for the cosine. The
A/B (``studies/distill_chunk_ab.py``) times the stage alone and the whole loss with each arm in one run, beside
the copy ceiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_lib import INTERPRETED
from kernels_lib.kernels.cross_entropy_chunk import NUM_WARPS, block_v as library_block_v
from kernels_lib.kernels.distill_chunk import SOFT_COSINE, SOFT_JSD, _online_lse
from kernels_lib.kernels.jsd import beta_mode, jsd_pointwise

COSINE_EPS: tl.constexpr = tl.constexpr(1e-12)


@triton.jit
def _lane_lse_step(m, s, c):
    """Merge the block ``c`` (``-inf`` where masked) into each lane's running max ``m`` and sum ``s``."""
    m_new = tl.maximum(m, c)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, s * tl.exp(m - shift) + tl.exp(c - shift)


@triton.jit
def _lane_lse_merge(m, s):
    """A row's running max and sum ``(m, Σ e^{c - m})`` from its lanes' (the library's pair: a caller forms
    ``(m - z_y) + log s`` rather than ``lse - z_y``, so that a large max cancels exactly)."""
    top = tl.max(m, axis=0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    return top, tl.sum(s * tl.exp(m - shift), axis=0)


@triton.jit
def distill_chunk_lanes_kernel(
    student_ptr, stride_s, teacher_ptr, stride_t, target_ptr, hard_ptr, soft_ptr, factor_ptr,
    n_cols, ignore_index, inv_t, beta,
    SOFT: tl.constexpr, BETA_MODE: tl.constexpr, HAS_TARGET: tl.constexpr, HARD: tl.constexpr,
    RAW_LSE: tl.constexpr, WRITE_GRAD: tl.constexpr,
    LANE_SUMS: tl.constexpr, LANE_LSE: tl.constexpr, FEW_EXP: tl.constexpr, FAST_LOG: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = student_ptr + row * stride_s
    t_row = teacher_ptr + row * stride_t
    cols = tl.arange(0, BLOCK_V)
    if HAS_TARGET:
        y = tl.load(target_ptr + row).to(tl.int64)
        valid = y != ignore_index
        y_safe = tl.where(valid, y, 0)
    else:
        y_safe = row * 0
        valid = y_safe == 0
    lanes = tl.zeros([BLOCK_V], dtype=tl.float32)
    lane_floor = tl.full([BLOCK_V], float("-inf"), tl.float32)

    # Sweep 1: log-sum-exps (JSD, hard) or dot products (cosine).
    if LANE_LSE:
        m_s, sum_s, m_t, sum_t, m_r, sum_r = lane_floor, lanes, lane_floor, lanes, lane_floor, lanes
    else:
        m_s, sum_s, m_t, sum_t, m_r, sum_r = -float("inf"), 0.0, -float("inf"), 0.0, -float("inf"), 0.0
    if LANE_SUMS:
        zz, uu, zu = lanes, lanes, lanes
    else:
        zz, uu, zu = 0.0, 0.0, 0.0
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        mask = offs < n_cols
        z = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32)
        if SOFT == 0:
            if LANE_LSE:
                m_s, sum_s = _lane_lse_step(m_s, sum_s, tl.where(mask, z * inv_t, -float("inf")))
                m_t, sum_t = _lane_lse_step(m_t, sum_t, tl.where(mask, u * inv_t, -float("inf")))
            else:
                m_s, sum_s = _online_lse(m_s, sum_s, z * inv_t, mask)
                m_t, sum_t = _online_lse(m_t, sum_t, u * inv_t, mask)
        else:
            if LANE_SUMS:
                zz += z * z
                uu += u * u
                zu += z * u
            else:
                zz += tl.sum(z * z, axis=0)
                uu += tl.sum(u * u, axis=0)
                zu += tl.sum(z * u, axis=0)
        if RAW_LSE:
            if LANE_LSE:
                m_r, sum_r = _lane_lse_step(m_r, sum_r, tl.where(mask, z, -float("inf")))
            else:
                m_r, sum_r = _online_lse(m_r, sum_r, z, mask)
    if LANE_LSE:  # the lanes' pairs merged into one (max, sum) per row, as the block path keeps them
        if SOFT == 0:
            m_s, sum_s = _lane_lse_merge(m_s, sum_s)
            m_t, sum_t = _lane_lse_merge(m_t, sum_t)
        if RAW_LSE:
            m_r, sum_r = _lane_lse_merge(m_r, sum_r)
    if SOFT == 0:
        lse_s = m_s + tl.log(sum_s)
        lse_t = m_t + tl.log(sum_t)
    else:
        if LANE_SUMS:
            zz = tl.sum(zz, axis=0)
            uu = tl.sum(uu, axis=0)
            zu = tl.sum(zu, axis=0)
    if HARD:
        if RAW_LSE:
            m_h = m_r
            log_h = tl.log(sum_r)
        else:  # JSD at T = 1: lse(z) is lse(z / T)
            m_h = m_s
            log_h = tl.log(sum_s)
        z_y = tl.load(s_row + y_safe).to(tl.float32)
        tl.store(hard_ptr + row, tl.where(valid, (m_h - z_y) + log_h, 0.0))

    # Sweep 2: the soft loss (and, for JSD, G = sum_j dl/dx_j).
    big_g = 0.0
    if SOFT == 0:
        if LANE_SUMS:
            soft, big_g = lanes, lanes
        else:
            soft, big_g = 0.0, 0.0
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32)
            loss, g = jsd_pointwise(z * inv_t - lse_s, u * inv_t - lse_t, beta, BETA_MODE, FEW_EXP, FAST_LOG)
            if LANE_SUMS:  # per lane: one reduction after the loop
                soft += tl.where(mask, loss, 0.0)
                big_g += tl.where(mask, g, 0.0)
            else:
                soft += tl.sum(tl.where(mask, loss, 0.0), axis=0)
                big_g += tl.sum(tl.where(mask, g, 0.0), axis=0)
        if LANE_SUMS:
            soft = tl.sum(soft, axis=0)
            big_g = tl.sum(big_g, axis=0)
    else:
        norm_z = tl.sqrt(zz)
        norm_prod = tl.maximum(norm_z, COSINE_EPS) * tl.maximum(tl.sqrt(uu), COSINE_EPS)
        cos = zu / norm_prod
        soft = beta * (1.0 - cos)
        inv_zz = tl.where(norm_z > COSINE_EPS, 1.0 / zz, 0.0)  # the clamped norm is constant: no gradient
    tl.store(soft_ptr + row, tl.where(valid, soft, 0.0))

    # Sweep 3: dz in place.
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
                _, g = jsd_pointwise(x, u * inv_t - lse_t, beta, BETA_MODE, FEW_EXP, FAST_LOG)
                dz = f_s * (g - tl.exp(x) * big_g)
            else:
                dz = -f_s * (u / norm_prod - cos * z * inv_zz)
            if HARD:
                dz += f_h * (tl.exp((z - m_h) - log_h) - tl.where(offs == y_safe, 1.0, 0.0))
            dz = tl.where(valid, dz, 0.0)
            tl.store(s_row + offs, dz.to(student_ptr.dtype.element_ty), mask=mask)


def launch_distill_chunk_lanes(
    student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor | None, *, soft: torch.Tensor,
    hard: torch.Tensor | None, factors: torch.Tensor | None, soft_kind: int, beta: float, temperature: float,
    ignore_index: int, lane_sums: bool = True, lane_lse: bool = False, few_exp: bool = True, fast_log: bool = False,
    block_v: int | None = None, num_warps: int | None = None,
) -> None:
    """:func:`kernels_lib.kernels.distill_chunk.launch_distill_chunk`'s call, with the study's dials (the module
    docstring); ``block_v``/``num_warps`` None take the library's."""
    if hard is not None and target is None:
        raise ValueError("the hard loss needs a target")
    if soft_kind not in (SOFT_JSD, SOFT_COSINE):
        raise ValueError(f"soft_kind must be SOFT_JSD or SOFT_COSINE; got {soft_kind!r}")
    if fast_log and INTERPRETED:
        raise ValueError("fast_log needs a CUDA GPU: its lg2.approx is inline PTX, which Triton's interpreter cannot run")
    rows, n_cols = student.shape
    step = block_v or library_block_v(n_cols)
    if step & (step - 1):
        raise ValueError(f"block_v must be a power of two; got {block_v!r}")
    with_hard = hard is not None
    distill_chunk_lanes_kernel[(rows,)](
        student, student.stride(0), teacher, teacher.stride(0),
        soft if target is None else target, hard if with_hard else soft, soft, soft if factors is None else factors,
        n_cols, int(ignore_index), 1.0 / float(temperature), float(beta),
        SOFT=soft_kind, BETA_MODE=beta_mode(float(beta)) if soft_kind == SOFT_JSD else 0,
        HAS_TARGET=target is not None, HARD=with_hard,
        RAW_LSE=with_hard and not (soft_kind == SOFT_JSD and float(temperature) == 1.0),
        WRITE_GRAD=factors is not None, LANE_SUMS=bool(lane_sums), LANE_LSE=bool(lane_lse), FEW_EXP=bool(few_exp),
        FAST_LOG=bool(fast_log),
        BLOCK_V=step, num_warps=num_warps or NUM_WARPS,
    )


def launcher(**dials):
    """A function with the library launcher's signature that runs this stage with ``dials`` (for an arm:
    ``kernels_lib._distillation.launch_distill_chunk`` set to it, through ``studies.bench.arms.constants_set``)."""
    def launch(*args, **kwargs):
        return launch_distill_chunk_lanes(*args, **kwargs, **dials)

    return launch
