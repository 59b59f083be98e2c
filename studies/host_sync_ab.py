"""Interleaved A/B of this tree's library against another copy of it (an older commit) in one process, one GPU.

The other copy (``--old DIR``: a folder holding its ``kernels_lib`` package, e.g. ``git archive <commit>
kernels_lib | tar x -C DIR``) is imported under the name ``kernels_lib_old`` (the package imports itself
relatively), so both libraries run on the same inputs, next to each other:
``studies.bench.timing.paired_times`` calls new and old alternately (order flipped every sample), each
call alone after an L2 flush, and the per-sample ratio new / old cancels the GPU's drift over the run.
For each loss (default: the losses whose target checks moved off the host) at the smallest x of its
published chart (``--points all`` for every x), bf16, the bench's inputs and options, the ``full`` call
(forward and backward). Writes ``host_sync_paired_ab.csv`` to ``--out`` (append it to
``data/measured/gpu_runs/``).

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.host_sync_ab --old DIR --old-commit C --out OUT
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

import pandas as pd
import torch

from kernels_lib import default_device
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.registry import get_spec
from kernels_workbench.bench.timing import mode_callable
from kernels_workbench.training_step import free_memory
from studies.bench.timing import paired_arms, ratio_text

FILE = "host_sync_paired_ab.csv"
LOSSES = (
    "fused_linear_dpo_loss", "kto_loss", "fused_linear_cpo_loss", "fused_linear_orpo_loss", "fused_linear_simpo_loss",
    "fused_linear_grpo_loss_token", "fused_linear_grpo_loss_sequence", "distill_jsd_loss", "distill_cosine_loss",
)


def import_old(folder: Path, name: str = "kernels_lib_old"):
    """The package ``folder/kernels_lib`` imported as ``name`` (beside this tree's ``kernels_lib``)."""
    init = folder / "kernels_lib" / "__init__.py"
    if not init.exists():
        raise FileNotFoundError(f"--old must hold kernels_lib/__init__.py; {init} is missing")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def counterpart(fn, old_name: str = "kernels_lib_old"):
    """The old package's function of the same module and name as the new library's ``fn``."""
    module = importlib.import_module(fn.__module__.replace("kernels_lib", old_name, 1))
    return getattr(module, fn.__qualname__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--old-commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--points", choices=("smallest", "all"), default="smallest")
    parser.add_argument("--samples", type=int, default=60)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = default_device()
    import_old(args.old)
    stamp = provenance(device)
    rows = []
    losses = args.losses.split(",")
    for i, name in enumerate(losses, 1):
        spec = get_spec(name)
        new = spec.providers["kernels_lib"].load()
        old = counterpart(new)
        workload = spec.published if device.type == "cuda" else spec.small
        xs = list(workload["x_values"])
        for x in xs if args.points == "all" else xs[:1]:
            sizes = {**workload["sizes"], workload["x_name"]: x}
            inputs = spec.make_inputs(sizes, workload.get("dtype", torch.bfloat16), device, dict(spec.default_options))
            fns = [mode_callable(lambda f=f: f(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full") for f in (new, old)]
            arms = ["new", "old"]
            for row in paired_arms(fns, arms, "old", device, samples=args.samples, grad_to_none=inputs.grad_inputs):
                commit = stamp["kernels_lib_commit"] if row["kernel_provider"] == "new" else args.old_commit
                rows.append({"loss": name, "x_name": workload["x_name"], "x_value": x, **row, **stamp,
                             "arm_commit": commit})
            new_row = rows[-2]
            print(f"[{i}/{len(losses)}] {name} {workload['x_name']}={x}: new/old {ratio_text(new_row)}, "
                  f"new {new_row['ms_50']:.3f} ms", flush=True)
            inputs = fns = None
            free_memory(device)
        pd.DataFrame(rows).to_csv(args.out / FILE, index=False)  # written as it goes
    return 0


if __name__ == "__main__":
    sys.exit(main())
