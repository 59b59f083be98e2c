"""``kernels_lib.linear_cross_entropy`` beside torch's ``F.linear_cross_entropy``.

Each case runs both on the same inputs and compares the loss and every gradient with torch's and
with torch's on float64 copies (``||out - ref|| / ||ref||``). Shapes are tiny and odd (``H``, ``V``
not powers of two): on a machine without a GPU the kernels run in Triton's interpreter. On a torch
older than 2.13 (no ``F.linear_cross_entropy``) the baseline is that function's stated definition,
``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, ...)`` (its reference path),
so the comparisons run on such a GPU too; the tests of what only torch's own function does (its
options, its errors, the loss module's examples) need torch 2.13.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device

lce_module = importlib.import_module("kernels_lib.linear_cross_entropy")

DEVICE = default_device()
OWN_LCE = getattr(F, "linear_cross_entropy", None)
Options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
needs_torch_lce = pytest.mark.skipif(OWN_LCE is None, reason="torch < 2.13 has no F.linear_cross_entropy")


def by_definition(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean", ignore_index=None,
                  label_smoothing=0.0):
    """torch's ``F.linear_cross_entropy`` as its docstring defines it (its reference path, without ``options``):
    ``cross_entropy(linear(input, linear_weight, linear_bias), target, ...)``, ``ignore_index=None`` as -100."""
    return F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight, reduction=reduction,
                           ignore_index=-100 if ignore_index is None else ignore_index, label_smoothing=label_smoothing)


#: The baseline: torch's own function where it exists, else its definition.
TORCH_LCE = OWN_LCE or by_definition

#: float32 against float64: summation order only (observed ~1e-7). bfloat16: a few roundings of 2^-8.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if ref.norm() == 0:
        return out.norm().item()
    return ((out - ref).norm() / ref.norm()).item()


def make(n=6, hidden=7, vocab=13, bias=False, class_weight=False, ignore=None, dtype=torch.float32, seed=0):
    """``(input, linear_weight, target, linear_bias, weight)`` on the device; logits of a few units;
    every third target ``ignore`` when given (-100 stands for torch's ``ignore_index=None``)."""
    gen = torch.Generator().manual_seed(seed)
    lead = () if n is None else (n,)
    x = torch.randn(*lead, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if bias else None
    cw = torch.rand(vocab, generator=gen) + 0.25 if class_weight else None
    target = torch.randint(0, vocab, lead, generator=gen)
    if ignore is not None and n is not None:
        target[::3] = ignore
    leaves = [None if t is None else t.to(DEVICE, dtype).requires_grad_() for t in (x, w, b)]
    return leaves[0], leaves[1], target.to(DEVICE), leaves[2], None if cw is None else cw.to(DEVICE)


def run(fn, x, w, target, b, cw, upstream=None, **kwargs):
    """The loss and the gradients of ``(input, linear_weight, linear_bias)`` for ``upstream``
    (a fixed random one for ``reduction="none"``), on fresh leaves so two calls do not mix."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w, b)]
    loss = fn(leaves[0], leaves[1], target, linear_bias=leaves[2], weight=cw, **kwargs)
    grad_output = torch.ones_like(loss) if upstream is None else upstream.to(loss.dtype)
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, present, grad_output)
    return loss, grads


def float64_reference(x, w, target, b, cw, upstream=None, **kwargs):
    def up(t):
        return None if t is None else t.detach().double()

    return run(TORCH_LCE, up(x), up(w), target, up(b), up(cw), upstream, **kwargs)


def assert_matches_torch(x, w, target, b, cw, **kwargs):
    """Ours against torch's (same dtype) and both against torch's in float64; shape and dtype as torch's."""
    upstream = None
    if kwargs.get("reduction") == "none":
        upstream = torch.randn(target.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ours, our_grads = run(kernels_lib.linear_cross_entropy, x, w, target, b, cw, upstream, **kwargs)
    theirs, their_grads = run(TORCH_LCE, x, w, target, b, cw, upstream, **kwargs)
    exact, exact_grads = float64_reference(x, w, target, b, cw, upstream, **kwargs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == x.dtype
    tol = TOL[x.dtype]
    assert rel_err(ours, exact) < tol and rel_err(theirs, exact) < max(tol, 1e-5)
    assert rel_err(ours, theirs) < 2 * tol
    for name, g, t, e in zip(("input", "linear_weight", "linear_bias"), our_grads, their_grads, exact_grads):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        assert rel_err(g, e) < tol, (name, rel_err(g, e))
        assert rel_err(g, t) < 2 * tol, (name, rel_err(g, t))


# --------------------------------------------------------------------------- torch's examples


def test_docstring_statement_equals_linear_then_cross_entropy():
    """F.linear_cross_entropy's docstring: ``linear_cross_entropy(input, linear_weight, target)`` is
    ``cross_entropy(linear(input, linear_weight), target)``; with torch's default ``ignore_index=None``."""
    x, w, target, _, _ = make(n=3, hidden=5, vocab=5)
    loss = kernels_lib.linear_cross_entropy(x, w, target)
    want = F.cross_entropy(F.linear(x.double(), w.double()), target)
    assert rel_err(loss, want) < 1e-6
    loss.backward()
    assert x.grad is not None and w.grad is not None


@needs_torch_lce
def test_loss_module_examples_refused_naming_what_to_use():
    """nn.LinearCrossEntropyLoss's docstring examples: a K-dimensional head (out_features=(4, 3)) and
    class-probability targets; neither is one head's class-index loss: refused, naming the argument."""
    torch.manual_seed(283)
    x = torch.randn(2, 5, device=DEVICE, requires_grad=True)
    w_kdim = torch.randn(10, 4, 3, 5, device=DEVICE, requires_grad=True)
    target = torch.randint(0, 10, (2, 4, 3), device=DEVICE)
    TORCH_LCE(x, w_kdim, target).backward()  # torch takes it
    with pytest.raises(NotImplementedError, match="linear_weight.*K-dimensional.*torch.nn.functional"):
        kernels_lib.linear_cross_entropy(x, w_kdim, target)
    w = torch.randn(10, 5, device=DEVICE, requires_grad=True)
    soft = torch.randn(2, 10, device=DEVICE).softmax(dim=1)
    TORCH_LCE(x, w, soft).backward()
    with pytest.raises(NotImplementedError, match="target holds class probabilities"):
        kernels_lib.linear_cross_entropy(x, w, soft)


# --------------------------------------------------------------------------- the sweep

CASES = [
    # reduction, ignore_index (None: torch's default, -100), label_smoothing, class weight, bias
    ("mean", None, 0.0, False, False),
    ("mean", None, 0.0, True, True),
    ("mean", 3, 0.1, True, False),
    ("mean", -1, 0.2, False, True),
    ("sum", None, 0.0, False, True),
    ("sum", -1, 0.1, True, False),
    ("none", None, 0.0, False, False),
    ("none", 3, 0.0, True, True),
    ("none", -1, 0.3, True, False),
]


@pytest.mark.parametrize("reduction,ignore_index,label_smoothing,class_weight,bias", CASES)
def test_matches_torch(reduction, ignore_index, label_smoothing, class_weight, bias):
    ignored = -100 if ignore_index is None else ignore_index
    x, w, target, b, cw = make(n=7, hidden=9, vocab=17, bias=bias, class_weight=class_weight, ignore=ignored)
    assert_matches_torch(x, w, target, b, cw, reduction=reduction, ignore_index=ignore_index,
                         label_smoothing=label_smoothing)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_one_row_and_unbatched_input(reduction):
    """N = 1, and torch's unbatched ``(H,)`` input with a scalar target (its ``none`` loss is a scalar)."""
    x, w, target, b, cw = make(n=1, hidden=5, vocab=11, bias=True, class_weight=True)
    assert_matches_torch(x, w, target, b, cw, reduction=reduction)
    x, w, target, b, cw = make(n=None, hidden=5, vocab=11, bias=True)
    assert x.shape == (5,) and target.shape == ()
    assert_matches_torch(x, w, target, b, cw, reduction=reduction, label_smoothing=0.1)


def test_bfloat16_loss_in_input_dtype():
    x, w, target, b, cw = make(n=8, hidden=7, vocab=13, bias=True, ignore=-100, dtype=torch.bfloat16)
    assert_matches_torch(x, w, target, b, cw)


@needs_torch_lce
def test_leading_dims_refused_as_torch_does():
    x = torch.randn(2, 3, 5, device=DEVICE)
    w = torch.randn(7, 5, device=DEVICE)
    target = torch.randint(0, 7, (2, 3), device=DEVICE)
    with pytest.raises(RuntimeError, match="dimensionality 1 or 2"):
        TORCH_LCE(x, w, target)
    with pytest.raises(ValueError, match=r"input must have shape \(H,\) or \(N, H\).*reshape"):
        kernels_lib.linear_cross_entropy(x, w, target)
    flat = kernels_lib.linear_cross_entropy(x.reshape(6, 5), w, target.reshape(6))
    assert rel_err(flat, TORCH_LCE(x.reshape(6, 5).double(), w.double(), target.reshape(6))) < 1e-5


# --------------------------------------------------------------------------- torch's edge semantics


def test_mean_over_nothing_is_nan_with_zero_gradients_as_torch():
    """Every target ignored: torch's mean is 0/0 = NaN, its reference path's gradients 0; so are ours
    (kernels_lib.fused_linear_cross_entropy alone gives 0 there)."""
    x, w, target, _, _ = make(n=4, hidden=5, vocab=7)
    target = torch.full_like(target, -100)
    ours, our_grads = run(kernels_lib.linear_cross_entropy, x, w, target, None, None)
    theirs, their_grads = run(TORCH_LCE, x, w, target, None, None)
    assert torch.isnan(ours) and torch.isnan(theirs)
    for g, t in zip(our_grads, their_grads):
        assert torch.equal(g, t) and not g.any()
    assert kernels_lib.fused_linear_cross_entropy(x, w, target).item() == 0.0


def test_nan_in_gives_nan_out():
    x, w, target, _, _ = make(n=4, hidden=5, vocab=7)
    x = x.detach().clone()
    x[2, 1] = float("nan")
    assert torch.isnan(kernels_lib.linear_cross_entropy(x, w, target))
    assert torch.isnan(kernels_lib.linear_cross_entropy(x, w, target, reduction="none")[2])


def test_autocast_loss_is_float32_as_torch():
    x, w, target, _, _ = make(n=4, hidden=5, vocab=7)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        ours = kernels_lib.linear_cross_entropy(x, w, target)
        theirs = TORCH_LCE(x, w, target)
    assert ours.dtype == theirs.dtype == torch.float32
    assert rel_err(ours, theirs) < 2e-2


# --------------------------------------------------------------------------- options


@pytest.mark.skipif(Options is None, reason="torch < 2.13 has no LinearCrossEntropyOptions")
def test_options_resolve_onto_our_dials():
    resolve = lce_module.resolve_options
    assert resolve(None, 64, 8, 40, torch.float32) == (None, False, False)
    assert resolve(Options(), 64, 8, 40, torch.bfloat16) == (None, False, False)
    for policy, accurate in (("compact", False), ("balanced", True), ("accurate", True), ("auto", False)):
        assert resolve(Options(acc_policy=policy), 64, 8, 40, torch.bfloat16)[1] is accurate
    # aspect_ratio: ceil(40 / 8) = 5 logits rows per input row, ceil(64 / 5) = 13 -> 16 rows; ":2" halves it.
    assert resolve(Options(chunking_method="aspect_ratio"), 64, 8, 40, torch.float32)[0] == 16
    assert resolve(Options(chunking_method="aspect_ratio:2"), 64, 8, 40, torch.float32)[0] == 8
    assert resolve(Options(chunking_method="aspect_ratio"), 3, 8, 4, torch.float32)[0] == 3  # at most N
    assert resolve(Options(batch_chunk_size=5), 64, 8, 40, torch.float32)[0] == 5
    assert resolve(Options(batch_chunk_size=500, chunking_method=None), 64, 8, 40, torch.float32)[0] == 64
    assert resolve(Options(chunking_method=None), 64, 8, 40, torch.float32)[0] == 64  # one chunk
    assert resolve(Options(allow_retain_graph=True), 64, 8, 40, torch.float32)[2] is True
    with pytest.raises(ValueError, match="batch_chunk_size.*chunking_method.*pass only one"):
        resolve(Options(batch_chunk_size=4, chunking_method="aspect_ratio"), 64, 8, 40, torch.float32)
    with pytest.raises(ValueError, match="options.acc_dtype"):
        resolve(Options(acc_dtype=torch.float64), 64, 8, 40, torch.float32)
    with pytest.raises(ValueError, match="options.acc_dtype"):
        resolve(Options(acc_dtype=torch.float16), 64, 8, 40, torch.bfloat16)
    with pytest.raises(TypeError, match="options must be torch.nn.LinearCrossEntropyOptions"):
        resolve({"acc_policy": "accurate"}, 64, 8, 40, torch.float32)


@pytest.mark.skipif(Options is None, reason="torch < 2.13 has no LinearCrossEntropyOptions")
def test_options_reach_the_fused_call(monkeypatch):
    calls = []
    real = lce_module.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(lce_module, "fused_linear_cross_entropy", spy)
    x, w, target, _, cw = make(n=8, hidden=5, vocab=11, class_weight=True)
    options = Options(acc_policy="accurate", batch_chunk_size=3)
    ours, our_grads = run(kernels_lib.linear_cross_entropy, x, w, target, None, cw, options=options)
    assert calls[-1]["chunk_size"] == 3 and calls[-1]["accurate"] is True and calls[-1]["reduction"] == "mean"
    assert calls[-1]["class_weight"] is cw
    theirs, their_grads = run(TORCH_LCE, x, w, target, None, cw, options=options)  # torch's chunked path
    assert rel_err(ours, theirs) < 2e-5
    for g, t in zip(our_grads, their_grads):
        assert rel_err(g, t) < 2e-5


@pytest.mark.skipif(Options is None, reason="torch < 2.13 has no LinearCrossEntropyOptions")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_allow_retain_graph_backpropagates_twice(reduction):
    """allow_retain_graph=True: a retained graph backpropagates twice (gradients add up to twice torch's)."""
    x, w, target, b, cw = make(n=6, hidden=5, vocab=11, bias=True, class_weight=True, ignore=-100)
    loss = kernels_lib.linear_cross_entropy(
        x, w, target, linear_bias=b, weight=cw, reduction=reduction, options=Options(allow_retain_graph=True)
    )
    loss.backward(retain_graph=True)
    loss.backward()
    want, want_grads = float64_reference(x, w, target, b, cw, reduction=reduction)
    assert rel_err(loss, want) < 1e-5
    for leaf, g in zip((x, w, b), want_grads):
        assert rel_err(leaf.grad, 2 * g) < 1e-5


# --------------------------------------------------------------------------- errors in torch's names


def test_errors_name_torchs_arguments():
    x, w, target, _, _ = make(n=4, hidden=5, vocab=7)
    lce = kernels_lib.linear_cross_entropy
    with pytest.raises(ValueError, match=r"linear_weight must have shape \(V, 5\)"):
        lce(x, torch.randn(7, 6, device=DEVICE), target)
    with pytest.raises(TypeError, match="linear_weight must have the dtype of input"):
        lce(x, w.detach().bfloat16(), target)
    with pytest.raises(ValueError, match=r"linear_bias must have shape \(V,\) = \(7,\)"):
        lce(x, w, target, linear_bias=torch.zeros(6, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight \(the per-class weights\) must have shape \(C,\) = \(7,\)"):
        lce(x, w, target, weight=torch.ones(8, device=DEVICE))
    with pytest.raises(TypeError, match="weight must be a floating tensor"):
        lce(x, w, target, weight=torch.ones(7, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"target must have shape input.shape\[:-1\]"):
        lce(x, w, target[:3])
    with pytest.raises(ValueError, match="target holds 1 value"):
        lce(x, w, torch.tensor([0, 1, 7, 2], device=DEVICE))
    with pytest.raises(ValueError, match="reduction must be one of"):
        lce(x, w, target, reduction="batchmean")
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        lce(x, w, target, ignore_index=1.5)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        lce(x, w, target, label_smoothing=1.5)
    with pytest.raises(TypeError, match="options must be"):
        lce(x, w, target, options="accurate")
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        lce(x.tolist(), w, target)


@needs_torch_lce
@pytest.mark.parametrize("reduction,ignore_index,label_smoothing,class_weight,bias", CASES[:6:2] + CASES[6:])
def test_the_definition_is_torchs_function(reduction, ignore_index, label_smoothing, class_weight, bias):
    """The baseline of an older torch, ``by_definition``, gives torch 2.13's loss and gradients (float64)."""
    ignored = -100 if ignore_index is None else ignore_index
    x, w, target, b, cw = make(n=7, hidden=9, vocab=17, bias=bias, class_weight=class_weight, ignore=ignored)
    kwargs = dict(reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)
    own, own_grads = float64_reference(x, w, target, b, cw, **kwargs)
    up = [None if t is None else t.detach().double() for t in (x, w, b)]
    defined, defined_grads = run(by_definition, up[0], up[1], target, up[2], None if cw is None else cw.double(),
                                 None if reduction != "none" else torch.ones(target.shape, device=DEVICE), **kwargs)
    assert rel_err(defined, own) < 1e-12, (kwargs, rel_err(defined, own))
    for g, t in zip(defined_grads, own_grads):
        assert rel_err(g, t) < 1e-12, (kwargs, rel_err(g, t))
