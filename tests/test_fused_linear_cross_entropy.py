"""Fused linear + cross-entropy against the float64 reference, Transformers' ForCausalLMLoss, and its own kernel.

Errors are relative in norm, ``||out - ref|| / ||ref||``, the reference run on float64 copies of the
very inputs the kernel saw. Shapes are small: on a machine without a GPU the kernel runs in Triton's
interpreter.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import INTERPRETED, default_device, reference
from kernels_lib.fused_linear_cross_entropy import (
    FusedLinearCrossEntropyLoss,
    default_chunk_size,
    lean_chunk_size,
    fused_linear_cross_entropy,
)
from kernels_lib.kernels.cross_entropy_chunk import launch_cross_entropy_chunk
from two_heads import poisoned_allocations  # noqa: F401  (a fixture)

# The module itself (for monkeypatching), whatever the package's __init__ exports under that name: it
# holds the route choice and its dials; the routes launch their kernels through flce_backend (a spy on
# a stage goes there) and the class-major route's slab size is its own.
flce_module = importlib.import_module("kernels_lib.fused_linear_cross_entropy")
flce_backend = importlib.import_module("kernels_lib.chunks.triton_backend")
flce_class_major = importlib.import_module("kernels_lib._flce.class_major")

DEVICE = default_device()

# Tolerances on the relative error, per input dtype. float32: only summation order differs from the
# float64 reference (observed ~3e-7). float16 has an 11-bit significand (unit roundoff 2^-11 ≈ 4.9e-4)
# and bfloat16 an 8-bit one (2^-8 ≈ 3.9e-3): each gradient is rounded once to that dtype, and on CUDA
# the logits chunk and dz are held in it too, so a few roundings compound; 8u for fp16 and 5u for
# bf16 leave room for that without hiding a real error (a wrong term is off by O(1)).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return ((out - ref).norm() / ref.norm()).item()


def make_inputs(lead=(37,), hidden=72, vocab=1031, dtype=torch.float32, bias=True, ignore_every=5, seed=0):
    """Inputs with logits of a few units (like a trained head); every ``ignore_every``-th target ignored."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if bias else None
    target = torch.randint(0, vocab, lead, generator=gen)
    if ignore_every:
        target.view(-1)[::ignore_every] = -100
    leaves = [t.to(DEVICE, dtype).requires_grad_() if t is not None else None for t in (x, w, b)]
    return (*leaves, target.to(DEVICE))


def grads_of(loss, tensors, grad_output):
    present = [t for t in tensors if t is not None]
    got = iter(torch.autograd.grad(loss, present, grad_output))
    return [next(got) if t is not None else None for t in tensors]


def check_against_reference(x, w, b, target, tol, **options):
    """Loss and every gradient of the kernel vs the float64 reference, with a random upstream gradient."""
    loss = fused_linear_cross_entropy(x, w, target, b, **options)
    ref_inputs = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    ref = reference.fused_linear_cross_entropy(*ref_inputs[:2], target, ref_inputs[2], **options)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    grad_output = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) + 0.5
    got = grads_of(loss, (x, w, b), grad_output)
    want = grads_of(ref, ref_inputs, grad_output.double())
    errors = {"loss": rel_err(loss, ref)}
    for name, g, r, t in zip(("dx", "dW", "db"), got, want, (x, w, b)):
        if t is not None:
            assert g.dtype == t.dtype and g.shape == t.shape
            errors[name] = rel_err(g, r)
    assert all(e < tol for e in errors.values()), errors


OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss_scale": 1e-3},
    {"softcap": 3.0},
    {"label_smoothing": 0.2, "z_loss_scale": 1e-2, "softcap": 5.0},
]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(o) or "plain")
def test_options_and_reductions_match_reference(reduction, options):
    x, w, b, target = make_inputs()
    check_against_reference(x, w, b, target, TOL[torch.float32], reduction=reduction, chunk_size=16, **options)


