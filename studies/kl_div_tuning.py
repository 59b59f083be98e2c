"""One GPU run (any CUDA GPU) for KL divergence: tune the block size, check N*V >= 2**31, sweep the published workload.

Run on the GPU machine (see README, "On a GPU"):

    KERNELS_LIB_COMMIT=<commit> python -m studies.kl_div_tuning --out $OUT

Writes ``tuning.csv`` and ``large_check.csv`` under ``--out``; the sweep itself goes through the
CLI (``python3 -m kernels_workbench.bench.cli kl_div --preset published``), which appends to data/measured/.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
import triton.testing

import kernels_lib
from kernels_workbench.bench.ceilings import copy_bandwidth
from kernels_workbench.check import relative_error
from kernels_lib.kernels.kl_div_forward import launch_kl_div_forward, num_programs


def tune(n: int, v: int) -> pd.DataFrame:
    """Forward-with-gradient and forward-only bandwidth of each (block, num_warps), fp32, batchmean."""
    x = torch.randn(n, v, device="cuda").log_softmax(-1)
    t = torch.randn(n, v, device="cuda").softmax(-1)
    grad = torch.empty_like(x)
    rows = []
    for block in (1024, 2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            partial = torch.empty(num_programs(x.numel(), block), device="cuda")
            for with_grad in (True, False):
                fn = lambda: launch_kl_div_forward(  # noqa: E731
                    x, t, log_target=False, partial=partial, loss=None, grad=grad if with_grad else None,
                    grad_scale=1.0 / n, block=block, num_warps=warps,
                )
                p50, p20, p80 = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8])
                moved = x.numel() * 4 * (3 if with_grad else 2)
                rows.append(dict(block=block, num_warps=warps, with_grad=with_grad, ms=p50, p20=p20, p80=p80,
                                 GBps=moved / (p50 * 1e-3) / 1e9))
    return pd.DataFrame(rows)


def large_check(n: int, v: int, dtype: torch.dtype) -> dict:
    """kl_div at N*V >= 2**31 against a float64 reference computed slice by slice; the gradient
    checked on the last rows (where 32-bit offsets would have wrapped)."""
    x = torch.randn(n, v, device="cuda").log_softmax(-1).to(dtype).requires_grad_()
    t = torch.randn(n, v, device="cuda").softmax(-1).to(dtype)
    x.grad = None
    loss = kernels_lib.kl_div(x, t, reduction="batchmean")
    loss.backward()
    total = torch.zeros((), dtype=torch.float64, device="cuda")
    for start in range(0, n, 1024):
        xs, ts = x[start:start + 1024].detach().double(), t[start:start + 1024].double()
        total += torch.nn.functional.kl_div(xs, ts, reduction="sum")
    reference = total / n
    tail = slice(n - 8, n)
    grad_reference = -t[tail].double() / n
    return dict(N=n, V=v, elements=n * v, dtype=str(dtype), loss=loss.item(), reference=reference.item(),
                loss_rel_err=relative_error(loss, reference), tail_grad_rel_err=relative_error(x.grad[tail], grad_reference),
                grad_written=bool(torch.isfinite(x.grad[tail]).all()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gbps, _ = copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {gbps:.0f} GB/s")
    tuning = tune(16384, 131072)
    tuning["copy_GBps"] = gbps
    tuning.to_csv(args.out / "tuning.csv", index=False)
    print(tuning.to_string(index=False))
    torch.cuda.empty_cache()
    checks = pd.DataFrame([large_check(16384, 131072, torch.float32), large_check(16384, 131073, torch.bfloat16)])
    checks.to_csv(args.out / "large_check.csv", index=False)
    print(checks.to_string(index=False))


if __name__ == "__main__":
    main()
