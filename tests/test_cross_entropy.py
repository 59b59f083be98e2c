"""kernels_lib.cross_entropy against a float64 reference and against torch.nn.functional.cross_entropy.

Errors are ``||out - ref|| / ||ref||`` (:func:`kernels_workbench.check.relative_error`), the
reference (:func:`kernels_lib.reference.cross_entropy`, autograd for the gradient) run on float64
copies of the very logits the kernel saw, bounded by :data:`kernels_workbench.check.TOLERANCE`
of the logits' dtype. Shapes are small: without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import kernels_lib
from kernels_lib import default_device, reference
from kernels_lib.kernels import cross_entropy_rows
from kernels_lib.kernels.cross_entropy_rows import launch_cross_entropy_rows
from kernels_workbench.check import TOLERANCE, relative_error
from device_errors import assert_device_error

ce_module = importlib.import_module("kernels_lib.cross_entropy")
cross_entropy, CrossEntropyLoss = ce_module.cross_entropy, ce_module.CrossEntropyLoss
DEVICE = default_device()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("mean", "sum", "none")


def make(n, v, dtype=torch.float32, *, seed=0, ignored=(), scale=3.0):
    """(logits, target): logits ~ N(0, scale²) in ``dtype``, targets uniform, rows in ``ignored`` -100."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=gen) * scale).to(DEVICE, dtype)
    target = torch.randint(0, v, (n,), generator=gen)
    target[list(ignored)] = -100
    return logits, target.to(DEVICE)


def class_weight(v, seed=0):
    return (torch.rand(v, generator=torch.Generator().manual_seed(seed)) + 0.5).to(DEVICE)


def run(fn, logits, target, upstream=None, **kwargs):
    """(loss, logits.grad) of ``fn`` on a fresh leaf copy of ``logits``; ``upstream`` defaults to ones."""
    leaf = logits.detach().clone().requires_grad_()
    out = fn(leaf, target, **kwargs)
    out.backward(torch.ones_like(out) if upstream is None else upstream.to(out.dtype))
    return out.detach(), leaf.grad


def reference_run(logits, target, upstream=None, weight=None, **kwargs):
    weight = None if weight is None else weight.double()
    up = None if upstream is None else upstream.double()
    return run(reference.cross_entropy, logits.double(), target, up, weight=weight, **kwargs)


def assert_close(out, ref, tol, what):
    err = relative_error(out, ref)
    assert not math.isnan(err), f"{what}: NaN"
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def upstream_for(reduction, n, seed=1):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE) if reduction == "none" else None


def check(logits, target, tol=None, *, upstream=None, **kwargs):
    tol = TOLERANCE[logits.dtype] if tol is None else tol
    got, grad = run(cross_entropy, logits, target, upstream, **kwargs)
    want, want_grad = reference_run(logits, target, upstream, **kwargs)
    assert got.shape == want.shape and grad.shape == logits.shape
    assert got.dtype == logits.dtype and grad.dtype == logits.dtype
    assert_close(got, want, tol, "loss")
    assert_close(grad, want_grad, tol, "grad")
    return got, grad


# --------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(dtype, reduction, smoothing):
    logits, target = make(5, 37, dtype, seed=int(smoothing * 10), ignored=[2])
    check(logits, target, reduction=reduction, label_smoothing=smoothing, upstream=upstream_for(reduction, 5))


@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_class_weights(reduction, smoothing):
    logits, target = make(6, 29, seed=4, ignored=[0, 3])
    check(logits, target, reduction=reduction, label_smoothing=smoothing, weight=class_weight(29),
          upstream=upstream_for(reduction, 6))


