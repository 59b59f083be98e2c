"""Where a loss's time goes: one call of kernels_lib's loss, profiled on a GPU, split into what its floor
counts and what it does not.

The floor (:mod:`.comparison`) is the loss's matmuls at the GPU's measured matmul rate, or its minimal bytes
at the copy bandwidth, whichever is longer. A kernel profile (``torch.profiler``: CUDA time per kernel name
over a call) says where a call spends the time above it:

- **matmuls**: cuBLAS's kernels (``nvjet…``, ``…gemm…``, ``cutlass…``), with the rate their FLOPs imply;
- **kernels_lib's kernels**: the loss's Triton kernels, named by their Python function;
- **torch's kernels**: the elementwise ops, reductions, fills and copies the loss's Python layer launches;
- **the rest of the call**: the call's median time (``triton.testing.do_bench``) minus the profiled kernels:
  time the GPU waited for the host, and kernels too short to be listed.

The profiles are files of ``data/measured/gpu_runs/`` written by the studies in ``studies/``
(``preference_scaling_profile``, ``kto_small_batch_profile``); each row carries its GPU, versions and commit,
and :func:`provenance` says them beside the table. A point's floor uses only the ceilings measured in the
profile's own run (its commit, on its GPU); without them the floor reads NaN.
"""

from __future__ import annotations

import pandas as pd

from . import data

#: The parts of a call, in the order a table shows them.
KINDS = ("matmuls", "kernels_lib's kernels", "torch's kernels", "the rest of the call")

_MATMUL_MARKS = ("nvjet", "gemm", "cutlass", "xmma")
_TORCH_MARKS = ("at::", "at_cuda_detail", "memset", "memcpy", "cub::")


def kind(kernel: str) -> str:
    """Which part of a call the kernel named ``kernel`` (as ``torch.profiler`` names it) belongs to."""
    name = str(kernel).lower()
    if any(mark in name for mark in _MATMUL_MARKS):
        return "matmuls"
    if any(mark in name for mark in _TORCH_MARKS):
        return "torch's kernels"
    return "kernels_lib's kernels"


def breakdown(kernels: pd.DataFrame, call_ms: float, flops: float | None = None) -> dict:
    """One call's time by part: ``kernels`` has one row per kernel name (``kernel``, ``ms``: its CUDA time in
    one call), ``call_ms`` the call's median time. Returns the milliseconds of each of :data:`KINDS` (the rest
    is ``call_ms`` less the kernels, never below 0), the call's time, and the matmuls' TFLOP/s when ``flops``
    (the call's matmul FLOPs) is given."""
    if call_ms <= 0 or call_ms != call_ms:
        raise ValueError(f"call_ms must be a positive time in ms, got {call_ms!r}")
    missing = {"kernel", "ms"} - set(kernels.columns)
    if missing:
        raise ValueError(f"kernels lacks the column(s) {', '.join(sorted(missing))}")
    by_kind = kernels.groupby(kernels.kernel.map(kind)).ms.sum()
    out = {"call ms": float(call_ms)}
    for part in KINDS[:-1]:
        out[part] = float(by_kind.get(part, 0.0))
    out[KINDS[-1]] = max(0.0, float(call_ms) - sum(out[part] for part in KINDS[:-1]))
    out["matmul TFLOP/s"] = flops / (out["matmuls"] * 1e9) if flops and out["matmuls"] > 0 else float("nan")
    return out


def _module(kernel_name: str):
    import importlib

    from .bench.registry import get_spec

    spec = get_spec(kernel_name)
    return spec, importlib.import_module(spec.make_inputs.__module__)


def _meta(rows: pd.DataFrame) -> dict:
    return {"gpu_name": str(rows.gpu_name.iloc[0]), "kernels_lib_commit": str(rows.kernels_lib_commit.iloc[0]),
            "torch_version": str(rows.torch_version.iloc[0]), "triton_version": str(rows.triton_version.iloc[0])}


