"""One GPU run (any CUDA GPU) for the preference losses: the published ORPO and KTO sweeps, all providers.

On the GPU machine, from the repository root (Liger comes as a wheel in ``.whl/``):

    pip install -q --no-deps --no-index --target /tmp/site .whl/liger_kernel-*.whl
    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=/tmp/site:$PWD python3 scripts/preference_sweeps.py --out $OUT

Parts, each the CLI sweep of one published workload (``kernels_lib.workbench.bench.cli``) with providers
kernels_lib, huggingface and liger, modes ``forward`` and ``full``, speed and memory:

- ``orpo``: ``fused_linear_orpo_loss``, B ∈ {2, 4, 8, 16} (chosen + rejected rows), T = 1024,
  H = 4096, V = 128256, bf16; rows appended to ``data/measured/fused_linear_orpo_loss.csv``;
- ``kto``: ``kto_loss``, B ∈ {2, 4, 8, 16, 32}, T = 512, H = 1024, V = 128256, bf16, bias, reference
  model; rows appended to ``data/measured/kto_loss.csv``.

Each sweep measures the copy and matmul ceilings too (appended to ``data/measured/ceilings.csv``).
After each part its CSV and the ceilings are copied to ``--out`` (copy them into ``data/measured/``
and commit). A provider that fails at a point (Liger's KTO under torch.compile with torch 2.11)
leaves a NaN row whose note names the error; a failing part is reported and the other still runs;
the exit code is 1 if any failed.

Estimated duration on an H200: ORPO 4 B × 3 providers × 2 modes = 24 points; the baseline's
``full`` at B = 16 is ~0.12 s a call, do_bench's ~100 ms of repeats plus memory make ~1–3 s a
point, and Liger's torch.compile adds ~20–40 s of compilation per new shape: ~2–3 min. KTO 5 × 3 × 2
= 30 points at a quarter of ORPO's FLOPs: ~1–2 min (less if Liger fails at once). Ceilings ~5 s
twice. About 4–6 minutes in all, inside one 8-minute call.

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

from kernels_lib.workbench import data
from kernels_lib.workbench.bench import cli
from kernels_lib.workbench.bench import fused_linear_kto as kto
from kernels_lib.workbench.bench import fused_linear_orpo as orpo

PARTS = {"orpo": orpo.KERNEL_NAME, "kto": kto.KERNEL_NAME}
MODES = "forward,full"


def sweep(kernel_name: str, size: str, out: Path) -> None:
    """The published workload of ``kernel_name`` through the CLI, all providers (a dry run at small
    size); at full size, copies its measured CSV and the ceilings to ``out``."""
    preset = "published" if size == "full" else "small"
    argv = [kernel_name, "--preset", preset, "--modes", MODES, "--providers", "kernels_lib,huggingface,liger"]
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
    parser.add_argument("--parts", default="orpo,kto", help=f"comma-separated, among {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    unknown = [p for p in args.parts.split(",") if p not in PARTS]
    if unknown:
        parser.error(f"--parts must be among {', '.join(PARTS)}; got {', '.join(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for part in args.parts.split(","):
        start = time.perf_counter()
        try:
            sweep(PARTS[part], args.size, args.out)
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
