"""The sequence losses' gradient pass in tiles, with the bias gradient from its column sums: an interleaved A/B
against the library's pass (one program per row, then ``dz.sum(0)`` for the bias), on one GPU.

Arms: ``library`` (the default) and each ``--tiles`` entry ``RxVwW`` (``BLOCK_R`` rows × ``BLOCK_V`` columns,
``W`` warps) of :mod:`studies.kernels.token_grad_tiles`, put in every sequence loss by
:func:`studies.bench.arms.constants_set`. For each loss at the ``--points`` of its published chart (bf16, the
bench's inputs and options: KTO's has a bias, the others none, where only the tiling differs), the ``full``
call (forward with the gradient, backward) timed by ``studies.bench.timing.paired_times`` (the arms called
alternately, each alone after an L2 flush; per-sample ratios to ``library`` cancel the GPU's drift), with each
arm's loss and gradients against the library's (``rel_diff``, ‖arm − library‖ / ‖library‖ over the loss and
every gradient, float64). Writes ``token_grad_tiles_ab.csv`` to ``--out`` (append it to
``data/measured/gpu_runs/``).

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.token_grad_tiles_ab --out OUT
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import pandas as pd
import torch

from kernels_lib import default_device
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.registry import get_spec
from kernels_workbench.bench.timing import mode_callable
from kernels_workbench.training_step import free_memory
from studies.bench.arms import constants_set, flat_outputs, within
from studies.bench.timing import paired_arms, ratio_text
from studies.kernels.token_grad_tiles import arm

FILE = "token_grad_tiles_ab.csv"
LOSSES = ("kto_loss", "fused_linear_dpo_loss", "fused_linear_grpo_loss_token")


def parse_tile(text: str) -> tuple[int, int, int]:
    """``"32x512w4"`` -> ``(32, 512, 4)``; a malformed entry raises naming it."""
    try:
        rows, rest = text.lower().split("x")
        cols, warps = rest.split("w")
        tile = int(rows), int(cols), int(warps)
    except ValueError:
        raise ValueError(f"--tiles entries look like 32x512w4 (BLOCK_R x BLOCK_V w num_warps); got {text!r}") from None
    if any(v <= 0 or v & (v - 1) for v in tile):
        raise ValueError(f"--tiles: BLOCK_R, BLOCK_V and num_warps must be powers of two; got {text!r}")
    return tile


def arm_context(tile):
    """The library's code (``tile`` None) or the tiled pass with ``tile``, for the calls inside."""
    return contextlib.nullcontext() if tile is None else constants_set(arm(tile))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--tiles", default="16x1024w8,16x512w4,32x512w8,8x2048w8")
    parser.add_argument("--points", choices=("ends", "all"), default="ends", help="the chart's smallest and largest x, or all")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--size", choices=("published", "small"), default="published")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = default_device()
    tiles = [None] + [parse_tile(t) for t in args.tiles.split(",")]
    names = ["library"] + args.tiles.split(",")
    stamp = provenance(device)
    rows = []
    losses = args.losses.split(",")
    for i, name in enumerate(losses, 1):
        spec = get_spec(name)
        fn = spec.providers["kernels_lib"].load()
        workload = spec.published if args.size == "published" else spec.small
        xs = list(workload["x_values"])
        for x in xs if args.points == "all" else sorted({xs[0], xs[-1]}):
            sizes = {**workload["sizes"], workload["x_name"]: x}
            inputs = spec.make_inputs(sizes, workload.get("dtype", torch.bfloat16), device, dict(spec.default_options))
            call = lambda: fn(*inputs.args, **inputs.kwargs)  # noqa: E731
            ref = flat_outputs(call, inputs.grad_inputs)
            diffs = [float((flat_outputs(call, inputs.grad_inputs, lambda t=tile: arm_context(t)) - ref).norm()
                           / ref.norm()) for tile in tiles]
            full = mode_callable(call, inputs.grad_inputs, "full")
            calls = [within(lambda t=tile: arm_context(t), full) for tile in tiles]
            summary = paired_arms(calls, names, "library", device, samples=args.samples, grad_to_none=inputs.grad_inputs)
            for row, diff in zip(summary, diffs):
                rows.append({"loss": name, "x_name": workload["x_name"], "x_value": x,
                             "bias": bool(dict(spec.default_options).get("bias", False)),
                             **row, "rel_diff": diff, **stamp})
            best = min(rows[-len(tiles) + 1:], key=lambda r: r["ms_50"])
            print(f"[{i}/{len(losses)}] {name} {workload['x_name']}={x}: best {best['kernel_provider']} / library "
                  f"{ratio_text(best)}", flush=True)
            inputs = calls = ref = full = call = None
            free_memory(device)
        pd.DataFrame(rows).to_csv(args.out / FILE, index=False)  # written as it goes
    return 0


if __name__ == "__main__":
    sys.exit(main())