def resident_launches(monkeypatch) -> list[bool]:
    """The ``RESIDENT`` flag of every launch of the rows kernel from here on, in order (the kernel still runs)."""
    launches = []
    original = cross_entropy_rows.cross_entropy_rows_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs["RESIDENT"])
                return original[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(cross_entropy_rows, "cross_entropy_rows_kernel", Spy())
    return launches


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("resident", [True, False], ids=["row-resident", "two-reads"])
def test_both_forward_paths_with_every_option(resident, dtype, inplace, monkeypatch):
    """The fused forward's two forms of pass 2, the row kept from pass 1 (``RESIDENT``, short rows) and
    the row read again: class weights, smoothing, ignored rows and a non-unit upstream gradient."""
    if not resident:
        monkeypatch.setattr(cross_entropy_rows, "RESIDENT_MAX_COLS", 0)
    logits, target = make(7, 1031, dtype, seed=11, ignored=[0, 4])
    launches = resident_launches(monkeypatch)
    check(logits, target, reduction="sum", label_smoothing=0.2, weight=class_weight(1031, seed=3),
          upstream=torch.tensor(-1.5, device=DEVICE), inplace=inplace)
    assert launches == [resident]


@pytest.mark.parametrize("extra", [0, 1], ids=["at-the-limit", "one-past"])
def test_resident_limit_decides_the_path_and_both_sides_match(extra, monkeypatch):
    """A row of exactly ``RESIDENT_MAX_COLS`` logits is held in registers; one more column is read twice.
    Both sides of the limit match the float64 reference (ignored row, smoothing, non-unit upstream)."""
    n_cols = cross_entropy_rows.RESIDENT_MAX_COLS + extra
    logits, target = make(3, n_cols, torch.float32, seed=5, ignored=[1])
    launches = resident_launches(monkeypatch)
    check(logits, target, reduction="mean", label_smoothing=0.1, upstream=torch.tensor(0.5, device=DEVICE))
    assert launches == [extra == 0], f"V = {n_cols}: RESIDENT launches {launches}, limit {cross_entropy_rows.RESIDENT_MAX_COLS}"


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(1, 7), (1, 1031), (3, 4097), (2, 1)], ids=lambda s: "x".join(map(str, s)))
def test_odd_shapes(shape, reduction):
    logits, target = make(*shape, seed=shape[1])
    check(logits, target, reduction=reduction, label_smoothing=0.2, upstream=upstream_for(reduction, shape[0]))


