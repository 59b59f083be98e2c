"""kernels_lib.kl_div against a float64 reference (torch.nn.functional.kl_div on float64 copies).

Errors are ``||out - ref|| / ||ref||`` (:func:`kernels_workbench.check.relative_error`), the reference run
on float64 copies of the very inputs the kernel saw, bounded by :data:`kernels_workbench.check.TOLERANCE`
of the input dtype (the looser of the two when the dtypes are mixed). Shapes are small: without a
GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device
from kernels_workbench.check import TOLERANCE, relative_error
from kernels_lib.kernels.kl_div_backward import launch_kl_div_backward
from kernels_lib.kernels import scale_gradient
from kernels_lib.kernels.scale_gradient import launch_scale_gradient
from kernels_lib.kernels.kl_div_forward import BLOCK, launch_kl_div_forward, num_programs
from kernels_lib.kl_div import REDUCTIONS, KLDivLoss, kl_div

# The module itself (for monkeypatching), whatever the package's __init__ exports under that name.
kl_module = importlib.import_module("kernels_lib.kl_div")

DEVICE = default_device()
# torch warns on every reduction="mean" call that the mean runs over all elements: documented here.
pytestmark = pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tolerance(*dtypes: torch.dtype) -> float:
    return max(TOLERANCE[d] for d in dtypes)


def make(shape, dtype=torch.float32, *, log_target=False, seed=0, target_dtype=None):
    """Log-probabilities and target (log-)probabilities along the last dimension, fresh per seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).log_softmax(-1)
    t = torch.randn(shape, generator=gen) * 2
    t = t.log_softmax(-1) if log_target else t.softmax(-1)
    return x.to(DEVICE, dtype), t.to(DEVICE, target_dtype or dtype)


def reference(x, t, reduction, log_target, upstream=None):
    """(loss, d loss / d x) of torch's kl_div on float64 copies; ``upstream`` defaults to ones."""
    xd = x.detach().double().requires_grad_()
    loss = F.kl_div(xd, t.detach().double(), reduction=reduction, log_target=log_target)
    if upstream is None:
        upstream = torch.ones_like(loss)
    loss.backward(upstream.double())
    return loss.detach(), xd.grad


def run(x, t, reduction, log_target, upstream=None):
    """(loss, x.grad) of kernels_lib.kl_div on a fresh leaf copy of ``x``."""
    leaf = x.detach().clone().requires_grad_()
    loss = kl_div(leaf, t, reduction=reduction, log_target=log_target)
    if upstream is None:
        upstream = torch.ones_like(loss)
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), leaf.grad


def assert_close(out, ref, tol, what):
    err = relative_error(out, ref)
    assert not math.isnan(err), f"{what}: NaN"
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


# --------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_loss_and_grad_match_float64_reference(reduction, log_target, dtype):
    x, t = make((5, 37), dtype, log_target=log_target, seed=REDUCTIONS.index(reduction) * 2 + log_target)
    loss, grad = run(x, t, reduction, log_target)
    ref_loss, ref_grad = reference(x, t, reduction, log_target)
    assert loss.dtype == dtype and loss.shape == ref_loss.shape
    assert grad.dtype == dtype and grad.shape == x.shape
    assert_close(loss, ref_loss, TOLERANCE[dtype], "loss")
    assert_close(grad, ref_grad, TOLERANCE[dtype], "grad")


@pytest.mark.parametrize(
    "shape",
    [(1, 50257), (7, 1031), (3, 4097), (2, 3, 37), (1000,), (1, 1), (4096,), (2, 4096)],
    ids=lambda s: "x".join(map(str, s)),
)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_odd_shapes(shape, reduction):
    x, t = make(shape, seed=len(shape) + shape[-1])
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) if reduction == "none" else None
    loss, grad = run(x, t, reduction, False, upstream)
    ref_loss, ref_grad = reference(x, t, reduction, False, upstream)
    assert loss.shape == ref_loss.shape and grad.shape == x.shape
    assert_close(loss, ref_loss, TOLERANCE[torch.float32], "loss")
    assert_close(grad, ref_grad, TOLERANCE[torch.float32], "grad")


