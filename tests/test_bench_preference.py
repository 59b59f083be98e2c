"""The measurement side of ORPO and KTO: specs, inputs, floors, Liger adapters (stand-ins), tiny CPU
sweeps, checks, a failing provider recorded by the sweep, the H200 script's small path."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch

from kernels_lib import default_device
from kernels_workbench.bench import fused_linear_kto as kto
from kernels_workbench.bench import fused_linear_orpo as orpo
from kernels_workbench.bench.spec import Provider
from kernels_workbench.bench.registry import get_spec, registered_losses
from kernels_workbench.bench.sweep import MEASURED_COLUMNS, run_sweep
from kernels_workbench.check import assert_checks_pass, check_against_reference

DEVICE = default_device()
ON_CPU = DEVICE.type == "cpu"
needs_cpu = pytest.mark.skipif(not ON_CPU, reason="CPU-machine behaviour (no CUDA: Liger cannot run)")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "published_sweeps.py"
TINY = {"B": 4, "T": 5, "H": 16, "V": 67}


# --------------------------------------------------------------------------- specs, inputs, floors


@pytest.mark.parametrize(
    "name,values,sizes,label",
    [
        ("fused_linear_orpo_loss", [2, 4, 8, 16], {"T": 1024, "H": 4096, "V": 128256}, "B"),
        ("kto_loss", [2, 4, 8, 16, 32], {"T": 512, "H": 1024, "V": 128256}, "Batch Size (B)"),
    ],
)
def test_registered_with_published_presets(name, values, sizes, label):
    assert name in registered_losses()
    spec = get_spec(name)
    assert list(spec.providers) == ["kernels_lib", "huggingface", "liger"] and spec.baseline == "huggingface"
    assert spec.published == {"x_name": "B", "x_label": label, "x_values": values, "sizes": sizes, "dtype": torch.bfloat16}
    small = spec.small
    assert small["x_name"] == "B" and max(small["x_values"]) * small["sizes"]["T"] * small["sizes"]["V"] < 10**5


def test_published_rows_match_the_presets():
    rows = orpo.published_rows()
    assert set(rows["T"]) == {1024, 4096} and set(orpo.published_rows(1024).x_value) == {2, 4, 8, 16}
    kto_rows = kto.published_rows()
    config = json.loads(kto_rows.extra_benchmark_config_str.iloc[0])
    assert {k: config[k] for k in ("T", "H", "V", "bias", "beta", "ignore_index")} == {
        "T": 512, "H": 1024, "V": 128256, "bias": True, "beta": 0.1, "ignore_index": 42
    }
    assert get_spec("kto_loss").default_options["ignore_index"] == 42


def test_orpo_inputs_pairs_grads_and_ignored_tokens():
    inputs = orpo.make_inputs(TINY, torch.bfloat16, DEVICE, {"ignore_fraction": 0.5, "beta": 0.2, "bias": True}, seed=1)
    x, weight, target, bias = inputs.args
    assert x.shape == (4, 5, 16) and weight.shape == (67, 16) and bias.shape == (67,) and target.shape == (4, 5)
    assert inputs.grad_inputs == [x, weight, bias] and all(t.requires_grad for t in inputs.grad_inputs)
    assert (target == -100).sum().item() == round(0.5 * 4 * 4) and (target[:, 0] != -100).all()
    assert inputs.kwargs == {"beta": 0.2}
    with pytest.raises(ValueError, match="even"):
        orpo.make_inputs({**TINY, "B": 3}, torch.float32, DEVICE, {})


@pytest.mark.parametrize("input_grad", [False, True])
def test_kto_inputs_reference_labels_kl(input_grad):
    options = {**get_spec("kto_loss").default_options, "input_grad": input_grad}
    inputs = kto.make_inputs(TINY, torch.bfloat16, DEVICE, options, seed=2)
    x, weight, target, labels, kl = inputs.args
    kw = inputs.kwargs
    assert x.shape == kw["ref_x"].shape == (4, 5, 16) and weight.shape == kw["ref_weight"].shape == (67, 16)
    assert kw["bias"].shape == kw["ref_bias"].shape == (67,) and labels.dtype == torch.bool and kl.shape == ()
    assert inputs.grad_inputs == ([x] if input_grad else []) + [weight, kw["bias"]]
    assert not any(kw[k].requires_grad for k in ("ref_x", "ref_weight", "ref_bias"))
    assert x.requires_grad == input_grad
    assert (target[:, 0] != 42).all() and (target == 42).sum() >= round(0.25 * 4 * 4)
    assert {k for k in kw if not k.startswith(("ref_", "bias"))} == {"beta", "ignore_index"}


def test_floors():
    published = {"B": 8, "T": 1024, "H": 4096, "V": 128256}
    assert orpo.flops(published, "full") == 3 * 2 * 8192 * 4096 * 128256  # 25.8 TFLOP, as FLCE at N = 8192
    assert orpo.flops(published, "forward") == orpo.flops(published, "full") / 3
    sizes = {"B": 2, "T": 3, "H": 5, "V": 7}
    assert kto.flops(sizes, "forward") == 2 * 2 * 30 * 7 and kto.flops(sizes, "full") == 3 * 2 * 30 * 7
    assert kto.flops(sizes, "full", input_grad=True) == 4 * 2 * 30 * 7
    assert orpo.bytes_moved(sizes, torch.bfloat16, "full") == 2 * (30 + 35) * 2 + 6 * 8
    assert kto.bytes_moved(sizes, torch.bfloat16, "forward") == 2 * (30 + 35) * 2 + 6 * 8


# --------------------------------------------------------------------------- Liger adapters (stand-ins)


class _Module:
    """Stands in for a Liger loss module: records its options and calls, returns (loss, aux)."""

    def __init__(self, log, **options):
        self.log = log
        log.append(("init", options))

    def __call__(self, *args):
        self.log.append(("call", args))
        return torch.tensor(1.5), ("aux",)


@pytest.fixture
def fake_liger(monkeypatch):
    log = []
    package = types.ModuleType("liger_kernel")
    chunked = types.ModuleType("liger_kernel.chunked_loss")
    chunked.LigerFusedLinearORPOLoss = lambda **o: _Module(log, **o)
    chunked.LigerFusedLinearKTOLoss = lambda **o: _Module(log, **o)
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", chunked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return log


def test_liger_orpo_adapter(fake_liger):
    fn = orpo.PROVIDERS["liger"].load()
    x, w, target = torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long)
    assert fn(x, w, target, beta=0.2, chunk_size=64).item() == 1.5
    fn(x, w, target, beta=0.2)
    assert [entry[0] for entry in fake_liger] == ["init", "call", "call"]  # one module per option set
    assert fake_liger[0][1] == {"ignore_index": -100, "beta": 0.2}
    args = fake_liger[1][1]
    assert args[0] is w and args[1] is x and args[2] is target and args[3] is None and args[4] is None


def test_liger_kto_adapter(fake_liger):
    fn = kto.PROVIDERS["liger"].load()
    inputs = kto.make_inputs(TINY, torch.float32, "cpu", get_spec("kto_loss").default_options)
    assert fn(*inputs.args, **inputs.kwargs).item() == 1.5
    assert fake_liger[0][1] == {"ignore_index": 42, "beta": 0.1, "use_ref_model": True, "average_log_prob": False}
    x, w, target, labels, kl = inputs.args
    expected = (x, w, target, inputs.kwargs["bias"], labels, inputs.kwargs["ref_x"], inputs.kwargs["ref_weight"],
                inputs.kwargs["ref_bias"], kl)
    assert all(a is b for a, b in zip(fake_liger[1][1], expected, strict=True))
    with pytest.raises(NotImplementedError, match="reference model"):
        fn(x, w, target, labels, ref_logps=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="weights"):
        fn(*inputs.args, **inputs.kwargs, desirable_weight=2.0)


# --------------------------------------------------------------------------- sweeps and checks on CPU


@needs_cpu
@pytest.mark.parametrize("name", ["fused_linear_orpo_loss", "kto_loss"])
def test_tiny_sweep(name):
    rows = run_sweep(name, x_name="B", x_values=[2], sizes={"T": 4, "H": 16, "V": 67}, dtype=torch.float32,
                     device=DEVICE, modes=["forward", "full"])
    assert list(rows.columns) == MEASURED_COLUMNS and len(rows) == 2 * 2  # 2 providers x 2 modes, speed only
    assert set(rows.kernel_provider) == {"kernels_lib", "huggingface"} and rows.y_value_50.notna().all()
    assert rows.note.str.contains("liger skipped").all()
    assert json.loads(rows.extra_benchmark_config_str.iloc[0])["T"] == 4


@needs_cpu
def test_sweep_records_a_failing_provider(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("backend compiler failed\nlong traceback text")

    monkeypatch.setitem(kto.PROVIDERS, "broken", Provider("broken", lambda: broken))
    rows = run_sweep("kto_loss", x_name="B", x_values=[2, 4], sizes={"T": 4, "H": 16, "V": 67}, dtype=torch.float32,
                     device=DEVICE, providers=["kernels_lib", "broken"], modes=["forward", "full"])
    failed = rows[rows.kernel_provider == "broken"]
    assert len(failed) == 4 and failed.y_value_50.isna().all()
    assert (failed.note == "RuntimeError: backend compiler failed").all()
    assert rows[rows.kernel_provider == "kernels_lib"].y_value_50.notna().all()


@pytest.mark.parametrize("name", ["fused_linear_orpo_loss", "kto_loss"])
def test_checks_against_the_baseline(name):
    extra = {"input_grad": True} if name == "kto_loss" else {"bias": True, "ignore_fraction": 0.3}
    cases = [{"dtype": torch.float32}, {"dtype": torch.bfloat16}, {"dtype": torch.float32, **extra}]
    table = check_against_reference(name, cases, TINY, DEVICE)
    assert_checks_pass(table)
    assert (table.loc[table.dtype == "float32", "kernels_lib loss err"] < 1e-5).all()


# --------------------------------------------------------------------------- the H200 script at CPU size


@needs_cpu
def test_h200_script_small_path(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kernels_workbench.data.MEASURED_DIR", tmp_path / "measured")
    spec = importlib.util.spec_from_file_location("h200_preference", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.PARTS["orpo"] == ("fused_linear_orpo_loss", "published") and script.MODES == "forward,full"
    assert {kernel for kernel, _ in script.PARTS.values()} <= set(registered_losses())
    assert script.main(["--out", str(tmp_path / "out"), "--size", "small", "--parts", "kto"]) == 0
    printed = capsys.readouterr().out
    assert "kernels_lib" in printed and "huggingface" in printed
    assert not (tmp_path / "measured").exists() and list((tmp_path / "out").iterdir()) == []  # a dry run
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path / "out"), "--parts", "no_such_part"])