@pytest.fixture(params=[True, False], ids=["exponentials", "logits"])
def epilogue_route(monkeypatch, request):
    """The gradient chunks take the epilogue GEMM (lse in its epilogue, the logits or the shifted
    exponentials written beside it: both settings of ``STORE_EXPONENTIALS``) in the interpreter too;
    yields the list of ``logits_out`` buffers it was called with."""
    calls = []
    monkeypatch.setattr(flce_module, "STORE_EXPONENTIALS", request.param)

    def spy(original):
        def call(*args, **kwargs):
            calls.append(kwargs.get("logits_out"))
            return original(*args, **kwargs)
        return call

    monkeypatch.setattr(flce_module, "EPILOGUE_GEMM_WHEN_INTERPRETED", True)
    for name in ("logits_logsumexp", "launch_logits_logsumexp"):  # the no-grad loss's and the route's
        monkeypatch.setattr(flce_backend, name, spy(getattr(flce_backend, name)))
    yield calls


@pytest.mark.parametrize(
    "lead, hidden, vocab, dtype, options",
    [
        ((37,), 72, 1031, torch.float32, dict(reduction="mean", chunk_size=16)),
        ((37,), 72, 1031, torch.float32, dict(reduction="sum", chunk_size=7, logit_scale=0.5, temperature=2.0)),
        ((1,), 40, 2053, torch.float32, dict(reduction="mean")),  # N = 1 (its one row kept), one chunk
        ((2, 9), 24, 517, torch.bfloat16, dict(reduction="mean", chunk_size=8, num_items_in_batch=11)),
        ((2, 9), 24, 517, torch.float16, dict(reduction="sum", chunk_size=8)),
    ],
)
def test_epilogue_gemm_route_matches_reference(lead, hidden, vocab, dtype, options, epilogue_route):
    """A plain reduced loss with a gradient: each chunk's lse from the GEMM's epilogue, which writes the
    logits too; the kernel's pass 2 alone reads them. Loss and every gradient as the reference."""
    x, w, b, target = make_inputs(lead, hidden, vocab, dtype=dtype, ignore_every=5 if lead != (1,) else 0)
    check_against_reference(x, w, b, target, TOL[dtype], **options)
    # On a GPU the route is Hopper's, for 16-bit operands whose rows TMA can take (elsewhere cuBLAS's).
    taken = INTERPRETED or flce_module._epilogue_gemm_takes(x.detach().reshape(-1, hidden)[:1], w.detach())
    assert all(out is not None for out in epilogue_route) and bool(epilogue_route) == taken


def test_epilogue_gemm_route_is_plain_only(epilogue_route):
    """Options the epilogue's lse cannot carry (smoothing, z-loss, softcap, statistics, class weights,
    ``none``) keep the two-pass kernel on cuBLAS's logits, and no gradient means no chunks at all."""
    x, w, b, target = make_inputs()
    for options in [*OPTIONS[1:], {"reduction": "none"}, {"return_token_stats": True}]:
        fused_linear_cross_entropy(x, w, target, b, **options)
    fused_linear_cross_entropy(x, w, target, b, class_weight=torch.rand(w.shape[0], device=DEVICE))
    assert epilogue_route == []
    with torch.no_grad():
        fused_linear_cross_entropy(x, w, target, b)
    assert epilogue_route == [None], "the no-grad loss: the GEMM once, no logits written"


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_epilogue_gemm_route_nan_and_all_ignored(epilogue_route):
    x, w, b, target = make_inputs()
    x.data[3, 5] = float("nan")
    loss = fused_linear_cross_entropy(x, w, target, b, chunk_size=16)
    dx, dw = torch.autograd.grad(loss, (x, w))
    assert loss.isnan() and dx[3].isnan().all() and dw.isnan().any()
    x, w, b, target = make_inputs()
    loss = fused_linear_cross_entropy(x, w, torch.full_like(target, -100), b, chunk_size=16)
    assert loss == 0 and all((g == 0).all() for g in torch.autograd.grad(loss, (x, w, b)))


#: The epilogue and class-major routes' operands: float32 in the interpreter (where the matmuls run in
#: float32), bfloat16 on a GPU (where the routes are Hopper's; the class-major one shares a buffer
#: between dW and the logits, so one dtype).
ROUTE_DTYPE = torch.float32 if INTERPRETED else torch.bfloat16


