"""The GPU test target's runner (tests/gpu_target.py): its counting, its record, its refusal
on a machine without CUDA. The target itself runs on a GPU machine (the closing notes and
data/measured/gpu_test_runs.csv say when)."""

from __future__ import annotations

import csv

import pytest
import torch

import gpu_target as gpu_tests

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
    some = gpu_tests.pytest_command(["tests/test_gpu_target.py", "tests/test_project.py::test_committed_notebooks_are_clean",
                                     "-k", "tests"], junit, 0)
    assert str(gpu_tests.ROOT / "tests") not in some
    assert some[-4:] == ["tests/test_gpu_target.py", "tests/test_project.py::test_committed_notebooks_are_clean", "-k", "tests"]
    assert f"--junitxml={junit}" in some and "-m" in some  # the target's markers and report either way
    # an option's value that happens to name a folder ("-k tests") is no selection
    assert str(gpu_tests.ROOT / "tests") in gpu_tests.pytest_command(["-k", "tests"], junit, 0)


@pytest.mark.parametrize("args, target", [
    ([], "gpu"),
    (["-x", "-v", "--durations=30"], "gpu"),
    (["tests/test_gpu_target.py"], "gpu selection"),
    (["tests/test_project.py::test_committed_notebooks_are_clean"], "gpu selection"),
    (["-k", "gluon"], "gpu selection"),
    (["-kgluon"], "gpu selection"),
    (["-m", "gpu"], "gpu selection"),
    (["--deselect=tests/test_gpu_target.py::test_x"], "gpu selection"),
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

    from kernels_workbench import report

    path = tmp_path / "runs.csv"
    monkeypatch.setattr(gpu_tests, "RUNS_CSV", path)
    monkeypatch.setattr(gpu_tests.append_rows, "__defaults__", (path,))
    reports = [(Path("r/01_cross_entropy.html"), 60.0, ""), (Path("r/05_training_step.html"), 30.0, "failed in cell 15")]
    row = report.record_run(reports, 10, 90.0, ["--device", "cuda", "--only", "01_cross_entropy", "05_training_step"])
    read = list(csv.DictReader(path.open()))
    assert len(read) == 1 and read[0]["target"] == "reports" and read[0]["minutes"] == "1.5"
    assert (read[0]["passed"], read[0]["failed"], read[0]["skipped"], read[0]["deselected"]) == ("1", "1", "0", "8")
    assert row["command"].endswith("(failed: 05_training_step)") and "--only 01_cross_entropy" in row["command"]


# --- The memory-aware schedule: the card's memory sets the workers, the declared needs the phases.

@pytest.mark.parametrize("card, cores, workers", [(79.18, 16, 12), (139.8, 16, 12), (23.6, 16, 4), (79.18, 2, 2), (10.0, 16, 1)])
def test_the_workers_follow_the_cards_memory(card, cores, workers):
    got, share, alone = gpu_tests.plan(card, cores)
    assert got == workers
    assert share >= gpu_tests.MIN_SHARE_GIB or got == 1, share
    # the shares and their contexts fit the card less its reserve; the alone phase gets nearly all of it
    assert got * (share + gpu_tests.CONTEXT_GIB) <= card - gpu_tests.CARD_RESERVE_GIB + 1e-6
    assert alone == pytest.approx(card - gpu_tests.CARD_RESERVE_GIB - gpu_tests.CONTEXT_GIB, abs=0.01)


def test_an_explicit_plan_that_overfills_the_card_is_refused():
    assert gpu_tests.plan(79.18, 16, workers=4)[1] > 15  # fewer workers: larger shares
    assert gpu_tests.plan(79.18, 16, share=9.0)[0] == 7
    with pytest.raises(ValueError, match="do not fit"):
        gpu_tests.plan(79.18, 16, workers=12, share=8.0)
    with pytest.raises(ValueError, match="at least 1"):
        gpu_tests.plan(79.18, 16, workers=0)


def test_phases_and_skips_from_the_declared_needs():
    needs = [0.0, 3.0, 6.0, 52.0, 90.0]
    share = 5.7
    shared = gpu_tests.schedule(needs, 79.18, "NVIDIA H100 80GB HBM3", share, gpu_tests.SHARED)
    alone = gpu_tests.schedule(needs, 79.18, "NVIDIA H100 80GB HBM3", share, gpu_tests.ALONE)
    # every test runs in exactly one phase; the one over the card is skipped in the shared phase
    assert [r for r, _ in shared] == [True, True, False, False, True]
    assert [r for r, _ in alone] == [False, False, True, True, False]
    reason = shared[-1][1]
    assert "needs 90.0 GiB" in reason and "79.2 GiB" in reason and "H100" in reason
    assert not any(why for _, why in shared[:-1])
    # on an H200 the 90 GiB test runs, alone
    h200 = gpu_tests.schedule(needs, 139.8, "NVIDIA H200", 10.7, gpu_tests.ALONE)
    assert [r for r, _ in h200] == [False, False, False, True, True] and not any(why for _, why in h200)
    # outside the target (plain pytest on a GPU) and when measuring again, everything runs
    assert all(r for r, _ in gpu_tests.schedule(needs[:4], 79.18, "x", share, None))
    assert all(r for r, _ in gpu_tests.schedule(needs[:4], 79.18, "x", share, gpu_tests.REMEASURE))


def test_a_declaration_must_be_a_positive_number_of_gib():
    assert gpu_tests.declared_gib(None) == 0.0
    assert gpu_tests.declared_gib(pytest.mark.gpu_memory(14).mark) == 14.0
    for bad in (pytest.mark.gpu_memory().mark, pytest.mark.gpu_memory("lots").mark, pytest.mark.gpu_memory(-1).mark):
        with pytest.raises(ValueError, match="one positive number of GiB"):
            gpu_tests.declared_gib(bad)


def test_peaks_are_merged_and_what_to_declare_is_said(tmp_path, monkeypatch):
    log = tmp_path / "log"
    log.mkdir()
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    gpu_tests.log_test_memory(str(log), "tests/test_a.py::small", 0.4, 0.0, gpu_tests.SHARED)
    gpu_tests.log_test_memory(str(log), "tests/test_a.py::creeping", 3.1, 0.0, gpu_tests.SHARED)
    gpu_tests.log_test_memory(str(log), "tests/test_a.py::outgrew", 5.7, 0.0, gpu_tests.SHARED, out_of_memory=True)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "main")
    gpu_tests.log_test_memory(str(log), "tests/test_b.py::heavy", 55.0, 52.0, gpu_tests.ALONE)
    gpu_tests.log_test_memory(str(log), "tests/test_a.py::outgrew", 9.2, 0.0, gpu_tests.REMEASURE)
    rows = gpu_tests.merged_memory(log)
    assert [r["nodeid"].split("::")[1] for r in rows] == ["heavy", "outgrew", "creeping", "small"]
    outgrew = rows[1]
    assert outgrew["peak_reserved_gib"] == "9.200" and outgrew["out_of_memory"] == "1"  # measured alone, still failed
    found = gpu_tests.memory_findings(rows, 5.7)
    assert any("outgrew its share" in f and "gpu_memory(11)" in f for f in found), found
    assert any("undeclared, peak 3.1" in f and "creeping" in f for f in found), found
    assert any("declared 52 GiB, peak 55.0" in f for f in found), found
    assert not any("small" in f for f in found)
    # the record keeps each GPU's newest measurement
    path = tmp_path / "memory.csv"
    gpu_tests.write_memory(rows, path, "NVIDIA H200", "aaaaaaa")
    gpu_tests.write_memory(rows[:1], path, "NVIDIA H100 80GB HBM3", "bbbbbbb")
    gpu_tests.write_memory(rows[:2], path, "NVIDIA H100 80GB HBM3", "ccccccc")
    read = list(csv.DictReader(path.open()))
    assert list(read[0]) == gpu_tests.MEMORY_COLUMNS
    by_gpu = {g: [r for r in read if r["gpu_name"] == g] for g in ("NVIDIA H200", "NVIDIA H100 80GB HBM3")}
    assert len(by_gpu["NVIDIA H200"]) == 4 and len(by_gpu["NVIDIA H100 80GB HBM3"]) == 2
    assert {r["kernels_lib_commit"] for r in by_gpu["NVIDIA H100 80GB HBM3"]} == {"ccccccc"}


def test_heavy_gpu_tests_declare_their_need():
    """The float64 references at the published N hold tens of GiB: each such case carries a declaration."""
    import ast
    from pathlib import Path

    source = (Path(__file__).parent / "test_gpu_routes.py").read_text()
    assert "gpu_memory(" in source and "NEEDS_GIB" in source
    tree = ast.parse(source)
    needs = next(n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "NEEDS_GIB")
    assert {k.value for k in needs.keys} >= {4096, 8192, 16384}
