"""Sentences the loss notebooks print beside their demonstrations, generated from the values they show."""

from __future__ import annotations

import math

import pandas as pd
import torch

from .narrative import span


def overflow_limit(dtype: torch.dtype) -> float:
    """The largest z whose e^z is finite in ``dtype``: log of its largest number."""
    return math.log(torch.finfo(dtype).max)


def overflow_sentence(table: pd.DataFrame, logits: torch.Tensor, naive: str = "naive log(sum(exp z))",
                      exact: str = "float64 logsumexp") -> str:
    """What the log-sum-exp table shows: ``table`` has one column per dtype, a row ``naive``, a row
    ``exact`` (float64) and the merged results; ``logits`` are the float64 logits it was computed on."""
    largest = logits.max().item()
    reference = table.loc[exact].iloc[0]
    limits, naive_values, merged = [], [], []
    for column in table.columns:
        dtype = getattr(torch, column)
        limits.append(f"{column}'s $e^z$ is finite up to $z \\approx {overflow_limit(dtype):.1f}$")
        value = table.loc[naive, column]
        naive_values.append(f"{'inf' if math.isinf(value) else f'{value:.3f}'} in {column}")
        values = table.drop([naive, exact])[column]
        step = torch.finfo(dtype).eps * 2 ** math.floor(math.log2(abs(largest)))
        merged.append(f"{values.iloc[0]:.3f} in {column} ({(values - reference).abs().max():.1e} from float64; "
                      f"{column} rounds logits near {largest:.0f} to steps of {step:.2g})")
    return (f"The {logits.numel()} logits lie around {logits.mean().item():.0f}, the largest at {largest:.0f}; "
            + ", ".join(limits) + f". The naive $\\log\\sum e^z$ gives " + " and ".join(naive_values)
            + "; the merged pairs, in either order, give " + " and ".join(merged)
            + f", against float64's {reference:.3f}.")


def chunk_sentence(ratios: pd.DataFrame, default_rows: int, vocab: int, item_bytes: int = 2) -> str:
    """What a chunk-size dial says beside the library's default: ``ratios`` has one column per chunk size
    (rows) and one row per measured point (a level ``B`` in its index), each time over the default chunk's
    in the same run; ``default_rows`` is the library's default at the workload, ``vocab`` its V (the logits
    buffer of a chunk is rows × V × ``item_bytes``)."""
    mib = lambda rows: rows * vocab * item_bytes / 2**20  # noqa: E731
    parts = []
    for rows in sorted(int(c) for c in ratios.columns):
        if rows == default_rows:
            continue
        column = ratios[[c for c in ratios.columns if int(c) == rows][0]].dropna()
        if not len(column):
            continue
        text = f"{rows}-row chunks take {span(column)} its time"
        if "B" in column.index.names and column.min() < 1 <= column.max():
            worst = column.groupby(level="B").max()  # every GPU and run at that B
            below = worst[worst < 1].index
            if len(below):
                text += f" (below 1× on every GPU at B = {', '.join(str(b) for b in sorted(below))})"
        parts.append(text + f" with a {mib(rows):.0f} MiB logits buffer")
    head = f"The library's default chunk at this workload is {default_rows} rows, a {mib(default_rows):.0f} MiB bf16 logits buffer"
    return head + ("; in the chunk dial, " + "; ".join(parts) if parts else "; no other chunk size was measured") + "."


def sequence_chunk_cost(rows: int, hidden: int, vocab: int, item_bytes: int = 2, input_grad: bool = True) -> pd.Series:
    """FLOPs and bytes of one chunk of the sequence losses' pipeline (:mod:`kernels_lib._sequence_logprobs`):
    ``rows`` rows of the head ``vocab × hidden``, the logits buffer in ``item_bytes`` per element. The logits
    matmul writes the buffer, the stats pass reads it (and writes a float32 lse and log-prob per row), the
    gradient pass reads it and writes ``dz`` over it, then ``dW += dzᵀ x`` and, with ``input_grad``, ``dx = dz W``."""
    matmul = 2 * rows * hidden * vocab
    logits = rows * vocab * item_bytes
    flops = matmul * (3 if input_grad else 2)
    passes = logits + 8 * rows + 2 * logits
    return pd.Series({
        "rows per chunk": rows,
        "logits matmul (GFLOP)": matmul / 1e9,
        "gradient matmuls, dW (and dx) (GFLOP)": (flops - matmul) / 1e9,
        "logits buffer written by the matmul (MB)": logits / 1e6,
        "stats pass: read, + lse and log p (MB)": (logits + 8 * rows) / 1e6,
        "gradient pass: read, dz written over it (MB)": 2 * logits / 1e6,
        "matmul FLOPs per byte of the two passes": flops / passes,
    }, dtype=object)
