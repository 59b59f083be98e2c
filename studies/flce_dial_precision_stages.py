"""One GPU run (any CUDA GPU) for fused linear cross-entropy: the dial, precision, stage times, the published sweep.

On the GPU machine, from the repository root (the peers come as wheels in ``.whl/``):

    pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl
    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=/tmp/site:$PWD python -m studies.flce_dial_precision_stages --out $OUT

Parts, each written under ``--out`` as soon as it is done, in the layout of ``data/measured/``
(copy ``--out``'s content there and commit it; a failing part is reported and the others still run;
the exit code is 1 if any failed):

a. ``gpu_runs/fused_linear_cross_entropy_dial.csv``: kernels_lib at N = 8192, H = 4096, V = 128256, bf16, for chunk sizes
   256 … 8192 × ``accurate`` True/False: speed (``forward_no_grad``, ``full``) and memory, in the
   measured layout (GPU, versions, commit in every row).
b. ``gpu_runs/fused_linear_cross_entropy_precision.csv``: loss, dx and dW relative errors against the baseline in float64 (on the
   GPU) at the same size, for kernels_lib (both modes, default and 256-row chunks), torch, Liger, CCE.
c. ``gpu_runs/fused_linear_cross_entropy_stages.csv``: time per stage of one chunk (logits, kernel, dx, dW) times the chunks, at the
   default chunk size, both modes.
d. the CLI sweep of the published workload, all providers, modes forward, forward_no_grad and full
   (appended to ``data/measured/fused_linear_cross_entropy.csv``, ceilings to
   ``data/measured/ceilings.csv``); both files are copied to ``--out`` to bring back.

Estimated duration on an H200 (do_bench's ~100 ms of repeats per point, plus memory and setup):
(a) 18 points × ~1.5 s ≈ 30 s; (b) ≈ 15 s (float64 GEMMs ≈ 26 TFLOP); (c) ≈ 5 s; (d) 3 N × 5 providers
× 3 modes = 45 points, ≈ 1.5–3 s each (CCE full at N = 16384 ≈ 0.2 s a call) ≈ 2 min, ceilings 5 s.
About 3–4 minutes in all with imports and compilation; well inside one 10-minute call.

``--size small`` runs the same code at CPU sizes (Triton's interpreter), the sweep as a dry run:
the tests use it to exercise every path that does not need CUDA.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

import kernels_lib
from kernels_workbench import data
from kernels_workbench.bench import cli
from studies.bench import flce_studies
from kernels_workbench.bench import fused_linear_cross_entropy as flce
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.sweep import available_providers

SIZES = {
    "full": {"BT": 8192, "H": 4096, "V": 128256, "chunks": [256, 512, 1024, 2048, 4096, 8192], "many": 256},
    "small": {"BT": 32, "H": 64, "V": 1031, "chunks": [4, 8, 32], "many": 4},
}
DTYPE = torch.bfloat16


def dial(size: dict, device: torch.device) -> pd.DataFrame:
    """(a) The chunk-size × accurate curve of kernels_lib."""
    sizes = {k: size[k] for k in ("BT", "H", "V")}
    return flce_studies.dial_sweep(sizes, chunk_sizes=size["chunks"], dtype=DTYPE, device=device)


def precision(size: dict, device: torch.device) -> pd.DataFrame:
    """(b) Loss, dx, dW errors against float64 for every provider that runs here."""
    peers, skipped = available_providers(flce.KERNEL_NAME, ["torch", "liger", "cce"])
    many = {"chunk_size": size["many"]}
    providers = {
        "kernels_lib": kernels_lib.fused_linear_cross_entropy,
        "kernels_lib[accurate=True]": flce.kernels_lib_variant(accurate=True).load(),
        flce.variant_name({**many, "accurate": True}): flce.kernels_lib_variant(**many, accurate=True).load(),
        flce.variant_name({**many, "accurate": False}): flce.kernels_lib_variant(**many, accurate=False).load(),
        **peers,
    }
    sizes = {"N": size["BT"], "H": size["H"], "V": size["V"]}
    table = flce_studies.gradient_errors(sizes, DTYPE, device, providers)
    table["note"] = "; ".join(f"{name} skipped ({why})" for name, why in skipped.items())
    return table.assign(**provenance(device))


def stages(size: dict, device: torch.device) -> pd.DataFrame:
    """(c) Time per stage at the default chunk size, both accumulation modes."""
    sizes = {"BT": size["BT"], "H": size["H"], "V": size["V"]}
    frames = []
    for accurate in (True, False):
        table = flce_studies.stage_times(sizes, DTYPE, device, accurate=accurate)
        frames.append(table.assign(accurate=accurate, chunk_size=table.attrs["chunk_size"], **sizes))
    return pd.concat(frames, ignore_index=True).assign(**provenance(device))


def sweep(size_name: str, out: Path) -> pd.DataFrame:
    """(d) The published workload through the CLI (a dry run at small size); copies the CSVs to ``out``."""
    preset = "published" if size_name == "full" else "small"
    argv = [flce.KERNEL_NAME, "--preset", preset, "--modes", "forward,forward_no_grad,full"]
    code = cli.main(argv if size_name == "full" else argv + ["--dry-run"])
    if code:
        raise RuntimeError(f"the CLI sweep exited with {code}")
    if size_name == "full":
        for name in (flce.KERNEL_NAME, "ceilings"):
            shutil.copy(data.measured_path(name), out)
    return pd.DataFrame()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--parts", default="dial,precision,stages,sweep", help="comma-separated parts to run")
    args = parser.parse_args(argv)
    (args.out / "gpu_runs").mkdir(parents=True, exist_ok=True)
    device = kernels_lib.default_device()
    size = SIZES[args.size]
    parts = {
        "dial": (flce_studies.RUN_FILES["dial"], lambda: dial(size, device)),
        "precision": (flce_studies.RUN_FILES["precision"], lambda: precision(size, device)),
        "stages": (flce_studies.RUN_FILES["stages"], lambda: stages(size, device)),
        "sweep": (None, lambda: sweep(args.size, args.out)),
    }
    failed = []
    for name in args.parts.split(","):
        filename, run = parts[name]
        start = time.perf_counter()
        try:
            table = run()
        except Exception:  # report and go on: one part's failure must not lose the others
            traceback.print_exc()
            failed.append(name)
            continue
        finally:
            print(f"[{name}] {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if filename:
            table.to_csv(args.out / filename, index=False)
            varying = table.loc[:, table.astype(str).nunique() > 1]  # the constant columns are in the CSV
            print(f"{filename}:\n{varying.to_string(index=False)}", flush=True)
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
