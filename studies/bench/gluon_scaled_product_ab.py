r"""The A/B of the stored exponentials' ``dx``: the Gluon kernel against the cuBLAS path it would replace.

:func:`scaled_product_ab` times, per chunk of ``C`` rows, three ways to form
:math:`\mathrm{out} = \mathrm{diag}(u g)\,(\tilde E W)` (``C × V`` times ``V × H``, rounded once):

- **baseline**: :func:`kernels_lib.chunks.matmuls.scaled_product_into`, the chunked route's path today:
  cuBLAS's float32 product, ``DX_BLOCK_ROWS`` rows at a time (recorded in the ``dx_block_rows``
  column: it has been 1024 and 2048), then a Triton kernel scaling the rows and rounding;
- **cuBLAS bare**: ``torch.mm(E, W, out=)`` into a buffer of the input dtype, no factors: the floor, what
  the same FLOPs cost in the vendor's GEMM with nothing around it;
- **gluon**: :func:`studies.kernels.gluon_scaled_product.launch_scaled_product` at its default and
  at each of its ``VARIANTS``.

In alternating rounds (the order reversed every other round: the GPU's drift over a run spreads over
every candidate), each timed with :func:`~kernels_workbench.bench.timing.time_callable` (do_bench's
p50/p20/p80 on CUDA, L2 flushed); a row is the median over rounds of each quantile, with TFLOP/s
(:math:`2 C V H` over the median) and the relative error against float64 from the same rounded inputs
(the bare product's against :math:`\tilde E W` without the factors). A candidate that fails to compile
or run is a row with its error, and the others still run; where Gluon cannot run (a CPU, the
interpreter) its rows say why. On CPU it runs at tiny sizes (CI: ``chunks=(8,), H=48, V=263``).
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from kernels_lib.chunks import matmuls
from studies.kernels import gluon_scaled_product as gluon_product
from kernels_workbench.check import relative_error
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.timing import time_callable

BASELINE = "baseline scaled_product_into"
CUBLAS = "cuBLAS bare torch.mm (no factors)"


def gluon_name(config: dict) -> str:
    """A Gluon candidate's name: ``gluon default`` or ``gluon`` and the keys it moves from the default."""
    moved = {k: v for k, v in config.items() if gluon_product.DEFAULT_CONFIG.get(k) != v}
    return "gluon default" if not moved else "gluon " + " ".join(f"{k}={v}" for k, v in moved.items())


