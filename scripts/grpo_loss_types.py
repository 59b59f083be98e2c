"""Every GRPO loss type of TRL 1.16 at the published GRPO workload, four providers in one run, with the floor.

On the GPU machine, from the repository root (Liger and TRL as wheels in ``.whl/``):

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=/tmp/site:$PWD python3 scripts/grpo_loss_types.py --out $OUT

For each loss type of :data:`kernels_workbench.bench.fused_linear_grpo.LOSS_TYPES` (``cispo`` with
TRL's suggested ``epsilon_high = 5.0``, ``dr_grpo`` with ``max_completion_length = T``), the
``fused_linear_grpo_loss_token`` sweep at ``B`` of ``SIZES[size]`` (published: ``T = 1024``, ``H = 4096``,
``V = 128256``, bf16, a reference model, on-policy), ``full`` speed and memory: kernels_lib, the torch
baseline (TRL's loss on fp32 logits), Liger's chunked loss and TRL's own fused-head path. The loss types
are measured in ``rounds`` rounds, their order reversed every other round, and each row is the median over
the rounds. Before and after, the matmul rate (:func:`kernels_workbench.bench.ceilings.measure_ceilings`):
the floor of ``full`` (four products of ``2BTHV``: the policy's and the reference's logits, ``dx``, ``dW``)
is taken at the rate measured in this run, written beside every row (``matmul_tflops``).

Writes ``gpu_runs/fused_linear_grpo_loss_types.csv`` under ``--out`` (the layout of ``data/measured/``).
They all run the same pass; only the per-token weights formed in torch differ. So kernels_lib's times
should agree across loss types within noise, and any peer's spread says what its loss code costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import kernels_lib  # noqa: F401  (before triton: the interpreter on a CPU)
from kernels_workbench.bench import fused_linear_grpo as grpo_bench
from kernels_workbench.bench import get_spec
from kernels_workbench.bench.ceilings import measure_ceilings
from kernels_workbench.bench.sweep import median_of_rounds, run_sweep

FILE = "gpu_runs/fused_linear_grpo_loss_types.csv"
SIZES = {
    "published": {"B": [8], "sizes": {"T": 1024, "H": 4096, "V": 128256}, "dtype": torch.bfloat16, "rounds": 2},
    "small": {"B": [2], "sizes": {"T": 3, "H": 8, "V": 31}, "dtype": torch.float32, "rounds": 2},
}
#: What each loss type runs with beyond the spec's defaults (TRL's suggested values).
OPTIONS = {"cispo": {"epsilon_high": 5.0}}
PROVIDERS = ["kernels_lib", "torch", "liger", "trl"]


def _medians(rounds: list, rate: float) -> pd.DataFrame:
    rounds = pd.concat(rounds, ignore_index=True)
    rows = pd.concat([median_of_rounds(group).assign(loss_type=loss_type)
                      for loss_type, group in rounds.groupby("loss_type", sort=False)], ignore_index=True)
    return rows.assign(matmul_tflops=rate)


def measure(size: str, device: torch.device, loss_types=tuple(grpo_bench.LOSS_TYPES), rounds_wanted: int | None = None,
            write=None) -> pd.DataFrame:
    """The rows, medians over the rounds; ``write(rows)`` after each round (a run cut short keeps its rounds)."""
    setup = SIZES[size]
    spec = get_spec(grpo_bench.KERNEL_NAMES["token"])
    rates = []
    ceilings = measure_ceilings(device)
    rates += list(ceilings.loc[ceilings.kernel_name == "matmul", "y_value_50"])
    rounds, start = [], time.perf_counter()
    for number in range(1, (rounds_wanted or setup["rounds"]) + 1):
        order = list(loss_types) if number % 2 else list(loss_types)[::-1]
        for loss_type in order:
            options = {**spec.default_options, "loss_type": loss_type, **OPTIONS.get(loss_type, {})}
            rows = run_sweep(spec.kernel_name, x_name="B", x_values=setup["B"], sizes=setup["sizes"], dtype=setup["dtype"],
                             device=device, providers=PROVIDERS, modes=("full",), options=options)
            rounds.append(rows.assign(round=number, loss_type=loss_type))
            print(f"round {number}: {loss_type} done ({time.perf_counter() - start:.0f} s)", flush=True)
        if write is not None:
            write(_medians(rounds, float(pd.Series(rates).median()) if rates else float("nan")))
    ceilings = measure_ceilings(device)
    rates += list(ceilings.loc[ceilings.kernel_name == "matmul", "y_value_50"])
    return _medians(rounds, float(pd.Series(rates).median()) if rates else float("nan"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write gpu_runs/... under")
    parser.add_argument("--size", choices=sorted(SIZES), default="published")
    parser.add_argument("--loss-types", default=",".join(grpo_bench.LOSS_TYPES))
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the loss types (default: the size's)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.size == "published" and device.type != "cuda":
        parser.error("--size published needs a CUDA GPU; --size small runs on a CPU")
    loss_types = [t for t in args.loss_types.split(",") if t]
    unknown = sorted(set(loss_types) - set(grpo_bench.LOSS_TYPES))
    if unknown:
        parser.error(f"--loss-types: unknown {', '.join(unknown)}; among {', '.join(grpo_bench.LOSS_TYPES)}")
    path = args.out / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = measure(args.size, device, loss_types, args.rounds, write=lambda rows: rows.to_csv(path, index=False))
    rows.to_csv(path, index=False)
    print(f"wrote {len(rows)} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
