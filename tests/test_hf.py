"""kernels_lib.hf against the unpatched Hugging Face models and TRL 1.16's fused LM head.

Tiny models from configs with seeded random weights (``hf_models``), float32, no download. The patched
model and the unpatched one run the very same backbone, so what differs is only how the head's loss
is summed (the kernel in chunks against torch's one cross-entropy): errors are relative in norm,
``||a - b|| / ||b||``, below ``LOSS_TOL`` = 1e-5 for losses and ``GRAD_TOL`` = 1e-4 for every
parameter's gradient (observed: ~1e-7 and ~1e-6). A wrong shift, mask, softcap or normalization is
off by 1e-2 or more.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import transformers
from hf_models import DEVICE, FAMILIES, HIDDEN, SOFTCAP, VOCAB, assert_grads_close, batch, loss_and_grads, rel_err, tiny_model

from kernels_lib import hf

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4


def _inputs(**overrides):
    input_ids, attention_mask, labels = batch()
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, **overrides}


# --------------------------------------------------------------------------- loss and gradients per family


@pytest.mark.parametrize("skip_ignored", [True, False], ids=["ignored-dropped", "ignored-kept"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loss_and_every_gradient_match_unpatched(family, tied, skip_ignored):
    """Padding (attention mask 0) and ignored labels, dropped before the head's matmuls or not; chunks of 8 rows
    so that several chunks are summed."""
    model = tiny_model(family, tied=tied)
    inputs = _inputs()
    ref_loss, ref_grads = loss_and_grads(model, **inputs)
    hf.patch(model, chunk_size=8, skip_ignored=skip_ignored)
    loss, grads = loss_and_grads(model, **inputs)
    assert loss.dtype == torch.float32
    assert rel_err(loss, ref_loss) < LOSS_TOL
    assert_grads_close(grads, ref_grads, GRAD_TOL)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_softcap_is_applied(family):
    """The patched loss follows ``final_logit_softcapping`` (read at each call, as Gemma's forward does):
    with the cap it matches the capped model, without it the uncapped one, and the two differ by far
    more than the tolerance."""
    model = tiny_model(family)
    inputs = _inputs()
    hf.patch(model)
    capped = model(**inputs).loss
    model.config.final_logit_softcapping = None
    uncapped = model(**inputs).loss
    hf.unpatch(model)
    assert rel_err(uncapped, model(**inputs).loss) < LOSS_TOL
    model.config.final_logit_softcapping = SOFTCAP
    assert rel_err(capped, model(**inputs).loss) < LOSS_TOL
    assert rel_err(capped, uncapped) > 1e-2


def test_head_with_bias():
    """A head with a bias (none of the families has one; swapped in here): loss and every gradient, the bias's too."""
    model = tiny_model("llama")
    torch.manual_seed(3)
    model.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=True).to(DEVICE)
    torch.nn.init.normal_(model.lm_head.bias, std=1.0)
    inputs = _inputs()
    ref_loss, ref_grads = loss_and_grads(model, **inputs)
    hf.patch(model)
    loss, grads = loss_and_grads(model, **inputs)
    assert "lm_head.bias" in grads
    assert rel_err(loss, ref_loss) < LOSS_TOL
    assert_grads_close(grads, ref_grads, GRAD_TOL)


# --------------------------------------------------------------------------- outputs and inference