@pytest.fixture
def passes(monkeypatch):
    """Counts the launches of the kernels that read the logits buffer after the GEMM (pass 2 and the
    class-major gradient kernel)."""
    counts = {"pass": 0}

    def spy(original):
        def call(*args, **kwargs):
            counts["pass"] += 1
            return original(*args, **kwargs)
        return call

    for name in ("launch_cross_entropy_chunk", "launch_class_major_gradient"):
        monkeypatch.setattr(flce_backend, name, spy(getattr(flce_backend, name)))
    return counts


@pytest.mark.parametrize("chunk_size", [16, None], ids=["chunked", "class-major"])
def test_exponentials_need_no_pass_over_the_buffer(chunk_size, epilogue_route, passes):
    """With the shifted exponentials stored, no kernel reads the N × V buffer between the GEMM and the
    matmuls, on either route; with the logits stored, pass 2 (or the class-major kernel) does."""
    x, w, b, target = make_inputs(dtype=ROUTE_DTYPE)
    loss = fused_linear_cross_entropy(x, w, target, b, chunk_size=chunk_size)
    torch.autograd.grad(loss, (x, w, b))
    assert epilogue_route and (passes["pass"] == 0) == flce_module.STORE_EXPONENTIALS


@pytest.mark.parametrize("chunk_size", [16, None], ids=["chunked", "class-major"])
def test_rows_far_from_their_target_match_reference(chunk_size, epilogue_route):
    """Rows whose target logit lies hundreds below their maximum (beyond the exponentials' headroom: their
    tiles take shifts of their own, then are rescaled) still give the reference's loss and gradients."""
    x, w, b, target = make_inputs(vocab=517, dtype=ROUTE_DTYPE)
    with torch.no_grad():
        for row in (2, 9):
            x[row] *= 40
            target[row] = int((x[row] @ w.T + b).argmin())
    z = x.detach().double() @ w.detach().double().T + b.detach().double()
    assert (z.max(1).values - z.gather(1, target[:, None].clamp(min=0))[:, 0])[[2, 9]].min() > 64
    check_against_reference(x, w, b, target, TOL[ROUTE_DTYPE], chunk_size=chunk_size)


