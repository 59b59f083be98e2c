"""The sequence losses (DPO, GRPO, KTO, CPO, ...) of one checkout at their published workloads, kernels_lib
alone, at its default chunk and at given chunk sizes: ``full`` and ``forward`` times, ``full``'s memory.

An A/B of two commits runs this once from a checkout of each, in one device call, alternating:

    for r in 1 2; do
      PYTHONPATH=$OLD python -m studies.sequence_chunk_ab --out $OUT --route "old route" --chunks default
      PYTHONPATH=$NEW python -m studies.sequence_chunk_ab --out $OUT --route "new route" --chunks default,4096
    done

Rows are appended to ``gpu_runs/sequence_epilogue_route_ab.csv`` under ``--out`` with the commit of the
checkout imported (``KERNELS_LIB_COMMIT`` or git), the GPU and the versions. ``--size small`` runs the
CPU-sized workloads (Triton's interpreter).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

import kernels_lib  # noqa: F401  (before triton: the interpreter on a CPU)
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.registry import get_spec
from kernels_workbench.bench.timing import mode_callable, peak_memory_mib, time_callable

FILE = "gpu_runs/sequence_epilogue_route_ab.csv"
LOSSES = "fused_linear_dpo_loss,fused_linear_grpo_loss_token,kto_loss,fused_linear_cpo_loss"


def measure(names: list[str], chunks: list[int | None], size: str, device: torch.device, rounds: int = 1) -> list[dict]:
    """One row per round, loss, x (B, or BT for the two-head losses) and chunk (None: the default); the chunks'
    order reversed every other round, so that the GPU's drift over a run falls on every chunk alike."""
    rows = []
    for round_ in range(rounds):
        rows += _one_round(names, chunks if round_ % 2 == 0 else chunks[::-1], size, device, round_ + 1)
    return rows


def _one_round(names, chunks, size, device, round_) -> list[dict]:
    rows = []
    for name in names:
        spec = get_spec(name)
        workload = spec.preset(size)
        loss = spec.providers["kernels_lib"].load()
        for batch in workload["x_values"]:
            sizes = dict(workload["sizes"], **{workload["x_name"]: batch})
            inputs = spec.make_inputs(sizes, workload["dtype"], device, dict(spec.default_options), 0)
            for chunk in chunks:
                kwargs = dict(inputs.kwargs) | ({} if chunk is None else {"chunk_size": chunk})

                def call():
                    return loss(*inputs.args, **kwargs)

                row = {"loss": name, "round": round_, "x_name": workload["x_name"], "B": batch, "chunk": chunk or "default"}
                for mode in ("full", "forward"):
                    timing = time_callable(mode_callable(call, inputs.grad_inputs, mode), device,
                                           grad_to_none=inputs.grad_inputs)
                    row[f"{mode}_ms"] = timing.p50
                    if mode == "full":
                        row["full_ms_p20"], row["full_ms_p80"] = timing.p20, timing.p80
                row["full_MiB"] = peak_memory_mib(mode_callable(call, inputs.grad_inputs, "full"), device,
                                                  inputs.grad_inputs)
                rows.append(row)
                print(row, flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--route", required=True, help="what this checkout's route is called in the rows")
    parser.add_argument("--losses", default=LOSSES)
    parser.add_argument("--chunks", default="default", help="comma-separated: default or a row count")
    parser.add_argument("--size", choices=["published", "small"], default="published")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, the chunks' order reversed every other one")
    parser.add_argument("--file", default=FILE, help="where under --out the rows go")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chunks = [None if c == "default" else int(c) for c in args.chunks.split(",")]
    rows = pd.DataFrame(measure(args.losses.split(","), chunks, args.size, device, args.rounds)).assign(route=args.route,
                                                                                        **provenance(device))
    path = args.out / args.file
    path.parent.mkdir(parents=True, exist_ok=True)
    rows.to_csv(path, mode="a", header=not path.exists(), index=False)
    print(f"{len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
