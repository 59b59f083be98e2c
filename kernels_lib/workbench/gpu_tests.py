"""The GPU test target: the whole test suite on a CUDA machine, the CUDA-only routes included, recorded.

``./workbench test --gpu`` (or ``python -m kernels_lib.workbench.gpu_tests`` where the packages are
already installed, as on a lent GPU machine) runs ``pytest`` over ``tests/`` without the notebook and
browser tests (the notebooks at full size are the reports' job: ``./workbench reports --device cuda``):
every kernel test on CUDA tensors, and the tests marked ``gpu`` (``tests/test_gpu_routes.py``: the
Hopper routes of the fused cross-entropy, the class-major logits in the ``dW`` buffer, the TMA
epilogue GEMM, the stored shifted exponentials, float16's scaled gradients, the sequence losses'
chunks, each against float64 and bounded by the baseline's own error in the same dtype on the same
device), which a machine without CUDA deselects.

Tests that provoke a device-side assert run it in a subprocess (``tests/device_errors.py``), so one
cannot end the CUDA context of the rest. With ``pytest-xdist`` installed the suite is spread over
worker processes (``--workers``; each holds its own CUDA context on the one GPU).

Each run writes, under ``--out``: ``junit.xml``, ``pytest.log``, ``gpu_route_errors.csv`` (every
route's errors beside the baseline's) and ``gpu_test_runs.csv`` (one row: commit, GPU, versions,
passed / failed / skipped / deselected, minutes, the command); ``--record`` appends that row to
``data/measured/gpu_test_runs.csv``, which the dashboard reads (its newest row per target). A run that
selects tests (files, node ids, ``-k``) is recorded as the target ``gpu selection``, apart from the
whole suite's ``gpu``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from .bench.environment import git_commit, package_version

ROOT = Path(__file__).resolve().parents[2]
#: Where ``--record`` appends, and the dashboard reads.
RUNS_CSV = ROOT / "data" / "measured" / "gpu_test_runs.csv"
COLUMNS = ["timestamp", "kernels_lib_commit", "gpu_name", "torch_version", "triton_version", "transformers_version",
           "trl_version", "target", "passed", "failed", "skipped", "deselected", "minutes", "command"]
#: What the target leaves out: the notebooks (full size: the reports) and the browser.
MARKERS = "not notebook and not browser"


def counts_from_junit(path: Path) -> dict[str, int]:
    """``passed``, ``failed`` (failures and errors), ``skipped`` from a pytest JUnit XML file."""
    passed = failed = skipped = 0
    for case in ET.parse(path).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return {"passed": passed, "failed": failed, "skipped": skipped}


def deselected_from_log(text: str) -> int:
    """The ``N deselected`` of pytest's closing line (0 when it has none)."""
    found = re.findall(r"(\d+) deselected", text)
    return int(found[-1]) if found else 0


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


#: The ``target`` of a run that selected tests (files, node ids, ``-k``, ``-m``, ``--deselect``): its row
#: is kept apart from the whole target's, whose newest row the dashboard shows as *the* GPU test run.
SELECTION = "gpu selection"
_SELECTING_OPTIONS = ("-k", "-m", "--deselect", "--lf", "--last-failed", "--sw", "--stepwise")
_SHORT_SELECTING = ("-k", "-m")  # also with the value attached: -kgluon


def _named_tests(pytest_args: list[str]) -> list[str]:
    """The test files and node ids among ``pytest_args`` (``tests/test_x.py``, ``tests/test_x.py::test_y``)."""
    return [a for a in pytest_args if not a.startswith("-") and (ROOT / a.split("::")[0]).is_file()]


def run_target(pytest_args: list[str]) -> str:
    """``"gpu"`` for the whole suite, :data:`SELECTION` when ``pytest_args`` select part of it."""
    selecting = any(a.split("=")[0] in _SELECTING_OPTIONS or a[:2] in _SHORT_SELECTING for a in pytest_args)
    return SELECTION if _named_tests(pytest_args) or selecting else "gpu"


def pytest_command(pytest_args: list[str], junit: Path, workers: int) -> list[str]:
    """The pytest command line of a run: over ``tests/``, or over the test files and node ids that
    ``pytest_args`` name (files: ``tests/test_x.py``, ``tests/test_x.py::test_y``) in its place; the other
    arguments (``-k``, ``-x``, ...) are passed on. Without the replacement a named file would run beside
    the whole suite, not instead of it."""
    named = _named_tests(pytest_args)
    command = [sys.executable, "-m", "pytest", *([] if named else [str(ROOT / "tests")]), "-m", MARKERS, "-q", "-rfE",
               "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if workers > 0 and importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(workers), "--dist", "loadgroup"]
    return command + list(pytest_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./workbench test --gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu_tests", help="where the run's files go")
    parser.add_argument("--record", action="store_true", help=f"append the run's row to {RUNS_CSV.relative_to(ROOT)}")
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1),
                        help="pytest-xdist workers (when installed; 0: one process)")
    parser.add_argument("pytest_args", nargs="*",
                        help="more pytest arguments (after --); test files or node ids among them run instead of tests/")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the GPU test target needs a CUDA GPU, and torch sees none here; "
                     "on this machine run ./workbench test (the CPU suite, through Triton's interpreter)")
    args.out.mkdir(parents=True, exist_ok=True)
    junit, log = args.out / "junit.xml", args.out / "pytest.log"
    command = pytest_command(args.pytest_args, junit, args.workers)
    env = dict(os.environ, KERNELS_LIB_ROUTE_ERRORS=str(args.out / "gpu_route_errors.csv"), PYTHONUNBUFFERED="1")
    (args.out / "gpu_route_errors.csv").unlink(missing_ok=True)
    print(f"gpu_tests: {shlex.join(command)}", flush=True)
    start = time.monotonic()
    with log.open("w") as handle:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            handle.write(line)
            sys.stdout.write(line)
        code = process.wait()
    minutes = (time.monotonic() - start) / 60
    if not junit.exists():
        print(f"gpu_tests: pytest wrote no {junit} (exit code {code}); see {log}", file=sys.stderr)
        return code or 1
    counts = counts_from_junit(junit)
    row = run_row(counts, deselected_from_log(log.read_text()), minutes,
                  "./workbench test --gpu " + shlex.join(args.pytest_args) if args.pytest_args else "./workbench test --gpu",
                  target=run_target(args.pytest_args))
    (args.out / "gpu_test_runs.csv").unlink(missing_ok=True)
    append_rows([row], args.out / "gpu_test_runs.csv")
    if args.record:
        append_rows([row])
    print(f"gpu_tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
          f"{row['deselected']} deselected in {minutes:.1f} min on {row['gpu_name']}; row in {args.out / 'gpu_test_runs.csv'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
