"""The vocab-parallel losses over NCCL against one process (any 2+ CUDA GPUs; gloo on a CPU).

    torchrun --nproc-per-node 2 scripts/tensor_parallel_check.py --out DIR

Each rank holds an uneven share of the vocabulary (V = 50257 split 25000 / 25257 on two ranks) and
computes ``fused_linear_cross_entropy`` (bf16, label smoothing 0.1, z-loss 1e-4, ignored rows) and
the logits-level ``cross_entropy`` (fp32) with ``process_group``; rank 0 computes the same on the
whole head alone. Written to ``DIR/tensor_parallel_check.csv``: ‖TP − single‖ / ‖single‖ of the loss,
``dx`` and the ``dW`` (or ``dlogits``) shards concatenated, and each against a float64 reference.
Exit code 1 if an error exceeds its bound (2e-2 for bf16 gradients, 1e-4 for fp32 and for losses).
``--small`` (CPU, gloo, Triton's interpreter) shrinks the sizes.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

import kernels_lib
from kernels_lib import reference
from kernels_workbench.bench.environment import provenance


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def _gather(t: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor:
    """The uneven shards of every rank, concatenated along ``dim`` (padded to the largest for all_gather)."""
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, max(sizes) - t.shape[dim]]
    parts = [torch.empty_like(torch.nn.functional.pad(t, pad)) for _ in sizes]
    dist.all_gather(parts, torch.nn.functional.pad(t, pad).contiguous())
    return torch.cat([p.narrow(dim, 0, size) for p, size in zip(parts, sizes)], dim)


def _shards(v: int, world: int) -> list[int]:
    """An uneven split: every rank but the last gets ``v // world - 257 * (rank == 0)``, the last the rest."""
    sizes = [v // world] * world
    sizes[0] -= min(257, sizes[0] // 2)
    sizes[-1] = v - sum(sizes[:-1])
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    n, h, v = (1024, 1000, 50257) if not args.small else (12, 24, 257)
    sizes = _shards(v, world)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, h, generator=gen)
    w = torch.randn(v, h, generator=gen) / h**0.5
    target = torch.randint(0, v, (n,), generator=gen)
    target[::7] = -100
    logits = torch.randn(n, v, generator=gen) * 3
    half = torch.bfloat16 if cuda else torch.float32
    options = {"label_smoothing": 0.1, "z_loss_scale": 1e-4}
    rows = []

    def record(name, err, bound):
        rows.append({"check": name, "rel_error": err, "bound": bound, "passed": err <= bound})

    # fused linear CE: the shard's head, the same x on every rank
    xs = x.to(device, half).clone().requires_grad_()
    ws = w[lo:hi].to(device, half).clone().requires_grad_()
    loss = kernels_lib.fused_linear_cross_entropy(xs, ws, target.to(device), process_group=dist.group.WORLD, **options)
    loss.backward()
    dw = _gather(ws.grad, sizes, 0)
    # logits-level CE on the shard's columns
    ls = logits[:, lo:hi].to(device).clone().requires_grad_()
    ce = kernels_lib.cross_entropy(ls, target.to(device), label_smoothing=0.1, process_group=dist.group.WORLD)
    ce.backward()
    dl = _gather(ls.grad, sizes, 1)
    if rank == 0:
        x1, w1 = x.to(device, half).clone().requires_grad_(), w.to(device, half).clone().requires_grad_()
        single = kernels_lib.fused_linear_cross_entropy(x1, w1, target.to(device), **options)
        single.backward()
        x64, w64 = x.double().clone().requires_grad_(), w.double().clone().requires_grad_()
        ref = reference.fused_linear_cross_entropy(x64, w64, target, **options)
        ref.backward()
        gbound = 2e-2 if half == torch.bfloat16 else 1e-4
        record("flce loss vs single", _rel(loss, single), 1e-4)
        record("flce dx vs single", _rel(xs.grad, x1.grad), gbound)
        record("flce dW vs single", _rel(dw, w1.grad), gbound)
        record("flce loss vs float64", _rel(loss.cpu(), ref), 1e-3 if half == torch.bfloat16 else 1e-5)
        record("flce dx vs float64", _rel(xs.grad.cpu(), x64.grad), gbound)
        record("flce dW vs float64", _rel(dw.cpu(), w64.grad), gbound)
        l1 = logits.to(device).clone().requires_grad_()
        ce1 = kernels_lib.cross_entropy(l1, target.to(device), label_smoothing=0.1)
        ce1.backward()
        l64 = logits.double().clone().requires_grad_()
        ce64 = reference.cross_entropy(l64, target, label_smoothing=0.1)
        ce64.backward()
        record("ce loss vs single", _rel(ce, ce1), 1e-5)
        record("ce dlogits vs single", _rel(dl, l1.grad), 1e-5)
        record("ce loss vs float64", _rel(ce.cpu(), ce64), 1e-5)
        record("ce dlogits vs float64", _rel(dl.cpu(), l64.grad), 1e-5)
        frame = pd.DataFrame(rows).assign(world=world, shards="/".join(map(str, sizes)), backend=dist.get_backend(),
                                          **provenance(device))
        args.out.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.out / "tensor_parallel_check.csv", index=False)
        print(frame.to_string(index=False))
    ok = torch.tensor([all(r["passed"] for r in rows)], dtype=torch.int32, device=device)
    dist.broadcast(ok, 0)
    dist.destroy_process_group()
    return 0 if bool(ok.item()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
