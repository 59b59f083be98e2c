"""kernels_lib.jsd and kernels_lib.tvd against float64 references, TRL's and Liger's own code.

Errors are ``||out - ref|| / ||ref||`` (:func:`kernels_workbench.check.relative_error`), the
reference (:func:`kernels_lib.reference.jsd` / :func:`~kernels_lib.reference.tvd`, autograd for the
gradient) run on float64 copies of the very inputs the kernel saw, bounded by
:data:`kernels_workbench.check.TOLERANCE` of the input dtype (the looser one when mixed), as in
tests/test_kl_div.py. Shapes are small: without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device, reference
from kernels_lib.kernels.jsd import launch_jsd, num_programs
from kernels_lib.kernels.tvd import launch_tvd
from kernels_workbench.check import TOLERANCE, relative_error

jsd_module = importlib.import_module("kernels_lib.jsd")
tvd_module = importlib.import_module("kernels_lib.tvd")
jsd, JSDLoss, tvd, TVDLoss = jsd_module.jsd, jsd_module.JSDLoss, tvd_module.tvd, tvd_module.TVDLoss
REDUCTIONS = ("none", "sum", "mean", "batchmean")
DEVICE = default_device()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BETAS = (0.0, 0.5, 1.0, 0.3)
LOSSES = ("jsd", "tvd")


def make(loss, shape, dtype=torch.float32, *, seed=0, other_dtype=None):
    """(student log-probs, teacher log-probs) for jsd, (p, q) probabilities for tvd."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=gen).log_softmax(-1)
    b = (torch.randn(shape, generator=gen) * 2).log_softmax(-1)
    if loss == "tvd":
        a, b = a.exp(), b.exp()
    return a.to(DEVICE, dtype), b.to(DEVICE, other_dtype or dtype)


def labels(n, ignored, seed=0):
    """(n,) labels in [0, 5) with the rows in ``ignored`` set to -100."""
    target = torch.randint(0, 5, (n,), generator=torch.Generator().manual_seed(seed))
    target[list(ignored)] = -100
    return target.to(DEVICE)


def ours(loss, **options):
    return (lambda a, b, **kw: jsd(a, b, **options, **kw)) if loss == "jsd" else (lambda a, b, **kw: tvd(a, b, **kw))


def theirs(loss, **options):
    return (lambda a, b, **kw: reference.jsd(a, b, **options, **kw)) if loss == "jsd" else reference.tvd


def run(fn, a, b, upstream=None, **kwargs):
    """(loss, a.grad) of ``fn`` on a fresh leaf copy of ``a``; ``upstream`` defaults to ones."""
    leaf = a.detach().clone().requires_grad_()
    out = fn(leaf, b, **kwargs)
    out.backward(torch.ones_like(out) if upstream is None else upstream.to(out.dtype))
    return out.detach(), leaf.grad


def reference_run(fn, a, b, upstream=None, **kwargs):
    return run(fn, a.double(), b.double(), None if upstream is None else upstream.double(), **kwargs)


def assert_close(out, ref, tol, what):
    err = relative_error(out, ref)
    assert not math.isnan(err), f"{what}: NaN"
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def check(loss, a, b, tol, *, beta=0.5, upstream=None, **kwargs):
    options = {"beta": beta} if loss == "jsd" else {}
    got, grad = run(ours(loss, **options), a, b, upstream, **kwargs)
    want, want_grad = reference_run(theirs(loss, **options), a, b, upstream, **kwargs)
    assert got.shape == want.shape and grad.shape == a.shape
    assert got.dtype == torch.promote_types(a.dtype, b.dtype) and grad.dtype == a.dtype
    assert_close(got, want, tol, "loss")
    assert_close(grad, want_grad, tol, "grad")
    return got, grad


# --------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("beta", BETAS)
def test_jsd_matches_float64_reference(beta, reduction, dtype):
    a, b = make("jsd", (5, 37), dtype, seed=int(beta * 10))
    check("jsd", a, b, TOLERANCE[dtype], beta=beta, reduction=reduction, target=labels(5, [1, 3]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_tvd_matches_float64_reference(reduction, dtype):
    a, b = make("tvd", (5, 37), dtype, seed=3)
    check("tvd", a, b, TOLERANCE[dtype], reduction=reduction, target=labels(5, [0]))


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(3, 1031), (1, 1031), (1, 3), (2, 4097)], ids=lambda s: "x".join(map(str, s)))
def test_odd_shapes(shape, reduction, loss):
    a, b = make(loss, shape, seed=shape[1])
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) if reduction == "none" else None
    for beta in (0.3, 1.0) if loss == "jsd" else (None,):
        check(loss, a, b, TOLERANCE[torch.float32], beta=beta, reduction=reduction, upstream=upstream)