def test_inference_unchanged_and_no_logits_with_labels():
    """No labels: the original forward, bit for bit (and greedy generation the same). Labels: no logits with
    ``keep_logits=False``, or by default while training; the logits with ``keep_logits=True``, or by default
    when inferring (eval mode, no grad: what Trainer.evaluate runs)."""
    model = tiny_model("gemma2")
    inputs = _inputs()
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        ref = model(**inputs)
        ref_logits = model(**no_labels).logits
        hf.patch(model, keep_logits=False)
        assert torch.equal(model(**no_labels).logits, ref_logits)  # the original forward, bit for bit
        out = model(**inputs)
        hf.patch(model, keep_logits=True)
        kept = model(**inputs)
        hf.patch(model)
        inferred = model(**inputs)
        model.train()
        training = model(**inputs)
        model.eval()
    with_grad = model(**inputs)  # eval mode under autograd: still lean by default
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast)
    assert out.logits is None and out.loss is not None
    assert training.logits is None and with_grad.logits is None
    assert set(out.keys()) == set(ref.keys()) - {"logits"}  # the cache is passed through as before
    for got in (kept, inferred):
        assert torch.equal(got.logits, ref.logits)  # formed as Gemma's forward forms them, softcap included
        assert rel_err(got.loss, ref.loss) < LOSS_TOL
    with pytest.raises(TypeError, match="keep_logits must be True, False or None"):
        hf.patch(model, keep_logits="yes")
    prompt = inputs["input_ids"][:1, :5]
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, hf.unpatch(model).generate(prompt, max_new_tokens=4, do_sample=False))


def test_backbone_outputs_and_tuple_output_pass_through():
    model = tiny_model("llama", layers=2)
    inputs = _inputs(output_hidden_states=True, output_attentions=True, use_cache=False)
    with torch.no_grad():
        ref = model(**inputs)
        hf.patch(model)
        out = model(**inputs)
        as_tuple = model(**inputs, return_dict=False)
    assert len(out.hidden_states) == len(ref.hidden_states) == 3
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, ref.hidden_states))
    assert all(torch.equal(a, b) for a, b in zip(out.attentions, ref.attentions))
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.loss)


def test_positional_labels():
    """Arguments are bound to the class's forward: labels passed positionally take the fused path too."""
    model = tiny_model("qwen2")
    input_ids, attention_mask, labels = batch()
    with torch.no_grad():
        ref = model(input_ids, attention_mask, None, None, None, labels).loss
        hf.patch(model, keep_logits=False)
        out = model(input_ids, attention_mask, None, None, None, labels)
    assert out.logits is None
    assert rel_err(out.loss, ref) < LOSS_TOL


# --------------------------------------------------------------------------- patch bookkeeping


