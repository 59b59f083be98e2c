"""The studies' A/B machinery: an arm's module constants set for the calls inside and put back, and a
committed run file that is corrupt named by its path."""

from __future__ import annotations

import importlib

import pytest

from kernels_lib.chunks import matmuls
from kernels_workbench import data
from studies.bench import flce_studies
from studies.bench.arms import constants_set


def test_an_arm_sets_its_constants_for_the_calls_inside_and_puts_them_back():
    """constants_set: the arm's values inside, the old ones after (also after an error); a constant the
    module lacks is refused before anything is set."""
    flce_module = importlib.import_module("kernels_lib.fused_linear_cross_entropy")  # the package's name is the function
    rows, store = matmuls.DX_BLOCK_ROWS, flce_module.STORE_EXPONENTIALS
    settings = {matmuls.__name__: {"DX_BLOCK_ROWS": rows + 7}, flce_module.__name__: {"STORE_EXPONENTIALS": not store}}
    with constants_set(settings):
        assert (matmuls.DX_BLOCK_ROWS, flce_module.STORE_EXPONENTIALS) == (rows + 7, not store)
    assert (matmuls.DX_BLOCK_ROWS, flce_module.STORE_EXPONENTIALS) == (rows, store)
    with pytest.raises(RuntimeError, match="inside"):
        with constants_set(settings):
            raise RuntimeError("inside")
    assert (matmuls.DX_BLOCK_ROWS, flce_module.STORE_EXPONENTIALS) == (rows, store)
    with pytest.raises(AttributeError, match="kernels_lib.chunks.matmuls has no constant DX_BLOCK_ROW to set"):
        with constants_set({flce_module.__name__: {"STORE_EXPONENTIALS": not store}, matmuls.__name__: {"DX_BLOCK_ROW": 1}}):
            pass
    assert flce_module.STORE_EXPONENTIALS == store


@pytest.mark.parametrize("kind", ["ragged", "empty"])
def test_corrupt_gpu_run_file_is_named(kind, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    path = tmp_path / flce_studies.RUN_FILES["dial"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("a,b\n1,2\n3,4,5\n" if kind == "ragged" else "")
    with pytest.raises(Exception) as info:
        flce_studies.load_run("dial")
    assert str(path) in str(info.value)


def test_within_enters_a_fresh_context_at_each_call_and_flat_outputs_reads_loss_and_grads():
    import contextlib
    from collections import namedtuple

    import torch

    from studies.bench.arms import flat_outputs, within

    entered = []

    @contextlib.contextmanager
    def ctx():
        entered.append(True)
        yield

    seen = []
    call = within(ctx, lambda: seen.append(len(entered)))
    call(), call()
    assert seen == [1, 2], "each call must run inside its own context"

    x = torch.tensor([1.0, 2.0], requires_grad=True)
    x.grad = torch.full((2,), 7.0)  # a stale gradient: flat_outputs must clear it first
    Out = namedtuple("Out", "loss")
    flat = flat_outputs(lambda: Out((x * x).sum()), [x], ctx)
    assert flat.dtype == torch.float64 and flat.tolist() == [5.0, 2.0, 4.0]
    assert len(entered) == 3
