"""The studies' tests beside the suite's: ``tests/`` on the path (they reuse its checks and fixtures), and the
``gpu`` marker deselected on a machine without CUDA, as ``tests/conftest.py`` does for the suite (when both
folders are collected together, that file has already done it and this finds nothing left to drop)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[2] / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: a CUDA-only route (deselected, not skipped, on a machine without CUDA)")
    config.addinivalue_line("markers", "gpu_memory(gib): the test's measured peak reserved device memory in GiB (tests/conftest.py)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    here = Path(__file__).resolve().parent
    dropped = [item for item in items if item.get_closest_marker("gpu") and here in Path(str(item.fspath)).resolve().parents]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]