def test_unpatch_restores_and_double_patch_is_harmless(monkeypatch):
    model = tiny_model("llama")
    inputs = _inputs()
    assert not hf.is_patched(model) and "forward" not in model.__dict__
    calls = []
    kernel = hf.fused_linear_cross_entropy
    monkeypatch.setattr(hf, "fused_linear_cross_entropy", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    hf.patch(model)
    hf.patch(model, chunk_size=4, keep_logits=False)  # updates the options, wraps nothing twice
    assert hf.is_patched(model)
    with torch.no_grad():
        fused = model(**inputs)
    assert len(calls) == 1 and fused.logits is None
    hf.unpatch(model)
    assert not hf.is_patched(model)
    assert "forward" not in model.__dict__ and model.forward.__func__ is type(model).forward
    with torch.no_grad():
        assert model(**inputs).logits is not None
    assert len(calls) == 1
    hf.unpatch(model)  # unpatching an unpatched model changes nothing


def test_deepcopy_of_a_patched_model_is_patched_on_its_own():
    """``copy.deepcopy`` (as TRL does for reference models) gives a model whose fused forward drives its own weights."""
    model = hf.patch(tiny_model("llama"))
    twin = copy.deepcopy(model)
    assert hf.is_patched(twin) and twin.forward.__self__ is twin
    out = twin(**_inputs())
    out.loss.backward()
    assert out.logits is None
    assert twin.lm_head.weight.grad is not None and model.lm_head.weight.grad is None


def test_unpatch_restores_a_previous_instance_forward():
    """A forward already patched on the instance (here TRL's fused head) is kept under ours and restored after."""
    from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head

    model = tiny_model("llama")
    trl_add_fused_lm_head(model)
    theirs = model.__dict__["forward"]
    inputs = _inputs()
    hf.patch(model, keep_logits=False)
    with torch.no_grad():
        assert model(**inputs).logits is None  # ours, for the loss
        assert model(**inputs, fused_lm_head=True).log_probs is not None  # TRL's fused head, still reachable
    hf.unpatch(model)
    assert model.__dict__["forward"] is theirs


class _ZLossLlama(transformers.LlamaForCausalLM):
    """A forward that adds a term of the logits to the loss, which kernels_lib does not compute."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
            loss = loss + 1e-4 * logits.logsumexp(-1).pow(2).mean()
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class _ClampedLlama(transformers.LlamaForCausalLM):
    """A forward that transforms the logits in a way kernels_lib does not know (a clamp)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        logits = logits.clamp(-5.0, 5.0)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class _LogitsAfterLossLlama(transformers.LlamaForCausalLM):
    """A forward that uses the logits after the loss (an extra output computed from them)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits.float() * 2)


@pytest.mark.parametrize(
    "cls, reason",
    [
        (_ZLossLlama, r"its loss is not Transformers' ForCausalLMLoss.*logsumexp"),
        (_ClampedLlama, r"its forward applies `logits = logits.clamp\(-5.0, 5.0\)` to the logits"),
        (_LogitsAfterLossLlama, r"its forward uses the logits after the loss"),
    ],
    ids=["extra-loss-term", "unknown-transform", "logits-after-loss"],
)
def test_forwards_that_depart_from_the_pattern_are_refused_by_name(cls, reason):
    """A forward other than backbone -> head -> known transforms -> ForCausalLMLoss (+ terms not of the logits) is
    refused when patching, naming the class and the statement: never patched with a silent difference."""
    model = cls(tiny_model("llama").config).eval()
    with pytest.raises(ValueError, match=rf"does not support {cls.__name__} \(model_type='llama'\): {reason}"):
        hf.patch(model)
    with pytest.raises(ValueError, match=cls.__name__):
        hf.add_fused_lm_head(model)
    with pytest.raises(ValueError, match=cls.__name__):
        hf.forward_pattern(cls)
    assert not hf.is_patched(model)


def test_unsupported_models_are_refused():
    bert = transformers.BertLMHeadModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        is_decoder=True))
    with pytest.raises(ValueError, match=r"BertLMHeadModel \(model_type='bert'\).*self\.cls \(BertOnlyMLMHead\).*"
                                         r"not its output embeddings"):
        hf.patch(bert)
    classifier = transformers.LlamaForSequenceClassification(tiny_model("llama").config)
    with pytest.raises(ValueError, match="LlamaForSequenceClassification"):
        hf.patch(classifier)

    gemma = tiny_model("gemma2")
    gemma.config = tiny_model("llama").config  # a config without Gemma's final_logit_softcapping
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM.*reads self.config.final_logit_softcapping.*no attribute"):
        hf.patch(gemma)
    llama = tiny_model("llama")
    llama.lm_head = torch.nn.Identity()
    with pytest.raises(ValueError, match="LlamaForCausalLM.*(no nn.Linear LM head|not its output embeddings)"):
        hf.patch(llama)
    assert not hf.is_patched(bert) and not hf.is_patched(gemma) and not hf.is_patched(llama)


@pytest.mark.parametrize("model_type", ["gpt2", "cohere", "granitemoe", "mixtral", "bart"])
def test_found_from_the_forward(model_type):
    """Classes outside the seven families, found from their forward: GPT-2 (``self.transformer``), Cohere's
    ``logit_scale``, Granite-MoE's ``logits_scaling`` (divides) with its router's auxiliary loss, Mixtral's
    auxiliary loss, Bart's decoder with an unshifted ``CrossEntropyLoss``. Loss and every gradient, the
    transforms set so that a missed one is off by far more than the tolerance."""
    from kernels_workbench import hf_coverage

    row = hf_coverage.check(model_type, hf_coverage.causal_lm_mapping()[model_type])
    assert row.result == "matched", row
    assert row.loss_rel_err < LOSS_TOL and row.grad_rel_err < GRAD_TOL


# --------------------------------------------------------------------------- Transformers' loss semantics


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_num_items_in_batch(as_tensor):
    """The summed loss over ``num_items_in_batch`` (Trainer's gradient accumulation), an int or a 0-dim tensor."""
    model = tiny_model("mistral")
    num_items = torch.tensor(37, device=DEVICE) if as_tensor else 37
    inputs = _inputs(num_items_in_batch=num_items)
    ref_loss, ref_grads = loss_and_grads(model, **inputs)
    mean_loss = model(**_inputs()).loss
    hf.patch(model)
    loss, grads = loss_and_grads(model, **inputs)
    assert rel_err(loss, ref_loss) < LOSS_TOL
    assert_grads_close(grads, ref_grads, GRAD_TOL)
    assert rel_err(loss, mean_loss) > 1e-2  # 37 is not the number of valid labels (16)


def test_shift_labels():
    """Pre-shifted labels are used as given (no shift), alone or beside ``labels``."""
    model = tiny_model("qwen3")
    input_ids, attention_mask, labels = batch()
    shift_labels = torch.roll(labels, -1, dims=1)  # a different alignment from the default shift
    shift_labels[:, -1] = -100
    shift_labels[0, 5] = -100
    with_labels = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels, shift_labels=shift_labels)
    ref_loss, ref_grads = loss_and_grads(model, **with_labels)
    hf.patch(model)
    loss, grads = loss_and_grads(model, **with_labels)
    assert rel_err(loss, ref_loss) < LOSS_TOL
    assert_grads_close(grads, ref_grads, GRAD_TOL)
    alone = model(input_ids=input_ids, attention_mask=attention_mask, shift_labels=shift_labels).loss
    assert rel_err(alone, ref_loss) < LOSS_TOL
    default_shift = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    assert rel_err(default_shift, ref_loss) > 1e-2


@pytest.mark.parametrize("keep", [5, "index"])
def test_logits_to_keep(keep):
    """Hidden states sliced as Transformers slices them, the labels aligned with the kept positions."""
    model = tiny_model("phi3")
    input_ids, attention_mask, labels = batch()
    if keep == "index":
        keep = torch.tensor([1, 4, 5, 9], device=DEVICE)
        kept_labels = labels[:, keep]
    else:
        kept_labels = labels[:, -keep:]
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=kept_labels, logits_to_keep=keep)
    ref_loss, ref_grads = loss_and_grads(model, **inputs)
    hf.patch(model)
    loss, grads = loss_and_grads(model, **inputs)
    assert rel_err(loss, ref_loss) < LOSS_TOL
    assert_grads_close(grads, ref_grads, GRAD_TOL)


