"""The floor: the least time a call of a loss can take on one GPU, from what one run measured there.

Defined here once, and everything that prints a floor (the notebooks, the overview, the dashboard, the
index) calls :func:`floor`. Per x of one run (one ``kernels_lib_commit`` on one GPU) it is the longer of

(a) the loss's matmul FLOPs (:meth:`~.bench.spec.LossSpec.flops`) at the GPU's matmul rate: the time of
    the loss's **own** matmuls where the run timed them (:attr:`~.bench.spec.LossSpec.own_matmuls`: fused
    linear cross-entropy's ``three_matmuls``), else the FLOPs at the square-product matmul ceiling that
    run measured (``ceilings.csv``, ``matmul``);
(b) its minimal bytes (:meth:`~.bench.spec.LossSpec.min_bytes`) at the copy bandwidth that run measured
    (``ceilings.csv``, ``copy``).

A run that wrote the matmul rate it measured beside its own rows (``matmul_tflops``: ``scripts/grpo_loss_types.py``)
has that rate as its matmul ceiling. A ceiling the run did not measure is never taken from another run: the floor
then reads "not measured" (NaN). A loss without matmuls (the divergences on logits) has (b) alone.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import torch

from . import data
from .bench.analysis import ceiling_run, medians
from .bench.registry import get_spec

#: The columns of :func:`floor`.
COLUMNS = ["ms", "bound", "matmul ms", "bytes ms"]


def run_rates(run: pd.DataFrame, ceilings: pd.DataFrame) -> dict[str, float]:
    """The ``copy`` (GB/s) and ``matmul`` (TFLOP/s) ceilings measured in the run of ``run``'s own rows (its
    commit on its GPU), never another run's; the matmul rate the run wrote beside its rows (``matmul_tflops``)
    where it did; a ceiling that run did not measure is absent."""
    if not len(run):
        return {}
    rates = own_rates(ceilings, str(run.gpu_name.iloc[0]), data.run_commit(run)) if ceilings is not None else {}
    if "matmul_tflops" in run and run.matmul_tflops.notna().any():
        rates["matmul"] = float(run.matmul_tflops.dropna().iloc[0])
    return rates


def own_rates(ceilings: pd.DataFrame, gpu_name: str, commit: str | None) -> dict[str, float]:
    """The ``copy`` and ``matmul`` ceilings measured on ``gpu_name`` in the run of ``commit`` itself; a ceiling
    that run did not measure is absent."""
    rates = {}
    for name in ("copy", "matmul"):
        try:
            rate, measured_in = ceiling_run(ceilings, name, gpu_name, commit)
        except ValueError:
            continue
        if measured_in == str(commit):
            rates[name] = rate
    return rates


#: Sizes that Liger's model-config benchmarks name in lower case, by our specs' names.
SIZE_ALIASES = {"vocab_size": "V"}


def _sizes(spec, config: dict, x_name: str, x) -> dict:
    """The sizes of one point: the spec's preset of the axis, under the run's configuration, with ``x_name`` at ``x``."""
    preset = spec.published_preset(x_name) or {}
    named = {SIZE_ALIASES.get(k, k): v for k, v in config.items()}
    given = {k: v for k, v in named.items() if k[:1].isupper() and isinstance(v, int) and not isinstance(v, bool)}
    return {**preset.get("sizes", {}), **given, x_name: int(x)}


def matmul_ms(kernel_name: str, sizes: dict, mode: str, tflops: float, options: dict | None = None) -> float:
    """The loss's matmul FLOPs (:meth:`~.bench.spec.LossSpec.flops`) of one call at ``sizes`` at ``tflops``, in ms:
    the matmul candidate of :func:`floor_at` (0 for a loss without matmuls; NaN without a rate)."""
    flops = get_spec(kernel_name).flops(sizes, mode, options)
    if flops is None:
        return 0.0
    return flops / (tflops * 1e12) * 1e3 if tflops is not None and math.isfinite(tflops) and tflops > 0 else math.nan


def bytes_ms(gigabytes: float, rates: dict) -> float:
    """``gigabytes`` moved at the copy bandwidth of ``rates`` (:func:`run_rates`), in ms: the bytes candidate of
    :func:`floor_at`, and the time any other traffic (a chunk's ``dW`` read and write) takes at that rate; NaN
    where the run measured no copy bandwidth."""
    copy = rates.get("copy", math.nan)
    return gigabytes / copy * 1e3 if copy is not None and math.isfinite(copy) and copy > 0 else math.nan


def floor_at(kernel_name: str, sizes: dict, dtype: torch.dtype, mode: str, rates: dict, own_ms: float = math.nan,
             options: dict | None = None) -> tuple[float, str | None, float, float]:
    """The floor of one call at ``sizes``: ``(ms, bound, matmul ms, bytes ms)`` from ``rates`` (:func:`run_rates`
    of one run) and ``own_ms``, the loss's own matmuls' time where that run timed them (module docstring).
    NaN (bound None) where a needed ceiling is absent from ``rates``."""
    spec = get_spec(kernel_name)
    matmul = matmul_ms(kernel_name, sizes, mode, rates.get("matmul", math.nan), options)
    if matmul and pd.notna(own_ms):  # the loss's own matmuls, timed in the run
        matmul = float(own_ms)
    moved = bytes_ms(spec.min_bytes(sizes, dtype, mode) / 1e9, rates)
    if math.isnan(matmul) or math.isnan(moved):
        return math.nan, None, matmul, moved
    return max(matmul, moved), ("matmul" if matmul >= moved else "bytes"), matmul, moved


def floor(run: pd.DataFrame, ceilings: pd.DataFrame, kernel_name: str | None = None, mode: str = "full",
          xs=None) -> pd.DataFrame:
    """Per x (index) of one run, the floor of ``mode`` (module docstring): ``ms``, ``bound`` (``"matmul"`` or
    ``"bytes"``, whichever is longer; None where not measured), and both candidates, ``matmul ms`` (the own
    matmuls' measured time, else the FLOPs at the run's matmul ceiling) and ``bytes ms``. ``xs``: the x to give
    (default the run's; a published x the run did not time takes the run's configuration at that x). NaN
    where the run measured a needed ceiling not, or the loss has no bench spec. Rows of two runs are refused."""
    out = pd.DataFrame(columns=COLUMNS, dtype=object)
    if not len(run):
        return out
    data.run_label(run)  # refuses rows of two runs
    kernel_name = kernel_name or str(run.kernel_name.iloc[0])
    times = medians(run, "speed", mode)
    xs = sorted(set(times.index) if xs is None else set(xs))
    out = pd.DataFrame(math.nan, index=pd.Index(xs, name=str(run.x_name.iloc[0])), columns=COLUMNS).astype(object)
    out["bound"] = None
    try:
        spec = get_spec(kernel_name)
    except ValueError:
        return out
    rates = run_rates(run, ceilings)
    own = times[spec.own_matmuls] if spec.own_matmuls and spec.own_matmuls in times else pd.Series(dtype=float)
    x_name = str(run.x_name.iloc[0])
    configs = {x: json.loads(text) for x, text in zip(run.x_value, run.extra_benchmark_config_str)}
    first = json.loads(run.extra_benchmark_config_str.iloc[0])
    for x in xs:
        config = configs.get(x, first)
        sizes = _sizes(spec, config, x_name, x)
        dtype = getattr(torch, str(config.get("dtype", spec.published.get("dtype", "torch.float32"))).replace("torch.", ""))
        out.loc[x] = list(floor_at(spec.kernel_name, sizes, dtype, mode, rates, own.get(x, math.nan),
                                   {k: v for k, v in config.items() if k == "input_grad"}))
    for column in ("ms", "matmul ms", "bytes ms"):
        out[column] = out[column].astype(float)
    return out


def floor_ms(run: pd.DataFrame, ceilings: pd.DataFrame, kernel_name: str | None = None, mode: str = "full", xs=None) -> pd.Series:
    """:func:`floor`'s ``ms`` per x, named ``floor ms``."""
    return floor(run, ceilings, kernel_name, mode, xs)["ms"].rename("floor ms")


def describe(run: pd.DataFrame, ceilings: pd.DataFrame, kernel_name: str | None = None) -> str:
    """What set the run's floor, in words: ``the three_matmuls timed in this run; matmul 692 TFLOP/s and copy
    3041 GB/s measured in this run``, or that the run measured no ceilings (then no floor)."""
    if not len(run):
        return "no run: no floor"
    kernel_name = kernel_name or str(run.kernel_name.iloc[0])
    rates = run_rates(run, ceilings)
    said = [f"{kind} {rates[kind]:.0f} {unit}" for kind, unit in (("matmul", "TFLOP/s"), ("copy", "GB/s")) if kind in rates]
    try:
        own = get_spec(kernel_name).own_matmuls
    except ValueError:
        return "no bench spec: no floor"
    timed = own if own and own in set(run.kernel_provider) else None
    text = " and ".join(said) + " measured in this run" if said else "no ceilings measured in this run: no floor"
    return (f"the loss's own matmuls (`{timed}`) timed in this run; " + text) if timed else text
