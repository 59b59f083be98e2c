"""The measurement side of fused linear cross-entropy: spec, providers, floors, dial, precision,
analysis, the speed-vs-memory chart, and the H200 script's CPU paths.

Sizes are tiny (kernels through Triton's interpreter on a machine without a GPU). The peers' CUDA
adapters are exercised with stand-in modules that record how they are called.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch

import kernels_lib
from kernels_lib import default_device, reference
from kernels_lib.workbench import charts, data
from kernels_lib.workbench.bench import analysis, cli
from kernels_lib.workbench.bench import flce_studies
from kernels_lib.workbench.bench import fused_linear_cross_entropy as flce
from kernels_lib.workbench.bench import torch_lce as torch_lce_module
from kernels_lib.workbench.bench.registry import get_spec, registered_losses
from kernels_lib.workbench.bench.sweep import MEASURED_COLUMNS, available_providers, run_sweep
from kernels_lib.workbench.check import assert_checks_pass, check_against_reference

DEVICE = default_device()
ON_CPU = DEVICE.type == "cpu"
needs_cpu = pytest.mark.skipif(not ON_CPU, reason="CPU-machine behaviour (no CUDA: the peers cannot run)")
TINY = {"N": 32, "H": 16, "V": 67}
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "flce_dial_precision_stages.py"


# --------------------------------------------------------------------------- spec and inputs


def test_registered_with_presets():
    assert "fused_linear_cross_entropy" in registered_losses()
    spec = get_spec("fused_linear_cross_entropy")
    assert list(spec.providers) == [
        "kernels_lib", "kernels_lib[accurate=True]", "torch", "liger", "cce", "liger_sm90", "quack",
        "torch_lce", "torch_lce[acc_policy=accurate]", "three_matmuls",
    ]
    assert spec.baseline == "torch"
    assert spec.published == {
        "x_name": "BT", "x_label": "tokens", "x_values": [4096, 8192, 16384],
        "sizes": {"H": 4096, "V": 128256}, "dtype": torch.bfloat16,
    }
    assert spec.small["x_name"] == "BT" and spec.small["dtype"] == torch.bfloat16
    assert max(spec.small["x_values"]) * spec.small["sizes"]["V"] < 10**5  # interpreter-sized


def test_make_inputs_shapes_grads_and_ignored_rows():
    options = {"reduction": "sum", "ignore_fraction": 0.25, "label_smoothing": 0.1}
    inputs = flce.make_inputs(TINY, torch.bfloat16, DEVICE, options, seed=3)
    x, weight, target, bias = inputs.args
    assert x.shape == (32, 16) and weight.shape == (67, 16) and bias is None
    assert x.dtype == weight.dtype == torch.bfloat16 and target.dtype == torch.int64
    assert x.requires_grad and weight.requires_grad and inputs.grad_inputs == [x, weight]
    assert (target == -100).sum().item() == 8
    valid = target[target != -100]
    assert ((valid >= 0) & (valid < 67)).all()
    assert inputs.kwargs == {"reduction": "sum", "label_smoothing": 0.1}  # data options consumed
    again = flce.make_inputs(TINY, torch.bfloat16, DEVICE, options, seed=3)
    assert torch.equal(again.args[0], x) and torch.equal(again.args[2], target)


def test_make_inputs_bias_and_bt_axis():
    inputs = flce.make_inputs({"BT": 5, "H": 8, "V": 11}, torch.float32, DEVICE, {"bias": True, "ignore_index": -1})
    x, weight, target, bias = inputs.args
    assert x.shape == (5, 8) and bias.shape == (11,) and bias.requires_grad
    assert inputs.grad_inputs == [x, weight, bias]
    assert inputs.kwargs == {"ignore_index": -1}


@pytest.mark.parametrize("mode,products", [("forward", 1), ("forward_no_grad", 1), ("backward", 2), ("full", 3)])
def test_flops_counts_the_matmuls(mode, products):
    assert flce.flops({"N": 8192, "H": 4096, "V": 128256}, mode) == products * 2 * 8192 * 4096 * 128256
    assert flce.flops({"BT": 3, "H": 5, "V": 7}, mode) == products * 2 * 3 * 5 * 7


def test_matmul_floor_ms_as_in_spec():
    # SPEC §4: at N = 8192 one logits matmul is 8.6 TFLOP; full >= 38 ms at 680 TFLOP/s.
    sizes = {"N": 8192, "H": 4096, "V": 128256}
    assert flce.flops(sizes, "forward_no_grad") / 1e12 == pytest.approx(8.6, abs=0.05)
    assert flce.matmul_floor_ms(sizes, "full", 680.0) == pytest.approx(38.0, abs=0.1)


@pytest.mark.parametrize("dtype,item", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_bytes_moved(dtype, item):
    n, h, v = 4096, 4096, 128256
    reads = (n * h + v * h) * item + n * 8
    sizes = {"BT": n, "H": h, "V": v}
    assert flce.bytes_moved(sizes, dtype, "forward_no_grad") == reads
    assert flce.bytes_moved(sizes, dtype, "forward") == reads
    assert flce.bytes_moved(sizes, dtype, "full") == reads + (n * h + v * h) * item


# --------------------------------------------------------------------------- providers


def test_variant_names_and_bound_options():
    assert flce.variant_name({}) == "kernels_lib"
    assert flce.variant_name({"chunk_size": 8, "accurate": False}) == "kernels_lib[chunk_size=8 accurate=False]"
    provider = flce.kernels_lib_variant(chunk_size=8, accurate=False)
    assert provider.name == "kernels_lib[chunk_size=8 accurate=False]"
    inputs = flce.make_inputs(TINY, torch.float32, DEVICE, {"ignore_fraction": 0.1})
    got = provider.load()(*inputs.args, **inputs.kwargs)
    want = kernels_lib.fused_linear_cross_entropy(*inputs.args, chunk_size=8, accurate=False)
    assert torch.equal(got, want)


@needs_cpu
def test_peers_skipped_on_cpu_naming_cuda():
    loaded, skipped = available_providers("fused_linear_cross_entropy")
    torch_lce = set(flce.TORCH_LCE_POLICIES)
    has_torch_lce = _torch_lce_loads()
    assert set(loaded) == {"kernels_lib", "kernels_lib[accurate=True]", "torch", flce.FLOOR} | (torch_lce if has_torch_lce else set())
    assert set(skipped) == {"liger", "cce", "liger_sm90", "quack"} | (set() if has_torch_lce else torch_lce)
    assert all("CUDA" in why for name, why in skipped.items() if name not in torch_lce)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_floor_provider_is_the_three_matmuls_alone(dtype):
    """``three_matmuls``: forward the logits product (its scalar one logit), backward dx = z W and
    dW = z^T x with the logits buffer as dz; nothing else, so its time is the floor of ``full``."""
    fn = flce.PROVIDERS[flce.FLOOR].load()
    inputs = flce.make_inputs({"N": 37, "H": 19, "V": 1031}, dtype, DEVICE, {"ignore_fraction": 0.1, "bias": True})
    x, weight, target, bias = inputs.args
    out = fn(*inputs.args, reduction="sum")
    z = (x @ weight.T).detach()
    assert out.dtype == torch.float32 and out.item() == z[0, 0].float().item()
    out.backward()
    assert torch.equal(x.grad, z @ weight.detach()) and torch.equal(weight.grad, z.T @ x.detach())
    assert bias.grad is None  # the bias vector is not part of the floor
    with torch.no_grad():
        assert fn(x.reshape(1, 37, 19), weight, target.reshape(1, 37)).item() == out.item()
    with pytest.raises(NotImplementedError, match="loss only"):
        fn(*inputs.args, return_z_loss=True)


needs_torch_lce = pytest.mark.skipif(
    not hasattr(torch.nn.functional, "linear_cross_entropy"), reason="torch < 2.13 has no F.linear_cross_entropy"
)


@needs_torch_lce
@pytest.mark.parametrize("name,policy", [("torch_lce", "auto"), ("torch_lce[acc_policy=accurate]", "accurate")])
def test_torch_lce_provider_is_torchs_chunked_function(monkeypatch, name, policy):
    """The provider calls F.linear_cross_entropy with LinearCrossEntropyOptions(acc_policy=...), rows
    flattened, our options mapped; its loss and gradients are ours to float32 rounding."""
    calls = []
    real = torch.nn.functional.linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear_cross_entropy", spy)
    fn = flce.PROVIDERS[name].load()
    inputs = flce.make_inputs(TINY, torch.float32, DEVICE, {"ignore_fraction": 0.2, "bias": True, "reduction": "sum"})
    x, weight, target, bias = inputs.args
    got = fn(*inputs.args, **inputs.kwargs)
    options = calls[-1]["options"]
    assert isinstance(options, torch.nn.LinearCrossEntropyOptions) and options.acc_policy == policy
    assert calls[-1]["reduction"] == "sum" and calls[-1]["ignore_index"] == -100 and calls[-1]["linear_bias"] is bias
    got_grads = torch.autograd.grad(got, inputs.grad_inputs)
    want = kernels_lib.fused_linear_cross_entropy(*inputs.args, reduction="sum")
    want_grads = torch.autograd.grad(want, inputs.grad_inputs)
    assert torch.allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-6)
    per_row = fn(x.reshape(4, 8, 16), weight, target.reshape(4, 8), reduction="none")
    assert per_row.shape == (4, 8)
    with pytest.raises(NotImplementedError, match="no label smoothing"):
        fn(*inputs.args, label_smoothing=0.1)


def _torch_lce_loads() -> bool:
    """Whether torch's ``F.linear_cross_entropy`` is there to measure: torch's own, or torch 2.13's files."""
    try:
        torch_lce_module.load()
    except (ImportError, FileNotFoundError):
        return False
    return True


