"""kernels_lib.hf with DeepSpeed ZeRO-3 partitioned head parameters, DeepSpeed itself faked.

DeepSpeed is not run here (no ZeRO-3 on this CPU-only test machine). What is faked is only the
interface :func:`kernels_lib.hf` uses: a partitioned parameter carries ``ds_id`` and a ``ds_status``
whose name is ``NOT_AVAILABLE``; ``deepspeed.zero.GatheredParameters(params, modifier_rank=None)``
puts the whole tensor in ``data`` on entry and takes it away on exit. DeepSpeed leaves an empty
``data`` there; the fake leaves zeros of the full shape, so that whatever reads the parameter after
the gather reads wrong values (and the test sees it), while autograd can still accumulate the full
gradient into it (what DeepSpeed's own hooks do with that gradient is not faked: not checked here).
The tests check that the gather is entered around the loss
(with each parameter once, read-only), that the kernel reads the gathered weight, that the loss and
every gradient are the unpatched model's, and that a loss whose backward re-reads the weight
(the fused head's ``reduction="none"``) still works after the parameter is partitioned again.
"""

from __future__ import annotations

import enum
import sys
import types

import pytest
import torch
from hf_models import assert_grads_close, batch, loss_and_grads, rel_err, tiny_model

from kernels_lib import hf

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


class _Status(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2


class _FakeZero3:
    """Partitions parameters (their full values kept aside, ``data`` emptied) and gathers them as DeepSpeed would."""

    def __init__(self):
        self.full = {}
        self.entered = []  # (parameter ids, modifier_rank) per gather
        self.active = False

    def partition(self, parameter: torch.nn.Parameter, ds_id: int) -> None:
        self.full[id(parameter)] = parameter.data
        parameter.ds_id = ds_id
        parameter.ds_status = _Status.NOT_AVAILABLE
        parameter.data = torch.zeros_like(parameter.data)

    def gathered_parameters(self, params, modifier_rank=None):
        fake = self

        class GatheredParameters:
            def __enter__(self):
                fake.entered.append(([id(p) for p in params], modifier_rank))
                fake.active = True
                for p in params:
                    p.data, p.ds_status = fake.full[id(p)], _Status.AVAILABLE

            def __exit__(self, *exc):
                fake.active = False
                for p in params:
                    p.data, p.ds_status = torch.zeros_like(fake.full[id(p)]), _Status.NOT_AVAILABLE
                return False

        return GatheredParameters()


@pytest.fixture
def zero3(monkeypatch):
    fake = _FakeZero3()
    module = types.ModuleType("deepspeed")
    module.zero = types.SimpleNamespace(GatheredParameters=fake.gathered_parameters)
    monkeypatch.setitem(sys.modules, "deepspeed", module)
    return fake


def _spy_kernel(monkeypatch, fake, seen):
    kernel = hf.fused_linear_cross_entropy

    def spy(x, weight, *args, **kwargs):
        seen.append((fake.active, weight.detach().clone()))
        return kernel(x, weight, *args, **kwargs)

    monkeypatch.setattr(hf, "fused_linear_cross_entropy", spy)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_patch_gathers_the_partitioned_head_for_the_loss(zero3, monkeypatch, tied):
    model = tiny_model("llama", tied=tied)
    input_ids, attention_mask, labels = batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    ref_loss, ref_grads = loss_and_grads(model, **inputs)
    full_head = model.lm_head.weight.detach().clone()
    hf.patch(model)
    model.zero_grad(set_to_none=True)
    seen = []
    _spy_kernel(monkeypatch, zero3, seen)
    zero3.partition(model.lm_head.weight, ds_id=7)
    if tied:  # the embedding reads it through its own module: DeepSpeed's module hooks gather it there
        embedding, weight = model.get_input_embeddings(), model.lm_head.weight
        embedding.register_forward_pre_hook(lambda *_: setattr(weight, "data", zero3.full[id(weight)]))
        embedding.register_forward_hook(lambda *_: setattr(weight, "data", torch.zeros_like(weight.data)))
    loss = model(**inputs).loss
    assert zero3.entered == [([id(model.lm_head.weight)], None)]  # once, read-only, the tied parameter once
    assert len(seen) == 1 and seen[0][0] and torch.equal(seen[0][1], full_head)  # inside the gather, the whole head
    assert not model.lm_head.weight.any()  # partitioned again after the loss
    loss.backward()
    assert rel_err(loss, ref_loss) < LOSS_TOL
    assert model.lm_head.weight.grad.shape == full_head.shape  # the whole gradient, for ZeRO-3's reduce-scatter
    assert_grads_close({name: p.grad for name, p in model.named_parameters()}, ref_grads, GRAD_TOL)


def test_fused_head_backward_after_the_parameter_is_partitioned_again(zero3, monkeypatch):
    """The fused head's ``reduction="none"`` backward recomputes the logits from the weight it saved: a copy
    taken inside the gather, so the backward after the gather's exit gives the unpartitioned gradients."""
    model = tiny_model("qwen2")
    input_ids, attention_mask, labels = batch()
    hf.add_fused_lm_head(model, outputs=("log_probs", "entropy"))

    def objective():
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        return -(out.log_probs.sum() + 0.1 * out.entropy.sum()) / out.label_mask.sum()

    ref_loss = objective()
    ref_loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    zero3.partition(model.lm_head.weight, ds_id=3)
    loss = objective()
    assert len(zero3.entered) == 1 and not model.lm_head.weight.any()
    loss.backward()
    assert rel_err(loss, ref_loss) < LOSS_TOL
    assert_grads_close({name: p.grad for name, p in model.named_parameters()}, ref_grads, GRAD_TOL)


def test_no_gather_without_zero3(zero3):
    """A head without ``ds_id`` (or one DeepSpeed already holds whole) is read as it is: no gather."""
    model = hf.patch(tiny_model("llama"))
    input_ids, attention_mask, labels = batch()
    model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
    model.lm_head.weight.ds_id, model.lm_head.weight.ds_status = 1, _Status.AVAILABLE
    model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert zero3.entered == []
