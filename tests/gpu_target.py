"""The GPU test target: the whole test suite on a CUDA machine, the CUDA-only routes included, recorded.

``./workbench test --gpu`` (or ``python tests/gpu_target.py`` where the packages are
already installed, as on a lent GPU machine) runs ``pytest`` over ``tests/`` without the notebook and
browser tests (the notebooks at full size are the reports' job: ``./workbench reports --device cuda``):
every kernel test on CUDA tensors, and the tests marked ``gpu`` (``tests/test_gpu_routes.py``: the
Hopper routes of the fused cross-entropy, the class-major logits in the ``dW`` buffer, the TMA
epilogue GEMM, the stored shifted exponentials, float16's scaled gradients, the sequence losses'
chunks, each against float64 and bounded by the baseline's own error in the same dtype on the same
device), which a machine without CUDA deselects.

Tests that provoke a device-side assert run it in a subprocess (``tests/device_errors.py``), so one
cannot end the CUDA context of the rest.

The schedule follows the card's memory (:func:`plan`). A test that needs more than a few GiB declares
its measured peak with ``@pytest.mark.gpu_memory(gib)`` (``tests/conftest.py``). The run has two phases:
first the tests that fit a worker's share, spread over ``pytest-xdist`` workers (as many as the card
holds at that share, at most :data:`MAX_WORKERS`), each process held to its share
(``torch.cuda.set_per_process_memory_fraction``), so a test that outgrows it fails alone with an
out-of-memory error rather than starving its neighbours; then the heavier tests one at a time, each
with the whole card. A test whose need exceeds the card is skipped, naming both numbers.

Each run writes, under ``--out``: ``junit.xml`` and ``pytest.log`` per phase (``-alone`` for the second),
``gpu_route_errors.csv`` (every route's errors beside the baseline's), ``test_memory.csv`` (each test's
peak reserved device memory, its declared need and phase) and ``gpu_test_runs.csv`` (one row: commit,
GPU, versions, passed / failed / skipped / deselected, minutes, the command); ``--record`` appends that row
to ``data/measured/gpu_test_runs.csv``, which the dashboard reads (its newest row per GPU), and keeps the
memory table per GPU in ``data/measured/gpu_test_memory.csv``. A run that
selects tests (files, node ids, ``-k``) is recorded as the target ``gpu selection``, apart from the
whole suite's ``gpu``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib.util
import math
import os
import re
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from kernels_workbench.bench.environment import git_commit, package_version
from kernels_workbench.run_record import COLUMNS, RUNS_CSV, append_rows, run_row  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
#: Where ``--record`` appends, and the dashboard reads.
MARKERS = "not notebook and not browser"
#: Where ``--record`` keeps each test's peak reserved memory, per GPU (the source of the declarations).
MEMORY_CSV = ROOT / "data" / "measured" / "gpu_test_memory.csv"
MEMORY_COLUMNS = ["timestamp", "gpu_name", "torch_version", "triton_version", "kernels_lib_commit", "nodeid", "phase", "declared_gib", "peak_reserved_gib", "out_of_memory"]

GIB = 2**30
#: The environment the target hands to pytest: which phase runs, each process's share, where peaks go.
PHASE_ENV, SHARE_ENV, MEMORY_LOG_ENV = "KERNELS_LIB_GPU_PHASE", "KERNELS_LIB_GPU_SHARE_GIB", "KERNELS_LIB_GPU_MEMORY_LOG"
#: The parallel phase's share in every phase: a test that declares more runs alone.
BOUNDARY_ENV = "KERNELS_LIB_GPU_BOUNDARY_GIB"
SHARED, ALONE = "shared", "alone"
#: The phase that runs the tests that outgrew their share once more with the whole card, to measure
#: what to declare (they stay failed).
REMEASURE = "remeasure"
#: Workers at most (the suite's parallelism levels off; more CUDA contexts only cost memory).
MAX_WORKERS = 12
#: The smallest share a worker gets: the undeclared tests' peaks stay under it (the target lists the
#: largest undeclared peaks so that one that creeps up gets declared).
MIN_SHARE_GIB = 4.0
#: What a process's CUDA context, cuBLAS handles and Triton's modules hold outside torch's allocator,
#: and what the card keeps for itself: neither counts in a share.
CONTEXT_GIB, CARD_RESERVE_GIB = 0.75, 1.5
#: An undeclared test whose peak passes this is listed as one to declare.
DECLARE_ABOVE_GIB = 2.0


def card_gib(device: int = 0) -> float:
    """The card's memory in GiB."""
    return torch.cuda.get_device_properties(device).total_memory / GIB


