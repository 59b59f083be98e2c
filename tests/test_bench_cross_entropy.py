"""The measurement side of the logits-level cross-entropy: the ``cross_entropy`` (A100) and
``megatron_cross_entropy`` (H100) specs, their presets against the published rows, the Liger and
Megatron adapters (Liger's own functions through Triton's interpreter; Megatron, not installed here,
through stand-ins that compute its documented per-token loss), tiny CPU sweeps and checks."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kernels_lib
from kernels_lib import default_device
from kernels_workbench import data
from kernels_workbench.bench import cross_entropy as ce_bench
from kernels_workbench.bench import megatron_cross_entropy as mg_bench
from kernels_workbench.bench.registry import get_spec, registered_losses
from kernels_workbench.bench.sweep import MEASURED_COLUMNS, available_providers, run_sweep
from kernels_workbench.check import TOLERANCE, assert_checks_pass, check_against_reference, relative_error

DEVICE = default_device()
needs_cpu = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU-machine behaviour (no CUDA: Liger cannot run)")
NAMES = ["cross_entropy", "megatron_cross_entropy"]
VOCAB = [4096, 8192, 16384, 32768, 65536, 131072]


# --------------------------------------------------------------------------- presets and published rows


def test_registered_with_the_published_workloads():
    assert set(NAMES) <= set(registered_losses())
    ce, mg = get_spec("cross_entropy"), get_spec("megatron_cross_entropy")
    assert ce.published == {"x_name": "V", "x_label": "vocab size", "x_values": VOCAB, "sizes": {"B": 8, "T": 2048},
                            "dtype": torch.float32}
    assert mg.published == {"x_name": "V", "x_label": "vocab size", "x_values": VOCAB,
                            "sizes": {"S": 2048, "B": 4, "TP": 1}, "dtype": torch.bfloat16}
    assert list(ce.providers) == ["kernels_lib", "torch", "liger"] and ce.baseline == "torch"
    assert list(mg.providers) == ["kernels_lib", "torch", "liger", "megatron-fused", "megatron-unfused"]
    assert mg.baseline == "torch" and mg.default_options == {"reduction": "sum"}
    for spec in (ce, mg):
        small = spec.small
        rows = ce_bench.n_rows(small["sizes"])
        assert small["x_name"] == "V" and rows * max(small["x_values"]) <= 2**16, "too large for the interpreter"


@pytest.mark.parametrize("name", NAMES)
def test_presets_match_the_published_rows(name):
    spec = get_spec(name)
    rows = data.load_published(name)
    assert sorted(set(rows.x_value)) == spec.published["x_values"]
    assert set(rows.x_name) == {"V"} and set(rows.x_label) == {spec.published["x_label"]}
    configs = {s for s in rows.extra_benchmark_config_str}
    assert len(configs) == 1 and json.loads(configs.pop()) == spec.published["sizes"]
    renamed = set(rows.kernel_provider.replace(ce_bench.PUBLISHED_ALIASES))  # "huggingface" is our torch
    assert renamed <= set(spec.providers), "a published provider without an adapter"


def test_cross_entropy_published_rows_were_float32_logits_renamed_torch():
    """Liger's memory at V = 4096 is one float32 B·T × V buffer (its gradient written over the
    logits): the preset's rows and dtype; the published "huggingface" is our torch baseline."""
    rows = ce_bench.published_rows()
    assert set(rows.kernel_provider) == {"liger", "torch"}
    memory = rows[(rows.metric_name == "memory") & (rows.kernel_provider == "liger") & (rows.x_value == 4096)]
    one_buffer = 8 * 2048 * 4096 * torch.finfo(torch.float32).bits // 8 / 2**20
    assert memory.y_value_50.iloc[0] == pytest.approx(one_buffer, rel=0.01)


def test_inputs_options_and_floors():
    inputs = ce_bench.make_inputs({"B": 2, "T": 5, "V": 33}, torch.bfloat16, DEVICE,
                                  {"ignore_fraction": 0.4, "reduction": "none", "label_smoothing": 0.1}, seed=3)
    logits, target = inputs.args
    assert logits.shape == (10, 33) and logits.dtype == torch.bfloat16 and logits.requires_grad
    assert inputs.grad_inputs == [logits] and target.dtype == torch.int64
    assert (target == -100).sum().item() == 4 and ((target >= 0) & (target < 33)).sum().item() == 6
    assert inputs.kwargs == {"reduction": "none", "label_smoothing": 0.1}
    assert mg_bench.make_inputs({"S": 3, "B": 2, "TP": 1, "V": 7}, torch.float32, DEVICE, {}).args[0].shape == (6, 7)
    with pytest.raises(ValueError, match="TP must be 1"):
        mg_bench.make_inputs({"S": 3, "B": 2, "TP": 2, "V": 7}, torch.float32, DEVICE, {})
    sizes = {"B": 2, "T": 3, "V": 7}
    assert ce_bench.bytes_moved(sizes, torch.float32, "forward_no_grad") == 6 * 7 * 4 + 6 * 8
    assert ce_bench.bytes_moved(sizes, torch.bfloat16, "full") == 2 * 6 * 7 * 2 + 6 * 8
    assert mg_bench.SPEC.bytes_moved({"S": 3, "B": 2, "V": 7}, torch.float32, "backward") == 2 * 6 * 7 * 4 + 6 * 8


