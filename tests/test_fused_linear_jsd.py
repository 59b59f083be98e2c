"""kernels_lib.fused_linear_jsd against the float64 reference, TRL 1.16's ``generalized_jsd_loss``
and TRL's ``ChunkedDivergenceFunction``.

Errors are ``||out - ref|| / ||ref||`` (:func:`kernels_workbench.check.relative_error`), the
reference (:func:`kernels_lib.reference.fused_linear_jsd`, autograd for the gradients) run on float64
copies of the very inputs the kernel saw, bounded by :data:`~kernels_workbench.check.TOLERANCE` of
the input dtype. Shapes are small: without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels_lib
from kernels_lib import fused_linear_jsd, reference
from kernels_workbench.check import BASELINE_MARGIN, TOLERANCE, relative_error
from two_heads import STUDENT, float64, make, poisoned_allocations, run  # noqa: F401  (a fixture)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check(tensors, tol, *, against_baseline=False, **options):
    """Loss and gradients against float64 within ``tol``; with ``against_baseline``, within
    ``BASELINE_MARGIN`` times the baseline's own error where that is larger (the reference run in the
    inputs' own dtypes on the same device: a bfloat16 teacher's logits are rounded to bfloat16 by any
    implementation, on CUDA by its matmul too)."""
    got, grads = run(fused_linear_jsd, tensors, **options)
    want, want_grads = run(reference.fused_linear_jsd, float64(tensors), **options)
    assert got.dtype == torch.float32 and got.shape == ()
    errors = [relative_error(got, want)] + [relative_error(g, w) for g, w in zip(grads, want_grads, strict=True)]
    bounds = [tol] * len(errors)
    if against_baseline:
        base, base_grads = run(reference.fused_linear_jsd, tensors, **options)
        base_errors = [relative_error(base, want)] + [relative_error(g, w) for g, w in zip(base_grads, want_grads, strict=True)]
        bounds = [max(tol, BASELINE_MARGIN * e) for e in base_errors]
    assert all(not math.isnan(e) and e <= b for e, b in zip(errors, bounds)), (errors, bounds)
    for grad, name in zip(grads, STUDENT):
        assert grad.dtype == tensors[name].dtype and grad.shape == tensors[name].shape
    return got, grads


# --------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matches_float64_reference(beta, dtype):
    """Several chunks (chunk_size=2 over 6 rows), biases, ignored rows, temperature != 1."""
    check(make(dtype=dtype, seed=int(10 * beta)), TOLERANCE[dtype], beta=beta, temperature=1.7, chunk_size=2)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reductions(reduction):
    got, _ = check(make(seed=3, bias=False), TOLERANCE[torch.float32], beta=0.3, reduction=reduction, chunk_size=4)
    batchmean, _ = run(fused_linear_jsd, make(seed=3, bias=False), beta=0.3)
    assert torch.allclose(got, batchmean * (4 if reduction == "sum" else 1 / 37), rtol=1e-5)


def test_odd_sizes_one_row_no_target_and_leading_dims():
    """N = 1 with odd V, H; a (2, 3, H) batch with a (2, 3) target; no target at all (every row counts)."""
    check(make(n=1, hs=5, ht=3, v=1031, seed=4), TOLERANCE[torch.float32], beta=0.7, temperature=0.6)
    check(make(lead=(2, 3), hs=3, ht=5, v=129, seed=5), TOLERANCE[torch.float32], beta=0.5, chunk_size=4)
    check({**make(n=3, seed=6), "target": None}, TOLERANCE[torch.float32], beta=0.2)


def test_mixed_dtypes_teacher_in_its_own_dtype():
    """A float32 student and a bfloat16 teacher: the teacher's logits in bfloat16 on CUDA (its own dtype's
    matmul), float32 in the interpreter; bounded by the baseline's own error in the same dtypes."""
    check(make(dtype=torch.float32, teacher_dtype=torch.bfloat16, seed=7), TOLERANCE[torch.float32], against_baseline=True,
          beta=0.5)


