"""Why DPO's and GRPO's ``full`` grows faster than B from B = 8 to 16 (one CUDA GPU, ~1 minute).

The published-workload sweep (``scripts/published_sweeps.py``, commit 6ef9242) measured kernels_lib's
DPO ``full`` at 54.4 ms for B = 8 and 123.9 ms for B = 16 (2.28×), GRPO's 55.2 → 125.2 ms, while CPO,
which has no reference model, doubled (40.2 → 80.1 ms). For DPO and GRPO (token level) at
B ∈ {8, 16}, T = 1024, H = 4096, V = 128256, bf16, this measures with ``triton.testing.do_bench``:

- ``full``: the bench's call and backward, as in the sweep;
- ``full, ref_logps given``: the same without the reference model's pass (its log-probs precomputed);
- ``reference pass``: the reference model's pass alone (``reference_sums``);

and a ``torch.profiler`` table of one ``full`` call per point (CUDA time per kernel name, top 12).
Writes ``preference_scaling_profile.csv`` (times) and ``preference_scaling_kernels.csv`` (profile)
to ``--out``.

    PYTHONPATH=$PWD KERNELS_LIB_COMMIT=<commit> python -m studies.preference_scaling_profile --out $OUT
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
from triton.testing import do_bench

from kernels_lib._sequence_logprobs import reference_sums
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.registry import get_spec

LOSSES = {"dpo": "fused_linear_dpo_loss", "grpo": "fused_linear_grpo_loss_token"}


def _inputs(name: str, batch: int):
    spec = get_spec(name)
    inputs = spec.make_inputs({**spec.published["sizes"], "B": batch}, torch.bfloat16, "cuda", dict(spec.default_options))
    return spec.providers["kernels_lib"].load(), inputs


def _full(loss, inputs, **overrides):
    def step():
        for t in inputs.grad_inputs:
            t.grad = None
        loss(*inputs.args, **{**inputs.kwargs, **overrides}).loss.backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    times, kernels = [], []
    for short, name in LOSSES.items():
        for batch in (8, 16):
            loss, inputs = _inputs(name, batch)
            kw = inputs.kwargs
            target = inputs.args[2]
            with torch.no_grad():
                ref = reference_sums(kw["ref_x"], kw["ref_weight"], kw.get("ref_bias"), target, ignore_index=-100, chunk_size=None)
            cases = {"full": _full(loss, inputs)}
            if short == "dpo":
                cases["full, ref_logps given"] = _full(loss, inputs, ref_x=None, ref_weight=None, ref_bias=None, ref_logps=ref)
            cases["reference pass"] = lambda: reference_sums(kw["ref_x"], kw["ref_weight"], kw.get("ref_bias"), target,
                                                            ignore_index=-100, chunk_size=None)
            for case, fn in cases.items():
                p20, p50, p80 = do_bench(fn, quantiles=[0.2, 0.5, 0.8], rep=300)
                times.append({"loss": name, "B": batch, "case": case, "ms_p50": p50, "ms_p20": p20, "ms_p80": p80})
                print(f"{name} B={batch} {case}: {p50:.1f} ms", flush=True)
            step = cases["full"]
            step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            table = [(e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()]
            for key, ms, count in sorted(table, key=lambda r: -r[1])[:12]:
                kernels.append({"loss": name, "B": batch, "kernel": key[:120], "cuda_ms": ms, "calls": count})
            del inputs, loss
            torch.cuda.empty_cache()
    meta = provenance("cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(times).assign(**meta).to_csv(args.out / "preference_scaling_profile.csv", index=False)
    pd.DataFrame(kernels).assign(**meta).to_csv(args.out / "preference_scaling_kernels.csv", index=False)


if __name__ == "__main__":
    main()