@pytest.fixture
def class_major_route(monkeypatch, epilogue_route):
    """The epilogue route in the interpreter, ``dW`` formed in slabs of 64 rows; yields the calls of the
    class-major route (one per forward that took it)."""
    calls = []
    original = flce_module._class_major_logits

    def spy(*args, **kwargs):
        calls.append(args[0].x.shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(flce_class_major, "CLASS_MAJOR_SLAB_ROWS", 64)
    monkeypatch.setattr(flce_module, "_class_major_logits", spy)
    yield calls


@pytest.mark.parametrize(
    "lead, hidden, vocab, bias, options",
    [
        ((37,), 72, 1031, True, dict(reduction="mean")),  # N < H; 17 slabs, the last of 7 rows
        ((5, 8), 40, 517, False, dict(reduction="sum", logit_scale=0.5, temperature=2.0)),  # N = H
        ((1,), 24, 2053, True, dict(reduction="mean", chunk_size=1)),  # N = 1
    ],
)
def test_class_major_route_matches_reference(lead, hidden, vocab, bias, options, class_major_route, poisoned_allocations):
    """One chunk of at most H rows: the logits class-major inside dW's own buffer, dW formed slab by
    slab over the logits already read. Loss and every gradient as the float64 reference, every
    element written (allocations NaN-poisoned)."""
    x, w, b, target = make_inputs(lead, hidden, vocab, ROUTE_DTYPE, bias=bias, ignore_every=5 if lead != (1,) else 0)
    check_against_reference(x, w, b, target, TOL[ROUTE_DTYPE], **options)
    assert len(class_major_route) == 1


def test_class_major_route_waits_for_backward(class_major_route):
    """Forward gives the loss and keeps the logits in dW's buffer; backward forms the gradients with the
    upstream gradient in their factor, once: a second backward through the graph is refused."""
    x, w, b, target = make_inputs(vocab=517, dtype=ROUTE_DTYPE)
    loss = fused_linear_cross_entropy(x, w, target, b)
    assert class_major_route and x.grad is None
    loss.backward(torch.tensor(2.0, device=DEVICE), retain_graph=True)
    once = w.grad.clone()
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
    ref_inputs = [t.detach().double().requires_grad_() for t in (x, w, b)]
    (2.0 * reference.fused_linear_cross_entropy(*ref_inputs[:2], target, ref_inputs[2])).backward()
    assert rel_err(once, ref_inputs[1].grad) < TOL[ROUTE_DTYPE]


def test_class_major_route_only_where_it_fits(class_major_route):
    """Several chunks, float32 sums (accurate), or no dW wanted: the chunked route (more rows than 2H:
    test_wide_class_major_route_only_within_its_limit)."""
    for lead, hidden, options in [((37,), 72, dict(chunk_size=16)), ((37,), 72, dict(accurate=True))]:
        x, w, b, target = make_inputs(lead, hidden, 517, ROUTE_DTYPE)
        fused_linear_cross_entropy(x, w, target, b, **options)
    x, w, b, target = make_inputs(vocab=517, dtype=ROUTE_DTYPE)
    fused_linear_cross_entropy(x, w.detach(), target, b)
    assert class_major_route == []
    fused_linear_cross_entropy(x, w, target, b)
    assert len(class_major_route) == 1


def test_weight_grad_holds_what_the_route_says(class_major_route):
    """``weight.grad`` of the class-major route is a view of its buffer and keeps all of it: ``(V + S)·H``
    elements at N ≤ H; at H < N the chunked route gives a gradient of its own size. (No ignored rows:
    N counts the rows left once they are dropped.)"""
    hidden, vocab, slab = 40, 517, flce_class_major.CLASS_MAJOR_SLAB_ROWS
    for rows in (hidden, hidden + 1, 2 * hidden):
        x, w, b, target = make_inputs((rows,), hidden, vocab, ROUTE_DTYPE, ignore_every=0)
        fused_linear_cross_entropy(x, w, target, b).backward()
        held = w.grad.untyped_storage().nbytes() // w.grad.element_size()
        expected = (vocab + slab) * hidden if rows <= hidden else vocab * hidden
        assert held == expected, (rows, held, expected)
    assert len(class_major_route) == 1, "only the chunk of N ≤ H rows takes the class-major route"


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_class_major_route_nan(class_major_route):
    x, w, b, target = make_inputs(vocab=517, dtype=ROUTE_DTYPE)
    x.data[3, 5] = float("nan")
    loss = fused_linear_cross_entropy(x, w, target, b)
    dx, dw = torch.autograd.grad(loss, (x, w))
    assert class_major_route and loss.isnan() and dx[3].isnan().all() and dw.isnan().any()


@pytest.mark.parametrize(
    "lead, hidden, vocab, bias, chunk_size",
    [
        ((1,), 72, 1031, True, None),  # a single row
        ((2, 3, 5), 72, 1031, False, 7),  # leading dims, chunks that do not divide N
        ((64,), 40, 257, True, 64),  # one chunk exactly
        ((3,), 16, 50257, True, 2),  # GPT-2's vocabulary: several loop steps over V
    ],
)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_shapes_match_reference(lead, hidden, vocab, bias, chunk_size, reduction):
    x, w, b, target = make_inputs(lead, hidden, vocab, bias=bias, ignore_every=4 if len(lead) > 1 else 0)
    check_against_reference(x, w, b, target, TOL[torch.float32], reduction=reduction, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("accurate", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_half_precision_matches_reference(dtype, accurate, reduction):
    x, w, b, target = make_inputs((48,), dtype=dtype)
    check_against_reference(
        x, w, b, target, TOL[dtype], reduction=reduction, chunk_size=8, accurate=accurate, z_loss_scale=1e-3
    )


def test_accurate_mode_accumulates_dw_in_float32():
    """Over many chunks a bf16 running sum of dW drifts; the float32 accumulator rounds once."""
    x, w, b, target = make_inputs((256,), hidden=32, vocab=257, dtype=torch.bfloat16, ignore_every=0)
    ref_w = w.detach().double().requires_grad_()
    ref = reference.fused_linear_cross_entropy(x.detach().double(), ref_w, target, b.detach().double())
    (want,) = torch.autograd.grad(ref, ref_w)
    errors = {}
    for accurate in (True, False):
        loss = fused_linear_cross_entropy(x, w, target, b, chunk_size=4, accurate=accurate)
        (got,) = torch.autograd.grad(loss, w)
        errors[accurate] = rel_err(got, want)
    # one bf16 rounding of dW (plus, on CUDA, of dz) against one per chunk
    assert errors[True] < 5e-3 and errors[True] < errors[False] / 2, errors


def test_int32_target_and_noncontiguous_x():
    x, w, b, target = make_inputs((6, 5))
    x_t = x.detach().transpose(0, 1).requires_grad_()  # (5, 6, H), not contiguous
    check_against_reference(x_t, w, b, target.t().to(torch.int32), TOL[torch.float32], chunk_size=4)


@pytest.mark.parametrize("host_checks", [True, False])
@pytest.mark.parametrize("upstream", [3.0, -0.37, 0.0])
def test_grad_output_scales_fused_gradients(host_checks, upstream):
    x, w, b, target = make_inputs()
    for reduction in ("mean", "sum"):
        loss = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, host_checks=host_checks)
        got = torch.autograd.grad(loss * upstream, (x, w, b))
        want = torch.autograd.grad(fused_linear_cross_entropy(x, w, target, b, reduction=reduction), (x, w, b))
        for g, r in zip(got, want):
            assert torch.isfinite(g).all()
            assert (g == 0).all() if upstream == 0 else rel_err(g, upstream * r) < 1e-6


def test_second_backward_through_fused_gradients_is_refused():
    """The gradients formed in forward are scaled in place and handed out: a second backward through a
    retained graph would scale them again, so it raises; ``reduction="none"`` recomputes and allows it."""
    x, w, b, target = make_inputs()
    loss = fused_linear_cross_entropy(x, w, target, b)
    first = torch.autograd.grad(loss, (x, w, b), retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice.*retain_graph"):
        torch.autograd.grad(loss, (x, w, b))
    per_token = fused_linear_cross_entropy(x, w, target, b, reduction="none")
    twice = [torch.autograd.grad(per_token.sum(), (x, w, b), retain_graph=True) for _ in range(2)]
    for g1, g2 in zip(*twice):
        assert torch.equal(g1, g2)
    n_valid = (target != -100).sum()
    for g, want in zip(first, twice[0]):
        assert rel_err(g * n_valid, want) < 1e-5


def test_only_the_inputs_that_require_grad_get_one():
    x, w, b, target = make_inputs()
    x = x.detach()
    for reduction in ("mean", "none"):
        loss = fused_linear_cross_entropy(x, w, target, b.detach(), reduction=reduction)
        (dw,) = torch.autograd.grad(loss.sum(), w)
        ref_w = w.detach().double().requires_grad_()
        ref = reference.fused_linear_cross_entropy(
            x.double(), ref_w, target, b.detach().double(), reduction=reduction
        )
        (want,) = torch.autograd.grad(ref.sum(), ref_w)
        assert rel_err(dw, want) < TOL[torch.float32]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_return_z_loss(reduction):
    x, w, b, target = make_inputs()
    options = dict(reduction=reduction, z_loss_scale=1e-2, label_smoothing=0.1, return_z_loss=True)
    loss, z_loss = fused_linear_cross_entropy(x, w, target, b, **options)
    ref_loss, ref_z = reference.fused_linear_cross_entropy(
        *(t.detach().double() for t in (x, w)), target, b.detach().double(), **options
    )
    assert rel_err(loss, ref_loss) < TOL[torch.float32] and rel_err(z_loss, ref_z) < TOL[torch.float32]
    assert not z_loss.requires_grad  # for logging: the loss already contains it


def test_matches_transformers_for_causal_lm_loss():
    """ForCausalLMLoss shifts its labels (position t predicts label t+1); we take targets aligned with
    the rows, so our target is its labels shifted left by one, with the last position ignored."""
    x, w, b, _ = make_inputs((2, 9), bias=False)
    labels = torch.randint(0, w.shape[0], (2, 9), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    labels[0, 4] = -100
    target = F.pad(labels[:, 1:], (0, 1), value=-100)
    loss = fused_linear_cross_entropy(x, w, target)
    got = torch.autograd.grad(loss, (x, w))
    x_hf, w_hf = (t.detach().clone().requires_grad_() for t in (x, w))
    ref = ForCausalLMLoss(x_hf @ w_hf.t(), labels, vocab_size=w.shape[0])
    want = torch.autograd.grad(ref, (x_hf, w_hf))
    assert rel_err(loss, ref) < TOL[torch.float32]
    assert all(rel_err(g, r) < TOL[torch.float32] for g, r in zip(got, want))


def test_all_targets_ignored():
    """torch's mean is 0/0 = NaN; ours is 0 with zero gradients (documented), sum and none are 0 too."""
    x, w, b, target = make_inputs((5,), ignore_every=0)
    target = torch.full_like(target, -100)
    assert reference.fused_linear_cross_entropy(x.detach(), w.detach(), target, b.detach()).isnan()
    for reduction in ("mean", "sum", "none"):
        loss = fused_linear_cross_entropy(
            x, w, target, b, reduction=reduction, label_smoothing=0.1, z_loss_scale=1.0
        )
        assert torch.all(loss == 0)
        for g in torch.autograd.grad(loss.sum(), (x, w, b)):
            assert torch.all(g == 0)


def test_custom_ignore_index():
    x, w, b, target = make_inputs(ignore_every=0)
    target[::3] = 7  # a valid class used as the ignore value
    check_against_reference(x, w, b, target, TOL[torch.float32], ignore_index=7, label_smoothing=0.1)


def _record_grad_scales(monkeypatch):
    seen = []

    def recording(*args, grad_scale, **kwargs):
        seen.append(grad_scale)
        return launch_cross_entropy_chunk(*args, grad_scale=grad_scale, **kwargs)

    monkeypatch.setattr(flce_backend, "launch_cross_entropy_chunk", recording)
    return seen


@pytest.mark.parametrize("interpreted_epilogue", [False, True], ids=["default", "epilogue-in-interpreter"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_grad_path_computes_no_gradient(monkeypatch, reduction, interpreted_epilogue):
    """Without a gradient: compiled, ``mean``/``sum`` take the log-sum-exp from the logits GEMM's epilogue
    (no chunk kernel, no logits buffer); in the interpreter they take the chunked kernel without its
    gradient pass, as ``none`` does everywhere, unless EPILOGUE_GEMM_WHEN_INTERPRETED asks for the GEMM
    (there a Python loop over tiles, ~60x the chunks' time)."""
    if interpreted_epilogue and not INTERPRETED:
        pytest.skip("the flag is read only in the interpreter")
    monkeypatch.setattr(flce_module, "EPILOGUE_GEMM_WHEN_INTERPRETED", interpreted_epilogue)
    epilogue = reduction != "none" and (not INTERPRETED or interpreted_epilogue)
    x, w, b, target = make_inputs()
    with_grad = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_size=8).detach()
    seen = _record_grad_scales(monkeypatch)
    epilogue_calls = []
    real = flce_backend.logits_logsumexp
    monkeypatch.setattr(flce_backend, "logits_logsumexp", lambda *a, **k: epilogue_calls.append(k) or real(*a, **k))
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_size=8)
    frozen = [t.detach() for t in (x, w, b)]
    loss_frozen = fused_linear_cross_entropy(*frozen[:2], target, frozen[2], reduction=reduction, chunk_size=8)
    if not epilogue:
        chunks = -(-int((target != -100).sum()) // 8)  # the 29 valid rows of 37 (the ignored ones dropped), by 8
        assert len(seen) == 2 * chunks and all(s is None for s in seen) and not epilogue_calls
        if reduction == "none":
            assert torch.equal(loss, with_grad) and torch.equal(loss_frozen, with_grad)
        else:
            torch.testing.assert_close(loss, with_grad, rtol=1e-6, atol=0)
            assert torch.equal(loss, loss_frozen)
    else:
        assert not seen and len(epilogue_calls) == 2
        torch.testing.assert_close(loss, with_grad, rtol=1e-5, atol=0)
        assert torch.equal(loss, loss_frozen)
    assert not loss.requires_grad and not loss_frozen.requires_grad
    assert x.grad is None and w.grad is None and b.grad is None


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy on NaN, in the interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_grad_epilogue_against_float64(dtype, monkeypatch):
    """The epilogue path at an odd size (H not a power of two, V prime-ish, N = 1 and 37), bias,
    logit_scale / temperature, ignored rows, ``mean`` and ``sum``: against float64; NaN in gives NaN out.
    (In the interpreter the no-grad loss takes the GEMM only when asked to.)"""
    monkeypatch.setattr(flce_module, "EPILOGUE_GEMM_WHEN_INTERPRETED", True)
    torch.manual_seed(3)
    for n in (1, 37):
        x = torch.randn(n, 24, dtype=dtype, device=DEVICE)
        w = (torch.randn(1031, 24, device=DEVICE) / 5).to(dtype)
        b = (torch.randn(1031, device=DEVICE) / 10).to(dtype)
        target = torch.randint(0, 1031, (n,), device=DEVICE)
        target[::3] = -100 if n > 1 else target[::3]
        for reduction in ("mean", "sum"):
            with torch.no_grad():
                got = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, logit_scale=1.5, temperature=2.0)
            logits = (x.double() @ w.double().T + b.double()) * 0.75
            want = torch.nn.functional.cross_entropy(logits, target, reduction=reduction)
            assert ((got.double() - want).abs() / want.abs()).item() < 1e-5, (n, reduction)
    x[0, 0] = float("nan")
    with torch.no_grad():
        assert torch.isnan(fused_linear_cross_entropy(x, w, target.fill_(5), b, reduction="sum"))


def test_module_matches_functional():
    x, w, b, target = make_inputs()
    options = dict(reduction="sum", label_smoothing=0.1, z_loss_scale=1e-3, softcap=4.0, chunk_size=8)
    module = FusedLinearCrossEntropyLoss(**options)
    assert "softcap=4.0" in repr(module)
    assert torch.equal(module(x, w, target, b), fused_linear_cross_entropy(x, w, target, b, **options))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy, in the interpreter
def test_nan_propagates():
    for poisoned in ("x", "weight", "bias"):
        x, w, b, target = make_inputs(ignore_every=0)
        tensors = {"x": x.detach().clone(), "weight": w.detach().clone(), "bias": b.detach().clone()}
        tensors[poisoned].view(-1)[3] = float("nan")
        for reduction in ("mean", "sum"):
            loss = fused_linear_cross_entropy(
                tensors["x"], tensors["weight"], target, tensors["bias"], reduction=reduction
            )
            assert loss.isnan(), (poisoned, reduction)


def test_default_chunk_size():
    assert default_chunk_size(100_000, 4096) == 4096  # H rows: the logits chunk is the size of dW
    assert default_chunk_size(50_000, 1024) == 2048  # at least 2048 rows (the dW pass ~5% of the matmuls)
    assert default_chunk_size(100_000, 5000) == 4992  # rounded down to a multiple of 128
    assert default_chunk_size(262_144, 4096) == 8192  # N / 32 for long batches ...
    assert default_chunk_size(10**7, 4096) == 8192  # ... at most 8192 rows
    assert default_chunk_size(37, 4096) == 37  # never more than the rows there are
    # Halved while the bf16 buffer would take more than a quarter of the free memory.
    assert default_chunk_size(100_000, 4096, 128256, 2, free_bytes=4 * 4096 * 128256 * 2) == 4096
    assert default_chunk_size(100_000, 4096, 128256, 2, free_bytes=4 * 4096 * 128256 * 2 - 1) == 2048
    assert default_chunk_size(100_000, 4096, 128256, 2, free_bytes=10**6) == 128  # never below one tile


def test_lean_chunk_size():
    assert lean_chunk_size(100_000, 4096) == 512  # H / 8: the logits chunk is 1/8 of dW
    assert lean_chunk_size(100_000, 8192) == 1024
    assert lean_chunk_size(100_000, 1000) == 256  # at least 256 rows
    assert lean_chunk_size(100_000, 5000) == 512  # rounded down to a multiple of 128
    assert lean_chunk_size(37, 4096) == 37


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_launcher_writes_every_output(dtype, softcap):
    """NaN-poisoned outputs, both modes: compute lse (+ loss, dz with a shared scale), then read it
    (dz with a per-row scale), each against autograd on the float64 per-row loss."""
    rows, vocab, eps, lam = 5, 20000, 0.1, 1e-2  # 20000 > one loop step in either backend
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE, dtype)
    target = torch.tensor([3, -100, vocab - 1, 0, 17], device=DEVICE)
    valid = target != -100

    z = logits.double().requires_grad_()
    c = softcap * torch.tanh(z / softcap) if softcap else z
    lse = torch.logsumexp(c, dim=-1)
    z_term = torch.where(valid, lam * lse**2, 0.0)
    want_loss = F.cross_entropy(c, target, reduction="none", label_smoothing=eps) + z_term
    row_scale = torch.rand(rows, generator=gen).to(DEVICE) + 0.5
    (want_dz_shared,) = torch.autograd.grad(want_loss.sum() * 0.25, z, retain_graph=True)
    (want_dz_rows,) = torch.autograd.grad((want_loss * row_scale.double()).sum(), z)

    def poisoned():
        return torch.full((rows,), float("nan"), device=DEVICE)

    buffer, got_lse, got_loss, got_z = logits.clone(), poisoned(), poisoned(), poisoned()
    kernel_args = dict(ignore_index=-100, label_smoothing=eps, z_loss_scale=lam, softcap=softcap)
    launch_cross_entropy_chunk(
        buffer, target, lse=got_lse, loss=got_loss, z_loss=got_z,
        grad_scale=torch.tensor([0.25], device=DEVICE), **kernel_args,
    )
    tol = 1e-5 if dtype == torch.float32 else TOL[dtype]
    assert not any(t.isnan().any() for t in (buffer, got_lse, got_loss, got_z))
    assert rel_err(got_lse, lse) < 1e-6 and rel_err(got_loss, want_loss) < 1e-5 and rel_err(got_z, z_term) < 1e-5
    assert torch.all(got_loss[~valid] == 0) and torch.all(buffer[~valid] == 0)
    assert rel_err(buffer, want_dz_shared) < tol

    buffer = logits.clone()
    launch_cross_entropy_chunk(
        buffer, target, lse=got_lse, loss=None, z_loss=None, grad_scale=row_scale, **kernel_args
    )
    assert rel_err(buffer, want_dz_rows) < tol


def _bad_calls():
    x, w, b, target = (t.detach() if t.is_floating_point() else t for t in make_inputs((4,), 8, 11))
    ok = dict(x=x, weight=w, target=target, bias=b)
    cases = [
        ("x", TypeError, dict(ok, x=x.tolist()), {}),
        ("x", TypeError, dict(ok, x=x.double()), {}),
        ("x", ValueError, dict(ok, x=x[:0], target=target[:0]), {}),
        ("weight", TypeError, dict(ok, weight=w.half()), {}),
        ("weight", ValueError, dict(ok, weight=w[0]), {}),
        ("weight", ValueError, dict(ok, weight=w[:, :5]), {}),
        ("weight", ValueError, dict(ok, weight=w.to("meta")), {}),
        ("target", TypeError, dict(ok, target=target.float()), {}),
        ("target", ValueError, dict(ok, target=target[:3]), {}),
        ("target", ValueError, dict(ok, target=torch.tensor([0, 1, 11, 2], device=DEVICE)), {}),
        ("target", ValueError, dict(ok, target=torch.tensor([0, -1, 3, 2], device=DEVICE)), {}),
        ("bias", TypeError, dict(ok, bias=b.half()), {}),
        ("bias", ValueError, dict(ok, bias=b[:5]), {}),
        ("reduction", ValueError, ok, {"reduction": "batchmean"}),
        ("label_smoothing", ValueError, ok, {"label_smoothing": 1.5}),
        ("z_loss_scale", ValueError, ok, {"z_loss_scale": -1.0}),
        ("z_loss_scale", TypeError, ok, {"z_loss_scale": float("nan")}),
        ("softcap", ValueError, ok, {"softcap": 0.0}),
        ("chunk_size", ValueError, ok, {"chunk_size": 0}),
        ("ignore_index", TypeError, ok, {"ignore_index": 1.5}),
        ("accurate", TypeError, ok, {"accurate": "yes"}),
        ("return_z_loss", TypeError, ok, {"return_z_loss": 1}),
    ]
    return [pytest.param(*case, id=f"{case[0]}-{i}") for i, case in enumerate(cases)]


@pytest.mark.parametrize("name, error, tensors, options", _bad_calls())
def test_bad_inputs_name_the_argument(name, error, tensors, options):
    with pytest.raises(error, match=name):
        fused_linear_cross_entropy(tensors["x"], tensors["weight"], tensors["target"], tensors["bias"], **options)
