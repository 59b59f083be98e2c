"""One GPU run (any CUDA GPU) of the published workloads, every provider that runs there.

On the GPU machine, from the repository root (Liger and TRL come as wheels in ``.whl/``):

    pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl
    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=/tmp/site:$PWD python3 scripts/published_sweeps.py --parts orpo,kto --out $OUT

Each part is the CLI sweep of one published chart (``kernels_workbench.bench.cli``), modes
``forward`` and ``full``, speed and memory, with every provider of the loss's spec that loads
(kernels_lib, the baseline, Liger, and TRL's fused-head path where the spec has it), its rows appended
to ``data/measured/<kernel_name>.csv``:

- ``orpo``, ``kto``: ``fused_linear_orpo_loss`` (B = 2 … 16, T = 1024, H = 4096, V = 128256, bf16) and
  ``kto_loss`` (B = 2 … 32, T = 512, H = 1024, bias, reference model); ``orpo_t4096``: the ORPO
  chart's second sequence length, T = 4096 (the baseline's fp32 logits are 34 GB at B = 16);
- ``dpo``, ``cpo``, ``simpo``, ``grpo_token``, ``grpo_sequence``: the preference charts (B = 2 … 16 at
  T = 1024, H = 4096, V = 128256, bf16; DPO and GRPO with a reference model);
- ``jsd``, ``jsd_tokens``, ``tvd``: the logits-level divergences (V = 4096 … 131072 at 8192 or 16384
  rows, fp32; JSD's token sweep at V = 128256);
- ``fused_linear_jsd``, ``distill_jsd``, ``distill_cosine``: the fused student-teacher losses
  (BT = 1024 … 8192, H = 4096, V = 128256, bf16; TRL's ``ChunkedDivergenceFunction`` beside
  fused linear JSD).
- ``cross_entropy``, ``megatron_ce``: the logits-level cross-entropy charts at TP = 1 on one GPU
  (V = 4096 … 131072; B·T = 8 × 2048 fp32 ``mean``, and S·B = 2048 × 4 bf16 ``sum``): kernels_lib, torch,
  Liger (the Megatron providers and TP = 2 are ``scripts/tensor_parallel_bench.py``'s, on two GPUs).

Each sweep measures the copy and matmul ceilings too (appended to ``data/measured/ceilings.csv``).
After each part its CSV and the ceilings are copied to ``--out`` (copy them into ``data/measured/``
and commit). A provider that fails at a point leaves a NaN row whose note names the error; a failing
part is reported and the others still run; the exit code is 1 if any failed.

Duration on an H200: a preference chart at 4 B × 4 providers × 2 modes is ~2–3 min (Liger's
``torch.compile`` adds ~20–40 s per new shape); KTO ~1–2 min; a divergence chart ~1 min. Parts
longer than one 10-minute call run in the background (``setsid``) and are waited for by later calls.

``--size small`` runs the same sweeps at the CPU presets (Triton's interpreter) as dry runs:
nothing appended or copied; the tests use it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
import traceback
from pathlib import Path

from kernels_workbench import data
from kernels_workbench.bench import cli

#: part -> (kernel_name, preset at full size); the CPU dry run uses each loss's ``small`` preset.
PARTS = {
    "orpo": ("fused_linear_orpo_loss", "published"),
    "orpo_t4096": ("fused_linear_orpo_loss", "published_t4096"),
    "kto": ("kto_loss", "published"),
    "dpo": ("fused_linear_dpo_loss", "published"),
    "cpo": ("fused_linear_cpo_loss", "published"),
    "simpo": ("fused_linear_simpo_loss", "published"),
    "grpo_token": ("fused_linear_grpo_loss_token", "published"),
    "grpo_sequence": ("fused_linear_grpo_loss_sequence", "published"),
    "jsd": ("jsd", "published"),
    "jsd_tokens": ("jsd", "published_tokens"),
    "tvd": ("tvd", "published"),
    "fused_linear_jsd": ("fused_linear_jsd", "published"),
    "distill_jsd": ("distill_jsd_loss", "published"),
    "distill_cosine": ("distill_cosine_loss", "published"),
    "cross_entropy": ("cross_entropy", "published"),
    "megatron_ce": ("megatron_cross_entropy", "published"),
}
MODES = "forward,full"


def sweep(kernel_name: str, preset: str, size: str, out: Path) -> None:
    """The ``preset`` workload of ``kernel_name`` through the CLI, every provider that loads (a dry
    run at the small preset); at full size, copies its measured CSV and the ceilings to ``out``."""
    preset = preset if size == "full" else "small"
    argv = [kernel_name, "--preset", preset, "--modes", MODES]
    code = cli.main(argv if size == "full" else argv + ["--dry-run"])
    if code:
        raise RuntimeError(f"the CLI sweep of {kernel_name} exited with {code}")
    if size == "full":
        for name in (kernel_name, "ceilings"):
            shutil.copy(data.measured_path(name), out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=("full", "small"), default="full")
    parser.add_argument("--parts", required=True, help=f"comma-separated, among {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    unknown = [p for p in args.parts.split(",") if p not in PARTS]
    if unknown:
        parser.error(f"--parts must be among {', '.join(PARTS)}; got {', '.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for part in args.parts.split(","):
        start = time.perf_counter()
        try:
            sweep(*PARTS[part], args.size, args.out)
        except Exception:  # report and go on: one part's failure must not lose the other
            traceback.print_exc()
            failed.append(part)
        finally:
            print(f"[{part}] {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
