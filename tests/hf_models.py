"""Tiny Hugging Face causal LMs with random weights (no download), and the inputs and comparisons the
kernels_lib.hf tests share. Sizes are tiny (hidden 32, vocab 257, one or two layers): on a machine
without a GPU the kernels run in Triton's interpreter.

``initializer_range=0.2`` (10× the default) gives logits of order 1, so the softcap (2.0 here) bends
them visibly and a wrong loss is far from a right one; at the default the logits are ~0.1 and any
softcap would be the identity.
"""

from __future__ import annotations

import torch
import transformers

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device

DEVICE = default_device()
VOCAB = 257
HIDDEN = 32
SOFTCAP = 2.0

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
)

#: family -> (config class, model class, extra config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 8, "final_logit_softcapping": SOFTCAP}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 8, "final_logit_softcapping": SOFTCAP}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}


def tiny_model(family: str = "llama", *, tied: bool = False, seed: int = 0, layers: int = 1, **overrides):
    """A float32 ``*ForCausalLM`` of ``family`` with seeded random weights, on the kernels' device, in eval mode
    (no dropout; gradients still flow)."""
    config_name, model_name, extra = FAMILIES[family]
    options = {**_COMMON, **extra, "num_hidden_layers": layers, "tie_word_embeddings": tied, **overrides}
    config = getattr(transformers, config_name)(**options)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(DEVICE).eval()
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    return model


def batch(batch_size: int = 2, seq_len: int = 12, *, seed: int = 1, pad: int = 4):
    """``(input_ids, attention_mask, labels)``: the last row right-padded by ``pad`` tokens (mask 0, label -100),
    and the first two labels of every row ignored (a prompt)."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch_size, seq_len), generator=generator)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    attention_mask[-1, seq_len - pad :] = 0
    input_ids[attention_mask == 0] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :2] = -100
    return input_ids.to(DEVICE), attention_mask.to(DEVICE), labels.to(DEVICE)


def loss_and_grads(model, **inputs):
    """The loss of ``model(**inputs)`` and every parameter's gradient (by name; zeroed before)."""
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 when both are 0)."""
    out, ref = out.detach().double(), ref.detach().double()
    diff = (out - ref).norm().item()
    return diff if diff == 0 else diff / ref.norm().item()


def assert_grads_close(grads: dict, ref: dict, tol: float) -> None:
    """Same parameters, and each gradient within ``tol`` relative error of the reference's."""
    assert grads.keys() == ref.keys()
    errors = {name: rel_err(grads[name], ref[name]) for name in ref}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol, f"{worst}: relative error {errors[worst]:.2e} >= {tol:.0e}"
