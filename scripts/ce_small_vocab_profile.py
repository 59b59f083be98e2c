"""Where the logits-level cross-entropy's time goes at small vocabularies (issue 14: slower than torch at V = 4096).

At V = 4096 the published charts' logits are 64 MB (Megatron's, bf16, 8192 rows) and 256 MB (the
cross_entropy chart's, fp32, 16384 rows): the GPU work is a few tenths of a millisecond, so a call's
host-side cost can set its time. Per chart, provider and mode this measures: ``do_bench``'s median
(what the charts report), the host time per call when calls are issued back to back (a sync only at
the end: the throughput a training loop sees, ``max(host, device)`` per call) and the host time of one
call issued after a sync (its latency). Providers: kernels_lib's default, kernels_lib with
``host_checks=False`` (no host sync), and the torch baseline. Then torch.profiler's host-side ops of
kernels_lib's ``full`` (self CPU time per call), the costly ones first.

On the GPU machine: ``KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python3 scripts/ce_small_vocab_profile.py --out $OUT``
(about a minute); writes ``gpu_runs/cross_entropy_small_vocab_profile.csv`` and
``gpu_runs/cross_entropy_small_vocab_ops.csv`` under ``--out``. ``--size small`` runs it on a CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

import kernels_lib  # noqa: F401  (before triton: the interpreter on a CPU)
from kernels_lib import reference
from kernels_lib.workbench.bench.environment import provenance
from kernels_lib.workbench.bench.timing import mode_callable, time_callable

#: chart -> (rows, logits dtype, reduction), the published workloads at V = 4096 and 8192
CHARTS = {"megatron_cross_entropy": (8192, torch.bfloat16, "sum"), "cross_entropy": (16384, torch.float32, "mean")}
SIZES = {"full": {"vocabs": [4096, 8192], "rows_scale": 1, "calls": 200},
         "small": {"vocabs": [64], "rows_scale": 1 / 256, "calls": 2}}
FILES = {"times": "gpu_runs/cross_entropy_small_vocab_profile.csv", "ops": "gpu_runs/cross_entropy_small_vocab_ops.csv"}


def providers():
    return {
        "kernels_lib": lambda z, t, r: kernels_lib.cross_entropy(z, t, reduction=r),
        "kernels_lib[host_checks=False]": lambda z, t, r: kernels_lib.cross_entropy(z, t, reduction=r, host_checks=False),
        "torch": lambda z, t, r: reference.cross_entropy(z, t, reduction=r),
    }


def host_times(fn, device, calls: int) -> tuple[float, float]:
    """(host ms per call issued back to back, host ms of one call issued after a sync)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    throughput = (time.perf_counter() - start) * 1e3 / calls
    latencies = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        fn()
        latencies.append((time.perf_counter() - start) * 1e3)
    return throughput, sorted(latencies)[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, ops = [], []
    for chart, (n, dtype, reduction) in CHARTS.items():
        n = max(8, int(n * size["rows_scale"]))
        for vocab in size["vocabs"]:
            generator = torch.Generator(device=device).manual_seed(0)
            logits = torch.randn(n, vocab, generator=generator, device=device).to(dtype).requires_grad_()
            target = torch.randint(0, vocab, (n,), generator=generator, device=device)
            for name, provider in providers().items():
                for mode in ("forward", "full"):
                    fn = mode_callable(lambda: provider(logits, target, reduction), [logits], mode)
                    timing = time_callable(fn, device, grad_to_none=[logits])
                    throughput, latency = host_times(fn, device, size["calls"])
                    rows.append({"chart": chart, "V": vocab, "N": n, "provider": name, "mode": mode,
                                 "do_bench ms": timing.p50, "host ms per call, back to back": throughput,
                                 "host ms of one call after a sync": latency})
                    print(rows[-1], flush=True)
            if vocab == size["vocabs"][0]:
                step = mode_callable(lambda: kernels_lib.cross_entropy(logits, target, reduction=reduction), [logits], "full")
                for _ in range(3):
                    step()
                calls = 20
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(calls):
                        step()
                for event in prof.key_averages():
                    ops.append({"chart": chart, "V": vocab, "op": event.key, "calls per step": event.count / calls,
                                "self cpu ms per step": event.self_cpu_time_total / 1e3 / calls,
                                "cpu ms per step": event.cpu_time_total / 1e3 / calls})
    stamp = provenance(device)
    for key, frame in (("times", pd.DataFrame(rows)), ("ops", pd.DataFrame(ops))):
        if key == "ops":
            frame = frame.sort_values(["chart", "self cpu ms per step"], ascending=[True, False]).groupby("chart").head(25)
        path = args.out / FILES[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        frame.assign(**stamp).to_csv(path, index=False)
        print(f"{key}: {len(frame)} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
