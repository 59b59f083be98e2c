"""The A/B of the sequence losses' stored-exponentials route against their two passes, beside the floor.

:data:`kernels_lib._sequence_logprobs.STORE_EXPONENTIALS` (off by default) takes each chunk's log-probs
from the fused cross-entropy's epilogue GEMM and puts the weights on the row factors of ``x`` and
``dx``, so no pass reads the ``chunk × V`` buffer between the matmuls. Issue 30 asks every fused loss
for 1.05× its matmul floor; DPO, GRPO, CPO and SimPO were at 1.06–1.25× through the two passes.

For each loss (``fused_linear_dpo_loss``, ``fused_linear_cpo_loss``, ``fused_linear_simpo_loss``,
``fused_linear_grpo_loss_token``, ``fused_linear_grpo_loss_sequence``, ``kto_loss``) at its published
sizes, ``full`` (forward and backward) of kernels_lib with the route off (``kernels_lib``) and on
(:data:`ARM`), in ``rounds`` alternating rounds (the arms' order reversed every other round: the GPU
drifts over a run), speed and memory, each row the median over the rounds; the matmul floor of each
point from the matmul rate measured in the same run (:func:`kernels_lib.workbench.overview.floor_ms`),
as ``floor_ms`` beside every row; and the two arms' loss and gradients at the smallest B against each
other (``rel_diff``: ‖on − off‖ / ‖off‖ over the loss and every gradient, the largest).

On a GPU (one call, about five minutes on an H200):

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=/tmp/site:$PWD python3 -m kernels_lib.workbench.bench.sequence_exponentials_ab \\
        $OUT/gpu_runs/sequence_exponentials_ab.csv

``--size small`` runs it at the CPU presets (Triton's interpreter, which takes the route only when
:data:`kernels_lib.fused_linear_cross_entropy.EPILOGUE_GEMM_WHEN_INTERPRETED` asks: this module asks).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from pathlib import Path

import pandas as pd
import torch

from ... import _sequence_logprobs
from .. import overview
from .ceilings import measure_ceilings
from . import get_spec
from .sweep import available_providers, median_of_rounds, run_sweep
from .timing import _loss

#: The losses on the sequence log-prob pipeline whose published workload has no second target.
LOSSES = ("fused_linear_dpo_loss", "fused_linear_cpo_loss", "fused_linear_simpo_loss", "fused_linear_grpo_loss_token",
          "fused_linear_grpo_loss_sequence", "kto_loss")
#: The route's arm, as its rows name the provider.
ARM = "kernels_lib[store_exponentials=True]"


@contextlib.contextmanager
def route(on: bool):
    """The route on or off for the calls inside (the interpreter asked to take the epilogue GEMM too)."""
    flce = importlib.import_module("kernels_lib.fused_linear_cross_entropy")
    saved = _sequence_logprobs.STORE_EXPONENTIALS, flce.EPILOGUE_GEMM_WHEN_INTERPRETED
    _sequence_logprobs.STORE_EXPONENTIALS, flce.EPILOGUE_GEMM_WHEN_INTERPRETED = on, on or saved[1]
    try:
        yield
    finally:
        _sequence_logprobs.STORE_EXPONENTIALS, flce.EPILOGUE_GEMM_WHEN_INTERPRETED = saved


def _loss_and_grads(kernel_name: str, point: dict, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The kernels_lib provider's loss and gradients at ``point``, on the spec's inputs (fixed seed)."""
    spec = get_spec(kernel_name)
    fn = available_providers(kernel_name, ["kernels_lib"])[0]["kernels_lib"]
    inputs = spec.make_inputs(point, dtype, device, spec.default_options)
    loss = _loss(fn(*inputs.args, **inputs.kwargs))
    grads = torch.autograd.grad(loss, inputs.grad_inputs)
    return [loss.detach().float(), *(g.float() for g in grads)]


def arms_difference(kernel_name: str, point: dict, dtype: torch.dtype, device: torch.device) -> float:
    """The largest ‖on − off‖ / ‖off‖ over the loss and every gradient of the two arms at ``point``."""
    with route(False):
        off = _loss_and_grads(kernel_name, point, dtype, device)
    with route(True):
        on = _loss_and_grads(kernel_name, point, dtype, device)
    return max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(on, off))


def sequence_exponentials_ab(losses=LOSSES, size: str = "published", rounds: int = 3,
                             device: torch.device | str | None = None, x_values=None) -> pd.DataFrame:
    """The A/B's rows (module docstring): the sweep's columns, ``floor_ms``, ``rel_diff``, ``rounds``.
    ``x_values``: the preset's sizes to measure (default all of them)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    ceilings = measure_ceilings(device)
    rates = dict(zip(ceilings.metric_name, ceilings.y_value_50)) if len(ceilings) else {}
    out = []
    for kernel_name in losses:
        spec = get_spec(kernel_name)
        preset = spec.published if size == "published" else spec.small
        preset = {**preset, "x_values": list(x_values or preset["x_values"])}
        per_round = []
        for round_ in range(rounds):
            for on in ((False, True) if round_ % 2 == 0 else (True, False)):
                print(f"sequence_exponentials_ab: {kernel_name} round {round_ + 1} of {rounds}, route {'on' if on else 'off'}",
                      flush=True)
                with route(on):
                    rows = run_sweep(kernel_name, x_name=preset["x_name"], x_values=preset["x_values"], sizes=preset["sizes"],
                                     dtype=preset["dtype"], device=device, providers=["kernels_lib"], modes=("full",))
                per_round.append(rows.assign(kernel_provider=ARM if on else "kernels_lib", round=round_ + 1))
        table = median_of_rounds(pd.concat(per_round, ignore_index=True))
        smallest = {**preset["sizes"], preset["x_name"]: int(min(preset["x_values"]))}
        table["rel_diff"] = arms_difference(kernel_name, smallest, preset["dtype"], device)
        table["floor_ms"] = [
            overview.floor_ms(kernel_name, {**preset["sizes"], preset["x_name"]: int(x)}, preset["dtype"], "full",
                              rates["copy"], rates["matmul"])[0] if rates and metric == "speed" else float("nan")
            for x, metric in zip(table.x_value, table.metric_name)]
        table["rounds"] = rounds
        out.append(table)
    return pd.concat(out, ignore_index=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the CSV to write")
    parser.add_argument("--size", choices=("published", "small"), default="published")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--losses", default=",".join(LOSSES))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.losses.split(",")) - set(LOSSES))
    if unknown:
        parser.error(f"--losses takes {', '.join(LOSSES)}; got {', '.join(unknown)}")
    table = sequence_exponentials_ab(args.losses.split(","), size=args.size, rounds=args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out, index=False)
    speed = table[table.metric_name == "speed"].pivot_table(index=["kernel_name", "x_value"], columns="kernel_provider",
                                                          values="y_value_50")
    floor = table[table.metric_name == "speed"].groupby(["kernel_name", "x_value"]).floor_ms.first()
    print((speed.div(floor, axis=0) if floor.notna().any() else speed).round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
