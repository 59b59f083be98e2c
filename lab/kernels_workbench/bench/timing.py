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
                     flush_bytes: int = FLUSH_BYTES, agree: Callable[[float], float] | None = None) -> Timing:
    """Time ``timed`` alone with ``setup`` run before each call and left out of the time. On CUDA: two
    warm-ups, then repeats for about ``rep_ms`` of ``timed`` (at least 5, at most ``max_repeats``, and no more
    than fit in ``budget_ms`` of setup and call together: a 40 ms forward before a 0.1 ms backward), each
    after its ``setup`` and an L2 flush (zeroing ``flush_bytes``, as do_bench does), CUDA events around
    ``timed`` alone; the median and p20/p80 (timer ``cuda_events_after_setup``). On a CPU the wall clock
    over ``cpu_repeats`` after one warm-up, as :func:`time_callable`.

    ``agree``, for a ``timed`` that holds collectives (each rank of a process group times its share, and all
    must call it equally often): a function that reduces a value over the ranks to their largest, which
    returns once every rank has given its own. The repeat count is then taken from the ranks' largest
    estimates, the same on every rank, and the ranks start the timed repeats together (on a CPU, whose
    count is fixed, it only brings them together)."""
    if device.type != "cuda":
        return _wall_clock(setup, timed, cpu_repeats, agree)
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
    if agree is not None:
        estimate, whole = agree(estimate), agree(whole)
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


def _wall_clock(setup: Callable[[], None], timed: Callable[[], None], repeats: int,
                agree: Callable[[float], float] | None = None) -> Timing:
    """The CPU's timing: one warm-up, then ``repeats`` calls of ``timed`` on the wall clock, ``setup``
    before each and outside the time (the ranks brought together by ``agree`` between the two, where
    given); quantiles, timer ``wall_clock_cpu``."""
    setup()
    timed()
    if agree is not None:
        agree(0.0)
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