def declared_gib(marker) -> float:
    """A ``gpu_memory(gib)`` marker's need in GiB (0 without one); refuses a marker without a positive number."""
    if marker is None:
        return 0.0
    if len(marker.args) != 1 or not isinstance(marker.args[0], (int, float)) or marker.args[0] <= 0:
        raise ValueError(f"gpu_memory takes one positive number of GiB (the test's measured peak); got {marker.args}")
    return float(marker.args[0])


def skip_reason(need_gib: float, card: float, gpu_name: str) -> str:
    """Why a test that needs ``need_gib`` cannot run on this card ('' when it can)."""
    if need_gib + CONTEXT_GIB <= card:
        return ""
    return (f"needs {need_gib:.1f} GiB of device memory (its measured peak, plus {CONTEXT_GIB} GiB for the CUDA "
            f"context); this {gpu_name} has {card:.1f} GiB")


def phase_of(need_gib: float, share_gib: float) -> str:
    """:data:`SHARED` for a test that fits a worker's share, :data:`ALONE` for one that runs by itself."""
    return SHARED if need_gib <= share_gib else ALONE


def schedule(needs: list[float], card: float, gpu_name: str, share: float, phase: str | None) -> list[tuple[bool, str]]:
    """For tests that declare ``needs`` (GiB; 0: none): whether each runs in ``phase`` (None or
    :data:`REMEASURE`: every test), and why it is skipped ('' when it runs). A test over the card is skipped
    in the shared phase, where a skip costs nothing."""
    out = []
    for need in needs:
        reason = skip_reason(need, card, gpu_name)
        where = SHARED if reason else phase_of(need, share)
        out.append((phase in (None, REMEASURE) or where == phase, reason))
    return out


def plan(card: float, cores: int, workers: int | None = None, share: float | None = None) -> tuple[int, float, float]:
    """``(workers, share, alone_share)`` in GiB for a card of ``card`` GiB and ``cores`` CPU cores.

    The workers follow the card: as many as hold :data:`MIN_SHARE_GIB` each beside their contexts (at most
    :data:`MAX_WORKERS` and the cores), then the card is split evenly among them. ``workers`` or ``share``
    given: the other follows from it. The alone phase's one process gets the card less its reserve."""
    usable = card - CARD_RESERVE_GIB
    alone = usable - CONTEXT_GIB
    if workers is None:
        fit = int(usable // ((share or MIN_SHARE_GIB) + CONTEXT_GIB))
        workers = max(1, min(MAX_WORKERS, cores, fit))
    if workers < 1:
        raise ValueError(f"--workers must be at least 1; got {workers}")
    if share is None:
        share = usable / workers - CONTEXT_GIB
    if workers * (share + CONTEXT_GIB) > usable:
        raise ValueError(f"{workers} workers of {share:.1f} GiB each (+{CONTEXT_GIB} GiB of context) do not fit the "
                         f"{usable:.1f} GiB this card has for tests; lower --workers or --share")
    return workers, math.floor(share * 100) / 100, math.floor(alone * 100) / 100


def log_test_memory(folder: str, nodeid: str, peak_gib: float, declared: float, phase: str,
                    out_of_memory: bool = False) -> None:
    """Append one test's peak to this process's file in ``folder`` (the target merges them)."""
    path = Path(folder) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}.csv"
    nodeid = re.sub(r"@[\w.-]+$", "", nodeid) if os.environ.get("PYTEST_XDIST_WORKER") else nodeid  # loadgroup's "@group"
    with path.open("a", newline="") as handle:
        csv.writer(handle).writerow([nodeid, phase, f"{declared:g}", f"{peak_gib:.3f}", int(out_of_memory)])


