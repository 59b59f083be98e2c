"""kernels_lib.distill_jsd_loss and distill_cosine_loss against the float64 references and Liger's
own chunked modules (run eagerly on the CPU).

Errors are ``||out - ref|| / ||ref||`` (:func:`kernels_workbench.check.relative_error`) against
:func:`kernels_lib.reference.distill_jsd_loss` / :func:`~kernels_lib.reference.distill_cosine_loss`
(autograd for the gradients) on float64 copies of the very inputs, bounded by
:data:`~kernels_workbench.check.TOLERANCE` of the input dtype. Shapes are small (Triton's interpreter).
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels_lib
from kernels_lib import DistillationOutput, distill_cosine_loss, distill_jsd_loss, reference
from kernels_workbench.check import TOLERANCE, relative_error
from two_heads import STUDENT, float64, make, poisoned_allocations, run  # noqa: F401  (a fixture)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOSSES = {"jsd": (distill_jsd_loss, reference.distill_jsd_loss), "cosine": (distill_cosine_loss, reference.distill_cosine_loss)}


def check(name, tensors, tol, **options):
    ours, theirs = LOSSES[name]
    got, grads = run(ours, tensors, **options)
    want, want_grads = run(theirs, float64(tensors), **options)
    assert isinstance(got, DistillationOutput) and all(t.dtype == torch.float32 and t.shape == () for t in got)
    errors = {field: relative_error(g, w) for field, g, w in zip(DistillationOutput._fields, got, want, strict=True)}
    errors.update({name: relative_error(g, w) for name, g, w in zip(STUDENT, grads, want_grads)})
    assert all(not math.isnan(e) and e <= tol for e in errors.values()), (errors, tol)
    for grad, name in zip(grads, STUDENT):
        assert grad.dtype == tensors[name].dtype and grad.shape == tensors[name].shape
    return got, grads


# --------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("name", LOSSES)
def test_matches_float64_reference(name, beta, dtype):
    """Several chunks, biases, ignored rows, temperature != 1, unequal weights."""
    check(name, make(dtype=dtype, seed=int(10 * beta)), TOLERANCE[dtype], beta=beta, temperature=1.7, chunk_size=2,
          weight_hard_loss=0.3, weight_soft_loss=0.9)


@pytest.mark.parametrize("name", LOSSES)
def test_hard_and_soft_fields(name):
    """loss = w_h · hard + w_s · soft; hard is the cross-entropy of the raw logits (no temperature) over
    the kept rows; weights that zero one term leave the other's gradient alone."""
    tensors = make(seed=20)
    out, _ = check(name, tensors, TOLERANCE[torch.float32], beta=0.4, temperature=2.5, weight_hard_loss=0.25,
                   weight_soft_loss=2.0)
    assert torch.allclose(out.loss, 0.25 * out.hard_loss + 2.0 * out.soft_loss, rtol=1e-6)
    logits = tensors["student_x"] @ tensors["student_weight"].T + tensors["student_bias"]
    ce = torch.nn.functional.cross_entropy(logits, tensors["target"])
    assert torch.allclose(out.hard_loss, ce, rtol=1e-5)
    hard_only, hard_grads = run(LOSSES[name][0], tensors, weight_hard_loss=1.0, weight_soft_loss=0.0)
    ce_grads = torch.autograd.grad(
        torch.nn.functional.cross_entropy(
            (leaf := tensors["student_x"].clone().requires_grad_()) @ tensors["student_weight"].T + tensors["student_bias"],
            tensors["target"]),
        leaf)
    assert torch.allclose(hard_only.loss, ce, rtol=1e-5) and relative_error(hard_grads[0], ce_grads[0]) < 1e-5


def test_odd_sizes_one_row_and_leading_dims():
    check("jsd", make(n=1, hs=5, ht=3, v=1031, seed=21), TOLERANCE[torch.float32], beta=0.7, temperature=0.6)
    check("cosine", make(n=1, hs=3, ht=5, v=1031, seed=22), TOLERANCE[torch.float32], beta=0.7)
    check("cosine", make(lead=(2, 3), hs=3, ht=5, v=129, seed=23), TOLERANCE[torch.float32], chunk_size=4)


@pytest.mark.parametrize("name", LOSSES)
def test_all_rows_ignored_give_zeros(name):
    """n is clamped to 1 (Liger's): the three fields are 0 and the gradients are 0."""
    tensors = make(seed=24)
    tensors["target"] = torch.full_like(tensors["target"], -100)
    out, grads = run(LOSSES[name][0], tensors)
    assert all(t.item() == 0.0 for t in out) and all(torch.count_nonzero(g) == 0 for g in grads)
    want, _ = run(LOSSES[name][1], float64(tensors))
    assert all(t.item() == 0.0 for t in want)


@pytest.mark.parametrize("name", LOSSES)
def test_every_output_written(poisoned_allocations, name):
    _, grads = check(name, make(seed=25), TOLERANCE[torch.float32], chunk_size=4)
    assert not any(torch.isnan(g).any() for g in grads)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
