"""The ``trl`` providers of DPO, CPO, SimPO and GRPO: TRL 1.16's fused head, then the trainer's loss.

They must compute the same loss and gradients as the baseline on materialized logits (the head is the
only difference), and the head must really be TRL's ``ChunkedLogProbFunction`` (counted), for the
policy and for the reference model.
"""

from __future__ import annotations

import pytest
import torch

from kernels_lib import reference
from kernels_workbench.bench.registry import get_spec

pytest.importorskip("trl.kernels")

CASES = [
    ("fused_linear_dpo_loss", {}),
    ("fused_linear_dpo_loss", {"loss_type": "ipo", "bias": True}),
    ("fused_linear_cpo_loss", {}),
    ("fused_linear_cpo_loss", {"loss_type": "hinge", "cpo_alpha": 0.0}),
    ("fused_linear_cpo_loss", {"label_smoothing": 0.1, "bias": True}),
    ("fused_linear_simpo_loss", {}),
    ("fused_linear_grpo_loss_token", {"return_entropy": True, "temperature": 0.7}),
    ("fused_linear_grpo_loss_sequence", {"loss_type": "grpo"}),
]
SIZES = {"B": 4, "T": 5, "H": 24, "V": 131}


@pytest.fixture
def trl_calls(monkeypatch):
    """Counts the calls of TRL's fused head."""
    from trl.kernels import ChunkedLogProbFunction

    calls = []
    apply = ChunkedLogProbFunction.apply

    def counted(*args):
        calls.append(args[0].shape)
        return apply(*args)

    monkeypatch.setattr(ChunkedLogProbFunction, "apply", counted)
    return calls


@pytest.mark.parametrize("name,options", CASES)
def test_trl_path_equals_the_baseline(name, options, trl_calls):
    spec = get_spec(name)
    module = __import__(spec.make_inputs.__module__, fromlist=["DATA_OPTIONS"])
    data_options = {k: options[k] for k in getattr(module, "DATA_OPTIONS", ()) if k in options}
    call_options = {k: v for k, v in options.items() if k not in data_options}
    results = {}
    for provider in (spec.baseline, "trl"):
        inputs = spec.make_inputs(SIZES, torch.float32, "cpu", {**spec.default_options, **data_options, "ignore_fraction": 0.3}, seed=3)
        out = spec.providers[provider].load()(*inputs.args, **{**inputs.kwargs, **call_options})
        out.loss.backward()
        results[provider] = (out, [t.grad.clone() for t in inputs.grad_inputs])
    (base, base_grads), (trl, trl_grads) = results[spec.baseline], results["trl"]
    assert trl_calls, "TRL's ChunkedLogProbFunction was not called"
    if "ref_x" in inputs.kwargs and inputs.kwargs["ref_x"] is not None:
        assert len(trl_calls) >= 2, "the reference model's log-probs did not go through TRL's head"
    torch.testing.assert_close(trl.loss, base.loss, rtol=1e-5, atol=1e-6)
    for field in base._fields[1:]:
        a, b = getattr(trl, field), getattr(base, field)
        if b is None:
            assert a is None, field
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True, msg=field)
    for a, b in zip(trl_grads, base_grads):
        assert torch.linalg.vector_norm(a - b) <= 1e-5 * torch.linalg.vector_norm(b)


def test_the_head_swap_is_scoped():
    """Outside ``token_logps_from`` the references use the materialized head again, even after an error."""
    seen = []

    def head(*args):
        seen.append(True)
        raise RuntimeError("boom")

    x, w = torch.randn(2, 3, 8), torch.randn(11, 8)
    target = torch.randint(0, 11, (2, 3))
    with pytest.raises(RuntimeError, match="boom"), reference.token_logps_from(head):
        reference.fused_linear_cpo(x, w, target)
    assert seen and torch.isfinite(reference.fused_linear_cpo(x, w, target).loss)
