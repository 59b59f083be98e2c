"""Each notebook executed once per test process, shared by its own test and the browser tests.

The notebook tests (``tests/test_notebook_*.py``, ``test_notebooks.py``, ``test_overview.py``,
``test_training_step.py``) and the browser tests (``test_browser.py``) read the same executions: the
runner's CPU parameters (:func:`kernels_lib.workbench.report.notebook_parameters`) plus a
``results_dir`` for the check tables, executed by :func:`kernels_lib.workbench.report.run_notebook`
into one folder, as ``./workbench reports`` does. Executing each notebook once, not twice, is most of
what keeps CI within its time (the notebooks are about half of the suite's CPU time). The tests that
share them carry ``xdist_group("notebooks")``, so that under pytest-xdist's ``--dist loadgroup`` they
all run in one worker, which holds this cache.

A notebook that fails is recorded as failed and raises again for every test that asks for it.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from kernels_lib.workbench import report

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
#: The mark of every test that reads a shared execution (one xdist worker for all of them).
GROUP = pytest.mark.xdist_group("notebooks")

_root: Path | None = None
_runs: dict[str, tuple[Path, float, str]] = {}


def out_dir() -> Path:
    """The folder the shared executions go to: ``executed/``, the HTML reports, ``results/<stem>/``."""
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="kernels_lib-notebooks-"))
    return _root


def results_dir(notebook: Path) -> Path:
    """Where ``notebook`` writes its check tables (its ``results_dir`` parameter)."""
    return out_dir() / "results" / notebook.stem


def run(notebook: Path, timeout: int = 900) -> tuple[Path, float, str]:
    """``(html path, seconds, failure)`` of ``notebook``'s shared execution, running it on first use."""
    if notebook.name not in _runs:
        parameters = {**report.notebook_parameters("cpu"), "results_dir": str(results_dir(notebook))}
        start = time.perf_counter()
        try:
            html, failure = report.run_notebook(notebook, out_dir(), parameters, timeout), ""
        except report.NotebookFailed as error:
            html, failure = out_dir() / notebook.with_suffix(".html").name, str(error)
        _runs[notebook.name] = (html, time.perf_counter() - start, failure)
    return _runs[notebook.name]


def executed(notebook: Path, timeout: int = 900) -> tuple[Path, Path, Path]:
    """``(html path, results dir, executed notebook path)`` of ``notebook``; fails the calling test
    with the runner's message when the notebook failed."""
    html, _, failure = run(notebook, timeout)
    if failure:
        pytest.fail(failure, pytrace=False)
    return html, results_dir(notebook), out_dir() / "executed" / notebook.name


def all_reports() -> list[tuple[Path, float, str]]:
    """Every notebook of ``notebooks/`` in the runner's order (:func:`report.run_order`), each executed
    once: the ``(html, seconds, failure)`` list :func:`report.write_index` takes."""
    return [run(notebook) for notebook in report.run_order(sorted(NOTEBOOKS.glob("*.ipynb")))]
