"""Suite-wide setup: the ``gpu`` and ``gpu_memory`` markers, and the GPU target's memory-aware schedule.

``gpu``: a test of a route that exists only on CUDA (the Hopper kernels; ``tests/test_gpu_routes.py``).
On a machine without CUDA such tests are *deselected*, not skipped, and the header says how many: they
are not counted at all there, and ``./workbench test --gpu`` (``tests/gpu_target.py``) runs
them with the rest of the suite on a CUDA machine.

``gpu_memory(gib)``: the test's peak reserved device memory in GiB, as the GPU target measured it
(``test_memory.csv`` of a run). On CUDA a test that declares more than the card has is skipped, naming
both numbers. Under the GPU target (``KERNELS_LIB_GPU_PHASE``) the tests whose need fits a worker's share
run in the parallel phase, the others alone afterwards, and every process is held to its share of the
card (``torch.cuda.set_per_process_memory_fraction``): a test that outgrows it fails with an
out-of-memory error of its own instead of filling the card under its neighbours. Each test's peak
reserved memory is logged where ``KERNELS_LIB_GPU_MEMORY_LOG`` points.
"""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import gpu_target as _target  # tests/gpu_target.py: the GPU target's scheduler


def _hold_to_a_share_of_the_cores(config) -> None:
    """An xdist worker (one per core) runs torch on its share of the cores, and so do the processes it starts
    (notebook kernels, gloo ranks, scripts: ``OMP_NUM_THREADS``): two workers of two threads each on two cores
    spend their time waiting for each other (a mixed CPU selection ran about 15 % faster held so). An
    ``OMP_NUM_THREADS`` already set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not hasattr(config, "workerinput") or workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_configure(config):
    _hold_to_a_share_of_the_cores(config)
    config.addinivalue_line("markers", "gpu: a CUDA-only route (deselected, not skipped, on a machine without CUDA)")
    config.addinivalue_line("markers", "shared_notebook: reads a notebook execution shared by the run's workers (tests/notebook_runs.py)")
    config.addinivalue_line("markers", "gpu_memory(gib): the test's measured peak reserved device memory in GiB; "
                                       "the GPU target runs it alone when it exceeds a worker's share, and skips it "
                                       "on a card with less memory")
    if hasattr(config.option, "testrunuid") and not hasattr(config, "workerinput") and not config.option.testrunuid:
        # The run's id, chosen here so that the process that starts the workers knows their shared
        # notebook folder and removes it at the end (pytest_sessionfinish).
        config.option.testrunuid = uuid.uuid4().hex
    if torch.cuda.is_available() and os.environ.get(_target.SHARE_ENV):
        share = float(os.environ[_target.SHARE_ENV])
        torch.cuda.set_per_process_memory_fraction(min(1.0, share / _target.card_gib()))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        kept, dropped = [], []
        for item in items:
            (dropped if item.get_closest_marker("gpu") else kept).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
            config._kernels_lib_gpu_deselected = len(dropped)
        return
    card, name = _target.card_gib(), torch.cuda.get_device_name()
    phase = os.environ.get(_target.PHASE_ENV)
    share = float(os.environ.get(_target.BOUNDARY_ENV) or card)  # the parallel phase's share: which phase a test is in
    needs = [_target.declared_gib(item.get_closest_marker("gpu_memory")) for item in items]
    kept = []
    for item, (runs, reason) in zip(items, _target.schedule(needs, card, name, share, phase)):
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
        if runs:
            kept.append(item)
    items[:] = kept  # the other phase runs the rest: not deselected, only elsewhere


def pytest_sessionfinish(session):
    """The run's notebook executions are removed by the process that started the run (they are ~140 MB)."""
    import notebook_runs  # noqa: PLC0415 (tests/ is on the path: the tests import it so)

    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller removes the shared folder after every worker is done
    uid = getattr(session.config.option, "testrunuid", None)
    notebook_runs.remove(notebook_runs.shared_dir(uid) if uid else None)
    notebook_runs.remove(notebook_runs.own_dir())


def pytest_report_header(config):
    if torch.cuda.is_available():
        phase = os.environ.get(_target.PHASE_ENV)
        where = f"; phase {phase!r}, a share of {os.environ.get(_target.SHARE_ENV)} GiB per process" if phase else ""
        return f"kernels_lib: CUDA ({torch.cuda.get_device_name()}, {_target.card_gib():.1f} GiB): the gpu-marked tests run{where}"
    return "kernels_lib: no CUDA: the gpu-marked tests are deselected (./workbench test --gpu on a CUDA machine)"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "OutOfMemoryError" in str(report.longrepr):
        item._kernels_lib_out_of_memory = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's peak reserved device memory (setup, call and teardown), logged for the GPU target."""
    log = os.environ.get(_target.MEMORY_LOG_ENV)
    if not (log and torch.cuda.is_available()):
        yield
        return
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_reserved() / _target.GIB
    declared = _target.declared_gib(item.get_closest_marker("gpu_memory"))
    _target.log_test_memory(log, item.nodeid, peak, declared, os.environ.get(_target.PHASE_ENV, ""),
                            getattr(item, "_kernels_lib_out_of_memory", False))
