"""kernels_lib.hf with peft: LoRA on the attention, on the LM head, or both, patched before or after peft wraps the
model; the patched loss and every trainable gradient (the head's lora_A/lora_B included) are the unpatched peft
model's. Merged and disabled adapters, LoRA dropout on the head (applied exactly), ``modules_to_save=["lm_head"]``
and TRL's fused-head protocol on a LoRA head; what kernels_lib cannot compute from the head's parameters (DoRA,
other adapter types, forward hooks, a replaced forward) is refused by name, at patch time or at the call."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from hf_models import batch, tiny_model  # noqa: E402

from kernels_lib import hf  # noqa: E402

ATTENTION = ["q_proj", "v_proj"]
HEAD = ["lm_head"]
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _peft_model(targets, *, patch: str | None, family: str = "llama", tied: bool = False, seed: int = 0, **lora):
    """A tiny float32 model wrapped by peft with LoRA on ``targets``; ``patch``: ``"before"`` or ``"after"`` peft
    wraps it, or None (the reference). ``init_lora_weights=False``: B is random, not zero, so that A's gradient
    is non-zero and the adapter changes the loss."""
    model = tiny_model(family, tied=tied, seed=seed)
    if patch == "before":
        hf.patch(model)
    torch.manual_seed(seed + 100)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **lora)
    wrapped = peft.get_peft_model(model, config)
    if patch == "after":
        assert hf.patch(wrapped) is wrapped
    if patch is not None:
        assert hf.is_patched(wrapped) and hf.is_patched(wrapped.get_base_model())
    return wrapped


def _loss_and_grads(model, *, fused: bool, seed: int = 7):
    """The loss and the gradient of every trainable parameter (by name); ``fused``: assert the loss came from the
    fused path (no logits formed), not from the original forward."""
    input_ids, attention_mask, labels = batch()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in both models when dropout is on
    output = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    if fused:
        assert output.logits is None, "the patched peft model formed logits: its loss did not come from kernels_lib"
    else:
        assert output.logits is not None
    output.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    return output.loss.detach(), grads


def _assert_same(patched, reference, *, nonzero=()):
    loss, grads = _loss_and_grads(patched, fused=True)
    want_loss, want_grads = _loss_and_grads(reference, fused=False)
    assert torch.allclose(loss, want_loss, rtol=LOSS_RTOL, atol=0), f"loss {loss.item()} != unpatched {want_loss.item()}"
    assert grads.keys() == want_grads.keys()
    assert grads, "no trainable parameter"
    for name, want in want_grads.items():
        got = grads[name]
        if want is None:
            assert got is None, f"{name}: a gradient where the unpatched model gives none"
            continue
        assert got is not None, f"{name}: no gradient from the patched model (the unpatched model gives one)"
        error = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
        assert error <= GRAD_RTOL, f"{name}: gradient relative error {error:.2e} > {GRAD_RTOL}"
    for name in nonzero:
        matching = [n for n in grads if name in n]
        assert matching, f"no trainable parameter named like {name}"
        for n in matching:
            assert grads[n] is not None and grads[n].abs().max() > 0, f"{n}: zero gradient (the adapter is bypassed)"
    return loss


HEAD_LORA = ("lm_head.lora_A", "lm_head.lora_B")


@pytest.mark.parametrize("patch", ["before", "after"])
@pytest.mark.parametrize(
    "targets", [ATTENTION, HEAD, ATTENTION + HEAD], ids=["attention", "lm_head", "attention+lm_head"]
)
def test_lora_matches_the_unpatched_peft_model(targets, patch):
    nonzero = (HEAD_LORA if "lm_head" in targets else ()) + (("q_proj.lora_A",) if "q_proj" in targets else ())
    _assert_same(_peft_model(targets, patch=patch), _peft_model(targets, patch=None), nonzero=nonzero)


def test_lora_on_a_tied_head_and_a_trainable_base_weight():
    """Qwen2 with tied embeddings, the head's base weight trainable: its gradient (the embedding's too) matches."""

    def build(patch):
        model = _peft_model(ATTENTION + HEAD, patch=patch, family="qwen2", tied=True)
        model.get_base_model().lm_head.base_layer.weight.requires_grad_(True)
        return model

    _assert_same(build("after"), build(None), nonzero=HEAD_LORA + ("embed_tokens.weight",))


def test_lora_dropout_on_the_head_is_applied_exactly():
    """In training mode with lora_dropout > 0 the patched loss draws the unpatched model's dropout mask (same seed),
    so loss and gradients match; and the dropout is really on (another seed gives another loss)."""
    patched = _peft_model(ATTENTION + HEAD, patch="after", lora_dropout=0.3).train()
    reference = _peft_model(ATTENTION + HEAD, patch=None, lora_dropout=0.3).train()
    loss = _assert_same(patched, reference, nonzero=HEAD_LORA)
    other, _ = _loss_and_grads(patched, fused=True, seed=8)
    assert (other - loss).abs() > 1e-4, "lora_dropout on the head had no effect in training mode"


def test_merged_and_disabled_adapters():
    """The head's base weight trainable (so that a disabled or merged adapter still leaves a gradient to compare)."""
    patched, reference = _peft_model(HEAD, patch="after"), _peft_model(HEAD, patch=None)
    for model in (patched, reference):
        model.get_base_model().lm_head.base_layer.weight.requires_grad_(True)
    active = _assert_same(patched, reference, nonzero=HEAD_LORA)
    with patched.disable_adapter(), reference.disable_adapter():
        disabled = _assert_same(patched, reference)
    assert (active - disabled).abs() > 1e-3, "disabling the head's adapter did not change the loss"
    for model in (patched, reference):
        model.merge_adapter()
    merged = _assert_same(patched, reference)
    assert torch.allclose(merged, active, rtol=1e-5), "the merged adapter's loss is not the unmerged one's"
    with patched.disable_adapter(), reference.disable_adapter():  # peft unmerges a disabled layer at its forward
        again = _assert_same(patched, reference)
    assert torch.allclose(again, disabled, rtol=1e-5)