def merged_memory(folder: Path) -> list[dict]:
    """Every test's logged peak from ``folder``, largest first; a test measured again alone
    (:data:`REMEASURE`) keeps that measurement, its failed one marked ``out_of_memory``."""
    rows = {}
    for path in sorted(folder.glob("*.csv")):
        with path.open() as handle:
            for nodeid, phase, declared, peak, oom in csv.reader(handle):
                row = {"nodeid": nodeid, "phase": phase, "declared_gib": declared, "peak_reserved_gib": peak,
                       "out_of_memory": oom}
                if phase == REMEASURE:
                    row["out_of_memory"] = rows.get(nodeid, {}).get("out_of_memory", "1")
                if nodeid not in rows or phase == REMEASURE:
                    rows[nodeid] = row
    return sorted(rows.values(), key=lambda r: -float(r["peak_reserved_gib"]))


def memory_findings(rows: list[dict], share: float) -> list[str]:
    """What the run's peaks ask of the declarations: undeclared tests over :data:`DECLARE_ABOVE_GIB`, and
    declared tests that needed more than they declared."""
    lines = []
    for row in rows:
        peak, declared = float(row["peak_reserved_gib"]), float(row["declared_gib"])
        if row.get("out_of_memory") == "1":
            lines.append(f"outgrew its share in the {row['phase']} phase, peak alone {peak:.1f} GiB: {row['nodeid']} "
                         f"-> @pytest.mark.gpu_memory({peak * 1.15:.0f})")
        elif not declared and peak > DECLARE_ABOVE_GIB:
            lines.append(f"undeclared, peak {peak:.1f} GiB (share {share:.1f}): {row['nodeid']} "
                         f"-> @pytest.mark.gpu_memory({peak * 1.15:.0f})")
        elif declared and peak > declared:
            lines.append(f"declared {declared:g} GiB, peak {peak:.1f} GiB: {row['nodeid']}")
    return lines


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
    # -v: each test's outcome on its own line as it ends, so that a run cut short (a lent machine's call limit)
    # still names what failed before the cut; -rfE repeats the failures at the end.
    command = [sys.executable, "-m", "pytest", *([] if named else [str(ROOT / "tests")]), "-m", MARKERS, "-v", "-rfE",
               "--tb=short", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if workers > 0 and importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(workers), "--dist", "loadgroup"]
    return command + list(pytest_args)


def _run_phase(command: list[str], env: dict, log: Path) -> int:
    """Run one phase's pytest, its output to the terminal and to ``log`` line by line (flushed: a run killed at a
    time limit leaves its log); its exit code."""
    print(f"gpu_tests: {shlex.join(command)}", flush=True)
    with log.open("w") as handle:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in process.stdout:
            handle.write(line)
            handle.flush()
            sys.stdout.write(line)
            sys.stdout.flush()
        return process.wait()


