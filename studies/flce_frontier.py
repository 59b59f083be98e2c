"""The speed-memory frontier of fused linear cross-entropy on one GPU: every peer and kernels_lib's dial.

On the GPU machine, from the repository root (the peers come as wheels in ``.whl/``; the CuTe DSL
peers need ``quack-kernels`` 0.6.4, ``nvidia-cutlass-dsl`` 4.6.2 with its ``-libs-base``, ``-libs-core``
and ``-libs-cu13``, ``apache-tvm-ffi`` and ``torch-c-dlpack-ext``):

    pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl
    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=/tmp/site:$PWD python -m studies.flce_frontier --out $OUT

The CuTe DSL's wheels (libs-base and libs-cu13 both fill the folder ``nvidia_cutlass_dsl/``, which ``pip
--target`` installs once, and its ``.pth`` file is not read from a ``PYTHONPATH`` folder) go into an
environment of their own (a virtual environment), or are unzipped into one folder ``D`` with
``D/nvidia_cutlass_dsl/dsl_packages`` and ``D`` on ``PYTHONPATH`` (what the ``.pth`` file adds).

Parts, each written under ``--out`` in the layout of ``data/measured/`` as soon as it is done (a
failing part is reported, the others still run, the exit code is 1 if any failed):

``frontier``: ``gpu_runs/fused_linear_cross_entropy_frontier.csv``. At the published sizes (N = 4096,
    8192, 16384, H = 4096, V = 128256, bf16), modes ``forward_no_grad`` and ``full`` (the peers and the
    default also ``forward``, the published chart's third panel), speed and
    memory: every peer that loads (torch, Liger, Liger's CuTe DSL kernel, QuACK, CCE), kernels_lib's
    default, and kernels_lib at each chunk size of ``SIZES[size]["chunks"]`` (``accurate=False``), each named
    ``kernels_lib[chunk_size=C accurate=False]``. One row per point, GPU, versions, commit. The peers
    and the default are measured in three rounds, the providers' order reversed every other
    round, and each row is the median over the rounds (each round's rows in
    ``gpu_runs/fused_linear_cross_entropy_frontier_rounds.csv``): the GPU drifts over a run (clocks,
    heat; a variant measured second once ran 15% slower than in a later round), and alternating
    rounds spread that drift over every provider.
``exponentials``: ``gpu_runs/fused_linear_cross_entropy_exponentials_ab.csv`` (each round's rows in
    ``..._exponentials_ab_rounds.csv``). The A/B of the shifted exponentials
    (:data:`kernels_lib.fused_linear_cross_entropy.STORE_EXPONENTIALS`): the ``frontier`` part's peers
    and default in the same alternating rounds, beside ``kernels_lib[store_exponentials=False]`` (the
    default with the logits stored and the kernel's pass 2), no dial.
``past_floor``: ``gpu_runs/fused_linear_cross_entropy_past_floor.csv`` (rounds in ``..._past_floor_rounds.csv``).
    The ``frontier`` part's peers, the floor's three matmuls among them, and the default in the same
    alternating rounds, no dial: issue 30's targets (torch's ``F.linear_cross_entropy`` on the H200's torch
    2.11 through ``KERNELS_LIB_TORCH_LCE_FILES``, :mod:`kernels_workbench.bench.torch_lce`).
``gluon``: ``gpu_runs/fused_linear_cross_entropy_gluon_ab.csv`` (rounds in ``..._gluon_ab_rounds.csv``).
    The log-sum-exp stage in Gluon (:mod:`studies.kernels.gluon_logits_logsumexp`) beside the tl.*
    one and cuBLAS's logits matmul, at each N, in alternating rounds, with their errors (:func:`gluon`).
``stages``: ``gpu_runs/fused_linear_cross_entropy_frontier_stages.csv``. At N = 8192, the time of
    each stage of a chunk (logits, kernel, dx, dW) times the chunks, for the chunk sizes of
    ``stage_chunks`` of :data:`SIZES` (:func:`studies.bench.flce_studies.stage_times`), on both
    routes (``route``): cuBLAS's logits and the kernel's two passes, or the logits and lse from the
    epilogue GEMM and the kernel's second pass; and that GEMM with ``logits_out`` alone at each Hopper
    config, the tile stored by each thread or by TMA.

``forward``: ``gpu_runs/fused_linear_cross_entropy_frontier_forward.csv``. The loss without a
    gradient needs each row's log-sum-exp and target logit only. At each N: the logits matmul alone
    (cuBLAS, into a bf16 buffer: the floor of the unfused path), kernels_lib's ``forward_no_grad``
    (its default path: for a plain ``mean``/``sum`` the epilogue kernel below), and :func:`kernels_lib.kernels.logits_logsumexp.logits_logsumexp`
    (the log-sum-exp in the epilogue of a Triton logits GEMM) at each of its ``CONFIGS``, with its
    lse's and target logit's relative errors against the float32 logits of the same inputs.

``default``: ``gpu_runs/fused_linear_cross_entropy_frontier_default.csv``. kernels_lib's default and
    the torch baseline alone (no wheels needed), ``forward_no_grad`` and ``full`` at each N: a later
    commit's default beside the same anchor as the ``frontier`` run.
``overhead``: ``gpu_runs/fused_linear_cross_entropy_frontier_overhead.csv``. Where ``full``'s time
    beyond its kernels goes, at N = 8192: the default, ``host_checks=False`` (no host sync at all;
    backward always multiplies by ``grad_output``), an explicit ``chunk_size`` (no free-memory query),
    both; per variant do_bench's median and the CPU time of one call's forward (the prologue the GPU
    may wait for), each variant measured twice (in order, then in reverse order: ``round``).
``profile``: ``gpu_runs/fused_linear_cross_entropy_frontier_profile.csv``. ``full`` under
    ``torch.profiler``, kernels_lib's default and QuACK's at N = 4096, 8192 and 16384 (the runs up to
    7d6b703: 4096 and 8192): per kernel, calls per step and CUDA ms per step (the stages as they run
    inside the pipeline, beside their isolated times in ``stages``), each row named by its
    ``kernel_provider``.
``class_major``: ``gpu_runs/fused_linear_cross_entropy_class_major_stages.csv``. At N = 4096 (the
    class-major route's chunk), each stage timed alone with its alternatives: the exponentials GEMM
    at Hopper configs around the default, ``dx`` in both operand orders, ``dW`` in slabs of several
    sizes (:func:`studies.bench.flce_studies.class_major_times`).
``timeline``: ``gpu_runs/fused_linear_cross_entropy_timeline.csv``. ``full`` at N = 4096, 8192 and 16384
    (the runs up to 5c132ed: 4096 alone), kernels_lib's default and QuACK's: do_bench's time beside the
    GPU's timeline of ten steps (span, the kernels' busy time, idle time and the largest gaps), to tell
    kernel time from a GPU left waiting, and the host's side of the same steps: its longest CUDA runtime
    calls (``host calls``: a synchronize there is the host waiting) and the lines where torch's sync
    debug mode sees one call wait for the GPU (``sync sites``).
``quack_ab``: ``gpu_runs/fused_linear_cross_entropy_quack_ab.csv`` (rounds in ``..._quack_ab_rounds.csv``).
    kernels_lib's default and QuACK alone, in the ``frontier`` part's alternating rounds at each N, no
    dial: a later commit against the fastest peer at a fraction of the frontier's time.
``quack_pairs``: ``gpu_runs/fused_linear_cross_entropy_quack_pairs.csv``. kernels_lib's default and QuACK,
    ``full`` and ``forward_no_grad`` at each N, timed in 30 adjacent pairs of single calls (the order
    alternating, L2 flushed before each): per provider the ms quantiles and the quantiles of its
    per-pair ratio to QuACK. A drift over the run moves both calls of a pair alike, so the ratio's
    spread is the GPU's noise at that point, not the run's; do_bench's median at N = 16384 rests on
    one or two calls (its 100 ms budget), the rounds' on three such medians.

``wide_class_major``: ``gpu_runs/fused_linear_cross_entropy_wide_class_major_ab.csv`` (rounds in
    ``..._wide_class_major_ab_rounds.csv``). The A/B of
    :mod:`studies.routes.wide_class_major`'s ``rows_per_hidden``: at the N of the chart
    with ``H < N ≤ 2H`` (8192), torch, QuACK, torch's ``F.linear_cross_entropy`` and the default (1: the
    chunked route, the gradients formed in forward) beside ``kernels_lib[class_major_rows_per_hidden=2]``
    (one class-major chunk of N rows, the gradients deferred to backward) in alternating rounds, no
    dial. The runs from 29f4f42 to 9e3752a, when the default was 2, had the arm at 1.
``row_major_dw``: ``gpu_runs/fused_linear_cross_entropy_row_major_dw.csv``. The chunked route's ``dx`` and
    ``dW`` for one chunk at the smallest N, each timed alone, ``dW`` in slabs of each size of ``slab_rows``
    (one matmul at ``S ≥ V``, the route's way), written and added to: whether the class-major route's
    slabs would help the chunked route's ``dW`` too (at 208350c: no).

``--size small`` runs the same code at CPU sizes (Triton's interpreter; the peers are skipped):
the tests use it.

Duration on an H200: about 90 points of 1–3 s plus the CuTe DSL peers' first compilations; the
parts are ordered so that the peers come first.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

import kernels_lib  # noqa: F401  (before triton: the interpreter on a CPU)
from kernels_lib.fused_linear_cross_entropy import default_chunk_size
from kernels_lib.kernels import logits_logsumexp as logits_lse
from studies.bench.arms import constants_set
from kernels_workbench.bench.ceilings import matmul_rate
from studies.bench import flce_studies
from kernels_workbench.bench import fused_linear_cross_entropy as flce
from kernels_workbench.bench.environment import provenance
from kernels_workbench.bench.sweep import available_providers, median_of_rounds, run_sweep
from kernels_workbench.bench.timing import mode_callable, time_callable
from studies.bench.timing import busy_timeline, paired_summary, paired_times, sync_sites
from kernels_workbench.check import relative_error
from studies.kernels import gluon_logits_logsumexp as gluon_stage
from studies.kernels.logits_logsumexp_configs import CANDIDATE_CONFIGS
from studies.routes import wide_class_major

SIZES = {
    "full": {"x_values": [4096, 8192, 16384], "H": 4096, "V": 128256, "chunks": [512, 1024, 2048, 3072, 4096, 8192],
             "stage_n": 8192, "stage_chunks": [2048, 4096], "rounds": 3, "profile_n": [4096, 8192, 16384],
             "timeline_n": [4096, 8192, 16384], "profile_providers": ["kernels_lib", "quack"],
             "slab_rows": [4096, 8192, 8448, 12288, 16384, 16896, 1 << 20],
             "pair_samples": 30},
    "small": {"x_values": [8, 16], "H": 48, "V": 263, "chunks": [4, 8], "stage_n": 16, "stage_chunks": [8],
              "rounds": 2, "profile_n": [16], "timeline_n": [16], "profile_providers": ["kernels_lib", "quack"], "slab_rows": [256, 1 << 20], "pair_samples": 2},
}
PEERS = ["torch", "liger", "liger_sm90", "quack", "cce", "torch_lce", "torch_lce[acc_policy=accurate]", flce.FLOOR]
MODES = ("forward_no_grad", "full")
DTYPE = torch.bfloat16
#: The module (its name is shadowed by the function on the package).
flce_module = importlib.import_module("kernels_lib.fused_linear_cross_entropy")
#: What each part writes under ``--out`` (the layout of ``data/measured/``; the notebooks read the same map).
FILES = flce_studies.FRONTIER_FILES


LOGITS_ARM = flce_studies.LOGITS_ARM
WIDE_ARM = flce_studies.WIDE_CLASS_MAJOR_ARM
DX_ARM = flce_studies.DX_BLOCK_ROWS_ARM
#: The A/B arms: kernels_lib's default with these module constants ({module: {constant: value}}) set for its calls.
ARMS = {LOGITS_ARM: {flce_module.__name__: {"STORE_EXPONENTIALS": False}},
        WIDE_ARM: wide_class_major.arm(rows_per_hidden=2),
        DX_ARM: {"kernels_lib.chunks.matmuls": {"DX_BLOCK_ROWS": flce_studies.DX_BLOCK_ROWS_BEFORE}}}


def _arm(name: str, **sweep) -> pd.DataFrame:
    """kernels_lib's default with the module constants of ``ARMS[name]`` set for its calls, put back after."""
    with constants_set(ARMS[name]):
        return run_sweep(flce.KERNEL_NAME, providers=["kernels_lib"], **sweep).assign(kernel_provider=name)


