"""The record of our own GPU runs (``data/measured/gpu_test_runs.csv``): one row per run of the GPU test
target (``tests/gpu_target.py``) or of the full-size reports, with the commit, the GPU and the versions.
These rows are the maintainers' record; no report shows them."""

from __future__ import annotations

import csv
import datetime as _dt
from pathlib import Path

import torch

from .bench.environment import git_commit, package_version
from .paths import REPO_ROOT

RUNS_CSV = REPO_ROOT / "data" / "measured" / "gpu_test_runs.csv"
COLUMNS = ["timestamp", "kernels_lib_commit", "gpu_name", "torch_version", "triton_version", "transformers_version",
           "trl_version", "target", "passed", "failed", "skipped", "deselected", "minutes", "command"]
#: What the target leaves out: the notebooks (full size: the reports) and the browser.

def run_row(counts: dict, deselected: int, minutes: float, command: str, target: str = "gpu") -> dict:
    """One row of :data:`RUNS_CSV` for a run on this machine's GPU."""
    return {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "kernels_lib_commit": git_commit(),
        "gpu_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch_version": torch.__version__,
        "triton_version": package_version("triton"),
        "transformers_version": package_version("transformers"),
        "trl_version": package_version("trl"),
        "target": target,
        **counts,
        "deselected": deselected,
        "minutes": f"{minutes:.1f}",
        "command": command,
    }


def append_rows(rows: list[dict], path: Path = RUNS_CSV) -> None:
    """Append ``rows`` to ``path`` (with the header when the file is new); refuses rows with other columns."""
    for row in rows:
        if list(row) != COLUMNS:
            raise ValueError(f"a GPU test run row must have the columns {COLUMNS}; got {list(row)}")
    new = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows(rows)
