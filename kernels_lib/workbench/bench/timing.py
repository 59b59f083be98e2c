"""How one provider call is timed and its memory measured.

Speed on CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed between repeats), median and
p20/p80 in milliseconds; mode ``backward`` by :func:`time_after_setup` (CUDA events around the backward
alone, after an untimed forward and an L2 flush). On CPU there are no events: a wall-clock timer over a few repeats, labelled
``wall_clock_cpu`` in the ``timer`` column, since interpreter times say nothing about a GPU.

Memory on CUDA: peak allocated during one call minus what was allocated before it (the inputs),
in MiB (the published rows' "MB"). On CPU the caching allocator keeps no statistics: NaN.

Modes, as in the published harness (inputs that take gradients have ``requires_grad=True``):
``forward`` the loss; ``forward_no_grad`` the loss under ``torch.no_grad()``; ``full`` forward and
backward; ``backward`` only ``loss.backward()``, after a fresh forward that is not timed
(:func:`backward_after_forward`, :func:`time_after_setup`). The published harness times ``backward``
by calling it again and again on one retained graph; that measures a second backward, which is not
the one a training step runs: a loss that forms its gradients in forward and hands them out in its
first backward (kernels_lib's fused CE refuses a second one; its KL, JSD and TVD form them again), or
torch's ``F.linear_cross_entropy``, takes another path there, or none. One fresh forward per timed
backward measures the backward that a step runs, for every provider alike. The host issues the backward
while the GPU still runs the forward, so the backward's launches are hidden as in a step: at sizes where
the host sets a call's time, ``forward`` and ``backward`` need not add up to ``full``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

MODES = ("forward", "forward_no_grad", "backward", "full")
QUANTILES = (0.5, 0.2, 0.8)
#: Bytes zeroed before each timed call to empty the L2 cache, as do_bench does (256 MiB).
FLUSH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Timing:
    """Median and p20/p80 of one measurement, and how it was taken."""

    p50: float
    p20: float
    p80: float
    timer: str


def _clear_grads(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        tensor.grad = None


def _loss(out) -> torch.Tensor:
    """The loss of a call's result: its ``.loss`` (the preference losses' named results) or the tensor itself."""
    return out.loss if hasattr(out, "loss") else out


def mode_callable(call: Callable[[], torch.Tensor], grad_inputs: list[torch.Tensor], mode: str) -> Callable[[], None]:
    """The function that ``mode`` times: ``call`` returns the loss of one provider on fixed inputs
    (a tensor, or a result with ``.loss``, whose loss is what backward starts from)."""
    if mode == "forward":
        return lambda: call()
    if mode == "forward_no_grad":

        def forward_no_grad():
            with torch.no_grad():
                call()

        return forward_no_grad
    if mode == "full":

        def full():
            _clear_grads(grad_inputs)
            _loss(call()).backward()

        return full
    if mode == "backward":
        raise ValueError("mode 'backward' is timed after a fresh forward each time, not by one callable: "
                         "use backward_after_forward(call, grad_inputs) with time_after_setup and peak_memory_mib(setup=)")
    raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")


def backward_after_forward(call: Callable[[], torch.Tensor], grad_inputs: list[torch.Tensor]) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(setup, timed)`` of mode ``backward``: ``setup`` clears the gradients and runs a fresh forward,
    ``timed`` runs that forward's backward (once: each ``timed`` needs a ``setup`` before it)."""
    state: dict = {}

    def setup():
        _clear_grads(grad_inputs)
        state["loss"] = _loss(call())

    def timed():
        state.pop("loss").backward()

    return setup, timed


def time_after_setup(setup: Callable[[], None], timed: Callable[[], None], device: torch.device, *, rep_ms: float = 100.0,
                     max_repeats: int = 1000, budget_ms: float = 3000.0, cpu_repeats: int = 3,
                     flush_bytes: int = FLUSH_BYTES) -> Timing:
    """Time ``timed`` alone with ``setup`` run before each call and left out of the time. On CUDA: two
    warm-ups, then repeats for about ``rep_ms`` of ``timed`` (at least 5, at most ``max_repeats``, and no more
    than fit in ``budget_ms`` of setup and call together: a 40 ms forward before a 0.1 ms backward), each
    after its ``setup`` and an L2 flush (zeroing ``flush_bytes``, as do_bench does), CUDA events around
    ``timed`` alone; the median and p20/p80 (timer ``cuda_events_after_setup``). On a CPU the wall clock
    over ``cpu_repeats`` after one warm-up, as :func:`time_callable`."""
    if device.type != "cuda":
        return _wall_clock(setup, timed, cpu_repeats)
    flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device)

    def one() -> tuple:
        setup()
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        timed()
        end.record()
        return start, end

    for _ in range(2):
        one()
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    start, end = one()
    torch.cuda.synchronize(device)
    whole = (time.perf_counter() - began) * 1e3
    estimate = max(start.elapsed_time(end), 1e-3)
    repeats = int(min(rep_ms / estimate, max_repeats, budget_ms / max(whole, 1e-3)))
    marks = [one() for _ in range(max(repeats, 5))]
    torch.cuda.synchronize(device)
    p50, p20, p80 = np.quantile([a.elapsed_time(b) for a, b in marks], QUANTILES)
    return Timing(float(p50), float(p20), float(p80), "cuda_events_after_setup")


def time_callable(fn: Callable[[], None], device: torch.device, *, grad_to_none=None, cpu_repeats: int = 3) -> Timing:
    """Time ``fn``: ``do_bench`` quantiles on CUDA, wall clock over ``cpu_repeats`` runs after one warm-up on CPU
    (three: interpreter times say nothing about a GPU, and every CPU path of the benchmarks runs in CI)."""
    if device.type == "cuda":
        import triton.testing

        p50, p20, p80 = triton.testing.do_bench(fn, quantiles=list(QUANTILES), grad_to_none=grad_to_none)
        return Timing(float(p50), float(p20), float(p80), "cuda_events_do_bench")
    return _wall_clock(lambda: None, fn, cpu_repeats)


def _wall_clock(setup: Callable[[], None], timed: Callable[[], None], repeats: int) -> Timing:
    """The CPU's timing: one warm-up, then ``repeats`` calls of ``timed`` on the wall clock, ``setup``
    before each and outside the time; quantiles, timer ``wall_clock_cpu``."""
    setup()
    timed()
    samples = []
    for _ in range(repeats):
        setup()
        start = time.perf_counter()
        timed()
        samples.append((time.perf_counter() - start) * 1e3)
    p50, p20, p80 = np.quantile(samples, QUANTILES)
    return Timing(float(p50), float(p20), float(p80), "wall_clock_cpu")


def peak_memory_mib(fn: Callable[[], None], device: torch.device, grad_inputs: list[torch.Tensor], *,
                    setup: Callable[[], None] | None = None) -> float:
    """Peak allocated during one ``fn()`` minus what was allocated before it (the inputs, with their
    gradients cleared, and what ``setup``, run first, left: mode ``backward``'s forward and the graph it
    saved), in MiB; NaN on CPU."""
    if device.type != "cuda":
        return float("nan")
    _clear_grads(grad_inputs)
    if setup is not None:
        setup()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


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