def frontier(size: dict, device: torch.device, rounds_path: Path | None = None, *, dial: bool = True,
             arms: tuple = (), peers=tuple(PEERS)) -> pd.DataFrame:
    """Every peer (of ``peers``), kernels_lib's default and (``dial``) each point of its dial, at each N of
    the chart. The peers and the default (and each of ``arms``, names in :data:`ARMS`) in ``size["rounds"]``
    rounds, the providers' order reversed every other round, one row per point the median over the
    rounds (each round's rows written to ``rounds_path``)."""
    common = dict(x_name="BT", x_values=size["x_values"], sizes={"H": size["H"], "V": size["V"]}, dtype=DTYPE,
                  device=device)
    main = list(peers) + ["kernels_lib"]
    rounds = []
    for number in range(1, size["rounds"] + 1):
        order = main if number % 2 else main[::-1]
        # The published chart's forward (with the gradient's work, where a provider does it there) too.
        sweep = dict(modes=("forward",) + MODES, **common)
        sweeps = [lambda: run_sweep(flce.KERNEL_NAME, providers=order, **sweep)]
        sweeps += [lambda name=name: _arm(name, **sweep) for name in arms]
        rows = pd.concat([run() for run in (sweeps if number % 2 else sweeps[::-1])], ignore_index=True)
        rounds.append(rows.assign(round=number))
        if rounds_path is not None:  # each round as soon as it is done: a run cut short keeps its rounds
            pd.concat(rounds, ignore_index=True).to_csv(rounds_path, index=False)
        print(f"frontier: round {number} of {size['rounds']} done", flush=True)
    rounds = pd.concat(rounds, ignore_index=True)
    if rounds_path is not None:
        rounds.to_csv(rounds_path, index=False)
    frames = [median_of_rounds(rounds)]
    common["modes"] = MODES
    for chunk in size["chunks"] if dial else ():
        options = {"chunk_size": chunk, "accurate": False}
        rows = run_sweep(flce.KERNEL_NAME, providers=["kernels_lib"], options=options, **common)
        frames.append(rows.assign(kernel_provider=flce.variant_name(options)))
    return pd.concat(frames, ignore_index=True)