def test_gradient_accumulation_over_micro_batches_of_different_lengths():
    """Two micro-batches (lengths 9 and 14), each divided by the valid labels of both (``num_items_in_batch``):
    their summed gradients equal the whole batch's (the short one right-padded to 14), patched and unpatched."""
    model = tiny_model("llama", tied=True)
    short, long = batch(2, 9, seed=5, pad=3), batch(2, 14, seed=6, pad=5)
    num_items = sum(int((labels[:, 1:] != -100).sum()) for _, _, labels in (short, long))

    def pad_to(tensors, length):
        widths = (0, length - tensors[0].shape[1])
        ids, mask, labels = tensors
        return (torch.nn.functional.pad(ids, widths), torch.nn.functional.pad(mask, widths),
                torch.nn.functional.pad(labels, widths, value=-100))

    whole = [torch.cat(parts) for parts in zip(pad_to(short, 14), long)]
    whole_inputs = dict(input_ids=whole[0], attention_mask=whole[1], labels=whole[2])

    def accumulated():
        sums = {}
        for ids, mask, labels in (short, long):
            loss, grads = loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels,
                                         num_items_in_batch=num_items)
            sums = {name: sums.get(name, 0) + grad for name, grad in grads.items()}
        return sums

    ref_whole_loss, ref_whole = loss_and_grads(model, **whole_inputs)
    ref_accumulated = accumulated()
    hf.patch(model)
    whole_loss, fused_whole = loss_and_grads(model, **whole_inputs)
    fused_accumulated = accumulated()
    assert rel_err(whole_loss, ref_whole_loss) < LOSS_TOL
    assert_grads_close(ref_accumulated, ref_whole, GRAD_TOL)  # the semantics: accumulation == whole batch
    assert_grads_close(fused_accumulated, ref_accumulated, GRAD_TOL)
    assert_grads_close(fused_accumulated, ref_whole, GRAD_TOL)
    assert_grads_close(fused_whole, ref_whole, GRAD_TOL)


