"""Sentences the loss notebooks print beside their demonstrations, generated from the values they show."""

from __future__ import annotations

import math

import pandas as pd
import torch


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
