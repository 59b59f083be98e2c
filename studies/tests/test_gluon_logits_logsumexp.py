"""The Gluon stage of the log-sum-exp (studies.kernels.gluon_logits_logsumexp).

On every machine: it compiles for ``sm_90a`` (Gluon does not run in Triton's interpreter, so CI's CPU
compiles it, in a subprocess with ``TRITON_INTERPRET=0``) and holds the Hopper instructions it is
written for; a config that asks for it where it cannot run says why and takes the ``tl.*`` kernel.
On the H200 (marker ``gpu``): its log-sum-exp and target logits against float64 from the very
(bf16/fp16-rounded) inputs it saw, within the 1e-5 of ``tests/test_logits_logsumexp.py`` (the fp32
accumulation is the only error left), at odd shapes (N = 1, V = 50257, H not a power of two), with
ignored rows, a bias, negative and fractional scales, outputs poisoned, NaN rows kept to themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib.kernels import logits_logsumexp as module
from kernels_workbench.check import relative_error
from studies.kernels import gluon_logits_logsumexp as gluon_stage
from studies.kernels.gluon_logits_logsumexp import GluonFallbackWarning, logits_logsumexp
from test_logits_logsumexp import IGNORE, TOL, make, reference
from two_heads import poisoned_allocations  # noqa: F401  (a fixture)

GLUON = dict(GLUON=True)


def check(x, w, b, y, alpha=1.0, config=None):
    """The study's launcher against float64, as ``tests/test_logits_logsumexp.py`` checks the library's."""
    lse, t = logits_logsumexp(x, w, b, y, alpha=alpha, ignore_index=IGNORE, config=config)
    ref_lse, ref_t = reference(x, w, b, y, alpha)
    assert lse.dtype == torch.float32 and lse.shape == (x.shape[0],) and torch.isfinite(lse).all()
    assert relative_error(lse, ref_lse) <= TOL
    if y is None:
        assert t is None
        return
    ignored = y == IGNORE
    assert (t[ignored] == 0).all(), "ignored rows' target logit is exactly 0"
    assert torch.isfinite(t).all()
    if (~ignored).any():
        assert relative_error(t[~ignored], ref_t[~ignored]) <= TOL

_COMPILE = r"""
import json, sys, torch
from studies.kernels import gluon_logits_logsumexp as g
out = []
for case in json.loads(sys.argv[1]):
    # torch dtypes do not go through JSON: they come as names.
    case = {k: getattr(torch, v) if k.endswith("dtype") else v for k, v in case.items()}
    kernel = g.compile_for_sm90(case.pop("dtype"), **case)
    ptx = kernel.asm["ptx"]
    out.append(dict(shared=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                    wgmma=ptx.count("wgmma.mma_async"), tma=ptx.count("cp.async.bulk.tensor"),
                    setmaxnreg=ptx.count("setmaxnreg"), waits=ptx.count("mbarrier.try_wait"),
                    target=kernel.metadata.target.arch))
