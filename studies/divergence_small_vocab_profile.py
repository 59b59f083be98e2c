"""Where the logits-level JSD's and TVD's time goes at small vocabularies (issue 30: JSD's "fixed per-call time" at V ≤ 8192).

On the published V charts (float32, N = 8192 rows for JSD, 16384 for TVD) the H200 runs put JSD's ``full``
at 0.32–0.74 ms at V = 4096 and 8192, with p20–p80 spreads of 0.09–0.24 ms, where its time per element at
V ≥ 32768 predicts 0.11 and 0.21 ms; from V = 32768 on the runs agree within 6 % and the spreads are at most
0.08 ms (notebook 07, ``overview.per_element_excess``). The CE small-vocabulary profile found the same shape to
be the host's (``studies/ce_small_vocab_profile.py``). This script measures it for the row divergences.

Per loss, V (4096 and 8192, and 16384 as the bandwidth-bound control) and provider (kernels_lib, Liger,
the torch baseline), mode ``full``:

- ``do_bench``'s median, p20 and p80 (what the charts report);
- the GPU's view (:func:`~kernels_workbench.bench.timing.busy_timeline`): the kernels' busy time per call
  and the idle time between them, over calls issued back to back with the L2 flushed as do_bench does;
- the host's view (:mod:`studies.bench.host_profile`): ms per call issued back to back and
  of one call after a sync. Where the host's ms per call exceed the GPU's busy ms, the call is
  host-bound: its ``do_bench`` time is the host's, and differs with the host.

Part ``ops``: torch.profiler's host-side ops of kernels_lib's ``full`` at the smallest V (self CPU time per
call, the costliest 25). Part ``step``: the loss behind GPU work queued first (five 4096² bf16 matmuls,
about 1 ms on an H200: longer than the host's time per call, short enough that the difference of two
medians is not lost in the chain's own spread), three rounds in alternating order: what it adds to a step
when the host runs ahead, as in training.

On the GPU machine: ``KERNELS_LIB_COMMIT=<commit> PYTHONPATH=/tmp/site:$PWD python -m studies.divergence_small_vocab_profile --out $OUT``
(estimated at about a minute; Liger's wheel on the path for its rows); writes the files of :data:`FILES`
under ``--out``, laid out as ``data/measured/``. ``--size small`` runs it on a CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import kernels_lib  # noqa: F401  (before triton: the interpreter on a CPU)
from kernels_workbench.bench import get_spec
from studies.bench.host_profile import host_ops, host_times, matmul_chain, step_rows, write_tables
from kernels_workbench.bench.sweep import available_providers
from kernels_workbench.bench.timing import mode_callable, time_callable
from studies.bench.timing import busy_timeline

LOSSES = ("jsd", "tvd")
PROVIDERS = ("kernels_lib", "liger", "torch")
SIZES = {"full": {"vocabs": [4096, 8192, 16384], "rows": None, "calls": 200, "chain": (4096, 5), "rounds": 3, "steps": 10},
         "small": {"vocabs": [64, 128], "rows": 8, "calls": 2, "chain": (64, 2), "rounds": 1, "steps": 2}}
FILES = {"times": "gpu_runs/divergence_small_vocab_profile.csv", "ops": "gpu_runs/divergence_small_vocab_ops.csv",
         "step": "gpu_runs/divergence_small_vocab_step.csv"}


def inputs(loss: str, vocab: int, rows: int | None, device: torch.device):
    """The published chart's inputs at ``vocab`` (its rows, float32, its default options), or ``rows`` rows."""
    spec = get_spec(loss)
    n = rows or int(spec.published["sizes"]["N"])
    return n, spec.make_inputs({"N": n, "V": vocab}, spec.published["dtype"], device, spec.default_options)


def full_step(fn, made):
    """``full`` (forward, then backward from the loss) of provider ``fn`` on ``made``."""
    return mode_callable(lambda: fn(*made.args, **made.kwargs), made.grad_inputs, "full")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--parts", default="times,ops,step", help="comma-separated: times, ops, step")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    unknown = parts - set(FILES)
    if unknown:
        parser.error(f"--parts must be among {', '.join(FILES)}; got {', '.join(sorted(unknown))}")
    size = SIZES[args.size]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, ops, steps = [], [], []
    for loss in LOSSES:
        providers, skipped = available_providers(loss, PROVIDERS)
        for name, why in skipped.items():
            print(f"{loss}: {name} skipped ({why})", flush=True)
        for vocab in size["vocabs"]:
            n, made = inputs(loss, vocab, size["rows"], device)
            calls = {name: full_step(fn, made) for name, fn in providers.items()}
            for name, fn in calls.items() if "times" in parts else ():
                timing = time_callable(fn, device, grad_to_none=made.grad_inputs)
                throughput, latency = host_times(fn, device, size["calls"])
                timeline = busy_timeline(fn, device, steps=size["steps"])
                rows.append({"loss": loss, "V": vocab, "N": n, "provider": name, "mode": "full",
                             "do_bench ms": timing.p50, "do_bench p20 ms": timing.p20, "do_bench p80 ms": timing.p80,
                             "gpu busy ms per call": timeline.busy if timeline else float("nan"),
                             "gpu idle ms per call": timeline.idle if timeline else float("nan"),
                             "host ms per call, back to back": throughput, "host ms of one call after a sync": latency})
                print(rows[-1], flush=True)
            if "ops" in parts and vocab == size["vocabs"][0]:
                ops += [{"loss": loss, "V": vocab, "N": n, **row} for row in host_ops(calls["kernels_lib"])[:25]]
            if "step" in parts and vocab < size["vocabs"][-1]:
                chain = matmul_chain(*size["chain"], torch.bfloat16, device)
                for row in step_rows(calls, chain, device, size["rounds"]):
                    steps.append({"loss": loss, "V": vocab, "N": n, **row})
                    print(steps[-1], flush=True)
    tables = {"times": rows, "ops": ops, "step": steps}
    write_tables({key: tables[key] for key in tables if key in parts}, FILES, args.out, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
