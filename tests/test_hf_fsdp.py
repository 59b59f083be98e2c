"""kernels_lib.hf under FSDP2 (``fully_shard``) with the LM head a unit of its own: gloo ranks on the CPU.

The per-module wrap of accelerate and torchtitan: ``fully_shard`` on every decoder layer, on the head
(with the tied embedding in one group, ``fully_shard([embed_tokens, lm_head])``, as FSDP2 requires for a
shared parameter) and on the root. Each rank feeds its own batch (data parallel). The patched model
(:func:`kernels_lib.hf.patch`, before or after sharding) and :func:`kernels_lib.hf.add_fused_lm_head` are
compared on every rank with the same model unpatched under the same sharding: the loss and every
parameter's gradient after FSDP's reduce-scatter (``grad.full_tensor()``), relative in norm (observed
~1e-7; 1e-5 for the loss and 1e-4 for gradients, as in test_hf.py). The head's weight must be sharded
again after the loss (the full head lives only during it) and the kernel must have received the
unsharded weight. A sharded weight passed straight to the loss, each rank with its own tokens, is refused
with an error that says what it is and what to do. Two and three ranks; tiny models (hf_models).
"""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from process_groups import GLOO_CPU_MARKS, outcomes, spawn_group
import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)

pytestmark = GLOO_CPU_MARKS

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4

#: name -> (tied embeddings, when the patch goes in: "before" or "after" fully_shard, "patch" or "fused_head")
CASES = {
    "untied_patch_before": (False, "before", "patch"),
    "untied_patch_after": (False, "after", "patch"),
    "tied_patch_before": (True, "before", "patch"),
    "tied_patch_after": (True, "after", "patch"),
    "untied_fused_head": (False, "after", "fused_head"),
    "tied_fused_head": (True, "before", "fused_head"),
}


def _sharded(model, tied: bool):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard([model.model.embed_tokens, model.lm_head] if tied else model.lm_head)
    fully_shard(model)
    return model


def _fused_head_loss(log_probs: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A GRPO-like objective of the per-token values: the mean log-prob and an entropy bonus (both with gradients)."""
    n = mask.sum()
    return -(log_probs * mask).sum() / n - 0.1 * (entropy * mask).sum() / n


def _reference_fused_head(model, input_ids, attention_mask, labels):
    """What the fused head returns, from the unpatched model's logits (its own FSDP forward)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    log_softmax = logits.log_softmax(-1)
    log_probs = log_softmax.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) * mask
    return log_probs, entropy, mask


def _run_case(case: str, rank: int) -> dict:
    from hf_models import batch, tiny_model
    from torch.distributed.tensor import DTensor

    from kernels_lib import hf

    tied, when, kind = CASES[case]
    input_ids, attention_mask, labels = batch(batch_size=2, seq_len=10, seed=1 + rank)  # each rank its own batch
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    results = {}
    for patched in (False, True):
        model = tiny_model("llama", tied=tied, layers=2, seed=0)
        if patched and when == "before":
            hf.patch(model) if kind == "patch" else hf.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        _sharded(model, tied)
        if patched and when == "after":
            hf.patch(model) if kind == "patch" else hf.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        seen = []
        if patched:
            kernel = hf.fused_linear_cross_entropy

            def spy(x, weight, *args, **kwargs):
                seen.append((isinstance(weight, DTensor), tuple(weight.shape)))
                return kernel(x, weight, *args, **kwargs)

            hf.fused_linear_cross_entropy = spy
        try:
            if kind == "patch":
                loss = model(**inputs).loss
            elif patched:
                out = model(**inputs, fused_lm_head=True)
                loss = _fused_head_loss(out.log_probs, out.entropy, out.label_mask)
            else:
                loss = _fused_head_loss(*_reference_fused_head(model, input_ids, attention_mask, labels))
        finally:
            if patched:
                hf.fused_linear_cross_entropy = kernel
        head_weight = model.lm_head.weight
        resharded = isinstance(head_weight, DTensor) and tuple(head_weight.to_local().shape) != tuple(head_weight.shape)
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        results["patched" if patched else "unpatched"] = dict(
            loss=loss.detach(), grads=grads, seen=seen, resharded=resharded
        )
    return results


def _error_calls(rank: int) -> dict:
    """The sharded head's weight passed to the loss directly, outside the head's forward, each rank its own rows."""
    from hf_models import HIDDEN, VOCAB, tiny_model
    from torch.distributed.fsdp import fully_shard

    from kernels_lib import fused_linear_cross_entropy

    model = tiny_model("llama", seed=0)
    fully_shard(model.lm_head)
    fully_shard(model)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(6, HIDDEN, generator=generator)
    target = torch.randint(0, VOCAB, (6,), generator=generator)
    return {"fsdp_weight_outside_forward": lambda: fused_linear_cross_entropy(x, model.lm_head.weight, target)}


def _worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    results = {"cases": {case: _run_case(case, rank) for case in CASES}, "errors": outcomes(_error_calls(rank))}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@functools.cache
def group_run(world: int) -> list[dict]:
    return spawn_group(_worker, world)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    scale = ref.norm().item()
    return (out - ref).norm().item() / (scale if scale > 0 else 1.0)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_unpatched_fsdp_model(world, case):
    """Loss and every gradient (after FSDP's reduce-scatter) as the unpatched model's under the same sharding,
    on every rank; the kernel got the unsharded weight once, and the head is sharded again after the loss."""
    for rank, results in enumerate(group_run(world)):
        got, want = results["cases"][case]["patched"], results["cases"][case]["unpatched"]
        assert rel_err(got["loss"], want["loss"]) < LOSS_TOL, (rank, got["loss"], want["loss"])
        assert got["grads"].keys() == want["grads"].keys()
        errors = {name: rel_err(got["grads"][name], want["grads"][name]) for name in want["grads"]}
        worst = max(errors, key=errors.get)
        assert errors[worst] < GRAD_TOL, (rank, worst, errors[worst])
        assert all(g.abs().sum() > 0 for g in got["grads"].values())
        assert got["seen"] == [(False, (257, 32))], got["seen"]  # the whole head, a plain tensor, once
        assert got["resharded"] and want["resharded"]
    # The ranks fed different batches: their losses differ, their reduced gradients agree.
    runs = group_run(world)
    assert runs[0]["cases"][case]["patched"]["loss"] != runs[1]["cases"][case]["patched"]["loss"]
    first = runs[0]["cases"][case]["patched"]["grads"]
    assert all(torch.equal(first[name], other["cases"][case]["patched"]["grads"][name])
               for other in runs[1:] for name in first)


@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_weight_passed_to_the_loss_is_refused_saying_what_to_do(world):
    """An FSDP2 weight outside the head's forward looks like a vocabulary-parallel head (a DTensor sharded
    (Shard(0),)); the ranks' different tokens show it is not: every rank raises, naming FSDP2 and the fixes."""
    for results in group_run(world):
        kind, message, _ = results["errors"]["fsdp_weight_outside_forward"]
        assert kind == "ValueError", message
        assert "FSDP2" in message and "full_tensor()" in message and "kernels_lib.hf" in message, message