def test_all_rows_ignored_give_zero_loss_and_zero_gradients():
    tensors = make(seed=8)
    tensors["target"] = torch.full_like(tensors["target"], -100)
    loss, grads = run(fused_linear_jsd, tensors, beta=0.5)
    assert loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads)
    assert run(reference.fused_linear_jsd, float64(tensors), beta=0.5)[0].item() == 0.0  # TRL's clamp, as ours


@pytest.mark.parametrize("chunk_size", [None, 4])  # one chunk; 4 + 2 rows
def test_every_output_written(poisoned_allocations, chunk_size):
    _, grads = check(make(seed=9), TOLERANCE[torch.float32], beta=0.4, chunk_size=chunk_size)
    assert not any(torch.isnan(g).any() for g in grads)


def test_upstream_gradient_and_teacher_is_a_constant():
    """backward scales by grad_output; a teacher that requires grad is read as a constant (no grad)."""
    tensors = make(seed=10)
    sx = tensors["student_x"].clone().requires_grad_()
    tw = tensors["teacher_weight"].clone().requires_grad_()
    loss = fused_linear_jsd(sx, tensors["student_weight"], tensors["teacher_x"], tw, tensors["target"], beta=0.5)
    (3.0 * loss).backward()
    assert tw.grad is None
    _, (unit, _) = run(fused_linear_jsd, {**tensors, "student_bias": None, "teacher_bias": None}, beta=0.5)
    assert torch.allclose(sx.grad, 3.0 * unit, rtol=1e-6, atol=0)
    with torch.no_grad():
        assert fused_linear_jsd(sx, tensors["student_weight"], tensors["teacher_x"], tw, beta=0.5).grad_fn is None


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
@pytest.mark.parametrize("where", ["student_x", "student_weight", "teacher_x", "teacher_bias"])
def test_nan_propagates(where):
    tensors = make(seed=11)
    tensors[where].view(-1)[0] = float("nan")  # row 0 (kept) or column 0 of every row
    loss, grads = run(fused_linear_jsd, tensors, beta=0.5)
    assert torch.isnan(loss) and torch.isnan(grads[1]).any()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
def test_nan_in_an_ignored_row_does_not_count():
    """The loss and dx stay finite (dW = dzᵀx takes 0 · NaN from that row, as torch's backward does)."""
    tensors = make(seed=12)
    tensors["teacher_x"][1] = float("nan")  # row 1 is ignored
    tensors["student_x"][4] = float("nan")  # so is row 4
    loss, grads = run(fused_linear_jsd, tensors, beta=0.5)
    assert torch.isfinite(loss) and torch.isfinite(grads[0]).all() and torch.isfinite(grads[2]).all()


# --------------------------------------------------------------------------- against TRL


def test_matches_trl_generalized_jsd_loss():
    """TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` on materialized float64 logits, (B, T, V) with
    labels (batchmean divides by the kept tokens), at the three kinds of beta and T != 1."""
    gkd = pytest.importorskip("trl.experimental.gkd")
    tensors = make(lead=(2, 4), seed=13)
    d = float64(tensors)
    student = d["student_x"] @ d["student_weight"].T + d["student_bias"]
    teacher = d["teacher_x"] @ d["teacher_weight"].T + d["teacher_bias"]
    for beta in (0.0, 0.4, 1.0):
        trl_loss = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=d["target"], beta=beta, temperature=1.5)
        ours, _ = run(fused_linear_jsd, tensors, beta=beta, temperature=1.5)
        assert relative_error(ours, trl_loss) <= TOLERANCE[torch.float32], beta