def test_gpt2_vocab_with_an_ignored_row():
    logits, target = make(3, 50257, seed=7, ignored=[1])
    check(logits, target, reduction="mean", label_smoothing=0.1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_agrees_with_torch_cross_entropy_in_the_same_dtype(reduction, dtype):
    """torch's own F.cross_entropy on the same (16-bit or float32) logits: same dtype, values within
    the dtype's tolerance (both are compared to float64 in test_matches_float64_reference)."""
    logits, target = make(4, 53, dtype, seed=9, ignored=[1])
    upstream = upstream_for(reduction, 4)
    got, grad = run(cross_entropy, logits, target, upstream, reduction=reduction, label_smoothing=0.05)
    want, want_grad = run(F.cross_entropy, logits, target, upstream, reduction=reduction, label_smoothing=0.05)
    assert got.dtype == want.dtype == dtype and grad.dtype == want_grad.dtype == dtype
    assert_close(got, want, 2 * TOLERANCE[dtype], "loss")
    assert_close(grad, want_grad, 2 * TOLERANCE[dtype], "grad")


def test_int32_targets_and_strided_rows():
    """A row-sliced view (row stride > V) and int32 targets are read as they are."""
    wide, target = make(4, 40, seed=10)
    logits = wide[:, 3:34]
    target = (target % 31).to(torch.int32)
    assert logits.stride(0) == 40 and not logits.is_contiguous()
    check(logits, target, reduction="sum")
    check(wide.t().contiguous().t()[:, :31], target, reduction="mean")  # column-major: copied first


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_no_grad(reduction):
    logits, target = make(4, 30, seed=12, ignored=[3])
    with torch.no_grad():
        got = cross_entropy(logits.clone().requires_grad_(), target, reduction=reduction)
    assert not got.requires_grad
    assert_close(got, reference.cross_entropy(logits.double(), target, reduction=reduction), TOLERANCE[torch.float32], "loss")


# --------------------------------------------------------------------------- the gradient buffer


@pytest.mark.parametrize("upstream", [None, 2.5])
def test_logits_grad_is_the_forward_buffer(upstream, monkeypatch):
    """With a reduction the gradient is written in forward and handed out as is (scaled in place)."""
    original, grads = ce_module.launch_cross_entropy_rows, []

    def recording(*args, **kwargs):
        grads.append(kwargs.get("grad"))
        return original(*args, **kwargs)

    monkeypatch.setattr(ce_module, "launch_cross_entropy_rows", recording)
    logits, target = make(3, 40, seed=13, ignored=[0])
    leaf = logits.clone().requires_grad_()
    out = cross_entropy(leaf, target)
    (buffer,) = grads
    pointer = buffer.data_ptr()
    del buffer
    grads.clear()
    upstream = None if upstream is None else torch.tensor(upstream, device=DEVICE)
    out.backward(upstream)
    assert leaf.grad.data_ptr() == pointer and not grads, "backward launched again or copied"
    _, want = reference_run(logits, target, upstream)
    assert_close(leaf.grad, want, TOLERANCE[torch.float32], "grad")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_non_unit_upstream_and_second_backward(reduction):
    logits, target = make(4, 30, seed=5, ignored=[2])
    leaf = logits.clone().requires_grad_()
    out = cross_entropy(leaf, target, reduction=reduction, label_smoothing=0.1)
    ones = torch.ones_like(out)
    out.backward(-0.37 * ones, retain_graph=True)
    out.backward(ones, retain_graph=True)  # a fresh buffer: the first is leaf.grad now
    out.backward(2.0 * ones)
    _, want = reference_run(logits, target, 2.63 * ones, reduction=reduction, label_smoothing=0.1)
    assert_close(leaf.grad, want, TOLERANCE[torch.float32], "accumulated grad")


def test_none_reduced_by_torch():
    """loss.sum().backward() hands backward an expanded (stride-0) upstream gradient."""
    logits, target = make(3, 19, seed=8, ignored=[1])
    leaf = logits.clone().requires_grad_()
    cross_entropy(leaf, target, reduction="none").sum().backward()
    _, want = reference_run(logits, target, reduction="sum")
    assert_close(leaf.grad, want, TOLERANCE[torch.float32], "grad")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_writes_the_gradient_over_the_logits(reduction):
    logits, target = make(4, 33, seed=14, ignored=[3])
    upstream = upstream_for(reduction, 4)
    leaf = logits.clone().requires_grad_()
    out = cross_entropy(leaf, target, reduction=reduction, inplace=True)
    out.backward(torch.ones_like(out) if upstream is None else upstream)
    want_loss, want = reference_run(logits, target, upstream, reduction=reduction)
    # The logits now hold their gradient; a leaf's .grad is autograd's copy of it (it does not take
    # the leaf's own storage), a non-leaf's flows on without one.
    assert torch.equal(leaf.detach(), leaf.grad), "the logits do not hold the gradient"
    assert_close(out, want_loss, TOLERANCE[torch.float32], "loss")
    assert_close(leaf.grad, want, TOLERANCE[torch.float32], "grad")
    retained = cross_entropy(logits.clone().requires_grad_(), target, reduction=reduction, inplace=True)
    ones = torch.ones_like(retained)
    retained.backward(ones, retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace=True" if reduction != "none" else "modified by an inplace"):
        retained.backward(ones)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_inplace_bumps_the_version_of_the_logits(reduction):
    """Another op that saved the logits for its backward fails loudly instead of reading the
    gradient (written in forward with a reduction, in backward with none)."""
    logits, target = make(3, 20, seed=15)
    leaf = logits.clone().requires_grad_()
    hidden = leaf * 1.0
    squares = hidden.pow(2).sum()  # pow saves its input: the logits
    loss = cross_entropy(hidden, target, reduction=reduction, inplace=True).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + squares).backward()


# --------------------------------------------------------------------------- ignored rows, NaN, poison


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignored_rows_contribute_nothing(reduction):
    logits, target = make(5, 23, seed=16, ignored=[0, 4])
    got, grad = check(logits, target, reduction=reduction, label_smoothing=0.1, upstream=upstream_for(reduction, 5))
    assert (grad[[0, 4]] == 0).all()
    if reduction == "none":
        assert (got[[0, 4]] == 0).all()
    changed = logits.clone()
    changed[[0, 4]] = float("nan")  # an ignored row is never read
    got_changed, grad_changed = run(cross_entropy, changed, target, upstream_for(reduction, 5), reduction=reduction,
                                    label_smoothing=0.1)
    assert torch.equal(got_changed, got) and torch.equal(grad_changed, grad)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored(reduction):
    """Zero loss and zero gradient (torch gives NaN for mean: 0/0)."""
    logits, target = make(3, 17, seed=17, ignored=[0, 1, 2])
    got, grad = run(cross_entropy, logits, target, reduction=reduction)
    assert (got == 0).all() and (grad == 0).all()
    torch_mean = F.cross_entropy(logits, target, reduction="mean")
    assert torch.isnan(torch_mean)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nan_in_a_kept_row_propagates(reduction):
    logits, target = make(4, 31, seed=18)
    logits[1, 7] = float("nan")
    got, grad = run(cross_entropy, logits, target, reduction=reduction)
    if reduction == "none":
        assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2, 3]]).all()
    else:
        assert torch.isnan(got)
    assert torch.isnan(grad[1]).all() and torch.isfinite(grad[[0, 2, 3]]).all()


