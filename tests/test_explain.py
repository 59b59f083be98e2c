"""kernels_workbench.explain: the sentences beside the notebooks' demonstrations say what their tables hold."""

from __future__ import annotations

import math

import pandas as pd
import torch

from kernels_workbench import explain


def test_overflow_limit_is_the_log_of_the_largest_number():
    assert abs(explain.overflow_limit(torch.float32) - 88.72) < 0.01
    assert abs(explain.overflow_limit(torch.float16) - 11.09) < 0.01


def test_overflow_sentence_reads_the_table():
    z = torch.tensor([490.0, 500.0, 510.0], dtype=torch.float64)
    exact = torch.logsumexp(z, 0).item()
    table = pd.DataFrame({"float32": {"naive log(sum(exp z))": math.inf, "running merge": exact + 1e-5, "float64 logsumexp": exact},
                          "float16": {"naive log(sum(exp z))": math.inf, "running merge": exact - 0.05, "float64 logsumexp": exact}})
    text = explain.overflow_sentence(table, z)
    assert "inf in float32 and inf in float16" in text
    assert "1.0e-05 from float64" in text and "5.0e-02 from float64" in text
    assert f"float64's {exact:.3f}" in text and "largest at 510" in text and text.endswith(".")
