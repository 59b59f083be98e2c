"""scripts/hardening_checks.py at CPU size: the float64 chunked reference, the check table, determinism rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest
import torch

from kernels_lib import reference
from kernels_workbench.bench import registered_losses
from kernels_workbench.check import relative_error

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hardening_checks.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("h200_hardening", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chunked_float64_reference_matches_autograd(script):
    """The chunked float64 loss and gradients equal autograd through the one-shot float64 reference."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(37, 11, generator=g, dtype=torch.float64), torch.randn(29, 11, generator=g, dtype=torch.float64)
    y = torch.randint(0, 29, (37,), generator=g)
    y[::5] = -100
    loss, dx, dw = script.float64_cross_entropy(x, w, y, chunk=8)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = reference.fused_linear_cross_entropy(xs, ws, y)
    ref.backward()
    assert relative_error(loss, ref) < 1e-13
    assert relative_error(dx, xs.grad) < 1e-13 and relative_error(dw, ws.grad) < 1e-13
    assert dx[::5].abs().max() == 0  # ignored rows get no gradient


def test_small_run_writes_both_tables(script, tmp_path, capsys):
    assert script.main(["--out", str(tmp_path), "--size", "small"]) == 0
    check = pd.read_csv(tmp_path / "flce_32768_check.csv")
    assert list(check.provider) == ["kernels_lib", "baseline"]
    ours = check.set_index("provider").loc["kernels_lib"]
    assert ours.loss_err < 1e-5 and max(ours.dx_err, ours.dW_err, ours.dx_last_rows_err) < 1.6e-2 and ours.nonfinite == 0
    determinism = pd.read_csv(tmp_path / "determinism.csv")
    assert set(determinism.kernel_name) == set(registered_losses())
    assert {"loss", "dx", "dweight"} <= set(determinism.output) and determinism.bitwise_equal.all()
    assert (determinism.max_abs_diff == 0).all() and (determinism.runs == 3).all()
    assert "bitwise_equal" in capsys.readouterr().out


def test_unknown_part_and_full_size_without_cuda_are_refused(script, tmp_path):
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path), "--parts", "speed"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            script.main(["--out", str(tmp_path)])
