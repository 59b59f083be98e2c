"""The measurement side of fused_linear_jsd, distill_jsd_loss and distill_cosine_loss: presets against
the published rows, inputs, floors, the Liger adapters (stand-ins), and the CPU providers agreeing."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from kernels_lib import DistillationOutput, default_device, fused_linear_jsd
from kernels_workbench import data
from kernels_workbench.bench import distillation
from kernels_workbench.bench import fused_linear_jsd as flj
from kernels_workbench.bench.registry import get_spec, registered_losses
from kernels_workbench.bench.sweep import MEASURED_COLUMNS, run_sweep
from kernels_workbench.check import assert_checks_pass, check_against_reference, relative_error

DEVICE = default_device()
needs_cpu = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU-machine behaviour (no CUDA: Liger cannot run)")
NAMES = ["fused_linear_jsd", "distill_jsd_loss", "distill_cosine_loss"]
TINY = {"BT": 6, "H": 16, "V": 67}


@pytest.mark.parametrize("name", NAMES)
def test_presets_match_the_published_rows(name):
    spec = get_spec(name)
    assert name in registered_losses() and spec.baseline == "torch"
    expected = ["kernels_lib", "torch", "liger"] + (["trl"] if name == "fused_linear_jsd" else [])
    assert list(spec.providers) == expected
    rows = data.load_published(name)
    assert set(rows.kernel_provider) == {"liger", "torch"} and set(rows.kernel_operation_mode) == {"forward", "full"}
    assert sorted(set(rows.x_value)) == spec.published["x_values"] and set(rows.x_name) == {spec.published["x_name"]}
    configs = {row for row in rows.extra_benchmark_config_str}
    assert len(configs) == 1
    config = json.loads(configs.pop())
    assert {k: config[k] for k in ("H", "V")} == spec.published["sizes"]
    assert config["dtype"] == str(spec.published["dtype"])
    if name != "fused_linear_jsd":
        assert config["bias"] is False and not spec.default_options.get("bias")
        for key in ("weight_hard_loss", "weight_soft_loss", "ignore_index"):
            assert spec.default_options[key] == config[key], key
    small = spec.small
    assert small["x_name"] == "BT" and max(small["x_values"]) * small["sizes"]["V"] < 10**4


def test_inputs_follow_the_published_scripts():
    """fused_linear_jsd: both heads H, no labels; distillation: a student of H/2, a teacher of H, labels."""
    sx, sw, tx, tw, target = (inputs := flj.make_inputs(TINY, torch.bfloat16, DEVICE, {})).args
    assert sx.shape == (6, 16) and tx.shape == (6, 16) and sw.shape == tw.shape == (67, 16) and target is None
    assert inputs.grad_inputs == [sx, sw] and not tx.requires_grad and not tw.requires_grad
    assert inputs.kwargs == {"student_bias": None, "teacher_bias": None}
    inputs = distillation.make_inputs(TINY, torch.float32, DEVICE, {"bias": True, "ignore_fraction": 0.5, "beta": 0.2})
    sx, sw, tx, tw, target = inputs.args
    assert sx.shape == (6, 8) and sw.shape == (67, 8) and tx.shape == (6, 16) and tw.shape == (67, 16)
    assert (target == -100).sum().item() == 3 and inputs.grad_inputs == [sx, sw, inputs.kwargs["student_bias"]]
    assert inputs.kwargs["beta"] == 0.2 and not inputs.kwargs["teacher_bias"].requires_grad


def test_floors():
    sizes = {"BT": 2, "H": 6, "V": 7}
    assert flj.flops(sizes, "forward") == 2 * 2 * 7 * (6 + 6) and flj.flops(sizes, "full") == 2 * 2 * 7 * (6 + 6) + 4 * 2 * 7 * 6
    assert distillation.flops(sizes, "full") == 2 * 2 * 7 * (3 + 6) + 4 * 2 * 7 * 3
    reads = (2 * 6 + 7 * 6) * 2 * 2  # both heads (H each), bf16
    assert flj.bytes_moved(sizes, torch.bfloat16, "forward") == reads
    assert flj.bytes_moved(sizes, torch.bfloat16, "full") == reads + (2 * 6 + 7 * 6) * 2
    assert distillation.bytes_moved(sizes, torch.float32, "forward") == (2 * 3 + 7 * 3 + 2 * 6 + 7 * 6) * 4 + 2 * 8


# --------------------------------------------------------------------------- CPU providers agree


@pytest.mark.parametrize("name", NAMES)
def test_checks_against_the_baseline(name):
    cases = [{"dtype": torch.float32}, {"dtype": torch.bfloat16},
             {"dtype": torch.float32, "bias": True, "ignore_fraction": 0.3, "beta": 0.0, "temperature": 2.0}]
    table = check_against_reference(name, cases, TINY, DEVICE)
    assert_checks_pass(table)
    assert (table.loc[table.dtype == "float32", "kernels_lib loss err"] < 1e-5).all()


@pytest.mark.parametrize("options", [{}, {"bias": True, "ignore_fraction": 0.5, "beta": 1.0, "temperature": 0.7}],
                         ids=["published", "bias-ignored-beta1"])
def test_trl_provider_computes_our_loss(options):
    """TRL's ``ChunkedDivergenceFunction`` (torch tiles on the CPU), masked and reduced by the adapter."""
    pytest.importorskip("trl.kernels.chunked_divergence")
    trl = get_spec("fused_linear_jsd").providers["trl"].load()
    losses, grads = [], []
    for fn in (trl, fused_linear_jsd):
        inputs = flj.make_inputs(TINY, torch.float32, DEVICE, options, seed=3)
        loss = fn(*inputs.args, **inputs.kwargs)
        losses.append(loss.detach())
        grads.append(torch.autograd.grad(loss, inputs.grad_inputs))
    assert relative_error(losses[0], losses[1]) < 1e-5
    assert all(relative_error(a, b) < 1e-5 for a, b in zip(*grads, strict=True))


