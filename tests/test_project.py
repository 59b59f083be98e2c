"""The project's own files: environment.yml against pyproject, CI against the README, committed notebooks clean."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def environment() -> dict:
    return yaml.safe_load((ROOT / "environment.yml").read_text())


def _conda_deps(environment: dict) -> tuple[list[str], list[str]]:
    """(conda specs, pip lines) of environment.yml."""
    conda, pip = [], []
    for entry in environment["dependencies"]:
        if isinstance(entry, dict):
            pip.extend(entry.get("pip", []))
        else:
            conda.append(str(entry))
    return conda, pip


def _conda_python_version(conda: list[str]) -> str:
    pins = [re.fullmatch(r"python\s*=?=\s*([0-9][0-9.]*)", spec.replace(" ", "")) for spec in conda]
    pins = [m.group(1) for m in pins if m]
    assert len(pins) == 1, f"environment.yml should pin python once; got {conda}"
    return pins[0]


# --------------------------------------------------------------------------- environment.yml


def test_environment_pins_python_and_pip(environment):
    conda, pip = _conda_deps(environment)
    version = _conda_python_version(conda)
    assert len(Version(version).release) >= 2, f"python pinned to a minor version at least, got {version}"
    assert "pip" in [re.split(r"[=<>]", spec)[0].strip() for spec in conda]
    assert pip, "environment.yml installs nothing through pip"


@pytest.mark.parametrize("folder", [".", "./lab"])
def test_environment_installs_each_package_with_its_extras(environment, folder):
    """environment.yml installs the library (``-e .[extras]``) and the workbench (``-e ./lab[extras]``),
    each with every extra its own pyproject defines (the environment is the full workbench)."""
    _, pip = _conda_deps(environment)
    pattern = re.escape(folder) + r"\[([^\]]+)\]"
    found = [re.fullmatch(r"-e\s+" + pattern, line.strip()) for line in pip]
    found = [m for m in found if m]
    assert len(found) == 1, f"environment.yml should install `-e {folder}[extras]` once; got {pip}"
    extras = {e.strip() for e in found[0].group(1).split(",")}
    defined = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras == set(defined), f"{sorted(extras)} vs {sorted(defined)}"


def test_environment_python_satisfies_requires_python(environment, pyproject):
    conda, _ = _conda_deps(environment)
    version = _conda_python_version(conda)
    requires = SpecifierSet(pyproject["project"]["requires-python"])
    assert Version(version) in requires, f"python {version} vs requires-python {requires}"


def test_environment_keeps_no_second_dependency_list(environment, pyproject):
    """pyproject is the one list: environment.yml names only python, pip and the package itself."""
    conda, pip = _conda_deps(environment)
    names = {re.split(r"[=<>\s]", spec)[0] for spec in conda}
    assert names == {"python", "pip"}, conda
    assert len(pip) == 2, pip


# --------------------------------------------------------------------------- CI and README


def _ci_test_command() -> str:
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line.startswith("./workbench")]
    assert len(commands) == 1, f".ci/run should call ./workbench once; got {commands}"
    return commands[0]


def test_ci_runs_workbench_test():
    command = shlex.split(_ci_test_command())
    assert command[:2] == ["./workbench", "test"]


def test_readme_mentions_the_ci_test_command(pyproject):
    readme = ROOT / pyproject["project"]["readme"]
    assert readme.name == "README.md"
    if readme.exists():
        text = readme.read_text()
        ci = " ".join(shlex.split(_ci_test_command())[:2])
        assert ci == "./workbench test"
        assert ci in text, f"README.md does not show the test command CI runs ({ci})"
    else:  # being written: at least the workbench that CI calls must offer the command
        assert re.search(r"^\s*test\)", (ROOT / "workbench").read_text(), re.MULTILINE)


def test_workbench_test_runs_pytest():
    """`./workbench test` runs pytest; `./workbench test --gpu` the recorded GPU target."""
    text = (ROOT / "workbench").read_text()
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.strip().startswith("test)")), None)
    assert start is not None
    case = "\n".join(lines[start:next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith(";;")) + 1])
    assert "-m pytest -n auto" in case and "tests/gpu_target.py --record" in case


# --------------------------------------------------------------------------- notebooks


def notebook_problems(notebook: dict) -> list[str]:
    """What is wrong with a notebook to commit: outputs, execution counts, cells without a unique id (nbformat
    4.5 and later require one: nbformat warns today, and will refuse), a missing or non-literal parameters cell."""
    problems = []
    cells = notebook.get("cells", [])
    if (notebook.get("nbformat", 4), notebook.get("nbformat_minor", 0)) >= (4, 5):
        ids = [cell.get("id") for cell in cells]
        problems += [f"cell {number} has no id" for number, cell_id in enumerate(ids) if not cell_id]
        if len({i for i in ids if i}) != len([i for i in ids if i]):
            problems.append("cell ids repeat")
    for number, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {number} has outputs")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {number} has execution_count {cell['execution_count']}")
    tagged = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(tagged) != 1:
        return problems + [f"{len(tagged)} cells tagged parameters (want exactly 1)"]
    cell = tagged[0]
    if cell.get("cell_type") != "code":
        return problems + ["the parameters cell is not code"]
    source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        return problems + [f"parameters cell does not parse: {error}"]
    if not tree.body:
        problems.append("parameters cell assigns nothing")
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and all(isinstance(t, ast.Name) for t in statement.targets):
            value = statement.value
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value:
            value = statement.value
        else:
            problems.append(f"parameters cell line {statement.lineno} is not a plain assignment")
            continue
        try:
            ast.literal_eval(value)
        except ValueError:
            problems.append(f"parameters cell line {statement.lineno} is not a literal: {ast.unparse(value)}")
    return problems


def _committed_notebooks() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "notebooks/*.ipynb"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
        return [ROOT / name for name in listed if (ROOT / name).exists()]
    except (OSError, subprocess.CalledProcessError):  # a copy without .git
        return sorted((ROOT / "notebooks").glob("*.ipynb"))


def _cell(source, cell_type="code", tags=(), outputs=(), count=None):
    cell = {"cell_type": cell_type, "metadata": {"tags": list(tags)}, "source": source}
    if cell_type == "code":
        cell.update(outputs=list(outputs), execution_count=count)
    return cell


def test_notebook_checker_accepts_a_clean_notebook():
    good = {"cells": [
        _cell("# Title", "markdown"),
        _cell(['device = "auto"  # comment\n', "seed: int = 0\n", "sizes = {'N': 2, 'V': [64, 128]}\n", "flag = None"], tags=["parameters"]),
        _cell("x = seed + 1"),
    ]}
    assert notebook_problems(good) == []


@pytest.mark.parametrize(
    "cells,fragment",
    [
        ([_cell("a = 1", tags=["parameters"], outputs=[{"output_type": "stream", "text": "x"}])], "outputs"),
        ([_cell("a = 1", tags=["parameters"], count=3)], "execution_count"),
        ([_cell("a = 1")], "0 cells tagged"),
        ([_cell("a = 1", tags=["parameters"]), _cell("b = 2", tags=["parameters"])], "2 cells tagged"),
        ([_cell("import torch\na = 1", tags=["parameters"])], "not a plain assignment"),
        ([_cell("a = torch.float32", tags=["parameters"])], "not a literal"),
        ([_cell("a = 2 ** 10", tags=["parameters"])], "not a literal"),
        ([_cell("a.b = 1", tags=["parameters"])], "not a plain assignment"),
    ],
    ids=["outputs", "count", "no-parameters", "two-parameters", "import", "name", "expression", "attribute"],
)
def test_notebook_checker_rejects(cells, fragment):
    problems = notebook_problems({"cells": cells})
    assert any(fragment in p for p in problems), problems


def test_notebook_checker_wants_unique_cell_ids_from_nbformat_4_5():
    cells = [dict(_cell("# Title", "markdown"), id="a"), _cell("a = 1", tags=["parameters"])]
    assert notebook_problems({"cells": cells}) == []  # before 4.5 cells have no ids
    assert "cell 1 has no id" in notebook_problems({"nbformat": 4, "nbformat_minor": 5, "cells": cells})
    cells[1]["id"] = "a"
    assert "cell ids repeat" in notebook_problems({"nbformat": 4, "nbformat_minor": 5, "cells": cells})
    cells[1]["id"] = "b"
    assert notebook_problems({"nbformat": 4, "nbformat_minor": 5, "cells": cells}) == []


def test_committed_notebooks_are_clean():
    notebooks = _committed_notebooks()
    assert notebooks, "no committed notebooks under notebooks/"
    found = {path.name: notebook_problems(json.loads(path.read_text())) for path in notebooks}
    assert all(path.parent.name == "notebooks" for path in notebooks)
    bad = {name: problems for name, problems in found.items() if problems}
    assert not bad, bad


def test_interpreter_refuses_the_triton_numpy_pair_that_breaks_it():
    from kernels_lib._runtime import check_interpreter_versions

    with pytest.raises(ImportError, match="numpy<2.3 or triton>=3.9"):
        check_interpreter_versions("3.6.0", "2.4.1")
    check_interpreter_versions("3.6.0", "2.2.6")
    check_interpreter_versions("3.9.0", "2.4.1")


#: The parameters every notebook takes from the runner (kernels_workbench.report) or a test.
RUNNER_PARAMETERS = ("device", "size", "interactive", "record", "results_dir", "seed")


@pytest.mark.parametrize("path", _committed_notebooks(), ids=lambda p: p.stem)
def test_each_notebook_takes_the_runner_parameters(path):
    notebook = json.loads(path.read_text())
    tagged = [c for c in notebook["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1
    source = "".join(tagged[0]["source"]) if isinstance(tagged[0]["source"], list) else tagged[0]["source"]
    assigned = {t.id for s in ast.parse(source).body if isinstance(s, ast.Assign) for t in s.targets}
    assert set(RUNNER_PARAMETERS) <= assigned, f"missing {set(RUNNER_PARAMETERS) - assigned}"


def test_readme_is_a_manual():
    """The README opens with the two commands, says how long a CPU run takes and how large the
    environment grows, carries no commit hashes or run narratives, and points at nothing outside the
    repository (docs/spec.md holds what users need of the specification)."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: a manual fits in a few screens"
    first_screen = "\n".join(lines[:30])
    assert "./workbench reports" in first_screen and "./workbench test" in first_screen
    assert "2.9 GB" in text
    # The CPU time it states is the one the run's estimate comes from (data/report_times.csv), within a third.
    said = re.search(r"`./workbench reports` takes about (\d+(?:\.\d+)?) minutes on 2 cores", text)
    assert said, "README.md must say how long ./workbench reports takes on a CPU"
    times = pd.read_csv(ROOT / "data" / "report_times.csv")
    recorded = times[times.device == "cpu"].seconds.sum() / 60
    assert abs(float(said.group(1)) - recorded) <= recorded / 3, (said.group(0), recorded)
    assert "./workbench test --gpu" in text and "./workbench reports --device cuda" in text
    assert "../shared" not in text
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", w) and re.search(r"[0-9]", w)]
    assert not hashes, f"commit hashes in README.md: {hashes}"
    for path in re.findall(r"`((?:docs|data|kernels_lib|scripts|tests)/[^`\s<]*)`", text):
        assert (ROOT / path).exists(), f"README.md names {path}, which does not exist"
    spec = (ROOT / "docs" / "spec.md").read_text()
    assert "lse" in spec and "128256" in spec and "../shared" not in spec