@pytest.mark.parametrize("missing", ["linear_cross_entropy", "LinearCrossEntropyOptions"])
def test_torch_lce_skipped_naming_what_torch_lacks(monkeypatch, missing):
    """On a torch without the function (the H200's 2.11) and without torch 2.13's files named by
    ``KERNELS_LIB_TORCH_LCE_FILES`` the providers are skipped, the note naming it."""
    owner = torch.nn.functional if missing == "linear_cross_entropy" else torch.nn
    monkeypatch.delattr(owner, missing, raising=False)
    monkeypatch.delenv(torch_lce_module.FILES_VARIABLE, raising=False)
    _, skipped = available_providers("fused_linear_cross_entropy", list(flce.TORCH_LCE_POLICIES))
    assert set(skipped) == set(flce.TORCH_LCE_POLICIES)
    assert all(why.startswith("ImportError") and missing in why and "2.13" in why for why in skipped.values())


@needs_torch_lce
def test_torch_lce_in_a_sweep_beside_kernels_lib():
    rows = run_sweep("fused_linear_cross_entropy", x_name="BT", x_values=[8], sizes={"H": 16, "V": 67},
                     dtype=torch.float32, device=DEVICE, providers=["kernels_lib", *flce.TORCH_LCE_POLICIES],
                     modes=["full"])
    assert set(rows.kernel_provider) == {"kernels_lib", *flce.TORCH_LCE_POLICIES}
    assert rows.y_value_50.notna().all() and not rows.note.str.contains("Error").any()


