"""Where a loss's time goes: one call of kernels_lib's loss, profiled on a GPU, split into what its floor
counts and what it does not.

The floor (:mod:`.comparison`) is the loss's matmuls at the GPU's measured matmul rate, or its minimal bytes
at the copy bandwidth, whichever is longer. A kernel profile (``torch.profiler``: CUDA time per kernel name
over a call) says where a call spends the time above it:

- **matmuls**: cuBLAS's kernels (``nvjet…``, ``…gemm…``, ``cutlass…``), with the rate their FLOPs imply;
- **kernels_lib's kernels**: the loss's Triton kernels, named by their Python function;
- **torch's kernels**: the elementwise ops, reductions, fills and copies the loss's Python layer launches;
- **the rest**: the call's median time (``triton.testing.do_bench``) minus the profiled kernels: the kernels a
  profile did not list (a top-k table leaves the shortest out) and the time the GPU sat idle, which a kernel
  profile cannot tell apart.

The profiles are files of ``data/measured/gpu_runs/`` written by the studies in ``studies/``
(``loss_profile``: every kernel of every loss's call; ``preference_scaling_profile``, ``kto_small_batch_profile``); each row carries its GPU, versions and commit,
and :func:`provenance` says them beside the table. A point's floor uses only the ceilings measured in the
profile's own run (its commit, on its GPU); without them the floor reads NaN. Rows of different runs (GPU or commit)
are never mixed: every table keeps its run's GPU and commit per row.
"""

from __future__ import annotations

import pandas as pd

from . import data

