"""The Gluon kernel of the stored exponentials' dx (studies.kernels.gluon_scaled_product).

On every machine: it compiles for ``sm_90a`` (Gluon does not run in Triton's interpreter, so CI's CPU
compiles it, in a subprocess with ``TRITON_INTERPRET=0``) at its default and each of its variants, for
bf16 and fp16, and its PTX holds the Hopper instructions it is written for (``wgmma`` of the tile's
width, TMA copies, register budgets) in the shared memory it should take; it says why it cannot run
on a CPU tensor; its launcher refuses bad input with an error naming the argument; the A/B benchmark
runs at tiny sizes, with the Gluon rows saying why they were skipped.

On the H200 (marker ``gpu``): its ``diag(r) (E W)`` against float64 from the very (rounded) inputs,
within 1.05× the baseline's own error (cuBLAS's float32 product, then one rounding:
``kernels_lib.chunks.matmuls.scaled_product_into``) on the same inputs, at odd shapes (C = 1, 777,
V = 50257 with E's rows padded to a 16-byte stride, H = 2056), factors negative and zero, ``out``
poisoned with NaN, ``out`` a row slice of a larger tensor whose other rows stay untouched, NaN kept to
its row.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib.chunks import matmuls
from studies.kernels import gluon_scaled_product as g
from studies.bench import gluon_scaled_product_ab as ab
from kernels_workbench.check import relative_error

_COMPILE = r"""
import json, sys, torch
from studies.kernels import gluon_scaled_product as g
out = []
for case in json.loads(sys.argv[1]):
    config = dict(case["config"])
    kernel = g.compile_for_sm90(getattr(torch, case["dtype"]), getattr(torch, case["out_dtype"]), **config)
    ptx = kernel.asm["ptx"]
    out.append(dict(shared=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                    wgmma=ptx.count("wgmma.mma_async"), tma=ptx.count("cp.async.bulk.tensor"),
                    setmaxnreg=ptx.count("setmaxnreg"), waits=ptx.count("mbarrier.try_wait"),
                    shapes=sorted({line.split("wgmma.mma_async.sync.aligned.")[1].split(".")[0]
                                   for line in ptx.splitlines() if "wgmma.mma_async.sync.aligned." in line}),
                    target=kernel.metadata.target.arch))