def make_operands(n_rows: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """``(e, w, factors, scale)`` as the chunked route has them: ``e`` softmax-like (``exp(z - max z)``,
    in (0, 1], one 1 a row), ``w`` ~ ``N(0, 1/H)``, float32 factors of both signs (a few zero), a float32
    scale on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e = torch.empty(n_rows, vocab, dtype=dtype, device=device)
    for start in range(0, n_rows, 512):  # float32 logits a block of rows at a time
        z = 2.0 * torch.randn(min(512, n_rows - start), vocab, generator=gen, device=device)
        e[start : start + z.shape[0]] = torch.exp(z - z.amax(dim=1, keepdim=True)).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, device=device) * hidden**-0.5).to(dtype)
    factors = torch.randn(n_rows, generator=gen, device=device)
    factors[3::7] = 0.0
    scale = torch.tensor(0.37, dtype=torch.float32, device=device)
    return e, w, factors, scale


def float64_references(e: torch.Tensor, w: torch.Tensor, factors: torch.Tensor, scale: torch.Tensor,
                       block: int = 1024):
    """``(E W, diag(u g) E W)`` in float64 from the very (rounded) inputs, a block of rows at a time."""
    w64 = w.double()
    product = torch.empty(e.shape[0], w.shape[1], dtype=torch.float64, device=e.device)
    for start in range(0, e.shape[0], block):
        product[start : start + block] = e[start : start + block].double() @ w64
    del w64
    scaled = product * (factors.double() * scale.double())[:, None]
    return product, scaled


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def scaled_product_ab(chunks=(1024, 2048, 4096), H: int = 4096, V: int = 128256, dtype: torch.dtype = torch.bfloat16,
                      device: torch.device | str | None = None, rounds: int = 3) -> pd.DataFrame:
    """One row per (``C``, candidate): ``ms_50``, ``ms_20``, ``ms_80`` (medians over ``rounds`` rounds),
    ``TFLOP/s``, ``rel_err`` against float64, ``error`` (a failure or why a candidate was skipped),
    ``dx_block_rows`` (the baseline's block), ``config`` (a Gluon candidate's full config), and the
    columns of :func:`~kernels_workbench.bench.environment.provenance`."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for n_rows in chunks:
        e, w, factors, scale = make_operands(n_rows, H, V, dtype, device, seed=n_rows)
        ref_product, ref = float64_references(e, w, factors, scale)
        base = dict(C=n_rows, H=H, V=V, dtype=str(dtype).replace("torch.", ""), dx_block_rows=matmuls.DX_BLOCK_ROWS)
        outputs = {}  # candidate -> (its output buffer, the call, its reference)
        failed: dict[str, tuple[str, dict | None]] = {}
        baseline_out = torch.empty(n_rows, H, dtype=dtype, device=device)
        outputs[BASELINE] = (baseline_out, lambda: matmuls.scaled_product_into(baseline_out, e, w, factors, scale),
                             ref, None)
        cublas_out = torch.empty(n_rows, H, dtype=dtype, device=device)
        outputs[CUBLAS] = (cublas_out, lambda: torch.mm(e, w, out=cublas_out), ref_product, None)
        reason = gluon_product.gluon_unsupported_reason(e, w, baseline_out)
        for config in gluon_product.CONFIGS:
            name = gluon_name(config)
            if reason is not None:
                failed[name] = (f"skipped: {reason}", config)
                continue
            out = torch.empty(n_rows, H, dtype=dtype, device=device)
            outputs[name] = (out, lambda out=out, config=config: gluon_product.launch_scaled_product(
                out, e, w, factors, scale, config=config), ref, config)
        errors = {}
        for name, (out, call, reference, config) in list(outputs.items()):
            try:
                print(f"scaled_product_ab C={n_rows}: {name}", flush=True)  # where a hang or a crash happened
                out.fill_(float("nan"))  # an element left unwritten shows as NaN in the error
                call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                errors[name] = relative_error(out, reference)
            except Exception as error:  # a candidate that does not compile or run here is a recorded failure
                failed[name] = (_error_text(error), config)
                del outputs[name]
        per_round = []
        names = list(outputs)
        for round_ in range(rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                if name in failed:
                    continue
                try:
                    timing = time_callable(outputs[name][1], device)
                except Exception as error:
                    failed[name] = (_error_text(error), outputs[name][3])
                    continue
                per_round.append(dict(candidate=name, ms_50=timing.p50, ms_20=timing.p20, ms_80=timing.p80,
                                      timer=timing.timer))
        measured = pd.DataFrame(per_round, columns=["candidate", "ms_50", "ms_20", "ms_80", "timer"])
        flops = 2.0 * n_rows * V * H
        for name in names:
            if name in failed:
                continue
            mine = measured[measured["candidate"] == name]
            p50 = float(mine["ms_50"].median())
            config = outputs[name][3]
            rows.append(dict(base, candidate=name, ms_50=p50, ms_20=float(mine["ms_20"].median()),
                             ms_80=float(mine["ms_80"].median()), **{"TFLOP/s": flops / (p50 * 1e-3) / 1e12},
                             rel_err=errors.get(name, math.nan), rounds=len(mine), timer=mine["timer"].iloc[0],
                             config=str(config) if config is not None else "", error=""))
        rows.extend(dict(base, candidate=name, config=str(config) if config is not None else "", error=why)
                    for name, (why, config) in failed.items())
        del e, w, ref, ref_product, outputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return pd.DataFrame(rows).assign(**provenance(device))


if __name__ == "__main__":  # python -m studies.bench.gluon_scaled_product_ab [out.csv]
    import sys

    table = scaled_product_ab()
    if len(sys.argv) > 1:
        table.to_csv(sys.argv[1], index=False)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table[["C", "candidate", "ms_50", "ms_20", "ms_80", "TFLOP/s", "rel_err", "error"]].to_string())
