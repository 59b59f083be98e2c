"""The class-major gradient kernel against its formula in float64: ``dz^T = g (softmax - onehot)``,
written in place over class-major logits (a view of a wider buffer, whose other columns stay as they
were), 0 at ignored rows, NaN where a row's logits hold one. Odd sizes: V = 1031, N = 37 and N = 1."""

from __future__ import annotations

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device
from kernels_lib.kernels.class_major_gradient import launch_class_major_gradient

DEVICE = default_device()
IGNORE = -100


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy on NaN
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2**-8)])
@pytest.mark.parametrize("n_rows", [37, 1])
def test_matches_formula(n_rows, dtype, tol):
    gen = torch.Generator().manual_seed(3)
    n_cols = 1031
    z = torch.randn(n_rows, n_cols, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, n_cols, (n_rows,), generator=gen)
    if n_rows > 1:
        target[4] = IGNORE
        z[7, 11] = float("nan")
    wide = torch.full((n_cols, n_rows + 3), 5.0, dtype=dtype)
    wide[:, :n_rows] = z.t().to(dtype)
    stored = wide[:, :n_rows].double().t()  # the logits as the kernel reads them
    lse = torch.logsumexp(stored, 1)
    scale = torch.tensor([0.37])
    buffer = wide.to(DEVICE)
    launch_class_major_gradient(buffer[:, :n_rows], lse.float().to(DEVICE), target.to(DEVICE), scale.to(DEVICE), IGNORE)
    got = buffer[:, :n_rows].double().t().cpu()
    want = 0.37 * (torch.softmax(stored, 1) - torch.nn.functional.one_hot(target.clamp(min=0), n_cols))
    want[target == IGNORE] = 0.0
    finite = torch.ones(n_rows, dtype=torch.bool)
    if n_rows > 1:
        assert got[7].isnan().all(), "a NaN logit makes its row's gradient NaN"
        finite[7] = False
        assert (got[4] == 0).all(), "an ignored row has no gradient"
    error = (got[finite] - want[finite]).norm() / want[finite].norm()
    assert error < tol, error
    assert (buffer[:, n_rows:].cpu() == 5.0).all(), "the columns beyond N are untouched"


def test_refuses_a_row_major_buffer():
    z = torch.zeros(4, 6, device=DEVICE)
    with pytest.raises(ValueError, match="unit stride along N"):
        launch_class_major_gradient(z.t(), torch.zeros(4, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE),
                                    torch.ones(1, device=DEVICE), IGNORE)