print("RESULT" + json.dumps(out))
"""

COMPILE_CASES = [
    dict(dtype="bfloat16", has_bias=True, has_target=True, even_n=False, alpha_positive=True),
    dict(dtype="float16", has_bias=False, has_target=False, even_n=True, alpha_positive=False),
    dict(dtype="bfloat16", has_bias=False, has_target=True, even_n=True, alpha_positive=True, target_dtype="int32"),
    # the first case with the consumers taking turns (PINGPONG): two more barrier waits, one per consumer
    dict(dtype="bfloat16", has_bias=True, has_target=True, even_n=False, alpha_positive=True, config={"PINGPONG": True}),
]


def test_compiles_for_sm90a():
    """Triton's compiler turns the kernel into sm_90a code on any machine: the TMA loads, the wgmma,
    the partitions' register budgets, and shared memory within the H200's 227 KiB per block."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(COMPILE_CASES)], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert done.returncode == 0 and lines, f"compilation failed:\n{done.stderr[-4000:]}"
    results = json.loads(lines[-1][len("RESULT"):])
    assert len(results) == len(COMPILE_CASES)
    for case, result in zip(COMPILE_CASES, results):
        assert result["target"] == 90, case
        assert result["wgmma"] > 0, f"no wgmma in the PTX of {case}"
        assert result["tma"] > 0, f"no TMA copy in the PTX of {case}"
        assert result["setmaxnreg"] > 0, f"no register budgets in the PTX of {case}"
        # Two consumer warpgroups and two loader warps (rounded up to whole warpgroups).
        assert result["num_warps"] >= 10
        cfg = gluon_stage.DEFAULT_CONFIG
        ring = 2 * cfg["STAGES"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * 2
        assert ring <= result["shared"] <= 227 * 1024, result
    assert results[3]["waits"] == results[0]["waits"] + 2, (results[0], results[3])


def test_a_gluon_config_that_cannot_run_says_why_and_takes_the_tl_kernel():
    """float32 inputs: Gluon's reason is the interpreter on the CPU, the dtype on the H200; either way
    the warning names it and the numbers are the tl.* kernel's."""
    x, w, b, y = make(37, 72, 200, torch.float32, seed=11)
    reason = gluon_stage.gluon_unsupported_reason(x, w)
    assert reason
    with pytest.warns(GluonFallbackWarning, match="asks for the Gluon kernel") as caught:
        check(x, w, b, y, alpha=0.7, config=GLUON)
    assert reason in str(caught[0].message)


def test_logits_out_is_not_the_gluon_kernels():
    x, w, _, _ = make(7, 40, 33, torch.bfloat16, seed=12)
    assert "logits_out" in gluon_stage.gluon_unsupported_reason(x, w, logits_out=True)


@pytest.mark.parametrize("config, match", [
    (dict(GLUON=True, TMA=True), "do not apply to the Gluon kernel"),
    (dict(GLUON=True, num_stages=0), "num_stages"),
    (dict(GLUON=True, PINGPONG="yes"), "must be a bool"),
])
def test_bad_gluon_configs_name_the_key(config, match):
    x, w, b, y = make(7, 40, 33, torch.bfloat16, seed=13)
    with pytest.raises(ValueError, match=match):
        logits_logsumexp(x, w, b, y, config=config)


def test_the_library_takes_no_gluon_config():
    """The library's launcher knows nothing of Gluon: a GLUON key is refused there, naming the keys it takes."""
    x, w, b, y = make(7, 40, 33, torch.bfloat16, seed=13)
    with pytest.raises(ValueError, match="keys among"):
        module.logits_logsumexp(x, w, b, y, config=GLUON)


# --- On the H200: the numbers.

def _gluon_only(monkeypatch):
    """The Gluon kernel must run: no fallback warning, and the tl.* partial kernels refuse to launch."""

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("a tl.* partials kernel ran instead of the Gluon kernel")

    monkeypatch.setattr(module, "logits_lse_partials_kernel", Refuse())
    monkeypatch.setattr(module, "logits_lse_partials_tma_kernel", Refuse())


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,v,dtype,bias,alpha", [
    (1, 264, 50257, torch.bfloat16, True, 1.0),
    (333, 520, 50257, torch.float16, True, -0.7),
    (1000, 128, 32768, torch.bfloat16, False, 1 / 0.7),
    (4096, 4096, 128256, torch.bfloat16, False, 1.0),
    (257, 2056, 151936, torch.bfloat16, True, 2.5),
])
def test_gluon_kernel_matches_float64(n, h, v, dtype, bias, alpha, monkeypatch, poisoned_allocations):
    x, w, b, y = make(n, h, v, dtype, bias=bias, seed=n)
    _gluon_only(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GluonFallbackWarning)
        check(x, w, b, y, alpha=alpha, config=GLUON)
        check(x, w, b, None, alpha=alpha, config=GLUON)


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,v,dtype,bias,alpha", [
    (1, 264, 50257, torch.bfloat16, True, 1.0),  # one row block: some programs' second consumer has no tile
    (333, 520, 50257, torch.float16, True, -0.7),
    (4096, 4096, 128256, torch.bfloat16, False, 1.0),
])
def test_pingpong_gluon_kernel_matches_float64(n, h, v, dtype, bias, alpha, monkeypatch, poisoned_allocations):
    """The consumers taking turns (``PINGPONG``) order the MMAs only: the same numbers."""
    x, w, b, y = make(n, h, v, dtype, bias=bias, seed=n + 1)
    _gluon_only(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GluonFallbackWarning)
        check(x, w, b, y, alpha=alpha, config=dict(GLUON=True, PINGPONG=True))


@pytest.mark.gpu
def test_gluon_kernel_keeps_nan_to_its_row_and_out_of_range_targets_nan(monkeypatch):
    x, w, b, y = make(300, 136, 1000, torch.bfloat16, seed=14)
    x[5, 3] = float("nan")
    y[0], y[2] = 1000, -5
    _gluon_only(monkeypatch)
    lse, t = logits_logsumexp(x, w, b, y, ignore_index=IGNORE, config=GLUON)
    assert lse[5].isnan() and t[5].isnan()
    assert t[[0, 2]].isnan().all()
    rest = torch.ones(300, dtype=torch.bool, device=x.device)
    rest[[0, 2, 5]] = False
    assert lse[torch.arange(300, device=x.device) != 5].isfinite().all() and t[rest].isfinite().all()