def test_matches_trl_chunked_divergence():
    """TRL's fused two-head ``ChunkedDivergenceFunction`` (per-token, unmasked), masked and averaged
    over the kept rows, on the CPU: loss and student gradients."""
    chunked = pytest.importorskip("trl.kernels.chunked_divergence")
    tensors = make(seed=14)
    keep = tensors["target"] != -100

    def trl_loss(sx, sw, tx, tw, target, *, student_bias, teacher_bias, beta):
        divergence, _ = chunked.ChunkedDivergenceFunction.apply(sx, sw, student_bias, tx, tw, teacher_bias, beta, 1.3)
        return (divergence * keep).sum() / keep.sum()

    for beta in (0.0, 0.6, 1.0):
        theirs, their_grads = run(trl_loss, tensors, beta=beta)
        ours, our_grads = run(fused_linear_jsd, tensors, beta=beta, temperature=1.3)
        assert relative_error(ours, theirs) <= 1e-5
        assert all(relative_error(a, b) <= 1e-5 for a, b in zip(our_grads, their_grads, strict=True))


# --------------------------------------------------------------------------- bad input


def bad_inputs():
    t = make(seed=15)
    return [
        ({"student_x": t["student_x"].tolist()}, TypeError, "student_x must be a torch.Tensor"),
        ({"student_x": t["student_x"].double()}, TypeError, "student_x must be a floating tensor"),
        ({"student_weight": t["student_weight"].half()}, TypeError, "student_weight must have the dtype of student_x"),
        ({"teacher_weight": t["teacher_weight"][:, :4]}, ValueError, "teacher_weight must have shape"),
        ({"teacher_weight": t["teacher_weight"][:5]}, ValueError, r"teacher_weight must have shape \(37, 9\)"),
        ({"teacher_x": t["teacher_x"][:5]}, ValueError, "teacher_x must have the leading shape of student_x"),
        ({"student_bias": t["student_bias"][:3]}, ValueError, "student_bias must have shape"),
        ({"teacher_bias": t["teacher_bias"].half()}, TypeError, "teacher_bias must have the dtype of teacher_weight"),
        ({"target": t["target"].float()}, TypeError, "target must be an int64 or int32"),
        ({"target": t["target"][:3]}, ValueError, "target must have shape"),
        ({"student_x": t["student_x"][:0], "teacher_x": t["teacher_x"][:0], "target": t["target"][:0]}, ValueError,
         "student_x must not be empty"),
        ({"beta": 1.5}, ValueError, "beta must be in"),
        ({"temperature": 0.0}, ValueError, "temperature must be > 0"),
        ({"reduction": "none"}, ValueError, "reduction must be one of"),
        ({"chunk_size": 0}, ValueError, "chunk_size must be None or a positive int"),
        ({"ignore_index": -100.0}, TypeError, "ignore_index must be an int"),
    ]


@pytest.mark.parametrize("change, error, message", bad_inputs(), ids=lambda p: str(p)[:40] if isinstance(p, str) else None)
def test_bad_input_names_the_argument(change, error, message):
    t = {**make(seed=15), "beta": 0.5}
    t.update(change)
    options = {k: t.pop(k) for k in ("beta", "temperature", "reduction", "chunk_size", "ignore_index") if k in t}
    with pytest.raises(error, match=message):
        fused_linear_jsd(t["student_x"], t["student_weight"], t["teacher_x"], t["teacher_weight"], t["target"],
                         student_bias=t["student_bias"], teacher_bias=t["teacher_bias"], **options)


def test_module_form():
    tensors = make(seed=16, bias=False)
    module = kernels_lib.FusedLinearJSDLoss(beta=0.3, temperature=2.0)
    args = [tensors[k] for k in ("student_x", "student_weight", "teacher_x", "teacher_weight", "target")]
    assert torch.equal(module(*args), fused_linear_jsd(*args, beta=0.3, temperature=2.0))
    assert "beta=0.3" in repr(module)
    with pytest.raises(ValueError, match="beta must be in"):
        kernels_lib.FusedLinearJSDLoss(beta=-0.1)
