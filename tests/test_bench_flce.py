"""The measurement side of fused linear cross-entropy: spec, providers, floors, dial, precision,
the speed-vs-memory chart, and the H200 script's CPU paths.

Sizes are tiny (kernels through Triton's interpreter on a machine without a GPU). The peers' CUDA
adapters are exercised with stand-in modules that record how they are called.
"""

from __future__ import annotations

import json
import sys
import types

import pandas as pd
import pytest
import torch

import kernels_lib
from kernels_lib import default_device
from kernels_workbench import charts, data
from kernels_workbench.bench import cli
from kernels_workbench.bench import fused_linear_cross_entropy as flce
from kernels_workbench.bench import torch_lce as torch_lce_module
from kernels_workbench.bench.registry import get_spec, registered_losses
from kernels_workbench.bench.sweep import MEASURED_COLUMNS, available_providers, run_sweep
from kernels_workbench.check import assert_checks_pass, check_against_reference
from synthetic_rows import FLCE_SYNTHETIC, flce_rows

DEVICE = default_device()
ON_CPU = DEVICE.type == "cpu"
needs_cpu = pytest.mark.skipif(not ON_CPU, reason="CPU-machine behaviour (no CUDA: the peers cannot run)")
TINY = {"N": 32, "H": 16, "V": 67}


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


def test_the_one_floors_matmul_time_as_in_spec():
    from kernels_workbench import floor as one_floor

    # SPEC §4: at N = 8192 one logits matmul is 8.6 TFLOP; full >= 38 ms at 680 TFLOP/s.
    sizes = {"N": 8192, "H": 4096, "V": 128256}
    assert flce.flops(sizes, "forward_no_grad") / 1e12 == pytest.approx(8.6, abs=0.05)
    assert one_floor.matmul_ms(flce.KERNEL_NAME, sizes, "full", 680.0) == pytest.approx(38.0, abs=0.1)  # the one floor's matmuls


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


@pytest.mark.gpu_memory(5)  # on a GPU: the published sizes' ceilings
def test_cli_dry_run(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("kernels_workbench.data.MEASURED_DIR", tmp_path / "measured")
    code = cli.main(["fused_linear_cross_entropy", "--preset", "small", "--values", "4", "--providers",
                     "kernels_lib,kernels_lib[accurate=True]", "--modes", "full", "--dry-run"])
    assert code == 0
    out = capsys.readouterr().out
    assert "kernels_lib[accurate=True]" in out and "full" in out
    assert not (tmp_path / "measured").exists()


# --------------------------------------------------------------------------- the speed-vs-memory chart on synthetic rows


SYNTHETIC = FLCE_SYNTHETIC


def test_speed_memory_chart_one_point_per_provider():
    figure = charts.speed_memory_chart(SYNTHETIC, 8192, "full", floor_ms=38.0)
    points = {trace.name: (trace.x[0], trace.y[0]) for trace in figure.data}
    assert points == {"kernels_lib": (1300.0, 44.0), "liger": (1129.0, 55.3), charts.BASELINE_NAME: (12024.0, 49.1)}  # cce: no memory row
    assert figure.layout.shapes[0].y0 == 38.0
    assert figure.layout.xaxis.type == "log"
    dial = flce_rows({("kernels_lib[chunk_size=256 accurate=False]", "full", "speed"): {8192: 60.0},
                  ("kernels_lib[chunk_size=256 accurate=False]", "full", "memory"): {8192: 1200.0}})
    figure = charts.speed_memory_chart(pd.concat([SYNTHETIC, dial]), 8192)
    (trace,) = [t for t in figure.data if t.name == "kernels_lib"]  # the dial's point joins kernels_lib's one legend entry
    assert trace.marker.color == charts.COLORS["kernels_lib"] and list(trace.marker.symbol) == ["circle", "diamond"]
    assert list(trace.customdata) == ["kernels_lib", "kernels_lib[chunk_size=256 accurate=False]"]


# --------------------------------------------------------------------------- the published chart's workload


def test_published_workload_picks_the_published_charts_rows():
    """The CSV keeps other workloads' runs beside the published chart's: the predicate picks the chart's own."""
    rows = data.load_measured(flce.KERNEL_NAME, latest=False)
    published = flce.is_published_workload(rows)
    assert published.any() and not published.all()
    configs = rows[published].extra_benchmark_config_str.map(json.loads)
    assert configs.map(lambda c: (c["H"], c["V"]) == (4096, 128256)).all()
    assert not rows[~published].extra_benchmark_config_str.map(json.loads).map(lambda c: (c["H"], c["V"]) == (4096, 128256)).any()
    assert flce.is_published_workload(rows.iloc[:0]).empty


