"""Does the two-head stage with per-lane sums (``studies/kernels/distill_chunk_lanes.py``) beat the library's stage?

One run, one GPU, the copy and matmul ceilings measured first. Two parts:

- ``stage``: the stage alone on one default chunk of the published workload (``--rows`` rows, V = 128256, bf16
  student and teacher, targets, the hard loss, ``dz`` written), the JSD (β = ½, T = 1) and the cosine, for the
  library's stage and every arm of :data:`STAGE_ARMS` (the dials and ``block_v`` × ``num_warps``), in ``--rounds``
  rounds of alternating order: the median time with p20/p80, the time in passes over one head's logits at the
  run's copy bandwidth (the stage's own bytes are 7 passes for the JSD, 5 for the cosine), and each output's
  relative error against the library's stage on the same chunk;
- ``loss``: ``full`` (forward and backward) of the three two-head losses at the published BT (``--points ends``
  or ``all``) with the library's stage and with each arm of ``--loss-arms`` set in its place (as
  ``studies.bench.arms.constants_set`` sets a module constant), time and memory, in rounds of alternating order.

Writes ``distill_chunk_ab_stage.csv``, ``distill_chunk_ab_loss.csv`` and ``ceilings.csv`` under ``--out``
(append them to ``data/measured/gpu_runs/`` and ``data/measured/ceilings.csv``); every row carries the GPU, the
versions and the commit. On a GPU, about a minute for the stage and two for the losses at their ends.

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.distill_chunk_ab --out OUT [--parts stage,loss]

``--size small`` runs both parts at CPU sizes through Triton's interpreter (a smoke test; times mean nothing).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

import kernels_lib  # noqa: F401  (before triton: the interpreter on a CPU)
from kernels_lib.kernels.distill_chunk import SOFT_COSINE, SOFT_JSD, launch_distill_chunk
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.registry import get_spec
from kernels_workbench.bench.timing import mode_callable, peak_memory_mib, time_callable
from kernels_workbench.check import relative_error
from studies.bench.arms import constants_set
from studies.bench.timing import run_ceilings
from studies.kernels.distill_chunk_lanes import launcher

LIBRARY = "library"
_NO = dict(lane_sums=False, lane_lse=False, few_exp=False, fast_log=False)
_FAST = dict(_NO, few_exp=True, fast_log=True)
_DIALS = {"plain": _NO, "few_exp": dict(_NO, few_exp=True), "fast_log": dict(_NO, fast_log=True),
          "few_exp+fast_log": _FAST, "lanes+few_exp": dict(_NO, lane_sums=True, few_exp=True),
          "lanes+few_exp+fast_log": dict(_FAST, lane_sums=True),
          "lanes+lane_lse+few_exp+fast_log": dict(_FAST, lane_sums=True, lane_lse=True)}
#: arm name -> the stage's dials. ``plain`` is the mixture's two-exponential ``tl.log`` form; the library's stage is
#: ``few_exp`` on a CPU and ``few_exp+fast_log`` on CUDA, at its loop step and warps. The tile arms take
#: ``few_exp+fast_log`` (with or without per-lane sums) at other loop steps and warp counts.
STAGE_ARMS = {**_DIALS,
              **{f"few_exp+fast_log bv{bv} w{w}": dict(_FAST, block_v=bv, num_warps=w)
                 for bv, w in ((2048, 4), (2048, 8), (4096, 8), (8192, 16))},
              **{f"lanes+few_exp+fast_log bv{bv} w{w}": dict(_FAST, lane_sums=True, block_v=bv, num_warps=w)
                 for bv, w in ((2048, 4), (8192, 16))}}
#: the arms of the CPU's smoke run: fast_log is inline PTX, which the interpreter cannot run.
CPU_ARMS = [arm for arm, dials in STAGE_ARMS.items() if not dials["fast_log"]]
LOSSES = ("distill_jsd_loss", "distill_cosine_loss", "fused_linear_jsd")
SOFTS = {"jsd": (SOFT_JSD, 0.5), "cosine": (SOFT_COSINE, 0.5)}


def _stage_for(arm: str):
    if arm == LIBRARY:
        return launch_distill_chunk
    return launcher(**STAGE_ARMS[arm])


def _chunk(rows: int, vocab: int, device: torch.device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    student = torch.randn(rows, vocab, generator=gen).to(device, torch.bfloat16)
    teacher = torch.randn(rows, vocab, generator=gen).to(device, torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    return student, teacher, target


def _outputs(rows: int, device: torch.device):
    """The stage's outputs and gradient factors, made once per timed arm: nothing is allocated or copied from the
    host inside a timed call (a copy from the host would make it wait for the GPU and time the launch)."""
    return (torch.empty(rows, device=device), torch.empty(rows, device=device),
            torch.full((2,), 0.5 / rows, device=device))


def _run_stage(launch, student, teacher, target, soft_kind, beta, outputs=None):
    soft, hard, factors = outputs or _outputs(student.shape[0], student.device)
    launch(student, teacher, target, soft=soft, hard=hard, factors=factors, soft_kind=soft_kind, beta=beta,
           temperature=1.0, ignore_index=-100)
    return soft, hard, student


def stage_rows(arms: list[str], rows: int, vocab: int, device: torch.device, rounds: int, copy_gbps: float) -> list[dict]:
    """One row per round, soft loss and arm: the stage's time on one chunk, in passes, and its errors."""
    student, teacher, target = _chunk(rows, vocab, device)
    one_pass = rows * vocab * student.element_size()
    out = []
    for soft_name, (soft_kind, beta) in SOFTS.items():
        want = _run_stage(launch_distill_chunk, student.clone(), teacher, target, soft_kind, beta)
        errors = {}
        for arm in arms:
            got = _run_stage(_stage_for(arm), student.clone(), teacher, target, soft_kind, beta)
            errors[arm] = {f"{name} error": relative_error(g.float(), w.float())
                           for name, g, w in zip(("soft", "hard", "dz"), got, want)}
        for round_ in range(1, rounds + 1):
            for arm in (arms if round_ % 2 else arms[::-1]):
                buffer = student.clone()  # overwritten with dz by each call: the same work every call
                launch, outputs = _stage_for(arm), _outputs(rows, device)
                timing = time_callable(lambda: _run_stage(launch, buffer, teacher, target, soft_kind, beta, outputs), device)
                row = {"part": "stage", "soft": soft_name, "arm": arm, "round": round_, "rows": rows, "V": vocab,
                       "ms": timing.p50, "ms_p20": timing.p20, "ms_p80": timing.p80,
                       "passes": timing.p50 * 1e-3 * copy_gbps * 1e9 / one_pass if copy_gbps == copy_gbps else float("nan"),
                       **errors[arm]}
                out.append(row)
                print(f"stage {soft_name} {arm} round {round_}: {timing.p50:.3f} ms, {row['passes']:.1f} passes", flush=True)
    return out