def test_autocast_bfloat16():
    """Under CPU autocast to bfloat16 both sides run the head in bfloat16: the float32 loss agrees within 4e-3
    relative (one bfloat16 ulp, 2^-8; observed ~5e-5, the mean averaging the roundings out), every gradient
    within 5e-2 (observed ~1e-2: each side rounds its bfloat16 logits and products differently), and the
    parameters' gradients are float32."""
    model = tiny_model("llama")
    inputs = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = loss_and_grads(model, **inputs)
        hf.patch(model)
        loss, grads = loss_and_grads(model, **inputs)
    assert loss.dtype == torch.float32
    assert rel_err(loss, ref_loss) < 4e-3
    assert all(grad.dtype == torch.float32 for grad in grads.values())
    assert_grads_close(grads, ref_grads, 5e-2)


# --------------------------------------------------------------------------- TRL's fused-head protocol

FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def _trl_and_ours(model, **options):
    from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head

    theirs, ours = copy.deepcopy(model), copy.deepcopy(model)
    trl_add_fused_lm_head(theirs, **options)
    hf.add_fused_lm_head(ours, **options)
    return theirs, ours


def _fused_run(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, fused_lm_head=True)
    # per-token log_probs carry a gradient of their own, and so does the entropy (an entropy bonus)
    (out.loss + out.log_probs[:, ::2].sum() + 0.3 * out.entropy[:, 1::3].sum()).backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "family, options, extra",
    [
        ("llama", {}, {}),
        ("llama", {"temperature": 0.7}, {"num_items_in_batch": 31}),
        ("gemma2", {"temperature": 1.3}, {}),
        ("qwen2", {"cast_lm_head_to_fp32": True}, {"shift": True}),
    ],
    ids=["llama", "temperature+num_items", "gemma2-softcap+temperature", "fp32-head+shift_labels"],
)
def test_fused_head_matches_trl(family, options, extra):
    model = tiny_model(family)
    options = {**options, "outputs": hf.FUSED_HEAD_OUTPUTS}
    theirs, ours = _trl_and_ours(model, **options)
    input_ids, attention_mask, labels = batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask)
    if extra.pop("shift", False):
        inputs["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    else:
        inputs["labels"] = labels
    inputs.update(extra)
    ref, ref_grads = _fused_run(theirs, **inputs)
    out, grads = _fused_run(ours, **inputs)
    assert type(out) is type(ref)
    for name in FIELDS:
        assert out[name].shape == ref[name].shape, name
    assert torch.equal(out.label_mask, ref.label_mask)
    assert torch.equal(out.is_top1, ref.is_top1)
    assert out.aux_loss is None
    for name in ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        assert rel_err(out[name], ref[name]) < LOSS_TOL, name
    assert_grads_close(grads, ref_grads, GRAD_TOL)
    with torch.no_grad():  # without fused_lm_head the forward is the model's own
        assert torch.equal(ours(**inputs).logits, model(**inputs).logits)


def test_fused_head_refuses_fields_it_does_not_know():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="outputs must be among .*; got logits"):
        hf.add_fused_lm_head(model, outputs=("log_probs", "logits"))
    assert not hf.is_patched(model)