@needs_cpu
@pytest.mark.parametrize("name", NAMES)
def test_tiny_sweep(name):
    rows = run_sweep(name, x_name="BT", x_values=[4], sizes={"H": 16, "V": 67}, dtype=torch.float32, device=DEVICE,
                     modes=["forward", "full"])
    runnable = {"kernels_lib", "torch"} | ({"trl"} if name == "fused_linear_jsd" else set())
    assert list(rows.columns) == MEASURED_COLUMNS and len(rows) == 2 * len(runnable)
    assert set(rows.kernel_provider) == runnable and rows.y_value_50.notna().all()
    assert rows.note.str.contains("liger skipped").all() and (rows.kernel_name == name).all()


# --------------------------------------------------------------------------- Liger adapters (stand-ins)


class _Module:
    """Stands in for a Liger module: records its options and calls; returns what the real one would."""

    def __init__(self, log, result, **options):
        self.log, self.result = log, result
        log.append(("init", options))

    def __call__(self, *args):
        self.log.append(("call", args))
        return self.result


@pytest.fixture
def fake_liger(monkeypatch):
    log = []
    package = types.ModuleType("liger_kernel")
    chunked = types.ModuleType("liger_kernel.chunked_loss")
    transformers = types.ModuleType("liger_kernel.transformers")
    triple = (torch.tensor(1.5), torch.tensor(2.0), torch.tensor(3.0))  # (loss, soft, hard)
    for name in ("LigerFusedLinearJSDLoss", "LigerFusedLinearCosineSimilarityLoss"):
        setattr(chunked, name, lambda **o: _Module(log, triple, **o))
    transformers.LigerFusedLinearJSD = lambda **o: _Module(log, torch.tensor(0.25), **o)
    for module_name, module in (("liger_kernel", package), ("liger_kernel.chunked_loss", chunked),
                                ("liger_kernel.transformers", transformers)):
        monkeypatch.setitem(sys.modules, module_name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return log


def same(a, b) -> bool:
    """The very tensor, or a view of it of the same shape (the adapters flatten the leading dims)."""
    return a is b or (a.shape == b.shape and a.data_ptr() == b.data_ptr())


@pytest.mark.parametrize("name", ["distill_jsd_loss", "distill_cosine_loss"])
def test_liger_distillation_adapters(fake_liger, name):
    fn = get_spec(name).providers["liger"].load()
    inputs = distillation.make_inputs(TINY, torch.float32, "cpu", {"bias": True, **get_spec(name).default_options})
    out = fn(*inputs.args, **inputs.kwargs)
    assert isinstance(out, DistillationOutput) and (out.loss.item(), out.hard_loss.item(), out.soft_loss.item()) == (1.5, 3.0, 2.0)
    fn(*inputs.args, **inputs.kwargs)
    assert [entry[0] for entry in fake_liger] == ["init", "call", "call"]  # one module per option set
    assert fake_liger[0][1] == {"weight_hard_loss": 0.5, "weight_soft_loss": 0.5, "beta": 0.5, "ignore_index": -100,
                                "temperature": 1.0, "return_soft_hard_loss": True}
    sx, sw, tx, tw, target = inputs.args
    expected = (sx, sw, tx, tw, target, inputs.kwargs["student_bias"], inputs.kwargs["teacher_bias"])
    assert all(same(a, b) for a, b in zip(fake_liger[1][1], expected, strict=True))


def test_liger_fused_linear_jsd_adapter(fake_liger):
    fn = get_spec("fused_linear_jsd").providers["liger"].load()
    inputs = flj.make_inputs(TINY, torch.float32, "cpu", {"ignore_fraction": 0.5})
    assert fn(*inputs.args, beta=0.3, temperature=2.0).item() == 0.25
    assert fake_liger[0][1] == {"jsd_beta": 0.3, "ignore_index": -100, "temperature": 2.0}
    assert all(same(a, b) for a, b in zip(fake_liger[1][1], inputs.args, strict=True))
    biased = flj.make_inputs(TINY, torch.float32, "cpu", {"bias": True})
    for unsupported in (biased.kwargs, {"reduction": "sum"}):
        with pytest.raises(NotImplementedError, match="no biases"):
            fn(*inputs.args, **unsupported)