#: The parts of a call, in the order a table shows them.
KINDS = ("matmuls", "kernels_lib's kernels", "torch's kernels", "the rest")

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
    is ``call_ms`` less the kernels, never below 0: listed kernels longer than the median leave no rest), the call's time, and the matmuls' TFLOP/s when ``flops``
    (the call's matmul FLOPs) is given."""
    if not isinstance(kernels, pd.DataFrame):
        raise TypeError(f"kernels must be a DataFrame with columns kernel and ms, got {type(kernels).__name__}")
    if not isinstance(call_ms, (int, float)) or isinstance(call_ms, bool) or not call_ms > 0:
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


RUN = ["gpu_name", "kernels_lib_commit"]  # the columns that name a run: rows of two runs are never combined
META = (*RUN, "torch_version", "triton_version")  # what a profile row says of its run


def _module(kernel_name: str):
    from .bench.registry import get_spec

    return get_spec(kernel_name), None


def _meta(rows: pd.DataFrame) -> dict:
    return {key: str(rows[key].iloc[0]) for key in META}


def by_run(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with the run named for a table's index: ``GPU`` (its label) and ``commit`` (7 characters)."""
    return rows.assign(GPU=rows.gpu_name.map(data.gpu_label), commit=rows.kernels_lib_commit.astype(str).str[:7])


def call_flops(kernel_name: str, sizes: dict) -> float | None:
    """The matmul FLOPs of one ``full`` call of the loss's bench at ``sizes``, with the bench's default options
    (KTO's published harness gives no gradient to ``x``: ``input_grad=False``, three products, not four); None for
    a loss on logits, which runs no matmul."""
    spec, _ = _module(kernel_name)
    return spec.flops(sizes, "full")


def logits_bytes(kernel_name: str, sizes: dict) -> int | None:
    """The bytes of one head's ``N × V`` logits at ``sizes`` in the spec's dtype (``N`` = ``B·T``, ``BT`` or ``N``):
    what one pass of an elementwise kernel over a chunked loss's logits reads (or writes). None for a loss on
    logits (its floor already counts its bytes) or sizes that name no row count."""
    import torch

    spec, _ = _module(kernel_name)
    if spec.matmul_flops is None:
        return None
    if "B" in sizes and "T" in sizes:
        rows = int(sizes["B"]) * int(sizes["T"])
    elif "BT" in sizes or "N" in sizes:
        rows = int(sizes.get("BT", sizes.get("N")))
    else:
        return None
    dtype = spec.published.get("dtype", torch.bfloat16)
    return rows * int(sizes["V"]) * torch.empty((), dtype=dtype).element_size()


def point(kernel_name: str, b: int, kernels: pd.DataFrame, call_ms: float, meta: dict,
          ceilings: pd.DataFrame | None = None, *, x_name: str = "B") -> dict:
    """The :func:`breakdown` of one profiled ``full`` call at the published sizes with ``x_name`` (the chart's
    axis: the batch ``B`` by default) set to ``b``, its floor (:func:`.floor.floor_at` at the ceilings of the
    profile's own run, ``meta``'s GPU and commit; NaN without them), the call over the floor, the run's matmul
    rate, and the matmuls over their time at that rate (NaN for a loss without matmuls)."""
    import torch

    from .floor import floor_at, matmul_ms, own_rates

    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        what = "b must be a batch size" if x_name == "B" else f"b must be a size of {x_name}"
        raise ValueError(f"{what} of at least 1, got {b!r}")
    missing = set(META) - set(meta)
    if missing:
        raise ValueError(f"meta lacks {', '.join(sorted(missing))} (the profile's run: GPU, commit, versions)")
    spec, _ = _module(kernel_name)
    sizes = {**spec.published["sizes"], x_name: b}
    flops = call_flops(kernel_name, sizes)
    out = {"loss": kernel_name, x_name: b, "at": f"{x_name} = {b}", **breakdown(kernels, call_ms, flops)}
    out.update({"floor ms": float("nan"), "× floor": float("nan"), "run matmul TFLOP/s": float("nan"),
                "matmuls × their floor": float("nan")})
    ceilings = data.load_measured("ceilings", latest=False) if ceilings is None else ceilings
    rates = own_rates(ceilings, meta["gpu_name"], meta["kernels_lib_commit"])
    if {"copy", "matmul"} <= set(rates):
        out["floor ms"] = floor_at(kernel_name, sizes, spec.published.get("dtype", torch.bfloat16), "full", rates)[0]
        out["× floor"] = call_ms / out["floor ms"]
        out["run matmul TFLOP/s"] = rates["matmul"]
        if flops:
            out["matmuls × their floor"] = out["matmuls"] / matmul_ms(kernel_name, sizes, "full", rates["matmul"])
    buffer = logits_bytes(kernel_name, sizes)
    out["logits GiB"] = buffer / 2**30 if buffer else float("nan")
    # kernels_lib's kernels in units of one pass over the logits at the run's copy bandwidth (bytes read + written)
    out["logits passes"] = (out[KINDS[1]] * 1e-3 * rates["copy"] * 1e9 / buffer if buffer and "copy" in rates
                            else float("nan"))
    return {**out, **{key: meta[key] for key in META}}


def _given_or_read(given: tuple, *names: str) -> list[pd.DataFrame] | None:
    """The frames the caller gave, else the files ``names`` of ``data/measured/gpu_runs/``; None where a file is missing."""
    if all(frame is not None for frame in given):
        return list(given)
    paths = [data.MEASURED_DIR / "gpu_runs" / name for name in names]
    return [data.read_table(path) for path in paths] if all(path.exists() for path in paths) else None


def preference_profiles(times: pd.DataFrame | None = None, kernels: pd.DataFrame | None = None,
                        ceilings: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per run, sequence loss and B in the preference profile (``preference_scaling_profile.csv``: the ``full``
    call of DPO and GRPO at the published workload; ``preference_scaling_kernels.csv``: the twelve longest
    kernels of one such call), the :func:`point` of ``full``, with the time of the reference model's pass
    measured alone. The kernels are joined to the times of the same run."""
    read = _given_or_read((times, kernels), "preference_scaling_profile.csv", "preference_scaling_kernels.csv")
    if read is None:
        return pd.DataFrame()
    times, kernels = read
    ceilings = data.load_measured("ceilings", latest=False) if ceilings is None else ceilings  # read once, not per point
    rows = []
    for (gpu, commit, loss, b), at in times.groupby([*RUN, "loss", "B"]):
        case = at.set_index("case").ms_p50
        listed = kernels[(kernels.gpu_name == gpu) & (kernels.kernels_lib_commit == commit) & (kernels.loss == loss)
                         & (kernels.B == b)].rename(columns={"cuda_ms": "ms"})
        if "full" not in case or not len(listed):
            continue
        rows.append({**point(loss, int(b), listed, float(case["full"]), _meta(at), ceilings),
                     "reference pass ms": float(case.get("reference pass", float("nan")))})
    return pd.DataFrame(rows)


def loss_profiles(times: pd.DataFrame | None = None, kernels: pd.DataFrame | None = None,
                  ceilings: pd.DataFrame | None = None, *, newest: bool = True) -> pd.DataFrame:
    """Per run, loss and x of the every-loss profile (``loss_profile_times.csv``: the ``full`` call's median and the
    host's time per call; ``loss_profile_kernels.csv``: every kernel of the call, none left out, so the rest is the
    GPU idle), the :func:`point` of the call on its chart's axis, and the host's ms per call. ``newest``: only each
    GPU's newest run (by the rows' timestamps). Under the profiler the large matmuls can run longer than in the
    timed calls (their sum then passes the call's median, and the rest reads 0): a profile says where the time
    goes, the median what a call costs."""
    read = _given_or_read((times, kernels), "loss_profile_times.csv", "loss_profile_kernels.csv")
    if read is None:
        return pd.DataFrame()
    times, kernels = read
    times = times[times.ms_p50.notna()]
    if newest and len(times):
        last = times.groupby(RUN).timestamp.max().reset_index().sort_values("timestamp").groupby("gpu_name").tail(1)
        times = times.merge(last[RUN], on=RUN)
    ceilings = data.load_measured("ceilings", latest=False) if ceilings is None else ceilings  # read once, not per point
    rows = []
    for (gpu, commit, loss, x_name, x), at in times.groupby([*RUN, "loss", "x_name", "x_value"], sort=False):
        listed = kernels[(kernels.gpu_name == gpu) & (kernels.kernels_lib_commit == commit) & (kernels.loss == loss)
                         & (kernels.x_value == x)].rename(columns={"cuda_ms": "ms"})
        if not len(listed):
            continue
        rows.append({**point(loss, int(x), listed, float(at.ms_p50.iloc[0]), _meta(at), ceilings, x_name=str(x_name)),
                     "host ms": float(at.host_ms.iloc[0])})
    return pd.DataFrame(rows)


def profile_markdown(losses: dict[str, str], intro: str = "") -> str:
    """The :func:`lines` of :func:`loss_profiles` (each GPU's newest run) for the losses named in ``losses`` (kernel
    name -> label), ``intro`` before them and the run's provenance after; a sentence saying so where none is measured."""
    table = loss_profiles()
    table = table[table.loss.isin(list(losses))] if len(table) else table
    if not len(table):
        return "No kernel profile of these losses measured yet: `python -m studies.loss_profile --out OUT` on a GPU."
    return f"{intro}{lines(table, losses)}\n\n({provenance(table)}.)"


def default_chunk(kernel_name: str = "kto_loss", b: int = 8) -> int:
    """The rows per chunk the library picks by default for the loss's published workload at batch ``b``."""
    from kernels_lib._sequence_logprobs import chunk_rows

    spec, _ = _module(kernel_name)
    sizes = spec.published["sizes"]
    return chunk_rows(None, int(sizes["T"]), b * int(sizes["T"]), int(sizes["H"]))


def kto_profiles(times: pd.DataFrame | None = None, kernels: pd.DataFrame | None = None,
                 ceilings: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per run and B in KTO's profile (``kto_small_batch.csv``: the call's median per chunk size;
    ``kto_small_batch_profile.csv``: CUDA time per kernel and per torch op, per call, at the smallest chunk
    measured), the :func:`point` of the profiled call, its chunk, and the call's time at each other chunk over
    it. (The profiled call is the forward with the gradient: KTO forms its gradient there, and ``backward``
    only scales it.)"""
    read = _given_or_read((times, kernels), "kto_small_batch.csv", "kto_small_batch_profile.csv")
    if read is None:
        return pd.DataFrame()
    times, kernels = read
    ceilings = data.load_measured("ceilings", latest=False) if ceilings is None else ceilings  # read once, not per point
    device = kernels[(kernels.cpu_ms_per_call == 0) & (kernels.cuda_ms_per_call > 0)]  # kernels and copies, not ops
    rows = []
    for (gpu, commit, b), listed in device.groupby([*RUN, "B"]):
        calls = times[(times.gpu_name == gpu) & (times.kernels_lib_commit == commit) & (times.B == b)]
        calls = calls.set_index("chunk_size").ms_50.sort_index()
        if not len(calls):
            continue
        profiled = calls.index[0]
        listed = listed.rename(columns={"name": "kernel", "cuda_ms_per_call": "ms"})
        chunks = {f"× at chunk {int(c)}": calls[c] / calls[profiled] for c in calls.index[1:]}
        rows.append({**point("kto_loss", int(b), listed, float(calls[profiled]), _meta(listed), ceilings),
                     "chunk": int(profiled), **chunks})
    return pd.DataFrame(rows)


def chunk_ratios(times: pd.DataFrame | None = None, kernel_name: str = "kto_loss") -> pd.DataFrame:
    """Per run (GPU and commit) and B of ``kto_small_batch.csv``, the call's time at each chunk size over its
    time at the chunk the library picks by default (:func:`default_chunk`): below 1 where that chunk is faster.
    NaN where the default chunk was not measured."""
    read = _given_or_read((times,), "kto_small_batch.csv")
    if read is None:
        return pd.DataFrame()
    table = by_run(read[0]).pivot_table(index=["GPU", "commit", "B"], columns="chunk_size", values="ms_50").sort_index(axis=1)
    base = pd.Series([table.loc[i].get(default_chunk(kernel_name, int(i[-1])), float("nan")) for i in table.index],
                     index=table.index)
    return table.div(base, axis=0).rename_axis(columns="time × the default chunk's, at chunk (rows)")


def chunk_trade(rows: pd.DataFrame | None = None, file: str = "two_head_chunk_ab.csv", default_label: str = "default") -> pd.DataFrame:
    """The chunk dial of a same-run A/B (``studies/sequence_chunk_ab.py``'s rows: ``full`` time and memory per loss,
    x and chunk, in rounds): per run (GPU and commit), loss and x, the median over rounds of the ``full`` time at
    each chunk over its time at the default chunk of that run's code (``default``), and the memory at each chunk
    in MiB. Columns ``(what, chunk)``: ``what`` is ``time × <default_label>`` or ``MiB``; the default chunk's column is
    named ``default_label`` (the name the caller gives that run's default chunk, e.g. ``lean``)."""
    read = _given_or_read((rows,), file)
    if read is None:
        return pd.DataFrame()
    rows = by_run(read[0]).assign(chunk=lambda r: r["chunk"].astype(str))
    keys = ["GPU", "commit", "loss", "x_name", "B"]
    time = rows.pivot_table(index=keys, columns="chunk", values="full_ms", aggfunc="median")
    memory = rows.pivot_table(index=keys, columns="chunk", values="full_MiB", aggfunc="median")
    order = sorted(time.columns, key=lambda c: (c != "default", int(c) if c.isdigit() else 0))
    time = time[order].div(time["default"], axis=0) if "default" in time else time[order] * float("nan")
    table = pd.concat({f"time × {default_label}": time, "MiB": memory[order]}, axis=1)
    return table.rename(columns={"default": default_label}, level=1).rename_axis(index={"B": "x"})


def small_vocab_steps(steps: pd.DataFrame | None = None, file: str = "cross_entropy_small_vocab_step.csv") -> pd.DataFrame:
    """What a loss on logits adds to a step at small V (``cross_entropy_small_vocab_step.csv``, or the row
    divergences' ``divergence_small_vocab_step.csv``, whose rows name the loss for the chart): per run (GPU and
    commit), chart, V and provider, the median over rounds of the step's time (a chain of GPU work, then the loss
    and its backward) less the chain's alone. Inside a step the host has run ahead, so a call's host time hides
    behind the GPU's work unless the call waits for the GPU (a check read on the host does)."""
    read = _given_or_read((steps,), file)
    if read is None:
        return pd.DataFrame()
    rows = read[0] if "chart" in read[0].columns else read[0].rename(columns={"loss": "chart"})
    table = by_run(rows).pivot_table(index=["GPU", "commit", "chart", "V"], columns="provider", values="loss in step ms",
                              aggfunc="median")
    return table.rename_axis(columns="ms the loss adds to a step")


def step_lines(table: pd.DataFrame, ours: str = "kernels_lib", peer: str = "torch") -> str:
    """One bullet per run and chart of :func:`small_vocab_steps`: what each provider's loss adds to a step, per V."""
    if not len(table):
        return "No step profile measured yet."
    out = []
    for (gpu, commit, chart), rows in table.groupby(level=["GPU", "commit", "chart"]):
        rows = rows.droplevel(["GPU", "commit", "chart"])
        cells = "; ".join(f"V = {v}: " + ", ".join(f"{p} {rows.loc[v, p]:.2f} ms" for p in rows.columns
                                                  if rows.loc[v, p] == rows.loc[v, p]) for v in rows.index)
        faster = int((rows[ours] < rows[peer]).sum()) if {ours, peer} <= set(rows.columns) else 0
        out.append(f"- `{chart}`, {gpu} (kernels_lib {commit}): {cells}; {ours} adds less than {peer} at {faster} of "
                   f"the {len(rows)} vocabularies.")
    return "\n".join(out)


def shares(table: pd.DataFrame) -> pd.DataFrame:
    """Each part of :data:`KINDS` as a share of the call's time (0–1), per row of a profile table."""
    return table[list(KINDS)].div(table["call ms"], axis=0)


def provenance(table: pd.DataFrame) -> str:
    """The generated line beside a profile table: its GPU(s), commit(s) and versions."""
    runs = table[list(META)].drop_duplicates()
    return "; ".join(f"{data.gpu_label(r.gpu_name)}, kernels_lib {r.kernels_lib_commit[:7]}, torch {r.torch_version}, "
                     f"triton {r.triton_version}" for r in runs.itertuples())


def lines(table: pd.DataFrame, labels: dict[str, str] | None = None) -> str:
    """One markdown bullet per profiled point: the loss (``labels`` names it), B, the call's time and its floor,
    each part's milliseconds and share, and the matmuls' rate beside the run's measured one."""
    if not len(table):
        return "No profile measured yet."
    labels = labels or {}
    out = []
    for (_, row), (_, share) in zip(table.iterrows(), shares(table).iterrows()):
        at = f" at {int(row['chunk'])}-row chunks" if "chunk" in row and row["chunk"] == row["chunk"] else ""
        measured = row["× floor"] == row["× floor"]  # both ceilings of the run (the floor, the passes' copy rate)
        matmul_free = row["matmuls × their floor"] != row["matmuls × their floor"]
        no_matmul = matmul_free and not row[KINDS[0]] > 0
        parts = ", ".join(f"{part} {row[part]:.2f} ms ({share[part]:.0%})" for part in KINDS[no_matmul:-1])
        parts += f", the rest (unlisted kernels and the GPU idle) {row[KINDS[-1]]:.2f} ms ({share[KINDS[-1]]:.0%})"
        if measured and matmul_free:
            floor = f", {row['× floor']:.2f}× its floor (no matmul)"
        elif measured:
            floor = (f", {row['× floor']:.2f}× its floor. Its matmuls took {row['matmuls × their floor']:.2f}× the time "
                     f"their FLOPs need at the run's measured {row['run matmul TFLOP/s']:.0f} TFLOP/s (they ran at "
                     f"{row['matmul TFLOP/s']:.0f})")
        else:
            floor = f", no ceilings measured in its run (the matmuls ran at {row['matmul TFLOP/s']:.0f} TFLOP/s)"
        passes = ""
        if measured and "logits passes" in row and row["logits passes"] == row["logits passes"] and row["logits passes"] > 0:
            passes = (f" kernels_lib's kernels took the time of reading or writing one head's N × V logits "
                      f"({row['logits GiB'] * 1024:.0f} MiB) {row['logits passes']:.1f} times at the run's copy bandwidth: "
                      "time the matmul floor does not count.")
        chunks = ", ".join(f"{row[c]:.2f}× with {int(c.removeprefix('× at chunk '))}-row chunks" for c in table.columns
                           if c.startswith("× at chunk ") and row[c] == row[c])
        chunks = f" The same call takes {chunks}." if chunks else ""
        host = ""
        if "host ms" in row and row["host ms"] == row["host ms"]:
            host_bound = row["host ms"] >= row["call ms"] and row[KINDS[-1]] >= 0.2 * row["call ms"]
            host = (f" The host took {row['host ms']:.2f} ms to issue a call (under the profiler)"
                    + (": the host, not the GPU, sets the pace." if host_bound else "."))
        where = row["at"] if "at" in row and isinstance(row["at"], str) else f"B = {row['B']}"
        out.append(f"- **{labels.get(row['loss'], row['loss'])}**, {where}{at}, on the {data.gpu_label(row['gpu_name'])}: "
                   f"{row['call ms']:.2f} ms a call{floor}: {parts}.{passes}{chunks}{host}")
    return "\n".join(out)


def sustained_rates(rows: pd.DataFrame | None = None, file: str = "sustained_matmul.csv",
                    ceilings: pd.DataFrame | None = None) -> pd.DataFrame:
    """How a GPU's matmul rate holds over a long call (``sustained_matmul.csv``, ``studies/sustained_matmul.py``:
    cuBLAS products back to back in bursts of growing length after an idle pause, one row per product with its
    ``start_ms`` in the burst, its ``ms`` and the SM clock read before and after the burst). Per run (GPU, commit,
    timestamp), shape and burst: the products; the TFLOP/s of the first tenth of them at their median time,
    leaving out the first product (the first launch after the pause runs slow whatever the clock); the TFLOP/s
    of the products that start in the last tenth of the burst's span, at their median time; the last over the
    first; the clocks; and the last tenth over the matmul ceiling of the same run (``ceilings.csv``, its commit on
    its GPU; NaN where that run measured none). A NaN time gives NaN rates."""
    read = _given_or_read((rows,), file)
    if read is None:
        return pd.DataFrame()
    rows = read[0]
    missing = {"shape", "M", "K", "N", "burst_ms", "start_ms", "ms", "sm_clock_mhz_before", "sm_clock_mhz_after",
               "timestamp", *RUN} - set(rows.columns)
    if missing:
        raise ValueError(f"the sustained-rate rows lack the column(s) {', '.join(sorted(missing))}")
    from .floor import own_rates

    ceilings = data.load_measured("ceilings", latest=False) if ceilings is None else ceilings
    out = []
    for (gpu_name, commit, _, shape, burst), products in rows.groupby(
            [*RUN, "timestamp", "shape", "burst_ms"], sort=False):
        products = products.sort_values("start_ms")
        first = products.iloc[1: 1 + max(1, len(products) // 10)] if len(products) > 1 else products
        t0, t1 = products.start_ms.iloc[0], products.start_ms.iloc[-1]
        last = products[products.start_ms >= t0 + 0.9 * (t1 - t0)]
        flops = 2.0 * float(products.M.iloc[0]) * float(products.K.iloc[0]) * float(products.N.iloc[0])
        first_rate, last_rate = (flops / (part.ms.median(skipna=False) * 1e-3) / 1e12 for part in (first, last))
        ceiling = own_rates(ceilings, str(gpu_name), str(commit)).get("matmul", float("nan")) if len(ceilings) else float("nan")
        out.append({"GPU": data.gpu_label(gpu_name), "commit": str(commit)[:7], "shape": shape, "burst ms": float(burst),
                    "products": len(products), "first tenth TFLOP/s": first_rate, "last tenth TFLOP/s": last_rate,
                    "last / first": last_rate / first_rate,
                    "SM MHz before": float(products.sm_clock_mhz_before.iloc[0]),
                    "SM MHz after": float(products.sm_clock_mhz_after.iloc[0]),
                    "ceiling TFLOP/s": ceiling, "last tenth / ceiling": last_rate / ceiling})
    return pd.DataFrame(out)


def sustained_lines(table: pd.DataFrame) -> str:
    """One markdown bullet per run and shape of :func:`sustained_rates`: each burst's last tenth in TFLOP/s, over
    the run's matmul ceiling where it measured one, and the SM clock read after it; then what the longest burst
    keeps of the shortest one's rate."""
    if not len(table):
        return "No sustained-rate run measured yet."
    out = []
    for (gpu, commit, shape), bursts in table.groupby(["GPU", "commit", "shape"], sort=False):
        bursts = bursts.sort_values("burst ms")
        ceiling = bursts["ceiling TFLOP/s"].iloc[0]
        cells = "; ".join(
            f"{r['burst ms']:.0f} ms: {r['last tenth TFLOP/s']:.0f} TFLOP/s"
            + (f" ({r['last tenth / ceiling']:.2f}× the ceiling)" if ceiling == ceiling else "")
            + f", {r['SM MHz after']:.0f} MHz after" for _, r in bursts.iterrows())
        short, long = bursts.iloc[0], bursts.iloc[-1]
        keep = long["last tenth TFLOP/s"] / short["last tenth TFLOP/s"]
        at = f"the run's matmul ceiling (its median) {ceiling:.0f} TFLOP/s" if ceiling == ceiling else "no ceiling in that run"
        out.append(f"- {shape} on the {gpu} (kernels_lib {commit}; {at}), the last tenth of each burst: {cells}. The "
                   f"{long['burst ms']:.0f} ms burst ends at {keep:.2f}× the {short['burst ms']:.0f} ms burst's rate.")
    return "\n".join(out)