@pytest.mark.parametrize("loss", LOSSES)
def test_gpt2_vocab_once(loss):
    a, b = make(loss, (2, 50257), seed=7)
    check(loss, a, b, TOLERANCE[torch.float32], beta=0.3, reduction="batchmean", target=labels(2, [1]))


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(
    "dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16), (torch.float16, torch.bfloat16)], ids=str
)
def test_mixed_dtypes(dtypes, loss):
    a, b = make(loss, (4, 53), dtypes[0], seed=11, other_dtype=dtypes[1])
    check(loss, a, b, max(TOLERANCE[d] for d in dtypes), beta=0.3, reduction="sum")


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", ["sum", "mean", "batchmean"])
def test_non_unit_scalar_upstream_and_second_backward(reduction, loss):
    a, b = make(loss, (4, 30), seed=5)
    target = labels(4, [2])
    fn = ours(loss, beta=0.3)
    leaf = a.clone().requires_grad_()
    out = fn(leaf, b, reduction=reduction, target=target)
    out.backward(torch.tensor(-0.37), retain_graph=True)
    out.backward(torch.tensor(1.0), retain_graph=True)  # a fresh buffer: the first is leaf.grad now
    out.backward(torch.tensor(2.0))
    _, want = reference_run(theirs(loss, beta=0.3), a, b, torch.tensor(2.63), reduction=reduction, target=target)
    assert_close(leaf.grad, want, TOLERANCE[torch.float32], "accumulated grad")


@pytest.mark.parametrize("loss", LOSSES)
def test_none_reduction_reduced_by_torch(loss):
    """loss.sum().backward() hands backward an expanded (stride-0) upstream gradient."""
    a, b = make(loss, (3, 19), seed=8)
    leaf = a.clone().requires_grad_()
    ours(loss, beta=0.3)(leaf, b, reduction="none", target=labels(3, [1])).sum().backward()
    _, want = reference_run(theirs(loss, beta=0.3), a, b, reduction="sum", target=labels(3, [1]))
    assert_close(leaf.grad, want, TOLERANCE[torch.float32], "grad")


@pytest.mark.parametrize("upstream", [None, 2.5])
@pytest.mark.parametrize("loss", LOSSES)
def test_input_grad_is_the_forward_buffer(loss, upstream, monkeypatch):
    """With a reduction the gradient is written in forward and handed out as is (scaled in place)."""
    module, name = (jsd_module, "launch_jsd") if loss == "jsd" else (tvd_module, "launch_tvd")
    original, grads = getattr(module, name), []

    def recording(*args, **kwargs):
        grads.append(kwargs.get("grad"))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    a, b = make(loss, (3, 40), seed=9)
    leaf = a.clone().requires_grad_()
    out = ours(loss, beta=0.5)(leaf, b, target=labels(3, [0]))
    (buffer,) = grads
    pointer = buffer.data_ptr()
    del buffer
    grads.clear()
    out.backward(None if upstream is None else torch.tensor(upstream))
    assert leaf.grad.data_ptr() == pointer and not grads, "backward launched again or copied"
    _, want = reference_run(theirs(loss, beta=0.5), a, b, None if upstream is None else torch.tensor(upstream),
                            target=labels(3, [0]))
    assert_close(leaf.grad, want, TOLERANCE[torch.float32], "grad")


@pytest.mark.parametrize("loss", LOSSES)
def test_no_grad_and_grad_free_inputs(loss):
    a, b = make(loss, (3, 20), seed=12)
    with torch.no_grad():
        got = ours(loss, beta=0.5)(a.clone().requires_grad_(), b)
    assert not got.requires_grad
    assert not ours(loss, beta=0.5)(a, b).requires_grad
    assert_close(got, theirs(loss, beta=0.5)(a.double(), b.double()), TOLERANCE[torch.float32], "loss")


