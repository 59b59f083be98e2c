"""Provenance recorded beside every measured row: the device, versions, commit and time."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import os
import subprocess
from functools import lru_cache
from pathlib import Path

import torch
import triton

from ..paths import REPO_ROOT


def package_version(name: str) -> str:
    """The installed version of distribution ``name``, or ``""`` when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


@lru_cache(maxsize=1)
def git_commit() -> str:
    """The repository's HEAD commit (short), with ``+dirty`` when tracked files differ; ``unknown`` outside git.

    ``KERNELS_LIB_COMMIT`` in the environment overrides it, for copies of the tree without ``.git``
    (the GPU machine receives the working tree only).
    """
    if os.environ.get("KERNELS_LIB_COMMIT"):
        return os.environ["KERNELS_LIB_COMMIT"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT, capture_output=True, text=True
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` on CUDA (e.g. 'NVIDIA H200'); ``CPU (Triton interpreter)`` otherwise."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU (Triton interpreter)"


def provenance(device: torch.device | str) -> dict[str, str]:
    """The columns every measured row carries."""
    return {
        "gpu_name": device_name(device),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "liger_version": package_version("liger-kernel"),
        "cce_version": package_version("cut-cross-entropy"),
        "quack_version": package_version("quack-kernels"),
        "cutlass_dsl_version": package_version("nvidia-cutlass-dsl"),
        "torch_version": torch.__version__,
        "triton_version": triton.__version__,
        "kernels_lib_commit": git_commit(),
    }