@pytest.mark.parametrize("where", ["student_x", "teacher_weight"])
@pytest.mark.parametrize("name", LOSSES)
def test_nan_propagates(name, where):
    tensors = make(seed=26)
    tensors[where].view(-1)[0] = float("nan")
    out, grads = run(LOSSES[name][0], tensors)
    assert torch.isnan(out.loss) and torch.isnan(out.soft_loss) and torch.isnan(grads[1]).any()
    assert torch.isnan(out.hard_loss) == (where == "student_x")  # the hard loss reads the student only


def test_outputs_and_teacher_carry_no_gradient():
    tensors = make(seed=27)
    sx = tensors["student_x"].clone().requires_grad_()
    tw = tensors["teacher_weight"].clone().requires_grad_()
    out = distill_cosine_loss(sx, tensors["student_weight"], tensors["teacher_x"], tw, tensors["target"])
    assert out.loss.requires_grad and not out.hard_loss.requires_grad and not out.soft_loss.requires_grad
    (2.0 * out.loss).backward()
    assert tw.grad is None and torch.isfinite(sx.grad).all()


# --------------------------------------------------------------------------- against Liger's modules


@pytest.mark.parametrize("name", LOSSES)
def test_matches_liger_chunked_modules(name):
    """``LigerFusedLinearJSDLoss`` / ``LigerFusedLinearCosineSimilarityLoss`` (``compiled=False``: plain
    torch on the CPU) with the same options: loss, soft, hard and the student's gradients."""
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    cls = {"jsd": chunked.LigerFusedLinearJSDLoss, "cosine": chunked.LigerFusedLinearCosineSimilarityLoss}[name]
    options = dict(weight_hard_loss=0.3, weight_soft_loss=0.9, beta=0.3, temperature=1.7)
    module = cls(**options, compiled=False, chunk_size=2, return_soft_hard_loss=True)
    tensors = make(seed=28)

    def liger(sx, sw, tx, tw, target, *, student_bias, teacher_bias):
        loss, soft, hard = module(sx, sw, tx, tw, target, student_bias, teacher_bias)
        return DistillationOutput(loss, hard, soft)

    theirs, their_grads = run(liger, tensors)
    ours, our_grads = run(LOSSES[name][0], tensors, **options)
    assert all(relative_error(a, b) <= 1e-5 for a, b in zip(ours, theirs, strict=True))
    assert all(relative_error(a, b) <= 1e-5 for a, b in zip(our_grads, their_grads, strict=True))


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("change, error, message", [
    ({"target": None}, TypeError, "target must be a torch.Tensor"),
    ({"target": "out of range"}, ValueError, r"target holds 1 value\(s\) outside \[0, 37\)"),
    ({"teacher_weight": "wrong V"}, ValueError, r"teacher_weight must have shape \(37, 9\)"),
    ({"student_bias": "half"}, TypeError, "student_bias must have the dtype of student_weight"),
    ({"weight_hard_loss": "0.5"}, TypeError, "weight_hard_loss must be a finite real"),
    ({"weight_soft_loss": float("nan")}, TypeError, "weight_soft_loss must be a finite real"),
    ({"temperature": -1.0}, ValueError, "temperature must be > 0"),
    ({"beta": None}, TypeError, "beta must be a finite real"),
])
@pytest.mark.parametrize("name", LOSSES)
def test_bad_input_names_the_argument(name, change, error, message):
    t = make(seed=29)
    options = {}
    for key, value in change.items():
        if key in ("weight_hard_loss", "weight_soft_loss", "temperature", "beta"):
            options[key] = value
        elif value == "out of range":
            t["target"] = t["target"].clone()
            t["target"][0] = 37
        elif value == "wrong V":
            t["teacher_weight"] = t["teacher_weight"][:36]
        elif value == "half":
            t["student_bias"] = t["student_bias"].half()
        else:
            t[key] = value
    with pytest.raises(error, match=message):
        LOSSES[name][0](t["student_x"], t["student_weight"], t["teacher_x"], t["teacher_weight"], t["target"],
                        student_bias=t["student_bias"], teacher_bias=t["teacher_bias"], **options)


def test_jsd_beta_range_and_module_forms():
    t = make(seed=30, bias=False)
    args = [t[k] for k in ("student_x", "student_weight", "teacher_x", "teacher_weight", "target")]
    with pytest.raises(ValueError, match="beta must be in"):
        distill_jsd_loss(*args, beta=1.2)
    assert torch.isfinite(distill_cosine_loss(*args, beta=1.2).loss)  # the cosine's beta is a plain factor
    for module, fn in ((kernels_lib.DistillJSDLoss(beta=0.2, temperature=2.0), distill_jsd_loss),
                       (kernels_lib.DistillCosineLoss(beta=0.2, temperature=2.0), distill_cosine_loss)):
        assert all(torch.equal(a, b) for a, b in zip(module(*args), fn(*args, beta=0.2, temperature=2.0)))
        assert "temperature=2.0" in repr(module)
    with pytest.raises(ValueError, match="beta must be in"):
        kernels_lib.DistillJSDLoss(beta=-0.5)