def default(size: dict, device: torch.device) -> pd.DataFrame:
    """kernels_lib's default and the baseline at each N of the chart."""
    return run_sweep(flce.KERNEL_NAME, providers=["kernels_lib", "torch"], x_name="BT", x_values=size["x_values"],
                     sizes={"H": size["H"], "V": size["V"]}, dtype=DTYPE, device=device, modes=MODES)


def stages(size: dict, device: torch.device) -> pd.DataFrame:
    """Stage times of one chunk times the chunks, per chunk size, lean accumulation."""
    sizes = {"BT": size["stage_n"], "H": size["H"], "V": size["V"]}
    frames = [
        flce_studies.stage_times(sizes, DTYPE, device, chunk_size=chunk, accurate=False, epilogue=epilogue).assign(
            chunk_size=chunk, BT=sizes["BT"], H=sizes["H"], V=sizes["V"],
            route="epilogue GEMM" if epilogue else "cuBLAS logits")
        for chunk in size["stage_chunks"] for epilogue in (False, True)
    ]
    frames.append(_logits_out_configs(size, device))
    return pd.concat(frames, ignore_index=True).assign(**provenance(device))


def _logits_out_configs(size: dict, device: torch.device) -> pd.DataFrame:
    """The epilogue GEMM writing a chunk's logits (``logits_out``), per Hopper config: the tile stored by
    each thread (masked stores) or by TMA (``TMA_STORE``), at the largest stage chunk."""
    chunk, h, v = max(size["stage_chunks"]), size["H"], size["V"]
    generator = torch.Generator(device=device).manual_seed(0)
    x_c = torch.randn(chunk, h, generator=generator, device=device).to(DTYPE)
    w = (torch.randn(v, h, generator=generator, device=device) * h**-0.5).to(DTYPE)
    target = torch.randint(0, v, (chunk,), generator=generator, device=device)
    buffer = torch.empty(chunk, v, dtype=DTYPE, device=device)
    hopper = [c for c in CANDIDATE_CONFIGS if c.get("TMA") and not c.get("WARP_SPECIALIZE")]
    configs = [None] if device.type != "cuda" else hopper + [dict(c, TMA_STORE=True) for c in hopper]
    rows = []
    for config in configs:
        try:
            ms = time_callable(lambda: logits_lse.logits_logsumexp(x_c, w, target=target, config=config,
                                                                   logits_out=buffer), device).p50
            error = ""
        except Exception as failure:  # a config that does not compile here is a recorded failure
            ms, error = float("nan"), f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"
        rows.append({"route": "epilogue GEMM, logits_out configs", "chunk_size": chunk, "stage": f"logits and lse {config}",
                     "ms per chunk": ms, "chunks": 1, "ms": ms, "TFLOP/s": 2.0 * chunk * h * v / (ms * 1e-3) / 1e12,
                     "error": error, "BT": chunk, "H": h, "V": v})
        print(rows[-1], flush=True)
    return pd.DataFrame(rows)


