"""Where the workbench finds the repository it serves: ``data/`` (the published and measured rows),
``notebooks/`` and ``reports/``. The workbench is installed from a clone (``pip install -e ./lab``, which
``./workbench`` does); ``KERNELS_WORKBENCH_ROOT`` names another clone."""

from __future__ import annotations

import os
from pathlib import Path


def _repo_root() -> Path:
    named = os.environ.get("KERNELS_WORKBENCH_ROOT")
    root = Path(named).resolve() if named else Path(__file__).resolve().parents[2]
    if not (root / "data" / "published").is_dir():
        raise RuntimeError(
            f"kernels_workbench needs the kernels_lib repository it came with (data/published/ under {root}): "
            "install it from a clone with `pip install -e ./lab`, or set KERNELS_WORKBENCH_ROOT to a clone")
    return root


REPO_ROOT = _repo_root()
DATA_DIR = REPO_ROOT / "data"