def test_launcher_writes_every_output_element():
    """Output buffers poisoned with NaN: every element must be written (ignored rows: loss and
    gradient 0, lse -inf)."""
    logits, target = make(4, 1030, seed=19, ignored=[2])
    lse, loss = (torch.full((4,), float("nan"), device=DEVICE) for _ in range(2))
    grad = torch.full_like(logits, float("nan"))
    launch_cross_entropy_rows(logits, target, lse=lse, loss=loss, grad=grad, scale=torch.ones(1, device=DEVICE))
    assert not torch.isnan(lse).any() and not torch.isnan(loss).any() and not torch.isnan(grad).any()
    assert lse[2] == -math.inf and loss[2] == 0 and (grad[2] == 0).all()
    kept = [0, 1, 3]
    assert_close(lse[kept], torch.logsumexp(logits[kept].double(), -1), TOLERANCE[torch.float32], "lse")
    fresh = torch.full_like(logits, float("nan"))
    launch_cross_entropy_rows(logits, target, lse=lse, grad=fresh, scale=torch.ones(4, device=DEVICE), lse_given=True)
    assert torch.equal(fresh, grad)


def test_vocab_parallel_hook_two_shards_give_the_whole_gradient():
    """The hook of the module docstring: pass 1 on each shard (its own lse), merged by log-sum-exp,
    then pass 2 on each shard with the global lse and its column offset, equals the whole row's
    gradient, class weights and smoothing included."""
    n, v, split = 5, 45, 19
    logits, target = make(n, v, seed=20, ignored=[3])
    weight = class_weight(v, seed=2)
    weight_sum = weight.sum().reshape(1)
    common = dict(label_smoothing=0.2, class_weight=weight, weight_sum=weight_sum, n_classes=v)
    shards = [(logits[:, :split], 0), (logits[:, split:], split)]
    local = []
    for shard, offset in shards:
        lse = torch.empty(n, device=DEVICE)
        launch_cross_entropy_rows(shard, target, lse=lse, col_offset=offset, **common)
        local.append(lse)
    global_lse = torch.logaddexp(*local)
    scale = torch.full((n,), 0.5, device=DEVICE)
    grads = []
    for shard, offset in shards:
        grad = torch.empty_like(shard)
        launch_cross_entropy_rows(shard, target, lse=global_lse, grad=grad, scale=scale, lse_given=True,
                                  col_offset=offset, **common)
        grads.append(grad)
    _, want = reference_run(logits, target, scale, reduction="none", weight=weight, label_smoothing=0.2)
    assert_close(torch.cat(grads, dim=1), want, TOLERANCE[torch.float32], "sharded grad")
    kept = [0, 1, 2, 4]
    assert_close(global_lse[kept], torch.logsumexp(logits[kept].double(), -1), TOLERANCE[torch.float32], "global lse")


# --------------------------------------------------------------------------- the module, bad inputs


def test_module_matches_torch_module():
    logits, target = make(4, 25, seed=21, ignored=[1])
    weight = class_weight(25, seed=3)
    ours = CrossEntropyLoss(weight=weight, reduction="sum", label_smoothing=0.1)
    theirs = torch.nn.CrossEntropyLoss(weight=weight, reduction="sum", label_smoothing=0.1)
    got, grad = run(ours, logits, target)
    want, want_grad = run(theirs, logits, target)
    assert_close(got, want, TOLERANCE[torch.float32], "loss")
    assert_close(grad, want_grad, TOLERANCE[torch.float32], "grad")
    assert "weight" in dict(ours.named_buffers()) and "label_smoothing=0.1" in repr(ours)
    assert kernels_lib.CrossEntropyLoss is CrossEntropyLoss and kernels_lib.cross_entropy is cross_entropy