def point(kernel_name: str, b: int, kernels: pd.DataFrame, call_ms: float, meta: dict,
          ceilings: pd.DataFrame | None = None) -> dict:
    """The :func:`breakdown` of one profiled ``full`` call at the published sizes with batch ``b``, its floor
    (:func:`.overview.floor_ms` at the ceilings of the profile's own run; NaN without them), the call over
    the floor, and the matmuls over their time at the run's measured matmul rate."""
    import torch

    from .bench.analysis import ceiling_run
    from .overview import floor_ms

    spec, module = _module(kernel_name)
    sizes = {**spec.published["sizes"], "B": int(b)}
    flops = module.flops(sizes, "full")
    out = {"loss": kernel_name, "B": int(b), **breakdown(kernels, call_ms, flops)}
    out.update({"floor ms": float("nan"), "× floor": float("nan"), "matmuls × their floor": float("nan")})
    rates = {}
    for name in ("copy", "matmul"):
        try:
            rate, measured_in = ceiling_run(data.load_measured("ceilings", latest=False) if ceilings is None else ceilings,
                                            name, meta["gpu_name"], meta["kernels_lib_commit"])
        except ValueError:
            continue
        if measured_in == meta["kernels_lib_commit"]:
            rates[name] = rate
    if {"copy", "matmul"} <= set(rates):
        dtype = spec.published.get("dtype", torch.bfloat16)
        out["floor ms"] = floor_ms(kernel_name, sizes, dtype, "full", rates["copy"], rates["matmul"])[0]
        out["× floor"] = call_ms / out["floor ms"]
        out["matmuls × their floor"] = out["matmuls"] / (flops / (rates["matmul"] * 1e9))
    return {**out, **meta}


def preference_profiles(times: pd.DataFrame | None = None, kernels: pd.DataFrame | None = None,
                        ceilings: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per sequence loss and B in the preference profile (``preference_scaling_profile.csv``: the ``full`` call
    of DPO and GRPO at the published workload; ``preference_scaling_kernels.csv``: its twelve longest kernels),
    the :func:`point` of ``full``, with the time of the reference model's pass measured alone."""
    gpu_runs = data.MEASURED_DIR / "gpu_runs"
    if times is None or kernels is None:
        if not (gpu_runs / "preference_scaling_profile.csv").exists() or not (gpu_runs / "preference_scaling_kernels.csv").exists():
            return pd.DataFrame()
        times, kernels = (data.read_table(gpu_runs / f"preference_scaling_{n}.csv") for n in ("profile", "kernels"))
    rows = []
    for (loss, b), at in times.groupby(["loss", "B"]):
        case = at.set_index("case").ms_p50
        listed = kernels[(kernels.loss == loss) & (kernels.B == b)].rename(columns={"cuda_ms": "ms"})
        if "full" not in case or not len(listed):
            continue
        rows.append({**point(loss, b, listed, case["full"], _meta(at), ceilings),
                     "reference pass ms": case.get("reference pass", float("nan"))})
    return pd.DataFrame(rows)


def kto_profiles(times: pd.DataFrame | None = None, kernels: pd.DataFrame | None = None,
                 ceilings: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per B in KTO's profile (``kto_small_batch.csv``: the call's median per chunk size;
    ``kto_small_batch_profile.csv``: CUDA time per kernel and per torch op, per call), the :func:`point` of one
    call at the default chunk (the smallest measured), with the call's time at each larger chunk over it. (The
    profiled call is the forward with the gradient: KTO forms its gradient there, and ``backward`` only scales it.)"""
    gpu_runs = data.MEASURED_DIR / "gpu_runs"
    if times is None or kernels is None:
        if not (gpu_runs / "kto_small_batch.csv").exists() or not (gpu_runs / "kto_small_batch_profile.csv").exists():
            return pd.DataFrame()
        times, kernels = (data.read_table(gpu_runs / f"kto_small_batch{n}.csv") for n in ("", "_profile"))
    device = kernels[(kernels.cpu_ms_per_call == 0) & (kernels.cuda_ms_per_call > 0)]  # kernels and copies, not ops
    rows = []
    for b, listed in device.groupby("B"):
        calls = times[times.B == b].set_index("chunk_size").ms_50.sort_index()
        if not len(calls):
            continue
        default = calls.index[0]
        listed = listed.rename(columns={"name": "kernel", "cuda_ms_per_call": "ms"})
        chunks = {f"× at chunk {int(c)}": calls[c] / calls[default] for c in calls.index[1:]}
        rows.append({**point("kto_loss", b, listed, calls[default], _meta(listed), ceilings), "chunk": int(default),
                     **chunks})
    return pd.DataFrame(rows)


def chunk_ratios(times: pd.DataFrame | None = None) -> pd.DataFrame:
    """KTO's call time at each chunk size over its time at the default (smallest) chunk, per B
    (``kto_small_batch.csv``): below 1 where larger chunks are faster."""
    times = data.read_table(data.MEASURED_DIR / "gpu_runs" / "kto_small_batch.csv") if times is None else times
    table = times.pivot_table(index="B", columns="chunk_size", values="ms_50").sort_index(axis=1)
    return table.div(table.iloc[:, 0], axis=0).rename_axis(columns="time × the default chunk's, at chunk (rows)")


def small_vocab_steps(steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """What the cross-entropy on logits adds to a step at small V (``cross_entropy_small_vocab_step.csv``): per
    chart, V and provider, the median over rounds of the step's time (a chain of GPU work, then the loss and its
    backward) less the chain's alone. Inside a step the host has run ahead, so a call's host time hides behind the
    GPU's work unless the call waits for the GPU (a check read on the host does)."""
    path = data.MEASURED_DIR / "gpu_runs" / "cross_entropy_small_vocab_step.csv"
    if steps is None:
        if not path.exists():
            return pd.DataFrame()
        steps = data.read_table(path)
    table = steps.pivot_table(index=["chart", "V"], columns="provider", values="loss in step ms", aggfunc="median")
    return table.rename_axis(columns="ms the loss adds to a step")


