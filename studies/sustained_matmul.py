"""Does the GPU's matmul rate hold over a long call? cuBLAS products back to back for bursts of growing length,
each product timed by its own CUDA events, after an idle pause.

Why: the floor of the fused linear losses is their matmul FLOPs at the run's matmul ceiling (a bf16 8192³
product, ``kernels_workbench.bench.ceilings``). In the loss profiles (``gpu_runs/loss_profile_kernels.csv``,
H100) the same cuBLAS kernels ran slower per call in the long calls than in the short ones: DPO's matmuls at
0.95× their floor at B = 2 (a 13 ms call) and 1.07× at B = 16 (107 ms); GRPO token's logits product at 2.85 ms
a call at B = 2 and 3.10 ms at B = 16, same shape. If the rate falls with the time the GPU has run flat out
(clocks under the power cap or the heat), the floor of a long call is the sustained rate's, not the ceiling's.

For each shape (``--shapes``: the ceiling's 8192³ and the sequence losses' logits product, a 2048-row chunk of
``H = 4096`` against ``V = 128256``) and each burst length (``--bursts`` ms), after ``--pause`` seconds idle:
products issued back to back until the burst is filled, an event after each, so each product's time and its
start (ms since the burst began) are known. With ``torch.cuda.clock_rate`` (needs ``pynvml``) the SM clock is
read before and after each burst. Writes ``sustained_matmul.csv`` (a row per product) to ``--out``; on a CPU it
runs a tiny shape as a dry run.

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.sustained_matmul --out OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from kernels_lib import default_device
from kernels_workbench.bench.environment import provenance
from kernels_workbench import profiles

FILE = "sustained_matmul.csv"
SHAPES = {"8192^3": (8192, 8192, 8192), "logits chunk 2048x4096x128256": (2048, 4096, 128256)}


def clock_mhz(device: torch.device) -> float:
    """The SM clock now (MHz), NaN where it cannot be read (a CPU, or no ``pynvml``)."""
    if device.type != "cuda":
        return float("nan")
    try:
        return float(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - pynvml missing or the query refused: the clock is simply unknown
        return float("nan")


def burst(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, count: int, device: torch.device) -> np.ndarray:
    """``count`` products ``out = a @ b`` back to back: ``(start, ms)`` per product, ms from the first's start."""
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
        events[0].record()
        for i in range(count):
            torch.matmul(a, b, out=out)
            events[i + 1].record()
        torch.cuda.synchronize(device)
        ends = np.array([events[0].elapsed_time(e) for e in events[1:]])
    else:
        start, marks = time.perf_counter(), []
        for _ in range(count):
            torch.matmul(a, b, out=out)
            marks.append((time.perf_counter() - start) * 1e3)
        ends = np.array(marks)
    starts = np.concatenate([[0.0], ends[:-1]])
    return np.stack([starts, ends - starts], axis=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--bursts", default="5,20,100,300,1000", help="burst lengths, ms")
    parser.add_argument("--pause", type=float, default=3.0, help="idle seconds before each burst")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = default_device()
    cuda = device.type == "cuda"
    stamp = provenance(device)
    rows = []
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise ValueError(f"--shapes: unknown shape {name!r}; known: {', '.join(SHAPES)}")
        m, k, n = SHAPES[name] if cuda else (64, 64, 64)
        dtype = torch.bfloat16 if cuda else torch.float32
        a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        flops = 2.0 * m * k * n
        one_ms = float(np.median(burst(a, b, out, 5, device)[:, 1]))  # warm-up, and the size of one product
        for length in (float(v) for v in args.bursts.split(",")):
            time.sleep(args.pause if cuda else 0.0)
            before = clock_mhz(device)
            count = max(2, int(round(length / max(one_ms, 1e-3))))
            times = burst(a, b, out, count, device)
            after = clock_mhz(device)
            for i, (start, ms) in enumerate(times):
                rows.append({"shape": name, "M": m, "K": k, "N": n, "burst_ms": length, "product": i,
                             "start_ms": start, "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12,
                             "sm_clock_mhz_before": before, "sm_clock_mhz_after": after, **stamp})
            print(f"{name} burst {length:.0f} ms ({count} products); SM clock {before:.0f} -> {after:.0f} MHz", flush=True)
        pd.DataFrame(rows).to_csv(args.out / FILE, index=False)
        a = b = out = None
    # each burst's first and last tenth, read as the workbench reads the committed file (no ceiling here)
    print(profiles.sustained_lines(profiles.sustained_rates(pd.DataFrame(rows), ceilings=pd.DataFrame())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
