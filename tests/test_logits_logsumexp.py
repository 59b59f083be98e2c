"""kernels_lib.kernels.logits_logsumexp against a float64 reference.

The reference forms ``z = alpha * (x @ W.T + b)`` in float64 from the very (possibly bf16/fp16-rounded)
inputs the kernel saw, so the only error left is the kernel's fp32 accumulation: errors
``||out - ref|| / ||ref||`` are bounded by 1e-5 for every input dtype. Sizes are odd on purpose
(H not a multiple of BLOCK_K, V not a multiple of BLOCK_N, partial GROUP_M groups) and small:
without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import INTERPRETED, default_device
from kernels_lib.kernels import logits_logsumexp as module
from kernels_lib.kernels.logits_logsumexp import (
    CONFIGS,
    DEFAULT_CONFIG,
    FLAG_KEYS,
    INTERPRETED_CONFIG,
    TmaFallbackWarning,
    logits_logsumexp,
    tma_unsupported_reason,
)
from kernels_workbench.check import relative_error

DEVICE = default_device()
TOL = 1e-5
IGNORE = -100
#: Larger tiles for the larger vocabularies: fewer (slow) interpreted programs.
WIDE = dict(BLOCK_M=32, BLOCK_N=256, BLOCK_K=32)


def make(n, h, v, dtype=torch.float32, *, bias=True, target_dtype=torch.int64, seed=0):
    """x, W, b (or None) and targets with every third row ignored; logits of order a few units."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(v, h, generator=gen) / math.sqrt(h) * 3).to(DEVICE, dtype)
    b = torch.randn(v, generator=gen).to(DEVICE, dtype) if bias else None
    y = torch.randint(0, v, (n,), generator=gen)
    y[1::3] = IGNORE
    return x, w, b, y.to(DEVICE, target_dtype)


def reference(x, w, b, y, alpha):
    """(lse, target logit) in float64; the target logit 0 at ignored rows."""
    z = x.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    z = alpha * z
    lse = torch.logsumexp(z, dim=1)
    if y is None:
        return lse, None
    valid = y != IGNORE
    z_y = z.gather(1, torch.where(valid, y, 0).long()[:, None])[:, 0]
    return lse, torch.where(valid, z_y, 0.0)


def check(x, w, b, y, alpha=1.0, config=None):
    lse, t = logits_logsumexp(x, w, b, y, alpha=alpha, ignore_index=IGNORE, config=config)
    ref_lse, ref_t = reference(x, w, b, y, alpha)
    assert lse.dtype == torch.float32 and lse.shape == (x.shape[0],)
    assert torch.isfinite(lse).all(), "every row's lse is written, finite for finite inputs"
    assert relative_error(lse, ref_lse) <= TOL
    if y is None:
        assert t is None
        return
    assert t.dtype == torch.float32 and t.shape == (x.shape[0],)
    ignored = y == IGNORE
    assert (t[ignored] == 0).all(), "ignored rows' target logit is exactly 0"
    assert torch.isfinite(t).all()
    if (~ignored).any():
        assert relative_error(t[~ignored], ref_t[~ignored]) <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,h,v", [(1, 24, 1), (7, 40, 33), (37, 72, 200)])
def test_matches_float64(n, h, v, dtype):
    x, w, b, y = make(n, h, v, dtype)
    check(x, w, b, y, alpha=0.7)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64, None])
def test_bias_and_targets(bias, target_dtype):
    x, w, b, y = make(7, 40, 33, torch.bfloat16, bias=bias, target_dtype=target_dtype or torch.int64, seed=1)
    check(x, w, b, y if target_dtype else None, alpha=-1.3)


@pytest.mark.parametrize("n,h,v,config", [(37, 72, 1031, None), (37, 72, 5000, WIDE), (7, 24, 5000, WIDE)])
def test_large_vocabulary(n, h, v, config):
    x, w, b, y = make(n, h, v, torch.bfloat16, seed=2)
    check(x, w, b, y, alpha=2.5, config=config)


@pytest.mark.parametrize("group_m", [1, 2, 3, 8])
def test_grouped_order_covers_every_tile(group_m):
    """37 rows in blocks of 16: three row blocks, so groups of 2 and 8 are partial."""
    x, w, b, y = make(37, 40, 100, seed=3)
    check(x, w, b, y, config=dict(GROUP_M=group_m))