def test_fused_head_gives_only_the_requested_fields():
    model = tiny_model("llama")
    hf.add_fused_lm_head(model, outputs=("log_probs", "mean_logits"))
    input_ids, attention_mask, labels = batch()
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    assert out.mean_logits is not None and out.entropy is None and out.log_sum_sq_probs is None and out.is_top1 is None


def test_fused_head_output_class_without_trl(monkeypatch):
    """Without TRL the output is a ModelOutput with TRL's fields."""
    hf._fused_output_class.cache_clear()
    for name in [name for name in sys.modules if name == "trl" or name.startswith("trl.")]:
        monkeypatch.setitem(sys.modules, name, None)  # `from trl... import` now raises ImportError
    try:
        model = tiny_model("llama")
        hf.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        input_ids, attention_mask, labels = batch()
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        assert isinstance(out, transformers.utils.ModelOutput) and type(out).__module__ == "kernels_lib.hf"
        assert list(type(out).__dataclass_fields__) == [
            "loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask", "aux_loss"
        ]
        assert out.is_top1 is None and out.entropy.shape == labels[:, 1:].shape
    finally:
        hf._fused_output_class.cache_clear()


def test_use_in_trl_rebinds_and_restores():
    from trl.trainer import sft_trainer
    from trl.trainer import utils as trl_utils

    theirs = trl_utils.add_fused_lm_head
    with hf.use_in_trl():
        assert trl_utils.add_fused_lm_head is hf.add_fused_lm_head
        assert sft_trainer.add_fused_lm_head is hf.add_fused_lm_head
    assert trl_utils.add_fused_lm_head is theirs and sft_trainer.add_fused_lm_head is theirs


def test_ours_after_trls_takes_over(monkeypatch):
    """What a user does after building a TRL trainer: our head on the model TRL already gave its head."""
    from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head

    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    hf.add_fused_lm_head(reference, outputs=("log_probs", "entropy", "is_top1"))
    trl_add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    hf.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    input_ids, attention_mask, labels = batch()
    calls = []
    kernel = hf.fused_linear_cross_entropy
    monkeypatch.setattr(hf, "fused_linear_cross_entropy", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
        ref = reference(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    assert len(calls) == 2
    assert torch.equal(out.log_probs, ref.log_probs) and torch.equal(out.entropy, ref.entropy)


# --------------------------------------------------------------------------- labels of the wrong shape


@pytest.mark.parametrize("fused_head", [False, True], ids=["patch", "fused_head"])
def test_labels_of_the_wrong_shape_are_named_with_the_model_shapes(fused_head):
    """Labels shaped (B, T - 1) (shifted by the caller) are refused naming ``labels`` and the (B, T) of
    input_ids, not the flattened rows of the kernel; so are shift_labels, and labels that are not a tensor."""
    model = tiny_model("llama")
    input_ids, attention_mask, labels = batch(batch_size=2, seq_len=12)
    if fused_head:
        hf.add_fused_lm_head(model)
    else:
        hf.patch(model)
    extra = {"fused_lm_head": True} if fused_head else {}
    call = lambda **kw: model(input_ids=input_ids, attention_mask=attention_mask, **extra, **kw)  # noqa: E731
    with pytest.raises(ValueError, match=r"labels must have shape \(batch, sequence\) = \(2, 12\).*got \(2, 11\)"):
        call(labels=labels[:, 1:])
    with pytest.raises(ValueError, match=r"shift_labels must have shape \(batch, sequence\) = \(2, 12\).*got \(24,\)"):
        call(shift_labels=labels.reshape(-1))
    if not fused_head:
        with pytest.raises(ValueError, match=r"= \(2, 3\).*logits_to_keep=3.*got \(2, 12\)"):
            call(labels=labels, logits_to_keep=3)
    with pytest.raises(TypeError, match="labels must be a tensor"):
        call(labels=labels.tolist())
