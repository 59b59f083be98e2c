"""Suite-wide setup: the ``gpu`` marker, and device errors checked where they cannot poison the suite.

``gpu``: a test of a route that exists only on CUDA (the Hopper kernels; ``tests/test_gpu_routes.py``).
On a machine without CUDA such tests are *deselected*, not skipped, and the header says how many: they
are not counted at all there, and ``./workbench test --gpu`` (``kernels_lib.workbench.gpu_tests``) runs
them with the rest of the suite on a CUDA machine.
"""

from __future__ import annotations

import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: a CUDA-only route (deselected, not skipped, on a machine without CUDA)")
    config.addinivalue_line("markers", "shared_notebook: reads a notebook execution shared by the run's workers (tests/notebook_runs.py)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("gpu") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        config._kernels_lib_gpu_deselected = len(dropped)


def pytest_report_header(config):
    if torch.cuda.is_available():
        return f"kernels_lib: CUDA ({torch.cuda.get_device_name()}): the gpu-marked tests run"
    return "kernels_lib: no CUDA: the gpu-marked tests are deselected (./workbench test --gpu on a CUDA machine)"
