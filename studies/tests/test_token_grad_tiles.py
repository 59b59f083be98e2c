"""The tiled gradient pass (``studies/kernels/token_grad_tiles.py``) against the library's pass and float64.

It must write exactly the library's ``dz`` (same formula per element: bitwise, in every dtype), its column sums
must be the sums of the stored ``dz``, and a sequence loss with the arm in place must match the float64
reference, the bias gradient included (which the arm takes from the column sums instead of ``dz.sum(0)``).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels_lib import fused_linear_dpo, fused_linear_kto, reference
from kernels_lib.kernels.token_logprobs import launch_token_logprobs, launch_token_logprobs_grad
from kernels_workbench.check import TOLERANCE, relative_error
from studies.bench.arms import constants_set
from studies.kernels import token_grad_tiles as tg
from studies.kernels.token_grad_tiles import arm, launch_token_grad_tiles

IGNORE = -100


def _chunk(dtype, rows, n_cols, second, seed, outside=False):
    g = torch.Generator().manual_seed(seed)
    z = (3 * torch.randn(rows, n_cols, generator=g)).to(dtype)
    y = torch.randint(0, n_cols, (rows,), generator=g)
    y[1] = IGNORE
    if outside:  # another shard's targets: global ids past this shard's columns
        y[2] = n_cols + 5
    y2 = None
    if second:
        y2 = torch.randint(0, n_cols, (rows,), generator=g)
        y2[3], y2[4] = y[3], IGNORE  # y' = y on one row, ignored on another
    lse, logp = torch.empty(rows), torch.empty(rows)
    logp2 = None if y2 is None else torch.empty(rows)
    launch_token_logprobs(z, y, lse=lse, logp=logp, ignore_index=IGNORE, target2=y2, logp2=logp2)
    return z, y, y2, lse, logp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("second", [False, True], ids=["one target", "two targets"])
@pytest.mark.parametrize("rows_per_weight", [1, 3])
def test_tiled_pass_writes_the_library_dz_and_its_column_sums(dtype, second, rows_per_weight):
    """Rows 21 (not a multiple of BLOCK_R = 8) and V = 203 (not a multiple of BLOCK_V = 64), an ignored row."""
    rows, n_cols = 21, 203
    z, y, y2, lse, logp = _chunk(dtype, rows, n_cols, second, seed=rows_per_weight + 7 * second)
    g = torch.Generator().manual_seed(11)
    w = torch.randn(rows // rows_per_weight, generator=g)
    w2 = torch.randn(rows // rows_per_weight, generator=g) if second else None
    want, got = z.clone(), z.clone()
    options = dict(lse=lse, logp=logp, weight=w, rows_per_weight=rows_per_weight, ignore_index=IGNORE, target2=y2,
                   weight2=w2)
    launch_token_logprobs_grad(want, y, **options)
    sums = launch_token_grad_tiles(got, y, **options, column_sums=True, tile=(8, 64, 4))
    assert torch.equal(got, want), f"{dtype}: the tiled dz differs from the library's by {(got.float() - want.float()).abs().max()}"
    exact = want.double().sum(0)
    err = float((sums.double() - exact).norm() / exact.norm())
    assert sums.dtype == torch.float32 and sums.shape == (n_cols,)
    assert err < 1e-6, f"{dtype}: column sums off the sums of the stored dz by {err:.2e}"


def test_tiled_pass_on_a_shard_leaves_other_shards_targets_alone():
    """With ``col_offset`` the targets are global: a row whose target another shard owns gets -w p only."""
    z, y, _, lse, logp = _chunk(torch.float32, 9, 50, False, seed=5, outside=True)
    w = torch.randn(9)
    want, got = z.clone(), z.clone()
    options = dict(lse=lse, logp=logp, weight=w, rows_per_weight=1, ignore_index=IGNORE, col_offset=0)
    launch_token_logprobs_grad(want, y, **options)
    assert launch_token_grad_tiles(got, y, **options, tile=(4, 16, 1)) is None
    assert torch.equal(got, want)


def test_nan_logits_give_nan_sums():
    z, y, _, lse, logp = _chunk(torch.float32, 6, 40, False, seed=2)
    z[0, 3] = float("nan")
    sums = launch_token_grad_tiles(z, y, lse=lse, logp=logp, weight=torch.ones(6), rows_per_weight=1,
                                   ignore_index=IGNORE, column_sums=True, tile=(4, 16, 1))
    assert math.isnan(float(sums[3])) and not torch.isnan(sums[:3]).any()


def _kto_tensors(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    B, T, H, V = 3, 5, 16, 71
    x = torch.randn(B, T, H, generator=g, dtype=dtype).requires_grad_()
    weight = (0.3 * torch.randn(V, H, generator=g, dtype=dtype)).requires_grad_()
    bias = (0.1 * torch.randn(V, generator=g, dtype=dtype)).requires_grad_()
    target = torch.randint(0, V, (B, T), generator=g)
    target[0, 2] = target[2, 4] = IGNORE
    labels = torch.tensor([True, False, True])
    ref = dict(ref_x=torch.randn(B, T, H, generator=g, dtype=dtype), ref_weight=0.3 * torch.randn(V, H, generator=g, dtype=dtype))
    return (x, weight, target, labels), bias, ref


def _loss_and_grads(fn, args, bias, ref, **options):
    for t in (args[0], args[1], bias):
        t.grad = None
    out = fn(*args, 0.05, bias=bias, **ref, **options)
    out.loss.backward()
    return out.loss.detach(), [t.grad.clone() for t in (args[0], args[1], bias)]


@pytest.mark.parametrize("chunk_size", [5, 10])
def test_kto_with_the_arm_matches_float64_bias_gradient_included(chunk_size):
    """KTO with a bias over one or several chunks: the arm's bias gradient comes from the column sums, and its
    loss and every gradient are within float32's tolerance of the float64 reference."""
    args, bias, ref = _kto_tensors(seed=chunk_size)
    calls = []
    original = tg.launch_token_grad_tiles

    def counted(*a, **k):
        calls.append(k["column_sums"])
        return original(*a, **k)

    with constants_set({**arm((4, 32, 1)), "studies.kernels.token_grad_tiles": {"launch_token_grad_tiles": counted}}):
        loss, grads = _loss_and_grads(fused_linear_kto, args, bias, ref, ignore_index=IGNORE, chunk_size=chunk_size)
    assert calls and all(calls), f"the arm's pass ran {len(calls)} times, column sums {calls}: the library's ran instead"
    args64 = tuple(t.detach().double().requires_grad_() if t.is_floating_point() else t for t in args)
    bias64 = bias.detach().double().requires_grad_()
    ref64 = {k: v.double() for k, v in ref.items()}
    want, want_grads = _loss_and_grads(reference.fused_linear_kto, args64, bias64, ref64, ignore_index=IGNORE)
    errors = {"loss": relative_error(loss, want)}
    errors.update({n: relative_error(g, w) for n, g, w in zip(("dx", "dW", "db"), grads, want_grads)})
    assert all(e <= TOLERANCE[torch.float32] for e in errors.values()), f"errors {errors}"


