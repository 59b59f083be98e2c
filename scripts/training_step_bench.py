"""What the LM head costs in a whole training step, measured: one model shape, every provider, gradient
checkpointing off then on, tokens per step 4 × 2048 upward (doubling the batch) until each provider's
first OOM (the logic is :mod:`kernels_workbench.training_step`).

On the GPU machine (no package registry: TRL, Liger-Kernel and what `import trl.trainer.utils` needs
travel as wheels in `.whl/`), one call per model shape, each inside the 10-minute limit of a call:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && KERNELS_LIB_COMMIT=<sha> python3 scripts/training_step_bench.py --out $OUT --model llama
    (the same with --model qwen)

Then append `$OUT/training_step.csv` to `data/measured/training_step.csv` (same columns; header once:
`tail -n +2` when the file exists). If the budget cut a sweep short (rows noted `skipped: budget`),
run the rest in another call, e.g. `--checkpointing on`.

The wheels (`.whl/`, git-ignored), prepared on a machine with a registry:

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl trl==1.16.0 liger-kernel==0.8.5 datasets==4.8.4 dill==0.4.1 multiprocess==0.70.19 xxhash==3.6.0

(`trl/trainer/utils.py` imports `datasets` at module level, for a type it does not use in the fused head;
`datasets` needs pyarrow, which the machine has. Should `import datasets` still fail there, this script
puts a stub `datasets` module in its place, says so, and the rows' `trl_version` reads `1.16.0 (datasets stubbed)`.)

Rows are appended to `$OUT/training_step.csv` as they are measured, so a call cut short keeps what it
measured. With `--budget-s` (default 520 s, counted from the start of this process) a point whose
estimated duration would end past the budget is recorded as `skipped: budget` and not run. Works on any
CUDA GPU; `--device cpu --tiny` runs the same path at a tiny shape on a CPU (the kernels through
Triton's interpreter; no memory figures, batch 1, 2, 4 × 32 tokens), to check it end to end:

    python scripts/training_step_bench.py --out /tmp/ts --model llama --device cpu --tiny   # about 40 s

With half of every sequence's labels masked beside the unmasked step, in one run (notebook 05's appendix reads
`data/measured/gpu_runs/training_step_masked.csv`; append `$OUT/training_step.csv` there):

    python3 scripts/training_step_bench.py --out $OUT --model llama --masked-shares 0,0.5 --checkpointing off --batches 4,8,16,32

Estimated on an H200 from the step times and memory measured earlier (SPEC §7): about 8.5 minutes per
model with the default budget; the ckpt-on points of 256 × 2048 tokens and up may be `skipped: budget`
(Llama). To measure those too, a second call: `--checkpointing on --batches 256,512 --providers
kernels_lib,liger,trl`.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

STARTED = time.perf_counter()


def stub_datasets_if_missing() -> str:
    """Import `datasets`; if that fails, register a stub that offers what `trl.trainer.utils` imports
    at module level (`IterableDataset`, unused by the fused head). Returns a note, "" if not stubbed."""
    try:
        import datasets  # noqa: F401
        return ""
    except Exception as error:  # noqa: BLE001 - any failure: TRL's fused head does not need it
        stub = types.ModuleType("datasets")
        stub.IterableDataset = type("IterableDataset", (), {})
        stub.Dataset = type("Dataset", (), {})
        stub.__version__ = "0.0.0+stub"
        sys.modules["datasets"] = stub
        return f"datasets stubbed ({type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder; rows are appended to OUT/training_step.csv")
    parser.add_argument("--model", choices=("llama", "qwen"), required=True)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape of the model (CPU check)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget-s", type=float, default=520.0, help="seconds from process start; default 520")
    parser.add_argument("--checkpointing", choices=("both", "off", "on"), default="both")
    parser.add_argument("--providers", default="kernels_lib,huggingface,liger,trl")
    parser.add_argument("--batches", default=None, help="default 4,8,...,512 (with --tiny: 1,2,4)")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (with --tiny: 32)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-point-s", type=float, default=20.0,
                        help="fewer timed steps (at least 3) and one warm-up when steps are long; default 20")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--masked-shares", default="0",
                        help="comma-separated shares of every sequence's first positions labelled -100 (a prompt), each "
                        "measured at every point of the run; default 0 (e.g. 0,0.5)")
    parser.add_argument("--run-id", default=None,
                        help="join an earlier call's run (its run_id) instead of starting a new one: the targets "
                        "are judged on the newest run of each model")
    args = parser.parse_args(argv)

    datasets_note = stub_datasets_if_missing()
    import pandas as pd
    import torch

    from kernels_workbench import training_step as ts

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device (use --device cpu --tiny for the CPU check)")
    model = ts.MODEL_ALIASES[args.model][1 if args.tiny else 0]
    providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    batches = [int(b) for b in (args.batches or ("1,2,4" if args.tiny else ",".join(map(str, ts.BATCHES)))).split(",")]
    seq = args.seq or (32 if args.tiny else ts.SEQ)
    checkpointing = {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]
    shares = [float(s) for s in args.masked_shares.split(",") if s.strip()]
    if not shares or any(not 0.0 <= s < 1.0 for s in shares):
        parser.error(f"--masked-shares takes shares in [0, 1), e.g. 0,0.5; got {args.masked_shares!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    csv = args.out / "training_step.csv"
    env = ts.training_provenance(args.device)
    print(f"{model} on {env['gpu_name']} · torch {env['torch_version']} · triton {env['triton_version']} · "
          f"transformers {env['transformers_version']} · trl {env['trl_version'] or '-'} · liger {env['liger_version'] or '-'} · "
          f"commit {env['kernels_lib_commit']}" + (f" · {datasets_note}" if datasets_note else ""), flush=True)

    def append(row: dict) -> None:
        if datasets_note and row["trl_version"]:
            row["trl_version"] = f"{row['trl_version']} (datasets stubbed)"
        pd.DataFrame([row], columns=ts.COLUMNS).to_csv(csv, mode="a", header=not csv.exists(), index=False)

    budget = args.budget_s - (time.perf_counter() - STARTED)
    rows = ts.run_sweep([model], providers, checkpointing, batches, seq, args.device, warmup=args.warmup,
                        steps=args.steps, seed=args.seed, budget_s=budget, max_point_s=args.max_point_s, on_row=append,
                        run_id=args.run_id, masked_shares=shares,
                        log=lambda line: print(line, flush=True))
    rows = pd.read_csv(csv)
    rows = rows[rows.run_id == rows.run_id.iloc[-1]]
    print(f"\nwrote {csv} ({len(rows)} rows of this run) in {time.perf_counter() - STARTED:.0f} s", flush=True)
    summarize(rows, ts)
    skipped = rows[ts.notes(rows).str.startswith("skipped: budget")]
    if len(skipped):
        print(f"\nskipped by the budget ({len(skipped)} points): " + ", ".join(
            f"{r.provider} ckpt={'on' if r.checkpointing else 'off'} B={r.batch}" for r in skipped.itertuples()))
    return 0


def summarize(rows, ts) -> None:
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.precision", 3):
        ok = ts.measured(rows)
        for value, label in (("step_ms_50", "median step time (ms)"), ("peak_gib", "peak memory (GiB)")):
            if len(ok) and ok[value].notna().any():
                print(f"\n{label}, by checkpointing and tokens per step:")
                print(ok.pivot_table(index=["checkpointing", "tokens"], columns="provider", values=value).to_string())
        print("\nlargest tokens per step:")
        print(ts.largest_fit(rows).to_string(index=False))
        cpu = (rows.device == "cpu").any()
        print("\ntargets (kernels_lib)" + (": on a CPU the kernels run in Triton's interpreter, so these times rank nothing and "
                                        "no memory is measured; the path is what this checks" if cpu else "") + ":")
        print(ts.training_verdicts(rows).drop(columns=["detail"]).to_string(index=False))
        failed = rows[ts.notes(rows).str.startswith(("error", "skipped: import"))]
        for r in failed.itertuples():
            print(f"note: {r.provider} ckpt={'on' if r.checkpointing else 'off'} B={r.batch}: {r.note}")


if __name__ == "__main__":
    raise SystemExit(main())