def _bad_calls():
    logits, target = make(3, 10, seed=22)
    ones = torch.ones(10, device=DEVICE)
    return [
        ("target holds 1 value.*outside \\[0, 10\\)", ValueError, (logits, torch.tensor([0, 10, -100], device=DEVICE)), {}),
        ("outside \\[0, 10\\)", ValueError, (logits, torch.tensor([0, -3, 1], device=DEVICE)), {}),
        ("logits must be a floating tensor", TypeError, (logits.double(), target), {}),
        ("logits must be a floating tensor", TypeError, (logits.long(), target), {}),
        ("logits must be a torch.Tensor", TypeError, (logits.tolist(), target), {}),
        ("logits must have 2 dimension", ValueError, (logits[0], target[0]), {}),
        ("logits must have 2 dimension", ValueError, (logits[None], target), {}),
        ("logits must not be empty", ValueError, (logits[:0], target[:0]), {}),
        ("target must be an int64 or int32", TypeError, (logits, target.float()), {}),
        ("target must have shape", ValueError, (logits, target[:2]), {}),
        ("weight must have shape", ValueError, (logits, target), {"weight": ones[:9]}),
        ("weight requires grad", ValueError, (logits, target), {"weight": ones.clone().requires_grad_()}),
        ("reduction must be one of", ValueError, (logits, target), {"reduction": "batchmean"}),
        ("label_smoothing must be in \\[0, 1\\]", ValueError, (logits, target), {"label_smoothing": 1.5}),
        ("label_smoothing must be a finite real", TypeError, (logits, target), {"label_smoothing": "0.1"}),
        ("ignore_index must be an int", TypeError, (logits, target), {"ignore_index": -100.0}),
        ("inplace must be a bool", TypeError, (logits, target), {"inplace": 1}),
        ("host_checks must be a bool", TypeError, (logits, target), {"host_checks": None}),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_inputs_raise_naming_the_argument(case):
    match, error, args, kwargs = _bad_calls()[case]
    with pytest.raises(error, match=match):
        cross_entropy(*args, **kwargs)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_bad_target_with_a_gradient_raises_in_backward(reduction):
    """With a gradient to form, the range check is read by backward (no wait in forward): the forward's
    loss is NaN at the bad row (the others exact), and backward raises naming the target; without a
    gradient the forward itself raises."""
    logits, _ = make(3, 10, seed=24)
    bad = torch.tensor([2, 10, -100], device=DEVICE)
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy(leaf, bad, reduction=reduction)
    if reduction == "none":
        assert torch.isnan(loss[1]) and loss[2] == 0
        assert_close(loss[0], reference.cross_entropy(logits[:1].double(), bad[:1], reduction="sum"),
                     TOLERANCE[torch.float32], "the good row")
    else:
        assert torch.isnan(loss)
    with pytest.raises(ValueError, match="target holds 1 value.*outside \\[0, 10\\)"):
        loss.sum().backward()
    assert leaf.grad is None
    with pytest.raises(ValueError, match="outside \\[0, 10\\)"):
        cross_entropy(leaf.detach(), bad, reduction=reduction)
    with torch.no_grad(), pytest.raises(ValueError, match="outside \\[0, 10\\)"):
        cross_entropy(leaf, bad, reduction=reduction)


def test_without_host_checks():
    """No host sync: the range is asserted on the device (on CUDA a device-side assert, which ends the
    process's CUDA context: there the bad case runs in a subprocess, :mod:`device_errors`)."""
    logits, _ = make(2, 10, seed=23)
    assert_device_error("cross_entropy(logits, torch.tensor([3, 12], device=DEVICE), host_checks=False)",
                        "outside \\[0, 10\\)", setup="""
                            from kernels_lib import cross_entropy
                            logits = torch.randn(2, 10, device=DEVICE)
                        """)
    good = torch.tensor([3, -100], device=DEVICE)
    assert_close(cross_entropy(logits, good, host_checks=False), reference.cross_entropy(logits.double(), good),
                 TOLERANCE[torch.float32], "loss")


def test_module_refuses_bad_options_at_construction():
    with pytest.raises(ValueError, match="reduction"):
        CrossEntropyLoss(reduction="batchmean")
    with pytest.raises(ValueError, match="label_smoothing"):
        CrossEntropyLoss(label_smoothing=-0.1)
