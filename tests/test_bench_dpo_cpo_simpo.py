"""The measurement side of DPO, CPO and SimPO: specs, inputs, floors, Liger adapters (stand-ins), tiny
CPU sweeps and checks against the baseline."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from kernels_lib import default_device
from kernels_workbench import data
from kernels_workbench.bench import fused_linear_cpo as cpo
from kernels_workbench.bench import fused_linear_dpo as dpo
from kernels_workbench.bench import fused_linear_simpo as simpo
from kernels_workbench.bench.registry import get_spec, registered_losses
from kernels_workbench.bench.sweep import MEASURED_COLUMNS, run_sweep
from kernels_workbench.check import assert_checks_pass, check_against_reference

DEVICE = default_device()
needs_cpu = pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU-machine behaviour (no CUDA: Liger cannot run)")
TINY = {"B": 4, "T": 5, "H": 16, "V": 67}
NAMES = ["fused_linear_dpo_loss", "fused_linear_cpo_loss", "fused_linear_simpo_loss"]


@pytest.mark.parametrize("name", NAMES)
def test_registered_with_the_published_workload(name):
    assert name in registered_losses()
    spec = get_spec(name)
    assert list(spec.providers) == ["kernels_lib", "huggingface", "liger", "trl"] and spec.baseline == "huggingface"
    assert spec.published == {"x_name": "B", "x_label": "B", "x_values": [2, 4, 8, 16],
                              "sizes": {"T": 1024, "H": 4096, "V": 128256}, "dtype": torch.bfloat16}
    small = spec.small
    assert small["x_name"] == "B" and max(small["x_values"]) * small["sizes"]["T"] * small["sizes"]["V"] < 10**5


@pytest.mark.parametrize("name", ["fused_linear_cpo_loss", "fused_linear_simpo_loss"])
def test_presets_match_the_published_rows(name):
    """CPO's and SimPO's published rows (copied unchanged into data/published); DPO has no published
    chart, hence our own name for it."""
    rows = data.load_published()
    assert not rows.kernel_name.str.contains("dpo").any()
    rows = rows[rows.kernel_name == name]
    assert set(rows.kernel_provider) == {"liger", "huggingface"} and set(rows.x_value) == set(get_spec(name).published["x_values"])
    config = json.loads(rows.extra_benchmark_config_str.iloc[0])
    assert config == {"T": 1024, "H": 4096, "V": 128256, "mode": "forward", "dtype": "torch.bfloat16"}


def test_dpo_inputs_reference_without_grad():
    inputs = dpo.make_inputs(TINY, torch.bfloat16, DEVICE, {"ignore_fraction": 0.5, "beta": 0.2, "bias": True}, seed=1)
    x, weight, target, bias = inputs.args
    kw = inputs.kwargs
    assert x.shape == kw["ref_x"].shape == (4, 5, 16) and weight.shape == kw["ref_weight"].shape == (67, 16)
    assert bias.shape == kw["ref_bias"].shape == (67,) and target.shape == (4, 5)
    assert inputs.grad_inputs == [x, weight, bias] and not any(kw[k].requires_grad for k in ("ref_x", "ref_weight", "ref_bias"))
    assert (target == -100).sum().item() == round(0.5 * 4 * 4) and (target[:, 0] != -100).all()
    assert {k: v for k, v in kw.items() if not k.startswith("ref_")} == {"beta": 0.2}
    with pytest.raises(ValueError, match="even"):
        dpo.make_inputs({**TINY, "B": 3}, torch.float32, DEVICE, {})


def test_floors():
    sizes = {"B": 2, "T": 3, "H": 5, "V": 7}
    product = 2 * 2 * 3 * 5 * 7
    assert dpo.flops(sizes, "forward") == 2 * product and dpo.flops(sizes, "full") == 4 * product
    assert dpo.bytes_moved(sizes, torch.bfloat16, "forward") == 2 * (30 + 35) * 2 + 6 * 8
    assert dpo.bytes_moved(sizes, torch.bfloat16, "full") == 3 * (30 + 35) * 2 + 6 * 8
    assert cpo.flops(sizes, "full") == simpo.flops(sizes, "full") == 3 * product  # ORPO's: no reference model


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
    for name in ("LigerFusedLinearDPOLoss", "LigerFusedLinearCPOLoss", "LigerFusedLinearSimPOLoss"):
        setattr(chunked, name, lambda **o: _Module(log, **o))
    monkeypatch.setitem(sys.modules, "liger_kernel", package)
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", chunked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return log


def _args():
    return torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3, dtype=torch.long)


def test_liger_cpo_adapter(fake_liger):
    fn = cpo.PROVIDERS["liger"].load()
    x, w, target = _args()
    assert fn(x, w, target, beta=0.2, cpo_alpha=0.5, label_smoothing=0.1, chunk_size=64).item() == 1.5
    fn(x, w, target, beta=0.2, cpo_alpha=0.5, label_smoothing=0.1)
    fn(x, w, target, cpo_alpha=0.0)
    assert [entry[0] for entry in fake_liger] == ["init", "call", "call", "init", "call"]  # one module per option set
    assert fake_liger[0][1] == {"ignore_index": -100, "beta": 0.2, "alpha": 0.5, "label_smoothing": 0.1, "compute_nll_loss": True}
    assert fake_liger[3][1]["compute_nll_loss"] is False
    args = fake_liger[1][1]
    assert args[0] is w and args[1] is x and args[2] is target and args[3] is None
    for unsupported in (dict(loss_type="ipo"), dict(alpha=0.1), dict(nll_target=target)):
        with pytest.raises(NotImplementedError, match="sigmoid"):
            fn(x, w, target, **unsupported)


def test_liger_simpo_adapter(fake_liger):
    fn = simpo.PROVIDERS["liger"].load()
    x, w, target = _args()
    assert fn(x, w, target, beta=2.0, simpo_gamma=0.7).item() == 1.5
    assert fake_liger[0][1] == {"ignore_index": -100, "beta": 2.0, "alpha": 1.0, "label_smoothing": 0.0,
                                "compute_nll_loss": True, "gamma": 0.7}
    with pytest.raises(NotImplementedError, match="AlphaPO"):
        fn(x, w, target, alpha=0.2)


def test_liger_dpo_adapter(fake_liger):
    fn = dpo.PROVIDERS["liger"].load()
    inputs = dpo.make_inputs(TINY, torch.float32, "cpu", get_spec("fused_linear_dpo_loss").default_options)
    assert fn(*inputs.args, **inputs.kwargs).item() == 1.5
    assert fake_liger[0][1] == {"ignore_index": -100, "beta": 0.1, "compute_nll_loss": False, "use_ref_model": True,
                                "average_log_prob": False, "loss_type": "sigmoid", "label_smoothing": 0.0, "discopop_tau": 0.05}
    x, w, target, bias = inputs.args
    kw = inputs.kwargs
    assert all(a is b for a, b in zip(fake_liger[1][1], (w, x, target, bias, kw["ref_x"], kw["ref_weight"], kw["ref_bias"]), strict=True))
    with pytest.raises(NotImplementedError, match="reference model"):
        fn(x, w, target, ref_logps=torch.zeros(4))
    for unsupported in (dict(loss_type="ipo"), dict(loss_type=["sigmoid", "hinge"]), dict(loss_weights=[2.0])):
        with pytest.raises(NotImplementedError, match="one loss type"):
            fn(*inputs.args, **(kw | unsupported))
    with pytest.raises(NotImplementedError, match="f-divergence"):
        fn(*inputs.args, **kw, f_divergence_type="js_divergence")


# --------------------------------------------------------------------------- sweeps and checks on CPU


@needs_cpu
@pytest.mark.parametrize("name", NAMES)
def test_tiny_sweep(name):
    rows = run_sweep(name, x_name="B", x_values=[2], sizes={"T": 4, "H": 16, "V": 67}, dtype=torch.float32,
                     device=DEVICE, modes=["forward", "full"])
    assert list(rows.columns) == MEASURED_COLUMNS and len(rows) == 3 * 2  # 3 providers (TRL's head runs on CPU) x 2 modes
    assert set(rows.kernel_provider) == {"kernels_lib", "huggingface", "trl"} and rows.y_value_50.notna().all()
    assert rows.note.str.contains("liger skipped").all() and (rows.kernel_name == name).all()


@pytest.mark.parametrize("name", NAMES)
def test_checks_against_the_baseline(name):
    extra = {"bias": True, "ignore_fraction": 0.3}
    cases = [{"dtype": torch.float32}, {"dtype": torch.bfloat16}, {"dtype": torch.float32, **extra}]
    if name == "fused_linear_dpo_loss":
        cases.append({"dtype": torch.float32, "loss_type": "ipo", **extra})
    elif name == "fused_linear_cpo_loss":
        cases.append({"dtype": torch.float32, "loss_type": "hinge", "cpo_alpha": 0.0})
    table = check_against_reference(name, cases, TINY, DEVICE)
    assert_checks_pass(table)
    assert (table.loc[table.dtype == "float32", "kernels_lib loss err"] < 1e-5).all()


def test_liger_modules_compute_our_losses():
    """Liger's own modules, run eagerly (``compiled=False``: plain torch, on the library's device), built with the options
    our adapters give them, agree with kernels_lib: the adapters map the same loss (``alpha`` is our
    ``cpo_alpha``, ``gamma`` our ``simpo_gamma``), so the GPU sweep compares like with like."""
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    from kernels_lib.fused_linear_cpo import fused_linear_cpo, fused_linear_simpo
    from kernels_lib.fused_linear_dpo import fused_linear_dpo

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 6, 16, generator=gen), torch.randn(67, 16, generator=gen) * 0.25
    ref_x, ref_w = torch.randn(4, 6, 16, generator=gen), torch.randn(67, 16, generator=gen) * 0.25
    target = torch.randint(0, 67, (4, 6), generator=gen)
    target[:, :2] = -100
    x, w, ref_x, ref_w, target = (t.to(DEVICE) for t in (x, w, ref_x, ref_w, target))
    cases = [
        (chunked.LigerFusedLinearCPOLoss(beta=0.2, alpha=0.5, label_smoothing=0.1, compute_nll_loss=True, compiled=False), (),
         lambda x_, w_: fused_linear_cpo(x_, w_, target, beta=0.2, cpo_alpha=0.5, label_smoothing=0.1)),
        (chunked.LigerFusedLinearSimPOLoss(beta=2.0, alpha=1.0, gamma=0.7, compute_nll_loss=True, compiled=False), (),
         lambda x_, w_: fused_linear_simpo(x_, w_, target, beta=2.0, simpo_gamma=0.7)),
        (chunked.LigerFusedLinearDPOLoss(beta=0.1, compute_nll_loss=False, use_ref_model=True, compiled=False), (ref_x, ref_w, None),
         lambda x_, w_: fused_linear_dpo(x_, w_, target, ref_x=ref_x, ref_weight=ref_w)),
    ]
    for module, reference_model, ours in cases:
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        theirs = module(ws, xs, target, None, *reference_model)[0]
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        mine = ours(xo, wo).loss
        assert abs(theirs.item() - mine.item()) < 1e-5 * abs(mine.item())
        for a, b in zip(torch.autograd.grad(theirs, (xs, ws)), torch.autograd.grad(mine, (xo, wo))):
            assert ((a - b).norm() / b.norm()).item() < 1e-5