def write_memory(rows: list[dict], path: Path, gpu_name: str, commit: str, when: str | None = None) -> None:
    """Keep ``rows`` as ``gpu_name``'s measurement in ``path``, the other GPUs' rows as they were; each row
    with the run's time (``when``, now by default), versions and commit."""
    kept = []
    if path.exists():
        with path.open() as handle:
            kept = [r for r in csv.DictReader(handle) if r["gpu_name"] != gpu_name]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=MEMORY_COLUMNS)
        writer.writeheader()
        writer.writerows(kept)
        stamp = {"timestamp": when or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"), "gpu_name": gpu_name,
                 "torch_version": torch.__version__, "triton_version": package_version("triton"),
                 "kernels_lib_commit": commit}
        writer.writerows({**stamp, **{k: r[k] for k in MEMORY_COLUMNS if k in r and k not in stamp}} for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./workbench test --gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu_tests", help="where the run's files go")
    parser.add_argument("--record", action="store_true", help=f"append the run's row to {RUNS_CSV.relative_to(ROOT)}")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest-xdist workers of the parallel phase (default: as many as the card's memory holds "
                             f"at {MIN_SHARE_GIB:g} GiB each, at most {MAX_WORKERS} and the cores)")
    parser.add_argument("--share", type=float, default=None,
                        help="GiB of device memory per worker (default: the card split among the workers)")
    parser.add_argument("pytest_args", nargs="*",
                        help="more pytest arguments (after --); test files or node ids among them run instead of tests/")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the GPU test target needs a CUDA GPU, and torch sees none here; "
                     "on this machine run ./workbench test (the CPU suite, through Triton's interpreter)")
    try:
        workers, share, alone = plan(card_gib(), os.cpu_count() or 1, args.workers, args.share)
    except ValueError as error:
        parser.error(str(error))
    if importlib.util.find_spec("xdist") is None:
        workers = 0
    args.out.mkdir(parents=True, exist_ok=True)
    memory_log = args.out / "test_memory"
    memory_log.mkdir(exist_ok=True)
    for stale in [*memory_log.glob("*.csv"), args.out / "gpu_route_errors.csv"]:
        stale.unlink(missing_ok=True)
    gpu_name = torch.cuda.get_device_name()
    print(f"gpu_tests: {gpu_name}, {card_gib():.1f} GiB: {workers} workers of {share:.1f} GiB each, then the tests "
          f"that declare more one at a time with {alone:.1f} GiB", flush=True)
    base_env = dict(os.environ, KERNELS_LIB_ROUTE_ERRORS=str(args.out / "gpu_route_errors.csv"), PYTHONUNBUFFERED="1",
                    **{MEMORY_LOG_ENV: str(memory_log), BOUNDARY_ENV: f"{share:.2f}"})
    start = time.monotonic()
    phases = [(SHARED, workers, share, args.out / "junit.xml", args.out / "pytest.log"),
              (ALONE, 0, alone, args.out / "junit-alone.xml", args.out / "pytest-alone.log")]
    counts, codes, deselected = {"passed": 0, "failed": 0, "skipped": 0}, [], 0
    for phase, phase_workers, phase_share, junit, log in phases:
        junit.unlink(missing_ok=True)
        env = dict(base_env, **{PHASE_ENV: phase, SHARE_ENV: f"{phase_share:.2f}"})
        code = _run_phase(pytest_command(args.pytest_args, junit, phase_workers), env, log)
        if code == 5 and phase == ALONE:  # no test declares more than the share: nothing to run alone
            continue
        codes.append(code)
        if not junit.exists():
            print(f"gpu_tests: pytest wrote no {junit} (exit code {code}); see {log}", file=sys.stderr)
            return code or 1
        for key, value in counts_from_junit(junit).items():
            counts[key] += value
        if phase == SHARED:
            deselected = deselected_from_log(log.read_text())
    outgrown = [r["nodeid"] for r in merged_memory(memory_log) if r["out_of_memory"] == "1"]
    if outgrown and len(outgrown) <= 20:  # measured again with the whole card, to say what to declare
        env = dict(base_env, **{PHASE_ENV: REMEASURE, SHARE_ENV: f"{alone:.2f}"})
        _run_phase([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", MARKERS, *outgrown],
                   env, args.out / "pytest-remeasure.log")
    minutes = (time.monotonic() - start) / 60
    memory = merged_memory(memory_log)
    write_memory(memory, args.out / "test_memory.csv", gpu_name, git_commit())
    for line in memory_findings(memory, share):
        print(f"gpu_tests: memory: {line}")
    print("gpu_tests: largest peaks (GiB): " + ", ".join(f"{r['nodeid'].split('/')[-1]} {float(r['peak_reserved_gib']):.1f}"
                                                         for r in memory[:8]))
    row = run_row(counts, deselected, minutes,
                  "./workbench test --gpu " + shlex.join(args.pytest_args) if args.pytest_args else "./workbench test --gpu",
                  target=run_target(args.pytest_args))
    (args.out / "gpu_test_runs.csv").unlink(missing_ok=True)
    append_rows([row], args.out / "gpu_test_runs.csv")
    if args.record:
        append_rows([row])
        if row["target"] == "gpu":
            write_memory(memory, MEMORY_CSV, gpu_name, row["kernels_lib_commit"])
    print(f"gpu_tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
          f"{row['deselected']} deselected in {minutes:.1f} min on {row['gpu_name']}; row in {args.out / 'gpu_test_runs.csv'}")
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
