"""Does a run trained on kernels_lib's head follow the run on Hugging Face's? 100+ AdamW steps on a
learnable synthetic token stream, the same init and batches for every provider, in the two ways a
GPU run trains in 16 bits (issue 10, part C; Liger-Kernel's mini-model convergence tests are the anchor):

- ``autocast``: float32 parameters under ``torch.autocast(bfloat16)`` (``Trainer(bf16=True)``): the
  losses take the autocast dtype for their matmuls and accumulate dW in float32;
- ``bf16``: bfloat16 parameters (kernels_lib's default accumulates dW across chunks in bf16, which
  SPEC §7 says can bias training over many steps; ``accurate=True`` accumulates in float32).

The stream: a random first-order Markov chain over ``--active`` tokens of the vocabulary (the rest
never occur, as most of a real vocabulary is rare), each followed by one of 4 successors with
weights 0.55/0.25/0.12/0.08, so the loss falls from ln V ≈ 11.8 towards the chain's entropy (1.15
nats) while the head's softmax still spans all V. Gradients clipped at norm 1 (the Trainer's default). Per step: the loss of every provider; at the end, each parameter's relative distance
from the Hugging Face run's. Any CUDA GPU:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && KERNELS_LIB_COMMIT=<sha> python3 scripts/training_convergence.py --out $OUT

Writes ``OUT/training_convergence.csv`` (one row per mode, provider and step; the summary columns on
the last step's row). About a minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PROVIDERS = ("huggingface", "kernels_lib", "kernels_lib[accurate=True]", "trl", "liger")
#: The model (:data:`kernels_workbench.training_step.MODEL_SHAPES`): hidden 1024, 8 layers, V = 128256, tied.
MODEL = "llama-1024x8"


def markov_stream(vocab: int, active: int, batch: int, seq: int, steps: int, seed: int, device) -> torch.Tensor:
    """``steps`` batches of ``batch × seq`` tokens from one random 4-successor chain over ``active``
    tokens of ``vocab`` (fixed by ``seed``)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    states = torch.randperm(vocab, generator=gen)[:active]
    successors = states[torch.randint(0, active, (vocab, 4), generator=gen)]
    probs = torch.tensor([0.55, 0.25, 0.12, 0.08])
    tokens = torch.empty(steps, batch, seq, dtype=torch.long)
    tokens[:, :, 0] = states[torch.randint(0, active, (steps, batch), generator=gen)]
    for t in range(1, seq):
        pick = torch.multinomial(probs, steps * batch, replacement=True, generator=gen).view(steps, batch)
        tokens[:, :, t] = successors[tokens[:, :, t - 1], pick]
    return tokens.to(device)


def train(provider, mode, stream, lr, seed, device):
    """``provider`` (:func:`~kernels_workbench.training_step.prepare`'s names) trained on ``stream``:
    the loss per step, the final weights (float32, on the CPU) and the seconds it took."""
    from kernels_workbench import training_step as ts

    model = ts.build_model(MODEL, device, seed, dtype=torch.float32 if mode == "autocast" else torch.bfloat16)
    loss_of = ts.prepare(provider, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    losses = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for ids in stream:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast"):
            loss = loss_of(ids, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    weights = {name: p.detach().float().cpu() for name, p in model.named_parameters()}
    del model, optimizer
    torch.cuda.empty_cache()
    return losses, weights, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--active", type=int, default=4096, help="tokens the chain visits (default 4096)")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    args = parser.parse_args()
    import pandas as pd

    from kernels_workbench.training_step import MODEL_SHAPES, new_run_id, training_provenance

    device = torch.device("cuda")
    stream = markov_stream(MODEL_SHAPES[MODEL]["vocab_size"], args.active, args.batch, args.seq, args.steps, args.seed, device)
    env = training_provenance(device)
    run_id = new_run_id()
    rows = []
    for mode in ("autocast", "bf16"):
        base_losses = base_weights = None
        for provider in args.providers.split(","):
            if mode == "autocast" and "accurate" in provider:
                continue  # float32 parameters: dW already accumulates in float32
            try:
                losses, weights, seconds = train(provider, mode, stream, args.lr, args.seed, device)
            except Exception as error:  # noqa: BLE001 - record and go on
                print(f"{mode} {provider}: {type(error).__name__}: {error}", flush=True)
                continue
            if provider == "huggingface":
                base_losses, base_weights = losses, weights
            diff = [abs(a - b) for a, b in zip(losses, base_losses)] if base_losses else [float("nan")] * len(losses)
            dist = (max(((w - base_weights[n]).norm() / base_weights[n].norm()).item() for n, w in weights.items())
                    if base_weights else float("nan"))
            last10 = sum(losses[-10:]) / 10
            print(f"{mode:8s} {provider:28s} loss {losses[0]:.3f} -> {losses[-1]:.4f} (last 10: {last10:.4f}) "
                  f"max |Δ hf| {max(diff):.4f} mean |Δ hf| last 10 {sum(diff[-10:]) / 10:.4f} "
                  f"weights vs hf (worst tensor) {dist:.3e} · {seconds:.1f} s", flush=True)
            for step, (loss, d) in enumerate(zip(losses, diff), start=1):
                rows.append({"run_id": run_id, "mode": mode, "provider": provider, "step": step, "loss": loss,
                             "abs_diff_huggingface": d})
            rows[-1].update({"last10_mean_loss": last10, "max_abs_diff_huggingface": max(diff),
                             "weights_rel_dist_huggingface": dist, "seconds": seconds,
                             "config": json.dumps({"hidden": 1024, "layers": 8, "vocab": 128256, "batch": args.batch,
                                                   "seq": args.seq, "lr": args.lr, "steps": args.steps,
                                                   "active": args.active, "clip": 1.0})})
    args.out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    for key, value in env.items():
        frame[key] = value
    frame.to_csv(args.out / "training_convergence.csv", index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
