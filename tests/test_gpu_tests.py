"""The GPU test target's runner (kernels_lib.workbench.gpu_tests): its counting, its record, its refusal
on a machine without CUDA. The target itself runs on a GPU machine (the closing notes and
data/measured/gpu_test_runs.csv say when)."""

from __future__ import annotations

import csv

import pytest
import torch

from kernels_lib.workbench import gpu_tests

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.a" name="ok"/>
<testcase classname="tests.a" name="ok2"/>
<testcase classname="tests.a" name="bad"><failure message="x">x</failure></testcase>
<testcase classname="tests.b" name="broken"><error message="y">y</error></testcase>
<testcase classname="tests.b" name="later"><skipped message="z"/></testcase>
</testsuite></testsuites>"""


def test_counts_from_junit_and_the_closing_line(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    assert gpu_tests.counts_from_junit(path) == {"passed": 2, "failed": 2, "skipped": 1}
    assert gpu_tests.deselected_from_log("...\n2 failed, 2 passed, 1 skipped, 37 deselected in 3.1s\n") == 37
    assert gpu_tests.deselected_from_log("5 passed in 1.0s") == 0


def test_rows_are_appended_with_one_header_and_checked(tmp_path):
    path = tmp_path / "runs.csv"
    row = gpu_tests.run_row({"passed": 3, "failed": 0, "skipped": 1}, 2, 4.25, "./workbench test --gpu")
    assert list(row) == gpu_tests.COLUMNS and row["minutes"] == "4.2" and row["target"] == "gpu"
    gpu_tests.append_rows([row], path)
    gpu_tests.append_rows([dict(row, target="reports")], path)
    read = list(csv.DictReader(path.open()))
    assert [r["target"] for r in read] == ["gpu", "reports"] and read[0]["passed"] == "3"
    with pytest.raises(ValueError, match="columns"):
        gpu_tests.append_rows([{"passed": 1}], path)


def test_named_test_files_run_instead_of_the_whole_suite(tmp_path):
    """``-- tests/test_x.py`` selects that file: a selection ran the whole suite beside it once (6f1fc79 on the H200)."""
    junit = tmp_path / "junit.xml"
    whole = gpu_tests.pytest_command(["-x"], junit, 0)
    assert str(gpu_tests.ROOT / "tests") in whole and whole[-1] == "-x"
    some = gpu_tests.pytest_command(["tests/test_gpu_tests.py", "tests/test_project.py::test_committed_notebooks_are_clean",
                                     "-k", "tests"], junit, 0)
    assert str(gpu_tests.ROOT / "tests") not in some
    assert some[-4:] == ["tests/test_gpu_tests.py", "tests/test_project.py::test_committed_notebooks_are_clean", "-k", "tests"]
    assert f"--junitxml={junit}" in some and "-m" in some  # the target's markers and report either way
    # an option's value that happens to name a folder ("-k tests") is no selection
    assert str(gpu_tests.ROOT / "tests") in gpu_tests.pytest_command(["-k", "tests"], junit, 0)


@pytest.mark.parametrize("args, target", [
    ([], "gpu"),
    (["-x", "-v", "--durations=30"], "gpu"),
    (["tests/test_gpu_tests.py"], "gpu selection"),
    (["tests/test_project.py::test_committed_notebooks_are_clean"], "gpu selection"),
    (["-k", "gluon"], "gpu selection"),
    (["-kgluon"], "gpu selection"),
    (["-m", "gpu"], "gpu selection"),
    (["--deselect=tests/test_gpu_tests.py::test_x"], "gpu selection"),
])
def test_a_selection_is_recorded_apart_from_the_whole_target(args, target):
    """A run of one test file (49 tests) recorded as target "gpu" became the dashboard's GPU test run,
    over the whole suite's 2276 (965a1c5 on the H200)."""
    assert gpu_tests.run_target(args) == target
    row = gpu_tests.run_row({"passed": 1, "failed": 0, "skipped": 0}, 0, 0.1, "cmd", target=gpu_tests.run_target(args))
    assert row["target"] == target


def test_refused_without_cuda_naming_what_to_run(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        gpu_tests.main([])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_reports_run_recorded_like_the_target(tmp_path, monkeypatch):
    """``report --record``: notebooks that ran as passed, failed ones as failed and named, the rest deselected."""
    from pathlib import Path

    from kernels_lib.workbench import report

    path = tmp_path / "runs.csv"
    monkeypatch.setattr(gpu_tests, "RUNS_CSV", path)
    monkeypatch.setattr(gpu_tests.append_rows, "__defaults__", (path,))
    reports = [(Path("r/01_cross_entropy.html"), 60.0, ""), (Path("r/05_training_step.html"), 30.0, "failed in cell 15")]
    row = report.record_run(reports, 10, 90.0, ["--device", "cuda", "--only", "01_cross_entropy", "05_training_step"])
    read = list(csv.DictReader(path.open()))
    assert len(read) == 1 and read[0]["target"] == "reports" and read[0]["minutes"] == "1.5"
    assert (read[0]["passed"], read[0]["failed"], read[0]["skipped"], read[0]["deselected"]) == ("1", "1", "0", "8")
    assert row["command"].endswith("(failed: 05_training_step)") and "--only 01_cross_entropy" in row["command"]