def test_dpo_without_a_bias_runs_the_arm_without_column_sums():
    """No bias: the arm's pass runs without partial sums, and the loss and gradients equal the library's."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 6, 16, generator=g).requires_grad_()
    weight = (0.3 * torch.randn(50, 16, generator=g)).requires_grad_()
    target = torch.randint(0, 50, (4, 6), generator=g)
    ref = dict(ref_x=torch.randn(4, 6, 16, generator=g), ref_weight=torch.randn(50, 16, generator=g))

    def run():
        x.grad = weight.grad = None
        out = fused_linear_dpo(x, weight, target, **ref, chunk_size=12)
        out.loss.backward()
        return [out.loss.detach(), x.grad.clone(), weight.grad.clone()]

    want = run()
    with constants_set(arm((4, 16, 1))):
        got = run()
    for name, a, b in zip(("loss", "dx", "dW"), got, want):
        assert relative_error(a, b) <= 1e-6, f"{name}: {relative_error(a, b):.2e} off the library's"


@pytest.mark.parametrize("text", ["32x512", "32x512w3", "ax512w4", "0x512w4"])
def test_ab_script_refuses_a_malformed_tile(text):
    from studies.token_grad_tiles_ab import parse_tile

    with pytest.raises(ValueError, match="--tiles"):
        parse_tile(text)


def test_token_grad_tiles_ab_script_small_path(tmp_path):
    """The A/B at CPU size: a row per arm and point, the library's pass restored after, the same outputs."""
    import pandas as pd

    import kernels_lib._sequence_logprobs as seq
    from studies import token_grad_tiles_ab as script

    before = seq.two_pass_gradient
    args = ["--out", str(tmp_path), "--size", "small", "--losses", "kto_loss", "--tiles", "8x64w2", "--samples", "2"]
    assert script.main(args) == 0
    assert seq.two_pass_gradient is before, "the A/B must leave the library's gradient pass in place"
    rows = pd.read_csv(tmp_path / script.FILE)
    assert len(rows) == 4 and list(rows.kernel_provider) == ["library", "8x64w2"] * 2
    assert rows.bias.all() and (rows.rel_diff < 1e-5).all() and (rows.ms_50 > 0).all()


_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from studies.kernels import token_grad_tiles as m
sig = {"logits_ptr": "*bf16", "stride_row": "i64", "target_ptr": "*i64", "target2_ptr": "*i64", "lse_ptr": "*fp32",
       "one_minus_p_ptr": "*fp32", "weight_ptr": "*fp32", "weight2_ptr": "*fp32", "partial_ptr": "*fp32",
       "n_rows": "i32", "rows_per_weight": "i32", "n_cols": "i32", "col_offset": "i32", "ignore_index": "i32"}
out = []
block_r, block_v, warps = m.TILE
for second, sums in ((False, True), (True, True)):
    const = dict(HAS_SECOND=second, WITH_SUMS=sums, BLOCK_R=block_r, BLOCK_V=block_v)
    s = dict(sig, **{n: "constexpr" for n in const})
    k = triton.compile(ASTSource(m.token_grad_tiles_kernel, s, constexprs={(list(s).index(n),): v for n, v in const.items()}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    out.append(dict(second=second, ex2=k.asm["ptx"].count("ex2.approx"), cubin=len(k.asm["cubin"])))
print("RESULT" + json.dumps(out))
"""


def test_the_default_tile_compiles_for_sm90():
    """Triton's compiler (not the interpreter, in a subprocess) builds the tiled pass for sm_90 at the default tile,
    with one and two targets and the column sums: what the A/B launches first on a GPU."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = json.loads(done.stdout.split("RESULT")[-1])
    assert len(cases) == 2 and all(c["ex2"] > 0 and c["cubin"] > 0 for c in cases), cases