# --------------------------------------------------------------------------- ignored rows


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ignored_rows_contribute_nothing(reduction, loss):
    a, b = make(loss, (6, 25), seed=13)
    target = labels(6, [0, 4], seed=2)
    a[4] = float("nan")  # an ignored row is not read: its NaN does not leak
    got, grad = run(ours(loss, beta=0.3), a, b, reduction=reduction, target=target)
    kept = target != -100
    want, want_grad = reference_run(theirs(loss, beta=0.3), a[kept], b[kept], reduction=reduction)
    if reduction == "none":
        assert (got[~kept] == 0).all()
        got = got[kept]
    assert_close(got, want, TOLERANCE[torch.float32], "loss")
    assert (grad[~kept] == 0).all()
    assert_close(grad[kept], want_grad, TOLERANCE[torch.float32], "grad")
    # A custom ignore_index.
    custom = torch.where(kept, target, torch.full_like(target, 7))
    again, grad_again = run(ours(loss, beta=0.3), a, b, reduction=reduction, target=custom, ignore_index=7)
    assert torch.equal(again[kept] if reduction == "none" else again, got) and torch.equal(grad_again, grad)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored_gives_zero(reduction, loss):
    a, b = make(loss, (3, 16), seed=14)
    got, grad = run(ours(loss, beta=0.5), a, b, reduction=reduction, target=labels(3, [0, 1, 2]))
    assert (got == 0).all() and (grad == 0).all()


# --------------------------------------------------------------------------- TRL and Liger


@pytest.fixture(scope="module")
def trl_jsd():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    return gkd.GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("beta", BETAS)
def test_jsd_matches_trl_generalized_jsd_loss(trl_jsd, beta, reduction):
    """TRL's own function on (B, T, V) logits and (B, T) labels: log_softmax of log-probs is the identity."""
    a, b = make("jsd", (2, 3, 29), seed=21)
    lab = torch.tensor([[1, -100, 2], [-100, 4, 0]], device=DEVICE)
    leaf = a.double().requires_grad_()
    want = trl_jsd(leaf, b.double(), labels=lab, beta=beta, reduction=reduction)
    want.backward(torch.ones_like(want))
    mine_leaf = a.reshape(6, 29).clone().requires_grad_()
    got = jsd(mine_leaf, b.reshape(6, 29), beta=beta, target=lab.reshape(6), reduction=reduction)
    if reduction == "none":
        got = got[lab.reshape(6) != -100]  # TRL returns jsd[mask]
    got.backward(torch.ones_like(got))
    assert_close(got, want, TOLERANCE[torch.float32], "loss")
    # TRL differentiates through log_softmax (the gradient w.r.t. logits); ours is w.r.t. the
    # log-probabilities: the two agree after projecting ours onto zero-sum rows.
    projected = mine_leaf.grad.double() - a.reshape(6, 29).double().exp() * mine_leaf.grad.double().sum(-1, keepdim=True)
    assert_close(projected, leaf.grad.reshape(6, 29), 1e-4, "grad through log_softmax")


def test_trl_ends_are_the_two_kl_directions(trl_jsd):
    a, b = make("jsd", (4, 13), seed=22)
    forward_kl = torch.nn.functional.kl_div(a.double(), b.double(), reduction="batchmean", log_target=True)
    reverse_kl = torch.nn.functional.kl_div(b.double(), a.double(), reduction="batchmean", log_target=True)
    assert_close(jsd(a, b, beta=0.0), forward_kl, 1e-5, "beta=0 is KL(teacher || student)")
    assert_close(jsd(a, b, beta=1.0), reverse_kl, 1e-5, "beta=1 is KL(student || teacher)")
    # TRL's batchmean without labels divides by size(0) (line 315): B = 1 here, so the sum over 4 rows.
    # (1e-6: TRL's log_softmax re-normalizes the float32-made rows.)
    assert_close(trl_jsd(a.double()[None], b.double()[None], beta=0.0), forward_kl * 4, 1e-6, "TRL beta=0")
    assert_close(trl_jsd(a.double()[None], b.double()[None], beta=1.0), reverse_kl * 4, 1e-6, "TRL beta=1")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy's -inf - -inf in Liger's masked lanes