def test_large_logits_and_all_rows_ignored():
    x, w, b, y = make(37, 24, 77, seed=4)
    check(x, w, b, y, alpha=40.0)  # logits of order 100: exp would overflow unshifted
    check(x, w, b, torch.full_like(y, IGNORE))


def test_noncontiguous_inputs():
    x, w, b, y = make(7, 80, 33, seed=5)
    check(x[:, ::2], w[:, ::2], b, y)


def test_targets_outside_the_vocabulary_give_nan():
    x, w, b, y = make(7, 24, 33, seed=6)
    y[0], y[2] = 33, -5
    _, t = logits_logsumexp(x, w, b, y, ignore_index=IGNORE)
    assert t[[0, 2]].isnan().all() and t[[1, 3, 4, 5, 6]].isfinite().all()


# An all-NaN row of a tile: numpy warns in the interpreter's max and in z - m.
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_nan_in_x_row_stays_in_that_row():
    x, w, b, y = make(37, 40, 100, seed=7)
    x[5, 3] = float("nan")
    lse, t = logits_logsumexp(x, w, b, y, ignore_index=IGNORE)
    assert lse[5].isnan() and t[5].isnan()
    rest = torch.arange(37) != 5
    assert lse[rest].isfinite().all() and t[rest].isfinite().all()


@pytest.mark.parametrize("where", ["weight", "bias"])
def test_nan_in_one_class_reaches_every_row(where):
    x, w, b, y = make(37, 40, 100, seed=8)
    y[0] = 70  # rows whose target is the NaN class get a NaN target logit, the others do not
    y[2] = 10
    if where == "weight":
        w[70, 11] = float("nan")
    else:
        b[70] = float("nan")
    lse, t = logits_logsumexp(x, w, b, y, ignore_index=IGNORE)
    assert lse.isnan().all()
    assert t[0].isnan() and t[y != 70].isfinite().all()


