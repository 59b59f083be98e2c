"""Sweeps: every provider at every point of one axis, as rows in the published CSV's layout.

Columns: the published ones (``kernel_name`` … ``liger_version``) followed by the measurement's own
(``device``, ``timer``, ``mode`` sizes in ``extra_benchmark_config_str``) and provenance (torch,
triton and peer versions, the commit). One row per (provider, x, mode, metric); ``speed`` rows for
every mode, ``memory`` rows for every mode on CUDA.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from .environment import provenance
from .registry import get_spec
from .timing import MODES, backward_after_forward, mode_callable, peak_memory_mib, time_after_setup, time_callable

PUBLISHED_COLUMNS = [
    "kernel_name",
    "kernel_provider",
    "kernel_operation_mode",
    "metric_name",
    "metric_unit",
    "x_name",
    "x_label",
    "x_value",
    "y_value_50",
    "y_value_20",
    "y_value_80",
    "extra_benchmark_config_str",
    "gpu_name",
    "timestamp",
    "liger_version",
]
MEASURED_COLUMNS = PUBLISHED_COLUMNS + [
    "cce_version",
    "torch_version",
    "triton_version",
    "kernels_lib_commit",
    "device",
    "timer",
    "note",
    "quack_version",
    "cutlass_dsl_version",
]


def available_providers(kernel_name: str, names: Sequence[str] | None = None) -> tuple[dict[str, Callable], dict[str, str]]:
    """Load the providers of a loss: ``(callables, skipped)`` where ``skipped`` maps a provider that
    cannot run here (peer not installed, no CUDA) to the reason. Unknown names raise ValueError."""
    spec = get_spec(kernel_name)
    names = list(spec.providers) if names is None else list(names)
    unknown = [n for n in names if n not in spec.providers]
    if unknown:
        raise ValueError(f"providers must be among {', '.join(spec.providers)}; got unknown {', '.join(unknown)}")
    loaded, skipped = {}, {}
    for name in names:
        try:
            loaded[name] = spec.providers[name].load()
        except (ImportError, RuntimeError) as error:
            skipped[name] = f"{type(error).__name__}: {error}"
    return loaded, skipped


def run_sweep(
    kernel_name: str,
    *,
    x_name: str,
    x_values: Sequence[int],
    sizes: dict,
    dtype: torch.dtype,
    device: torch.device | str,
    providers: Sequence[str] | None = None,
    modes: Sequence[str] = ("forward", "full"),
    options: dict | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> pd.DataFrame:
    """Measure ``providers`` at each ``x_values`` of axis ``x_name`` (the other sizes fixed in ``sizes``).

    ``progress(done, total, label)`` is called after each measurement (the widgets' progress bar).
    Providers that cannot run here are left out and named in the ``note`` of every row.
    A provider that fails at one point (out of memory, a compiler error, anything it raises) gives a
    NaN row whose note holds the error's type and first line: what fails is recorded, the sweep goes on.
    """
    spec = get_spec(kernel_name)
    device = torch.device(device)
    bad_modes = [m for m in modes if m not in MODES]
    if bad_modes:
        raise ValueError(f"modes must be among {', '.join(MODES)}; got {', '.join(bad_modes)}")
    if not x_values:
        raise ValueError("x_values must name at least one size")
    options = {**spec.default_options, **(options or {})}
    callables, skipped = available_providers(kernel_name, providers)
    skipped_note = "; ".join(f"{n} skipped ({why})" for n, why in skipped.items())
    stamp = provenance(device)
    total, done = len(x_values) * len(callables) * len(modes), 0
    axis = spec.published_preset(x_name)
    x_label = axis["x_label"] if axis else x_name
    rows = []
    for x in x_values:
        point = {**sizes, x_name: int(x)}
        config = json.dumps({**point, "dtype": str(dtype), **options})
        for provider, fn in callables.items():
            for mode in modes:
                measured = _measure_point(spec, fn, point, dtype, device, options, mode)
                base = {
                    "kernel_name": kernel_name,
                    "kernel_provider": provider,
                    "kernel_operation_mode": mode,
                    "x_name": x_name,
                    "x_label": x_label,
                    "x_value": int(x),
                    "extra_benchmark_config_str": config,
                    **stamp,
                    "device": device.type,
                    "note": "; ".join(filter(None, [measured.get("error", ""), skipped_note])),
                }
                timing = measured.get("timing")
                rows.append(
                    {
                        **base,
                        "metric_name": "speed",
                        "metric_unit": "ms",
                        "y_value_50": timing.p50 if timing else float("nan"),
                        "y_value_20": timing.p20 if timing else float("nan"),
                        "y_value_80": timing.p80 if timing else float("nan"),
                        "timer": timing.timer if timing else "",
                    }
                )
                if device.type == "cuda":
                    memory = measured.get("memory", float("nan"))
                    rows.append(
                        {
                            **base,
                            "metric_name": "memory",
                            "metric_unit": "MB",
                            "y_value_50": memory,
                            "y_value_20": memory,
                            "y_value_80": memory,
                            "timer": "torch.cuda.max_memory_allocated",
                        }
                    )
                done += 1
                if progress is not None:
                    progress(done, total, f"{provider} {mode} {x_name}={x}")
    return pd.DataFrame(rows, columns=MEASURED_COLUMNS)


def _measure_point(spec, fn, point, dtype, device, options, mode) -> dict:
    try:
        inputs = spec.make_inputs(point, dtype, device, options)
        call = lambda: fn(*inputs.args, **inputs.kwargs)  # noqa: E731
        if mode == "backward":  # a fresh forward, untimed, before each timed backward (timing's docstring)
            setup, timed = backward_after_forward(call, inputs.grad_inputs)
            memory = peak_memory_mib(timed, device, inputs.grad_inputs, setup=setup)
            timing = time_after_setup(setup, timed, device)
        else:
            setup, timed = None, mode_callable(call, inputs.grad_inputs, mode)
            memory = peak_memory_mib(timed, device, inputs.grad_inputs)
            timing = time_callable(timed, device, grad_to_none=inputs.grad_inputs)
        return {"timing": timing, "memory": memory}
    except Exception as error:  # any failure of a provider is a recorded NaN row, not a lost sweep
        first_line = next(iter(str(error).splitlines()), "")
        return {"error": f"{type(error).__name__}: {first_line}"}
    finally:
        inputs = setup = timed = call = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


#: What identifies one measured point across repeated rounds of a sweep.
POINT_KEYS = ["kernel_name", "kernel_provider", "kernel_operation_mode", "metric_name", "x_value"]


def median_of_rounds(rounds: pd.DataFrame) -> pd.DataFrame:
    """One row per point from a sweep measured in several rounds (a ``round`` column): the median over
    the rounds of each of ``y_value_50``, ``y_value_20`` and ``y_value_80``, the rest from the first
    round's row, and the note saying how many rounds it is the median of. Rounds measured in turn,
    in alternating provider order, put a drift of the GPU over the run (clocks, heat) on every
    provider alike instead of on whichever came later."""
    if "round" not in rounds.columns:
        raise ValueError("rounds must have a 'round' column (the round each row was measured in)")
    n_rounds = rounds["round"].nunique()
    values = ["y_value_50", "y_value_20", "y_value_80"]
    medians = rounds.groupby(POINT_KEYS, sort=False)[values].median()
    first = rounds.sort_values("round", kind="stable").drop_duplicates(POINT_KEYS).set_index(POINT_KEYS)
    first[values] = medians.loc[first.index, values]
    note = f"median of {n_rounds} rounds, providers in alternating order"
    first["note"] = [f"{text}; {note}" if isinstance(text, str) and text else note for text in first["note"]]
    return first.reset_index()[[c for c in rounds.columns if c != "round"]]