@pytest.mark.parametrize("beta", BETAS)
def test_jsd_beta_is_liger_beta(beta):
    """Liger's own ``_jsd_kernel`` (liger_kernel/ops/jsd.py), run through the interpreter, on
    (student=X=log Q, teacher=Y=log P) as LigerJSD passes them: same beta, same loss and gradient."""
    if not kernels_lib.INTERPRETED and not torch.cuda.is_available():
        pytest.skip("no backend for Liger's kernel")
    liger_jsd = pytest.importorskip("liger_kernel.ops.jsd")
    a, b = make("jsd", (4, 37), seed=23)
    target = labels(4, [2])
    loss_tile, dx = torch.zeros_like(a), torch.zeros_like(a)
    n_kept = int((target != -100).sum())
    liger_jsd._jsd_kernel[(4,)](
        a, a.stride(0), b, b.stride(0), loss_tile, loss_tile.stride(0), dx, dx.stride(0), target,
        beta, n_kept, -100, 37, BLOCK_SIZE=64, HAS_LABEL=True,
    )
    got, grad = run(ours("jsd", beta=beta), a, b, target=target)  # batchmean over kept rows = Liger's scale
    assert_close(got, loss_tile.sum(), 1e-5, "loss vs Liger")
    assert_close(grad, dx, 1e-5, "grad vs Liger")


def liger_tvd(p, q, shift_labels, reduction, ignore_index=-100):
    """Liger's ``tv_distance_forward_triton`` + ``_tv_distance_kernel`` (liger_kernel/ops/tvd.py) as torch
    ops: its kernel does not run in Triton's interpreter (line 72, ``scale.to(tl.float32)`` on a Python
    float). Lines 126-134: scale 1/n_non_ignore (batchmean), 1/(n_non_ignore*V) (mean), else 1;
    line 94: loss 0.5*|p-q|; line 98: grad 0 where p == q, else +-0.5*scale; lines 76-82: ignored rows
    0; lines 101-110 + 155-161: per-row sums times scale, summed (batchmean/mean/sum) or (N, V) for none."""
    n, v = p.shape
    kept = (shift_labels != ignore_index)[:, None]
    n_kept = int(kept.sum())
    scale = {"batchmean": 1.0 / n_kept, "mean": 1.0 / (n_kept * v)}.get(reduction, 1.0)
    pointwise = torch.where(kept, 0.5 * (p - q).abs(), 0.0)
    grad = torch.where(kept & (p != q), torch.where(p > q, 0.5 * scale, -0.5 * scale), 0.0)
    return (pointwise if reduction == "none" else (pointwise.sum(-1) * scale).sum()), grad


def test_tvd_matches_liger():
    p, q = make("tvd", (4, 37), seed=24)
    p[0, :5] = q[0, :5]  # equal entries: gradient 0 in both
    target = labels(4, [1])
    for reduction in ("batchmean", "sum", "mean", "none"):
        want, want_grad = liger_tvd(p.double(), q.double(), target, reduction)
        got, grad = run(tvd, p, q, target=target, reduction=reduction)
        assert_close(got, want, 1e-5, f"{reduction} loss vs Liger")
        assert_close(grad, want_grad, 1e-6, f"{reduction} grad vs Liger")
        assert (grad[0, :5] == 0).all()


# --------------------------------------------------------------------------- NaN and -inf


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("where", [0, 1])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_nan_gives_nan(reduction, where, loss):
    a, b = make(loss, (3, 20), seed=17)
    (a, b)[where][1, 4] = float("nan")
    for beta in (0.0, 0.3, 1.0) if loss == "jsd" else (None,):
        leaf = a.clone().requires_grad_()
        out = ours(loss, beta=beta)(leaf, b, reduction=reduction)
        out.backward(torch.ones_like(out))
        if reduction == "none":
            assert torch.isnan(out[1, 4]) and torch.isfinite(out[[0, 2]]).all()
        else:
            assert torch.isnan(out), f"{beta}: {out}"
        assert torch.isnan(leaf.grad[1, 4]) or (loss == "jsd" and beta == 0.0 and where == 0), beta


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's NumPy -inf - -inf and log(0)
@pytest.mark.parametrize("beta", BETAS)
def test_jsd_zero_probabilities_count_zero(beta):
    """-inf log-probabilities (probability 0) give finite terms where the KL is finite."""
    a, b = make("jsd", (2, 9), seed=30)
    a[0, 3] = b[0, 3] = float("-inf")  # both 0: the class does not exist
    got, grad = run(ours("jsd", beta=beta), a, b, reduction="sum")
    assert torch.isfinite(got) and torch.isfinite(grad).all() and grad[0, 3] == 0
    keep = torch.arange(9) != 3
    want, _ = reference_run(theirs("jsd", beta=beta), a[:1, keep], b[:1, keep], reduction="sum")
    rest, _ = reference_run(theirs("jsd", beta=beta), a[1:], b[1:], reduction="sum")
    assert_close(got, want + rest, 1e-5, "loss")


