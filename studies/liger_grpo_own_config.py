"""Why does Liger's fused GRPO measure ~3x its own published figure in our GRPO charts?

Liger published ~320 ms (``full``, B = 16, token level) on an A100; our sweep measures about 1000 ms on an
H100 and an H200, faster GPUs. Before a ratio to that number is quoted, this study times Liger's module in
two arms, each in a fresh process, on the same GPU, at the published workload (T = 1024, H = 4096,
V = 128256, bf16, B = 2..16, token and sequence level):

- ``liger_own``: the configuration of Liger's own benchmark script for that chart (``benchmark_grpo_loss.py``
  at the installed version, read through its test module's head): a fresh ``LigerFusedLinearGRPOLoss`` per
  point with its benchmark's settings (beta 0.1, epsilon 0.2 both sides, ``bnpo``, the reference model's
  head, ``compiled=True``, its default ``chunk_size``), ``nn.Linear`` heads, timed as that script times
  (``triton.testing.do_bench``, rep 100 ms, a fresh forward before each backward);
- ``bench_adapter``: the workbench's ``liger`` provider as the chart sweep calls it (one loaded adapter
  across the B values, its modules kept between points), inputs from the chart's ``make_inputs``, timed
  by the workbench's ``time_callable``.

Each row also records how many graphs ``torch.compile`` made and how often it recompiled during the
point (``torch._dynamo.utils.counters``): a recompile limit reached makes Dynamo run the chunk step eagerly.

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD:$PWD/lab python -m studies.liger_grpo_own_config --out OUT

writes ``liger_grpo_own_config.csv`` to ``OUT`` (``data/measured/gpu_runs/`` when committed). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

FILE = "liger_grpo_own_config.csv"
ARMS = ("liger_own", "bench_adapter")
LEVELS = ("token", "sequence")
SIZES = {"T": 1024, "H": 4096, "V": 128256}
BATCHES = (2, 4, 8, 16)


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0}


def _liger_own_point(level: str, b: int, device: torch.device) -> dict:
    """One point of Liger's own benchmark configuration (written here from its script's settings)."""
    import triton.testing
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    t, h, v, dtype = SIZES["T"], SIZES["H"], SIZES["V"], torch.bfloat16
    head = torch.nn.Linear(h, v, bias=False, dtype=dtype, device=device)
    ref_head = torch.nn.Linear(h, v, bias=False, dtype=dtype, device=device)
    loss = LigerFusedLinearGRPOLoss(beta=0.1, epsilon_low=0.2, epsilon_high=0.2, temperature=1.0, use_ref_model=True,
                                    compiled=True, loss_type="bnpo", max_completion_length=None,
                                    importance_sampling_level=level)
    x = torch.randn(b, t, h, dtype=dtype, device=device, requires_grad=True)
    ids = torch.randint(0, v, (b, t), device=device)
    mask = torch.ones(b, t, device=device)
    advantages = torch.randn(b, dtype=dtype, device=device)
    ref_x = torch.randn(b, t, h, dtype=dtype, device=device)

    def full():
        out = loss(x, head.weight, ids, mask, advantages, ref_input=ref_x, ref_weight=ref_head.weight)
        out[0].backward()

    p50, p20, p80 = triton.testing.do_bench(full, rep=100, quantiles=[0.5, 0.2, 0.8])
    return {"ms_p50": p50, "ms_p20": p20, "ms_p80": p80, "timer": "do_bench rep=100 (Liger's script)"}


def _adapter_points(level: str, device: torch.device) -> list[dict]:
    """The chart sweep's ``liger`` provider over the B values, one loaded adapter for all of them."""
    from kernels_workbench.bench import fused_linear_grpo as bench
    from kernels_workbench.bench.timing import mode_callable, time_callable

    spec = bench.SPEC_TOKEN if level == "token" else bench.SPEC_SEQUENCE
    fn = spec.providers["liger"].load()
    rows = []
    for b in BATCHES:
        before = _dynamo_counts()
        inputs = spec.make_inputs({**SIZES, "B": b}, torch.bfloat16, device, dict(spec.default_options))
        timing = time_callable(mode_callable(lambda: fn(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full"),
                               device, grad_to_none=inputs.grad_inputs)
        after = _dynamo_counts()
        rows.append({"B": b, "ms_p50": timing.p50, "ms_p20": timing.p20, "ms_p80": timing.p80, "timer": timing.timer,
                     **{f"{k}_added": after[k] - before[k] for k in after}})
        del inputs
        torch.cuda.empty_cache()
    return rows


def run_arm(arm: str, level: str) -> list[dict]:
    device = torch.device("cuda")
    if arm == "bench_adapter":
        rows = _adapter_points(level, device)
    else:
        rows = []
        for b in BATCHES:
            before = _dynamo_counts()
            point = _liger_own_point(level, b, device)
            after = _dynamo_counts()
            rows.append({"B": b, **point, **{f"{k}_added": after[k] - before[k] for k in after}})
            torch.cuda.empty_cache()
    return [{"arm": arm, "importance_sampling_level": level, **row} for row in rows]


def summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per level and B: each arm's median ``full`` time and the adapter's over Liger's own (``× own``)."""
    table = rows.pivot_table(index=["importance_sampling_level", "B"], columns="arm", values="ms_p50")
    missing = [arm for arm in ARMS if arm not in table.columns]
    if missing:
        raise ValueError(f"summary: the rows have no arm {missing} (expected both of {ARMS})")
    table["bench_adapter × liger_own"] = table["bench_adapter"] / table["liger_own"]
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arm", choices=ARMS, help="one arm in this process (the driver runs each in its own)")
    parser.add_argument("--level", choices=LEVELS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("liger_grpo_own_config: CUDA only (Liger's module runs on a GPU)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.level)))
        return 0
    from kernels_workbench.bench.environment import provenance

    rows = []
    for level in LEVELS:
        for arm in ARMS:
            done = subprocess.run([sys.executable, "-m", "studies.liger_grpo_own_config", "--out", str(args.out),
                                   "--arm", arm, "--level", level], capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{arm} {level}: exit {done.returncode}\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.extend(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{arm} {level}: " + ", ".join(f"B={r['B']} {r['ms_p50']:.1f} ms" for r in rows[-len(BATCHES):]), flush=True)
    frame = pd.DataFrame(rows)
    for key, value in provenance(torch.device("cuda")).items():
        frame[key] = value
    frame.to_csv(args.out / FILE, index=False)
    print(summary(frame).round(3).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
