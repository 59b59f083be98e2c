"""The study's two-head stage (``studies/kernels/distill_chunk_lanes.py``) against float64 and the library's stage.

Every dial must compute what the library computes: through the whole loss (the arm set as the A/B sets it) against
the float64 references, and stage against stage on the same chunk, in each dtype, with ignored rows, the hard loss
at T != 1, the JSD's ends and its mixture, the cosine, a vocabulary that is not a multiple of the block, and NaN in.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from kernels_lib import distill_cosine_loss, distill_jsd_loss, fused_linear_jsd, reference
from kernels_lib.kernels.distill_chunk import SOFT_COSINE, SOFT_JSD, launch_distill_chunk
from kernels_workbench.check import TOLERANCE, relative_error
from studies.bench.arms import constants_set
from studies.kernels.distill_chunk_lanes import launch_distill_chunk_lanes, launcher
from two_heads import DEVICE, STUDENT, float64, make, run

DIALS = [dict(zip(("lane_sums", "lane_lse", "few_exp"), flags)) for flags in itertools.product((False, True), repeat=3)]
if torch.cuda.is_available():  # fast_log is inline PTX: only a GPU runs it
    DIALS += [dict(d, fast_log=True) for d in DIALS]
DIAL_IDS = ["-".join(k for k, v in d.items() if v) or "library-like" for d in DIALS]


CALLS = []


def _arm(dials):
    """The A/B's arm: the library's pipeline with this stage in place of its own (each call counted in CALLS)."""
    stage = launcher(**dials, block_v=16)

    def counted(*args, **kwargs):
        CALLS.append(dials)
        return stage(*args, **kwargs)

    CALLS.clear()
    return constants_set({"kernels_lib._distillation": {"launch_distill_chunk": counted}})


@pytest.mark.parametrize("dials", DIALS, ids=DIAL_IDS)
@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("loss, ref", [(distill_jsd_loss, reference.distill_jsd_loss),
                                       (distill_cosine_loss, reference.distill_cosine_loss)], ids=["jsd", "cosine"])
def test_the_loss_with_the_arm_matches_float64(loss, ref, beta, dials):
    """Several chunks, biases, rows 1 and 4 ignored, T = 1.7 (so the hard loss needs its own log-sum-exp), V = 37
    over blocks of 16 (a ragged last block)."""
    tensors = make(seed=3 + int(10 * beta))
    options = dict(beta=beta, temperature=1.7, chunk_size=2, weight_hard_loss=0.3, weight_soft_loss=0.9)
    with _arm(dials):
        got, grads = run(loss, tensors, **options)
    assert len(CALLS) == 3, f"the arm's stage ran {len(CALLS)} times for 3 chunks of 2 rows: the library's ran instead"
    want, want_grads = run(ref, float64(tensors), **options)
    errors = {f: relative_error(g, w) for f, g, w in zip(got._fields, got, want, strict=True)}
    errors.update({n: relative_error(g, w) for n, g, w in zip(STUDENT, grads, want_grads)})
    tol = TOLERANCE[torch.float32]
    assert all(not math.isnan(e) and e <= tol for e in errors.values()), f"dials {dials}: errors {errors} over {tol}"


def test_the_fused_linear_jsd_with_the_arm_matches_float64():
    tensors = make(seed=11)
    options = dict(beta=0.3, temperature=1.0, chunk_size=3)
    args = lambda t: (t["student_x"], t["student_weight"], t["teacher_x"], t["teacher_weight"])  # noqa: E731
    with _arm({"lane_sums": True, "lane_lse": True, "few_exp": True}):
        got = fused_linear_jsd(*args(tensors), **options)
    assert len(CALLS) == 2, f"the arm's stage ran {len(CALLS)} times for 2 chunks"
    want = fused_linear_jsd(*args(tensors), **options)  # the library's stage on the same inputs
    exact = reference.fused_linear_jsd(*args(float64(tensors)), **options)
    assert relative_error(got, exact) <= TOLERANCE[torch.float32], (got, exact)
    assert relative_error(got, want) <= TOLERANCE[torch.float32], (got, want)


def _stage(launch, dtype, soft_kind, beta, temperature, poison=False, offset=0.0, **dials):
    gen = torch.Generator().manual_seed(7)
    rows, v = 5, 301
    student = (torch.randn(rows, v, generator=gen) * 3 + offset).to(DEVICE, dtype)
    teacher = (torch.randn(rows, v, generator=gen) * 3 + offset).to(DEVICE, dtype)
    if poison:
        student[2, 17] = float("nan")
    target = torch.tensor([3, -100, 300, 0, 150], device=DEVICE)
    soft, hard = torch.empty(rows, device=DEVICE), torch.empty(rows, device=DEVICE)
    factors = torch.tensor([0.25, 0.5], device=DEVICE)
    launch(student, teacher, target, soft=soft, hard=hard, factors=factors, soft_kind=soft_kind, beta=beta,
           temperature=temperature, ignore_index=-100, **dials)
    return soft, hard, student.float()


# Every dial in float32; in the half dtypes (which only change the loads and dz's store) all dials at once.
DTYPE_DIALS = [pytest.param(torch.float32, d, id=f"float32-{i}") for d, i in zip(DIALS, DIAL_IDS)] + [
    pytest.param(dt, DIALS[-1], id=f"{str(dt)[6:]}-{DIAL_IDS[-1]}") for dt in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize("dtype, dials", DTYPE_DIALS)
@pytest.mark.parametrize("soft_kind, beta, temperature", [(SOFT_JSD, 0.5, 1.0), (SOFT_JSD, 0.0, 2.0), (SOFT_JSD, 1.0, 0.7),
                                                          (SOFT_JSD, 0.9, 1.3), (SOFT_COSINE, 0.5, 1.0)],
                         ids=["jsd-mix-T1", "jsd-b0", "jsd-b1", "jsd-mix-T1.3", "cosine"])
def test_the_stage_computes_what_the_librarys_stage_computes(soft_kind, beta, temperature, dials, dtype):
    want = _stage(launch_distill_chunk, dtype, soft_kind, beta, temperature)
    got = _stage(launch_distill_chunk_lanes, dtype, soft_kind, beta, temperature, block_v=64, **dials)
    for name, g, w in zip(("soft", "hard", "dz"), got, want):
        error = relative_error(g, w)
        # float32 sums in another order; dz is stored in the chunk's dtype, where one rounding step may differ
        bound = 1e-5 if name != "dz" or dtype == torch.float32 else TOLERANCE[dtype]
        assert error <= bound, f"{name} with {dials} in {dtype}: {error:.2e} against the library's stage (bound {bound})"
    assert torch.all(got[0][1] == 0) and torch.all(got[1][1] == 0) and torch.all(got[2][1] == 0), "an ignored row counted"


@pytest.mark.parametrize("dials", DIALS, ids=DIAL_IDS)
def test_nan_in_a_row_gives_nan_in_that_rows_outputs(dials):
    soft, hard, dz = _stage(launch_distill_chunk_lanes, torch.float32, SOFT_JSD, 0.5, 1.3, poison=True, block_v=64,
                            **dials)
    assert soft[2].isnan() and hard[2].isnan() and dz[2].isnan().any(), f"NaN in row 2 was lost with {dials}"
    kept = [0, 3, 4]
    assert soft[kept].isfinite().all() and hard[kept].isfinite().all() and dz[kept].isfinite().all(), "NaN leaked into other rows"


@pytest.mark.parametrize("dials", DIALS, ids=DIAL_IDS)
def test_a_large_common_offset_cancels_in_the_hard_loss(dials):
    """Logits around 1000: the hard loss (m - z_y) + log s keeps its digits where lse - z_y would lose them; the
    library's stage keeps them, and so must every dial (float64 of the same rounded logits as the reference)."""
    soft, hard, _ = _stage(launch_distill_chunk_lanes, torch.float32, SOFT_JSD, 0.5, 1.3, offset=1000.0, block_v=64,
                           **dials)
    gen = torch.Generator().manual_seed(7)
    z = (torch.randn(5, 301, generator=gen) * 3 + 1000.0).double()
    target = torch.tensor([3, -100, 300, 0, 150])
    kept = target != -100
    want = torch.logsumexp(z[kept], -1) - z[kept].gather(1, target[kept, None]).squeeze(1)
    error = relative_error(hard[kept].cpu().double(), want)
    assert error <= 1e-5, f"hard loss at a 1000 offset with {dials}: {error:.1e} against float64"