# --------------------------------------------------------------------------- the default chunk


def test_two_head_chunk_size_rule():
    from kernels_lib._distillation import MIN_TWO_HEAD_CHUNK_ROWS
    from kernels_lib.chunks.chunk_size import lean_chunk_size

    assert kernels_lib.distillation.two_head_chunk_size(8192, 2048) == MIN_TWO_HEAD_CHUNK_ROWS, "the floor of the default"
    assert kernels_lib.distillation.two_head_chunk_size(1024, 2048) == 1024, "never more rows than the input has"
    assert kernels_lib.distillation.two_head_chunk_size(65536, 32768) == lean_chunk_size(65536, 32768) > MIN_TWO_HEAD_CHUNK_ROWS, \
        "a wide student's lean budget wins over the floor"
    assert kernels_lib.distillation.two_head_chunk_size(1, 8) == 1


@pytest.mark.parametrize("fn", [distill_jsd_loss, distill_cosine_loss, kernels_lib.fused_linear_jsd], ids=lambda f: f.__name__)
def test_default_chunk_is_two_head_chunk_size(monkeypatch, fn):
    """The loop is built with ``two_head_chunk_size`` rows when ``chunk_size`` is None, and with the given rows otherwise."""
    from kernels_lib import _distillation

    seen = []

    class Stop(Exception):
        pass

    def spy(x, weight, bias, rows_per_chunk, dtype, **kwargs):
        seen.append(rows_per_chunk)
        raise Stop

    monkeypatch.setattr(_distillation, "Operands", spy)
    t = make(n=3000, hs=8, ht=8, v=16)
    args = (t["student_x"], t["student_weight"], t["teacher_x"], t["teacher_weight"])
    kwargs = {"target": t["target"]}
    for chunk, want in ((None, _distillation.two_head_chunk_size(3000, 8)), (96, 96)):
        with pytest.raises(Stop):
            fn(*args, **kwargs, chunk_size=chunk)
        assert seen[-1] == want, f"{fn.__name__} with chunk_size={chunk} built chunks of {seen[-1]} rows, not {want}"


# --------------------------------------------------------------------------- the stage's hardware log

_COMPILE_STAGE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels_lib.kernels import distill_chunk as m
sig = {"student_ptr": "*bf16", "stride_s": "i64", "teacher_ptr": "*bf16", "stride_t": "i64", "target_ptr": "*i64",
       "hard_ptr": "*fp32", "soft_ptr": "*fp32", "factor_ptr": "*fp32", "n_cols": "i32", "ignore_index": "i32",
       "inv_t": "fp32", "beta": "fp32"}
out = []
for fast_log in (False, True):
    const = dict(SOFT=m.SOFT_JSD, BETA_MODE=2, HAS_TARGET=True, HARD=True, RAW_LSE=True, WRITE_GRAD=True,
                 FAST_LOG=fast_log, BLOCK_V=4096)
    s = dict(sig, **{n: "constexpr" for n in const})
    kernel = triton.compile(ASTSource(m.distill_chunk_kernel, s, constexprs={(list(s).index(n),): v for n, v in const.items()}),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    ptx = kernel.asm["ptx"]
    out.append(dict(fast_log=fast_log, lg2=ptx.count("lg2.approx"), ex2=ptx.count("ex2.approx")))
print("RESULT" + json.dumps(out))
"""


def test_stage_takes_the_hardware_log_only_where_it_is_compiled_for_cuda():
    """The two-head stage's mixture log is ``lg2.approx`` on CUDA (compiled for sm_90 by Triton's compiler in a
    subprocess, as on a GPU) and ``tl.log`` elsewhere; Triton's interpreter, which cannot run inline PTX, never gets
    it (so the CPU tests above check the ``tl.log`` form against float64, and the GPU target the hardware one)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kernels_lib.kernels.distill_chunk import hardware_log

    assert not hardware_log(torch.zeros(1)), "a CPU tensor took the inline-PTX log"
    if torch.cuda.is_available():
        assert hardware_log(torch.zeros(1, device="cuda")) == (torch.version.hip is None and not kernels_lib.INTERPRETED)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", _COMPILE_STAGE], env=env, capture_output=True, text=True, timeout=600,
                          cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = {c["fast_log"]: c for c in json.loads(done.stdout.split("RESULT")[-1])}
    assert cases[True]["lg2"] > 0, f"FAST_LOG compiled without lg2.approx: {cases}"
    assert cases[False]["lg2"] == 0, f"tl.log compiled to lg2.approx after all (the polynomial is gone?): {cases}"
    assert all(c["ex2"] > 0 for c in cases.values()), f"the exponentials are not ex2.approx: {cases}"
