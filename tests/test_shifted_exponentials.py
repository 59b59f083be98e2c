"""The epilogue GEMM's shifted exponentials (kernels_lib.kernels.shifted_exponentials) against float64.

What the fused loss's gradient reads: ``exp(c* - lse) · ẽ`` must be ``softmax(z) - onehot`` row by
row (0 at ignored rows), in row-major and class-major buffers, with rows whose target logit lies
more than the headroom below their maximum (their tiles shifted apart, then rescaled), N = 1, odd
H and V, a bias and a scale; every element of the buffer written (it starts NaN). Without a GPU the
kernels run in Triton's interpreter (float32 operands)."""

from __future__ import annotations

import math

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import INTERPRETED, default_device
from kernels_lib.kernels.logits_logsumexp import launch_logits_logsumexp
from kernels_lib.kernels.shifted_exponentials import EXP_HEADROOM, launch_scale_rows, launch_target_logit_shift
from kernels_workbench.check import relative_error

DEVICE = default_device()
IGNORE = -100
DTYPE = torch.float32 if INTERPRETED else torch.bfloat16
TOL = 1e-5 if INTERPRETED else 1e-2
WIDE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32) if INTERPRETED else None


def make(n, h, v, *, seed=0, outliers=(), alpha=1.0):
    """x, W, b, targets (every fourth row ignored); rows in ``outliers`` scaled by 40 and aimed at their
    smallest logit (of ``alpha · (x W^T + b)``), so that it lies hundreds below their maximum."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen)
    w = torch.randn(v, h, generator=gen) / math.sqrt(h) * 3
    b = torch.randn(v, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    y[3::4] = IGNORE
    for row in outliers:
        x[row] *= 40
        y[row] = int((alpha * (x[row] @ w.T + b)).argmin())
    return x.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE), b.to(DEVICE, DTYPE), y.to(DEVICE)


def run(x, w, b, y, alpha, class_major):
    n, v = x.shape[0], w.shape[0]
    if class_major:
        out = torch.full((v, n + 3), float("nan"), dtype=DTYPE, device=DEVICE)[:, :n].t()
    else:
        out = torch.full((n, v + 5), float("nan"), dtype=DTYPE, device=DEVICE)[:, :v]
    factors = launch_target_logit_shift(x, w, b, y, alpha, IGNORE)
    lse, target_logit = launch_logits_logsumexp(x, w, b, y, alpha=alpha, ignore_index=IGNORE, config=WIDE,
                                                logits_out=out, shift=factors)
    return out, factors, lse, target_logit


@pytest.mark.parametrize("class_major", [False, True], ids=["row-major", "class-major"])
@pytest.mark.parametrize("alpha", [0.7, -1.3])  # the scale folded into the exponent, or applied first
# V = 512: a multiple of the tile's columns (no column mask), on the GPU and in the interpreter.
@pytest.mark.parametrize("n, h, v, outliers", [(37, 72, 1031, (5, 8)), (1, 40, 517, (0,)), (20, 24, 300, ()),
                                               (9, 40, 512, (2,))])
def test_gradient_from_exponentials_matches_float64(n, h, v, outliers, class_major, alpha):
    x, w, b, y = make(n, h, v, outliers=outliers, alpha=alpha)
    out, factors, lse, target_logit = run(x, w, b, y, alpha, class_major)
    z = alpha * (x.double() @ w.double().T + b.double())
    valid = y != IGNORE
    onehot = torch.nn.functional.one_hot(torch.where(valid, y, 0), v).double()
    want = torch.where(valid[:, None], torch.softmax(z, 1) - onehot, 0.0)
    got = factors.double()[:, None] * out.double()
    assert not out.isnan().any(), "every element written"
    assert (factors[~valid] == 0).all(), "ignored rows: factor 0"
    assert (out[~valid] == 0).all(), "ignored rows store zeros"
    assert relative_error(got, want) < TOL
    assert relative_error(lse[valid], torch.logsumexp(z, 1)[valid]) < TOL
    z_y = z.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    assert relative_error(target_logit[valid], z_y[valid]) < TOL and (target_logit[~valid] == 0).all()
    for row in outliers:  # tiles shifted apart and rescaled to the row's maximum less the headroom
        assert z[row].max() - z_y[row] > EXP_HEADROOM
        want_factor = math.exp(float(z[row].max()) - EXP_HEADROOM - float(torch.logsumexp(z[row], 0)))
        # The lse sums the stored exponentials: their rounding (bf16 on a GPU) is the factor's error.
        assert abs(float(factors[row]) / want_factor - 1) < (1e-3 if INTERPRETED else 1e-2)
    assert out.abs().max() <= math.exp(EXP_HEADROOM + math.log(v)), "no stored exponent beyond the headroom"


def test_shift_is_the_target_logit():
    x, w, b, y = make(37, 72, 1031)
    shift = launch_target_logit_shift(x, w, b, y, 0.7, IGNORE)
    z = 0.7 * (x.double() @ w.double().T + b.double())
    valid = y != IGNORE
    want = z.gather(1, torch.where(valid, y, 0)[:, None])[:, 0]
    assert relative_error(shift[valid], want[valid]) < TOL
    assert (shift[~valid] == -math.inf).all()
    stray = y.clone()
    stray[0] = w.shape[0]
    assert launch_target_logit_shift(x, w, None, stray, 1.0, IGNORE)[0] == -math.inf


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:All-NaN slice:RuntimeWarning")
def test_nan_and_stray_targets():
    """A NaN logit makes its row's exponentials NaN (the gradient then NaN), an ignored row's too (its
    factor stays 0, its target logit 0); a target outside [0, V) gets a NaN target logit and its row no
    one-hot write (nothing written outside the buffer)."""
    x, w, b, y = make(20, 24, 300)
    x[2, 3] = float("nan")
    x[7, 1] = float("nan")  # row 7 is ignored
    y[5] = 300
    out, factors, lse, target_logit = run(x, w, b, y, 1.0, False)
    assert out[2].isnan().any() and lse[2].isnan()
    assert y[7] == IGNORE and out[7].isnan().any() and factors[7] == 0 and target_logit[7] == 0
    assert target_logit[5].isnan() and factors[5].isnan() and not out[5].isnan().any()
    assert not out[[0, 1, 3, 4]].isnan().any() and (out[3] == 0).all()


def test_scale_rows_and_in_place():
    """Each row times its factor and the scale, in the output's dtype (within one rounding), in place too."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randn(7, 1500, generator=gen).to(DEVICE, DTYPE)
    factors = torch.rand(7, generator=gen).to(DEVICE)
    factors[3] = 0.0
    scale = torch.tensor([0.37], device=DEVICE)
    want = src.double() * factors.double()[:, None] * 0.37
    ulp = torch.finfo(DTYPE).eps
    got = launch_scale_rows(src, factors, scale)
    assert got.dtype == DTYPE and ((got.double() - want).abs() <= ulp * want.abs()).all()
    launch_scale_rows(src, factors, scale, out=src)
    assert torch.equal(src, got) and (src[3] == 0).all()