def forward(size: dict, device: torch.device, progress=None) -> pd.DataFrame:
    """The no-grad forward's candidates at each N: cuBLAS logits alone, our chunked path, the epilogue kernel."""
    rows = []
    for n in size["x_values"]:
        inputs = flce.make_inputs({"BT": n, "H": size["H"], "V": size["V"]}, DTYPE, device, {})
        x, weight, target, _ = (t.detach() if isinstance(t, torch.Tensor) else t for t in inputs.args)
        exact = x.float() @ weight.float().t()  # the bf16 inputs' logits in float32
        ref_lse = torch.logsumexp(exact, -1)
        ref_target = exact.gather(1, target.clamp(min=0)[:, None])[:, 0].where(target >= 0, 0.0)
        del exact
        logits = torch.empty(n, size["V"], dtype=DTYPE, device=device)
        matmul_flops = 2.0 * n * size["H"] * size["V"]

        def record(candidate, fn, lse=None, target_logit=None):
            print(f"forward N={n}: {candidate}", flush=True)  # where a hang or a crash happened
            timing = time_callable(fn, device)
            rows.append({
                "BT": n, "H": size["H"], "V": size["V"], "candidate": candidate, "ms_50": timing.p50,
                "ms_20": timing.p20, "ms_80": timing.p80, "TFLOP/s": matmul_flops / (timing.p50 * 1e-3) / 1e12,
                "lse_rel_err": float("nan") if lse is None else relative_error(lse, ref_lse),
                "target_logit_rel_err": float("nan") if target_logit is None else relative_error(target_logit, ref_target),
            })

        record("cuBLAS logits matmul alone", lambda: torch.matmul(x, weight.t(), out=logits))
        with torch.no_grad():
            record("kernels_lib forward_no_grad (the default path)", lambda: kernels_lib.fused_linear_cross_entropy(x, weight, target))
        del logits
        for config in CANDIDATE_CONFIGS if device.type == "cuda" else [None]:
            try:
                lse, t = logits_lse.logits_logsumexp(x, weight, target=target, config=config)
                record(f"logits_logsumexp {config}", lambda: logits_lse.logits_logsumexp(x, weight, target=target, config=config), lse, t)
            except Exception as error:  # a config that does not compile here is a recorded failure, not a lost part
                rows.append({"BT": n, "H": size["H"], "V": size["V"], "candidate": f"logits_logsumexp {config}",
                             "error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"})
            if progress is not None:  # what is measured so far survives a candidate that hangs
                progress(pd.DataFrame(rows).assign(**provenance(device)))
    return pd.DataFrame(rows).assign(**provenance(device))


