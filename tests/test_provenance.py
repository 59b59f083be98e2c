"""Provenance: every ratio the notebooks print or chart is taken within one run (one kernels_lib_commit on
one GPU). The helpers that pair or judge rows refuse rows of two runs; the overview's workloads hold one
run each; a floor says whose ceilings it used; and the notebooks' ratio code goes through the one-run helpers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from kernels_workbench import data, overview
from kernels_workbench.bench import analysis
from synthetic_rows import kl_rows, two_runs

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
H200 = overview.H200


@pytest.mark.parametrize("judge", [
    lambda rows: analysis.preference_targets(rows, {}, baseline="torch"),
    lambda rows: data.same_run_pairs(rows, "kernels_lib", ["liger"]),
])
def test_a_judge_of_targets_refuses_rows_of_two_runs(judge):
    rows = two_runs()
    with pytest.raises(ValueError, match="one run"):
        judge(rows)
    with pytest.raises(ValueError, match="one run"):  # the same commit on two GPUs is two runs too
        judge(pd.concat([kl_rows("kernels_lib", 1.0, 1.0, "c"), kl_rows("liger", 2.0, 2.0, "c", gpu="NVIDIA H100")]))
    judge(data.one_run(rows))  # one run: judged


def test_ceiling_run_names_the_run_that_measured_it():
    ceilings = pd.DataFrame([
        {"kernel_name": "copy", "gpu_name": H200, "kernels_lib_commit": c, "timestamp": t, "y_value_50": v}
        for c, t, v in (("a", "2026-01-01", 3000.0), ("b", "2026-01-02", 4000.0))
    ])
    assert analysis.ceiling_run(ceilings, "copy", H200, "a") == (3000.0, "a")
    assert analysis.ceiling_run(ceilings, "copy", H200, "z") == (4000.0, "b")  # z measured none: b's, and it says so


def test_workloads_hold_one_run_and_the_floor_says_whose_ceilings(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    two_runs().to_csv(tmp_path / "kl_div.csv", index=False)
    (kl,) = [w for w in overview.workloads() if w.kernel_name == "kl_div"]
    assert set(kl.measured.kernels_lib_commit) == {"new"} and set(kl.measured.kernel_provider) == {"kernels_lib"}
    assert kl.run.startswith("run of commit new on NVIDIA H200")
    assert "liger" in overview.coverage(kl)["not in this run"]
    ceilings = pd.DataFrame([
        {"kernel_name": name, "gpu_name": H200, "kernels_lib_commit": "old", "timestamp": "2026-01-01", "y_value_50": rate}
        for name, rate in (("copy", 4000.0), ("matmul", 700.0))
    ])
    assert overview.workload_floor(kl, ceilings) is None, "the rows' run measured no ceilings: no floor, not another run's"
    same = overview.workload_floor(kl, ceilings.assign(kernels_lib_commit="new"))
    assert same.same_run and "copy 4000 GB/s measured in this run" in same.describe()


def test_agreement_compact_has_one_row_per_chart_and_provider():
    table = pd.DataFrame([
        {"workload": "kl", "provider": "liger", "mode": m, "x": x, "ratio": r, "expected": 0.42, "ratio / expected": r / 0.42,
         "verdict": v}
        for m, x, r, v in (("forward", 1, 0.43, "agrees"), ("forward", 2, 0.46, "agrees"),
                           ("full", 1, 0.21, "faster than the GPUs explain"), ("full", 2, 0.40, "agrees"))
    ])
    compact = overview.agreement_compact(table)
    assert len(compact) == 1 and compact.loc[0, "GPUs explain"] == "0.42×"
    assert compact.loc[0, "forward: ours / published"] == "0.43–0.46×: agrees"
    assert compact.loc[0, "full: ours / published"] == "0.21–0.40×: 1 of 2 agree, 1 faster"
    text = overview.agreement_sentences(table)
    assert text.startswith("3 of 4 points (75%) agree") and "liger `full` on `kl`" in text


# --------------------------------------------------------------------------- the notebooks' source

#: Notebooks whose ratios and targets come from data/measured rows, and the one-run helpers each must call.
ONE_RUN_NOTEBOOKS = {
    "02_kl_divergence": ("data.one_run", "data.run_label"),
    "03_orpo": ("data.one_run", "data.run_label"),
    "04_kto": ("data.one_run", "data.run_label"),
    "06_preference_dpo_cpo_simpo_grpo": ("data.one_run", "data.run_label"),
    "08_distillation": ("data.one_run", "data.run_label"),
    "09_tensor_parallel": ("data.one_run", "data.run_label"),
}
#: Helpers that pick runs as the named one does: the newest run of each GPU is data.one_run per GPU.
ONE_RUN_ALTERNATIVES = {"data.one_run": ("data.newest_run_per_gpu",)}
#: Picking a run by hand: the newest row's commit, or the rows of one commit without the GPU.
BY_HAND = [r"kernels_lib_commit\.iloc\[-1\]", r"kernels_lib_commit == commit\]", r"kernels_lib_commit\)\.iloc\[-1\]"]


def _code(stem: str) -> str:
    notebook = json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text(encoding="utf-8"))
    return "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")


@pytest.mark.parametrize("stem", sorted(ONE_RUN_NOTEBOOKS))
def test_a_notebook_takes_its_ratios_within_one_run(stem):
    code = _code(stem)
    for helper in ONE_RUN_NOTEBOOKS[stem]:
        called = [h for h in (helper, *ONE_RUN_ALTERNATIVES.get(helper, ())) if h + "(" in code]
        assert called, f"{stem} does not call {helper}"
    for pattern in BY_HAND:
        assert not re.search(pattern, code), f"{stem} picks a run by hand ({pattern}): use data.one_run"
    # measured rows newest-per-point (data.load_measured's default) mix runs: a notebook judging them reads every run
    assert not re.search(r"load_measured\((?![^)]*latest=False)[^)]*\)", code.replace('load_measured("ceilings", latest=False)', "")), stem


def test_the_overview_prints_the_compact_agreement_and_each_charts_run():
    code = _code("00_overview")
    assert "overview.agreement_compact(" in code and "overview.agreement_sentences(" in code
    assert "overview.agreement_summary" not in code  # the 70-line list is gone (summaries.agreement_summary is one row per GPU)
    assert "narrative.provenance_line(" in code  # each chart's run, in one generated line beside it


def test_no_function_of_the_charts_cards_or_overview_defaults_to_a_gpu():
    """The GPU is a dimension: no parameter of the modules behind the charts, the index and the overview
    defaults to a GPU's name (each shows every GPU measured, or the one it is given)."""
    import inspect

    from kernels_workbench import charts, dashboard, report

    gpus = set(overview.DATASHEETS.index) | {data.gpu_label(g) for g in overview.DATASHEETS.index}
    found = []
    for module in (data, overview, dashboard, charts, report):
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ != module.__name__:
                continue
            for parameter in inspect.signature(function).parameters.values():
                if isinstance(parameter.default, str) and parameter.default in gpus:
                    found.append(f"{module.__name__}.{name}({parameter.name}={parameter.default!r})")
    assert found == [], f"parameters that default to a GPU: {found}"