def test_several_adapters_and_switching_between_calls():
    """The active adapters are read at each call: two on the head at once, then the second alone."""
    models = []
    for patch in ("after", None):
        model = _peft_model(ATTENTION + HEAD, patch=patch)
        torch.manual_seed(200)
        model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4, target_modules=HEAD, init_lora_weights=False))
        model.base_model.set_adapter(["default", "second"])
        models.append(model)
    both = _assert_same(*models, nonzero=HEAD_LORA)
    for model in models:
        model.set_adapter("second")
    alone = _assert_same(*models, nonzero=("lm_head.lora_B.second",))
    assert (both - alone).abs() > 1e-3


def test_modules_to_save_head():
    """modules_to_save=["lm_head"]: the loss runs on the adapter's trainable copy of the head (its gradient matches)."""

    def build(patch):
        model = tiny_model("llama")
        if patch == "before":
            hf.patch(model)
        config = peft.LoraConfig(r=4, target_modules=ATTENTION, modules_to_save=HEAD, init_lora_weights=False)
        return peft.get_peft_model(model, config)

    patched, reference = build("before"), build(None)
    with torch.no_grad():  # the copies differ from the original head: using the original would show
        for model in (patched, reference):
            model.get_base_model().lm_head.modules_to_save["default"].weight.mul_(1.5)
    _assert_same(patched, reference, nonzero=("lm_head.modules_to_save.default.weight",))


def test_trl_fused_head_on_a_lora_head():
    """``add_fused_lm_head`` on a peft model: per-token log-probabilities and the head's LoRA gradients are the
    unpatched model's (log-softmax of its logits)."""
    input_ids, attention_mask, labels = batch()
    patched, reference = _peft_model(HEAD, patch=None), _peft_model(HEAD, patch=None)
    hf.add_fused_lm_head(patched)
    out = patched(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    logits = reference(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    target = labels[:, 1:]
    want = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])[..., 0] * (target != -100)
    assert torch.allclose(out.log_probs, want, rtol=1e-5, atol=1e-6)
    out.log_probs.sum().backward()
    want.sum().backward()
    for name, p in reference.named_parameters():
        if p.requires_grad:
            got = dict(patched.named_parameters())[name].grad
            assert p.grad.abs().max() > 0, name
            assert torch.allclose(got, p.grad, rtol=1e-4, atol=1e-6), f"{name}: gradient differs"


# ------------------------------------------------------------------------------------------------ refused


def test_dora_on_the_head_is_refused_by_name():
    with pytest.raises(ValueError, match=r"adapter 'default'.*DoRA"):
        _peft_model(HEAD, patch="after", use_dora=True)
    model = _peft_model(ATTENTION, patch="before")  # DoRA arriving after patching: refused at the call
    model.add_adapter("dora", peft.LoraConfig(r=2, target_modules=HEAD, use_dora=True))
    model.set_adapter("dora")
    with pytest.raises(ValueError, match=r"adapter 'dora'.*DoRA"):
        _loss_and_grads(model, fused=True)


def test_other_adapter_types_on_the_head_are_refused_by_name():
    model = tiny_model("llama")
    hf.patch(model)
    wrapped = peft.get_peft_model(model, peft.LoHaConfig(r=2, target_modules=HEAD))
    with pytest.raises(ValueError, match=r"peft\.tuners\.loha\.layer\.Linear"):
        _loss_and_grads(wrapped, fused=True)
    with pytest.raises(ValueError, match=r"loha"):
        hf.patch(wrapped)


def _rescale(module, inputs, output):
    return output * 2


def test_a_forward_hook_on_the_head_is_refused_by_name():
    """A hook added after patching is caught at the call; patching a hooked head is refused at once."""
    model = _peft_model(ATTENTION + HEAD, patch="after")
    handle = model.get_base_model().lm_head.register_forward_hook(_rescale)
    with pytest.raises(ValueError, match=r"forward hook .*test_hf_lora\._rescale"):
        _loss_and_grads(model, fused=True)
    with pytest.raises(ValueError, match=r"_rescale"):
        hf.patch(model)
    handle.remove()
    plain = tiny_model("llama")
    hf.patch(plain)
    plain.lm_head.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match=r"forward pre-hook .*<lambda>"):
        _loss_and_grads(plain, fused=True)
    base = _peft_model(HEAD, patch="before")
    base.get_base_model().lm_head.base_layer.register_forward_hook(_rescale)  # on the LoRA layer's base_layer
    with pytest.raises(ValueError, match=r"base_layer has a forward hook .*_rescale"):
        _loss_and_grads(base, fused=True)


def test_a_replaced_head_forward_or_a_non_linear_head_is_refused():
    model = tiny_model("llama")
    hf.patch(model)
    model.lm_head.forward = lambda hidden: torch.nn.functional.linear(hidden, model.lm_head.weight) * 2
    with pytest.raises(ValueError, match=r"forward is replaced .*lambda"):
        _loss_and_grads(model, fused=True)

    class ScaledLinear(torch.nn.Linear):
        def forward(self, hidden):
            return super().forward(hidden) * 2

    other = tiny_model("llama")
    hf.patch(other)
    head = ScaledLinear(other.config.hidden_size, other.config.vocab_size, bias=False)
    head.weight = other.lm_head.weight
    other.lm_head = head
    with pytest.raises(ValueError, match=r"ScaledLinear, not an nn\.Linear"):
        _loss_and_grads(other, fused=True)
