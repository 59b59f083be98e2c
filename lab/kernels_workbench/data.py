"""The data behind the charts: published rows (``data/published/``) and our measurements (``data/measured/``).

Both share the published CSV's columns (SPEC §3); measured rows add provenance
(:data:`kernels_workbench.bench.sweep.MEASURED_COLUMNS`). A missing or unreadable file raises an error
that names it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from .paths import DATA_DIR
PUBLISHED_ROWS = DATA_DIR / "published" / "liger_benchmark_rows.csv"
MEASURED_DIR = DATA_DIR / "measured"

_REQUIRED = ["kernel_name", "kernel_provider", "kernel_operation_mode", "metric_name", "x_value", "y_value_50", "gpu_name"]


#: Columns that name a commit: always text, so an all-digit short hash (``1234567``) or one that reads as
#: a float (``1234e56``) stays the commit it names and compares equal to the commit a run was given.
TEXT_COLUMNS = {"kernels_lib_commit": str, "commit": str}


def read_table(path: Path | str, **kwargs) -> pd.DataFrame:
    """``pd.read_csv`` with :data:`TEXT_COLUMNS` read as text: every measured CSV is read through it."""
    return pd.read_csv(path, dtype=TEXT_COLUMNS, **kwargs)


def read_rows(path: Path | str, required: list[str] = _REQUIRED) -> pd.DataFrame:
    """Read one CSV of benchmark rows, checking it has the columns the charts need."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark data file {path} does not exist")
    try:
        frame = read_table(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise ValueError(f"benchmark data file {path} is not a readable CSV: {error}") from error
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise ValueError(f"benchmark data file {path} lacks the column(s) {', '.join(missing)}")
    numeric = [c for c in ("x_value", "y_value_50", "y_value_20", "y_value_80") if c in frame.columns]
    for column in numeric:
        converted = pd.to_numeric(frame[column], errors="coerce")
        unreadable = converted.isna() & frame[column].notna()  # an empty cell is a failed point, not an error
        if unreadable.any():
            bad = frame.loc[unreadable, column].iloc[0]
            raise ValueError(f"benchmark data file {path}: column {column} holds a non-number ({bad!r})")
        frame[column] = converted
    return frame


def load_published(kernel_name: str | None = None) -> pd.DataFrame:
    """Liger's published rows for the four losses, optionally one ``kernel_name`` (e.g. ``kl_div``)."""
    frame = read_rows(PUBLISHED_ROWS)
    return frame if kernel_name is None else frame[frame.kernel_name == kernel_name].reset_index(drop=True)


def measured_path(kernel_name: str) -> Path:
    """Where the sweeps of ``kernel_name`` are appended (one CSV per loss; ``ceilings`` for the ceilings)."""
    return measured_file(f"{kernel_name}.csv")


def measured_file(name: str | Path) -> Path:
    """The file ``name`` (a path inside ``data/measured/``, e.g. ``gpu_runs/training_step_torch_lce.csv``),
    resolved when called: a module keeps the name, not the path, so a changed :data:`MEASURED_DIR` (a
    test's folder) moves every reader with it."""
    return MEASURED_DIR / name


def load_measured(kernel_name: str, *, latest: bool = True) -> pd.DataFrame:
    """Our measured rows of ``kernel_name``; with ``latest``, only the newest row of each
    (GPU, provider, mode, metric, x, config), so re-runs replace older figures on the charts."""
    path = measured_path(kernel_name)
    if not path.exists():
        return pd.DataFrame(columns=_REQUIRED)
    frame = read_rows(path)
    if latest and len(frame):
        key = ["gpu_name", "kernel_provider", "kernel_operation_mode", "metric_name", "x_value", "extra_benchmark_config_str"]
        frame = frame.sort_values("timestamp").drop_duplicates(key, keep="last").reset_index(drop=True)
    return frame


def run_commit(rows: pd.DataFrame) -> str | None:
    """The commit of the newest kernels_lib row (else of the newest row): the run whose ceilings judge them."""
    if not len(rows):
        return None
    ours = rows[rows.kernel_provider.str.startswith("kernels_lib")] if "kernel_provider" in rows else rows.iloc[:0]
    return str((ours if len(ours) else rows).sort_values("timestamp", kind="stable").kernels_lib_commit.iloc[-1])


def newest_run(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of the newest run (:func:`run_commit`) of rows that several runs appended."""
    return rows[rows.kernels_lib_commit == run_commit(rows)].reset_index(drop=True)


#: What makes one run: the commit of kernels_lib that was measured and the GPU it ran on. Two rows
#: are comparable (a ratio, a target's verdict) only when they agree on both.
RUN_COLUMNS = ("kernels_lib_commit", "gpu_name")


def runs(rows: pd.DataFrame) -> list[tuple[str, str]]:
    """The runs ``(kernels_lib_commit, gpu_name)`` that ``rows`` hold, oldest first (by their newest row)."""
    if not len(rows):
        return []
    missing = [c for c in RUN_COLUMNS if c not in rows.columns]
    if missing:
        raise ValueError(f"rows lack the run column(s) {', '.join(missing)}: which run they come from is unknown")
    order = rows.assign(_t=rows["timestamp"].astype(str) if "timestamp" in rows else "").groupby(list(RUN_COLUMNS))._t.max()
    return [(str(commit), str(gpu)) for commit, gpu in order.sort_values(kind="stable").index]


def run_label(rows: pd.DataFrame) -> str:
    """Which run ``rows`` come from, as the notebooks and the index print it: ``run of commit C on GPU
    (date)``. Raises ``ValueError`` naming the runs when ``rows`` mix several (their ratios would compare
    two runs) or hold none."""
    found = runs(rows)
    if len(found) != 1:
        what = ", ".join(f"{c} on {g}" for c, g in found) or "no rows"
        raise ValueError(f"rows of one run expected (one kernels_lib_commit and one gpu_name), got {what}")
    (commit, gpu), date = found[0], str(rows["timestamp"].max())[:10] if "timestamp" in rows else ""
    return f"run of commit {commit} on {gpu}" + (f" ({date})" if date else "")


def one_run(rows: pd.DataFrame, commit: str | None = None, gpu_name: str | None = None) -> pd.DataFrame:
    """The rows of one run: of ``commit`` on ``gpu_name`` when given, else of the newest kernels_lib row's
    commit and GPU (:func:`run_commit`). Every ratio the notebooks, the dashboard and the README print is
    taken within such rows (:func:`same_run_pairs`), so a peer missing from the run is *not measured*
    rather than filled in from another run."""
    if not len(rows):
        return rows
    runs(rows)  # the run columns are there
    if commit is None or gpu_name is None:
        ours = rows[rows.kernel_provider.astype(str).str.startswith("kernels_lib")] if "kernel_provider" in rows else rows.iloc[:0]
        newest = (ours if len(ours) else rows).sort_values("timestamp", kind="stable").iloc[-1]
        commit = str(newest.kernels_lib_commit) if commit is None else commit
        gpu_name = str(newest.gpu_name) if gpu_name is None else gpu_name
    chosen = (rows.kernels_lib_commit.astype(str) == str(commit)) & (rows.gpu_name.astype(str) == str(gpu_name))
    return rows[chosen].reset_index(drop=True)


#: The words of a GPU's full name that say nothing a reader of a chart needs (the vendor; the memory's
#: technology, where its size is named too).
_LABEL_DROPPED = re.compile(r"^NVIDIA\s+|\s+HBM\w*$", re.I)


def gpu_label(gpu_name: str) -> str:
    """A GPU's short name as the charts and cards print it: ``NVIDIA H100 80GB HBM3`` → ``H100 80GB``,
    ``NVIDIA H200`` → ``H200``, ``NVIDIA A100-SXM4-80GB`` → ``A100 80GB``, ``NVIDIA H100 PCIe`` →
    ``H100 PCIe``; a name it cannot shorten (``CPU (Triton interpreter)``) is kept."""
    name = _LABEL_DROPPED.sub("", str(gpu_name).strip())
    name = re.sub(r"-SXM\d*-", " ", name)
    return re.sub(r"-PCIE-?", " PCIe ", name, flags=re.I).strip() or str(gpu_name)


def cuda_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows measured on a CUDA GPU (all of them where the rows name no ``device``)."""
    return rows[rows.device.astype(str) == "cuda"] if "device" in rows.columns else rows


def gpus_measured(rows: pd.DataFrame) -> list[str]:
    """The GPUs (``gpu_name``) whose CUDA rows ``rows`` hold, by short label (:func:`gpu_label`): every GPU
    the charts, cards and the overview show beside the published rows, none preferred."""
    if not len(rows):
        return []
    if "gpu_name" not in rows.columns:
        raise ValueError("rows lack the column gpu_name: which GPU measured them is unknown")
    names = {str(g) for g in cuda_rows(rows).gpu_name.dropna()}
    return sorted(names, key=lambda g: (gpu_label(g), g))


def newest_run_per_gpu(rows: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Per GPU of :func:`gpus_measured`, the rows of its newest run (:func:`one_run` of that GPU's CUDA
    rows: the commit of its newest kernels_lib row). Each value is one run, so every ratio taken in it
    (:func:`same_run_pairs`) is within one commit on one GPU; two GPUs are never paired."""
    cuda = cuda_rows(rows)
    return {gpu: one_run(cuda[cuda.gpu_name.astype(str) == gpu]) for gpu in gpus_measured(rows)}


def same_run_pairs(rows: pd.DataFrame, ours: str, peers: list[str] | tuple[str, ...], metric: str = "speed",
                   mode: str = "full") -> pd.DataFrame:
    """The pairing behind every ratio: per x and peer, ``ours``' and the peer's median of ``metric`` in
    ``mode`` and their ratio, both taken from one run.

    ``rows`` must be one run's (:func:`one_run`); rows that mix runs raise ``ValueError`` (:func:`run_label`),
    so no printed ratio can set a number of one commit or GPU beside one of another. A peer the run did
    not measure at an x gives NaN there (shown as *not measured*). Columns: ``x``, ``peer``, ``ours``,
    ``peer value``, ``ratio``, ``run``."""
    label = run_label(rows)
    chosen = rows[(rows.metric_name == metric) & (rows.kernel_operation_mode == mode)]
    table = chosen.pivot_table(index="x_value", columns="kernel_provider", values="y_value_50")
    if ours not in table.columns:
        table[ours] = float("nan")
    out = []
    for peer in peers:
        theirs = table[peer] if peer in table.columns else pd.Series(float("nan"), index=table.index)
        for x in table.index:
            a, b = float(table.at[x, ours]), float(theirs[x])
            out.append({"x": float(x), "peer": peer, "ours": a, "peer value": b, "ratio": a / b if b == b and b != 0 else float("nan"),
                        "run": label})
    return pd.DataFrame(out, columns=["x", "peer", "ours", "peer value", "ratio", "run"])


def append_measured(rows: pd.DataFrame, kernel_name: str, directory: Path | str | None = None) -> Path:
    """Append ``rows`` to ``data/measured/<kernel_name>.csv`` (header written once) and return the path;
    to ``<directory>/<kernel_name>.csv`` instead where given (a run's own output folder).

    A file written before columns were added at the end of the layout (a peer's version) is rewritten
    once with them, empty in its old rows; any other difference of columns is refused."""
    path = measured_path(kernel_name) if directory is None else Path(directory) / f"{kernel_name}.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        existing = read_rows(path)
        old, new = list(existing.columns), list(rows.columns)
        if old != new:
            if new[: len(old)] != old:
                raise ValueError(f"benchmark data file {path} has other columns than the rows to append")
            existing.reindex(columns=new).to_csv(path, index=False)
    rows.to_csv(path, mode="a", header=not path.exists(), index=False)
    return path