print("RESULT" + json.dumps(out))
"""

COMPILE_CASES = [dict(dtype=dtype, out_dtype=dtype, config=config)
                 for dtype in ("bfloat16", "float16") for config in g.CONFIGS]
# fp16 inputs whose dx stays float32 until grad_output is applied (kernels_lib.chunks.gradient_sums)
COMPILE_CASES.append(dict(dtype="float16", out_dtype="float32", config=g.CONFIGS[0]))


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(COMPILE_CASES)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, f"compilation failed:\n{done.stderr[-4000:]}"
    results = json.loads(lines[-1][len("RESULT"):])
    assert len(results) == len(COMPILE_CASES)
    return results


@pytest.mark.parametrize("index", range(len(COMPILE_CASES)),
                         ids=[f"{c['dtype']}->{c['out_dtype']}-{ab.gluon_name(c['config'])}" for c in COMPILE_CASES])
def test_compiles_for_sm90a(compiled, index):
    """Triton's compiler turns each config into sm_90a code on any machine: TMA copies, ``wgmma`` of
    ``m64 n{BLOCK_N} k16`` (one warpgroup's half of the tile, the whole width), the partitions' register
    budgets, a ring of ``STAGES`` slots in shared memory within the H200's 227 KiB per block."""
    case, result = COMPILE_CASES[index], compiled[index]
    cfg = case["config"]
    assert result["target"] == 90, case
    assert result["wgmma"] > 0, f"no wgmma in the PTX of {case}"
    assert result["shapes"] == [f"m64n{cfg['BLOCK_N']}k16"], result["shapes"]
    assert result["tma"] > 0, f"no TMA copy in the PTX of {case}"
    assert result["setmaxnreg"] > 0, f"no register budgets in the PTX of {case}"
    # Two consumer warpgroups and one loader warp (rounded up to a whole warpgroup).
    assert result["num_warps"] >= 9
    assert g.shared_bytes(cfg) <= result["shared"] <= g.MAX_SHARED_BYTES, result
    # Waits on the ready barriers (two consumers) and the empty ones (the loader), nothing else.
    assert result["waits"] >= 3


def test_variants_move_the_default_and_fit_in_shared_memory():
    assert g.CONFIGS[0] == g.DEFAULT_CONFIG and 3 <= len(g.VARIANTS) <= 5
    names = [ab.gluon_name(c) for c in g.CONFIGS]
    assert names[0] == "gluon default" and len(set(names)) == len(names)
    for config in g.CONFIGS:
        assert g.shared_bytes(config) <= g.MAX_SHARED_BYTES, config


def test_a_cpu_tensor_gets_a_reason_and_the_launcher_refuses_it():
    """On CI's CPU the reason is the interpreter; on the GPU machine, that the tensors are not on CUDA."""
    e, w, factors, scale = ab.make_operands(5, 16, 24, torch.bfloat16, torch.device("cpu"))
    out = torch.empty(5, 16, dtype=torch.bfloat16)
    reason = g.gluon_unsupported_reason(e, w, out)
    assert reason and ("interpreter" in reason or "CUDA" in reason), reason
    with pytest.raises(ValueError, match="launch_scaled_product: ") as caught:
        g.launch_scaled_product(out, e, w, factors, scale)
    assert reason in str(caught.value)


@pytest.mark.parametrize("shape, stride, match", [
    ((3, 50257), (50257, 1), "e's rows are 100514 bytes apart, not a multiple of 16"),
    ((3, 64), (1, 3), "unit stride along its columns"),
])
def test_tma_reasons_name_the_tensor(shape, stride, match):
    t = torch.empty_strided(shape, stride, dtype=torch.bfloat16)
    assert match in g._tma_reason("e", t)


def test_tma_takes_padded_rows():
    """E with 50257 columns in rows padded to 50264 elements (16-byte aligned stride) is TMA's."""
    storage = torch.empty(3, 50264, dtype=torch.bfloat16)
    assert g._tma_reason("e", storage[:, :50257]) is None


def _ok(n_rows=5, hidden=16, vocab=24, dtype=torch.bfloat16):
    e, w, factors, scale = ab.make_operands(n_rows, hidden, vocab, dtype, torch.device("cpu"))
    return dict(out=torch.empty(n_rows, hidden, dtype=dtype), e=e, w=w, factors=factors, scale=scale)


@pytest.mark.parametrize("change, match", [
    (dict(e=torch.zeros(24, dtype=torch.bfloat16)), "e must be 2-D"),
    (dict(w=torch.zeros(23, 16, dtype=torch.bfloat16)), "w must have e's 24 columns as rows"),
    (dict(w=torch.zeros(24, dtype=torch.bfloat16)), "w must be 2-D"),
    (dict(out=torch.zeros(5, 17, dtype=torch.bfloat16)), "out must have shape \\(5, 16\\)"),
    (dict(out=torch.zeros(5, 16, dtype=torch.int32)), "out must be bfloat16, float16 or float32"),
    (dict(factors=torch.zeros(4)), "factors must have shape \\(5,\\)"),
    (dict(factors=torch.zeros(5, dtype=torch.float64)), "factors must be float32"),
    (dict(scale=torch.ones(2)), "scale must hold one element"),
    (dict(scale=torch.ones(1, dtype=torch.float16)), "scale must be float32"),
    (dict(e=torch.zeros(5, 24), w=torch.zeros(24, 16)), "e must be bfloat16 or float16"),
    (dict(w=torch.zeros(24, 16, dtype=torch.float16)), "w must have e's dtype"),
    (dict(scale=1.0), "scale must be a torch.Tensor"),
])
def test_launcher_names_the_bad_argument(change, match):
    args = dict(_ok(), **change)
    with pytest.raises(ValueError, match="launch_scaled_product: " + match):
        g.launch_scaled_product(**args)


@pytest.mark.parametrize("config, match", [
    (dict(BLOCK_Q=64), "unknown keys \\['BLOCK_Q'\\]"),
    (dict(BLOCK_N=512), "BLOCK_N'\\] must be at most 256"),
    (dict(BLOCK_M=64), "BLOCK_M'\\] must be 128 or 256"),
    (dict(BLOCK_K=48), "BLOCK_K'\\] must be a power of two"),
    (dict(STAGES=0), "STAGES'\\] must be a positive int"),
    (dict(STAGES=5), "more than a block's"),
])
def test_bad_configs_name_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        g.launch_scaled_product(**_ok(), config=config)


def test_ab_runs_at_tiny_sizes_and_skips_gluon_with_its_reason():
    """On the suite's device: the interpreter on a CPU machine, the compiled kernels on a GPU (where a CPU
    tensor has no Triton to run it: on the H200 the baseline's row was a failure, its error NaN). V = 263
    gives E rows of 526 bytes, which TMA cannot read, so the Gluon rows are skipped there too."""
    table = ab.scaled_product_ab(chunks=(8,), H=48, V=263, device=kernels_lib.default_device(), rounds=1)
    by_name = table.set_index("candidate")
    assert {ab.BASELINE, ab.CUBLAS} <= set(by_name.index)
    gluon_rows = [ab.gluon_name(c) for c in g.CONFIGS]
    assert set(gluon_rows) <= set(by_name.index)
    failed = {name: by_name.loc[name].get("error", "") for name in (ab.BASELINE, ab.CUBLAS)}
    assert not any(failed.values()), f"rows that carry an error: {failed}"  # their error first: a failed row has no rel_err
    baseline = by_name.loc[ab.BASELINE]
    assert math.isfinite(baseline["rel_err"]) and baseline["rel_err"] < 2e-2, baseline["rel_err"]
    assert baseline["ms_50"] > 0 and baseline["dx_block_rows"] == matmuls.DX_BLOCK_ROWS
    assert math.isfinite(by_name.loc[ab.CUBLAS, "rel_err"]) and by_name.loc[ab.CUBLAS, "rel_err"] < 2e-2
    for name in gluon_rows:
        assert by_name.loc[name, "error"].startswith("skipped: "), by_name.loc[name, "error"]
    assert {"gpu_name", "triton_version", "torch_version", "kernels_lib_commit"} <= set(table.columns)


# --- On the H200: the numbers.

def _operands(n_rows, hidden, vocab, dtype, seed, pad_rows=False):
    """The A/B's operands on CUDA; with ``pad_rows`` E lies in rows padded to a multiple of 8 elements
    (a contiguous E of V = 50257 has rows TMA cannot read)."""
    e, w, factors, scale = ab.make_operands(n_rows, hidden, vocab, dtype, torch.device("cuda"), seed=seed)
    factors[1::5] = -factors[1::5].abs()  # negative factors beside make_operands' zeros
    if pad_rows:
        padded = torch.full((n_rows, -(-vocab // 8) * 8), float("nan"), dtype=dtype, device="cuda")
        padded[:, :vocab] = e
        e = padded[:, :vocab]  # the padding holds NaN: a read past V would show
    return e, w, factors, scale


def _check_against_baseline(out, e, w, factors, scale, margin=1.05):
    _, ref = ab.float64_references(e, w, factors, scale)
    baseline = torch.empty_like(out)
    matmuls.scaled_product_into(baseline, e.contiguous(), w, factors, scale)
    mine, theirs = relative_error(out, ref), relative_error(baseline, ref)
    assert math.isfinite(mine), "the Gluon kernel left NaN (an unwritten or wrongly read element)"
    assert mine <= margin * theirs + 1e-6, (mine, theirs)
    return mine, theirs


@pytest.mark.gpu
@pytest.mark.parametrize("n_rows, hidden, vocab, dtype, pad_rows", [
    (1, 4096, 50257, torch.bfloat16, True),  # one row: consumer 1's half of the tile is all padding
    (777, 2056, 50257, torch.bfloat16, True),  # every dimension ragged; H = 2056 not a power of two
    pytest.param(777, 4096, 128256, torch.float16, False, marks=pytest.mark.gpu_memory(10)),
    pytest.param(1024, 4096, 128256, torch.bfloat16, False, marks=pytest.mark.gpu_memory(10)),
    pytest.param(4096, 4096, 128256, torch.bfloat16, False, marks=pytest.mark.gpu_memory(11)),  # the full chunk
])
def test_matches_float64_within_the_baselines_error(n_rows, hidden, vocab, dtype, pad_rows):
    e, w, factors, scale = _operands(n_rows, hidden, vocab, dtype, seed=n_rows, pad_rows=pad_rows)
    assert g.gluon_unsupported_reason(e, w) is None
    out = torch.full((n_rows, hidden), float("nan"), dtype=dtype, device="cuda")
    g.launch_scaled_product(out, e, w, factors, scale)
    _check_against_baseline(out, e, w, factors, scale)
    assert (out[3::7] == 0).all(), "a zero factor gives a zero row"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", g.VARIANTS, ids=str)
def test_each_variant_matches_float64(variant):
    e, w, factors, scale = _operands(777, 2056, 50257, torch.bfloat16, seed=3, pad_rows=True)
    out = torch.full((777, 2056), float("nan"), dtype=torch.bfloat16, device="cuda")
    g.launch_scaled_product(out, e, w, factors, scale, config=variant)
    _check_against_baseline(out, e, w, factors, scale)


@pytest.mark.gpu
def test_float32_out_rounds_nothing():
    """fp16 inputs whose dx stays float32 (kernels_lib.chunks.gradient_sums): the only error is the tensor
    cores' float32 accumulation over K = V, as in cuBLAS's float32 product scaled in float32, at a shape
    where cuBLAS runs one chain over K per tile as the kernel does (on the H200 at C = 2048, H = 4096,
    V = 32768 both had 3.85e-5). With few output tiles cuBLAS splits K and adds the parts: at
    C = 300, H = 520 its error was 5.7e-6 and the kernel's 3.9e-5, at C = 1100, H = 2056 1.9e-5 and 3.9e-5.
    The chain's error grows with K (1.5e-4 for both at C = H = 4096, V = 128256; cuBLAS's products over
    K slices of 4096 added in float32: 4.8e-6): the wgmma accumulator's, which a kernel promoting its
    sum every few K blocks would shed (data/measured/README.md, GPU runs of 2026-12-04)."""
    e, w, factors, scale = _operands(2048, 4096, 32768, torch.float16, seed=4)
    out = torch.full((2048, 4096), float("nan"), dtype=torch.float32, device="cuda")
    g.launch_scaled_product(out, e, w, factors, scale)
    _, ref = ab.float64_references(e, w, factors, scale)
    cublas = torch.mm(e, w, out_dtype=torch.float32) * (factors * scale)[:, None]
    mine, theirs = relative_error(out, ref), relative_error(cublas, ref)
    assert mine <= 1.05 * theirs + 1e-7 and mine < 1e-4, (mine, theirs)


@pytest.mark.gpu
def test_out_a_row_slice_of_a_larger_tensor():
    e, w, factors, scale = _operands(333, 2056, 50257, torch.bfloat16, seed=5, pad_rows=True)
    big = torch.full((1000, 2056), 7.0, dtype=torch.bfloat16, device="cuda")
    big[100:433] = float("nan")
    out = big[100:433]
    g.launch_scaled_product(out, e, w, factors, scale)
    assert (big[:100] == 7.0).all() and (big[433:] == 7.0).all(), "a row outside out was written"
    _check_against_baseline(out, e, w, factors, scale)


@pytest.mark.gpu
def test_nan_stays_in_its_row():
    e, w, factors, scale = _operands(300, 1032, 4104, torch.bfloat16, seed=6)
    factors[5] = 1.0
    e[5, 1234] = float("nan")
    out = torch.full((300, 1032), float("nan"), dtype=torch.bfloat16, device="cuda")
    g.launch_scaled_product(out, e, w, factors, scale)
    assert out[5].isnan().all()
    others = torch.arange(300, device="cuda") != 5
    assert out[others].isfinite().all()


@pytest.mark.gpu
def test_contiguous_rows_of_50257_are_refused_with_the_reason():
    e, w, factors, scale = _operands(8, 64, 50257, torch.bfloat16, seed=7)
    assert "e's rows are 100514 bytes apart" in g.gluon_unsupported_reason(e, w)
    with pytest.raises(ValueError, match="e's rows are 100514 bytes apart"):
        g.launch_scaled_product(torch.empty(8, 64, dtype=torch.bfloat16, device="cuda"), e, w, factors, scale)


@pytest.mark.gpu
def test_ab_runs_every_candidate_on_the_gpu():
    table = ab.scaled_product_ab(chunks=(256,), H=1024, V=8192, rounds=1)
    assert "error" in table and (table["error"] == "").all(), table[table.get("error", "") != ""].to_string()
    assert (table["rel_err"] < 1e-2).all()
