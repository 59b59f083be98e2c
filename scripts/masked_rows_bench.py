"""The LM-head loss of an SFT batch with 0 / 25 / 50 / 75 % of its positions masked, every peer in one run
(the workload and providers: :mod:`kernels_workbench.bench.masked_rows`).

On the GPU machine (no package registry: Liger-Kernel, cut-cross-entropy, TRL and what
`import trl.kernels` needs travel as wheels in `.whl/`, as for `scripts/training_step_bench.py`):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PWD/lab && KERNELS_LIB_COMMIT=<sha> python3 scripts/masked_rows_bench.py --out $OUT

It writes `$OUT/fused_linear_cross_entropy_masked_rows.csv` (the measured layout: GPU, versions and
commit on every row); append it to `data/measured/gpu_runs/fused_linear_cross_entropy_masked_rows.csv`
(`tail -n +2` when the file exists). About 2 minutes on an H100 (7 providers × 4 shares, each point
timed for about 0.8 s after its warm-ups). On a CPU, `--device cpu --tiny` runs the same path at a tiny
size through Triton's interpreter (no memory figures), to check it end to end:

    python scripts/masked_rows_bench.py --out /tmp/masked --device cpu --tiny   # about 20 s
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))  # training_step_bench's stub for `datasets`


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder; rows are appended to OUT/<kernel_name>.csv")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny size (the CPU check)")
    parser.add_argument("--providers", default=None, help="comma-separated; default every provider")
    parser.add_argument("--percents", default=None, help="masked shares in %%; default 0,25,50,75")
    parser.add_argument("--rep-ms", type=float, default=800.0, help="timed milliseconds per point (CUDA); default 800")
    args = parser.parse_args(argv)

    from training_step_bench import stub_datasets_if_missing

    datasets_note = stub_datasets_if_missing()
    import torch

    from kernels_workbench import data
    from kernels_workbench.bench import masked_rows as mr

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device (use --device cpu --tiny for the CPU check)")
    providers = [p.strip() for p in args.providers.split(",")] if args.providers else list(mr.PROVIDERS)
    percents = [int(p) for p in args.percents.split(",")] if args.percents else list(mr.MASKED_PERCENTS)
    sizes = mr.TINY if args.tiny else mr.WORKLOAD
    print(f"masked rows: {sizes} bf16, providers {', '.join(providers)}" + (f" · {datasets_note}" if datasets_note else ""),
          flush=True)
    rows = mr.measure(providers, sizes, args.device, percents=percents, rep_ms=args.rep_ms,
                      log=lambda line: print(line, flush=True))
    if datasets_note:
        rows["note"] = [f"{n}; {datasets_note}" if n else datasets_note for n in rows.note.fillna("")]
    path = data.append_measured(rows, mr.KERNEL_NAME, directory=args.out)
    first = rows.iloc[0]
    print(f"\n{first.gpu_name} · torch {first.torch_version} · triton {first.triton_version} · "
          f"liger {first.liger_version or '-'} · cce {first.cce_version or '-'} · commit {first.kernels_lib_commit}")
    speed = rows[rows.metric_name == "speed"]
    print("\nmedian ms (full: forward + backward), by masked %:")
    print(speed.pivot_table(index="x_value", columns="kernel_provider", values="y_value_50").round(3).to_string())
    print(f"\nwrote {path} ({len(rows)} rows) in {time.perf_counter() - STARTED:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