@pytest.mark.parametrize("shape", [(2, 3, 37), (1000,), (6, 5)], ids=str)
def test_batchmean_divides_by_size0(shape):
    x, t = make(shape, seed=3)
    total = kl_div(x, t, reduction="sum")
    batchmean = kl_div(x, t, reduction="batchmean")
    mean = kl_div(x, t, reduction="mean")
    assert batchmean.item() == pytest.approx(total.item() / shape[0], rel=1e-5)
    assert mean.item() == pytest.approx(total.item() / x.numel(), rel=1e-5)
    ref = F.kl_div(x.double(), t.double(), reduction="batchmean")
    assert_close(batchmean, ref, TOLERANCE[torch.float32], "batchmean")


@pytest.mark.parametrize(
    "input_dtype,target_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float16),
    ],
    ids=str,
)
@pytest.mark.parametrize("reduction", ["none", "sum", "batchmean"])
def test_mixed_dtypes(input_dtype, target_dtype, reduction):
    x, t = make((4, 53), input_dtype, seed=11, target_dtype=target_dtype)
    upstream = torch.randn(4, 53, generator=torch.Generator().manual_seed(2)).to(DEVICE) if reduction == "none" else None
    loss, grad = run(x, t, reduction, False, upstream)
    ref_loss, ref_grad = reference(x, t, reduction, False, upstream)
    assert loss.dtype == torch.promote_types(input_dtype, target_dtype)
    assert grad.dtype == input_dtype
    tol = tolerance(input_dtype, target_dtype)
    assert_close(loss, ref_loss, tol, "loss")
    assert_close(grad, ref_grad, tol, "grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "mean", "batchmean"])
def test_grad_with_non_unit_scalar_upstream(reduction, log_target, dtype):
    x, t = make((3, 41), dtype, log_target=log_target, seed=5)
    upstream = torch.tensor(-0.37, dtype=torch.float64, device=DEVICE)
    loss, grad = run(x, t, reduction, log_target, upstream)
    ref_loss, ref_grad = reference(x, t, reduction, log_target, upstream)
    assert_close(grad, ref_grad, TOLERANCE[dtype], "grad")
    # And the unit upstream (the in-place scale is skipped) gives the unscaled gradient.
    _, grad_unit = run(x, t, reduction, log_target)
    assert_close(grad_unit, ref_grad / upstream, TOLERANCE[dtype], "grad with upstream 1")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log_target", [False, True])
def test_grad_none_reduction_random_upstream(log_target, dtype):
    x, t = make((2, 3, 29), dtype, log_target=log_target, seed=7)
    upstream = torch.randn(2, 3, 29, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    loss, grad = run(x, t, "none", log_target, upstream)
    ref_loss, ref_grad = reference(x, t, "none", log_target, upstream)
    assert loss.shape == x.shape
    assert_close(loss, ref_loss, TOLERANCE[dtype], "loss")
    assert_close(grad, ref_grad, TOLERANCE[dtype], "grad")


def test_non_contiguous_input():
    base_x, base_t = make((37, 6), seed=9)
    x, t = base_x.t(), base_t.t()  # (6, 37), not contiguous
    assert not x.is_contiguous()
    loss, grad = run(x, t, "batchmean", False)
    ref_loss, ref_grad = reference(x, t, "batchmean", False)
    assert_close(loss, ref_loss, TOLERANCE[torch.float32], "loss")
    assert_close(grad, ref_grad, TOLERANCE[torch.float32], "grad")


def test_fresh_random_inputs_each_seed():
    """Several independent draws, including unnormalized inputs, all within tolerance."""
    for seed in range(4):
        gen = torch.Generator().manual_seed(100 + seed)
        x = (torch.randn(3, 67, generator=gen) * 3).to(DEVICE)
        t = torch.rand(3, 67, generator=gen).to(DEVICE)
        for reduction in REDUCTIONS:
            loss, grad = run(x, t, reduction, False)
            ref_loss, ref_grad = reference(x, t, reduction, False)
            assert_close(loss, ref_loss, TOLERANCE[torch.float32], f"loss seed {seed} {reduction}")
            assert_close(grad, ref_grad, TOLERANCE[torch.float32], f"grad seed {seed} {reduction}")


# --------------------------------------------------------------------------- zeros and NaN


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_target_with_exact_zeros(reduction):
    x, t = make((4, 33), seed=13)
    t[:, ::3] = 0.0
    t[2] = 0.0  # a whole row of zeros
    loss, grad = run(x, t, reduction, False)
    ref_loss, ref_grad = reference(x, t, reduction, False)
    assert torch.isfinite(loss).all()
    assert_close(loss, ref_loss, TOLERANCE[torch.float32], "loss")
    assert_close(grad, ref_grad, TOLERANCE[torch.float32], "grad")
    if reduction == "none":
        assert (loss[:, ::3] == 0).all() and (loss[2] == 0).all()
    assert (grad[2] == 0).all()


def test_all_zero_target_gives_zero_loss():
    x, _ = make((3, 10), seed=1)
    t = torch.zeros_like(x)
    for reduction in ("sum", "mean", "batchmean"):
        assert kl_div(x, t, reduction=reduction).item() == 0.0


@pytest.mark.parametrize("where", ["input", "target"])
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nan_gives_nan(reduction, log_target, where):
    x, t = make((3, 20), log_target=log_target, seed=17)
    (x if where == "input" else t)[1, 4] = float("nan")
    loss = kl_div(x, t, reduction=reduction, log_target=log_target)
    ref = F.kl_div(x.double(), t.double(), reduction=reduction, log_target=log_target)
    if reduction == "none":
        assert torch.isnan(loss[1, 4])
        mask = torch.ones_like(loss, dtype=torch.bool)
        mask[1, 4] = False
        assert torch.isfinite(loss[mask]).all()
        assert_close(loss[mask], ref[mask], TOLERANCE[torch.float32], "finite part")
    else:
        assert torch.isnan(loss), f"{reduction}: {loss}"


def test_nan_input_where_target_is_zero_gives_nan():
    """0 * NaN is NaN (torch: xlogy(0, 0) - 0 * NaN): the 0 log 0 rule must not hide a NaN input."""
    x, t = make((2, 8), seed=2)
    t[0, 0] = 0.0
    x[0, 0] = float("nan")
    assert torch.isnan(F.kl_div(x, t, reduction="sum"))
    assert torch.isnan(kl_div(x, t, reduction="sum"))
    assert torch.isnan(kl_div(x, t, reduction="none")[0, 0])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy log of a negative
def test_negative_target_gives_nan_as_torch():
    x, t = make((2, 8), seed=4)
    t[1, 3] = -0.25
    assert torch.isnan(F.kl_div(x, t, reduction="sum"))
    assert torch.isnan(kl_div(x, t, reduction="sum"))


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_none_reduction_reduced_by_torch_backward(reduce):
    """loss.sum().backward() hands backward an expanded (stride-0) upstream gradient."""
    x, t = make((3, 19), seed=8)
    leaf = x.clone().requires_grad_()
    getattr(kl_div(leaf, t, reduction="none"), reduce)().backward()
    _, ref = reference(x, t, reduce, False)
    assert_close(leaf.grad, ref, TOLERANCE[torch.float32], "grad")


# --------------------------------------------------------------------------- retained graph


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_second_backward_through_retained_graph_accumulates(reduction, log_target):
    x, t = make((3, 45), log_target=log_target, seed=19)
    leaf = x.clone().requires_grad_()
    loss = kl_div(leaf, t, reduction=reduction, log_target=log_target)
    gen = torch.Generator().manual_seed(4)
    if reduction == "none":
        g1, g2, g3 = (torch.randn(3, 45, generator=gen).to(DEVICE) for _ in range(3))
    else:
        g1, g2, g3 = (torch.tensor(v, device=DEVICE) for v in (0.5, 1.0, -2.0))
    loss.backward(g1, retain_graph=True)
    _, ref1 = reference(x, t, reduction, log_target, g1)
    assert_close(leaf.grad, ref1, TOLERANCE[torch.float32], "first backward")
    loss.backward(g2, retain_graph=True)
    _, ref2 = reference(x, t, reduction, log_target, g1 + g2)
    assert_close(leaf.grad, ref2, TOLERANCE[torch.float32], "second backward")
    loss.backward(g3)
    _, ref3 = reference(x, t, reduction, log_target, g1 + g2 + g3)
    assert_close(leaf.grad, ref3, TOLERANCE[torch.float32], "third backward")


def test_second_backward_unit_upstream():
    x, t = make((4, 30), seed=23)
    leaf = x.clone().requires_grad_()
    loss = kl_div(leaf, t, reduction="batchmean")
    loss.backward(retain_graph=True)
    loss.backward()
    _, ref = reference(x, t, "batchmean", False)
    assert_close(leaf.grad, 2 * ref, TOLERANCE[torch.float32], "two backwards")


def test_autograd_grad_twice():
    x, t = make((2, 30), seed=29)
    leaf = x.clone().requires_grad_()
    loss = kl_div(leaf, t, reduction="sum")
    (g1,) = torch.autograd.grad(loss, leaf, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, leaf, torch.tensor(3.0, device=DEVICE))
    _, ref = reference(x, t, "sum", False)
    assert_close(g1, ref, TOLERANCE[torch.float32], "first")
    assert_close(g2, 3 * ref, TOLERANCE[torch.float32], "second")


# --------------------------------------------------------------------------- launchers


def poisoned(n, dtype=torch.float32):
    return torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("block", [BLOCK, 128])
@pytest.mark.parametrize("log_target", [False, True])
def test_launch_forward_reduce_writes_every_element(log_target, block):
    numel = 2 * block + 37
    x, t = make((numel,), log_target=log_target, seed=31)
    programs = num_programs(numel, block)
    assert programs == 3
    partial, grad = poisoned(programs), poisoned(numel)
    launch_kl_div_forward(
        x, t, log_target=log_target, partial=partial, loss=None, grad=grad, grad_scale=0.25, block=block
    )
    assert torch.isfinite(partial).all() and torch.isfinite(grad).all()
    ref_loss, ref_grad = reference(x, t, "sum", log_target)
    assert_close(partial.sum(), ref_loss, TOLERANCE[torch.float32], "partial sums")
    assert_close(grad, 0.25 * ref_grad, TOLERANCE[torch.float32], "grad")
    # Each program's partial is the sum of its own block.
    pointwise = F.kl_div(x.double(), t.double(), reduction="none", log_target=log_target)
    for p in range(programs):
        expected = pointwise[p * block : (p + 1) * block].sum()
        assert partial[p].item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("log_target", [False, True])
def test_launch_forward_pointwise_writes_every_element(log_target, dtype):
    numel = BLOCK + 99
    x, t = make((numel,), dtype, log_target=log_target, seed=37)
    loss, grad = poisoned(numel, dtype), poisoned(numel, dtype)
    launch_kl_div_forward(x, t, log_target=log_target, partial=None, loss=loss, grad=grad)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    ref = F.kl_div(x.double(), t.double(), reduction="none", log_target=log_target)
    assert_close(loss, ref, TOLERANCE[dtype], "pointwise loss")
    ref_grad = -(t.double().exp() if log_target else t.double())
    assert_close(grad, ref_grad, TOLERANCE[dtype], "grad")


def test_launch_forward_without_grad_leaves_no_grad_written():
    numel = 300
    x, t = make((numel,), seed=41)
    partial = poisoned(num_programs(numel))
    x_before, t_before = x.clone(), t.clone()
    launch_kl_div_forward(x, t, log_target=False, partial=partial, loss=None, grad=None)
    assert torch.isfinite(partial).all()
    ref_loss, _ = reference(x, t, "sum", False)
    assert_close(partial.sum(), ref_loss, TOLERANCE[torch.float32], "partial sums")
    # input stands in for the unused loss and grad pointers: it must come back unwritten.
    assert torch.equal(x, x_before) and torch.equal(t, t_before)


def test_launch_forward_needs_exactly_one_output():
    x, t = make((10,), seed=1)
    with pytest.raises(ValueError, match="exactly one"):
        launch_kl_div_forward(x, t, log_target=False, partial=None, loss=None, grad=None)
    with pytest.raises(ValueError, match="exactly one"):
        launch_kl_div_forward(x, t, log_target=False, partial=poisoned(1), loss=poisoned(10), grad=None)


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("scalar", [False, True])
def test_launch_backward_writes_every_element(scalar, log_target):
    numel = 2 * BLOCK + 5
    _, t = make((numel,), log_target=log_target, seed=43)
    gen = torch.Generator().manual_seed(5)
    g = torch.tensor(1.75, device=DEVICE) if scalar else torch.randn(numel, generator=gen).to(DEVICE)
    grad = poisoned(numel)
    launch_kl_div_backward(t, g, log_target=log_target, grad=grad, grad_scale=0.5)
    assert torch.isfinite(grad).all()
    p = t.double().exp() if log_target else t.double()
    assert_close(grad, -p * g.double() * 0.5, TOLERANCE[torch.float32], "grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_launch_scale_gradient(dtype):
    numel = BLOCK + 13
    base = torch.randn(numel, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    grad = base.clone()
    launch_scale_gradient(grad, torch.tensor(-3.0, device=DEVICE))
    assert_close(grad, base.double() * -3.0, TOLERANCE[dtype], "scaled")
    # Upstream 1: nothing is read or written, so even a NaN-poisoned buffer stays as it is.
    untouched = poisoned(numel, dtype)
    launch_scale_gradient(untouched, torch.tensor(1.0, device=DEVICE))
    assert torch.isnan(untouched).all()
    kept = base.clone()
    launch_scale_gradient(kept, torch.tensor(1.0, dtype=torch.bfloat16, device=DEVICE))
    assert torch.equal(kept, base)


def test_scale_gradient_programs_stride_over_every_block(monkeypatch):
    """More blocks than programs (the grid's cap made small): each program scales every
    ``programs``-th block, the ragged last one too, and nothing past the end."""
    monkeypatch.setattr(scale_gradient, "MAX_PROGRAMS", 2)
    numel = 5 * scale_gradient.BLOCK + 13
    base = torch.randn(numel + 7, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    buffer = base.clone()
    launch_scale_gradient(buffer[:numel], torch.tensor(0.5, device=DEVICE))
    assert_close(buffer[:numel], base[:numel].double() * 0.5, TOLERANCE[torch.float32], "scaled")
    assert torch.equal(buffer[numel:], base[numel:])


# --------------------------------------------------------------------------- grad buffers


class Recorder:
    """Wraps launch_kl_div_forward, recording its ``grad`` argument per call."""

    def __init__(self):
        self.grads = []
        self.original = kl_module.launch_kl_div_forward

    def __call__(self, *args, **kwargs):
        self.grads.append(kwargs.get("grad"))
        return self.original(*args, **kwargs)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(kl_module, "launch_kl_div_forward", rec)
    return rec


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_grad_written_when_input_does_not_require_grad(recorder, reduction):
    x, t = make((3, 20), seed=47)
    loss = kl_div(x, t, reduction=reduction)
    assert len(recorder.grads) == 1 and recorder.grads[0] is None
    assert not loss.requires_grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_no_grad_written_under_no_grad(recorder, reduction):
    x, t = make((3, 20), seed=53)
    leaf = x.requires_grad_()
    with torch.no_grad():
        loss = kl_div(leaf, t, reduction=reduction)
    assert len(recorder.grads) == 1 and recorder.grads[0] is None
    assert not loss.requires_grad
    ref = F.kl_div(x.detach().double(), t.double(), reduction=reduction)
    assert_close(loss, ref, TOLERANCE[torch.float32], "loss")


def test_target_requiring_grad_allowed_under_no_grad(recorder):
    x, t = make((2, 10), seed=3)
    t.requires_grad_()
    with torch.no_grad():
        loss = kl_div(x, t)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("reduction", ["sum", "mean", "batchmean"])
def test_grad_is_written_in_forward_when_needed(recorder, reduction):
    x, t = make((3, 20), seed=59)
    leaf = x.requires_grad_()
    kl_div(leaf, t, reduction=reduction)
    assert len(recorder.grads) == 1 and recorder.grads[0] is not None
    assert recorder.grads[0].shape == x.shape


@pytest.mark.parametrize("upstream", [None, 2.5])
@pytest.mark.parametrize("reduction", ["sum", "mean", "batchmean"])
def test_input_grad_is_the_forward_buffer(recorder, reduction, upstream):
    x, t = make((4, 25), seed=61)
    leaf = x.clone().requires_grad_()
    loss = kl_div(leaf, t, reduction=reduction)
    (buffer,) = recorder.grads
    pointer = buffer.data_ptr()
    del buffer
    recorder.grads.clear()
    if upstream is None:
        loss.backward()
    else:
        loss.backward(torch.tensor(upstream, device=DEVICE))
    assert leaf.grad.data_ptr() == pointer, "input.grad is a copy of the forward buffer"
    _, ref = reference(x, t, reduction, False, None if upstream is None else torch.tensor(upstream, device=DEVICE))
    assert_close(leaf.grad, ref, TOLERANCE[torch.float32], "grad")


# --------------------------------------------------------------------------- module


@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_module_matches_function_and_reference(reduction, log_target):
    module = KLDivLoss(reduction=reduction, log_target=log_target)
    assert repr(reduction) in repr(module) and f"log_target={log_target}" in repr(module)
    x, t = make((3, 31), log_target=log_target, seed=67)
    leaf = x.clone().requires_grad_()
    loss = module(leaf, t)
    assert torch.equal(loss.detach(), kl_div(x, t, reduction=reduction, log_target=log_target))
    loss.backward(torch.ones_like(loss))
    ref_loss, ref_grad = reference(x, t, reduction, log_target)
    assert_close(loss, ref_loss, TOLERANCE[torch.float32], "loss")
    assert_close(leaf.grad, ref_grad, TOLERANCE[torch.float32], "grad")


def test_module_default_is_batchmean():
    module = KLDivLoss()
    x, t = make((4, 12), seed=71)
    assert module.reduction == "batchmean" and module.log_target is False
    ref = F.kl_div(x.double(), t.double(), reduction="batchmean")
    assert_close(module(x, t), ref, TOLERANCE[torch.float32], "loss")


def test_module_rejects_unknown_reduction():
    with pytest.raises(ValueError, match="reduction"):
        KLDivLoss(reduction="average")


# --------------------------------------------------------------------------- bad inputs


def _good():
    return make((3, 8), seed=0)


def _bad_cases():
    x, t = _good()
    return {
        "differing shapes": (lambda: kl_div(x, t[:, :5]), ValueError, ["input", "target"]),
        "broadcastable shapes": (lambda: kl_div(x, t[:1]), ValueError, ["input", "target"]),
        "integer input": (lambda: kl_div(x.long(), t), TypeError, ["input"]),
        "integer target": (lambda: kl_div(x, t.to(torch.int32)), TypeError, ["target"]),
        "bool target": (lambda: kl_div(x, t > 0), TypeError, ["target"]),
        "float64 input": (lambda: kl_div(x.double(), t), TypeError, ["input"]),
        "float64 target": (lambda: kl_div(x, t.double()), TypeError, ["target"]),
        "non-tensor input": (lambda: kl_div(x.tolist(), t), TypeError, ["input"]),
        "non-tensor target": (lambda: kl_div(x, 0.5), TypeError, ["target"]),
        "unknown reduction": (lambda: kl_div(x, t, reduction="average"), ValueError, ["reduction"]),
        "reduction None": (lambda: kl_div(x, t, reduction=None), ValueError, ["reduction"]),
        "non-bool log_target int": (lambda: kl_div(x, t, log_target=1), TypeError, ["log_target"]),
        "non-bool log_target str": (lambda: kl_div(x, t, log_target="yes"), TypeError, ["log_target"]),
        "empty tensor": (lambda: kl_div(torch.empty(0, 5, device=DEVICE), torch.empty(0, 5, device=DEVICE)), ValueError, ["input"]),
        "0-dim tensor": (lambda: kl_div(torch.tensor(-1.0, device=DEVICE), torch.tensor(0.5, device=DEVICE)), ValueError, ["input"]),
        "target requires grad": (
            lambda: kl_div(x.clone().requires_grad_(), t.clone().requires_grad_()),
            ValueError,
            ["target"],
        ),
        "both on meta": (
            lambda: kl_div(torch.empty(3, 8, device="meta"), torch.empty(3, 8, device="meta")),
            ValueError,
            ["input", "meta"],
        ),
        "target on meta": (
            lambda: kl_div(x, torch.empty(3, 8, device="meta")),
            ValueError,
            ["input", "target", "meta"],
        ),
        "input on meta": (
            lambda: kl_div(torch.empty(3, 8, device="meta"), t),
            ValueError,
            ["input", "target", "meta"],
        ),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs_raise_naming_the_argument(case):
    call, error, names = _bad_cases()[case]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for name in names:
        assert name in message, f"{case}: {name!r} not in {message!r}"
