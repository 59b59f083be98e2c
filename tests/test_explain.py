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


def test_chunk_sentence_reads_the_dial():
    index = pd.MultiIndex.from_tuples([("H200", 2), ("H200", 8)], names=["GPU", "B"])
    ratios = pd.DataFrame({512: [1.08, 1.12], 1024: [1.0, 1.0], 2048: [1.11, 0.95]}, index=index)
    text = explain.chunk_sentence(ratios, 1024, 128256)
    assert text.startswith("The library's default chunk at this workload is 1024 rows, a 250 MiB bf16 logits buffer")
    assert "512-row chunks take 1.08–1.12× its time with a 125 MiB logits buffer" in text
    assert "2048-row chunks take 0.95–1.11× its time (below 1× on every GPU at B = 8) with a 501 MiB logits buffer" in text


def test_sequence_chunk_cost_from_the_shapes():
    cost = explain.sequence_chunk_cost(rows=2, hidden=3, vocab=5, item_bytes=2)
    assert cost["logits matmul (GFLOP)"] == 60 / 1e9 and cost["gradient matmuls, dW (and dx) (GFLOP)"] == 120 / 1e9
    assert cost["logits buffer written by the matmul (MB)"] == 20 / 1e6
    assert cost["stats pass: read, + lse and log p (MB)"] == 36 / 1e6 and cost["gradient pass: read, dz written over it (MB)"] == 40 / 1e6
    assert cost["matmul FLOPs per byte of the two passes"] == 180 / 76
