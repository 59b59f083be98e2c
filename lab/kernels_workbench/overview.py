"""The overview notebook's logic: every published workload beside our measurements, its floor, the
agreement of our re-measurement of a peer with its published figure, and the environment of the runs.

A *workload* is one published chart: the rows of one ``kernel_name`` and one benchmark
configuration (ORPO was published at two sequence lengths, so it makes two; JSD on two axes). Measured
rows belong to a workload when they sweep the same axis (``x_name``) and their configuration has the
same sizes (the configs' upper-case keys: ``H``, ``V``, ``T``, ...; :data:`SIZE_ALIASES` for the
lower-case ones of Liger's model-config benchmarks) and dtype. A workload's measured rows are those of
run per GPU we measured (:func:`.data.newest_run_per_gpu`: the newest kernels_lib run of that chart on
each GPU, one commit on one GPU), so that every ratio taken from them (a floor, the agreement with the
published figure) is within one run, a provider the run did not measure is absent rather than filled
in from another run, and no GPU is preferred: each is shown beside the published rows, labelled.
Everything here reads ``data/`` only:
it works for any loss that has published rows, and picks up ``data/measured/<kernel_name>.csv`` as
soon as it exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pandas as pd

from . import data
from . import floor as one_floor
from .narrative import span
from .data import run_commit  # noqa: F401  (the notebooks call overview.run_commit)
from .bench.registry import get_spec

#: Names of GPUs we have measured on, as ``gpu_name`` records them (names of :data:`DATASHEETS`); no
#: function defaults to one: every GPU in the rows is shown.
H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"

#: Datasheet figures of the GPUs in the published and measured rows (NVIDIA's datasheets: HBM
#: bandwidth, dense bf16 tensor-core rate without sparsity, SXM parts unless named PCIe; the B200 per GPU
#: from the HGX B200 sheet: 1.4 TB and 62 TB/s over 8 GPUs, 36 PFLOP/s bf16 with sparsity over 8, halved).
DATASHEETS = pd.DataFrame(
    [
        ("NVIDIA A100-SXM4-80GB", "80 GB HBM2e", 2.039, 312),
        ("NVIDIA H100 PCIe", "80 GB HBM2e", 2.0, 756),
        (H100, "80 GB HBM3", 3.35, 989),
        (H200, "141 GB HBM3e", 4.8, 989),
        ("NVIDIA B200", "180 GB HBM3e", 7.7, 2250),
    ],
    columns=["gpu_name", "memory", "bandwidth TB/s", "bf16 dense TFLOP/s"],
).set_index("gpu_name")

#: Provenance columns of measured rows shown in :func:`environment_table` (``driver`` when recorded).
ENVIRONMENT_COLUMNS = [
    "torch_version", "triton_version", "liger_version", "cce_version", "quack_version", "cutlass_dsl_version", "driver",
    "timer",
]


def chart_title(kernel_name: str, config: dict, x_name: str | None = None) -> str:
    """``kernel_name (the configuration's sizes but the swept ``x_name``, dtype)``: a chart's title."""
    shown = ", ".join(f"{k} = {v}" for k, v in config.items() if k.isupper() and k != x_name)
    dtype = str(config.get("dtype", "")).replace("torch.", "")
    return f"{kernel_name} ({shown}{', ' + dtype if dtype else ''})"


@dataclass(frozen=True)
class Workload:
    """One published chart: its rows, the measured rows of the same configuration (the newest run of each
    GPU, together), and its sizes. ``runs``: GPU → that GPU's rows (by default ``measured`` split by GPU)."""

    kernel_name: str
    config: dict  # the published configuration, without "mode"
    published: pd.DataFrame
    measured: pd.DataFrame
    runs: dict = field(default=None, compare=False)

    def __post_init__(self):
        if self.runs is None:
            measured = self.measured
            split = {gpu: measured[measured.gpu_name.astype(str) == gpu].reset_index(drop=True)
                     for gpu in data.gpus_measured(measured.assign(device="cuda"))} if len(measured) else {}
            object.__setattr__(self, "runs", split)

    @property
    def gpus(self) -> list[str]:
        """The GPUs with measured rows of this chart (:func:`.data.gpus_measured`' order)."""
        return list(self.runs)

    def on(self, gpu_name: str) -> pd.DataFrame:
        """The rows of the newest run on ``gpu_name`` (empty where that GPU has none)."""
        return self.runs.get(gpu_name, self.measured.iloc[:0])

    @property
    def title(self) -> str:
        return chart_title(self.kernel_name, self.config)

    @property
    def x_name(self) -> str:
        return str(self.published.x_name.iloc[0])

    @property
    def x_label(self) -> str:
        return str(self.published.x_label.iloc[0])

    @property
    def published_gpu(self) -> str:
        return str(self.published.gpu_name.iloc[0])

    @property
    def run(self) -> str:
        """Which run the measured rows of each GPU come from (:func:`.data.run_label`, joined by "; "), or ""
        when there are none."""
        return "; ".join(data.run_label(rows) for rows in self.runs.values() if len(rows))


#: Sizes that Liger's model-config benchmarks name in lower case, by our specs' names (their ``bsz``
#: and ``seq_len`` describe the model configuration's largest batch, not the chart's points).
SIZE_ALIASES = {"vocab_size": "V"}


def _config(text: str) -> dict:
    return {SIZE_ALIASES.get(k, k): v for k, v in json.loads(text).items() if k != "mode"}


def _match_keys(config: dict) -> set[str]:
    """The keys that identify a workload: sizes (upper-case) and dtype."""
    return {k for k in config if k.isupper() or k == "dtype"}


def belongs(measured_config: dict, published_config: dict, x_name: str) -> bool:
    """Whether a measured configuration is the published one: equal on every size and dtype both name
    (the swept size aside)."""
    common = (_match_keys(measured_config) & _match_keys(published_config)) - {x_name}
    return all(measured_config[k] == published_config[k] for k in common)


def _spec_baseline(kernel_name: str) -> str | None:
    """The baseline provider's name in the loss's bench spec, or None when the loss has no spec."""
    try:
        return get_spec(kernel_name).baseline
    except ValueError:
        return None


def measured_on(kernel_name: str, gpu_name: str | None = None, latest: bool = True) -> pd.DataFrame:
    """Our rows of ``kernel_name`` measured on ``gpu_name`` (CUDA runs; every GPU's when None): the newest
    row per point, or with ``latest=False`` every run's."""
    rows = data.load_measured(kernel_name, latest=latest)
    if not len(rows):
        return rows
    chosen = rows.device == "cuda"
    return rows[chosen & (rows.gpu_name == gpu_name)] if gpu_name is not None else rows[chosen]


def _published_options(kernel_name: str, measured_config: dict) -> bool:
    """Whether a measured row ran the loss's published options: for a spec with ``extra_options`` (GRPO,
    whose ``--option loss_type=cispo`` sweeps share the published sizes), its ``default_options`` as
    given and none of the extra ones; any other spec's rows, always."""
    try:
        spec = get_spec(kernel_name)
    except (KeyError, ValueError):
        return True
    if not spec.extra_options:
        return True
    same = all(measured_config.get(k, v) == v for k, v in spec.default_options.items())
    return same and not set(measured_config) & set(spec.extra_options)


def of_chart(rows: pd.DataFrame, config: dict, x_name: str) -> pd.DataFrame:
    """The ``rows`` that belong to the published chart of ``config`` swept over ``x_name`` (:func:`belongs`),
    measured with the published options (:func:`_published_options`)."""
    if not len(rows):
        return rows
    same_axis = rows[rows.x_name == x_name]
    keep = [belongs(_config(s), config, x_name) and _published_options(k, _config(s))
            for s, k in zip(same_axis.extra_benchmark_config_str, same_axis.kernel_name)]
    return same_axis[keep]


def newest_per_point(rows: pd.DataFrame) -> pd.DataFrame:
    """The newest row per (provider, mode, metric, x) of one chart's rows: runs that recorded the same
    workload under other config strings (the tensor-parallel bench adds ``TP``) give one point each."""
    if not len(rows):
        return rows
    key = ["kernel_provider", "kernel_operation_mode", "metric_name", "x_value"]
    return rows.sort_values("timestamp", kind="stable").drop_duplicates(key, keep="last").sort_index()


def workload_runs(workload: "Workload", gpu_name: str | None = None) -> pd.DataFrame:
    """Every run's rows of ``workload``'s chart on ``gpu_name`` (every GPU's when None; its ``measured``
    keeps the newest run of each GPU, the newest row per point)."""
    return of_chart(measured_on(workload.kernel_name, gpu_name, latest=False), workload.config, workload.x_name)


def across_runs(rows: pd.DataFrame, provider: str, mode: str, metric: str = "speed") -> pd.DataFrame:
    """One provider's ``mode`` medians of ``metric`` in every run that ``rows`` hold (:func:`workload_runs`),
    per x: one column per run's commit, oldest first (:func:`.data.runs`), and ``newest / oldest`` and
    ``max / min`` across them. Whether a point is the kernel's or the run's: the same kernel's time that
    moves between runs where its other points do not is the run's spread (the logits-level JSD at
    V ≤ 8192, notebook 07). Raises ValueError when ``rows`` hold runs of two GPUs."""
    chosen = rows[(rows.kernel_provider == provider) & (rows.kernel_operation_mode == mode) & (rows.metric_name == metric)]
    runs = data.runs(chosen)
    gpus = {gpu for _, gpu in runs}
    if len(gpus) > 1:
        raise ValueError(f"rows hold runs on {', '.join(sorted(gpus))}: a time compares across runs of one GPU only")
    order = [commit for commit, _ in runs]
    table = chosen.pivot_table(index="x_value", columns="kernels_lib_commit", values="y_value_50", aggfunc="median")[order]
    table.columns.name = None
    return table.assign(**{"newest / oldest": table[order[-1]] / table[order[0]],
                           "max / min": table[order].max(axis=1) / table[order].min(axis=1)})


def per_element_excess(rows: pd.DataFrame, provider: str, mode: str, *, fit_from: float) -> pd.DataFrame:
    """How far a bandwidth-bound loss's small points sit above its own large ones, run by run.

    Per run that ``rows`` hold (:func:`.data.runs`), the time per element of ``provider``'s ``mode``
    (the median over its points with ``x ≥ fit_from`` of ``ms / (rows · V)``, both read off each row's
    configuration) predicts each point's time from its size alone; per point: the measured
    median, that ``model``, ``excess`` = measured − model, ``measured / model``, and the spread of the
    run's own samples, ``p80 − p20``. A per-element kernel sits on its model; an excess that moves
    between runs and comes with a wide spread within the run is not the kernel's work (the logits-level
    JSD at V ≤ 8192, notebook 07). Raises ValueError where a run has no point at ``x ≥ fit_from``."""
    chosen = rows[(rows.kernel_provider == provider) & (rows.kernel_operation_mode == mode) & (rows.metric_name == "speed")]
    out = []
    for commit, gpu in data.runs(chosen):
        of_run = chosen[(chosen.kernels_lib_commit == commit) & (chosen.gpu_name == gpu)]
        # One row per point (a point measured twice in a run: the median of each quantile).
        run = of_run.groupby("x_value").agg(y_value_50=("y_value_50", "median"), y_value_20=("y_value_20", "median"),
                                            y_value_80=("y_value_80", "median"),
                                            elements=("extra_benchmark_config_str", lambda c: _elements(c.iloc[0])))
        large = run[run.index >= fit_from]
        if not len(large):
            raise ValueError(f"run {commit} on {gpu} has no {provider} {mode} point at x >= {fit_from:g} to fit the time per element")
        per_element = (large.y_value_50 / large.elements).median()
        for x, row in run.iterrows():
            model = per_element * row.elements
            out.append({"run": commit, "gpu": gpu, "x": x, "measured ms": row.y_value_50, "model ms": model,
                        "excess ms": row.y_value_50 - model, "measured / model": row.y_value_50 / model,
                        "p80 - p20 ms": row.y_value_80 - row.y_value_20})
    return pd.DataFrame(out, columns=["run", "gpu", "x", "measured ms", "model ms", "excess ms", "measured / model", "p80 - p20 ms"])


def _elements(config: str) -> float:
    """Rows times classes of a logits-level point: ``N`` (or ``BT``, or ``B·T``) times ``V`` of its configuration."""
    sizes = json.loads(config)
    rows = sizes["N"] if "N" in sizes else sizes["BT"] if "BT" in sizes else sizes["B"] * sizes["T"]
    return float(rows) * float(sizes["V"])


def workloads(gpu_name: str | None = None) -> list[Workload]:
    """Every published chart, in the published CSV's order, with our rows (CUDA runs) for the same axis and
    configuration: per GPU we measured (only ``gpu_name`` when given), its newest kernels_lib run of the
    chart (:func:`.data.newest_run_per_gpu`), newest row per point within it. The published "huggingface"
    provider is renamed as the spec names its baseline (``torch`` for fused linear cross-entropy)."""
    published = data.load_published()
    result = []
    for kernel_name in published.kernel_name.unique():
        rows = published[published.kernel_name == kernel_name]
        baseline = _spec_baseline(kernel_name)
        if baseline:
            rows = rows.replace({"kernel_provider": {"huggingface": baseline}})
        measured = measured_on(kernel_name, gpu_name)
        configs = rows.extra_benchmark_config_str.map(lambda s: json.dumps(_config(s), sort_keys=True))
        for key in configs.unique():
            config = json.loads(key)
            of_gpu = data.newest_run_per_gpu(of_chart(measured, config, rows[configs == key].x_name.iloc[0]))
            per_gpu = {gpu: newest_per_point(run).reset_index(drop=True) for gpu, run in of_gpu.items()}
            mine = pd.concat(per_gpu.values(), ignore_index=True) if per_gpu else measured.iloc[:0].reset_index(drop=True)
            ordered = {k: config[k] for k in _config(rows[configs == key].extra_benchmark_config_str.iloc[0])}
            result.append(Workload(kernel_name, ordered, rows[configs == key].reset_index(drop=True), mine, per_gpu))
    return result


@dataclass(frozen=True)
class Floor:
    """The floor of a workload on one GPU (:func:`.floor.floor` of its run there) per mode (columns) and x
    (index), what bounds it at each x, and what set it (:func:`.floor.describe`)."""

    ms: pd.DataFrame
    bound: pd.Series
    gpu_name: str
    what: str

    @property
    def same_run(self) -> bool:
        """Always: a floor is of its rows' own run (a run that measured no ceilings has none)."""
        return True

    def describe(self) -> str:
        kind = {"bytes": "minimal bytes at the copy bandwidth", "matmul": "matmul FLOPs at the matmul rate"}
        bounds = " / ".join(kind[b] for b in dict.fromkeys(self.bound.dropna()))
        return f"floor on the {data.gpu_label(self.gpu_name)}: {bounds}; {self.what}"


def workload_floor(workload: Workload, ceilings: pd.DataFrame, modes=("forward", "full"), gpu_name: str | None = None) -> Floor | None:
    """The floor of ``workload`` on ``gpu_name`` (default: its first GPU) at its published and measured x:
    :func:`.floor.floor` of its run on that GPU, a published x the run did not time at the run's
    configuration. None where the workload has no run on that GPU, the loss no bench spec, or the run
    measured no ceilings (never another run's)."""
    gpu_name = gpu_name or next(iter(workload.gpus), None)
    rows = workload.on(gpu_name) if gpu_name is not None else workload.measured.iloc[:0]
    if not len(rows):
        return None
    xs = sorted(set(workload.published.x_value) | set(rows.x_value))
    floors = {mode: one_floor.floor(rows, ceilings, workload.kernel_name, mode, xs) for mode in modes}
    full = floors[modes[-1]]
    if full.ms.isna().all():
        return None
    return Floor(pd.DataFrame({mode: f.ms for mode, f in floors.items()}), full.bound, gpu_name,
                 one_floor.describe(rows, ceilings, workload.kernel_name))


def workload_floors(workload: Workload, ceilings: pd.DataFrame, modes=("forward", "full")) -> dict[str, Floor]:
    """The floor of ``workload`` on each GPU it was measured on (:func:`workload_floor`), GPUs whose run
    measured no ceilings left out; {} without measured rows."""
    floors = {gpu: workload_floor(workload, ceilings, modes, gpu) for gpu in workload.gpus}
    return {floor.gpu_name: floor for floor in floors.values() if floor is not None}


def gpus_measured(workload_list: list[Workload]) -> list[str]:
    """Every GPU with measured rows in ``workload_list`` (:func:`.data.gpus_measured`' order)."""
    return sorted({gpu for workload in workload_list for gpu in workload.gpus}, key=lambda g: (data.gpu_label(g), g))


def coverage_rows(workload: Workload) -> list[dict]:
    """What a workload holds, one row per GPU we measured it on (one row, ``none yet``, where none):
    published GPU and providers, our providers measured on that GPU and those of its spec that its run
    did not measure, and the run (commit, date)."""
    published = sorted(set(workload.published.kernel_provider))
    try:
        expected = [p for p in get_spec(workload.kernel_name).providers if "[" not in p]
    except ValueError:
        expected = ["kernels_lib", *published]
    common = {"workload": workload.title, "published on": data.gpu_label(workload.published_gpu),
              "published providers": ", ".join(published)}
    if not workload.gpus:
        return [{**common, "measured on": "none yet", "measured providers": "–", "not in this run": ", ".join(expected),
                 "commit": "–", "measured": "–"}]
    out = []
    for gpu in workload.gpus:
        rows = workload.on(gpu)
        measured = sorted(set(rows.kernel_provider))
        out.append({**common, "measured on": data.gpu_label(gpu), "measured providers": ", ".join(measured),
                    "not in this run": ", ".join(p for p in expected if p not in measured) or "–",
                    "commit": run_commit(rows) or "–", "measured": str(rows.timestamp.max())[:10]})
    return out


def coverage(workload: Workload) -> dict:
    """:func:`coverage_rows` as one row: each per-GPU field joined by "; " (in the order of ``measured on``)."""
    rows = coverage_rows(workload)
    return {key: rows[0][key] if key in ("workload", "published on", "published providers") else "; ".join(r[key] for r in rows)
            for key in rows[0]}


def datasheet_ratios(published_gpus, measured_gpus) -> pd.DataFrame:
    """Per (published GPU, measured GPU) of :data:`DATASHEETS`, how much more bandwidth and bf16 rate the
    measured GPU has: what the GPUs alone explain of a ratio of our time to a published one."""
    rows = []
    for theirs in sorted(set(published_gpus)):
        for ours in measured_gpus:
            a, b = DATASHEETS.loc[theirs], DATASHEETS.loc[ours]
            rows.append({"published on": data.gpu_label(theirs), "measured on": data.gpu_label(ours),
                         "bandwidth ×": b["bandwidth TB/s"] / a["bandwidth TB/s"],
                         "bf16 rate ×": b["bf16 dense TFLOP/s"] / a["bf16 dense TFLOP/s"]})
    return pd.DataFrame(rows, columns=["published on", "measured on", "bandwidth ×", "bf16 rate ×"])


def agreement_table(workload: Workload, floor: "Floor | dict[str, Floor] | None", tolerance: float = 0.25,
                    gpu_name: str | None = None) -> pd.DataFrame:
    """Where our re-measurement of a published provider agrees with its published time, on each GPU we
    measured (only ``gpu_name`` when given).

    One row per (GPU, provider, mode, x) measured in both: both medians, ``ratio`` = our time on that
    GPU / the published time on the published GPU, and ``expected``: the ratio the GPUs alone explain,
    from :data:`DATASHEETS` (published rate / ours, the bandwidth where the floor is bytes, the bf16 rate
    where it is the matmuls; NaN without a floor). ``floor``: one :class:`Floor` (what bounds the loss at
    each x: its bytes or its matmuls, a property of the loss and its sizes) or per GPU a dict of them
    (:func:`workload_floors`). ``verdict``: ``agrees`` when ratio / expected is within ``tolerance`` of
    1, else ``slower`` or ``faster than the GPUs explain``. A published mode whose harness measured
    another of ours (the spec's ``published_modes``: Megatron's ``backward`` is a forward and a
    backward) is paired with that mode of ours, named as published.
    """
    columns = ["workload", "gpu", "provider", "mode", "x", "published ms", "measured ms", "ratio", "expected", "ratio / expected",
               "verdict"]
    gpus = workload.gpus if gpu_name is None else [g for g in workload.gpus if g == gpu_name]
    parts = [_agreement_on(workload, gpu, floor.get(gpu) if isinstance(floor, dict) else floor, tolerance) for gpu in gpus]
    parts = [p for p in parts if len(p)]
    return pd.concat(parts, ignore_index=True)[columns] if parts else pd.DataFrame(columns=columns)


def _agreement_on(workload: Workload, gpu_name: str, floor: "Floor | None", tolerance: float) -> pd.DataFrame:
    """:func:`agreement_table`'s rows of one GPU."""
    published, measured = workload.published, workload.on(gpu_name)
    if not len(measured):
        return pd.DataFrame()
    speed = lambda rows: rows[rows.metric_name == "speed"].set_index(["kernel_provider", "kernel_operation_mode", "x_value"]).y_value_50  # noqa: E731
    try:
        published_modes = get_spec(workload.kernel_name).published_modes
    except ValueError:
        published_modes = {}
    ours = measured[measured.metric_name == "speed"]
    ours = pd.concat([ours[~ours.kernel_operation_mode.isin(list(published_modes))],
                      *(ours[ours.kernel_operation_mode == mine].assign(kernel_operation_mode=theirs)
                        for theirs, mine in published_modes.items())])
    both = pd.concat({"published ms": speed(published), "measured ms": speed(ours)}, axis=1, join="inner")
    both = both[both["measured ms"].notna()]  # a point that failed in our run (its note says why) has nothing to compare
    sheet_ours, sheet_theirs = DATASHEETS.loc[gpu_name], DATASHEETS.loc[workload.published_gpu]
    rate = {"bytes": "bandwidth TB/s", "matmul": "bf16 dense TFLOP/s"}
    rows = []
    for (provider, mode, x), row in both.iterrows():
        bound = floor.bound.get(x) if floor is not None else None
        expected = sheet_theirs[rate[bound]] / sheet_ours[rate[bound]] if bound else float("nan")
        ratio = row["measured ms"] / row["published ms"]
        relative = ratio / expected
        if relative != relative:
            verdict = "no floor to judge by"
        elif abs(relative - 1) <= tolerance:
            verdict = "agrees"
        else:
            verdict = "slower than the GPUs explain" if relative > 1 else "faster than the GPUs explain"
        rows.append({"workload": workload.title, "gpu": data.gpu_label(gpu_name), "provider": provider, "mode": mode, "x": x,
                     "published ms": row["published ms"], "measured ms": row["measured ms"], "ratio": ratio, "expected": expected,
                     "ratio / expected": relative, "verdict": verdict})
    return pd.DataFrame(rows)


def environment_table(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per (measured file, GPU, commit): the versions recorded beside the rows, the dates, and
    the number of rows. ``frames``: name -> measured rows (all of them, ``latest=False``)."""
    parts = []
    for name, rows in frames.items():
        if not len(rows):
            continue
        shown = [c for c in ENVIRONMENT_COLUMNS if c in rows.columns]
        grouped = rows.fillna({c: "" for c in shown}).groupby(["gpu_name", "kernels_lib_commit"], sort=False)
        table = grouped[shown].agg(lambda values: ", ".join(sorted(set(map(str, values)) - {""})) or "–")
        table["first"] = grouped.timestamp.min()
        table["last"] = grouped.timestamp.max()
        table["rows"] = grouped.size()
        table = table.reset_index()
        table.insert(0, "file", name)
        parts.append(table)
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


#: The columns every measured file carries, whatever its layout (``training_step.csv`` has its own:
#: :data:`kernels_workbench.training_step.COLUMNS`).
PROVENANCE_COLUMNS = ["gpu_name", "kernels_lib_commit", "timestamp"]


def measured_files() -> dict[str, pd.DataFrame]:
    """Every ``data/measured/*.csv`` (ceilings and the training-step rows included), all rows."""
    return {path.stem: data.read_rows(path, PROVENANCE_COLUMNS) for path in sorted(data.MEASURED_DIR.glob("*.csv"))}


def published_environment() -> pd.DataFrame:
    """The published runs: GPU, Liger version and date per kernel."""
    published = data.load_published()
    grouped = published.groupby("kernel_name", sort=False)
    return pd.DataFrame({
        "gpu_name": grouped.gpu_name.first(),
        "liger_version": grouped.liger_version.first(),
        "date": grouped.timestamp.max().str[:10],
    })


def speed_memory_x(rows: pd.DataFrame, mode: str = "full") -> int | None:
    """The x at which to draw speed against memory: among the x where the most providers have both a
    time and a memory of ``mode``, the middle one. None when no x has both."""
    selected = rows[rows.kernel_operation_mode == mode]
    pairs = selected.groupby(["x_value", "kernel_provider"]).metric_name.agg(lambda m: {"speed", "memory"} <= set(m))
    per_x = pairs.groupby(level="x_value").sum()
    per_x = per_x[per_x > 0]
    if not len(per_x):
        return None
    best = sorted(per_x[per_x == per_x.max()].index)
    return int(best[len(best) // 2])


def agreement_summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, GPU, provider, mode) of an :func:`agreement_table`: the range of ``ratio``,
    the ``expected`` ratio, and how many x agree, out of how many."""
    keys = ["workload", *(["gpu"] if "gpu" in table.columns else []), "provider", "mode"]
    if not len(table):
        return pd.DataFrame(columns=[*keys, "ratio min", "ratio max", "expected", "agree", "of", "finding"])
    grouped = table.groupby(keys, sort=False)
    summary = grouped.agg(**{
        "ratio min": ("ratio", "min"),
        "ratio max": ("ratio", "max"),
        "expected": ("expected", "first"),
        "agree": ("verdict", lambda v: int((v == "agrees").sum())),
        "of": ("verdict", "size"),
        "finding": ("verdict", lambda v: "; ".join(f"{n}× {verdict}" for verdict, n in v.value_counts().items())),
    })
    return summary.reset_index()


def _agreement_cell(part: pd.DataFrame) -> str:
    """``0.33–0.38×: agrees`` or ``0.10–0.20×: 1 of 3 agree, 2 faster``: one (chart, provider, mode)."""
    counts = part.verdict.value_counts()
    agree, n = int(counts.get("agrees", 0)), len(part)
    if agree == n:
        verdict = "agrees" if n > 1 else "agrees (1 point)"
    else:
        off = [f"{int(counts[v])} {v.split(' than')[0]}" for v in ("slower than the GPUs explain", "faster than the GPUs explain")
               if v in counts]
        verdict = f"{agree} of {n} agree, " + ", ".join(off)
    return f"{span([part.ratio.min(), part.ratio.max()])}: {verdict}"


def agreement_compact(table: pd.DataFrame) -> pd.DataFrame:
    """The agreement of an :func:`agreement_table` (of every workload), one row per (chart, GPU, provider):
    ``GPUs explain`` (the ``expected`` ratio, or its range) and one column per mode, ``ours / published``
    (the range of ``ratio`` over x) and its verdict (``agrees`` at every x, else how many points agree and
    how many are slower / faster than the GPUs explain). The per-point table stays in the CSV."""
    judged = table[table.verdict.isin(["agrees", "slower than the GPUs explain", "faster than the GPUs explain"])] if len(table) else table
    if not len(judged):
        return pd.DataFrame(columns=["chart", "provider", "GPUs explain"])
    modes = [m for m in ("forward", "backward", "full") if m in set(judged["mode"])]
    modes += sorted(set(judged["mode"]) - set(modes))
    rows = []
    judged = judged if "gpu" in judged.columns else judged.assign(gpu="")
    for (chart, gpu, provider), part in judged.groupby(["workload", "gpu", "provider"], sort=False):
        row = {"chart": chart, **({"GPU": gpu} if gpu else {}), "provider": provider,
               "GPUs explain": span([part.expected.min(), part.expected.max()])}
        for mode in modes:
            at = part[part["mode"] == mode]
            row[f"{mode}: ours / published"] = _agreement_cell(at) if len(at) else "–"
        rows.append(row)
    return pd.DataFrame(rows)


def agreement_sentences(table: pd.DataFrame) -> str:
    """One or two sentences over an :func:`agreement_table`: how many points agree, and the largest
    departure (its workload, provider, mode and ``ratio / expected``)."""
    judged = table[table["ratio / expected"].notna()] if len(table) else table
    if not len(judged):
        return "No provider is both published and measured on a GPU of ours yet: nothing to compare."
    agree = int((judged.verdict == "agrees").sum())
    text = (f"{agree} of {len(judged)} points ({agree / len(judged):.0%}) agree with the published times once the GPUs' "
            f"datasheet rates are accounted for.")
    off = judged[judged.verdict != "agrees"]
    if len(off):
        worst = off.loc[(off["ratio / expected"].map(lambda r: max(r, 1 / r))).idxmax()]
        on = f" on the {worst.gpu}" if "gpu" in off.columns and isinstance(worst.gpu, str) and worst.gpu else ""
        text += (f" The largest departure is {worst.provider} `{worst['mode']}` on `{worst.workload}`{on}: {worst['ratio / expected']:.2f}× "
                 f"what the GPUs explain ({worst.verdict.replace(' than the GPUs explain', '')}); software versions differ too.")
    return text
