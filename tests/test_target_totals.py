"""The targets' totals kernel and the preamble built on it (normalizer, class-weight sum, range check)."""

from __future__ import annotations

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device
from kernels_lib._target_totals import target_totals
from kernels_lib.kernels.target_totals import BLOCK, launch_target_totals
from device_errors import assert_device_error

DEVICE = default_device()
IGNORE = -100


def expected(target, n_cols, weight=None):
    """[T, D, B, [B = 0], 1/D, 1] from plain torch on the host, in float64."""
    y = target.cpu().long()
    valid = y != IGNORE
    bad = valid & ((y < 0) | (y >= n_cols))
    good = valid & ~bad
    w = torch.ones(n_cols, dtype=torch.float64) if weight is None else weight.cpu().double()
    total = w[y[good]].sum().item()
    normalizer = total if total != 0 else 1.0
    return [total, normalizer, float(bad.sum()), float(not bad.any()), 1.0 / normalizer, 1.0]


@pytest.mark.parametrize("n", [1, 37, BLOCK + 5])  # one row, one block, a partial second block
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_totals_match_torch(n, weighted, dtype):
    gen = torch.Generator().manual_seed(n)
    n_cols = 50257
    target = torch.randint(0, n_cols, (n,), generator=gen)
    target[::3] = IGNORE
    if n > 2:
        target[1], target[-1] = n_cols, -7  # out of range, both ends
    weight = torch.rand(n_cols, generator=gen) if weighted else None
    out = launch_target_totals(target.to(DEVICE, dtype), n_cols, IGNORE,
                               None if weight is None else weight.to(DEVICE))
    assert out.dtype == torch.float32 and out.shape == (6,)
    assert out.cpu().tolist() == pytest.approx(expected(target, n_cols, weight), rel=1e-6)


def test_all_ignored_gives_normalizer_one():
    out = launch_target_totals(torch.full((9,), IGNORE, device=DEVICE), 10, IGNORE)
    assert out.cpu().tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 1.0]


def test_preamble_and_range_check():
    target = torch.tensor([[3, IGNORE], [9, 0]], device=DEVICE)
    weight = torch.arange(1.0, 11.0, device=DEVICE)
    totals = target_totals(target, 10, IGNORE, weight, host_checks=True)
    assert totals.valid_weight.item() == 4.0 + 10.0 + 1.0 and totals.normalizer.item() == 15.0
    assert totals.mean_factor.shape == (1,) and totals.mean_factor.item() == pytest.approx(1 / 15.0)
    assert totals.sum_factor.shape == (1,) and totals.sum_factor.item() == 1.0
    assert totals.weight_sum.shape == (1,) and totals.weight_sum.item() == 55.0
    totals.check.raise_if_bad()  # nothing out of range
    bad = torch.tensor([3, 10, IGNORE, -1], device=DEVICE)
    with pytest.raises(ValueError, match=r"target holds 2 value\(s\) outside \[0, 10\).*e\.g\. 10"):
        target_totals(bad, 10, IGNORE, None, host_checks=True).check.raise_if_bad()
    # On CUDA a device-side assert, which ends the process's CUDA context: there in a subprocess.
    assert_device_error("target_totals(bad, 10, -100, None, host_checks=False)", "outside", setup="""
        from kernels_lib._target_totals import target_totals
        bad = torch.tensor([3, 10, -100, -1], device=DEVICE)
    """)