def test_bad_dials_are_refused_naming_them():
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        _stage(launch_distill_chunk_lanes, torch.float32, SOFT_JSD, 0.5, 1.0, block_v=48)
    with pytest.raises(ValueError, match="soft_kind"):
        _stage(launch_distill_chunk_lanes, torch.float32, 7, 0.5, 1.0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fast_log needs a CUDA GPU"):
            _stage(launch_distill_chunk_lanes, torch.float32, SOFT_JSD, 0.5, 1.0, fast_log=True)


_COMPILE = r"""
import itertools, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from studies.kernels import distill_chunk_lanes as m
sig = {"student_ptr": "*bf16", "stride_s": "i64", "teacher_ptr": "*bf16", "stride_t": "i64", "target_ptr": "*i64",
       "hard_ptr": "*fp32", "soft_ptr": "*fp32", "factor_ptr": "*fp32", "n_cols": "i32", "ignore_index": "i32",
       "inv_t": "fp32", "beta": "fp32"}
out = []
for soft, fast_log in itertools.product((0, 1), (False, True)):
    const = dict(SOFT=soft, BETA_MODE=2 if soft == 0 else 0, HAS_TARGET=True, HARD=True, RAW_LSE=soft == 1, WRITE_GRAD=True,
                 LANE_SUMS=True, LANE_LSE=True, FEW_EXP=True, FAST_LOG=fast_log, BLOCK_V=4096)
    s = dict(sig, **{n: "constexpr" for n in const})
    kernel = triton.compile(ASTSource(m.distill_chunk_lanes_kernel, s, constexprs={(list(s).index(n),): v for n, v in const.items()}),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
    ptx = kernel.asm["ptx"]
    out.append(dict(soft=soft, fast_log=fast_log, lg2=ptx.count("lg2.approx"), ex2=ptx.count("ex2.approx")))
print("RESULT" + json.dumps(out))
"""


def test_every_dial_compiles_for_sm90_and_fast_log_is_the_hardware_log():
    """Triton's compiler (not the interpreter, in a subprocess) builds the stage for sm_90 with every dial on; the
    JSD's mixture log is ``lg2.approx`` with ``fast_log`` and a polynomial without; the cosine has no per-element log."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = {(c["soft"], c["fast_log"]): c for c in json.loads(done.stdout.split("RESULT")[-1])}
    assert cases[(0, True)]["lg2"] > 0 and cases[(0, False)]["lg2"] == 0, cases
    assert cases[(1, True)]["lg2"] == cases[(1, False)]["lg2"] == 0, cases
    assert all(c["ex2"] > 0 for c in cases.values()), "the exponentials are not ex2.approx"
