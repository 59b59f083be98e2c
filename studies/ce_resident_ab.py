"""How long a row the logits cross-entropy's fused forward should hold whole in registers: an interleaved A/B of
``kernels_lib.kernels.cross_entropy_rows.RESIDENT_MAX_COLS``, on one CUDA GPU.

A row of at most ``RESIDENT_MAX_COLS`` logits is read once (pass 2 writes the gradient from the registers pass 1
filled): ``2·N·V·e`` bytes, the floor, against ``3·N·V·e`` for two reads. The question is how long a row can be before
the register pressure (one 16-warp block per SM) costs more than the second read saves: 32 float32 logits a thread
at 16384, 64 at 32768, 128 at 65536. On the H100 (``gpu_runs/ce_resident_ab.csv``) 32768 won (0.69× the two reads)
and 65536 lost (1.40×, it spills); the library's limit is 32768. For each chart (the fp32 ``mean``
chart ``cross_entropy``, the bf16 ``sum`` chart ``megatron_cross_entropy``) at ``--vocab`` sizes, the ``full``
call (forward with the gradient, backward) with each ``--limits`` value, timed by
``studies.bench.timing.paired_times`` (the arms called alternately, each alone after an L2 flush; the per-sample
ratio to the first arm cancels the GPU's drift), beside the bytes floor at the run's copy bandwidth
(``2·N·V·e`` at ``ceilings.csv``'s copy rate, measured in the same run), with each arm's loss and gradient
against the first arm's (``rel_diff``). Writes ``ce_resident_ab.csv`` to ``--out`` (append it to
``data/measured/gpu_runs/``).

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.ce_resident_ab --out OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

from kernels_lib import default_device
from kernels_workbench.bench.ceilings import measure_ceilings
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.registry import get_spec
from kernels_workbench.bench.timing import mode_callable
from kernels_workbench.training_step import free_memory
from studies.bench.arms import constants_set, flat_outputs, within
from studies.bench.timing import paired_arms, ratio_text

FILE = "ce_resident_ab.csv"
CHARTS = ("cross_entropy", "megatron_cross_entropy")


def resident_limit(limit: int):
    """``RESIDENT_MAX_COLS`` set to ``limit`` inside the ``with`` (put back after)."""
    return constants_set({"kernels_lib.kernels.cross_entropy_rows": {"RESIDENT_MAX_COLS": limit}})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--limits", default="16384,32768", help="RESIDENT_MAX_COLS per arm; the first is the reference")
    parser.add_argument("--vocab", default="16384,32768", help="V values (default: where the arms differ, and one below)")
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--size", choices=("published", "small"), default="published")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = default_device()
    limits = [int(v) for v in args.limits.split(",")]
    stamp = provenance(device)
    ceilings = measure_ceilings(device) if device.type == "cuda" else pd.DataFrame()
    copy_gbs = float(dict(zip(ceilings.kernel_name, ceilings.y_value_50))["copy"]) if len(ceilings) else float("nan")
    rows = []
    for chart in CHARTS:
        spec = get_spec(chart)
        preset = spec.published if args.size == "published" else spec.small
        fn = spec.providers["kernels_lib"].load()
        for v in (int(x) for x in args.vocab.split(",")):
            inputs = spec.make_inputs({**preset["sizes"], "V": v}, preset["dtype"], device, dict(spec.default_options))
            logits = inputs.grad_inputs[0]
            floor_ms = 2 * logits.numel() * logits.element_size() / (copy_gbs * 1e9) * 1e3
            call = lambda: fn(*inputs.args, **inputs.kwargs)  # noqa: E731
            ref = flat_outputs(call, inputs.grad_inputs, lambda: resident_limit(limits[0]))
            diffs = [float((flat_outputs(call, inputs.grad_inputs, lambda lim=limit: resident_limit(lim)) - ref).norm()
                           / ref.norm()) for limit in limits]
            full = mode_callable(call, inputs.grad_inputs, "full")
            calls = [within(lambda lim=limit: resident_limit(lim), full) for limit in limits]
            names = [f"resident<={limit}" for limit in limits]
            summary = paired_arms(calls, names, names[0], device, samples=args.samples, grad_to_none=inputs.grad_inputs)
            for row, limit, diff in zip(summary, limits, diffs):
                rows.append({"chart": chart, "V": v, "resident_max_cols": limit, "resident": v <= limit, **row,
                             "floor_ms (2 N V e at copy rate)": floor_ms, "rel_diff": diff, **stamp})
            on = rows[-1]
            print(f"{chart} V={v}: resident<={limits[-1]} / resident<={limits[0]} = {ratio_text(on)}; "
                  f"{on['ms_50']:.3f} ms, floor {floor_ms:.3f} ms", flush=True)
            inputs = calls = ref = logits = full = call = None
            free_memory(device)
        pd.DataFrame(rows).to_csv(args.out / FILE, index=False)  # written as it goes
    return 0


if __name__ == "__main__":
    sys.exit(main())
