"""Notebook 05's loss-curve check, measured on its own over seeds: how far each provider's bf16 curve
moves from a run of the same model whose head forms the logits and their gradient in float32
(``training_step.EXACT_HEAD``), beside its distance from Hugging Face's own bf16 curve.

Hugging Face's unpatched bf16 model rounds its logits to bf16 before the float32 cross-entropy, and
TRL's chunked head does the same per chunk, so "drift from Hugging Face" mixes Hugging Face's rounding
with a provider's; the float32-head run is the yardstick that separates them. The notebook's check
(``training_step.curve_checks``) judges kernels_lib by its distance from it, bound by twice Hugging
Face's own. On a CUDA GPU at the notebook's full-size check (Llama-3.2-1B, 1 × 1024 tokens, lr 1e-4),
about 30 s a seed on an H200; ``--tiny`` runs the CPU shape (Triton's interpreter):

    python3 scripts/training_curve_distances.py --out $OUT [--seeds 0,1] [--tiny]

Writes ``OUT/training_curve_distances.csv``: one row per seed and provider, the largest distance from
the float32 head and from Hugging Face over the steps, and the provenance.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from kernels_workbench import training_step as ts

PROVIDERS = ("huggingface", "kernels_lib", "kernels_lib[accurate=True]", "trl")
FULL = {"model": "llama-3.2-1b", "batch": 1, "seq": 1024, "lr": 1e-4}
TINY = {"model": "llama-tiny", "batch": 2, "seq": 32, "lr": 3e-3}


def distances(shape: dict, seeds: list[int], steps: int, device: torch.device) -> pd.DataFrame:
    """One row per (seed, provider): ``max |Δ float32 head|`` and ``max |Δ huggingface|`` over ``steps``."""
    providers = [p for p in PROVIDERS if ts.provider_unavailable(p) is None]
    rows = []
    for seed in seeds:
        curves = ts.loss_curves(shape["model"], providers, steps, device, dtype=torch.bfloat16, seq=shape["seq"],
                                batch=shape["batch"], lr=shape["lr"], seed=seed)
        for provider, group in curves[curves.provider != ts.EXACT_HEAD].groupby("provider", sort=False):
            rows.append({"seed": seed, "provider": provider, "steps": steps, **shape,
                         f"max |Δ {ts.EXACT_HEAD}|": group[f"|Δ {ts.EXACT_HEAD}|"].max(),
                         "max |Δ huggingface|": group["|Δ huggingface|"].max(), "last loss": group.loss.iloc[-1]})
    return pd.DataFrame(rows).assign(**ts.training_provenance(device))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="the CPU shape (llama-tiny, 2 × 32 tokens)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = distances(TINY if args.tiny or device.type == "cpu" else FULL, [int(s) for s in args.seeds.split(",")], args.steps, device)
    args.out.mkdir(parents=True, exist_ok=True)
    rows.to_csv(args.out / "training_curve_distances.csv", index=False)
    print(rows[["seed", "provider", f"max |Δ {ts.EXACT_HEAD}|", "max |Δ huggingface|"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
