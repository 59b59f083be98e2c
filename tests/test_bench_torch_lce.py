"""torch 2.13's ``linear_cross_entropy`` files loaded as the workbench does on an older torch
(:mod:`kernels_workbench.bench.torch_lce`): the same numbers as torch's own function, bit for bit,
where torch has it (the files are then the installed torch's own); a folder that lacks them is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kernels_lib  # sets up the backend before the kernels are defined
from kernels_workbench.bench import fused_linear_cross_entropy as flce
from kernels_workbench.bench import torch_lce

HAS_LCE = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
needs_lce = pytest.mark.skipif(not HAS_LCE, reason=f"torch {torch.__version__} has no F.linear_cross_entropy (2.13+)")
TORCH_FILES = Path(torch.__file__).parent / "nn" / "modules"
DEVICE = kernels_lib.default_device()


def inputs(n=37, hidden=24, vocab=1031, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * hidden**-0.5
    b = torch.randn(vocab, generator=g) if bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    y[::5] = -100
    return [t if t is None else t.to(DEVICE) for t in (x, w, b, y)]


def run(function, options_class, reduction, policy, tensors):
    x, w, b, y = (t if t is None or t.dtype == torch.int64 else t.clone().requires_grad_() for t in tensors)
    options = options_class() if policy is None else options_class(acc_policy=policy)
    loss = function(x, w, y, linear_bias=b, reduction=reduction, ignore_index=-100, options=options)
    loss.sum().backward()
    return [loss.detach(), x.grad, w.grad] + ([b.grad] if b is not None else [])


@needs_lce
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("policy", [None, "accurate"])
@pytest.mark.parametrize("bias", [False, True])
def test_files_match_torch_bit_for_bit(reduction, policy, bias):
    loaded = torch_lce.load_files(TORCH_FILES)
    assert loaded.source.startswith("torch 2.13's files")
    tensors = inputs(bias=bias)
    ours = run(loaded.function, loaded.options_class, reduction, policy, tensors)
    theirs = run(F.linear_cross_entropy, torch.nn.LinearCrossEntropyOptions, reduction, policy, tensors)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert torch.isfinite(ours[0]).all() and ours[1].abs().sum() > 0  # a loss and a gradient, not zeros


def test_folder_without_the_files_is_named(tmp_path):
    (tmp_path / torch_lce.FILE_NAMES["ops"]).write_text("")
    with pytest.raises(FileNotFoundError, match="KERNELS_LIB_TORCH_LCE_FILES.*linear_cross_entropy_options.py"):
        torch_lce.load_files(tmp_path)


def test_missing_function_names_what_is_missing(monkeypatch):
    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    monkeypatch.delenv(torch_lce.FILES_VARIABLE, raising=False)
    with pytest.raises(ImportError, match="linear_cross_entropy.*KERNELS_LIB_TORCH_LCE_FILES"):
        torch_lce.load()


@needs_lce
def test_provider_runs_the_files_where_torch_lacks_the_function(monkeypatch):
    """The bench provider on a torch without the function: the files from the variable, torch's numbers."""
    tensors = inputs(bias=False)
    want = run(F.linear_cross_entropy, torch.nn.LinearCrossEntropyOptions, "mean", None, tensors)
    monkeypatch.delattr(F, "linear_cross_entropy")
    monkeypatch.setenv(torch_lce.FILES_VARIABLE, str(TORCH_FILES))
    provider = flce.PROVIDERS["torch_lce"].load()
    x, w, _, y = (t if t is None or t.dtype == torch.int64 else t.clone().requires_grad_() for t in tensors)
    loss = provider(x, w, y)
    loss.backward()
    assert torch.equal(loss.detach(), want[0]) and torch.equal(x.grad, want[1]) and torch.equal(w.grad, want[2])