# --------------------------------------------------------------------------- Liger adapters (its own kernels, interpreted)


@pytest.fixture
def liger_here(monkeypatch):
    """Liger's Triton kernels run in the interpreter too: lift the specs' CUDA guard for the test."""
    pytest.importorskip("liger_kernel.megatron")
    for module in (ce_bench, mg_bench):
        monkeypatch.setattr(module, "require_cuda", lambda peer: None)


def _logits(n=6, v=41, dtype=torch.float32, seed=0, ignored=(1,)):
    inputs = ce_bench.make_inputs({"N": n, "V": v}, dtype, DEVICE, {}, seed)
    logits, target = inputs.args
    target[list(ignored)] = -100
    return logits.detach(), target


def _loss_and_grad(fn, logits, target, **kwargs):
    leaf = logits.clone().requires_grad_()
    out = fn(leaf, target, **kwargs)
    out.sum().backward()
    return out.detach(), leaf.grad


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_liger_adapters_compute_our_loss(liger_here, name, reduction):
    liger = get_spec(name).providers["liger"].load()
    logits, target = _logits()
    got, grad = _loss_and_grad(liger, logits, target, reduction=reduction, label_smoothing=0.1)
    want, want_grad = _loss_and_grad(kernels_lib.cross_entropy, logits, target, reduction=reduction, label_smoothing=0.1)
    assert got.shape == want.shape
    assert relative_error(got, want) < TOLERANCE[torch.float32] and relative_error(grad, want_grad) < TOLERANCE[torch.float32]


def test_liger_megatron_adapter_refuses_class_weights(liger_here):
    liger = mg_bench.PROVIDERS["liger"].load()
    with pytest.raises(NotImplementedError, match="class weights"):
        liger(*_logits(), weight=torch.ones(41))


# --------------------------------------------------------------------------- Megatron adapters (stand-ins)


def _megatron_per_token(logits, target, alpha=0.0):
    """Megatron's documented per-token loss on one rank: ``lse - z_y`` for a target in range, else
    ``lse - max`` (the target is taken as another rank's); label smoothing ``α`` spreads
    ``s = α V/(V-1)``: ``(1 - s) loss - s mean_j log p_j``."""
    z = logits.float()
    v = z.shape[-1]
    lse = torch.logsumexp(z, -1)
    owned = (target >= 0) & (target < v)
    z_y = torch.where(owned, z.gather(-1, target.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1), z.max(-1).values)
    loss = lse - z_y
    if alpha:
        s = alpha * v / (v - 1)
        loss = (1 - s) * loss - s * torch.log_softmax(z, -1).mean(-1)
    return loss


@pytest.fixture
def fake_megatron(monkeypatch):
    """``megatron.core`` stand-ins recording each call: the new signatures (``tp_group``), and an old
    unfused one that reads the group from ``parallel_state``. No process group is left behind."""
    log = {"calls": [], "init": []}

    def fused(vocab_parallel_logits, target, tp_group):
        log["calls"].append(("fused", vocab_parallel_logits, tp_group.size()))
        return _megatron_per_token(vocab_parallel_logits, target)

    def unfused(vocab_parallel_logits, target, label_smoothing=0.0, tp_group=None):
        log["calls"].append(("unfused", vocab_parallel_logits, tp_group.size(), label_smoothing))
        return _megatron_per_token(vocab_parallel_logits, target, label_smoothing)

    def unfused_old(vocab_parallel_logits, target, label_smoothing=0.0):
        log["calls"].append(("old", vocab_parallel_logits, label_smoothing))
        return _megatron_per_token(vocab_parallel_logits, target, label_smoothing)

    parallel_state = types.SimpleNamespace(
        model_parallel_is_initialized=lambda: bool(log["init"]),
        initialize_model_parallel=lambda **kw: log["init"].append(kw),
    )
    modules = {
        "megatron": types.ModuleType("megatron"),
        "megatron.core": types.ModuleType("megatron.core"),
        "megatron.core.fusions.fused_cross_entropy": types.SimpleNamespace(fused_vocab_parallel_cross_entropy=fused),
        "megatron.core.tensor_parallel.cross_entropy": types.SimpleNamespace(vocab_parallel_cross_entropy=unfused),
    }
    modules["megatron.core"].parallel_state = parallel_state
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    log["use_old_unfused"] = lambda: monkeypatch.setattr(
        sys.modules["megatron.core.tensor_parallel.cross_entropy"], "vocab_parallel_cross_entropy", unfused_old
    )
    started = not dist.is_initialized()
    yield log
    if started and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_megatron_unfused_adapter_computes_our_loss(fake_megatron, reduction, smoothing):
    """torch's ε becomes Megatron's α = ε (V-1)/V, ignored targets are zeroed, fp32 logits copied."""
    unfused = mg_bench.PROVIDERS["megatron-unfused"].load()
    logits, target = _logits(ignored=(1, 4))
    leaf = logits.clone().requires_grad_()
    got = unfused(leaf, target, reduction=reduction, label_smoothing=smoothing)
    got.sum().backward()
    want, want_grad = _loss_and_grad(F.cross_entropy, logits.double(), target, reduction=reduction, label_smoothing=smoothing)
    assert relative_error(got, want) < 1e-6 and relative_error(leaf.grad, want_grad) < 1e-6
    kind, seen, group_size, alpha = fake_megatron["calls"][-1]
    assert kind == "unfused" and group_size == 1 and alpha == pytest.approx(smoothing * 40 / 41)
    assert seen.shape == (6, 1, 41) and seen.data_ptr() != leaf.data_ptr(), "float32 logits handed over uncopied"


