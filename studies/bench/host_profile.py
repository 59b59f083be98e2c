"""Where a small call's time goes: the host's share of it against the GPU's.

A loss whose GPU work is a few tenths of a millisecond (the logits-level losses at V ≤ 8192) can be set by
what the host does per call: the argument checks, autograd, each launch. ``do_bench`` times a call from an
event before it to an event after it, so a call whose host is slower than its kernels reads as the
host's time, and moves with the host (a bare Triton launch took 9–16 µs across the H200 rows of
``data/measured/gpu_runs/cross_entropy_small_vocab_breakdown.csv``, two device calls). The measures here
tell the two apart on one machine:

- :func:`host_times`: the host's milliseconds per call issued back to back (a sync at the end only: the
  throughput a loop sees, ``max(host, device)`` per call) and of one call issued after a sync;
- :func:`host_ops`: torch.profiler's host-side ops of a call, the costly ones first;
- :func:`step_rows`: the loss inside a step, behind GPU work queued first (:func:`matmul_chain`), so
  the host runs ahead as in training: what the loss adds to a step.

The GPU's own view, the kernels' busy time per call, is :func:`.timing.busy_timeline`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.timing import time_callable


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def host_times(fn: Callable[[], None], device: torch.device, calls: int) -> tuple[float, float]:
    """(host ms per call, ``calls`` issued back to back; host ms of one call issued after a sync, the median of 5)."""
    sync = _sync(device)
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


def host_microseconds(fn: Callable[[], None], device: torch.device, calls: int) -> float:
    """Host µs per call, ``calls`` issued back to back after three warm-ups."""
    for _ in range(3):
        fn()
    return host_times(fn, device, calls)[0] * 1e3


def host_ops(fn: Callable[[], None], calls: int = 20, warmup: int = 3) -> list[dict]:
    """torch.profiler's host-side ops over ``calls`` calls of ``fn`` (after ``warmup``): per op its calls,
    self and total CPU ms per call of ``fn``, the costliest self time first."""
    for _ in range(warmup):
        fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    rows = [{"op": event.key, "calls per step": event.count / calls,
             "self cpu ms per step": event.self_cpu_time_total / 1e3 / calls,
             "cpu ms per step": event.cpu_time_total / 1e3 / calls} for event in prof.key_averages()]
    return sorted(rows, key=lambda row: -row["self cpu ms per step"])


def matmul_chain(n: int, links: int, dtype: torch.dtype, device: torch.device) -> Callable[[], torch.Tensor]:
    """GPU work to queue before a call, as a training step has: ``links`` products of an ``n × n`` matrix
    in ``dtype`` (five 4096² products: about 1 ms in bf16, 13 ms in float32 on an H200)."""
    a = torch.randn(n, n, device=device, dtype=dtype)

    def chain():
        y = a
        for _ in range(links):
            y = y @ a
        return y

    return chain


def step_rows(steps: dict[str, Callable[[], None]], chain: Callable[[], torch.Tensor], device: torch.device,
              rounds: int) -> list[dict]:
    """Per round and provider, ``do_bench`` of ``chain`` alone and of ``chain`` then the provider's
    ``steps[name]`` (its forward and backward), the providers' order reversed every other round, and
    the loss's share of the step: their difference."""

    def after_chain(step):
        def run():
            chain()
            step()
        return run

    calls = {"chain": chain, **{name: after_chain(step) for name, step in steps.items()}}
    rows = []
    for round_ in range(rounds):
        names = list(calls) if round_ % 2 == 0 else list(reversed(calls))
        times = {name: time_callable(calls[name], device).p50 for name in names}
        rows += [{"round": round_ + 1, "provider": name, "chain ms": times["chain"], "step ms": times[name],
                  "loss in step ms": times[name] - times["chain"]} for name in names if name != "chain"]
    return rows


def write_tables(tables: dict[str, list[dict]], files: dict[str, str], out: Path, device: torch.device) -> None:
    """Each of ``tables`` (a part's name → its rows) as the CSV ``out / files[name]`` (laid out as
    ``data/measured/``), the run's provenance (:func:`.environment.provenance`) on every row."""
    stamp = provenance(device)
    for key, rows in tables.items():
        path = Path(out) / files[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        frame = pd.DataFrame(rows).assign(**stamp)
        frame.to_csv(path, index=False)
        print(f"{key}: {len(frame)} rows -> {path}")
