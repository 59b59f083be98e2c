"""Where the logits-level cross-entropy's time goes at small vocabularies (issue 14: slower than torch at V = 4096).

At V = 4096 the published charts' logits are 64 MB (Megatron's, bf16, 8192 rows) and 256 MB (the
cross_entropy chart's, fp32, 16384 rows): the GPU work is a few tenths of a millisecond, so a call's
host-side cost can set its time. Per chart, provider and mode this measures: ``do_bench``'s median
(what the charts report), the host time per call when calls are issued back to back (a sync only at
the end: the throughput a training loop sees, ``max(host, device)`` per call) and the host time of one
call issued after a sync (its latency). Providers: kernels_lib's default, kernels_lib with
``host_checks=False`` (no host sync), and the torch baseline. Then torch.profiler's host-side ops of
kernels_lib's ``full`` (self CPU time per call), the costly ones first. Part ``breakdown``: the host
time of each stage of a call alone (argument checks, the targets' totals, each launch, a bare Triton
launch and a bare torch op for scale), issued back to back, in microseconds. Part ``step``: the loss
inside a step, as a training loop issues it: GPU work queued before the call (a chain of five
4096² matmuls in the logits' dtype: about 1 ms in bf16, 13 ms in float32 on the H200), then forward
and backward; ``do_bench`` of the chain alone and of the whole step,
three rounds in alternating order, and the loss's share, step minus chain: what the loss adds to a
step once the host runs ahead of the GPU.

On the GPU machine: ``KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.ce_small_vocab_profile --out $OUT``
(about a minute); writes ``gpu_runs/cross_entropy_small_vocab_profile.csv`` and
``gpu_runs/cross_entropy_small_vocab_ops.csv`` (and ``..._breakdown.csv``, ``..._step.csv``) under ``--out``.
``--size small`` runs it on a CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import kernels_lib  # noqa: F401  (before triton: the interpreter on a CPU)
import triton
import triton.language as tl
from kernels_lib import reference
from kernels_lib.cross_entropy import _validate as cross_entropy_checks
from kernels_lib._target_totals import target_totals
from kernels_lib.kernels.cross_entropy_rows import launch_cross_entropy_rows
from kernels_lib.kernels.scale_gradient import launch_scale_gradient
from studies.bench.host_profile import host_microseconds, host_ops, host_times, matmul_chain, write_tables
from studies.bench.host_profile import step_rows as host_profile_step_rows
from kernels_workbench.bench.timing import mode_callable, time_callable

#: chart -> (rows, logits dtype, reduction), the published workloads at V = 4096 and 8192
CHARTS = {"megatron_cross_entropy": (8192, torch.bfloat16, "sum"), "cross_entropy": (16384, torch.float32, "mean")}
SIZES = {"full": {"vocabs": [4096, 8192], "rows_scale": 1, "calls": 200, "chain": (4096, 5), "rounds": 3},
         "small": {"vocabs": [64], "rows_scale": 1 / 2048, "calls": 2, "chain": (64, 2), "rounds": 1}}
FILES = {"times": "gpu_runs/cross_entropy_small_vocab_profile.csv", "ops": "gpu_runs/cross_entropy_small_vocab_ops.csv",
         "breakdown": "gpu_runs/cross_entropy_small_vocab_breakdown.csv", "step": "gpu_runs/cross_entropy_small_vocab_step.csv"}


@triton.jit
def _bare_kernel(x_ptr):
    """One store: what a Triton launch costs on the host with nothing to bind."""
    tl.store(x_ptr, 1.0)


def stage_calls(logits, target, reduction) -> dict:
    """Each stage of one ``kernels_lib.cross_entropy`` call, callable alone on the chart's inputs."""
    n, vocab = logits.shape
    lse, loss = (torch.empty(n, device=logits.device) for _ in range(2))
    grad = torch.empty_like(logits)
    scale, one, small = (torch.ones(1, device=logits.device) for _ in range(3))

    def totals(host_checks):
        def run():
            check = target_totals(target, vocab, -100, None, host_checks).check
            if check is not None:
                check.raise_if_bad()
        return run

    return {
        "checks (_validate)": lambda: cross_entropy_checks(logits, target, None, -100, reduction, 0.0, False, True),
        "target_totals + range check": totals(True),
        "target_totals, host_checks=False": totals(False),
        "cross_entropy_rows launch (fused)": lambda: launch_cross_entropy_rows(logits, target, lse=lse, loss=loss,
                                                                               grad=grad, scale=scale),
        "scale_gradient launch": lambda: launch_scale_gradient(grad, one),
        "bare Triton launch": lambda: _bare_kernel[(1,)](small),
        "bare torch op (add_)": lambda: small.add_(1.0),
        "torch.empty(N)": lambda: torch.empty(n, device=logits.device),
        "kernels_lib forward (with grad)": lambda: kernels_lib.cross_entropy(logits, target, reduction=reduction),
        "torch forward (with grad)": lambda: reference.cross_entropy(logits, target, reduction=reduction),
    }


