"""Does the logits-level JSD kernel gain from the two-head stage's mixture-log dials (one exponential fewer, the
hardware log)? One run, one GPU, the copy ceiling measured first.

For each arm (:data:`ARMS`: the library's kernel, and ``studies/kernels/jsd_log_dials.py`` with ``few_exp``,
``fast_log`` or both), ``kernels_lib.jsd``'s ``full`` (forward and backward, β = ½, batchmean, fp32) on the JSD's
two published charts (the vocabulary sweep at 8192 rows, the token sweep at V = 128256; ``--points ends`` or
``all``), in ``--rounds`` rounds of alternating order: the median time with p20/p80, the floor (the loss's bytes at
the run's copy bandwidth) and the time over it, and the loss's and gradient's relative error against the library's
kernel on the same inputs. The arm runs the library's launcher and autograd function with the study kernel set in
place of ``jsd_kernel`` (``studies.bench.arms.constants_set``).

Writes ``jsd_log_ab.csv`` and ``ceilings.csv`` under ``--out`` (append them to ``data/measured/gpu_runs/`` and
``data/measured/ceilings.csv``); every row carries the GPU, the versions and the commit. About a minute on a GPU.

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.jsd_log_ab --out OUT

``--size small`` runs at CPU sizes through Triton's interpreter (a smoke test; times mean nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

import kernels_lib
from kernels_workbench import floor as one_floor
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.registry import get_spec
from kernels_workbench.bench.timing import mode_callable, time_callable
from kernels_workbench.check import relative_error
from studies.bench.arms import constants_set
from studies.bench.timing import run_ceilings
from studies.kernels.jsd_log_dials import WithDials

LIBRARY = "library"
#: arm -> (few_exp, fast_log)
ARMS = {"few_exp": (True, False), "fast_log": (False, True), "few_exp+fast_log": (True, True)}
#: the CPU's arms: fast_log is inline PTX, which the interpreter cannot run.
CPU_ARMS = [arm for arm, (_, fast) in ARMS.items() if not fast]
CHARTS = {"published": "V", "published_tokens": "BT"}


def _arm(arm: str):
    if arm == LIBRARY:
        return constants_set({})
    return constants_set({"kernels_lib.kernels.jsd": {"jsd_kernel": WithDials(*ARMS[arm])}})


def _outputs(spec, inputs):
    student = inputs.grad_inputs[0]
    student.grad = None
    loss = kernels_lib.jsd(*inputs.args, **inputs.kwargs)
    loss.backward()
    return loss.detach().clone(), student.grad.detach().clone()


def rows(arms: list[str], size: str, points: str, device: torch.device, rounds: int, copy_gbps: float) -> list[dict]:
    """One row per chart, x, arm and round: ``full``'s time, the floor, and the errors against the library."""
    spec = get_spec("jsd")
    out = []
    for preset, x_name in CHARTS.items():
        workload = spec.preset("small" if size == "small" else preset)
        xs = list(workload["x_values"])
        for x in (xs if points == "all" else sorted({xs[0], xs[-1]})):
            sizes = dict(workload["sizes"], **{workload["x_name"]: x})
            inputs = spec.make_inputs(sizes, workload["dtype"], device, dict(spec.default_options), 0)
            floor = one_floor.floor_at("jsd", sizes, workload["dtype"], "full", {"copy": copy_gbps})[0]
            want = _outputs(spec, inputs)
            errors = {}
            for arm in arms:
                with _arm(arm):
                    got = _outputs(spec, inputs)
                errors[arm] = {"loss error": relative_error(got[0], want[0]), "grad error": relative_error(got[1], want[1])}
            full = mode_callable(lambda: kernels_lib.jsd(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full")
            for round_ in range(1, rounds + 1):
                for arm in (arms if round_ % 2 else arms[::-1]):
                    with _arm(arm):
                        timing = time_callable(full, device, grad_to_none=inputs.grad_inputs)
                    out.append({"chart": preset, "x_name": workload["x_name"], "x": x, "arm": arm, "round": round_,
                                "full_ms": timing.p50, "full_ms_p20": timing.p20, "full_ms_p80": timing.p80,
                                "floor_ms": floor, "x_floor": timing.p50 / floor, **errors[arm]})
                    print(f"jsd {preset} {workload['x_name']}={x} {arm} round {round_}: {timing.p50:.3f} ms, "
                          f"{timing.p50 / floor:.2f}x floor", flush=True)
            inputs = full = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=["published", "small"], default="published")
    parser.add_argument("--arms", default=None, help="comma-separated arms of ARMS (default: all that run here)")
    parser.add_argument("--points", choices=("ends", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    arms = (args.arms or ",".join(ARMS if device.type == "cuda" else CPU_ARMS)).split(",")
    unknown = sorted(a for a in arms if a not in ARMS)
    if unknown:
        parser.error(f"unknown arm: {', '.join(unknown)} (arms: {', '.join(ARMS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbps = run_ceilings(device, args.out).get("copy", float("nan"))
    table = pd.DataFrame(rows([LIBRARY, *arms], args.size, args.points, device, args.rounds, copy_gbps))
    table.assign(**provenance(device)).to_csv(args.out / "jsd_log_ab.csv", index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