def step_lines(table: pd.DataFrame, meta: pd.DataFrame, ours: str = "kernels_lib", peer: str = "torch") -> str:
    """One bullet per chart of :func:`small_vocab_steps`: what each provider's loss adds to a step, per V."""
    if not len(table):
        return "No step profile measured yet."
    out = []
    for chart, rows in table.groupby(level="chart"):
        rows = rows.droplevel("chart")
        cells = "; ".join(f"V = {v}: " + ", ".join(f"{p} {rows.loc[v, p]:.2f} ms" for p in rows.columns if rows.loc[v, p] == rows.loc[v, p])
                          for v in rows.index)
        faster = (rows[ours] < rows[peer]).sum() if {ours, peer} <= set(rows.columns) else 0
        out.append(f"- `{chart}`: {cells} ({ours} adds less than {peer} at {faster} of {len(rows)} V).")
    return "\n".join(out) + f"\n\n({provenance(meta.drop_duplicates(['gpu_name', 'kernels_lib_commit']))}.)"


def shares(table: pd.DataFrame) -> pd.DataFrame:
    """Each part of :data:`KINDS` as a share of the call's time (0–1), per row of a profile table."""
    return table[list(KINDS)].div(table["call ms"], axis=0)


def provenance(table: pd.DataFrame) -> str:
    """The generated line beside a profile table: its GPU(s), commit(s) and versions."""
    runs = table[["gpu_name", "kernels_lib_commit", "torch_version", "triton_version"]].drop_duplicates()
    return "; ".join(f"{data.gpu_label(r.gpu_name)}, kernels_lib {r.kernels_lib_commit[:7]}, torch {r.torch_version}, "
                     f"triton {r.triton_version}" for r in runs.itertuples())


def lines(table: pd.DataFrame, labels: dict[str, str] | None = None) -> str:
    """One markdown bullet per profiled point: the loss (``labels`` names it), B, the call's time, each part's
    milliseconds and share, and the rate the matmuls ran at."""
    if not len(table):
        return "No profile measured yet."
    labels = labels or {}
    out = []
    for (_, row), (_, share) in zip(table.iterrows(), shares(table).iterrows()):
        parts = ", ".join(f"{part} {row[part]:.2f} ms ({share[part]:.0%})" for part in KINDS)
        rate = f"; the matmuls at {row['matmul TFLOP/s']:.0f} TFLOP/s" if row["matmul TFLOP/s"] == row["matmul TFLOP/s"] else ""
        floor = (f", {row['× floor']:.2f}× its floor (the matmuls alone {row['matmuls × their floor']:.2f}× their time at the "
                 f"run's matmul rate)") if row["× floor"] == row["× floor"] else ", no ceilings measured in its run"
        chunks = "; ".join(f"{int(c.removeprefix('× at chunk '))}-row chunks {row[c]:.2f}×" for c in table.columns
                           if c.startswith("× at chunk ") and row[c] == row[c])
        chunks = f" The same call with {chunks} the time." if chunks else ""
        out.append(f"- **{labels.get(row['loss'], row['loss'])}**, B = {row['B']}, on the {data.gpu_label(row['gpu_name'])}: "
                   f"{row['call ms']:.2f} ms a call{floor}: {parts}{rate}.{chunks}")
    return "\n".join(out)