def test_megatron_fused_adapter(fake_megatron):
    fused = mg_bench.PROVIDERS["megatron-fused"].load()
    logits, target = _logits(dtype=torch.bfloat16)
    leaf = logits.clone().requires_grad_()
    got = fused(leaf, target, reduction="sum")
    want = F.cross_entropy(logits.double(), target, reduction="sum")
    assert relative_error(got, want) < 1e-6
    kind, seen, group_size = fake_megatron["calls"][-1]
    assert kind == "fused" and group_size == 1 and seen.data_ptr() == leaf.data_ptr(), "bf16 logits copied"
    with pytest.raises(NotImplementedError, match="label smoothing"):
        fused(leaf, target, label_smoothing=0.1)
    with pytest.raises(NotImplementedError, match="class weights"):
        fused(leaf, target, weight=torch.ones(41))


def test_megatron_old_signature_initializes_parallel_state(fake_megatron):
    fake_megatron["use_old_unfused"]()
    unfused = mg_bench.PROVIDERS["megatron-unfused"].load()
    logits, target = _logits()
    for _ in range(2):
        got = unfused(logits, target, reduction="mean")
    assert fake_megatron["init"] == [{"tensor_model_parallel_size": 1}], "parallel_state initialized once, TP = 1"
    assert relative_error(got, F.cross_entropy(logits.double(), target)) < 1e-6


def test_megatron_missing_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron... raises ImportError
    _, skipped = available_providers("megatron_cross_entropy", ["megatron-fused", "megatron-unfused"])
    assert set(skipped) == {"megatron-fused", "megatron-unfused"}
    assert all("megatron-core" in why and "ImportError" in why for why in skipped.values())


# --------------------------------------------------------------------------- sweeps and checks on CPU


@needs_cpu
@pytest.mark.parametrize("name", NAMES)
def test_tiny_sweep(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)
    spec = get_spec(name)
    rows = run_sweep(name, x_name="V", x_values=[67], sizes=spec.small["sizes"], dtype=spec.small["dtype"],
                     device=DEVICE, modes=["forward", "backward", "full"])
    assert list(rows.columns) == MEASURED_COLUMNS and len(rows) == 2 * 3  # kernels_lib and torch x 3 modes
    assert set(rows.kernel_provider) == {"kernels_lib", "torch"} and rows.y_value_50.notna().all()
    assert rows.note.str.contains("liger skipped").all() and (rows.kernel_name == name).all()
    config = json.loads(rows.extra_benchmark_config_str.iloc[0])
    assert {k: config[k] for k in spec.small["sizes"]} == spec.small["sizes"] and config["V"] == 67


@pytest.mark.parametrize("name", NAMES)
def test_checks_against_the_baseline(name):
    cases = [
        {"dtype": torch.float32},
        {"dtype": torch.bfloat16},
        {"dtype": torch.float16, "reduction": "mean"},
        {"dtype": torch.float32, "reduction": "none", "label_smoothing": 0.1, "ignore_fraction": 0.3},
        {"dtype": torch.float32, "reduction": "sum", "label_smoothing": 0.2, "ignore_fraction": 0.5},
    ]
    sizes = {**get_spec(name).small["sizes"], "V": 1031}
    table = check_against_reference(name, cases, sizes, DEVICE)
    assert_checks_pass(table)
    assert (table.loc[table.dtype == "float32", "kernels_lib loss err"] < 1e-5).all()
