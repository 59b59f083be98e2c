"""Timing for the studies: where a CUDA stream's time goes (:func:`busy_timeline`), where the host waits
for the GPU (:func:`sync_sites`), and interleaved timing of several calls whose per-sample ratios cancel
the GPU's drift (:func:`paired_times`, :func:`paired_summary`), and the run's ceilings measured beside an A/B
(:func:`run_ceilings`). The product's timing (do_bench, the modes,
peak memory) is :mod:`kernels_workbench.bench.timing`, which these build on.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kernels_workbench.bench.ceilings import measure_ceilings

from kernels_workbench.bench.timing import FLUSH_BYTES, QUANTILES, _clear_grads


def run_ceilings(device: torch.device, out=None) -> dict[str, float]:
    """Measure the copy and matmul ceilings on ``device`` (written to ``out / "ceilings.csv"`` when ``out`` is a
    folder) and return them as ``{"copy": GB/s, "matmul": TFLOP/s}``; empty on a CPU, where nothing is measured."""
    ceilings = measure_ceilings(device)
    if out is not None:
        ceilings.to_csv(out / "ceilings.csv", index=False)
    return {str(k): float(v) for k, v in zip(ceilings.kernel_name, ceilings.y_value_50)}


@dataclass(frozen=True)
class Timeline:
    """Where a CUDA stream's time goes over ``steps`` back-to-back calls (the GPU's view, per call, ms):
    ``span`` from the first kernel's start to the last one's end, ``busy`` the union of the kernels'
    intervals (kernels overlapping on several streams count once), ``idle = span - busy``; ``gaps``,
    the largest idle intervals as ``(ms, kernel before, kernel after)``; ``host_calls``, the host's view:
    the CUDA runtime calls that took longest in all, as ``(name, ms per call of fn, calls per call of
    fn)`` (a ``cudaStreamSynchronize`` or ``cudaEventSynchronize`` there is the host waiting for the
    GPU: harmless while the GPU still has the host's earlier launches to run, idle GPU once it has not)."""

    steps: int
    span: float
    busy: float
    idle: float
    gaps: list
    host_calls: list


def busy_timeline(fn: Callable[[], None], device: torch.device, *, steps: int = 10, warmup: int = 3,
                  flush_bytes: int = FLUSH_BYTES, largest: int = 5) -> Timeline | None:
    """Run ``fn`` ``steps`` times back to back under ``torch.profiler``, L2 flushed before each call as
    do_bench does (zeroing ``flush_bytes``; the flush's kernel counts as busy), and measure how much of
    the GPU's span its kernels fill: a call whose kernels sum to less than its do_bench time leaves the
    GPU idle (host syncs, launches slower than the kernels), which the gaps locate. None on a CPU (no
    kernel timeline).

    The profile holds one call more, first, whose kernels (the first ``1 / (steps + 1)`` of them) are
    left out: the host starts it level with the GPU (synchronized before the profile), so its
    prologue's launches show as idle GPU that a loop, whose host runs ahead, does not have (counted,
    they made 0.25–0.37 ms "idle per step" in ``gpu_runs/fused_linear_cross_entropy_timeline.csv``'s
    earlier rows, mostly that one call's gaps)."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType

    flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device)
    for _ in range(warmup):
        flush.zero_()
        fn()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps + 1):
            flush.zero_()
            fn()
        torch.cuda.synchronize(device)
    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    kernels = kernels[len(kernels) // (steps + 1):]  # without the start-up call
    runtime: dict[str, list[float]] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith("cuda"):
            runtime.setdefault(e.name, []).append((e.time_range.end - e.time_range.start) / 1e3)
    host_calls = sorted(((name, sum(ms) / (steps + 1), len(ms) / (steps + 1)) for name, ms in runtime.items()),
                        key=lambda call: -call[1])[:largest]
    if not kernels:
        return Timeline(steps, float("nan"), float("nan"), float("nan"), [], host_calls)
    busy, gaps, end, before = 0.0, [], kernels[0][0], kernels[0][2]
    for start, stop, name in kernels:
        if start > end:
            gaps.append(((start - end) / 1e3, before, name))
        if stop > end:
            busy += stop - max(start, end)
            end, before = stop, name
    span = (end - kernels[0][0]) / 1e3
    busy /= 1e3
    gaps.sort(reverse=True)
    return Timeline(steps, span / steps, busy / steps, (span - busy) / steps, gaps[:largest], host_calls)


def sync_sites(fn: Callable[[], None], device: torch.device) -> list[str]:
    """Where one call of ``fn`` makes the host wait for the GPU, as torch's sync debug mode sees it
    (``.item()``, a blocking copy, ``nonzero`` …; not an explicit event or stream synchronize):
    ``"file:line: message"`` per distinct site. Empty on a CPU."""
    if device.type != "cuda":
        return []
    torch.cuda.synchronize(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sorted({f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:80]}" for w in caught
                   if "synchronizing CUDA operation" in str(w.message)})  # not the mode's own notice


def paired_times(fns: list[Callable[[], None]], device: torch.device, *, samples: int, grad_to_none=None,
                 flush_bytes: int = FLUSH_BYTES) -> np.ndarray:
    """Time each of ``fns`` ``samples`` times, interleaved: sample ``i`` calls every function once, in
    order for even ``i`` and reversed for odd ``i``, each call alone (``grad_to_none`` cleared and, on
    CUDA, L2 flushed by zeroing ``flush_bytes`` as do_bench does, then CUDA events around the call; on a
    CPU the wall clock). Returns ms, shape ``(len(fns), samples)``: ``out[a, i] / out[b, i]`` compares
    two calls made next to each other, so a drift of the GPU over the run (clocks, heat) cancels in the
    ratio, where separate sweeps see it as a difference between providers. The caller warms each up."""
    cuda = device.type == "cuda"
    flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device) if cuda else None
    marks = []  # (function, start, end): CUDA events, or perf_counter seconds
    for i in range(samples):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for k in order:
            _clear_grads(grad_to_none or [])
            if cuda:
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[k]()
                end.record()
            else:
                start = time.perf_counter()
                fns[k]()
                end = time.perf_counter()
            marks.append((k, start, end))
    if cuda:
        torch.cuda.synchronize(device)
    out = np.empty((len(fns), samples))
    counts = [0] * len(fns)
    for k, start, end in marks:
        out[k, counts[k]] = start.elapsed_time(end) if cuda else (end - start) * 1e3
        counts[k] += 1
    return out


def ratio_text(row: dict) -> str:
    """A :func:`paired_summary` row's ratio as one line: ``median (p20 …, p80 …)``."""
    return f"{row['ratio_50']:.3f} (p20 {row['ratio_20']:.3f}, p80 {row['ratio_80']:.3f})"


def paired_summary(times: np.ndarray, names: list[str], against: str) -> list[dict]:
    """Per function of :func:`paired_times`'s ``times`` (named ``names``): the median and p20/p80 of its
    ms, and of its per-sample ratio to the function named ``against`` (1 for that one): the ratio's
    quantiles are over pairs of calls made next to each other."""
    ref = times[names.index(against)]
    rows = []
    for name, ms in zip(names, times):
        ratio = ms / ref
        rows.append({"kernel_provider": name, "samples": len(ms), "ratio to": against,
                     **{f"ms_{int(q * 100)}": float(np.quantile(ms, q)) for q in QUANTILES},
                     **{f"ratio_{int(q * 100)}": float(np.quantile(ratio, q)) for q in QUANTILES}})
    return rows


def paired_arms(calls: list[Callable[[], None]], names: list[str], against: str, device: torch.device, *, samples: int,
                grad_to_none=None, warmups: int = 2) -> list[dict]:
    """Each of ``calls`` run ``warmups`` times (compile, fill the allocator's cache), then timed interleaved
    (:func:`paired_times`) and summarized per call (:func:`paired_summary`, ratios to the one named ``against``)."""
    for call in calls:
        for _ in range(warmups):
            call()
    times = paired_times(calls, device, samples=samples, grad_to_none=grad_to_none)
    return paired_summary(times, names, against=against)
