"""Tuning the two stages of a fused linear CE chunk on the epilogue route, at the published size.

A chunk of the default (plain ``mean``/``sum`` with a gradient, Hopper) is: the logits GEMM with the
log-sum-exp in its epilogue (:func:`kernels_lib.kernels.logits_logsumexp.launch_logits_logsumexp`
with ``logits_out``), then the CE kernel's pass 2 alone, which overwrites the logits with ``dz``
(:func:`kernels_lib.kernels.cross_entropy_chunk.launch_cross_entropy_chunk`, lse given). Per chunk of
4096 rows (H = 4096, V = 128256, bf16) this measures, with ``do_bench`` medians:

* ``pass2``: the kernel's pass 2 at each loop step ``BLOCK_V`` and warp count, beside an in-place
  ``mul_`` of the same buffer (one read and one write of the same bytes: the floor it streams
  against);
* ``gemm``: the epilogue GEMM at Hopper tile configs beyond those of ``CONFIGS`` (group size, a
  narrower tile with more stages), beside cuBLAS's logits matmul into the same buffer (the run of
  fffe646 also tried the tile stored by TMA in two column halves, a flag not kept: no faster);
* ``full``: the default fused linear CE's ``full`` at N = 4096, 8192, 16384 (the published workload)
  with the fastest of those GEMM configs in place of :data:`TMA_LOGITS_OUT_CONFIG`, against the
  default config, in two rounds of alternating order (rows named ``full N=…``).

On the GPU machine: ``KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.flce_chunk_tuning --out $OUT``
(about two minutes); writes ``gpu_runs/fused_linear_cross_entropy_chunk_tuning.csv`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

import kernels_lib  # noqa: F401  (before triton)
import triton.testing
from kernels_lib.kernels import cross_entropy_chunk, logits_logsumexp
from kernels_lib.kernels.logits_logsumexp import TMA_LOGITS_OUT_CONFIG, launch_logits_logsumexp
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.registry import get_spec
from kernels_workbench.bench.timing import mode_callable

ROWS, HIDDEN, VOCAB = 4096, 4096, 128256
PASS2 = [(block, warps) for block in (2048, 4096, 8192) for warps in (4, 8, 16)]
GEMM = [
    TMA_LOGITS_OUT_CONFIG,
    dict(TMA_LOGITS_OUT_CONFIG, GROUP_M=32),
    dict(TMA_LOGITS_OUT_CONFIG, GROUP_M=4),
    dict(TMA_LOGITS_OUT_CONFIG, BLOCK_N=128, num_stages=4),
    dict(TMA_LOGITS_OUT_CONFIG, BLOCK_N=128, num_stages=5),
    dict(TMA_LOGITS_OUT_CONFIG, BLOCK_M=256, BLOCK_N=128, num_stages=3),
]
FULL_ROWS = (4096, 8192, 16384)


def median_ms(fn) -> tuple[float, float, float]:
    return tuple(float(t) for t in triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(ROWS, HIDDEN, generator=gen, device=device) * 0.5).to(torch.bfloat16)
    w = (torch.randn(VOCAB, HIDDEN, generator=gen, device=device) * 0.02).to(torch.bfloat16)
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen, device=device)
    buffer = torch.empty(ROWS, VOCAB, dtype=torch.bfloat16, device=device)
    rows = []
    path = args.out / "gpu_runs/fused_linear_cross_entropy_chunk_tuning.csv"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after each stage: what was measured survives a later failure
        pd.DataFrame(rows).assign(rows=ROWS, H=HIDDEN, V=VOCAB, **provenance(device)).to_csv(path, index=False)

    def record(stage, variant, timing, moved=None, flops=None):
        p50, p20, p80 = timing
        rows.append({"stage": stage, "variant": variant, "ms": p50, "ms_20": p20, "ms_80": p80,
                     "TB/s": None if moved is None else moved / p50 / 1e9,
                     "TFLOP/s": None if flops is None else flops / p50 / 1e9})
        print(rows[-1], flush=True)

    flops = 2 * ROWS * HIDDEN * VOCAB
    record("gemm", "cuBLAS logits matmul", median_ms(lambda: torch.matmul(x, w.t(), out=buffer)), flops=flops)
    for config in GEMM:
        try:
            timing = median_ms(lambda: launch_logits_logsumexp(x, w, None, target, alpha=1.0, ignore_index=-100,
                                                               config=config, logits_out=buffer))
            record("gemm", str(config), timing, flops=flops)
        except Exception as error:  # a config the compiler or the shared memory refuses: named, not fatal
            rows.append({"stage": "gemm", "variant": str(config), "error": f"{type(error).__name__}: {str(error)[:120]}"})
            print(rows[-1], flush=True)

    save()
    gemm_times = {r["variant"]: r["ms"] for r in rows if r["stage"] == "gemm" and "ms" in r and r["ms"] == r["ms"]}
    fastest = min((c for c in GEMM if str(c) in gemm_times), key=lambda c: gemm_times[str(c)])
    lse, _ = launch_logits_logsumexp(x, w, None, target, alpha=1.0, ignore_index=-100, logits_out=buffer)
    scale = torch.full((1,), 1.0 / ROWS, device=device)
    moved = 2 * buffer.numel() * buffer.element_size()
    record("pass2", "in-place mul_ (floor)", median_ms(lambda: buffer.mul_(1.0)), moved=moved)
    for block, warps in PASS2:
        cross_entropy_chunk.MAX_BLOCK_V, cross_entropy_chunk.NUM_WARPS = block, warps
        timing = median_ms(lambda: cross_entropy_chunk.launch_cross_entropy_chunk(
            buffer, target, lse=lse, loss=None, z_loss=None, grad_scale=scale, ignore_index=-100,
            label_smoothing=0.0, z_loss_scale=0.0, softcap=None))
        record("pass2", f"BLOCK_V={block} num_warps={warps}", timing, moved=moved)
    cross_entropy_chunk.MAX_BLOCK_V, cross_entropy_chunk.NUM_WARPS = 4096, 8
    del buffer, lse
    save()

    spec = get_spec("fused_linear_cross_entropy")
    provider = spec.providers["kernels_lib"].load()
    candidates = {"default config": TMA_LOGITS_OUT_CONFIG, f"fastest GEMM config {fastest}": fastest}
    for n in FULL_ROWS:
        inputs = spec.make_inputs({"BT": n, "H": HIDDEN, "V": VOCAB}, torch.bfloat16, device, dict(spec.default_options))
        full = mode_callable(lambda: provider(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full")
        for round_ in range(2):
            names = list(candidates) if round_ == 0 else list(reversed(candidates))
            for name in names:
                logits_logsumexp.TMA_LOGITS_OUT_CONFIG = candidates[name]
                p50, p20, p80 = triton.testing.do_bench(full, quantiles=[0.5, 0.2, 0.8], grad_to_none=inputs.grad_inputs)
                record(f"full N={n}", f"{name} (round {round_ + 1})", (float(p50), float(p20), float(p80)))
        logits_logsumexp.TMA_LOGITS_OUT_CONFIG = TMA_LOGITS_OUT_CONFIG
        del inputs, full
        torch.cuda.empty_cache()
        save()
    print(f"{len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