def test_configs():
    assert DEFAULT_CONFIG in CONFIGS and not DEFAULT_CONFIG.get("TMA"), "the default is a measured pointer config"
    keys = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
    for config in (*CONFIGS, INTERPRETED_CONFIG):
        assert keys <= set(config) <= keys | set(FLAG_KEYS)
        # Hopper: the pipelined bf16 tiles fit in shared memory (228 KiB per SM).
        assert config["num_stages"] * (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * 2 <= 200 * 1024
    assert CONFIGS[0].get("TMA") and CONFIGS[0].get("PERSISTENT"), "the Hopper candidates come first"
    assert len({tuple(sorted(c.items())) for c in CONFIGS}) == len(CONFIGS), "no duplicates"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_every_config_passes_the_launchers_validation(config, dtype):
    cfg = module._config(config, dtype)
    assert {k: cfg[k] for k in config} == config
    assert all(cfg[k] is bool(config.get(k, False)) for k in FLAG_KEYS)


# --- The TMA (Hopper) kernel: Triton's interpreter runs tensor descriptors, so its numerics are checked here
# with small tiles; INTERPRETED_NUM_SMS = 3 persistent programs take several tiles each.

TMA_VARIANTS = [dict(TMA=True), dict(TMA=True, PERSISTENT=True), dict(TMA=True, WARP_SPECIALIZE=True),
                dict(TMA=True, PERSISTENT=True, WARP_SPECIALIZE=True)]


@pytest.fixture
def tma_only(monkeypatch):
    """The TMA kernel must run: no fallback warning, and the pointer kernel refuses to launch."""

    class Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the pointer kernel ran instead of the TMA kernel")

    monkeypatch.setattr(module, "logits_lse_partials_kernel", Refuse())
    with warnings.catch_warnings():
        warnings.simplefilter("error", TmaFallbackWarning)
        yield


@pytest.mark.skipif(not INTERPRETED, reason="small-tile numerics run in the interpreter (on a GPU: the benchmark)")
@pytest.mark.parametrize("variant", TMA_VARIANTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,h,v", [(1, 24, 1), (37, 72, 200)])
def test_tma_kernel_matches_float64(n, h, v, dtype, variant, tma_only):
    x, w, b, y = make(n, h, v, dtype, seed=9)
    check(x, w, b, y, alpha=0.7, config=dict(INTERPRETED_CONFIG, **variant))


STORE_VARIANTS = [dict(TMA=True, TMA_STORE=True), dict(TMA=True, PERSISTENT=True, TMA_STORE=True)]


@pytest.mark.parametrize("layout", ["row-major", "class-major"])
@pytest.mark.parametrize("aligned", [True, False], ids=["16-byte rows", "odd rows"])
@pytest.mark.parametrize("variant", [None] + (TMA_VARIANTS[:2] + STORE_VARIANTS if INTERPRETED else []), ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,h,v", [(1, 24, 33), (37, 72, 200), (40, 24, 77)])
def test_logits_out_holds_the_logits(n, h, v, dtype, variant, aligned, layout):
    """``logits_out`` (rows of a wider, NaN-poisoned buffer; or, class-major, the ``.t()`` of such a
    ``V × N`` buffer) gets every logit, rounded to the inputs' dtype, and nothing beyond its ``(N, V)``;
    lse and the target logits are those of the stored logits. Rows of a multiple of 16 bytes take the
    TMA store where it is asked for (where the inner size fills whole 16 bytes); odd rows the masked
    stores."""
    x, w, b, y = make(n, h, v, dtype, seed=11)
    outer, inner = (n, v) if layout == "row-major" else (v, n)
    width = (inner + 5 + 7) // 8 * 8 if aligned else inner + 5 + (inner % 2 == 0)
    wide = torch.full((outer + 2, width), float("nan"), dtype=dtype, device=DEVICE)
    out = wide[1 : outer + 1, :inner]
    out = out if layout == "row-major" else out.t()
    config = None if variant is None else dict(INTERPRETED_CONFIG, **variant)
    lse, t = logits_logsumexp(x, w, b, y, alpha=0.7, ignore_index=IGNORE, config=config, logits_out=out)
    z = 0.7 * (x.double() @ w.double().T + b.double())
    assert not out.isnan().any(), "every logit written"
    assert relative_error(out, z) <= (TOL if dtype == torch.float32 else 2**-8)
    assert wide[0].isnan().all() and wide[-1].isnan().all() and wide[:, inner:].isnan().all(), "nothing outside"
    # lse and the target logit are those of the logits as stored (their softmax sums to 1)
    stored = out.double()
    assert relative_error(lse, torch.logsumexp(stored, 1)) <= TOL
    valid = y != IGNORE
    assert torch.equal(t[valid], stored[valid].gather(1, y[valid].long()[:, None])[:, 0].float()) and (t[~valid] == 0).all()


@pytest.mark.skipif(not INTERPRETED, reason="small-tile numerics run in the interpreter")
@pytest.mark.parametrize("group_m", [1, 3])
@pytest.mark.parametrize("bias,with_target", [(False, True), (True, False)])
def test_tma_kernel_bias_targets_groups(bias, with_target, group_m, tma_only):
    x, w, b, y = make(37, 40, 100, torch.bfloat16, bias=bias, seed=10)
    check(x, w, b, y if with_target else None, alpha=-1.3, config=dict(TMA=True, PERSISTENT=True, GROUP_M=group_m))


@pytest.mark.skipif(not INTERPRETED, reason="small-tile numerics run in the interpreter")
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("variant", TMA_VARIANTS[:2], ids=str)
def test_tma_kernel_nan_and_out_of_range_targets(variant, tma_only):
    x, w, b, y = make(37, 40, 100, seed=11)
    x[5, 3] = float("nan")
    y[0], y[2], y[3] = 100, -5, 70
    b[70] = float("nan")
    lse, t = logits_logsumexp(x, w, b, y, ignore_index=IGNORE, config=variant)
    assert lse.isnan().all(), "a NaN class reaches every row"
    assert t[[0, 2, 3, 5]].isnan().all()
    assert (t[1::3] == 0).all() and t[[6, 8, 9]].isfinite().all()
    x[5, 3] = 0.0
    b[70] = 0.0
    check(x, w, b, y.clamp(min=0) % 100, config=variant)


def test_tma_reason_none_for_aligned_inputs():
    x, w, _, _ = make(7, 40, 33, torch.bfloat16)
    assert tma_unsupported_reason(x, w) is None


@pytest.mark.parametrize(
    "dtype, h, cut, match",
    [
        (torch.bfloat16, 20, 0, r"x's rows are 40 bytes, not a multiple of 16 \(H = 20 must be a multiple of 8"),
        (torch.float32, 18, 0, r"rows are 72 bytes, not a multiple of 16 \(H = 18 must be a multiple of 4"),
        (torch.float32, 24, 1, r"x's data pointer \(0x[0-9a-f]+\) is not 16-byte aligned"),
    ],
)
def test_tma_falls_back_with_its_reason(dtype, h, cut, match):
    """Inputs TMA cannot take: the pointer kernel runs (same results) and a warning names the reason."""
    x, w, b, y = make(7, h, 33, dtype, seed=12)
    if cut:  # the same values at an address 4 bytes past a 16-byte boundary, contiguous
        buffer = torch.empty(x.numel() + 4, dtype=dtype, device=DEVICE)[cut:cut + x.numel()]
        x = buffer.view(x.shape).copy_(x)
        assert x.is_contiguous() and x.data_ptr() % 16
    assert tma_unsupported_reason(x, w) is not None
    with pytest.warns(TmaFallbackWarning, match=match):
        check(x, w, b, y, config=dict(TMA=True, PERSISTENT=True))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(x=torch.zeros(4)), "x must have 2"),
        (dict(x=torch.zeros(4, 8, dtype=torch.int64)), "x must be a floating"),
        (dict(x=torch.zeros(0, 8)), "x must not be empty"),
        (dict(weight=torch.zeros(5, 9)), "weight must have shape"),
        (dict(weight=torch.zeros(5)), "weight must have 2"),
        (dict(weight=torch.zeros(5, 8, dtype=torch.bfloat16)), "weight must have the dtype of x"),
        (dict(bias=torch.zeros(4)), r"bias must have shape \(V,\)"),
        (dict(bias=torch.zeros(5, dtype=torch.float16)), "bias must have the dtype of weight"),
        (dict(target=torch.zeros(3, dtype=torch.int64)), "target must have shape"),
        (dict(target=torch.zeros(4)), "target must be an int64 or int32"),
        (dict(x=[[0.0] * 8] * 4), "x must be a torch.Tensor"),
        (dict(alpha=float("inf")), "alpha must be a finite real"),
        (dict(ignore_index=1.5), "ignore_index must be an int"),
        (dict(config=dict(BLOCK_Q=16)), "config must be a dict"),
        (dict(config=dict(BLOCK_N=48)), r"config\['BLOCK_N'\] must be"),
        (dict(config=dict(num_warps=0)), r"config\['num_warps'\] must be"),
        (dict(config=dict(TMA=1)), r"config\['TMA'\] must be a bool"),
        (dict(config=dict(PERSISTENT=True)), r"config\['PERSISTENT'\] needs config\['TMA'\]"),
        (dict(config=dict(WARP_SPECIALIZE=True)), r"config\['WARP_SPECIALIZE'\] needs config\['TMA'\]"),
        (dict(config=dict(TMA_STORE=True)), r"config\['TMA_STORE'\] needs config\['TMA'\]"),
        (dict(config=dict(TMA=True, BLOCK_N=512)), r"config\['BLOCK_N'\] must be <= 256 with TMA"),
        (dict(logits_out=torch.zeros(4, 4)), r"logits_out must have shape \(N, V\)"),
        (dict(logits_out=torch.zeros(4, 5, dtype=torch.bfloat16)), "logits_out must have the dtype of x"),
        (dict(logits_out=torch.zeros(4, 10)[:, ::2]), "logits_out must have unit stride along V, or along N"),
        (dict(logits_out=[[0.0] * 5] * 4), "logits_out must be a torch.Tensor"),
    ],
)
def test_bad_inputs_name_the_argument(change, match):
    args = dict(x=torch.zeros(4, 8), weight=torch.zeros(5, 8), bias=None, target=None, alpha=1.0, ignore_index=-100,
                config=None, logits_out=None)
    args.update(change)
    # Moved keeping each tensor's strides (.to() would make a strided view contiguous).
    args = {k: torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=DEVICE).copy_(a)
            if isinstance(a, torch.Tensor) else a for k, a in args.items()}
    with pytest.raises((TypeError, ValueError), match=match):
        logits_logsumexp(args.pop("x"), args.pop("weight"), args.pop("bias"), args.pop("target"), **args)