def providers():
    return {
        "kernels_lib": lambda z, t, r: kernels_lib.cross_entropy(z, t, reduction=r),
        "kernels_lib[host_checks=False]": lambda z, t, r: kernels_lib.cross_entropy(z, t, reduction=r, host_checks=False),
        "torch": lambda z, t, r: reference.cross_entropy(z, t, reduction=r),
    }


def step_rows(logits, target, reduction, size: dict, device) -> list[dict]:
    """The loss inside a step (module docstring, part ``step``): per round and provider, ``do_bench`` of
    the matmul chain alone and of chain + forward + backward, and the loss's share (their difference)."""

    def step(provider):
        def run():
            logits.grad = None
            provider(logits, target, reduction).backward()
        return run

    chain = matmul_chain(*size["chain"], logits.dtype, device)
    return host_profile_step_rows({name: step(provider) for name, provider in providers().items()}, chain, device,
                                  size["rounds"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--parts", default="times,ops,breakdown,step", help="comma-separated: times, ops, breakdown, step")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    size = SIZES[args.size]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows, ops, stages, steps = [], [], [], []
    for chart, (n, dtype, reduction) in CHARTS.items():
        n = max(8, int(n * size["rows_scale"]))
        for vocab in size["vocabs"]:
            generator = torch.Generator(device=device).manual_seed(0)
            logits = torch.randn(n, vocab, generator=generator, device=device).to(dtype).requires_grad_()
            target = torch.randint(0, vocab, (n,), generator=generator, device=device)
            if "breakdown" in parts and vocab == size["vocabs"][0]:
                for stage, fn in stage_calls(logits, target, reduction).items():
                    stages.append({"chart": chart, "V": vocab, "N": n, "stage": stage,
                                   "host us per call": host_microseconds(fn, device, 10 * size["calls"])})
                    print(stages[-1], flush=True)
            if "step" in parts:
                for row in step_rows(logits, target, reduction, size, device):
                    steps.append({"chart": chart, "V": vocab, "N": n, **row})
                    print(steps[-1], flush=True)
            for name, provider in providers().items() if "times" in parts else ():
                for mode in ("forward", "full"):
                    fn = mode_callable(lambda: provider(logits, target, reduction), [logits], mode)
                    timing = time_callable(fn, device, grad_to_none=[logits])
                    throughput, latency = host_times(fn, device, size["calls"])
                    rows.append({"chart": chart, "V": vocab, "N": n, "provider": name, "mode": mode,
                                 "do_bench ms": timing.p50, "host ms per call, back to back": throughput,
                                 "host ms of one call after a sync": latency})
                    print(rows[-1], flush=True)
            if "ops" in parts and vocab == size["vocabs"][0]:
                step = mode_callable(lambda: kernels_lib.cross_entropy(logits, target, reduction=reduction), [logits], "full")
                ops += [{"chart": chart, "V": vocab, **row} for row in host_ops(step)[:25]]  # the costliest 25
    tables = {"times": rows, "ops": ops, "breakdown": stages, "step": steps}
    write_tables({key: tables[key] for key in tables if key in parts}, FILES, args.out, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
