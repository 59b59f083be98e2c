"""Fused linear + cross-entropy studies beyond the sweep: the chunk-size dial, gradient precision
against float64, and the time of each stage of a chunk; and the committed GPU runs of each
(``studies/flce_dial_precision_stages.py`` writes them).
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from kernels_lib.chunks.matmuls import addmm_into
from kernels_lib.fused_linear_cross_entropy import default_chunk_size, matmul_dtype
from kernels_lib.kernels.cross_entropy_chunk import launch_cross_entropy_chunk
from kernels_lib.kernels.logits_logsumexp import launch_logits_logsumexp, logits_logsumexp
from kernels_lib.kernels.shifted_exponentials import launch_scale_rows, launch_target_logit_shift
from kernels_workbench import data
from kernels_workbench.fused_cross_entropy import gradient_errors  # noqa: F401  (the studies' precision runs)
from kernels_workbench.bench.fused_linear_cross_entropy import KERNEL_NAME, _nhv, variant_name
from kernels_workbench.bench.sweep import run_sweep
from kernels_workbench.bench.timing import time_callable


#: What each part of ``studies/flce_frontier.py`` writes under its ``--out``, in the layout of
#: ``data/measured/`` (every peer and the chunk-size dial at the published sizes, the no-grad forward
#: candidates, the stages at the chunks around the default, the A/Bs, the profile): part → file, each
#: alternating-rounds part's rounds beside it as ``<part>_rounds``. The one map: the script writes by it
#: and :data:`RUN_FILES` reads by it.
FRONTIER_FILES = {
    "frontier": "gpu_runs/fused_linear_cross_entropy_frontier.csv",
    "frontier_rounds": "gpu_runs/fused_linear_cross_entropy_frontier_rounds.csv",
    "exponentials": "gpu_runs/fused_linear_cross_entropy_exponentials_ab.csv",
    "exponentials_rounds": "gpu_runs/fused_linear_cross_entropy_exponentials_ab_rounds.csv",
    "stages": "gpu_runs/fused_linear_cross_entropy_frontier_stages.csv",
    "forward": "gpu_runs/fused_linear_cross_entropy_frontier_forward.csv",
    "profile": "gpu_runs/fused_linear_cross_entropy_frontier_profile.csv",
    "default": "gpu_runs/fused_linear_cross_entropy_frontier_default.csv",
    "overhead": "gpu_runs/fused_linear_cross_entropy_frontier_overhead.csv",
    "class_major": "gpu_runs/fused_linear_cross_entropy_class_major_stages.csv",
    "timeline": "gpu_runs/fused_linear_cross_entropy_timeline.csv",
    "quack_ab": "gpu_runs/fused_linear_cross_entropy_quack_ab.csv",
    "quack_ab_rounds": "gpu_runs/fused_linear_cross_entropy_quack_ab_rounds.csv",
    "quack_pairs": "gpu_runs/fused_linear_cross_entropy_quack_pairs.csv",
    "wide_class_major": "gpu_runs/fused_linear_cross_entropy_wide_class_major_ab.csv",
    "wide_class_major_rounds": "gpu_runs/fused_linear_cross_entropy_wide_class_major_ab_rounds.csv",
    "row_major_dw": "gpu_runs/fused_linear_cross_entropy_row_major_dw.csv",
    "past_floor": "gpu_runs/fused_linear_cross_entropy_past_floor.csv",
    "past_floor_rounds": "gpu_runs/fused_linear_cross_entropy_past_floor_rounds.csv",
    "gluon": "gpu_runs/fused_linear_cross_entropy_gluon_ab.csv",
    "gluon_rounds": "gpu_runs/fused_linear_cross_entropy_gluon_ab_rounds.csv",
}
#: The committed GPU runs the notebooks read (:func:`load_run`): key → file under ``data/measured/``.
RUN_FILES = {
    # studies/flce_dial_precision_stages.py
    "dial": "gpu_runs/fused_linear_cross_entropy_dial.csv",
    "precision": "gpu_runs/fused_linear_cross_entropy_precision.csv",
    "stages": "gpu_runs/fused_linear_cross_entropy_stages.csv",
    # studies/flce_frontier.py: its parts' files (FRONTIER_FILES), some under a key of their own
    **{key: FRONTIER_FILES[part] for key, part in {
        "frontier": "frontier", "frontier_forward": "forward", "frontier_stages": "stages", "frontier_default": "default",
        "frontier_profile": "profile", "exponentials_ab": "exponentials", "class_major": "class_major",
        "timeline": "timeline", "quack_ab": "quack_ab", "quack_pairs": "quack_pairs", "wide_class_major": "wide_class_major",
        "past_floor": "past_floor", "past_floor_rounds": "past_floor_rounds", "gluon": "gluon"}.items()},
    # python -m studies.bench.gluon_scaled_product_ab (the Gluon dx GEMM's A/B)
    "gluon_scaled_product": "gpu_runs/gluon_scaled_product_ab.csv",
}
#: The candidates of the Gluon A/B (``studies/flce_frontier.py --parts gluon``) as its CSV names them.
GLUON_AB_CUBLAS, GLUON_AB_TL, GLUON_AB_GLUON = ("cuBLAS logits matmul alone", "logits_logsumexp None",
                                                "logits_logsumexp {'GLUON': True}")
#: The other arm of the shifted exponentials' A/B: kernels_lib's default with the logits stored and the
#: kernel's pass 2 (``STORE_EXPONENTIALS`` off; ``studies/flce_frontier.py --parts exponentials``).
LOGITS_ARM = "kernels_lib[store_exponentials=False]"
#: The other arm of the wide class-major A/B: the default with ``CLASS_MAJOR_ROWS_PER_HIDDEN = 2``, one
#: class-major chunk at ``H < N ≤ 2H`` (``studies/flce_frontier.py --parts wide_class_major``). The
#: default was 1 at the first run in ``gpu_runs/fused_linear_cross_entropy_wide_class_major_ab.csv``, 2
#: from 29f4f42 to 9e3752a (those runs' arm: :data:`WIDE_CLASS_MAJOR_ARM_BEFORE`), 1 again since.
WIDE_CLASS_MAJOR_ARM = "kernels_lib[class_major_rows_per_hidden=2]"
#: The arm's name in the runs made while the default was 2: the chunked route.
WIDE_CLASS_MAJOR_ARM_BEFORE = "kernels_lib[class_major_rows_per_hidden=1]"
#: The other arm of the ``dx`` block A/B (``studies/flce_frontier.py --parts past_floor``): the default with
#: :data:`kernels_lib.chunks.matmuls.DX_BLOCK_ROWS` at its value of before, each float32 ``dx`` product
#: twice the rows (and bytes) of today's.
DX_BLOCK_ROWS_BEFORE = 2048
DX_BLOCK_ROWS_ARM = f"kernels_lib[dx_block_rows={DX_BLOCK_ROWS_BEFORE}]"


def wide_class_major_arms(rows: pd.DataFrame) -> dict[str, str]:
    """Which provider of a wide class-major A/B run (``rows``: one run's) is which route:
    ``{"chunked": name, "class-major": name}``. The default is ``kernels_lib``; the arm is
    :data:`WIDE_CLASS_MAJOR_ARM` (the class-major chunk) in runs made while the default was 1, and
    :data:`WIDE_CLASS_MAJOR_ARM_BEFORE` (the chunked route) in those made while it was 2."""
    providers = set(rows.kernel_provider)
    if WIDE_CLASS_MAJOR_ARM in providers:
        return {"chunked": "kernels_lib", "class-major": WIDE_CLASS_MAJOR_ARM}
    if WIDE_CLASS_MAJOR_ARM_BEFORE in providers:
        return {"chunked": WIDE_CLASS_MAJOR_ARM_BEFORE, "class-major": "kernels_lib"}
    raise ValueError(f"rows: no arm of the wide class-major A/B ({WIDE_CLASS_MAJOR_ARM} or "
                     f"{WIDE_CLASS_MAJOR_ARM_BEFORE}) among {sorted(providers)}")


def load_run(part: str) -> pd.DataFrame | None:
    """The committed GPU measurement of ``part`` (a :data:`RUN_FILES` key), or None when not measured yet.

    A file that keeps several runs (each appended with its ``kernels_lib_commit`` and ``timestamp``)
    gives its newest (:func:`data.newest_run`)."""
    path = data.measured_file(RUN_FILES[part])
    if not path.is_file():
        return None
    rows = data.read_rows(path, required=[])
    return data.newest_run(rows) if {"kernels_lib_commit", "timestamp"} <= set(rows.columns) else rows


def load_runs(part: str, gpu_name: str | None = None) -> pd.DataFrame | None:
    """Every run of ``part`` (a :data:`RUN_FILES` key) that its file keeps, not only the newest (on
    ``gpu_name`` alone when given), or None when not measured yet."""
    path = data.measured_file(RUN_FILES[part])
    if not path.is_file():
        return None
    rows = data.read_rows(path, required=[])
    return rows if gpu_name is None else rows[rows.gpu_name == gpu_name].reset_index(drop=True)


def gluon_ab_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The Gluon A/B of one run, per ``BT``: the median ms of cuBLAS's logits matmul alone, of the tl.*
    log-sum-exp stage (``logits_logsumexp``'s default, the TMA kernel), of the Gluon stage at its
    defaults and of the fastest Gluon variant that ran, with ``gluon / tl`` (below 1: Gluon is faster),
    ``gluon / cuBLAS``, ``tl / cuBLAS``, the best variant's name and ratio, and the worst log-sum-exp
    error of each arm against float32 logits of the same inputs. Raises ValueError naming the rows'
    runs when ``rows`` mix runs (:func:`data.run_label`)."""
    data.run_label(rows)
    ok = rows[rows.error.isna()] if "error" in rows.columns else rows
    ms = ok.pivot_table(index="BT", columns="candidate", values="ms_50")
    err = ok.pivot_table(index="BT", columns="candidate", values="lse_rel_err")
    gluon = [c for c in ms.columns if c.startswith("logits_logsumexp {") and "'GLUON': True" in c]
    table = pd.DataFrame({"cuBLAS ms": ms[GLUON_AB_CUBLAS], "tl ms": ms[GLUON_AB_TL], "gluon ms": ms[GLUON_AB_GLUON]})
    best = ms[gluon].idxmin(axis=1)
    table["best gluon variant"] = best.str.replace("logits_logsumexp ", "", regex=False)
    table["best gluon ms"] = [ms.at[bt, name] for bt, name in best.items()]
    table["gluon / tl"] = table["gluon ms"] / table["tl ms"]
    table["best gluon / tl"] = table["best gluon ms"] / table["tl ms"]
    table["gluon / cuBLAS"] = table["gluon ms"] / table["cuBLAS ms"]
    table["tl / cuBLAS"] = table["tl ms"] / table["cuBLAS ms"]
    table["tl lse err"] = err[GLUON_AB_TL]
    table["gluon lse err"] = err[gluon].max(axis=1)
    return table


def deferred_share_needed(full_ms: float, forward_target_ms: float, n_rows: int, vocab: int, itemsize: int) -> dict:
    r"""How much of the gradient work forward must leave to backward to take at most ``forward_target_ms``,
    and the bytes that costs without recomputing the logits.

    ``full`` is three matmuls of the same FLOPs (logits, ``dx``, ``dW``), each :math:`G = t_\text{full}/3`.
    Rows whose gradients wait for backward cost forward one matmul (their logits, or exponentials, kept
    for backward); rows formed in forward cost three. With a share :math:`f` deferred, forward takes
    :math:`fG + (1 - f)\,3G`, so :math:`t_\text{fwd} \le T` needs :math:`f \ge (3G - T) / 2G`, and the kept
    logits take :math:`f \cdot N V` elements of ``itemsize`` bytes (recomputing them instead adds a fourth
    matmul to ``full``). Returns ``{"share": f, "bytes": ...}``, ``f`` clipped to [0, 1]."""
    matmul_ms = full_ms / 3
    share = min(max((3 * matmul_ms - forward_target_ms) / (2 * matmul_ms), 0.0), 1.0)
    return {"share": share, "bytes": share * n_rows * vocab * itemsize}


#: The GEMM kernels of a profile, by name: cuBLAS's (``nvjet``, ``sm90_xmma``, ``cutlass``), the CuTe DSL's
#: (``quackgemm``, ``gemm``) and kernels_lib's logits GEMMs with their epilogue (``logits_lse``).
GEMM_KERNEL_NAMES = r"nvjet|xmma|cutlass|gemm|logits_lse"


def memory_by_round(rounds: pd.DataFrame, mode: str = "full") -> pd.DataFrame:
    """Each provider's peak memory (MB) in ``mode`` per N and round of one alternating-rounds run (its
    ``*_rounds.csv``): index ``(kernel_provider, N)``, one column per round, and ``first round over the
    rest`` (round 1's peak over the largest of the later rounds'; 1 where every round agrees). A
    provider whose first calls at a size hold more than its steady state (compilation, tuning: QuACK's
    round 1 at N = 4096 / 8192, ``data/measured/README.md``) shows above 1, which a one-round run would
    have taken for its memory. Raises ValueError when ``rounds`` mix runs (:func:`data.run_label`)."""
    data.run_label(rounds)
    memory = rounds[(rounds.metric_name == "memory") & (rounds.kernel_operation_mode == mode)]
    table = memory.pivot_table(index=["kernel_provider", "x_value"], columns="round", values="y_value_50", aggfunc="median")
    table.index = table.index.set_names(["kernel_provider", "N"])
    table.columns = [f"round {int(r)}" for r in table.columns]
    later = table[table.columns[1:]].max(axis=1) if len(table.columns) > 1 else table[table.columns[0]]
    return table.assign(**{"first round over the rest": table[table.columns[0]] / later})


def profile_kernels(profile: pd.DataFrame, top: int = 3) -> pd.DataFrame:
    """Per provider and N of a ``profile`` run (``studies/flce_frontier.py --parts profile``): the device
    time per step of its GPU kernels (the rows with no CPU time: not the torch ops that launch them),
    of those that are GEMMs (:data:`GEMM_KERNEL_NAMES`) and of the rest, their number, and the ``top``
    longest with their ms per step. Rows without ``kernel_provider`` (runs
    before it was recorded) are kernels_lib's; a provider skipped in the run has no kernels and is left out."""
    provider = profile["kernel_provider"] if "kernel_provider" in profile else pd.Series("kernels_lib", index=profile.index)
    rows = profile.assign(kernel_provider=provider.fillna("kernels_lib"))
    kernels = rows[(rows["cpu ms per step"] == 0) & (rows["device ms per step"] > 0)]
    out = []
    for (name, n), group in kernels.groupby(["kernel_provider", "BT"], sort=True):
        longest = group.sort_values("device ms per step", ascending=False).head(top)
        gemm = group.name.str.contains(GEMM_KERNEL_NAMES, case=False, regex=True)
        out.append({"kernel_provider": name, "N": int(n), "kernels ms per step": group["device ms per step"].sum(),
                    "GEMM ms per step": group.loc[gemm, "device ms per step"].sum(),
                    "other ms per step": group.loc[~gemm, "device ms per step"].sum(), "kernels": len(group),
                    "longest": "; ".join(f"{k[:48]} {ms:.2f}" for k, ms in zip(longest.name, longest["device ms per step"]))})
    return pd.DataFrame(out, columns=["kernel_provider", "N", "kernels ms per step", "GEMM ms per step", "other ms per step",
                                      "kernels", "longest"])


def dial_sweep(
    sizes: dict,
    *,
    chunk_sizes,
    dtype: torch.dtype,
    device,
    modes=("forward_no_grad", "full"),
) -> pd.DataFrame:
    """kernels_lib at one size for each ``chunk_size`` × ``accurate``: rows in the measured layout,
    ``kernel_provider`` naming the point (:func:`variant_name`). ``sizes`` holds ``BT``, ``H``, ``V``.

    ``accurate`` changes only the gradient, so ``forward_no_grad`` is measured once per chunk size.
    """
    point = {k: val for k, val in sizes.items() if k != "BT"}
    frames = []
    for chunk_size in chunk_sizes:
        for accurate in (True, False):
            chosen = [m for m in modes if accurate or m != "forward_no_grad"]
            if not chosen:
                continue
            options = {"chunk_size": int(chunk_size), "accurate": accurate}
            rows = run_sweep(
                KERNEL_NAME, x_name="BT", x_values=[int(sizes["BT"])], sizes=point, dtype=dtype, device=device,
                providers=["kernels_lib"], modes=chosen, options=options,
            )
            frames.append(rows.assign(kernel_provider=variant_name(options)))
    return pd.concat(frames, ignore_index=True)


def _random_head(rows: int, h: int, v: int, dtype: torch.dtype, device: torch.device):
    """Seeded ``x`` (``rows × H``, N(0, 1)), ``W`` (``V × H``, N(0, 1/H): logits of unit scale) and targets."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, h, generator=generator, device=device).to(dtype)
    w = (torch.randn(v, h, generator=generator, device=device) * h**-0.5).to(dtype)
    return x, w, torch.randint(0, v, (rows,), generator=generator, device=device)


def stage_times(sizes: dict, dtype: torch.dtype, device, *, chunk_size: int | None = None,
                accurate: bool = True, epilogue: bool = False) -> pd.DataFrame:
    """Where the time of kernels_lib's ``full`` goes: each stage of one chunk timed alone, times the
    number of chunks. ``sizes`` holds ``BT`` (or ``N``), ``H``, ``V``.

    Stages per chunk of ``c`` rows: the logits ``x_c Wᵀ`` (``2cHV`` FLOPs), the Triton kernel (lse,
    loss, ``dz`` in place: memory-bound, ``3cV`` logits moved), or with ``epilogue`` (the route of a
    plain loss on Hopper) the logits and their lse from the Triton GEMM
    (:func:`~kernels_lib.kernels.logits_logsumexp.logits_logsumexp` with ``logits_out``) and the
    kernel's second pass alone (``2cV`` logits moved); ``dx_c = dz W`` (``2cHV``) and
    ``dW += dzᵀ x_c`` (``2cHV`` plus a read and a write of the ``V × H`` accumulator: the cost that
    grows with the number of chunks). The sum is a floor on the measured ``full`` (launches and the
    final rounding of an fp32 accumulator come on top).
    """
    device = torch.device(device)
    n, h, v = _nhv(sizes)
    mm_dtype = matmul_dtype(dtype)
    chunk = min(chunk_size or default_chunk_size(n, h), n)
    x_c, w, target = _random_head(chunk, h, v, mm_dtype, device)
    buffer = torch.empty(chunk, v, dtype=mm_dtype, device=device)
    dx = torch.empty(chunk, h, dtype=dtype, device=device)
    acc = torch.zeros(v, h, dtype=torch.float32 if accurate else dtype, device=device)
    per_row = [torch.empty(chunk, dtype=torch.float32, device=device) for _ in range(3)]
    scale = torch.full((1,), 1.0 / n, dtype=torch.float32, device=device)

    def kernel():
        launch_cross_entropy_chunk(buffer, target, lse=per_row[0], loss=per_row[1], z_loss=per_row[2],
                                   grad_scale=scale, ignore_index=-100, label_smoothing=0.0,
                                   z_loss_scale=0.0, softcap=None)

    def kernel_pass_two():  # the epilogue route's kernel: the lse known, one read and one write of the logits
        launch_cross_entropy_chunk(buffer, target, lse=per_row[0], loss=None, z_loss=None, grad_scale=scale,
                                   ignore_index=-100, label_smoothing=0.0, z_loss_scale=0.0, softcap=None)

    def dx_matmul():
        if dx.dtype == buffer.dtype:
            torch.matmul(buffer, w, out=dx)
        else:
            dx.copy_(buffer @ w)

    if epilogue:
        first = [("logits and lse: Triton GEMM, lse in its epilogue",
                  lambda: logits_logsumexp(x_c, w, target=target, logits_out=buffer), 2.0 * chunk * h * v),
                 ("kernel: dz (lse given)", kernel_pass_two, 0.0)]
    else:
        first = [("logits x_c Wᵀ", lambda: torch.matmul(x_c, w.t(), out=buffer), 2.0 * chunk * h * v),
                 ("kernel: lse, loss, dz", kernel, 0.0)]
    stages = [
        *first,
        ("dx_c = dz W", dx_matmul, 2.0 * chunk * h * v),
        ("dW += dzᵀ x_c", lambda: addmm_into(acc, buffer.t(), x_c, max_temp_numel=buffer.numel()), 2.0 * chunk * h * v),
    ]
    n_chunks = math.ceil(n / chunk)
    rows = []
    for name, fn, stage_flops in stages:
        ms = time_callable(fn, device).p50
        rows.append({"stage": name, "ms per chunk": ms, "chunks": n_chunks, "ms": ms * n_chunks,
                     "TFLOP/s": stage_flops / (ms * 1e-3) / 1e12 if stage_flops else float("nan")})
    table = pd.DataFrame(rows)
    table.attrs.update(chunk_size=chunk, accurate=accurate, N=n, H=h, V=v, dtype=str(dtype), epilogue=epilogue)
    return table


def row_major_dw_times(sizes: dict, dtype: torch.dtype, device, *, slab_rows) -> pd.DataFrame:
    r"""The chunked route's gradient matmuls for one chunk of ``N`` rows, each timed alone, from the
    row-major ``N × V`` exponentials :math:`\tilde e`: ``dx`` (:math:`\tilde e W`) and ``dW``
    (:math:`\tilde e^\top x`) in slabs of ``S`` classes, one matmul per slab, for each ``S`` of
    ``slab_rows`` (``S ≥ V``: one matmul, the route's way), written (``first chunk``: ``beta = 0``) and
    added to (``later chunk``: ``beta = 1``, as chunks 2, 3, … do). ``sizes`` holds ``BT`` (or ``N``),
    ``H``, ``V``. Columns ``stage``, ``variant``, ``ms``, ``TFLOP/s``.

    Why: in the profiles (``gpu_runs/fused_linear_cross_entropy_frontier_profile.csv``) the class-major route's ``dW``, in slabs of 8448 classes, took 6.01 ms
    per 4096 rows where the chunked route's one matmul took 6.22 (cuBLAS chose other tiles for the two)."""
    device = torch.device(device)
    n, h, v = _nhv(sizes)
    mm_dtype = matmul_dtype(dtype)
    x, w, _ = _random_head(n, h, v, mm_dtype, device)
    e = torch.rand(n, v, dtype=torch.float32, device=device).to(mm_dtype)
    dw = torch.zeros(v, h, dtype=mm_dtype, device=device)
    dx = torch.empty(n, h, dtype=mm_dtype, device=device)

    def slabs(size, beta):
        def run():
            for start in range(0, v, size):
                dw[start:start + size].addmm_(e[:, start:start + size].t(), x, beta=beta)
        return run

    product = 2.0 * n * h * v
    stages = [("dx", "ẽ W", lambda: torch.mm(e, w, out=dx))]
    stages += [("dW", f"{chunk}, slabs of {min(size, v)} classes ({math.ceil(v / size)} matmuls)", slabs(size, beta))
               for size in slab_rows for chunk, beta in (("first chunk", 0.0), ("later chunk", 1.0))]
    rows = []
    for stage, variant, fn in stages:
        ms = time_callable(fn, device).p50
        rows.append({"stage": stage, "variant": variant, "ms": ms, "TFLOP/s": product / (ms * 1e-3) / 1e12})
        print(rows[-1], flush=True)
    return pd.DataFrame(rows).assign(BT=n, H=h, V=v, dtype=str(dtype).replace("torch.", ""))


def class_major_times(sizes: dict, dtype: torch.dtype, device, *, slab_rows, configs) -> pd.DataFrame:
    r"""The class-major route's stages (one chunk of ``N ≤ H`` rows, shifted exponentials), each timed
    alone, with the alternatives each stage could take. ``sizes`` holds ``BT`` (or ``N``), ``H``, ``V``.

    Stages (``stage``, ``variant``, ``ms``, ``TFLOP/s``):

    - ``shift``: each row's target logit :math:`c_i` (one dot product per row);
    - ``exponentials GEMM``: the epilogue GEMM writing :math:`\tilde e^\top` class-major, with its merge
      (``2NHV`` FLOPs), per launch ``config`` of ``configs`` (``None``: the launcher's own choice);
    - ``dx``: :math:`\tilde e W` as the route forms it, ``(ẽᵀ)ᵀ W``, and as ``(Wᵀ ẽᵀ)ᵀ`` (the other
      operand order cuBLAS could be given; its result is ``H × N``, transposed);
    - ``dW``: :math:`\tilde e^\top (\mathrm{diag}(r) x)` in slabs of ``S`` classes, one matmul per slab,
      for each ``S`` of ``slab_rows`` (``S ≥ V``: one matmul), the product of each slab's wave count;
    - ``scale rows``: the row factors on ``x`` (and again on ``dx``).
    """
    device = torch.device(device)
    n, h, v = _nhv(sizes)
    mm_dtype = matmul_dtype(dtype)
    x, w, target = _random_head(n, h, v, mm_dtype, device)
    e_t = torch.empty(v, n, dtype=mm_dtype, device=device)
    dw = torch.empty(v, h, dtype=mm_dtype, device=device)
    dx = torch.empty(n, h, dtype=mm_dtype, device=device)
    scale = torch.full((1,), 1.0 / n, dtype=torch.float32, device=device)
    shift = launch_target_logit_shift(x, w, None, target, 1.0, -100)
    factors = torch.empty_like(shift)

    def gemm(config):
        def run():
            factors.copy_(shift)  # the launch overwrites its shift with the row factors
            launch_logits_logsumexp(x, w, None, target, alpha=1.0, ignore_index=-100, config=config,
                                    logits_out=e_t.t(), shift=factors)
        return run

    def slabs(size):
        def run():
            for start in range(0, v, size):
                torch.mm(e_t[start:start + size], x, out=dw[start:start + size])
        return run

    product = 2.0 * n * h * v
    stages = [("shift", "launch_target_logit_shift", lambda: launch_target_logit_shift(x, w, None, target, 1.0, -100), 0.0)]
    stages += [("exponentials GEMM", f"config {config}", gemm(config), product) for config in configs]
    stages += [("dx", "(ẽᵀ)ᵀ W", lambda: torch.mm(e_t.t(), w, out=dx), product),
               ("dx", "(Wᵀ ẽᵀ)ᵀ", lambda: torch.mm(w.t(), e_t), product)]
    stages += [("dW", f"slabs of {min(size, v)} classes ({math.ceil(v / size)} matmuls)", slabs(size), product)
               for size in slab_rows]
    stages += [("scale rows", "launch_scale_rows on x", lambda: launch_scale_rows(x, factors, scale), 0.0)]
    rows = []
    for stage, variant, fn, stage_flops in stages:
        try:
            timing, error = time_callable(fn, device), ""
            ms = timing.p50
        except Exception as failure:  # a config that does not compile here is a recorded failure
            ms, error = float("nan"), f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"
        rows.append({"stage": stage, "variant": variant, "ms": ms,
                     "TFLOP/s": stage_flops / (ms * 1e-3) / 1e12 if stage_flops else float("nan"), "error": error})
        print(rows[-1], flush=True)
    return pd.DataFrame(rows).assign(BT=n, H=h, V=v, dtype=str(dtype).replace("torch.", ""))
