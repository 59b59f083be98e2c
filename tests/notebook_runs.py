"""Each notebook executed once per test run, shared by its own test and the browser tests.

The notebook tests (``tests/test_notebook_*.py``, ``test_notebooks.py``, ``test_overview.py``,
``test_training_step.py``) and the browser tests (``test_browser.py``) read the same executions: the
runner's CPU parameters (:func:`kernels_workbench.report.notebook_parameters`) plus a
``results_dir`` for the check tables, executed by :func:`kernels_workbench.report.run_notebook`
into one folder, as ``./workbench reports`` does. Executing each notebook once, not twice, is most of
what keeps CI within its time (the notebooks are about half of the suite's CPU time).

Under pytest-xdist the folder is shared by every worker of the run (named by xdist's
``PYTEST_XDIST_TESTRUNUID``): the first worker to ask for a notebook executes it under a file lock,
and any other worker asking meanwhile waits for it and reads the result. (xdist's ``loadgroup``
does not keep a group on one worker with pytest 9.2 and pytest-xdist 3.8: the group suffix is not
applied, seen here, so the sharing cannot rest on it.)

A notebook that fails is recorded as failed and fails every test that asks for it, with the runner's
message.

The folder is removed when the run ends (``conftest.pytest_sessionfinish``, in the process that
started the run), unless ``KERNELS_LIB_KEEP_NOTEBOOK_RUNS`` is set: each run writes about 140 MB.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from filelock import FileLock

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
#: The mark of every test that reads a shared execution (``shared_notebook``, registered in conftest.py).
GROUP = pytest.mark.shared_notebook

_root: Path | None = None
_own: Path | None = None
#: Set it (to anything) to keep a run's executed notebooks and reports after the run.
KEEP_ENV = "KERNELS_LIB_KEEP_NOTEBOOK_RUNS"


def shared_dir(run: str) -> Path:
    """The folder every worker of the xdist run ``run`` shares."""
    return Path(tempfile.gettempdir()) / f"kernels_lib-notebooks-{run}"


def remove(folder: Path | None) -> None:
    """Remove a run's folder at the end of the run, unless :data:`KEEP_ENV` is set (then it says where)."""
    if folder is None or not folder.exists():
        return
    if os.environ.get(KEEP_ENV):
        print(f"\nkernels_lib: the notebook executions are kept in {folder}")
        return
    shutil.rmtree(folder, ignore_errors=True)


def out_dir() -> Path:
    """The folder the shared executions go to: ``executed/``, the HTML reports, ``results/<stem>/``;
    one per xdist run (every worker the same), else one per process (:func:`own_dir`)."""
    global _root, _own
    if _root is None:
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        if run:
            _root = shared_dir(run)
            _root.mkdir(exist_ok=True)
        else:
            _root = _own = Path(tempfile.mkdtemp(prefix="kernels_lib-notebooks-"))
    return _root


def own_dir() -> Path | None:
    """The folder this process made for itself (a run without xdist workers), None if it made none: the
    one this process removes at the end; an xdist run's shared folder is its controller's to remove."""
    return _own


def results_dir(notebook: Path) -> Path:
    """Where ``notebook`` writes its check tables (its ``results_dir`` parameter)."""
    return out_dir() / "results" / notebook.stem


def run(notebook: Path, timeout: int = 900) -> tuple[Path, float, str]:
    """``(html path, seconds, failure)`` of ``notebook``'s shared execution, running it on first use."""
    from kernels_workbench import report  # noqa: PLC0415 (the run's controller imports this module only to clean up)

    done = out_dir() / f"{notebook.stem}.run.json"
    with FileLock(str(out_dir() / f"{notebook.stem}.lock")):
        if not done.exists():
            parameters = {**report.notebook_parameters("cpu"), "results_dir": str(results_dir(notebook))}
            start = time.perf_counter()
            try:
                html, failure = report.run_notebook(notebook, out_dir(), parameters, timeout), ""
            except report.NotebookFailed as error:
                html, failure = out_dir() / notebook.with_suffix(".html").name, str(error)
            done.write_text(json.dumps({"html": str(html), "seconds": time.perf_counter() - start, "failure": failure}))
        record = json.loads(done.read_text())
    return Path(record["html"]), record["seconds"], record["failure"]


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
    from kernels_workbench import report  # noqa: PLC0415

    return [run(notebook) for notebook in report.run_order(sorted(NOTEBOOKS.glob("*.ipynb")))]
