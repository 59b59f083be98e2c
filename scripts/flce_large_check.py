"""fused_linear_cross_entropy at N*V >= 2**31 and at V = 151936 on CUDA, against the baseline in float32/float64.

    python3 scripts/flce_large_check.py --out OUT     (writes flce_large_check.csv)
"""

import argparse
from pathlib import Path

import pandas as pd
import torch

import kernels_lib
from kernels_lib import reference
from kernels_lib.workbench.bench.environment import provenance
from kernels_lib.workbench.check import relative_error


def check(n: int, h: int, v: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, generator=g, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=g, device="cuda") * h**-0.5).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), generator=g, device="cuda")
    y[::7] = -100
    loss = kernels_lib.fused_linear_cross_entropy(x, w, y)
    loss.backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference.fused_linear_cross_entropy(x64, w64, y)  # float64 logits: N*V*8 bytes
    ref.backward()
    tail = slice(n - 16, n)
    return dict(N=n, H=h, V=v, elements=n * v, loss_err=relative_error(loss, ref), dx_tail_err=relative_error(x.grad[tail], x64.grad[tail]),
                dW_err=relative_error(w.grad, w64.grad), **provenance("cuda"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [check(16800, 128, 128256), check(1031, 200, 151936)]
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "flce_large_check.csv", index=False)
    print(table[["N", "H", "V", "elements", "loss_err", "dx_tail_err", "dW_err"]].to_string(index=False))


if __name__ == "__main__":
    main()