class _Recorder:
    """Stands in for a peer: records constructor and call arguments, returns a loss of the inputs."""

    def __init__(self):
        self.init, self.calls = [], []

    def module(self, **kwargs):
        self.init.append(kwargs)
        return lambda *args: self.calls.append((args, {})) or args[1].float().sum()

    def function(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return args[0].float().sum()


@pytest.fixture
def fake_peers(monkeypatch):
    """liger_kernel.transformers and cut_cross_entropy replaced by recorders; CUDA reported available."""
    liger, cce = _Recorder(), _Recorder()
    liger_pkg = types.ModuleType("liger_kernel")
    liger_transformers = types.ModuleType("liger_kernel.transformers")
    liger_transformers.LigerFusedLinearCrossEntropyLoss = liger.module
    cce_module = types.ModuleType("cut_cross_entropy")
    cce_module.linear_cross_entropy = cce.function
    monkeypatch.setitem(sys.modules, "liger_kernel", liger_pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", liger_transformers)
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", cce_module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return liger, cce


def test_liger_adapter_maps_our_signature(fake_peers):
    liger, _ = fake_peers
    fn = flce.PROVIDERS["liger"].load()
    x, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    target = torch.zeros(2, 3, dtype=torch.long)
    fn(x, w, target, reduction="sum", label_smoothing=0.1, z_loss_scale=1e-4, softcap=30.0, chunk_size=8, accurate=False)
    fn(x, w, target, reduction="sum", label_smoothing=0.1, z_loss_scale=1e-4, softcap=30.0)
    assert liger.init == [  # one module per option set, reused
        {"ignore_index": -100, "lse_square_scale": 1e-4, "label_smoothing": 0.1, "reduction": "sum", "softcap": 30.0}
    ]
    (args, _), _ = liger.calls
    assert args[0] is w  # Liger takes the weight first
    assert args[1].shape == (6, 4) and args[2].shape == (6,) and args[3] is None
    with pytest.raises(NotImplementedError, match="loss only"):
        fn(x, w, target, return_z_loss=True)


def test_cce_adapter_no_shift_mean_ignore_index(fake_peers):
    _, cce = fake_peers
    fn = flce.PROVIDERS["cce"].load()
    x, w, target = torch.randn(6, 4), torch.randn(5, 4), torch.zeros(6, dtype=torch.long)
    fn(x, w, target)
    (args, kwargs), = cce.calls
    assert args[0] is x and args[1] is w and args[2] is target
    assert kwargs == {"ignore_index": -100, "softcap": None, "reduction": "mean", "shift": False}
    for bad in ({"label_smoothing": 0.1}, {"z_loss_scale": 1e-4}):
        with pytest.raises(NotImplementedError, match="cut_cross_entropy"):
            fn(x, w, target, **bad)
    with pytest.raises(NotImplementedError, match="cut_cross_entropy"):
        fn(x, w, target, torch.zeros(5))


@pytest.mark.parametrize("full_ms, target_ms, share", [(75.0, 37.5, 0.75), (60.0, 40.0, 0.5), (30.0, 40.0, 0.0), (30.0, 5.0, 1.0)])
def test_deferred_share_needed(full_ms, target_ms, share):
    """Forward at f·G + (1 - f)·3G with G = full/3 meets the target exactly at the share returned (or is
    already under it at 0, or cannot reach it at 1); the kept logits are that share of N·V elements."""
    need = flce_studies.deferred_share_needed(full_ms, target_ms, n_rows=16384, vocab=128256, itemsize=2)
    assert need["share"] == pytest.approx(share)
    assert need["bytes"] == pytest.approx(share * 16384 * 128256 * 2)
    g = full_ms / 3
    forward = need["share"] * g + (1 - need["share"]) * 3 * g
    assert forward == pytest.approx(target_ms) or (share == 0 and forward < target_ms) or (share == 1 and forward > target_ms)


def test_load_run_absent_is_none(monkeypatch, tmp_path):
    monkeypatch.setattr("kernels_lib.workbench.data.MEASURED_DIR", tmp_path)
    assert flce_studies.load_run("dial") is None
    (tmp_path / "gpu_runs").mkdir()
    pd.DataFrame({"a": [1]}).to_csv(tmp_path / flce_studies.RUN_FILES["dial"], index=False)
    assert flce_studies.load_run("dial").a.tolist() == [1]


def test_load_run_gives_the_newest_of_several_runs(monkeypatch, tmp_path):
    monkeypatch.setattr("kernels_lib.workbench.data.MEASURED_DIR", tmp_path)
    (tmp_path / "gpu_runs").mkdir()
    runs = pd.DataFrame({"a": [1, 2, 3, 4], "kernels_lib_commit": ["old", "old", "new", "new"],
                         "timestamp": ["2026-11-30 19:00:00", "2026-11-30 19:05:00",
                                       "2026-12-01 00:20:00", "2026-12-01 00:25:00"]})
    runs.iloc[[2, 3, 0, 1]].to_csv(tmp_path / flce_studies.RUN_FILES["frontier"], index=False)  # order in the file is no clue
    assert sorted(flce_studies.load_run("frontier").a.tolist()) == [3, 4]


def test_load_runs_keeps_every_run_and_filters_the_gpu(monkeypatch, tmp_path):
    monkeypatch.setattr("kernels_lib.workbench.data.MEASURED_DIR", tmp_path)
    assert flce_studies.load_runs("timeline") is None
    (tmp_path / "gpu_runs").mkdir()
    pd.DataFrame({"a": [1, 2, 3], "kernels_lib_commit": ["old", "new", "new"], "gpu_name": ["H200", "H200", "A100"]}).to_csv(
        tmp_path / flce_studies.RUN_FILES["timeline"], index=False)
    assert flce_studies.load_runs("timeline").a.tolist() == [1, 2, 3]
    assert flce_studies.load_runs("timeline", "H200").a.tolist() == [1, 2]


def test_profile_kernels_sums_device_kernels_per_provider_and_n():
    """Kernels are the rows without CPU time; the torch ops and autograd rows that launch them are not
    counted twice; rows of runs before the provider column are kernels_lib's; a skipped provider has no row."""
    profile = pd.DataFrame({
        "name": ["_FusedLinearCrossEntropyFunction", "aten::mm", "gemm", "mm kernel", "merge", "gemm", "quack skipped: no CUDA"],
        "calls per step": [1, 2, 1, 2, 1, 1, float("nan")],
        "device ms per step": [9.0, 4.0, 5.0, 4.0, 0.25, 6.0, float("nan")],
        "cpu ms per step": [2.0, 0.3, 0.0, 0.0, 0.0, 0.0, float("nan")],
        "kernel_provider": ["kernels_lib"] * 5 + [None, "quack"],
        "BT": [4096] * 5 + [8192, 4096],
    })
    table = flce_studies.profile_kernels(profile, top=2).set_index(["kernel_provider", "N"])
    assert list(table.index) == [("kernels_lib", 4096), ("kernels_lib", 8192)]
    assert table.loc[("kernels_lib", 4096), "kernels ms per step"] == 9.25
    assert table.loc[("kernels_lib", 4096), "kernels"] == 3
    # "gemm" and "mm kernel"... only names of GEMM kernels count as GEMMs: "mm kernel" and "merge" are the rest
    assert table.loc[("kernels_lib", 4096), "GEMM ms per step"] == 5.0
    assert table.loc[("kernels_lib", 4096), "other ms per step"] == 4.25
    assert table.loc[("kernels_lib", 4096), "longest"] == "gemm 5.00; mm kernel 4.00"
    assert table.loc[("kernels_lib", 8192), "kernels ms per step"] == 6.0
    without_column = flce_studies.profile_kernels(profile.drop(columns="kernel_provider").iloc[:5])
    assert without_column.kernel_provider.tolist() == ["kernels_lib"]


def _round_rows(provider, n, round_, mb, commit="abc1234", mode="full", metric="memory"):
    return {"kernel_provider": provider, "x_value": n, "round": round_, "y_value_50": mb, "metric_name": metric,
            "kernel_operation_mode": mode, "kernels_lib_commit": commit, "gpu_name": "NVIDIA H200", "timestamp": "2026-12-04"}


def test_memory_by_round_shows_a_first_round_peak():
    """QuACK's round 1 held 10180 MB at N = 4096 and rounds 2 and 3 2036 (0f2fe95 on the H200)."""
    rows = pd.DataFrame([_round_rows("quack", 4096, 1, 10180.0), _round_rows("quack", 4096, 2, 2036.0),
                         _round_rows("quack", 4096, 3, 2036.0), _round_rows("kernels_lib", 4096, 1, 1164.0),
                         _round_rows("kernels_lib", 4096, 2, 1164.0), _round_rows("kernels_lib", 4096, 3, 1164.0),
                         _round_rows("quack", 4096, 1, 7.0, metric="speed"), _round_rows("quack", 4096, 1, 1.0, mode="forward")])
    table = flce_studies.memory_by_round(rows)
    assert list(table.columns) == ["round 1", "round 2", "round 3", "first round over the rest"]
    assert table.loc[("quack", 4096), "first round over the rest"] == pytest.approx(10180 / 2036)
    assert table.loc[("kernels_lib", 4096), "first round over the rest"] == 1.0
    assert table.loc[("quack", 4096), "round 1"] == 10180.0  # the speed and forward rows are not memory of full
    with pytest.raises(ValueError):
        flce_studies.memory_by_round(pd.concat([rows, pd.DataFrame([_round_rows("quack", 8192, 1, 1.0, commit="def5678")])]))


def test_published_rows_use_our_names():
    rows = flce.published_rows()
    assert set(rows.kernel_provider) == {"liger", "torch"}
    assert sorted(set(rows.x_value)) == [4096, 8192, 16384, 32768]
    assert set(rows.gpu_name) == {"NVIDIA A100-SXM4-80GB"}


# --------------------------------------------------------------------------- sweep, checks, dial, precision


def test_tiny_sweep_rows():
    rows = run_sweep(
        "fused_linear_cross_entropy", x_name="BT", x_values=[4, 8], sizes={"H": 16, "V": 67},
        dtype=torch.bfloat16, device=DEVICE, modes=("forward_no_grad", "full"),
    )
    assert list(rows.columns) == MEASURED_COLUMNS
    speed = rows[rows.metric_name == "speed"]
    assert {"kernels_lib", "kernels_lib[accurate=True]", "torch"} <= set(speed.kernel_provider)
    assert len(speed) == 2 * 2 * len(set(speed.kernel_provider))
    ours = speed.kernel_provider.str.startswith("kernels_lib") | (speed.kernel_provider == "torch")
    assert (speed[ours].y_value_50 > 0).all()
    # a peer that loads here may fail at these sizes (QuACK's CuTe DSL compiler on the H200): a NaN row with its error
    peers = speed[~ours]
    assert ((peers.y_value_50 > 0) | (peers.y_value_50.isna() & peers.note.fillna("").str.contains("Error"))).all()
    config = json.loads(rows.extra_benchmark_config_str.iloc[0])
    assert config["H"] == 16 and config["V"] == 67 and config["reduction"] == "mean" and config["ignore_fraction"] == 0.05
    if ON_CPU:
        assert rows.note.str.contains("liger skipped").all() and rows.note.str.contains("cce skipped").all()


def test_check_table_passes_over_options():
    cases = [
        {"dtype": torch.float32, "reduction": "mean"},
        {"dtype": torch.bfloat16, "reduction": "sum", "label_smoothing": 0.1, "bias": True},
        {"dtype": torch.float16, "reduction": "none", "z_loss_scale": 1e-3, "softcap": 5.0},
    ]
    table = check_against_reference("fused_linear_cross_entropy", cases, {"N": 7, "H": 24, "V": 131}, DEVICE)
    assert len(table) == 3 and table.shape[0] == table["passed"].sum()
    assert_checks_pass(table)


def test_cli_dry_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("kernels_lib.workbench.data.MEASURED_DIR", tmp_path / "measured")
    code = cli.main(["fused_linear_cross_entropy", "--preset", "small", "--values", "4", "--providers",
                     "kernels_lib,kernels_lib[accurate=True]", "--modes", "full", "--dry-run"])
    assert code == 0
    out = capsys.readouterr().out
    assert "kernels_lib[accurate=True]" in out and "full" in out
    assert not (tmp_path / "measured").exists()


def test_dial_sweep_names_each_point():
    rows = flce_studies.dial_sweep({"BT": 8, "H": 16, "V": 67}, chunk_sizes=[2, 8], dtype=torch.bfloat16, device=DEVICE)
    speed = rows[rows.metric_name == "speed"]
    assert set(zip(speed.kernel_provider, speed.kernel_operation_mode)) == {
        ("kernels_lib[chunk_size=2 accurate=True]", "forward_no_grad"),
        ("kernels_lib[chunk_size=2 accurate=True]", "full"),
        ("kernels_lib[chunk_size=2 accurate=False]", "full"),
        ("kernels_lib[chunk_size=8 accurate=True]", "forward_no_grad"),
        ("kernels_lib[chunk_size=8 accurate=True]", "full"),
        ("kernels_lib[chunk_size=8 accurate=False]", "full"),
    }
    for _, row in speed.iterrows():
        config = json.loads(row.extra_benchmark_config_str)
        assert row.kernel_provider == flce.variant_name({"chunk_size": config["chunk_size"], "accurate": config["accurate"]})


def test_gradient_errors_bf16_accumulation_grows_with_chunks():
    providers = {
        "kernels_lib": kernels_lib.fused_linear_cross_entropy,
        "lean, 16 chunks": flce.kernels_lib_variant(chunk_size=4, accurate=False).load(),
        "accurate, 16 chunks": flce.kernels_lib_variant(chunk_size=4, accurate=True).load(),
        "torch": reference.fused_linear_cross_entropy,
    }
    table = flce_studies.gradient_errors({"N": 64, "H": 32, "V": 257}, torch.bfloat16, DEVICE, providers).set_index("provider")
    assert list(table.columns) == ["shape", "dtype", "loss err", "dx err", "dW err"]
    assert (table[["loss err", "dx err", "dW err"]] < 2e-2).all().all()
    # float32 accumulation rounds dW once: as accurate as the baseline's single product (in the
    # interpreter, float32 matmuls; on CUDA the stored exponentials' row factors round the N × H operand
    # once more, kernels_lib.kernels.shifted_exponentials: within 1.5x); bf16 accumulation over 16 chunks
    # rounds 16 times.
    factor = 1.05 if kernels_lib.INTERPRETED else 1.5
    assert table.loc["accurate, 16 chunks", "dW err"] <= factor * table.loc["torch", "dW err"]
    assert table.loc["lean, 16 chunks", "dW err"] > 1.3 * table.loc["accurate, 16 chunks", "dW err"]


def test_stage_times_cover_the_pipeline():
    table = flce_studies.stage_times({"BT": 10, "H": 16, "V": 67}, torch.bfloat16, DEVICE, chunk_size=4, accurate=False)
    assert list(table.stage) == ["logits x_c Wᵀ", "kernel: lse, loss, dz", "dx_c = dz W", "dW += dzᵀ x_c"]
    assert (table.chunks == 3).all()
    assert (table["ms"] == table["ms per chunk"] * 3).all() and (table["ms"] > 0).all()
    assert table.attrs["chunk_size"] == 4 and table.attrs["accurate"] is False
    epilogue = flce_studies.stage_times({"BT": 10, "H": 16, "V": 67}, torch.bfloat16, DEVICE, chunk_size=4,
                                        accurate=False, epilogue=True)
    assert list(epilogue.stage) == ["logits and lse: Triton GEMM, lse in its epilogue", "kernel: dz (lse given)",
                                    "dx_c = dz W", "dW += dzᵀ x_c"]
    assert epilogue.attrs["epilogue"] is True and (epilogue["ms"] > 0).all()


# --------------------------------------------------------------------------- analysis on synthetic rows


def _rows(values: dict) -> pd.DataFrame:
    """Measured-layout rows from {(provider, mode, metric): {x: median}} at H = 4096, V = 128256."""
    rows = []
    for (provider, mode, metric), by_x in values.items():
        for x, y in by_x.items():
            rows.append({
                "kernel_name": "fused_linear_cross_entropy", "kernel_provider": provider, "kernel_operation_mode": mode,
                "metric_name": metric, "x_value": x, "y_value_50": y,
                "extra_benchmark_config_str": json.dumps({"H": 4096, "V": 128256, "BT": x, "dtype": "torch.bfloat16"}),
            })
    return pd.DataFrame(rows)


SYNTHETIC = _rows({
    ("kernels_lib", "full", "speed"): {4096: 20.0, 8192: 44.0},
    ("torch", "full", "speed"): {4096: 24.5, 8192: 49.1},
    ("liger", "full", "speed"): {4096: 46.1, 8192: 55.3},
    ("cce", "full", "speed"): {4096: 48.4, 8192: 96.2},
    ("kernels_lib", "forward_no_grad", "speed"): {4096: 7.0, 8192: 14.0},
    ("torch", "forward_no_grad", "speed"): {4096: 9.33, 8192: 18.5},
    ("cce", "forward_no_grad", "speed"): {4096: 8.39, 8192: 16.7},
    ("kernels_lib", "full", "memory"): {4096: 1100.0, 8192: 1300.0},
    ("liger", "full", "memory"): {4096: 1065.0, 8192: 1129.0},
    ("torch", "full", "memory"): {4096: 6012.0, 8192: 12024.0},
})


def test_achieved_tflops():
    tflops = analysis.achieved_tflops(SYNTHETIC, "kernels_lib", "full")
    assert list(tflops.index) == [4096, 8192]
    assert tflops.loc[8192] == pytest.approx(3 * 2 * 8192 * 4096 * 128256 / 44e-3 / 1e12)
    assert analysis.achieved_tflops(SYNTHETIC, "nobody", "full").empty


def test_flce_targets_ratios_and_flags():
    table = analysis.fused_linear_cross_entropy_targets(SYNTHETIC, matmul_tflops=680.0)
    assert list(table.index) == [4096, 8192]
    assert table.loc[8192, "full / torch"] == pytest.approx(44.0 / 49.1)
    assert table.loc[8192, "full / Liger"] == pytest.approx(44.0 / 55.3)
    assert table.loc[4096, "full / CCE"] == pytest.approx(20.0 / 48.4)
    assert table.loc[8192, "forward_no_grad / CCE"] == pytest.approx(14.0 / 16.7)
    assert table.loc[4096, "forward_no_grad / torch"] == pytest.approx(7.0 / 9.33)
    assert table.loc[8192, "memory / Liger"] == pytest.approx(1300.0 / 1129.0)
    assert table.loc[8192, "full / matmul ceiling"] == pytest.approx(table.loc[8192, "full TFLOP/s"] / 680.0)
    assert bool(table.loc[4096, "full ≤ 0.85× torch"]) and not bool(table.loc[8192, "full ≤ 0.85× torch"])
    assert bool(table.loc[4096, "memory full ≤ 1.1× Liger"]) and not bool(table.loc[8192, "memory full ≤ 1.1× Liger"])
    assert table["full ≤ 0.6× Liger"].tolist() == [True, False]  # 20/46.1, 44/55.3
    assert table["forward_no_grad ≤ 1.0× CCE"].all()


def test_target_verdicts_and_missing_peer():
    without_cce = SYNTHETIC[SYNTHETIC.kernel_provider != "cce"]
    table = analysis.fused_linear_cross_entropy_targets(without_cce, matmul_tflops=680.0)
    assert table["full / CCE"].isna().all() and table["full ≤ 0.5× CCE"].isna().all()
    verdicts = analysis.target_verdicts(table)
    assert list(verdicts.index) == list(analysis.FLCE_TARGETS)
    assert verdicts.loc["full ≤ 0.5× CCE", "status"] == "not measured"
    assert verdicts.loc["full ≤ 0.85× torch", "status"] == "missed"
    assert verdicts.loc["full ≤ 0.85× torch", "worst at x"] == 8192
    assert verdicts.loc["full ≤ 0.85× torch", "worst ratio"] == pytest.approx(44.0 / 49.1)
    assert verdicts.loc["forward_no_grad ≤ 0.8× torch", "status"] == "met"


def test_speed_memory_chart_one_point_per_provider():
    figure = charts.speed_memory_chart(SYNTHETIC, 8192, "full", floor_ms=38.0)
    points = {trace.name: (trace.x[0], trace.y[0]) for trace in figure.data}
    assert points == {"kernels_lib": (1300.0, 44.0), "liger": (1129.0, 55.3), "torch": (12024.0, 49.1)}  # cce: no memory row
    assert figure.layout.shapes[0].y0 == 38.0
    assert figure.layout.xaxis.type == "log"
    dial = _rows({("kernels_lib[chunk_size=256 accurate=False]", "full", "speed"): {8192: 60.0},
                  ("kernels_lib[chunk_size=256 accurate=False]", "full", "memory"): {8192: 1200.0}})
    figure = charts.speed_memory_chart(pd.concat([SYNTHETIC, dial]), 8192)
    (trace,) = [t for t in figure.data if t.name == "kernels_lib"]  # the dial's point joins kernels_lib's one legend entry
    assert trace.marker.color == charts.COLORS["kernels_lib"] and list(trace.marker.symbol) == ["circle", "diamond"]
    assert list(trace.customdata) == ["kernels_lib", "kernels_lib[chunk_size=256 accurate=False]"]


# --------------------------------------------------------------------------- the H200 script at CPU size


def test_h200_script_cpu_paths(tmp_path):
    spec = importlib.util.spec_from_file_location("h200_flce", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.SIZES["full"]["chunks"] == [256, 512, 1024, 2048, 4096, 8192]
    code = script.main(["--out", str(tmp_path), "--size", "small", "--parts", "dial,precision,stages"])
    assert code == 0
    dial = pd.read_csv(tmp_path / flce_studies.RUN_FILES["dial"])
    assert list(dial.columns) == MEASURED_COLUMNS and dial.kernel_provider.str.startswith("kernels_lib[chunk_size=").all()
    precision = pd.read_csv(tmp_path / flce_studies.RUN_FILES["precision"])
    assert {"kernels_lib", "kernels_lib[accurate=True]", "torch"} <= set(precision.provider)
    assert {"gpu_name", "torch_version", "kernels_lib_commit"} <= set(precision.columns)
    stages = pd.read_csv(tmp_path / flce_studies.RUN_FILES["stages"])
    assert set(stages.accurate) == {True, False} and "kernels_lib_commit" in stages.columns


def _peers_here(names) -> set:
    """The providers of ``names`` that load on this machine (a peer's wheel installed, CUDA where it needs it):
    what a sweep of them measures here, whatever else is installed."""
    return set(available_providers(flce.KERNEL_NAME, list(names))[0])


def _errors(rows: pd.DataFrame) -> pd.Series:
    """The ``error`` column of a part's rows as text ("" where a row has none, or the part wrote no such column)."""
    return rows["error"].fillna("").astype(str) if "error" in rows else pd.Series("", index=rows.index)


def _frontier_script():
    """``scripts/flce_frontier.py`` as a module."""
    spec = importlib.util.spec_from_file_location("flce_frontier", SCRIPT.with_name("flce_frontier.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _check_frontier(script, out: Path, torch_lce: set) -> None:
    rows = pd.read_csv(out / script.FILES["frontier"])
    assert list(rows.columns) == MEASURED_COLUMNS
    dial = {flce.variant_name({"chunk_size": c, "accurate": False}) for c in script.SIZES["small"]["chunks"]}
    # Liger's Triton kernel runs only where the kernels are compiled (CUDA) and liger-kernel is installed
    # (the peers' CuTe and QuACK kernels need their wheels): in the interpreter it is skipped.
    # torch's own chunked linear_cross_entropy is pure torch: it runs wherever torch has it (>= 2.13).
    providers = set(rows.kernel_provider)
    assert dial | {"kernels_lib", "torch", flce.FLOOR} | torch_lce <= providers
    assert providers - dial - {"kernels_lib"} == _peers_here(script.PEERS)  # every peer that loads here, no other
    assert set(rows.kernel_operation_mode) == {"forward", *script.MODES}
    peer_run = rows[rows.kernel_provider.isin(["kernels_lib", "torch"])].note
    for peer in {"quack", "liger_sm90"} - _peers_here(script.PEERS):
        assert peer_run.str.contains(f"{peer} skipped").all()
    rounds = pd.read_csv(out / script.FILES["frontier_rounds"])
    n_rounds = script.SIZES["small"]["rounds"]
    assert sorted(rounds["round"].unique()) == list(range(1, n_rounds + 1)) and script.SIZES["full"]["rounds"] == 3
    first_provider = rounds.groupby("round").kernel_provider.first()
    assert first_provider[1] != first_provider[2], "every other round reverses the providers' order"
    main = rows[rows.kernel_provider.isin(["kernels_lib", "torch"])]
    assert main.note.str.contains(f"median of {n_rounds} rounds").all()
    assert len(main) == len(rounds[rounds.kernel_provider.isin(["kernels_lib", "torch"])]) / n_rounds


def _check_past_floor(script, out: Path, torch_lce: set) -> None:
    # issue 30's part: the same peers and the floor, no dial, and its targets judged from that one run
    dial = {flce.variant_name({"chunk_size": c, "accurate": False}) for c in script.SIZES["small"]["chunks"]}
    past = pd.read_csv(out / script.FILES["past_floor"])
    assert {"kernels_lib", "torch", flce.FLOOR, script.DX_ARM} | torch_lce <= set(past.kernel_provider) and not set(past.kernel_provider) & dial
    from kernels_lib._flce import matmuls

    assert matmuls.DX_BLOCK_ROWS != flce_studies.DX_BLOCK_ROWS_BEFORE  # the arm's constant put back after its sweep
    judged = analysis.past_floor_targets(past)
    assert judged["full / three matmuls"].notna().all() and judged["full / QuACK"].isna().all()
    # the square product's rate of the same run: measured on a GPU, NaN on a CPU (no cuBLAS rate to speak of)
    rates = analysis.past_floor_rates(past)
    assert (rates["three matmuls TFLOP/s"] > 0).all()
    assert rates["square 8192³ TFLOP/s"].notna().all() if torch.cuda.is_available() else rates["square 8192³ TFLOP/s"].isna().all()


def _check_stages(script, out: Path, torch_lce: set) -> None:
    stages = pd.read_csv(out / script.FILES["stages"])
    assert set(stages.chunk_size) == set(script.SIZES["small"]["stage_chunks"]) and "kernels_lib_commit" in stages.columns
    assert set(stages.route) == {"cuBLAS logits", "epilogue GEMM", "epilogue GEMM, logits_out configs"}


def _check_class_major(script, out: Path, torch_lce: set) -> None:
    major = pd.read_csv(out / script.FILES["class_major"])
    assert set(major.stage) == {"shift", "exponentials GEMM", "dx", "dW", "scale rows"}
    # Every stage timed; a GEMM config the GPU cannot hold (shared memory) is a recorded failure with its reason.
    gemm = major.stage == "exponentials GEMM"
    assert major[~gemm].ms.notna().all() and major[gemm].ms.notna().any()
    assert (major[gemm & major.ms.isna()].error.astype(str).str.contains("out of resource")).all()
    assert major[major.stage == "dW"].variant.str.contains(r"\(1 matmuls\)").any(), "one slab of all V classes"


def _check_profile(script, out: Path, torch_lce: set) -> None:
    profile = pd.read_csv(out / script.FILES["profile"])
    assert set(profile.kernel_provider) == {"kernels_lib", "quack"}
    if "quack" not in _peers_here(["quack"]):
        assert profile[profile.kernel_provider == "quack"].name.str.contains("skipped").all()
    assert not profile[profile.kernel_provider == "kernels_lib"].name.str.contains("skipped|failed").any()


def _check_timeline(script, out: Path, torch_lce: set) -> None:
    timeline = pd.read_csv(out / script.FILES["timeline"])
    assert set(timeline.kernel_provider) == {"kernels_lib", "quack"}
    assert timeline[timeline.kernel_provider == "kernels_lib"].ms_50.notna().sum() == 1
    quack = timeline[timeline.kernel_provider == "quack"]
    assert (quack.ms_50.notna() | _errors(quack).str.contains("skipped|failed")).all()  # timed, or why not


def _check_quack_ab(script, out: Path, torch_lce: set) -> None:
    quack_ab = pd.read_csv(out / script.FILES["quack_ab"])
    assert set(quack_ab.kernel_provider) == {"kernels_lib"} | _peers_here(["quack"])
    if "quack" not in _peers_here(["quack"]):
        assert quack_ab.note.str.contains("quack skipped").all()


def _check_quack_pairs(script, out: Path, torch_lce: set) -> None:
    pairs = pd.read_csv(out / script.FILES["quack_pairs"])
    ours = pairs[pairs.kernel_provider == "kernels_lib"]
    quack = pairs[pairs.kernel_provider == "quack"]
    assert len(quack) and (quack.ms_50.notna() | _errors(quack).str.contains("skipped|failed")).all()  # timed, or why not
    assert set(ours.kernel_operation_mode) == {"full", "forward_no_grad"} and set(ours.BT) == set(script.SIZES["small"]["x_values"])
    assert (ours.samples == script.SIZES["small"]["pair_samples"]).all() and ours.ms_50.gt(0).all()


def _check_exponentials(script, out: Path, torch_lce: set) -> None:
    n_rounds = script.SIZES["small"]["rounds"]
    ab = pd.read_csv(out / script.FILES["exponentials"])
    assert {"kernels_lib", script.LOGITS_ARM} | _peers_here(script.PEERS) == set(ab.kernel_provider)  # the frontier's peers
    assert ab.note.str.contains(f"median of {n_rounds} rounds").all()
    assert script.flce_module.STORE_EXPONENTIALS, "the A/B puts the setting back"


def _check_wide_class_major(script, out: Path, torch_lce: set) -> None:
    n_rounds = script.SIZES["small"]["rounds"]
    wide = pd.read_csv(out / script.FILES["wide_class_major"])
    assert {"kernels_lib", script.WIDE_ARM} | _peers_here(["torch", "quack", "torch_lce"]) == set(wide.kernel_provider)
    if "quack" not in _peers_here(["quack"]):
        assert wide[wide.kernel_provider != script.WIDE_ARM].note.str.contains("quack skipped").all()
    assert wide.note.str.contains(f"median of {n_rounds} rounds").all() and set(wide.x_value) == {min(script.SIZES["small"]["x_values"])}
    assert script.flce_module.CLASS_MAJOR_ROWS_PER_HIDDEN == 1, "the A/B puts the setting back"


def _check_row_major_dw(script, out: Path, torch_lce: set) -> None:
    row_major = pd.read_csv(out / script.FILES["row_major_dw"])
    assert set(row_major.stage) == {"dx", "dW"} and row_major.ms.gt(0).all() and "kernels_lib_commit" in row_major
    assert len(row_major[row_major.stage == "dW"]) == 2 * len(script.SIZES["small"]["slab_rows"]), "written and added to"


#: The frontier script's parts, a test each (so the workers share them out; the GPU target is as long as its
#: longest test): the part, and the check of the files it writes (None: its exit code alone; its rows are
#: checked by the studies' own tests).
FRONTIER_PART_CHECKS = {
    "frontier": _check_frontier, "past_floor": _check_past_floor, "stages": _check_stages,
    "class_major": _check_class_major, "profile": _check_profile, "timeline": _check_timeline,
    "quack_ab": _check_quack_ab, "quack_pairs": _check_quack_pairs, "exponentials": _check_exponentials,
    "wide_class_major": _check_wide_class_major, "row_major_dw": _check_row_major_dw,
    "forward": None, "default": None, "overhead": None, "gluon": None,
}


def test_frontier_script_parts_each_have_a_test():
    """Every part of the frontier script runs in :func:`test_frontier_script_cpu_paths`, and its peers are named."""
    script = _frontier_script()
    assert set(FRONTIER_PART_CHECKS) == set(script.PARTS)
    assert {"liger_sm90", "quack"} <= set(script.PEERS)
    assert set(flce.TORCH_LCE_POLICIES) <= set(script.PEERS)


@pytest.mark.parametrize("part", list(FRONTIER_PART_CHECKS))
def test_frontier_script_cpu_paths(part, tmp_path, capsys):
    """The frontier run at CPU size, one part: every peer named (skipped here, with the reason), kernels_lib's
    default and each dial point in both modes, and the stage tables with their provenance."""
    script = _frontier_script()
    code = script.main(["--out", str(tmp_path), "--size", "small", "--parts", part])
    assert code == 0, f"the {part} part returned {code}; its stderr ends:\n{capsys.readouterr().err[-3000:]}"
    # ... and on an older torch from torch 2.13's files where KERNELS_LIB_TORCH_LCE_FILES names them (as on the H200).
    torch_lce = set(flce.TORCH_LCE_POLICIES) if _torch_lce_loads() else set()
    if FRONTIER_PART_CHECKS[part] is not None:
        FRONTIER_PART_CHECKS[part](script, tmp_path, torch_lce)


def test_cce_paper_table_and_workload():
    """The CCE paper's Gemma 2 rows as its README prints them, the preset of its workload, and our run beside them:
    ratios to the baseline within each source only."""
    import json

    import pandas as pd

    paper = flce.cce_paper_rows()
    assert len(paper) == 9 and set(paper.provider) == {"cce", "torch.compile", "torch"}
    full = paper.set_index(["provider", "mode"])
    assert full.loc[("torch", "full"), "time ms"] == 208.8 and full.loc[("cce", "forward"), "memory MB"] == 1.1
    preset = flce.SPEC.preset("cce_gemma2")
    assert preset["sizes"] == {"H": 2304, "V": 256000} and preset["x_values"] == [8192]
    config = json.dumps({"H": 2304, "V": 256000, "dtype": "torch.bfloat16"})
    rows = pd.DataFrame([
        {"kernel_provider": p, "kernel_operation_mode": "full", "metric_name": m, "y_value_50": v, "x_value": 8192,
         "extra_benchmark_config_str": config, "kernels_lib_commit": "abc1234", "gpu_name": "NVIDIA H200",
         "timestamp": "2026-12-02 12:00"}
        for p, m, v in [("kernels_lib", "speed", 40.0), ("torch", "speed", 80.0), ("kernels_lib", "memory", 900.0)]
    ])
    other = rows.assign(extra_benchmark_config_str=json.dumps({"H": 4096, "V": 128256}))
    assert flce.is_cce_paper_workload(pd.concat([rows, other])).tolist() == [True] * 3 + [False] * 3
    table = flce.cce_paper_table(rows)
    assert table.loc[("kernels_lib", "full"), "H200 × torch"] == 0.5 and table.loc[("kernels_lib", "full"), "H200 MB"] == 900.0
    assert table.loc[("cce", "full"), "A100 × torch"] == pytest.approx(134.8 / 208.8)
    assert pd.isna(table.loc[("kernels_lib", "full"), "A100 ms (paper)"])  # ours is not in the paper
    with pytest.raises(ValueError, match="one run"):
        flce.cce_paper_table(pd.concat([rows, rows.assign(kernels_lib_commit="fff0000")]))


def test_published_and_cce_paper_workloads_are_told_apart():
    """The CSV keeps the CCE paper's run beside the published chart's: each predicate picks its own rows."""
    rows = data.load_measured(flce.KERNEL_NAME, latest=False)
    published, cce = flce.is_published_workload(rows), flce.is_cce_paper_workload(rows)
    assert published.any() and not (published & cce).any()
    configs = rows[published].extra_benchmark_config_str.map(json.loads)
    assert configs.map(lambda c: (c["H"], c["V"]) == (4096, 128256)).all()
    assert flce.is_published_workload(rows.iloc[:0]).empty


def test_wide_class_major_arms_follow_the_default_of_the_run():
    """The wide class-major A/B's arm is the class-major chunk since the default went back to 1, the chunked
    route in the runs made while it was 2: each run's routes are told by the arm it has, and the recorded
    runs of the old kind still read."""
    new = pd.DataFrame({"kernel_provider": ["kernels_lib", flce_studies.WIDE_CLASS_MAJOR_ARM, "torch"]})
    old = pd.DataFrame({"kernel_provider": ["kernels_lib", flce_studies.WIDE_CLASS_MAJOR_ARM_BEFORE, "torch"]})
    assert flce_studies.wide_class_major_arms(new) == {"chunked": "kernels_lib", "class-major": flce_studies.WIDE_CLASS_MAJOR_ARM}
    assert flce_studies.wide_class_major_arms(old) == {"chunked": flce_studies.WIDE_CLASS_MAJOR_ARM_BEFORE, "class-major": "kernels_lib"}
    with pytest.raises(ValueError, match="no arm of the wide class-major A/B"):
        flce_studies.wide_class_major_arms(pd.DataFrame({"kernel_provider": ["kernels_lib"]}))
    recorded = flce_studies.load_run("wide_class_major")
    if recorded is not None:  # the newest recorded run names one of the two arms
        assert set(flce_studies.wide_class_major_arms(recorded).values()) <= set(recorded.kernel_provider)
