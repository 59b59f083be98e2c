"""timing.paired_times: every function timed once per sample, in alternating order, each call alone."""

from __future__ import annotations

import time

import numpy as np
import torch

from studies.bench.timing import paired_summary, paired_times


def test_paired_times_interleave_and_alternate():
    calls = []
    fns = [lambda: calls.append("a"), lambda: (calls.append("b"), time.sleep(0.004))]
    x = torch.zeros(2, requires_grad=True)
    x.grad = torch.ones(2)
    out = paired_times(fns, torch.device("cpu"), samples=4, grad_to_none=[x])
    assert out.shape == (2, 4)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"], "in order, then reversed, sample by sample"
    assert x.grad is None, "gradients cleared before each call"
    assert (out[1] > 3.5).all() and (out[0] < out[1]).all(), "each call timed alone, in ms"


def test_paired_summary_quantiles_of_times_and_of_per_sample_ratios():
    # A drift that doubles every time: B is always 1.1x A in its pair, while B's own times spread widely.
    a = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    times = np.stack([a, 1.1 * a])
    rows = {r["kernel_provider"]: r for r in paired_summary(times, ["a", "b"], against="a")}
    assert rows["a"]["ratio_50"] == 1.0 and rows["a"]["samples"] == 5
    assert abs(rows["b"]["ratio_20"] - 1.1) < 1e-12 and abs(rows["b"]["ratio_80"] - 1.1) < 1e-12
    assert rows["b"]["ms_50"] == 4.4 and rows["b"]["ms_80"] > 2 * rows["b"]["ms_20"], "the times themselves drift"