# --------------------------------------------------------------------------- launchers


def poisoned(n, dtype=torch.float32):
    return torch.full((n,), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("block", [4096, 128])
def test_launcher_writes_every_element(block, loss):
    n, v = 3, 2 * 128 + 37
    a, b = make(loss, (n, v), seed=31)
    target = labels(n, [1])
    launch = launch_jsd if loss == "jsd" else launch_tvd
    options = {"beta": 0.3} if loss == "jsd" else {}
    programs = num_programs(n, v, block)
    assert programs == (3 if block == 4096 else 9)
    partial, pointwise, grad = poisoned(programs), poisoned(n * v), poisoned(n * v)
    launch(a, b, label=target, partial=partial, loss=pointwise, grad=grad, scale=0.25, block=block, **options)
    assert torch.isfinite(partial).all() and torch.isfinite(pointwise).all() and torch.isfinite(grad).all()
    want, want_grad = reference_run(theirs(loss, **options), a, b, reduction="sum", target=target)
    assert_close(partial.sum(), want, 1e-5, "partials")
    assert_close(grad.view(n, v), 0.25 * want_grad, 1e-5, "grad")
    want_pointwise = theirs(loss, **options)(a.double(), b.double(), reduction="none", target=target)
    assert_close(pointwise.view(n, v), want_pointwise, 1e-5, "pointwise")
    # The pointwise upstream multiplies the gradient; nothing else is written.
    upstream = torch.randn(n, v, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grad2 = poisoned(n * v)
    before = (a.clone(), b.clone())
    launch(a, b, label=target, grad=grad2, upstream=upstream, block=block, **options)
    assert_close(grad2.view(n, v), want_grad * upstream.double(), 1e-5, "upstream grad")
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])


@pytest.mark.parametrize("launch", [launch_jsd, launch_tvd])
def test_launcher_needs_an_output(launch):
    a, b = make("tvd", (2, 8))
    with pytest.raises(ValueError, match="at least one"):
        launch(a, b, **({"beta": 0.5} if launch is launch_jsd else {}))
    with pytest.raises(ValueError, match="upstream"):
        launch(a, b, loss=poisoned(16), upstream=a, **({"beta": 0.5} if launch is launch_jsd else {}))


# --------------------------------------------------------------------------- modules and bad inputs


def test_modules_match_functions():
    a, b = make("jsd", (3, 11), seed=40)
    module = JSDLoss(beta=0.3, reduction="sum")
    assert "beta=0.3" in repr(module) and "'sum'" in repr(module)
    assert torch.equal(module(a, b), jsd(a, b, beta=0.3, reduction="sum"))
    p, q = a.exp(), b.exp()
    target = labels(3, [2])
    assert torch.equal(TVDLoss(ignore_index=-100)(p, q, target), tvd(p, q, target=target))