def test_a_parallel_run_removes_its_shared_notebook_folder(tmp_path):
    """The notebook executions of a run (~140 MB) do not outlive it: the process that started the
    xdist workers removes their shared folder."""
    root = Path(__file__).resolve().parents[1]
    folder = tmp_path / "kernels_lib-notebooks-cleanup"
    folder.mkdir()
    (folder / "executed.html").write_text("x")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("KERNELS_LIB_KEEP_NOTEBOOK_RUNS", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", "--testrunuid=cleanup",
         "tests/test_project.py::test_ci_runs_workbench_test"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert not folder.exists(), "the shared notebook folder outlived the run"


def test_kept_notebook_runs_stay_and_say_where(tmp_path, monkeypatch, capsys):
    """With KERNELS_LIB_KEEP_NOTEBOOK_RUNS set, the end of a run leaves the executions and says where they are."""
    import notebook_runs

    folder = tmp_path / "kernels_lib-notebooks-kept"
    folder.mkdir()
    monkeypatch.setenv(notebook_runs.KEEP_ENV, "1")
    notebook_runs.remove(folder)
    assert folder.exists() and str(folder) in capsys.readouterr().out
    monkeypatch.delenv(notebook_runs.KEEP_ENV)
    notebook_runs.remove(folder)
    assert not folder.exists()


def test_an_xdist_worker_runs_torch_on_its_share_of_the_cores(monkeypatch):
    """conftest: each of N workers (and what it starts) gets cores // N threads; a set OMP_NUM_THREADS is kept."""
    import types

    import conftest
    import torch

    before = torch.get_num_threads()
    worker = types.SimpleNamespace(workerinput={})
    try:
        monkeypatch.setattr(os, "cpu_count", lambda: 8)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        conftest._hold_to_a_share_of_the_cores(worker)
        assert os.environ["OMP_NUM_THREADS"] == "2" and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        conftest._hold_to_a_share_of_the_cores(worker)
        assert os.environ["OMP_NUM_THREADS"] == "3" and torch.get_num_threads() == 2  # the user's setting stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        conftest._hold_to_a_share_of_the_cores(types.SimpleNamespace())  # the controller, or a run without workers
        assert "OMP_NUM_THREADS" not in os.environ
    finally:
        torch.set_num_threads(before)
