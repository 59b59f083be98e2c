"""``time_after_setup``'s ``agree``: how ranks that time a call holding collectives stay in step (every rank calls
it equally often, and none starts its timed repeats while another still warms up)."""

from __future__ import annotations

import pytest
import torch

from kernels_workbench.bench.timing import time_after_setup


def test_agree_brings_the_ranks_together_before_the_repeats_on_a_cpu():
    """On a CPU the repeat count is fixed: ``agree`` (the ranks' reduction) is called once, after the warm-up and
    before the first timed repeat."""
    order = []

    def agree(value):
        order.append(("agree", value))
        return value

    timing = time_after_setup(lambda: order.append("s"), lambda: order.append("t"), torch.device("cpu"), cpu_repeats=2,
                              agree=agree)
    assert order == ["s", "t", ("agree", 0.0), "s", "t", "s", "t"]
    assert timing.timer == "wall_clock_cpu" and timing.p20 <= timing.p50 <= timing.p80


def test_without_agree_a_cpu_timing_has_no_pause_between_warm_up_and_repeats():
    order = []
    time_after_setup(lambda: order.append("s"), lambda: order.append("t"), torch.device("cpu"), cpu_repeats=2)
    assert order == ["s", "t"] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events: the CPU path is the tests above")
def test_on_cuda_the_repeat_count_is_taken_from_the_agreed_estimate():
    """Another rank's estimate of 1 s (what ``agree`` returns) sets the count: the fewest repeats (5) after the two
    warm-ups and the estimate, where this rank's own short call alone repeats far more often."""
    device = torch.device("cuda")
    calls, given = [], []

    def agree(value):
        given.append(value)
        return max(value, 1000.0)

    time_after_setup(lambda: None, lambda: calls.append(torch.cuda._sleep(10_000)), device, agree=agree)
    assert len(given) == 2 and all(0 < v < 1000.0 for v in given)  # this rank's estimate and its setup-and-call time
    assert len(calls) == 2 + 1 + 5
    calls.clear()
    time_after_setup(lambda: None, lambda: calls.append(torch.cuda._sleep(10_000)), device)
    assert len(calls) > 2 + 1 + 5