#: The Gluon kernel's variants of the ``gluon`` part: its default, then one dial moved at a time, then the
#: consumers taking turns (``PINGPONG``). ``num_stages=4`` (256 KiB of shared memory) did not launch in the
#: first run (16f5396): left out since.
GLUON_VARIANTS = [dict(GLUON=True), dict(GLUON=True, num_stages=2), dict(GLUON=True, GROUP_M=16),
                  dict(GLUON=True, BLOCK_K=32, num_stages=6), dict(GLUON=True, PINGPONG=True),
                  dict(GLUON=True, PINGPONG=True, num_stages=2), dict(GLUON=True, PINGPONG=True, GROUP_M=16)]


def gluon(size: dict, device: torch.device, rounds_path: Path | None = None) -> pd.DataFrame:
    """The Gluon stage against the tl.* one and the floor, at each N (issue 30's ``forward_no_grad``):
    cuBLAS's logits matmul alone, :func:`~kernels_lib.kernels.logits_logsumexp.logits_logsumexp` with its
    default (the tl.* TMA kernel) and with each of :data:`GLUON_VARIANTS`, in alternating rounds (order
    reversed every other round); each row the median over rounds of do_bench's p50 (and of its p20, p80),
    with the lse's and target logit's relative errors against the float32 logits of the same inputs. A
    candidate that fails is a row with its error, the others still run."""
    rows, per_round = [], []
    for n in size["x_values"]:
        inputs = flce.make_inputs({"BT": n, "H": size["H"], "V": size["V"]}, DTYPE, device, {})
        x, weight, target, _ = (t.detach() if isinstance(t, torch.Tensor) else t for t in inputs.args)
        exact = x.float() @ weight.float().t()
        ref_lse = torch.logsumexp(exact, -1)
        ref_target = exact.gather(1, target.clamp(min=0)[:, None])[:, 0].where(target >= 0, 0.0)
        del exact
        logits = torch.empty(n, size["V"], dtype=DTYPE, device=device)
        candidates = {"cuBLAS logits matmul alone": lambda: torch.matmul(x, weight.t(), out=logits)}
        errors, failed = {}, {}
        for config in [None] + (GLUON_VARIANTS if device.type == "cuda" else []):
            name = f"logits_logsumexp {config}"
            try:
                print(f"gluon N={n}: {name}", flush=True)  # where a hang or a crash happened
                lse, t = gluon_stage.logits_logsumexp(x, weight, target=target, config=config)
                torch.cuda.synchronize() if device.type == "cuda" else None
                errors[name] = (relative_error(lse, ref_lse), relative_error(t, ref_target))
                candidates[name] = functools.partial(gluon_stage.logits_logsumexp, x, weight, target=target, config=config)
            except Exception as error:  # a variant that does not compile or run here is a recorded failure
                failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        matmul_flops = 2.0 * n * size["H"] * size["V"]
        names = list(candidates)
        for round_ in range(size["rounds"]):
            for name in names if round_ % 2 == 0 else names[::-1]:
                timing = time_callable(candidates[name], device)
                per_round.append({"BT": n, "candidate": name, "round": round_, "ms_50": timing.p50,
                                  "ms_20": timing.p20, "ms_80": timing.p80})
        measured = pd.DataFrame(per_round)
        for name in names:
            mine = measured[(measured["BT"] == n) & (measured["candidate"] == name)]
            p50 = float(mine["ms_50"].median())
            lse_err, t_err = errors.get(name, (float("nan"), float("nan")))
            rows.append({"BT": n, "H": size["H"], "V": size["V"], "candidate": name, "ms_50": p50,
                         "ms_20": float(mine["ms_20"].median()), "ms_80": float(mine["ms_80"].median()),
                         "TFLOP/s": matmul_flops / (p50 * 1e-3) / 1e12, "lse_rel_err": lse_err,
                         "target_logit_rel_err": t_err, "rounds": len(mine)})
        rows.extend({"BT": n, "H": size["H"], "V": size["V"], "candidate": name, "error": why}
                    for name, why in failed.items())
        del logits
    if rounds_path is not None:
        pd.DataFrame(per_round).assign(**provenance(device)).to_csv(rounds_path, index=False)
    return pd.DataFrame(rows).assign(**provenance(device))