def _bad_cases():
    a, b = make("jsd", (3, 8))
    t = labels(3, [])
    meta = torch.empty(3, 8, device="meta")
    cases = {}
    for name, fn, names in (("jsd", jsd, ("student_logp", "teacher_logp")), ("tvd", tvd, ("p", "q"))):
        first, second = names
        cases.update({
            f"{name} differing shapes": (lambda fn=fn: fn(a, b[:, :5]), ValueError, [first, second]),
            f"{name} 3-D": (lambda fn=fn: fn(a[None], b[None]), ValueError, [first, "2 dimension"]),
            f"{name} integer first": (lambda fn=fn: fn(a.long(), b), TypeError, [first]),
            f"{name} float64 second": (lambda fn=fn: fn(a, b.double()), TypeError, [second]),
            f"{name} non-tensor second": (lambda fn=fn: fn(a, 0.5), TypeError, [second]),
            f"{name} empty": (lambda fn=fn: fn(a[:0], b[:0]), ValueError, [first, "empty"]),
            f"{name} unknown reduction": (lambda fn=fn: fn(a, b, reduction="avg"), ValueError, ["reduction"]),
            f"{name} float target": (lambda fn=fn: fn(a, b, target=t.float()), TypeError, ["target"]),
            f"{name} target shape": (lambda fn=fn: fn(a, b, target=t[:2]), ValueError, ["target", "(3,)"]),
            f"{name} non-tensor target": (lambda fn=fn: fn(a, b, target=[1, 2, 3]), TypeError, ["target"]),
            f"{name} float ignore_index": (lambda fn=fn: fn(a, b, ignore_index=-100.0), TypeError, ["ignore_index"]),
            f"{name} second requires grad": (
                lambda fn=fn: fn(a.clone().requires_grad_(), b.clone().requires_grad_()), ValueError, [second, "detach"],
            ),
            f"{name} on meta": (lambda fn=fn: fn(meta, b), ValueError, [first, "meta"]),
            f"{name} target on meta": (lambda fn=fn: fn(a, b, target=t.to("meta")), ValueError, ["target", "meta"]),
        })
    cases.update({
        "jsd beta above 1": (lambda: jsd(a, b, beta=1.5), ValueError, ["beta", "[0, 1]"]),
        "jsd negative beta": (lambda: jsd(a, b, beta=-0.1), ValueError, ["beta", "[0, 1]"]),
        "jsd NaN beta": (lambda: jsd(a, b, beta=math.nan), TypeError, ["beta", "finite"]),
        "jsd tensor beta": (lambda: jsd(a, b, beta=torch.tensor(0.5)), TypeError, ["beta"]),
        "JSDLoss beta": (lambda: JSDLoss(beta=2.0), ValueError, ["beta"]),
        "JSDLoss reduction": (lambda: JSDLoss(reduction="avg"), ValueError, ["reduction"]),
        "TVDLoss ignore_index": (lambda: TVDLoss(ignore_index="x"), TypeError, ["ignore_index"]),
    })
    return cases


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs_raise_naming_the_argument(case):
    call, error, names = _bad_cases()[case]
    with pytest.raises(error) as info:
        call()
    missing = [name for name in names if name not in str(info.value)]
    assert not missing, f"{case}: {missing} not in {info.value!r}"


# --------------------------------------------------------------------------- property


@settings(max_examples=12, deadline=None)
@given(
    n=st.integers(1, 4),
    v=st.integers(1, 70),
    beta=st.sampled_from([0.0, 1.0, 0.5]) | st.floats(0.01, 0.99),
    scale=st.floats(0.1, 8.0),
    reduction=st.sampled_from(REDUCTIONS),
    ignored=st.lists(st.booleans(), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_property_matches_reference(n, v, beta, scale, reduction, ignored, seed):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, v, generator=gen) * scale).log_softmax(-1).to(DEVICE)
    b = (torch.randn(n, v, generator=gen) * scale).log_softmax(-1).to(DEVICE)
    target = torch.where(torch.tensor(ignored[:n]), -100, 1).to(DEVICE)
    for loss, x, y in (("jsd", a, b), ("tvd", a.exp(), b.exp())):
        got, grad = run(ours(loss, beta=beta), x, y, target=target, reduction=reduction)
        want, want_grad = reference_run(theirs(loss, beta=beta), x, y, target=target, reduction=reduction)
        # Absolute floor: a loss or gradient of ~0 (v = 1, equal rows) has no meaningful relative error.
        assert (got.double() - want).abs().max() <= 1e-5 * (1 + want.abs().max()), (loss, got, want)
        assert (grad.double() - want_grad).abs().max() <= 1e-5 * (1 + want_grad.abs().max()), loss


# --------------------------------------------------------------------------- workbench


@pytest.mark.parametrize("loss", LOSSES)
def test_bench_spec_registered_and_checked(loss):
    from kernels_workbench.bench.registry import get_spec, registered_losses
    from kernels_workbench.check import check_against_reference

    assert loss in registered_losses()
    spec = get_spec(loss)
    assert list(spec.providers) == ["kernels_lib", "torch", "liger"] and spec.baseline == "torch"
    assert spec.published["sizes"] == {"N": 8192 if loss == "jsd" else 16384}
    assert spec.published["x_values"] == [4096, 8192, 16384, 32768, 65536, 131072]
    assert spec.bytes_moved({"N": 2, "V": 8}, torch.float32, "forward") == 2 * 8 * 12
    assert spec.bytes_moved({"N": 2, "V": 8}, torch.float32, "forward_no_grad") == 2 * 8 * 8
    cases = [{"dtype": d, "reduction": r} for d in (torch.float32, torch.bfloat16) for r in ("batchmean", "none")]
    rows = check_against_reference(loss, cases, {"N": 3, "V": 77}, DEVICE)
    assert rows.passed.all(), rows.to_string()
