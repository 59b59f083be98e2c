"""GPU hardening run: cross-entropy at N = 32768 × V = 128256 against float64, and run-to-run determinism.

On the GPU machine, from the repository root:

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python3 scripts/hardening_checks.py --out $OUT

Parts (``--parts``, default both):

- ``flce_large``: ``fused_linear_cross_entropy`` at N = 32768, H = 4096, V = 128256, bf16
  (N·V = 4.2e9 > 2**32, so neither 32-bit element offsets nor a 2**31 limit can hide), every 7th
  target ignored; its loss, ``dx`` and ``dW`` against a float64 reference computed chunk by chunk
  (2048 rows at a time: the float64 logits of all rows would be 34 GB), and, beside them, the errors
  of the baseline that materializes the logits as a model does (bf16 matmul, then float32). ``dx``
  is also compared on its first and last 64 rows alone (the rows whose logits sit past 2**31
  elements in a flat N × V layout). Writes ``flce_32768_check.csv``.
- ``determinism``: each loss's ``kernels_lib`` provider on its published workload at the largest
  published size, run three times on the same inputs; every output (loss, each gradient) compared
  bitwise with the first run. Writes ``determinism.csv`` (one row per loss and output: equal or
  not, the largest absolute difference).

``--size small`` runs both at CPU sizes (Triton's interpreter) as a dry run; the tests use it.
Duration on an H200: about a minute (the float64 reference is ~100 TFLOP at the FP64 tensor rate).
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import pandas as pd
import torch

import kernels_lib
from kernels_lib import reference
from kernels_workbench.bench import get_spec, registered_losses
from kernels_workbench.bench.environment import provenance
from kernels_workbench.check import relative_error

SIZES = {
    "full": {"N": 32768, "H": 4096, "V": 128256, "chunk": 2048, "edge": 64},
    "small": {"N": 300, "H": 24, "V": 257, "chunk": 64, "edge": 8},
}


def float64_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int, ignore_index: int = -100):
    """Mean cross-entropy of ``x @ weight.T`` over the valid rows and its gradients, in float64,
    ``chunk`` rows at a time: ``(loss, dx, dW)``. Per chunk, ``dz = (softmax(z) - onehot(y)) / n_valid``
    (0 on ignored rows), ``dx = dz W``, ``dW += dzᵀ x``."""
    w64 = weight.detach().double()
    valid = target != ignore_index
    n_valid = int(valid.sum())
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    dx = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    dw = torch.zeros_like(w64)
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        x64, y, keep = x[rows].detach().double(), target[rows].clamp(min=0), valid[rows]
        z = x64 @ w64.T
        lse = torch.logsumexp(z, dim=-1)
        total += ((lse - z.gather(1, y[:, None])[:, 0]) * keep).sum()
        dz = torch.softmax(z, dim=-1)
        dz[torch.arange(len(y), device=y.device), y] -= 1.0
        dz *= keep[:, None].to(dz.dtype) / n_valid
        dx[rows] = dz @ w64
        dw += dz.T @ x64
        del z, dz
    return total / n_valid, dx, dw


def flce_large(size: str, device: torch.device) -> pd.DataFrame:
    """Kernel and baseline against the chunked float64 reference at N·V > 2**32 (``SIZES``)."""
    n, h, v, chunk, edge = (SIZES[size][k] for k in ("N", "H", "V", "chunk", "edge"))
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, h, generator=g, device=device).bfloat16()
    w = (torch.randn(v, h, generator=g, device=device) * h**-0.5).bfloat16()
    y = torch.randint(0, v, (n,), generator=g, device=device)
    y[::7] = -100
    ref_loss, ref_dx, ref_dw = float64_cross_entropy(x, w, y, chunk)
    rows = []
    for name, fn in (("kernels_lib", kernels_lib.fused_linear_cross_entropy), ("baseline", reference.fused_linear_cross_entropy)):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xs, ws, y)
        loss.backward()
        rows.append({
            "provider": name, "N": n, "H": h, "V": v, "elements": n * v, "dtype": "bfloat16",
            "loss": loss.item(), "loss_ref": ref_loss.item(), "loss_err": relative_error(loss, ref_loss),
            "dx_err": relative_error(xs.grad, ref_dx), "dx_first_rows_err": relative_error(xs.grad[:edge], ref_dx[:edge]),
            "dx_last_rows_err": relative_error(xs.grad[-edge:], ref_dx[-edge:]), "dW_err": relative_error(ws.grad, ref_dw),
            "nonfinite": int((~torch.isfinite(xs.grad)).sum() + (~torch.isfinite(ws.grad)).sum()),
            **provenance(device),
        })
        del xs, ws, loss
    return pd.DataFrame(rows)


def _outputs(spec, inputs) -> list[tuple[str, torch.Tensor]]:
    """One call of the ``kernels_lib`` provider and its backward: named loss and gradients."""
    fn = spec.providers["kernels_lib"].load()
    for tensor in inputs.grad_inputs:
        tensor.grad = None
    out = fn(*inputs.args, **inputs.kwargs)
    loss = out.loss if hasattr(out, "loss") else out
    loss.sum().backward()
    bound = inspect.signature(fn).bind(*inputs.args, **inputs.kwargs).arguments
    name_of = {id(t): name for name, t in bound.items() if isinstance(t, torch.Tensor)}
    return [("loss", loss.detach().clone())] + [(f"d{name_of[id(t)]}", t.grad.clone()) for t in inputs.grad_inputs]


def determinism(size: str, device: torch.device, runs: int = 3) -> pd.DataFrame:
    """Every loss at its largest published (or small) size, ``runs`` times: bitwise equal to run 1?"""
    rows = []
    for kernel_name in registered_losses():
        spec = get_spec(kernel_name)
        preset = spec.published if size == "full" else spec.small
        sizes = {preset["x_name"]: preset["x_values"][-1], **preset["sizes"]}
        options = {**spec.default_options, "input_grad": True} if "input_grad" in spec.default_options else spec.default_options
        inputs = spec.make_inputs(sizes, preset["dtype"], device, options, 0)
        first = _outputs(spec, inputs)
        diffs = {name: 0.0 for name, _ in first}
        equal = {name: True for name, _ in first}
        for _ in range(runs - 1):
            for (name, a), (_, b) in zip(first, _outputs(spec, inputs)):
                equal[name] &= bool(torch.equal(a, b))
                diffs[name] = max(diffs[name], (a.double() - b.double()).abs().max().item())
        for name, tensor in first:
            rows.append({"kernel_name": kernel_name, "sizes": str(sizes), "dtype": str(preset["dtype"]).removeprefix("torch."),
                         "output": name, "numel": tensor.numel(), "runs": runs, "bitwise_equal": equal[name],
                         "max_abs_diff": diffs[name], **provenance(device)})
        del inputs, first
    return pd.DataFrame(rows)


PARTS = {"flce_large": (flce_large, "flce_32768_check.csv"), "determinism": (determinism, "determinism.csv")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=tuple(SIZES), default="full")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, among {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    unknown = [p for p in args.parts.split(",") if p not in PARTS]
    if unknown:
        parser.error(f"--parts must be among {', '.join(PARTS)}; got {', '.join(unknown)}")
    device = kernels_lib.default_device()
    if args.size == "full" and device.type != "cuda":
        parser.error("--size full needs a CUDA device (use --size small for a dry run)")
    args.out.mkdir(parents=True, exist_ok=True)
    for part in args.parts.split(","):
        run, file_name = PARTS[part]
        table = run(args.size, device)
        table.to_csv(args.out / file_name, index=False)
        print(table.drop(columns=list(provenance(device))).to_string(index=False), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
