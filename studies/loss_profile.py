"""Where each loss's ``full`` call spends its time, on one CUDA GPU: every kernel of the call, beside the call's median.

For each loss (default: every registered loss but the fused linear CE, whose stages ``studies/flce_frontier.py``
profiles) at the smallest and the largest x of its published chart (``--points all`` for every x), bf16, the
bench's own inputs and options:

- the ``full`` call (forward and backward, the sweep's ``mode_callable``) timed as the sweep times it
  (``timing.time_callable``: median, p20, p80);
- the places where one call makes the host wait for the GPU (``studies.bench.timing.sync_sites``: ``.item()``, a
  blocking copy, ``nonzero`` …), ``; ``-joined in ``sync_sites`` (empty on the CPU);
- with ``--timeline``, the GPU's own view of ten back-to-back calls (``studies.bench.timing.busy_timeline``): the
  idle time per call between its kernels, the largest gaps with the kernels around them, and the CUDA runtime
  calls the host spent longest in (a ``cudaFree`` or a synchronize there is the host waiting);
- ``torch.profiler`` over three such calls: the CUDA time of **every** kernel name per call (no top-k cut, so the
  call's time less the kernels is the time the GPU sat idle), and the host's time per call (the profiler's
  CPU total of the call's top-level op is not taken: the wall time of three unsynchronized launches is).

The copy and matmul ceilings are measured first in the same run, so each point's floor is of this run's own GPU
(``kernels_workbench.profiles.loss_profiles`` reads the three files). Writes to ``--out``:
``loss_profile_times.csv``, ``loss_profile_kernels.csv`` and ``ceilings.csv`` (append each to
``data/measured/gpu_runs/`` and ``data/measured/ceilings.csv``).

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.loss_profile --out OUT [--losses a,b] [--points all]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import pandas as pd
import torch

from kernels_workbench.bench.ceilings import measure_ceilings
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.registry import get_spec, registered_losses
from kernels_workbench.bench.timing import mode_callable, time_callable
from studies.bench.timing import busy_timeline, sync_sites

SKIP = ("fused_linear_cross_entropy",)


def _workload(spec, device: torch.device) -> dict:
    """The published workload on a GPU; its CPU-sized version (``spec.small``) on the CPU, a smoke test only."""
    return spec.published if device.type == "cuda" else spec.small


def _points(workload: dict, which: str) -> list[int]:
    xs = list(workload["x_values"])
    return xs if which == "all" else sorted({xs[0], xs[-1]})


def _profile(full, device: torch.device, calls: int = 3) -> tuple[list[dict], float]:
    """Every kernel's CUDA ms per call, and the host's ms per call (launches without a sync between calls)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    full()
    sync()
    gpu = device.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if gpu else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            full()
        host_ms = (time.perf_counter() - start) * 1e3 / calls
        sync()
    # On the CPU (a smoke test) the ops' own CPU times stand in for the kernels'.
    kernels = [{"kernel": e.key[:160], "cuda_ms": (e.device_time_total if gpu else e.self_cpu_time_total) / 1e3 / calls,
                "calls": e.count / calls} for e in prof.key_averages()]
    kernels = [k for k in kernels if k["cuda_ms"] > 0]
    return kernels, host_ms


def _timeline_columns(line) -> dict:
    """A point's timeline columns: idle ms per call, its largest gaps and the host's longest runtime calls."""
    if line is None:
        return {}
    gaps = "; ".join(f"{ms:.3f} ms after {a[:40]} before {b[:40]}" for ms, a, b in line.gaps[:3])
    calls = "; ".join(f"{name} {ms:.3f} ms x{n:.1f}" for name, ms, n in line.host_calls)
    return {"timeline_idle_ms": line.idle, "timeline_busy_ms": line.busy, "largest_gaps": gaps, "host_runtime_calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--losses", default=",".join(n for n in registered_losses() if n not in SKIP))
    parser.add_argument("--points", choices=("ends", "all"), default="ends")
    parser.add_argument("--timeline", action="store_true", help="also each point's GPU timeline (idle gaps, host's runtime calls)")
    parser.add_argument("--device", default="cuda", help="cpu: the CPU-sized workloads through the interpreter, a smoke test")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    measure_ceilings(device).to_csv(args.out / "ceilings.csv", index=False)
    stamp = provenance(device)
    times, kernels = [], []
    losses = args.losses.split(",")
    for i, name in enumerate(losses, 1):
        spec = get_spec(name)
        fn = spec.providers["kernels_lib"].load()
        workload = _workload(spec, device)
        x_name = workload["x_name"]
        for x in _points(workload, args.points):
            sizes = {**workload["sizes"], x_name: x}
            at = {"loss": name, "x_name": x_name, "x_value": x}
            try:
                inputs = spec.make_inputs(sizes, workload.get("dtype", torch.bfloat16), device, dict(spec.default_options))
                full = mode_callable(lambda: fn(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full")
                timing = time_callable(full, device, grad_to_none=inputs.grad_inputs)
                listed, host_ms = _profile(full, device)
                sites = "; ".join(sync_sites(full, device))
                line = busy_timeline(full, device) if args.timeline else None
            except Exception as error:  # a loss that fails is a row that says so, not a lost run
                times.append({**at, "ms_p50": float("nan"), "note": f"{type(error).__name__}: {str(error)[:200]}", **stamp})
                print(f"[{i}/{len(losses)}] {name} {x_name}={x}: {type(error).__name__}", flush=True)
                continue
            finally:
                inputs = full = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            busy = sum(k["cuda_ms"] for k in listed)
            times.append({**at, "ms_p50": timing.p50, "ms_p20": timing.p20, "ms_p80": timing.p80, "host_ms": host_ms,
                          "kernels_ms": busy, "timer": timing.timer, "sync_sites": sites, **_timeline_columns(line),
                          "note": "", **stamp})
            kernels += [{**at, **k, **stamp} for k in listed]
            print(f"[{i}/{len(losses)}] {name} {x_name}={x}: {timing.p50:.3f} ms, kernels {busy:.3f} ms, host {host_ms:.3f} ms, "
                  f"{len(sites.split('; ')) if sites else 0} sync site(s)",
                  flush=True)
        pd.DataFrame(times).to_csv(args.out / "loss_profile_times.csv", index=False)  # written as it goes
        pd.DataFrame(kernels).to_csv(args.out / "loss_profile_kernels.csv", index=False)


if __name__ == "__main__":
    main()
