"""What the LM head costs in a whole training step: model shapes, providers, one measured step, the sweep,
kernels_lib's step against each peer's per GPU, and the analytic costs to put beside them.

A *point* is one (model shape, provider, gradient checkpointing, batch × sequence tokens): a fresh model
of the shape (random init, same seed for every provider, parameters in bf16), ``torch.optim.AdamW``
(``fused=True`` on CUDA), a few warm-up steps, then timed steps of forward + backward + ``optimizer.step()``
+ ``zero_grad()``, each bracketed by ``torch.cuda.synchronize()``. The providers differ only in how the
loss is formed from the last hidden states:

- ``huggingface``: the unpatched model, ``model(input_ids, labels=labels).loss`` (bf16 logits, their
  float32 upcast, ``cross_entropy``: SPEC §7);
- ``trl``: ``trl.trainer.utils.add_fused_lm_head(model)``, then ``model(..., fused_lm_head=True).loss``;
- ``kernels_lib``: ``kernels_lib.hf.patch(model)`` (the loss from :func:`kernels_lib.fused_linear_cross_entropy`
  on the last hidden states, no logits);
- ``liger``: ``apply_liger_kernel_to_llama`` / ``apply_liger_kernel_to_qwen2`` on the instance with only
  ``fused_linear_cross_entropy=True`` (rope, RMSNorm, SwiGLU and plain cross-entropy off).

A provider whose package is missing, or that fails here, gives a row with a note instead of figures; a
point that runs out of memory gives a row with the note ``OOM``. On CUDA each row has the step time
(median, p20, p80), tokens/s, the peak memory of the timed steps and the memory held before them
(weights and AdamW state; ``zero_grad()`` sets gradients to None, so they belong to the step's own
memory, peak minus held). On a CPU (tiny shapes, kernels through Triton's interpreter) the times are CPU
wall-clock times and the memory columns are NaN: there is no allocator statistic to read.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from . import data, narrative
from .bench.environment import package_version, provenance

GIB = 2**30

#: Model shapes: the family (which transformers class, which Liger patch) and the config's fields.
#: ``llama-3.2-1b`` and ``qwen2.5-0.5b`` are the published models' shapes (tied embeddings, random
#: init here); the ``-tiny`` ones keep their proportions small enough for a CPU and the interpreter.
#: The config's fields of :data:`MODEL_SHAPES`, in the order of each row (every shape ties its embeddings).
SHAPE_FIELDS = ("family", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps", "max_position_embeddings")
MODEL_SHAPES: dict[str, dict] = {name: {**dict(zip(SHAPE_FIELDS, row)), "tie_word_embeddings": True} for name, row in {
    "llama-3.2-1b": ("llama", 2048, 16, 32, 8, 8192, 128256, 500000.0, 1e-5, 131072),
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 4864, 151936, 1000000.0, 1e-6, 32768),
    # scripts/training_convergence.py: a Llama-3 head (V = 128256, tied) on a small body, 150 steps in a minute
    "llama-1024x8": ("llama", 1024, 8, 16, 4, 2816, 128256, 500000.0, 1e-6, 1024),
    "llama-tiny": ("llama", 64, 2, 4, 2, 256, 1024, 500000.0, 1e-5, 2048),
    "qwen-tiny": ("qwen2", 56, 3, 7, 1, 304, 1187, 1000000.0, 1e-6, 2048),
}.items()}
#: ``--model llama|qwen`` of the script: (full shape, tiny shape).
MODEL_ALIASES = {"llama": ("llama-3.2-1b", "llama-tiny"), "qwen": ("qwen2.5-0.5b", "qwen-tiny")}

PROVIDERS = ("huggingface", "trl", "kernels_lib", "liger")
#: Providers a sweep runs only when asked (``--providers``): torch's ``F.linear_cross_entropy`` (torch 2.13, or
#: its two files on an older torch, :mod:`.bench.torch_lce`) on the backbone's hidden states, default options.
OPTIONAL_PROVIDERS = ("torch_lce",)
#: Batches of the sweep (× ``SEQ`` tokens each); a provider stops at its first OOM.
BATCHES = (4, 8, 16, 32, 64, 128, 256, 512)
SEQ = 2048

#: Columns of ``data/measured/training_step.csv`` (and of :func:`run_sweep`'s frame), in order.
COLUMNS = [
    "run_id", "model", "family", "provider", "checkpointing", "batch", "seq", "tokens", "device",
    "warmup_steps", "timed_steps", "step_ms_50", "step_ms_20", "step_ms_80", "tokens_per_s",
    "peak_gib", "held_gib", "step_gib", "peak_reserved_gib", "parameters", "loss_first", "loss_last", "losses",
    "note", "gpu_name", "gpu_memory_gib", "timestamp", "torch_version", "triton_version", "transformers_version", "trl_version",
    "liger_version", "kernels_lib_commit", "masked_share",
]


# --------------------------------------------------------------------------- models


def model_config(name: str):
    """The transformers config of shape ``name`` (:data:`MODEL_SHAPES`), ``use_cache`` off (training)."""
    from transformers import LlamaConfig, Qwen2Config

    shape = dict(MODEL_SHAPES[name])
    family = shape.pop("family")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    config = cls(**shape, use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def build_model(name: str, device: torch.device | str, seed: int = 0, checkpointing: bool = False,
                dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A fresh causal LM of shape ``name``: random init from ``seed`` (the same weights for every
    provider), parameters in ``dtype``, in training mode, gradient checkpointing on or off."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[MODEL_SHAPES[name]["family"]]
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(model_config(name))
    model.to(dtype)
    if checkpointing:  # transformers 5.24 renames it activation_checkpointing_enable (the old name warns)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    return model


def parameter_count(name: str) -> int:
    """Parameters of shape ``name`` from its config (tied embeddings counted once; Qwen2's q/k/v biases)."""
    s = MODEL_SHAPES[name]
    h, i, v, layers = s["hidden_size"], s["intermediate_size"], s["vocab_size"], s["num_hidden_layers"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    if s["family"] == "qwen2":
        per_layer += h + 2 * kv  # q, k, v biases
    head = 0 if s["tie_word_embeddings"] else v * h
    return v * h + layers * per_layer + h + head


# --------------------------------------------------------------------------- providers


def provider_base(provider: str) -> tuple[str, dict]:
    """``"kernels_lib[chunk_size=256]"`` -> ``("kernels_lib", {"chunk_size": 256})``: a provider of
    :data:`PROVIDERS`, optionally with options for :func:`kernels_lib.hf.patch` (the dial:
    ``chunk_size=N``, ``accurate=True``)."""
    name, _, rest = provider.partition("[")
    known = PROVIDERS + OPTIONAL_PROVIDERS
    if name not in known or (rest and (name != "kernels_lib" or not rest.endswith("]"))):
        raise ValueError(f"provider must be one of {', '.join(known)} or kernels_lib[chunk_size=N]; got {provider!r}")
    options = {}
    for item in filter(None, rest[:-1].split()):
        key, _, value = item.partition("=")
        if key == "chunk_size" and value.isdigit() and int(value) >= 1:
            options[key] = int(value)
        elif key == "accurate" and value in ("True", "False"):
            options[key] = value == "True"
        else:
            raise ValueError(f"kernels_lib's options here are chunk_size=N (N >= 1) and accurate=True|False; got {item!r} in {provider!r}")
    return name, options


def provider_unavailable(provider: str, family: str = "llama") -> str | None:
    """Why ``provider`` cannot run here (its package missing or failing to import), or None."""
    provider, _ = provider_base(provider)
    if provider == "torch_lce":
        from .bench import torch_lce as torch_lce_files

        try:
            torch_lce_files.load()
        except (ImportError, FileNotFoundError) as error:
            return f"skipped: {str(error).splitlines()[0][:200]}"
        return None
    module = {"huggingface": "transformers", "trl": "trl.trainer.utils", "kernels_lib": "kernels_lib.hf",
              "liger": "liger_kernel.transformers"}[provider]
    try:
        __import__(module)
    except Exception as error:  # noqa: BLE001 - any import failure means: skip, and say why
        return f"skipped: import {module} failed ({type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''})"
    if provider == "trl":
        from trl.trainer import utils

        if not hasattr(utils, "add_fused_lm_head"):
            return f"skipped: trl {package_version('trl')} has no add_fused_lm_head"
    return None


def prepare(provider: str, model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Patch ``model`` (in place) for ``provider`` and return ``loss_of(input_ids, labels)``. Only the
    loss is returned, so no output object keeps the logits alive through backward."""
    family = model.config.model_type
    if provider == EXACT_HEAD:
        head = model.get_output_embeddings()

        def float32_head(hidden):  # the logits and their gradient in float32, rounded once into the parameter's grad
            return torch.nn.functional.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float())

        head.forward = float32_head
        return lambda ids, labels: model(input_ids=ids, labels=labels).loss
    provider, options = provider_base(provider)
    if provider == "huggingface":
        return lambda ids, labels: model(input_ids=ids, labels=labels).loss
    if provider == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
        return lambda ids, labels: model(input_ids=ids, labels=labels, fused_lm_head=True).loss
    if provider == "kernels_lib":
        import kernels_lib.hf

        kernels_lib.hf.patch(model, **options)
        return lambda ids, labels: model(input_ids=ids, labels=labels).loss
    if provider == "liger":
        from liger_kernel import transformers as liger

        apply = {"llama": liger.apply_liger_kernel_to_llama, "qwen2": liger.apply_liger_kernel_to_qwen2}[family]
        apply(model=model, fused_linear_cross_entropy=True, rope=False, rms_norm=False, swiglu=False, cross_entropy=False)
        return lambda ids, labels: model(input_ids=ids, labels=labels).loss
    if provider == "torch_lce":
        return _torch_lce_loss(model)
    raise ValueError(f"provider must be one of {', '.join(PROVIDERS + OPTIONAL_PROVIDERS)}; got {provider!r}")


def _torch_lce_loss(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_of`` through torch's ``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions()`` (its chunked
    path) on the backbone's hidden states, as Transformers' ``ForCausalLMLoss`` forms the loss: position t
    predicts label t + 1, ``-100`` ignored, the mean over the counted tokens. No logits are built."""
    from .bench import torch_lce as torch_lce_files

    function, options_class, _ = torch_lce_files.load()
    options, head = options_class(), model.get_output_embeddings()

    def loss_of(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = model.base_model(input_ids=ids).last_hidden_state[:, :-1]
        return function(hidden.reshape(-1, hidden.shape[-1]), head.weight, labels[:, 1:].reshape(-1), linear_bias=head.bias,
                        reduction="mean", ignore_index=-100, options=options)

    return loss_of


# --------------------------------------------------------------------------- one point


def training_provenance(device: torch.device | str) -> dict[str, str]:
    """:func:`~kernels_workbench.bench.environment.provenance` plus the GPU's memory (GiB; NaN on a
    CPU) and the transformers and TRL versions."""
    base = provenance(device)
    device = torch.device(device)
    capacity = torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else float("nan")
    return {"gpu_name": base["gpu_name"], "gpu_memory_gib": capacity, "timestamp": base["timestamp"], "torch_version": base["torch_version"],
            "triton_version": base["triton_version"], "transformers_version": package_version("transformers"),
            "trl_version": package_version("trl"), "liger_version": base["liger_version"],
            "kernels_lib_commit": base["kernels_lib_commit"]}


def is_oom(error: BaseException) -> bool:
    """An allocator failure: torch's OutOfMemoryError, or an error saying so (cuBLAS failing to allocate
    its workspace raises a plain RuntimeError)."""
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "alloc_failed" in text


def free_memory(device: torch.device | str) -> None:
    """Collect garbage and give cached blocks back (after a point, above all after an OOM)."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _batch(vocab: int, batch: int, seq: int, step: int, seed: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randint(0, vocab, (batch, seq), generator=generator).to(device)


def masked_labels(ids: torch.Tensor, share: float) -> torch.Tensor:
    """The labels of an SFT batch whose first ``round(share · T)`` positions of every sequence are a prompt
    (label ``-100``: no loss, no gradient); ``share = 0`` gives the inputs themselves."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"masked_share must be in [0, 1); got {share}")
    labels = ids.clone()
    labels[:, : round(share * ids.shape[1])] = -100
    return labels


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_point(model_name, provider, checkpointing, batch, seq, device, warmup, steps, lr, seed, max_point_s, state,
               masked_share=0.0):
    """The measurement; ``state`` receives the model and optimizer so the caller can free them."""
    model = state["model"] = build_model(model_name, device, seed, checkpointing)
    loss_of = prepare(provider, model)
    fused = device.type == "cuda"
    optimizer = state["optimizer"] = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    vocab = model.config.vocab_size
    losses, times = [], []

    def step(index: int) -> float:
        ids = _batch(vocab, batch, seq, index, seed, device)
        labels = masked_labels(ids, masked_share)
        _sync(device)
        start = time.perf_counter()
        loss = loss_of(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        elapsed = time.perf_counter() - start
        losses.append(float(loss.detach()))
        return elapsed

    warm = []
    for i in range(warmup):
        warm.append(step(i))
        if max_point_s is not None and warm[-1] > max_point_s / 3:
            break  # long steps: one warm-up step is enough (the first step's extra cost is small beside them)
    timed = steps
    if max_point_s is not None and warm:  # long steps: fewer timed steps (at least 3)
        timed = max(3, min(steps, int(max_point_s / max(warm[-1], 1e-9))))
    held = reserved = float("nan")
    if device.type == "cuda":
        held = torch.cuda.memory_allocated(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    times = [step(warmup + i) for i in range(timed)]
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else float("nan")
    if device.type == "cuda":
        reserved = torch.cuda.max_memory_reserved(device) / GIB
    ms = np.asarray(times) * 1e3
    return {
        "warmup_steps": len(warm), "timed_steps": timed,
        "step_ms_50": float(np.median(ms)), "step_ms_20": float(np.quantile(ms, 0.2)), "step_ms_80": float(np.quantile(ms, 0.8)),
        "tokens_per_s": batch * seq / (float(np.median(ms)) / 1e3),
        "peak_gib": peak, "held_gib": held, "step_gib": peak - held, "peak_reserved_gib": reserved,
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss_first": losses[0], "loss_last": losses[-1], "losses": json.dumps([round(v, 6) for v in losses]),
    }


def new_run_id() -> str:
    """A run's id: the UTC time to the microsecond (``20261201T052445.123456``), so that two runs of one
    second differ and a later run's id sorts after an earlier one's (older ids stop at the second)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%f")


def _blank_row(run_id: str, model: str, provider: str, checkpointing: bool, batch: int, seq: int,
               device: torch.device, note: str = "", masked_share: float = 0.0) -> dict:
    """A row of :data:`COLUMNS` with the point's identity and provenance, figures NaN."""
    row = {column: float("nan") for column in COLUMNS}
    row.update({"run_id": run_id, "model": model, "family": MODEL_SHAPES[model]["family"], "provider": provider,
                "checkpointing": bool(checkpointing), "batch": batch, "seq": seq, "tokens": batch * seq,
                "device": torch.device(device).type, "losses": "", "note": note, **training_provenance(device),
                "masked_share": float(masked_share)})
    return row


def measure_point(model_name: str, provider: str, checkpointing: bool, batch: int, seq: int = SEQ,
                  device: torch.device | str = "cuda", *, warmup: int = 2, steps: int = 5, lr: float = 1e-4,
                  seed: int = 0, max_point_s: float | None = None, run_id: str = "", masked_share: float = 0.0) -> dict:
    """Measure one point (module docstring); return its row (:data:`COLUMNS`). An OOM gives the note
    ``OOM``, a missing or failing provider a note saying why, and NaN figures. ``max_point_s`` lowers
    the number of timed steps (to at least 3) when the last warm-up step says they would take longer.
    ``masked_share``: that share of every sequence's first positions has label ``-100`` (:func:`masked_labels`)."""
    device = torch.device(device)
    family = MODEL_SHAPES[model_name]["family"]
    row = _blank_row(run_id, model_name, provider, checkpointing, batch, seq, device, masked_share=masked_share)
    unavailable = provider_unavailable(provider, family)
    if unavailable:
        row["note"] = unavailable
        return row
    state: dict = {}
    if device.type == "cuda":
        free_memory(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        row.update(_run_point(model_name, provider, checkpointing, batch, seq, device, warmup, steps, lr, seed, max_point_s, state,
                              masked_share))
    except Exception as error:  # noqa: BLE001 - recorded, the sweep goes on
        if not is_oom(error):
            first = str(error).splitlines()[0][:200] if str(error) else ""
            row["note"] = f"error: {type(error).__name__}: {first}"
            traceback.print_exc(limit=-3)
        else:
            row["note"] = "OOM"
        error = None  # drop the traceback (it holds the step's tensors)
    finally:
        state.clear()
        free_memory(device)
    return row


# --------------------------------------------------------------------------- what forward keeps for backward


def saved_for_backward(model_name: str, provider: str, batch: int, seq: int, device: torch.device | str = "cpu", *,
                       checkpointing: bool = False, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The bytes a provider's forward keeps for backward, measured on any device (a CPU too) with
    ``torch.autograd.graph.saved_tensors_hooks``: every tensor saved for backward, counted once per
    storage, parameters left out (they are held anyway). Also the largest single saved storage, to
    tell a ``B·T × V`` one apart. Returns ``{"provider", "checkpointing", "tokens", "saved bytes",
    "saved bytes per token", "largest saved (bytes)", "largest saved shape"}``."""
    device = torch.device(device)
    model = build_model(model_name, device, seed, checkpointing, dtype)
    loss_of = prepare(provider, model)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, tuple[int, tuple]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameters and pointer not in storages and storage.nbytes():
            storages[pointer] = (storage.nbytes(), tuple(tensor.shape))
        return tensor

    ids = _batch(model.config.vocab_size, batch, seq, 0, seed, device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = loss_of(ids, ids)
    loss.backward()
    del model, loss_of, loss
    free_memory(device)  # the patches make reference cycles: collect now, not when Python gets to it
    total = sum(n for n, _ in storages.values())
    largest = max(storages.values(), default=(0, ()))
    return {"provider": provider, "checkpointing": bool(checkpointing), "tokens": batch * seq, "saved bytes": total,
            "saved bytes per token": total / (batch * seq), "largest saved (bytes)": largest[0],
            "largest saved shape": "×".join(map(str, largest[1]))}


def saved_bytes_per_token(model_name: str, provider: str, device: torch.device | str = "cpu", *, batch: int = 2,
                          seqs: tuple[int, int] = (32, 64), checkpointing: bool = False, seed: int = 0) -> dict:
    """:func:`saved_for_backward` at two sequence lengths: the bytes kept per additional token (the
    slope: what decides how many tokens fit) and the part that does not grow with tokens (the
    intercept: e.g. a weight gradient formed in forward). Returns ``{"provider", "checkpointing",
    "bytes per token", "fixed bytes"}``.

    The fit is over the ``B·T`` tokens, but a head that keeps tensors of the shifted rows keeps them for
    the ``B·(T − 1)`` tokens that have a label: ``b`` bytes per such token add ``b`` to the slope and
    ``−b·B`` to the intercept. So "fixed bytes" can be negative: at CPU size (``H = 64``, ``B = 2``)
    TRL's fused head reads ``−274 = −2 × 137``, and ``137 = 2H + 9`` is what a copy of the shifted hidden
    states (``2H`` bytes in bf16), the labels (8) and a mask (1) take per labelled token: nothing fixed. A fixed
    part of ``2VH`` (kernels_lib's and Liger's ``dW``) is far larger than ``b·B`` and reads as it is."""
    small, large = (saved_for_backward(model_name, provider, batch, seq, device, checkpointing=checkpointing, seed=seed)
                    for seq in seqs)
    slope = (large["saved bytes"] - small["saved bytes"]) / (large["tokens"] - small["tokens"])
    return {"provider": provider, "checkpointing": bool(checkpointing), "bytes per token": slope,
            "fixed bytes": small["saved bytes"] - slope * small["tokens"]}


# --------------------------------------------------------------------------- loss curves (the check)


def train_losses(model_name: str, provider: str, steps: int, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype = torch.bfloat16, batch: int = 2, seq: int = 64, lr: float = 1e-2, seed: int = 0,
                 checkpointing: bool = False) -> list[float]:
    """The loss of each of ``steps`` AdamW steps of a fresh model of shape ``model_name`` (seed
    ``seed``, parameters in ``dtype``) patched for ``provider``, on one fixed random batch (the model
    learns it, so the curve falls and the providers' curves can be compared step by step)."""
    device = torch.device(device)
    model = build_model(model_name, device, seed, checkpointing, dtype)
    loss_of = prepare(provider, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
    ids = _batch(model.config.vocab_size, batch, seq, 0, seed, device)
    losses = []
    for _ in range(steps):
        loss = loss_of(ids, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    del model, loss_of, optimizer, loss
    free_memory(device)
    return losses


#: The curves' yardstick: the unpatched model with its head's logits, and their gradient, in float32
#: (``float32 head``): the same bf16 model and optimizer, the head's arithmetic exact to float32, its
#: gradients rounded once into the bf16 parameters. Hugging Face's own bf16 run rounds the logits to
#: bf16 before the float32 cross-entropy (and TRL's chunked head does the same per chunk), so "drift
#: from Hugging Face" measures Hugging Face's rounding as much as a provider's; the distance from this
#: run measures each provider's own, the unpatched model included.
EXACT_HEAD = "float32 head"


def loss_curves(model_name: str, providers: Sequence[str], steps: int, device: torch.device | str = "cpu",
                reference: bool = True, **options) -> pd.DataFrame:
    """:func:`train_losses` of each provider (same init, same batch): rows (provider, dtype, step,
    loss), plus ``|Δ huggingface|``, the absolute difference to the unpatched model's loss at that
    step, and (``reference``) the :data:`EXACT_HEAD` run's curve and ``|Δ float32 head|``."""
    dtype = options.get("dtype", torch.bfloat16)
    runs = [*providers, EXACT_HEAD] if reference else list(providers)
    curves = {p: train_losses(model_name, p, steps, device, **options) for p in runs}
    base, exact = curves.get("huggingface"), curves.get(EXACT_HEAD)
    rows = [{"provider": p, "dtype": str(dtype).replace("torch.", ""), "step": i + 1, "loss": v,
             "|Δ huggingface|": abs(v - base[i]) if base is not None else float("nan"),
             f"|Δ {EXACT_HEAD}|": abs(v - exact[i]) if exact is not None else float("nan")}
            for p, losses in curves.items() for i, v in enumerate(losses)]
    return pd.DataFrame(rows)


#: Largest distance from the :data:`EXACT_HEAD` curve allowed at any step of :func:`loss_curves` (20
#: AdamW steps): float32 agrees to rounding; in bf16 every provider rounds differently and training
#: amplifies it.
CURVE_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
#: ... or within this factor of the unpatched bf16 model's own distance from it, in the same run (the
#: baseline's error in the same dtype on the same device: at the full shape Hugging Face's bf16 logits
#: move the curve by more than the tolerance).
CURVE_MARGIN = 2.0


def curve_checks(curves: pd.DataFrame, peer: str = "trl") -> pd.DataFrame:
    """Per (dtype, provider) of :func:`loss_curves` rows, the reference and Hugging Face left out: the largest
    distance from the :data:`EXACT_HEAD` curve and at which step, the largest ``|Δ huggingface|``,
    the first and last loss, the tolerance (:data:`CURVE_TOLERANCE`), Hugging Face's and ``peer``'s
    own largest distance from the reference in that dtype (NaN if not run), and ``passed``: within
    the tolerance or within :data:`CURVE_MARGIN` × Hugging Face's distance.

    Without the reference run (``loss_curves(reference=False)``) the distances are from Hugging
    Face's curve, the bound ``peer``'s drift from it (how the check read before the reference run)."""
    key = f"|Δ {EXACT_HEAD}|"
    judged = EXACT_HEAD if (curves.provider == EXACT_HEAD).any() else "huggingface"
    yardstick = "huggingface" if judged == EXACT_HEAD else peer
    distance = key if judged == EXACT_HEAD else "|Δ huggingface|"
    others = curves[curves.provider != judged]
    drift = others.groupby(["dtype", "provider"])[distance].max()
    out = []
    for (dtype, provider), group in others[others.provider != "huggingface"].groupby(["dtype", "provider"], sort=False):
        worst = group.loc[group[distance].idxmax()]
        tolerance = CURVE_TOLERANCE[dtype]
        base_drift = float(drift.get((dtype, yardstick), float("nan")))
        bound = max(tolerance, CURVE_MARGIN * base_drift) if provider != yardstick and not math.isnan(base_drift) else tolerance
        out.append({"dtype": dtype, "provider": provider, "steps": len(group), "first loss": group.loss.iloc[0],
                    "last loss": group.loss.iloc[-1], f"max {distance}": worst[distance], "at step": int(worst.step),
                    **({"max |Δ huggingface|": group["|Δ huggingface|"].max()} if judged == EXACT_HEAD else {}),
                    "tolerance": tolerance, f"{yardstick} drift": base_drift,
                    **({f"{peer} drift": float(drift.get((dtype, peer), float("nan")))} if yardstick != peer else {}),
                    "passed": bool(worst[distance] <= bound)})
    return pd.DataFrame(out)


# --------------------------------------------------------------------------- the sweep


def _estimate_s(done: list[dict], model: str, provider: str, checkpointing: bool, tokens: int, default: float,
                warmup: int = 2, steps: int = 5, max_point_s: float | None = None) -> float:
    """Seconds a point will take: the step time of the nearest smaller measured point of the same
    (model, provider, checkpointing), else of any provider at this checkpointing, else of the same
    provider without checkpointing (× 1.35 with it), scaled by tokens,
    times the steps it will run (as :func:`measure_point` chooses them), plus the overhead (building
    the model, first-step costs) seen so far for this model. ``default`` without any measured point."""
    def step_s(rows):
        rows = [r for r in rows if r["tokens"] <= tokens]
        if not rows:
            return None
        last = max(rows, key=lambda r: r["tokens"])
        return last["step_ms_50"] / 1e3 * tokens / last["tokens"]

    same = [r for r in done if (r["model"], r["provider"], r["checkpointing"]) == (model, provider, checkpointing)]
    t = step_s(same)
    if t is None:
        t = step_s([r for r in done if (r["model"], r["checkpointing"]) == (model, checkpointing)])
    if t is None:  # the other checkpointing setting: recomputing the layers' forward costs about a third more
        other = step_s([r for r in done if r["model"] == model and r["provider"] == provider])
        t = None if other is None else other * (1.35 if checkpointing else 1.0)
    if t is None:
        return default
    n_warm, n_timed = warmup, steps
    if max_point_s is not None:
        n_warm = 1 if t > max_point_s / 3 else warmup
        n_timed = max(3, min(steps, int(max_point_s / t)))
    overheads = [r["_seconds"] - (r["warmup_steps"] + r["timed_steps"]) * r["step_ms_50"] / 1e3
                 for r in done if r["model"] == model]
    overhead = float(np.median(overheads)) if overheads else 0.0
    return max(overhead, 0.0) + (n_warm + n_timed) * t


def run_sweep(models: Sequence[str], providers: Sequence[str] = PROVIDERS, checkpointing: Sequence[bool] = (False, True),
              batches: Sequence[int] = BATCHES, seq: int = SEQ, device: torch.device | str = "cuda", *,
              warmup: int = 2, steps: int = 5, lr: float = 1e-4, seed: int = 0, budget_s: float | None = None,
              max_point_s: float | None = None, default_point_s: float = 10.0, run_id: str | None = None,
              on_row: Callable[[dict], None] | None = None, log: Callable[[str], None] | None = print,
              masked_shares: Sequence[float] = (0.0,)) -> pd.DataFrame:
    """Every (model, batch, checkpointing, masked share, provider): batches ascending, and at each batch every
    checkpointing setting, share (:func:`masked_labels`) and provider before the next batch, so that what a budget
    cuts off is the largest sizes (where, with checkpointing, only the fused heads still fit). A provider stops at its
    first OOM (or error) for that model, checkpointing and share. With ``budget_s`` (seconds from the call), a
    point whose estimated duration (:func:`_estimate_s`) would end past the budget is not run but
    recorded with the note ``skipped: budget (...)``. A provider that cannot run here gives one row per
    checkpointing setting saying why. ``on_row`` sees each row as it comes (the script appends it to a
    CSV); ``log`` gets a line per row. Returns the rows as a DataFrame of :data:`COLUMNS`."""
    device = torch.device(device)
    run_id = run_id or new_run_id()
    start = time.perf_counter()
    done: list[dict] = []
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)
        if log is not None:
            log(describe_row(row))

    for model in models:
        family = MODEL_SHAPES[model]["family"]
        unavailable = {p: provider_unavailable(p, family) for p in providers}
        stopped: set[tuple[bool, float, str]] = set()
        points = [(batch, ckpt, share, provider) for batch in batches for ckpt in checkpointing
                  for share in masked_shares for provider in providers]
        for batch, ckpt, share, provider in points:
            tokens = batch * seq
            if unavailable[provider]:
                if batch == batches[0]:  # one row says why
                    emit(_blank_row(run_id, model, provider, ckpt, batch, seq, device, unavailable[provider], share))
                continue
            if (ckpt, share, provider) in stopped:
                continue
            estimate = _estimate_s(done, model, provider, ckpt, tokens, default_point_s, warmup, steps, max_point_s)
            elapsed = time.perf_counter() - start
            if budget_s is not None and elapsed + estimate > budget_s:
                note = f"skipped: budget ({elapsed:.0f} s spent, ~{estimate:.0f} s needed, budget {budget_s:.0f} s)"
                emit(_blank_row(run_id, model, provider, ckpt, batch, seq, device, note, share))
                continue
            t0 = time.perf_counter()
            row = measure_point(model, provider, ckpt, batch, seq, device, warmup=warmup, steps=steps,
                                lr=lr, seed=seed, max_point_s=max_point_s, run_id=run_id, masked_share=share)
            if row["note"]:
                stopped.add((ckpt, share, provider))
            else:
                done.append({**row, "_seconds": time.perf_counter() - t0})
            emit(row)
    return pd.DataFrame(rows, columns=COLUMNS)


def describe_row(row: dict) -> str:
    """One line per row, for the script's log."""
    head = f"{row['model']:>13} ckpt={'on ' if row['checkpointing'] else 'off'} {row['provider']:>11} B={row['batch']:<4} tokens={row['tokens']:<7}"
    if row.get("masked_share", 0.0) > 0:
        head += f" masked {row['masked_share']:.0%}"
    if row["note"]:
        return f"{head} {row['note']}"
    memory = "" if math.isnan(row["peak_gib"]) else f" peak {row['peak_gib']:.1f} GiB (held {row['held_gib']:.1f})"
    return (f"{head} {row['step_ms_50']:.1f} ms [{row['step_ms_20']:.1f}, {row['step_ms_80']:.1f}] "
            f"{row['tokens_per_s']:.0f} tok/s{memory} loss {row['loss_first']:.3f} -> {row['loss_last']:.3f}")


# --------------------------------------------------------------------------- analysis


def notes(rows: pd.DataFrame) -> pd.Series:
    """The ``note`` column as strings ("" where empty; a CSV read back gives NaN there)."""
    return rows.note.astype(object).fillna("").astype(str)


def measured(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows with figures (no note: neither OOM nor skipped nor failed)."""
    return rows[notes(rows).eq("") & rows.step_ms_50.notna()]


def latest_run(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of the newest run (``run_id``) of each model (of one GPU: :func:`newest_runs_per_gpu`)."""
    if not len(rows):
        return rows
    newest = rows.groupby("model").run_id.max()
    return rows[rows.run_id == rows.model.map(newest)].reset_index(drop=True)


def newest_runs_per_gpu(rows: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Per GPU whose CUDA rows ``rows`` hold (:func:`.data.gpus_measured`: by short label, none preferred), the
    newest run of each model on that GPU (:func:`latest_run`); {} without CUDA rows. Two GPUs are never mixed."""
    if not len(rows):
        return {}
    cuda = data.cuda_rows(rows)
    return {gpu: latest_run(cuda[cuda.gpu_name.astype(str) == gpu]) for gpu in data.gpus_measured(cuda)}


def run_labels(latest: pd.DataFrame) -> str:
    """The provenance of :func:`latest_run` rows of one GPU, one clause per model: ``model: run of commit C on
    GPU (date)`` (:func:`.data.run_label`) and the versions of torch, transformers, TRL and Liger."""
    said = []
    for model, run in latest.groupby("model", sort=False):
        versions = ", ".join(f"{name} {run[column].iloc[0]}" for name, column in
                             (("torch", "torch_version"), ("transformers", "transformers_version"), ("trl", "trl_version"),
                              ("liger", "liger_version")) if column in run and pd.notna(run[column].iloc[0]))
        said.append(f"{model}: {data.run_label(run)}" + (f" ({versions})" if versions else ""))
    return "; ".join(said)


def largest_fit(rows: pd.DataFrame) -> pd.DataFrame:
    """Per (model, checkpointing, provider): the largest tokens per step measured, and what stopped the
    sweep above it (``OOM at N``, ``skipped`` by the budget, ``error``, or ``end of grid``: then the
    largest fit is a lower bound)."""
    out = []
    for (model, ckpt, provider), group in rows.groupby(["model", "checkpointing", "provider"], sort=False):
        ok = measured(group)
        largest = int(ok.tokens.max()) if len(ok) else 0
        above = group[group.tokens > largest].sort_values("tokens")
        text = notes(above)
        if (text == "OOM").any():
            limit = f"OOM at {int(above[text == 'OOM'].tokens.min())}"
        elif text.str.startswith("skipped: budget").any():
            limit = "skipped (budget)"
        elif text.str.startswith(("skipped", "error")).any():
            limit = text[text.str.startswith(("skipped", "error"))].iloc[0]
        else:
            limit = "end of grid"
        out.append({"model": model, "checkpointing": bool(ckpt), "provider": provider, "largest tokens": largest,
                    "largest batch": int(ok.loc[ok.tokens.idxmax(), "batch"]) if len(ok) else 0,
                    "stopped by": limit, "bounded by OOM": limit.startswith("OOM")})
    return pd.DataFrame(out, columns=["model", "checkpointing", "provider", "largest tokens", "largest batch",
                                      "stopped by", "bounded by OOM"])


#: The targets for the training step (same GPU, same run, per model and checkpointing):
#: label → (quantity, bound, direction). Times are medians; "≤" bounds hold at every tokens per step
#: both providers measured.
TRAINING_TARGETS = {
    "peak memory ≤ 0.7× huggingface (largest size both fit)": ("memory / huggingface", 0.7, "≤"),
    "step time ≤ 0.95× huggingface": ("time / huggingface", 0.95, "≤"),
    "step time ≤ Liger": ("time / liger", 1.0, "≤"),
    "step time ≤ TRL fused head": ("time / trl", 1.0, "≤"),
    "largest tokens per step ≥ 1.5× huggingface": ("largest / huggingface", 1.5, "≥"),
}


def step_ratios(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """Per (model, checkpointing, tokens) of one run: ``provider``'s median step time and peak memory,
    and their ratios to each peer's (NaN where a peer did not measure that size)."""
    ok = measured(rows)
    out = []
    for (model, ckpt), group in ok.groupby(["model", "checkpointing"], sort=False):
        time_ = group.groupby(["tokens", "provider"]).step_ms_50.median().unstack()
        memory = group.groupby(["tokens", "provider"]).peak_gib.median().unstack()  # all NaN on a CPU
        if provider not in time_.columns:
            continue
        for tokens in time_.index[time_[provider].notna()]:
            entry = {"model": model, "checkpointing": bool(ckpt), "tokens": int(tokens),
                     f"{provider} ms": time_.at[tokens, provider], f"{provider} GiB": memory.at[tokens, provider]}
            optional = tuple(p for p in OPTIONAL_PROVIDERS if p in time_.columns)  # their columns only where measured
            for peer in (p for p in PROVIDERS + optional if p != provider):
                entry[f"time / {peer}"] = (time_.at[tokens, provider] / time_.at[tokens, peer]
                                           if peer in time_.columns else float("nan"))
                entry[f"memory / {peer}"] = (memory.at[tokens, provider] / memory.at[tokens, peer]
                                             if peer in memory.columns else float("nan"))
            out.append(entry)
    return pd.DataFrame(out)


def _peer_order(providers, provider: str) -> list[str]:
    """The peers of ``provider`` among ``providers``: :data:`PROVIDERS`, then :data:`OPTIONAL_PROVIDERS`, then any other
    (sorted), never ``provider`` or another configuration of it (``kernels_lib[...]``)."""
    present = [p for p in providers if p != provider and not str(p).startswith(f"{provider}[")]
    known = [p for p in PROVIDERS + OPTIONAL_PROVIDERS if p in present]
    return known + sorted(p for p in present if p not in known)


def masked_share(rows: pd.DataFrame) -> pd.Series:
    """Each row's share of masked label positions (:func:`masked_labels`); 0 for rows measured before the column."""
    if "masked_share" not in rows:
        return pd.Series(0.0, index=rows.index)
    return pd.to_numeric(rows["masked_share"], errors="coerce").fillna(0.0)


def step_comparison(rows: pd.DataFrame, provider: str = "kernels_lib", share: float = 0.0) -> pd.DataFrame:
    """Per GPU (its newest run of each model, :func:`newest_runs_per_gpu`), model, checkpointing and tokens per
    step that ``provider`` measured (the rows with ``share`` of their labels masked, :func:`masked_share`): its
    median step time (``kernels_lib ms``), that time over each peer's at the same size (``× <peer>``, NaN where
    the peer did not measure it: out of memory, skipped or not run), the fastest peer there and the time over its
    (``× fastest peer``), its peak memory (``kernels_lib GiB``), the leanest peer there and the peak over its (``memory × leanest``). Every ratio is taken inside one run on one
    GPU. Columns ``gpu_name``, ``run_id``, ``model``, ``checkpointing``, ``tokens`` first; empty without CUDA rows."""
    out, peers_seen = [], []
    for gpu, latest in newest_runs_per_gpu(rows).items():
        ok = measured(latest)
        ok = ok[masked_share(ok) == share]
        for (model, ckpt), group in ok.groupby(["model", "checkpointing"], sort=False):
            time_ = group.groupby(["tokens", "provider"]).step_ms_50.median().unstack()
            memory = group.groupby(["tokens", "provider"]).peak_gib.median().unstack().reindex(index=time_.index, columns=time_.columns)
            if provider not in time_.columns:
                continue
            peers = _peer_order(time_.columns, provider)
            peers_seen += [p for p in peers if p not in peers_seen]
            for tokens in time_.index[time_[provider].notna()]:
                ours, ours_gib = time_.at[tokens, provider], memory.at[tokens, provider]
                times, peaks = time_.loc[tokens, peers].dropna(), memory.loc[tokens, peers].dropna()
                entry = {"gpu_name": gpu, "run_id": str(group.run_id.iloc[0]), "model": model, "checkpointing": bool(ckpt),
                         "tokens": int(tokens), f"{provider} ms": ours, **{f"× {p}": ours / time_.at[tokens, p] for p in peers},
                         "fastest peer": times.idxmin() if len(times) else None,
                         "× fastest peer": ours / times.min() if len(times) else math.nan, f"{provider} GiB": ours_gib,
                         "leanest peer": peaks.idxmin() if len(peaks) else None,
                         "memory × leanest": ours_gib / peaks.min() if len(peaks) else math.nan}
                out.append(entry)
    head = ["gpu_name", "run_id", "model", "checkpointing", "tokens", f"{provider} ms"]
    tail = ["fastest peer", "× fastest peer", f"{provider} GiB", "leanest peer", "memory × leanest"]
    return pd.DataFrame(out, columns=head + [f"× {p}" for p in peers_seen] + tail)


def masked_step_comparison(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """The steps measured with a share of every sequence's labels masked (``--masked-shares 0,0.5`` of
    scripts/training_step_bench.py), per GPU, model, checkpointing, tokens and masked share above 0: what
    :func:`step_comparison` says at that share (``× fastest peer``, ``memory × leanest``, ...), and each provider's
    step time over its own unmasked step at the same size in the same run (``<provider> masked / unmasked``): a
    head that skips the masked rows gets faster with the share, one that only zeroes them does not. Empty when no
    row has a masked share."""
    keys = ["gpu_name", "model", "checkpointing", "tokens"]
    shares = sorted(s for s in masked_share(rows).unique() if s > 0)
    frames = [step_comparison(rows, provider, s).assign(**{"masked share": s}) for s in shares]
    if not any(len(f) for f in frames):
        return pd.DataFrame(columns=keys + ["masked share"])
    table = pd.concat(frames, ignore_index=True).drop(columns="run_id")
    # each provider's median step per point and share, over its own unmasked one, in the newest run of each GPU
    newest = pd.concat([measured(latest).assign(gpu_name=gpu) for gpu, latest in newest_runs_per_gpu(rows).items()])
    medians = newest.assign(share=masked_share(newest)).groupby(keys + ["provider", "share"]).step_ms_50.median().unstack("share")
    ratios = medians.drop(columns=0.0, errors="ignore").div(medians.get(0.0, math.nan), axis=0)
    ratios = ratios.rename_axis(columns="masked share").stack().unstack("provider")
    ratios = ratios.rename(columns=lambda name: f"{name} masked / unmasked").reset_index()
    table = table.merge(ratios, on=keys + ["masked share"], how="left")
    first = keys + ["masked share"]
    return table[first + [c for c in table.columns if c not in first]]


def largest_comparison(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """Per GPU (its newest run of each model), model and checkpointing: the largest tokens per step ``provider``
    measured (:func:`largest_fit`), what stopped it, and that size over each peer's largest (``× <peer>``; NaN
    where the peer measured none). A size not stopped by an OOM (budget, end of the grid) is a lower bound:
    ``bounded by OOM`` says which."""
    out = []
    for gpu, latest in newest_runs_per_gpu(rows).items():
        for (model, ckpt), fits in largest_fit(latest).groupby(["model", "checkpointing"], sort=False):
            fits = fits.set_index("provider")
            if provider not in fits.index:
                continue
            ours = fits.at[provider, "largest tokens"]
            entry = {"gpu_name": gpu, "model": model, "checkpointing": bool(ckpt), f"{provider} largest tokens": int(ours),
                     "stopped by": fits.at[provider, "stopped by"], "bounded by OOM": bool(fits.at[provider, "bounded by OOM"])}
            for peer in _peer_order(fits.index, provider):
                theirs = fits.at[peer, "largest tokens"]
                entry[f"× {peer}"] = ours / theirs if theirs > 0 else math.nan
            out.append(entry)
    return pd.DataFrame(out)


#: How a sentence names each provider of the training step.
SAID = {"huggingface": "Hugging Face", "trl": "TRL", "liger": "Liger", "torch_lce": "torch's `F.linear_cross_entropy`"}


def said(provider: str) -> str:
    """A provider as the training step's sentences name it (``huggingface`` → ``Hugging Face``)."""
    return SAID.get(provider, narrative.name(provider))


def comparison_lines(steps: pd.DataFrame, largest: pd.DataFrame | None = None, provider: str = "kernels_lib",
                     digits: int = 2) -> str:
    """One markdown bullet per (GPU, model, checkpointing) of :func:`step_comparison`: the range over the sizes
    of ``provider``'s step time over each peer's and over the fastest peer's (naming it), its peak memory over the
    leanest peer's, and with ``largest`` (:func:`largest_comparison`) its largest step over each peer's.
    "Not measured on a GPU yet" without rows."""
    if steps is None or not len(steps):
        return "Not measured on a GPU yet: no step to compare."
    lines = []
    for (gpu, model, ckpt), group in steps.groupby(["gpu_name", "model", "checkpointing"], sort=False):
        peers = [c[2:] for c in group.columns if c.startswith("× ") and c != "× fastest peer" and group[c].notna().any()]
        times = ", ".join(f"{narrative.span(group[f'× {p}'], digits)} {said(p)}'s" for p in peers)
        fastest = ", ".join(said(p) for p in dict.fromkeys(group["fastest peer"].dropna()))
        leanest = ", ".join(said(p) for p in dict.fromkeys(group["leanest peer"].dropna()))
        text = (f"- **{data.gpu_label(gpu)}, {model}, checkpointing {'on' if ckpt else 'off'}** "
                f"({int(group.tokens.min()):,}–{int(group.tokens.max()):,} tokens per step): "
                f"{provider}'s step time is {times or 'not compared: no peer measured'}; "
                f"{narrative.span(group['× fastest peer'], digits)} the fastest peer's ({fastest or 'none'}). "
                f"Its peak memory is {narrative.span(group['memory × leanest'], digits)} the leanest peer's ({leanest or 'none'})")
        fit = (largest[(largest.gpu_name == gpu) & (largest.model == model) & (largest.checkpointing == ckpt)]
               if largest is not None and len(largest) else pd.DataFrame())
        if len(fit):
            fit = fit.iloc[0]
            ratios = [f"{fit[f'× {p}']:.2f}× {said(p)}'s" for p in SAID if f"× {p}" in fit and pd.notna(fit[f"× {p}"])]
            size = f"{int(fit[f'{provider} largest tokens']):,} tokens"
            size = f"{size} ({fit['stopped by']})" if fit["bounded by OOM"] else f"at least {size} (the sweep stopped: {fit['stopped by']})"
            text += f"; its largest step, {size}, is {', '.join(ratios) or 'not compared'}"
        lines.append(text + ".")
    return "\n".join(lines)


def gpu_summary_lines(steps: pd.DataFrame, largest: pd.DataFrame | None = None, provider: str = "kernels_lib") -> str:
    """One markdown bullet per GPU of :func:`step_comparison` (over its models, checkpointing settings and sizes):
    the range of ``provider``'s step time over the fastest peer's and over Hugging Face's, of its peak memory over
    the leanest peer's, and with ``largest`` of its largest step over Hugging Face's."""
    if steps is None or not len(steps):
        return "Not measured on a GPU yet: no step to compare."
    lines = []
    for gpu, group in steps.groupby("gpu_name", sort=False):
        text = (f"- **{data.gpu_label(gpu)}** ({', '.join(dict.fromkeys(group.model))}, checkpointing off and on, "
                f"{int(group.tokens.min()):,}–{int(group.tokens.max()):,} tokens per step): {provider}'s step takes "
                f"{narrative.span(group['× fastest peer'])} the fastest peer's time")
        if "× huggingface" in group and group["× huggingface"].notna().any():
            text += f" and {narrative.span(group['× huggingface'])} Hugging Face's"
        text += f", at {narrative.span(group['memory × leanest'])} the leanest peer's peak memory"
        fits = largest[largest.gpu_name == gpu] if largest is not None and len(largest) else pd.DataFrame()
        if len(fits) and "× huggingface" in fits and fits["× huggingface"].notna().any():
            text += f"; its largest step is {narrative.span(fits['× huggingface'])} Hugging Face's"
            if not fits["bounded by OOM"].all():
                text += " (at least, where the sweep stopped before an OOM)"
        lines.append(text + ".")
    return "\n".join(lines)


def measured_rows(path: Path | str | None = None) -> pd.DataFrame:
    """The rows of ``data/measured/training_step.csv`` (``path``: another file of its columns); empty, with
    :data:`COLUMNS`, where there is no such file."""
    path = data.measured_path("training_step") if path is None else Path(path)
    return data.read_table(path) if path.exists() else pd.DataFrame(columns=COLUMNS)


#: What notebook 05's headline names (:func:`headline`): the step, and the peers of ``training_step.csv``.
HEADLINE_WHAT = "The training step (the peers: Hugging Face, Liger and TRL)"


def headline_tables(rows: pd.DataFrame, provider: str = "kernels_lib") -> dict[str, list[pd.DataFrame]]:
    """Per GPU of :func:`step_comparison` (its newest run of each model), one table per model and checkpointing,
    indexed by ``tokens``: ``× fastest peer`` and ``memory × leanest``, the columns :func:`.narrative.headline`
    reads (a whole step has no floor column, so the sentence has no floor clause)."""
    steps = step_comparison(rows, provider)
    out: dict[str, list[pd.DataFrame]] = {}
    for (gpu, _, _), group in steps.groupby(["gpu_name", "model", "checkpointing"], sort=False):
        out.setdefault(str(gpu), []).append(group.set_index("tokens")[["× fastest peer", "memory × leanest"]])
    return {gpu: out[gpu] for gpu in sorted(out, key=lambda g: (data.gpu_label(g), g))}


def headline(rows: pd.DataFrame, provider: str = "kernels_lib") -> str:
    """Notebook 05's opening sentence (and its card's on the index): :func:`.narrative.headline` of
    :func:`headline_tables`, ``provider``'s step time × the fastest peer's and peak memory × the leanest peer's,
    per GPU; no commit, no date (:func:`provenance_lines` says the runs)."""
    return narrative.headline(HEADLINE_WHAT, headline_tables(rows, provider), ours=provider, of="step",
                              unmeasured="not measured on a GPU yet")


def provenance_lines(rows: pd.DataFrame) -> str:
    """One :func:`.narrative.provenance_line` per GPU and model of the runs behind :func:`headline` (markdown bullets)."""
    lines = [f"- {model}: {narrative.provenance_line(run)}" for gpu, latest in newest_runs_per_gpu(rows).items()
             for model, run in latest.groupby("model", sort=False)]
    return "\n".join(lines) or "No GPU run yet."


def torch_lce_lines(latest: pd.DataFrame, gpu: str) -> str:
    """Markdown bullets for the run beside torch's ``F.linear_cross_entropy`` on ``gpu`` (:func:`latest_run` rows of
    that GPU): per checkpointing, kernels_lib's step time and peak memory over ``torch_lce``'s (:func:`step_ratios`),
    and the first step's loss of each; "" where ``torch_lce`` was not measured."""
    ratios = step_ratios(latest)
    if "time / torch_lce" not in ratios:
        return ""
    parts = []
    for ckpt, part in ratios.groupby("checkpointing"):
        t, m = part["time / torch_lce"].dropna(), part["memory / torch_lce"].dropna()
        if len(t):
            parts.append(f"checkpointing {'on' if ckpt else 'off'}: {narrative.span(t, 3)} its time at {narrative.span(m, 4)} "
                         f"its peak memory over {int(part.tokens.min())}–{int(part.tokens.max())} tokens per step")
    first = latest[latest.loss_first.notna()].sort_values("tokens").groupby("provider").loss_first.first()
    text = (f"- **Beside torch's function on the {data.gpu_label(gpu)}:** kernels_lib's step, " + "; ".join(parts) + ". The time "
            "is the head's: the same backbone, the same peak (both form the gradients chunk by chunk, neither keeps the logits).")
    if {"torch_lce", "kernels_lib", "huggingface"} <= set(first.index):
        text += (f"\n- **Its loss** comes back in the hidden states' dtype: {first['torch_lce']:.4f} in the first step, "
                 f"against kernels_lib's {first['kernels_lib']:.4f} and Hugging Face's {first['huggingface']:.4f}.")
    return text


def training_verdicts(rows: pd.DataFrame, provider: str = "kernels_lib") -> pd.DataFrame:
    """The targets (:data:`TRAINING_TARGETS`, printed by ``scripts/training_step_bench.py``; the notebook shows
    :func:`step_comparison`) per (model, checkpointing) for the newest run of each model: the ratio that decides
    (worst over the sizes for the time bounds; at the largest size both fit for memory; largest fits for the size
    bound), where, the bound, and ``met``, ``missed``
    or ``not judged`` (a peer not measured; or, for the size bound, neither an OOM of ``provider`` nor
    a ratio already past the bound)."""
    rows = latest_run(rows)
    ratios = step_ratios(rows, provider)
    fits = largest_fit(rows)
    out = []
    for (model, ckpt), group in rows.groupby(["model", "checkpointing"], sort=False):
        these = ratios[(ratios.model == model) & (ratios.checkpointing == ckpt)] if len(ratios) else ratios
        for label, (quantity, bound, direction) in TRAINING_TARGETS.items():
            ratio, where, status, detail = float("nan"), None, "not judged", ""
            if quantity.startswith("largest"):
                f = fits[(fits.model == model) & (fits.checkpointing == ckpt)].set_index("provider")
                if provider in f.index and "huggingface" in f.index and f.at["huggingface", "largest tokens"] > 0:
                    ours, theirs = f.at[provider, "largest tokens"], f.at["huggingface", "largest tokens"]
                    ratio, where = ours / theirs, int(ours)
                    lower_bound = not f.at[provider, "bounded by OOM"]
                    detail = (f"{provider} {int(ours)} tokens ({f.at[provider, 'stopped by']}), huggingface {int(theirs)} "
                              f"({f.at['huggingface', 'stopped by']})")
                    if ratio >= bound:
                        status = "met"
                    elif not lower_bound:
                        status = "missed"
                    else:
                        detail += f"; {provider} was not run to OOM"
            elif len(these) and quantity in these.columns:
                values = these.set_index("tokens")[quantity].dropna()
                if quantity.startswith("memory"):
                    values = values.loc[values.index.max():] if len(values) else values  # the largest size both fit
                if len(values):
                    ratio, where = float(values.max()), int(values.idxmax())
                    status = "met" if ratio <= bound else "missed"
                    detail = f"over {len(values)} size(s), best {values.min():.3f}"
            out.append({"model": model, "checkpointing": bool(ckpt), "target": label, "bound": f"{direction} {bound}",
                        "ratio": ratio, "at tokens": where, "status": status, "detail": detail})
    return pd.DataFrame(out, columns=["model", "checkpointing", "target", "bound", "ratio", "at tokens", "status", "detail"])


# --------------------------------------------------------------------------- analytic costs


def lm_head_bytes_per_token(vocab: int) -> dict[str, int]:
    """What the unfused LM head holds per token in a bf16 training step (SPEC §7): the bf16 logits,
    their float32 upcast and its float32 gradient (10 bytes × V: about 1.3 MB at V = 128256)."""
    return {"logits (bf16)": 2 * vocab, "float32 upcast": 4 * vocab, "logits gradient (float32)": 4 * vocab}


def activation_bytes_per_token(name: str, checkpointing: bool) -> float:
    """An estimate of the bf16 activations a Hugging Face decoder keeps per token for backward (sdpa).

    Per layer: two RMSNorms (float32 input 4H, normalized bf16 2H, output 2H: 8H each), q 2H, k and v
    2·kv each, the attention output and the o_proj input (2H each), the MLP's gate, SiLU, up and
    product (2I each): 22H + 4kv + 8I bytes; plus the final norm (8H) and the embedding output (2H).
    With checkpointing each layer keeps its input (2H) and one layer's activations are live again
    while it is recomputed. An estimate to set beside the measurement, not a measurement."""
    s = MODEL_SHAPES[name]
    h, i, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    per_layer = 22 * h + 4 * kv + 8 * i
    if checkpointing:
        return layers * 2 * h + per_layer + 10 * h
    return layers * per_layer + 10 * h


def step_memory_estimate(name: str, tokens: int, checkpointing: bool = False) -> pd.DataFrame:
    """The memory of one bf16 AdamW training step of shape ``name`` at ``tokens`` per step, by
    component (GB, 1e9 bytes), for the unfused head (``LM head`` = ``unfused``: Hugging Face) and a
    fused one (``fused``: no logits; its chunk buffers, a few hundred MB, are left out):
    weights (2 bytes/parameter), gradients (2), AdamW's two moments (4: torch keeps them in the
    parameter dtype), the activations (:func:`activation_bytes_per_token`) and the LM head's logits,
    upcast and gradient (:func:`lm_head_bytes_per_token`)."""
    params = parameter_count(name)
    vocab = MODEL_SHAPES[name]["vocab_size"]
    common = {"weights (bf16)": 2 * params, "gradients (bf16)": 2 * params, "AdamW state (2 moments, bf16)": 4 * params,
              "activations (estimate)": activation_bytes_per_token(name, checkpointing) * tokens}
    head = {k: v * tokens for k, v in lm_head_bytes_per_token(vocab).items()}
    out = []
    for provider, parts in (("unfused", {**common, **head}), ("fused", {**common, **{k: 0 for k in head}})):
        for component, value in parts.items():
            out.append({"model": name, "tokens": tokens, "checkpointing": bool(checkpointing), "LM head": provider,
                        "component": component, "GB": value / 1e9})
    return pd.DataFrame(out)


def analytic_costs(names: Iterable[str] = ("llama-3.2-1b", "qwen2.5-0.5b")) -> pd.DataFrame:
    """Per model shape: parameters, the bytes of weights + gradients + AdamW state, the LM head's
    bytes per token (logits, upcast, gradient) and the activations' per token (estimate, with and
    without checkpointing), and the tokens per step at which the logits' share outweighs the
    weights + gradients + optimizer state."""
    out = []
    for name in names:
        params = parameter_count(name)
        vocab = MODEL_SHAPES[name]["vocab_size"]
        head = sum(lm_head_bytes_per_token(vocab).values())
        state = 8 * params
        out.append({"model": name, "vocab": vocab, "hidden": MODEL_SHAPES[name]["hidden_size"],
                    "parameters (M)": params / 1e6,
                    "LM head weight (M)": vocab * MODEL_SHAPES[name]["hidden_size"] / 1e6,
                    "weights + grads + AdamW (GB)": state / 1e9,
                    "LM head per token (MB)": head / 1e6,
                    "activations per token (MB)": activation_bytes_per_token(name, False) / 1e6,
                    "activations per token, checkpointing (MB)": activation_bytes_per_token(name, True) / 1e6,
                    "tokens where logits > weights + grads + AdamW": math.ceil(state / head),
                    "LM head at 16 × 2048 tokens (GB)": head * 16 * 2048 / 1e9})
    return pd.DataFrame(out).set_index("model")


# --------------------------------------------------------------------------- charts (plotly, imported when drawn)

COMPONENT_COLORS = {
    "weights (bf16)": "#4c78a8", "gradients (bf16)": "#72b7b2", "AdamW state (2 moments, bf16)": "#54a24b",
    "activations (estimate)": "#b279a2", "logits (bf16)": "#f58518", "float32 upcast": "#e45756",
    "logits gradient (float32)": "#9d755d",
}


def memory_components_chart(names: Sequence[str] = ("llama-3.2-1b", "qwen2.5-0.5b"), tokens: int = 16 * SEQ):
    """Stacked bars of :func:`step_memory_estimate` (GB) per model, head (unfused / fused) and
    checkpointing, at ``tokens`` per step."""
    import plotly.graph_objects as go

    frame = pd.concat([step_memory_estimate(n, tokens, c) for n in names for c in (False, True)], ignore_index=True)
    frame["bar"] = frame.model + "<br>" + frame["LM head"] + ", ckpt " + frame.checkpointing.map({False: "off", True: "on"})
    figure = go.Figure()
    for component, rows in frame.groupby("component", sort=False):
        figure.add_trace(go.Bar(x=rows.bar, y=rows.GB, name=component, marker_color=COMPONENT_COLORS.get(component),
                                hovertemplate="%{x}<br>" + component + ": %{y:.1f} GB<extra></extra>"))
    figure.update_layout(barmode="stack", height=480, yaxis_title="GB (estimate)",
                         title=f"What a bf16 AdamW step holds at {tokens:,} tokens per step (estimate)",
                         legend={"orientation": "h", "y": -0.25})
    return figure


def loss_curve_chart(curves: pd.DataFrame, title: str = "Loss per AdamW step, same init and batch"):
    """:func:`loss_curves` rows: one panel per dtype, a line per provider."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from .charts import kernels_lib_on_top, provider_color  # one colour per provider in every report

    dtypes = list(dict.fromkeys(curves.dtype))
    figure = make_subplots(rows=1, cols=len(dtypes), subplot_titles=dtypes, shared_yaxes=True)
    for col, dtype in enumerate(dtypes, start=1):
        for provider, rows in curves[curves.dtype == dtype].groupby("provider", sort=False):
            exact = provider == EXACT_HEAD  # the yardstick: thin, black, dashed, under the providers
            figure.add_trace(go.Scatter(x=rows.step, y=rows.loss, name=provider, legendgroup=provider, showlegend=col == 1,
                                        mode="lines" if exact else "lines+markers",
                                        line={"color": "#000000" if exact else provider_color(provider), "width": 1 if exact else 2,
                                              "dash": "dash" if exact else "solid" if provider == "huggingface" else "dot"}),
                             row=1, col=col)
        figure.update_xaxes(title_text="step", row=1, col=col)
    figure.update_yaxes(title_text="loss", row=1, col=1)
    figure.update_layout(title=title, height=380)
    return kernels_lib_on_top(figure)


def step_chart(rows: pd.DataFrame, model: str):
    """Measured rows of one model (one run): median step time (p20–p80 as error bars) and peak memory
    against tokens per step, a line per provider, checkpointing off and on side by side; the points
    that ran out of memory as crosses at the GPU's capacity (dotted)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from .charts import kernels_lib_on_top, provider_color  # one colour per provider in every report

    rows = rows[rows.model == model]
    settings = sorted(rows.checkpointing.unique())
    titles = [f"{what}, checkpointing {'on' if c else 'off'}" for what in ("step time", "peak memory") for c in settings]
    figure = make_subplots(rows=2, cols=len(settings), subplot_titles=titles, shared_xaxes=True, vertical_spacing=0.12)
    capacity = rows.gpu_memory_gib.dropna().max() if "gpu_memory_gib" in rows else float("nan")
    for col, ckpt in enumerate(settings, start=1):
        these = rows[rows.checkpointing == ckpt]
        ok = measured(these)
        present = set(these.provider)
        for provider in [p for p in PROVIDERS if p in present] + sorted(p for p in present if p not in PROVIDERS):
            mine = ok[ok.provider == provider].sort_values("tokens")
            color = provider_color(provider)  # a dial point in its provider's colour
            first = col == 1
            figure.add_trace(go.Scatter(
                x=mine.tokens, y=mine.step_ms_50, name=provider, legendgroup=provider, showlegend=first,
                mode="lines+markers", line={"color": color},
                error_y={"type": "data", "symmetric": False, "array": mine.step_ms_80 - mine.step_ms_50,
                         "arrayminus": mine.step_ms_50 - mine.step_ms_20}), row=1, col=col)
            figure.add_trace(go.Scatter(x=mine.tokens, y=mine.peak_gib, name=provider, legendgroup=provider,
                                        showlegend=False, mode="lines+markers", line={"color": color}), row=2, col=col)
            oom = these[(these.provider == provider) & notes(these).eq("OOM")]
            if len(oom) and not math.isnan(capacity):
                figure.add_trace(go.Scatter(x=oom.tokens, y=[capacity] * len(oom), name=f"{provider} OOM", legendgroup=provider,
                                            showlegend=False, mode="markers", marker={"symbol": "x", "size": 12, "color": color},
                                            hovertemplate=provider + " OOM at %{x} tokens<extra></extra>"), row=2, col=col)
        if not math.isnan(capacity):
            figure.add_hline(y=capacity, line_dash="dot", line_color="#7f7f7f", row=2, col=col,
                             annotation_text=f"GPU {capacity:.0f} GiB", annotation_position="top left")  # the OOM crosses sit at the right
        ticks = sorted(int(t) for t in these.tokens.dropna().unique())  # the sizes swept: 8k, 16k, … (no crowded minor labels)
        labels = [f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in ticks]
        figure.update_xaxes(type="log", title_text="tokens per step (B × T)", tickvals=ticks, ticktext=labels, row=2, col=col)
        figure.update_xaxes(type="log", tickvals=ticks, ticktext=labels, row=1, col=col)
    figure.update_yaxes(title_text="step time (ms)", row=1, col=1)
    figure.update_yaxes(title_text="peak allocated (GiB)", row=2, col=1)
    gpu = rows.gpu_name.iloc[0] if len(rows) else ""
    figure.update_layout(title=f"{model}: a training step on {gpu} (forward, backward, AdamW)", height=700)
    return kernels_lib_on_top(figure)


#: SPEC §7's reference measurement: one H200, random init, bf16, AdamW, 16 × 2048 tokens per step, peak GiB
#: per (model, checkpointing, LM head); "fused" is a minimal hand patch with kernels_lib's loss. Notebook 05
#: sets :func:`step_memory_estimate` beside it.
REFERENCE_PEAK_GIB = {("llama-3.2-1b", False, "unfused"): 107.5, ("llama-3.2-1b", False, "fused"): 62.0,
                      ("llama-3.2-1b", True, "unfused"): 56.4, ("llama-3.2-1b", True, "fused"): 13.9,
                      ("qwen2.5-0.5b", False, "unfused"): 100.7, ("qwen2.5-0.5b", False, "fused"): 45.8,
                      ("qwen2.5-0.5b", True, "unfused"): 60.0, ("qwen2.5-0.5b", True, "fused"): 6.8}


def estimate_beside_reference(tokens: int = 16 * SEQ) -> pd.DataFrame:
    """:func:`step_memory_estimate`'s peak (GiB) per (model, checkpointing, LM head) beside
    :data:`REFERENCE_PEAK_GIB`, and their ratio."""
    rows = []
    for (model, ckpt, head), measured_gib in REFERENCE_PEAK_GIB.items():
        estimate = step_memory_estimate(model, tokens, ckpt).groupby("LM head").GB.sum()[head] * 1e9 / GIB
        rows.append({"model": model, "checkpointing": ckpt, "LM head": head, "estimate (GiB)": estimate,
                     "reference, SPEC §7 (GiB)": measured_gib, "estimate / reference": estimate / measured_gib})
    return pd.DataFrame(rows).set_index(["model", "checkpointing", "LM head"])


def conclusion_lines(costs: pd.Series, check_model: str, curve_distance: pd.Series | None, steps: pd.DataFrame | None = None,
                     small: pd.DataFrame | None = None, convergence: pd.DataFrame | None = None,
                     largest: pd.DataFrame | None = None) -> str:
    """Notebook 05's conclusion as markdown bullets, every figure from its arguments: ``costs`` one model's
    row of :func:`analytic_costs`, ``curve_distance`` kernels_lib's largest loss difference from the
    unpatched model per dtype (None: the checks were not run), ``steps`` :func:`step_comparison` of the
    sweep (per GPU; None: not measured) and
    ``largest`` its :func:`largest_comparison`, ``small`` the small steps' :func:`step_comparison`,
    ``convergence`` the 16-bit runs' summary (``gpu_name`` where several GPUs ran it, mode, provider,
    ``max_abs_diff_huggingface``, ``weights_rel_dist_huggingface``)."""
    vocab, hidden = int(costs["vocab"]), int(costs["hidden"])
    lines = [
        f"- **The head, not the model, fills a small model's training step.** Unfused, the logits, their float32 upcast and "
        f"their gradient cost {costs['LM head per token (MB)']:.2f} MB per token: at 16 × 2048 tokens "
        f"{costs['LM head at 16 × 2048 tokens (GB)']:.0f} GB, {costs['LM head at 16 × 2048 tokens (GB)'] / costs['weights + grads + AdamW (GB)']:.1f}× "
        f"the {costs['weights + grads + AdamW (GB)']:.1f} GB of weights, gradients and AdamW state. Gradient checkpointing "
        "removes most activations and none of it.",
        (f"- **On this machine** ({check_model}), a fused head keeps per token exactly the unfused one's minus $4V$ bytes, and the "
         "patched model's loss curve follows the unpatched one's to " + ", ".join(f"{v:.0e} ({d})" for d, v in curve_distance.items())
         + " over 20 AdamW steps." if curve_distance is not None else
         "- **The checks of section 3 were not run in this report** (`run_checks = False`).")
        + f" kernels_lib and Liger form $dW$ in forward and keep it until backward (a fixed $2VH$ bytes: "
        f"{2 * vocab * hidden / 1e9:.2f} GB at V = {vocab}, H = {hidden}); TRL recomputes the logits in backward instead.",
    ]
    if steps is None or not len(steps):
        lines.append("- **Not measured on a GPU yet** (section 4): the step's time and memory are not compared here.")
    else:
        lines.append(gpu_summary_lines(steps, largest))
    if small is not None and len(small) and "× huggingface" in small:
        for gpu, part in small.groupby("gpu_name", sort=False):
            worst = part.groupby("model")["× huggingface"].max().dropna()
            fastest = part.groupby("model")["× fastest peer"].max().dropna()
            if len(worst):
                lines.append(f"- **Small steps** (4b, {data.gpu_label(gpu)}): kernels_lib's step takes at most "
                             + ", ".join(f"{v:.3f}× ({m})" for m, v in worst.items())
                             + " Hugging Face's and at most " + ", ".join(f"{v:.3f}× ({m})" for m, v in fastest.items())
                             + f" the fastest peer's at {int(part.tokens.min())}–{int(part.tokens.max())} tokens per step.")
    if convergence is not None and len(convergence):
        groups = convergence.groupby("gpu_name", sort=False) if "gpu_name" in convergence else [(None, convergence)]
        for gpu, part in groups:
            by = part.set_index(["mode", "provider"])
            ours = by.xs("kernels_lib", level="provider")["max_abs_diff_huggingface"]
            spread = part[part.provider != "huggingface"]["weights_rel_dist_huggingface"].dropna()
            where = f" on the {data.gpu_label(gpu)}" if gpu is not None else ""
            lines.append(f"- **Training follows in 16 bits** (4c{where}): over the run every fused head's loss stays within "
                         f"{by['max_abs_diff_huggingface'].max():.2f} of Hugging Face's at any step (kernels_lib "
                         + ", ".join(f"{v:.2f} ({m})" for m, v in ours.items()) + "). The final weights of the heads lie "
                         + (narrative.span(spread, suffix="") if len(spread) else "an unmeasured distance")
                         + " apart in relative norm from Hugging Face's: 16-bit training amplifies any rounding difference, so one seed "
                         "cannot separate the heads further.")
    return "\n".join(lines)