def loss_rows(arms: list[str], points: str, size: str, device: torch.device, rounds: int) -> list[dict]:
    """One row per round, loss, BT and arm: ``full``'s time (median, p20, p80) and memory with that stage."""
    out = []
    for name in LOSSES:
        spec = get_spec(name)
        workload = spec.preset(size)
        loss = spec.providers["kernels_lib"].load()
        xs = list(workload["x_values"])
        for bt in (xs if points == "all" else sorted({xs[0], xs[-1]})):
            sizes = dict(workload["sizes"], **{workload["x_name"]: bt})
            inputs = spec.make_inputs(sizes, workload["dtype"], device, dict(spec.default_options), 0)
            full = mode_callable(lambda: loss(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full")
            for round_ in range(1, rounds + 1):
                for arm in (arms if round_ % 2 else arms[::-1]):
                    with constants_set({"kernels_lib._distillation": {"launch_distill_chunk": _stage_for(arm)}}):
                        timing = time_callable(full, device, grad_to_none=inputs.grad_inputs)
                        mib = peak_memory_mib(full, device, inputs.grad_inputs)
                    out.append({"part": "loss", "loss": name, "arm": arm, "round": round_, "x_name": workload["x_name"],
                                "BT": bt, "full_ms": timing.p50, "full_ms_p20": timing.p20, "full_ms_p80": timing.p80,
                                "full_MiB": mib})
                    print(f"{name} BT={bt} {arm} round {round_}: {timing.p50:.3f} ms", flush=True)
            inputs = full = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="stage,loss")
    parser.add_argument("--size", choices=["published", "small"], default="published")
    parser.add_argument("--rows", type=int, default=2048, help="rows of the stage's chunk (the losses' default chunk)")
    parser.add_argument("--stage-arms", default=None, help="comma-separated arms of STAGE_ARMS (default: all that run here)")
    parser.add_argument("--loss-arms", default=None,
                        help="default: plain,few_exp+fast_log bv2048 w4,few_exp+fast_log bv8192 w16 (on a CPU: plain)")
    parser.add_argument("--points", choices=("ends", "all"), default="ends")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    args.stage_arms = args.stage_arms or ",".join(STAGE_ARMS if gpu else CPU_ARMS)
    args.loss_arms = args.loss_arms or ("plain,few_exp+fast_log bv2048 w4,few_exp+fast_log bv8192 w16" if gpu else "plain")
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"stage", "loss"}) + sorted(
        a for a in args.stage_arms.split(",") + args.loss_arms.split(",") if a and a not in STAGE_ARMS)
    if unknown:
        parser.error(f"unknown part or arm: {', '.join(unknown)} (arms: {', '.join(STAGE_ARMS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    copy_gbps = run_ceilings(device, args.out).get("copy", float("nan"))
    stamp = provenance(device)
    small = args.size == "small"
    if "stage" in parts:
        rows, vocab = (8, 300) if small else (args.rows, 128256)
        table = pd.DataFrame(stage_rows([LIBRARY, *args.stage_arms.split(",")], rows, vocab, device, args.rounds,
                                        copy_gbps)).assign(**stamp)
        table.to_csv(args.out / "distill_chunk_ab_stage.csv", index=False)
    if "loss" in parts:
        arms = [LIBRARY, *[a for a in args.loss_arms.split(",") if a]]
        table = pd.DataFrame(loss_rows(arms, args.points, args.size, device, args.rounds)).assign(**stamp)
        table.to_csv(args.out / "distill_chunk_ab_loss.csv", index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