def _running(loaded: dict, inputs) -> tuple[dict, dict]:
    """The providers of ``loaded`` that run one ``full`` step on ``inputs``, and the others with their error:
    a peer that loads may still fail at a shape (QuACK 0.6.4's CuTe DSL compiler at H = 48, V = 263 on the
    H200: "ICE IR Verification Failed"), and a part records that as a row and goes on."""
    running, failed = {}, {}
    for name, fn in loaded.items():
        try:
            mode_callable(lambda fn=fn: fn(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full")()
        except Exception as error:  # anything a peer raises is its failure at this shape, recorded
            failed[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        else:
            running[name] = fn
    return running, failed


def profile(size: dict, device: torch.device) -> pd.DataFrame:
    """Per-kernel CUDA time of ``full`` (forward + backward), averaged over a few steps, for each provider
    of ``size["profile_providers"]`` (kernels_lib's default and the fastest peer) at each N of
    ``size["profile_n"]``; a provider that does not load here, or fails at a size, gives one row with the reason."""
    steps = 5
    loaded, skipped = available_providers(flce.KERNEL_NAME, size["profile_providers"])
    frames = [pd.DataFrame([{"name": f"{name} skipped: {why}", "kernel_provider": name}]) for name, why in skipped.items()]
    for n in size["profile_n"]:
        inputs = flce.make_inputs({"BT": n, "H": size["H"], "V": size["V"]}, DTYPE, device, {})
        running, failed = _running(loaded, inputs)
        frames += [pd.DataFrame([{"name": f"{name} failed: {why}", "kernel_provider": name, "BT": n}])
                   for name, why in failed.items()]
        for name, loss_fn in running.items():
            step = mode_callable(lambda fn=loss_fn: fn(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full")
            for _ in range(3):
                step()
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(steps):
                    step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            rows = [
                {"name": e.key, "calls per step": e.count / steps,
                 "device ms per step": getattr(e, "device_time_total", 0.0) / 1e3 / steps,
                 "cpu ms per step": e.cpu_time_total / 1e3 / steps}
                for e in prof.key_averages()
            ]
            table = pd.DataFrame(rows).sort_values("device ms per step", ascending=False).head(40)
            frames.append(table.assign(kernel_provider=name, BT=n))
    return pd.concat(frames, ignore_index=True).assign(H=size["H"], V=size["V"], **provenance(device))


def overhead(size: dict, device: torch.device) -> pd.DataFrame:
    """do_bench's ``full`` and the forward call's CPU time for variants that remove one host-side cost each."""
    n = size["stage_n"]
    inputs = flce.make_inputs({"BT": n, "H": size["H"], "V": size["V"]}, DTYPE, device, {})
    chunk = default_chunk_size(n, size["H"], size["V"], 2)
    variants = {"default": {}, "host_checks=False": {"host_checks": False}, f"chunk_size={chunk}": {"chunk_size": chunk},
                f"chunk_size={chunk} host_checks=False": {"chunk_size": chunk, "host_checks": False}}
    rows = []
    # Each variant twice, in order and then reversed: a drift over the run (clocks, heat) shows as a
    # difference between a variant's two rounds, not as a difference between variants.
    order = list(variants.items())
    for round_, (name, options) in enumerate(order + order[::-1]):
        def step():
            kernels_lib.fused_linear_cross_entropy(*inputs.args, **inputs.kwargs, **options).backward()

        timing = time_callable(step, device, grad_to_none=inputs.grad_inputs)
        cpu = []
        for _ in range(5):
            for tensor in inputs.grad_inputs:
                tensor.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            loss = kernels_lib.fused_linear_cross_entropy(*inputs.args, **inputs.kwargs, **options)
            cpu.append((time.perf_counter() - start) * 1e3)
            loss.backward()
        rows.append({"variant": name, "round": 1 + round_ // len(order), "BT": n, "ms_50": timing.p50, "ms_20": timing.p20, "ms_80": timing.p80,
                     "forward call cpu ms (median of 5)": sorted(cpu)[2]})
        print(rows[-1], flush=True)
    return pd.DataFrame(rows).assign(H=size["H"], V=size["V"], **provenance(device))


def exponentials(size: dict, device: torch.device, rounds_path: Path | None = None) -> pd.DataFrame:
    """The A/B of the shifted exponentials: the frontier's rounds with :data:`LOGITS_ARM`, no dial."""
    return frontier(size, device, rounds_path, dial=False, arms=(LOGITS_ARM,))


def timeline(size: dict, device: torch.device) -> pd.DataFrame:
    """``full`` at each N of ``size["timeline_n"]``, per provider of ``size["profile_providers"]``: do_bench's
    time beside the GPU's own view of ten back-to-back steps, each after do_bench's L2 flush
    (:func:`~kernels_workbench.bench.timing.busy_timeline`: span, kernels' busy time, idle, largest gaps,
    the host's longest runtime calls) and the call's sync sites (:func:`~kernels_workbench.bench.timing.sync_sites`)."""
    loaded, skipped = available_providers(flce.KERNEL_NAME, size["profile_providers"])
    rows = []
    for n in size["timeline_n"]:
        inputs = flce.make_inputs({"BT": n, "H": size["H"], "V": size["V"]}, DTYPE, device, {})
        rows += [{"kernel_provider": name, "BT": n, "error": f"skipped: {why}"} for name, why in skipped.items()]
        running, failed = _running(loaded, inputs)
        rows += [{"kernel_provider": name, "BT": n, "error": f"failed: {why}"} for name, why in failed.items()]
        for name, loss_fn in running.items():
            step = mode_callable(lambda fn=loss_fn: fn(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full")
            timing = time_callable(step, device, grad_to_none=inputs.grad_inputs)
            line = busy_timeline(step, device)
            row = {"kernel_provider": name, "BT": n, "ms_50": timing.p50, "ms_20": timing.p20, "ms_80": timing.p80}
            if line is not None:
                row.update({"steps": line.steps, "span ms per step": line.span, "busy ms per step": line.busy,
                            "idle ms per step": line.idle,
                            "largest gaps": "; ".join(f"{ms:.3f} ms after {a[:40]} before {b[:40]}" for ms, a, b in line.gaps),
                            "host calls": "; ".join(f"{call} {ms:.3f} ms in {k:g} calls" for call, ms, k in line.host_calls),
                            "sync sites": "; ".join(sync_sites(step, device))})
            rows.append(row)
            print(row, flush=True)
        inputs = None
    return pd.DataFrame(rows).assign(H=size["H"], V=size["V"], **provenance(device))


def quack_ab(size: dict, device: torch.device, rounds_path: Path | None = None) -> pd.DataFrame:
    """kernels_lib's default beside the fastest peer alone (QuACK), in the frontier's alternating rounds, no
    dial: a later commit's ratios in a few minutes."""
    return frontier(size, device, rounds_path, dial=False, peers=("quack",))


def past_floor(size: dict, device: torch.device, rounds_path: Path | None = None) -> pd.DataFrame:
    """Issue 30's run: every peer that loads (torch's ``F.linear_cross_entropy`` with its default and
    accurate policies among them) and the floor (:data:`~kernels_workbench.bench.fused_linear_cross_entropy.FLOOR`,
    the three matmuls alone) beside kernels_lib's default, in the frontier's alternating rounds, no dial:
    what :func:`kernels_workbench.bench.analysis.past_floor_targets` judges. Beside them the arm
    :data:`DX_ARM` (the stored exponentials' ``dx`` in blocks of the rows of before, 2048), the A/B of
    :data:`kernels_lib.chunks.matmuls.DX_BLOCK_ROWS`. Every row carries ``matmul_tflops``: the better of two bf16
    8192³ products through cuBLAS, one before the rounds and one after (NaN on a CPU), the square-product rate
    of the same run that :func:`kernels_workbench.bench.analysis.past_floor_rates` sets the floor's rate beside."""
    def run():
        return frontier(size, device, rounds_path, dial=False, arms=(DX_ARM,))

    if device.type != "cuda":
        return run().assign(matmul_tflops=float("nan"))
    before, rows, after = matmul_rate(device)[0], run(), matmul_rate(device)[0]
    return rows.assign(matmul_tflops=max(before, after))


def quack_pairs(size: dict, device: torch.device) -> pd.DataFrame:
    """kernels_lib's default and QuACK's, ``full`` and ``forward_no_grad`` at each N, timed in adjacent pairs
    (:func:`~kernels_workbench.bench.timing.paired_times`: ``size["pair_samples"]`` samples, the order
    alternating, each call alone after an L2 flush): the median and p20/p80 of the per-pair ratio, which
    a drift of the GPU over the run does not move. A provider that does not load, or fails at a size, gives a row
    with the reason."""
    loaded, skipped = available_providers(flce.KERNEL_NAME, ["kernels_lib", "quack"])
    rows = [{"kernel_provider": name, "error": f"skipped: {why}"} for name, why in skipped.items()]
    for n in size["x_values"]:
        inputs = flce.make_inputs({"BT": n, "H": size["H"], "V": size["V"]}, DTYPE, device, {})
        running, failed = _running(loaded, inputs)
        rows += [{"kernel_provider": name, "BT": n, "error": f"failed: {why}"} for name, why in failed.items()]
        for mode in ("full", "forward_no_grad"):
            fns = [mode_callable(lambda fn=running[name]: fn(*inputs.args, **inputs.kwargs), inputs.grad_inputs, mode)
                   for name in running]
            for fn in fns:  # compile and warm up (``full`` clears the gradients itself)
                for _ in range(3):
                    fn()
            times = paired_times(fns, device, samples=size["pair_samples"], grad_to_none=inputs.grad_inputs)
            for row in paired_summary(times, list(running), against=list(running)[-1]):
                rows.append({**row, "kernel_operation_mode": mode, "BT": n})
                print(rows[-1], flush=True)
        inputs = None
    return pd.DataFrame(rows).assign(H=size["H"], V=size["V"], **provenance(device))


def wide_class_major(size: dict, device: torch.device, rounds_path: Path | None = None) -> pd.DataFrame:
    """The A/B of the class-major route beyond H rows at the chart's N in ``(H, k·H]``, ``k`` = the
    :data:`WIDE_ARM`'s :mod:`studies.routes.wide_class_major`'s ``rows_per_hidden`` (the
    smallest N where none is, as at CPU size): torch, QuACK, the default (the chunked route) and
    :data:`WIDE_ARM` (one class-major chunk of N rows) in the frontier's alternating rounds, no dial;
    torch's ``F.linear_cross_entropy`` beside them, whose memory issue 30 bounds ours by."""
    limit = ARMS[WIDE_ARM][flce_module.__name__]["_class_major_route_takes"].rows_per_hidden * size["H"]
    wide = [n for n in size["x_values"] if size["H"] < n <= limit] or size["x_values"][:1]
    return frontier(dict(size, x_values=wide), device, rounds_path, dial=False, peers=("torch", "quack", "torch_lce"),
                    arms=(WIDE_ARM,))


def class_major(size: dict, device: torch.device) -> pd.DataFrame:
    """The class-major route's stages at the smallest N (:func:`flce_studies.class_major_times`): the
    exponentials GEMM at Hopper configs around the launcher's, both operand orders of ``dx``, ``dW`` at
    each slab size of ``size["slab_rows"]``."""
    base = logits_lse.TMA_LOGITS_OUT_CONFIG
    configs = [None] if device.type != "cuda" else [
        None, dict(base, GROUP_M=8), dict(base, GROUP_M=32), dict(base, TMA_STORE=False),
        dict(base, BLOCK_M=256, BLOCK_N=128), dict(base, PERSISTENT=False), dict(base, TMA_STORE=False, num_stages=4),
        dict(base, BLOCK_K=128, num_stages=2)]
    sizes = {"BT": min(size["x_values"]), "H": size["H"], "V": size["V"]}
    return flce_studies.class_major_times(sizes, DTYPE, device, slab_rows=size["slab_rows"], configs=configs).assign(
        **provenance(device))


def row_major_dw(size: dict, device: torch.device) -> pd.DataFrame:
    """The chunked route's ``dx`` and ``dW`` for one chunk of the smallest N, ``dW`` at each slab size of
    ``size["slab_rows"]``, written and added to (:func:`flce_studies.row_major_dw_times`)."""
    sizes = {"BT": min(size["x_values"]), "H": size["H"], "V": size["V"]}
    return flce_studies.row_major_dw_times(sizes, DTYPE, device, slab_rows=size["slab_rows"]).assign(**provenance(device))


PARTS = {"frontier": frontier, "exponentials": exponentials, "stages": stages, "forward": forward, "default": default,
         "profile": profile, "overhead": overhead, "class_major": class_major, "timeline": timeline, "quack_ab": quack_ab,
         "quack_pairs": quack_pairs, "wide_class_major": wide_class_major, "row_major_dw": row_major_dw,
         "past_floor": past_floor, "gluon": gluon}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write the parts' CSVs under")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, among {', '.join(PARTS)}")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose among {', '.join(PARTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    failed = []
    for part in parts:
        start = time.perf_counter()
        try:
            path = args.out / FILES[part]
            path.parent.mkdir(parents=True, exist_ok=True)
            extra = {"progress": lambda partial: partial.to_csv(path, index=False)} if part == "forward" else {}
            if f"{part}_rounds" in FILES:  # the parts that run alternating rounds keep each round's rows
                extra = {"rounds_path": args.out / FILES[f"{part}_rounds"]}
            rows = PARTS[part](SIZES[args.size], device, **extra)
            rows.to_csv(path, index=False)
            print(f"{part}: {len(rows)} rows in {time.perf_counter() - start:.0f} s -> {path}", flush=True)
        except Exception:  # a failing part is reported; the others still run
            failed.append(part)
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
