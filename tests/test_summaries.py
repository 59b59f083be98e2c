"""kernels_workbench.summaries: the main flow's short tables and the sentences that read them."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from kernels_workbench import summaries


def test_environment_summary_one_row_per_gpu_and_versions():
    env = pd.DataFrame({"file": ["a", "b", "a", "c"], "gpu_name": ["NVIDIA H200"] * 3 + ["NVIDIA H100 80GB HBM3"],
                        "kernels_lib_commit": ["x1", "x1", "x2", "x3"], "torch_version": ["2.11"] * 4,
                        "triton_version": ["3.6"] * 4, "liger_version": ["0.8.5", None, "0.8.5", "–"],
                        "first": ["1", "2", "3", "4"], "last": ["5", "6", "7", "8"], "rows": [1, 2, 3, 4]})
    table = summaries.environment_summary(env)
    assert len(table) == 3 and set(table.liger) == {"0.8.5", "–"}
    row = table[(table.GPU == "H200") & (table.liger == "0.8.5")].iloc[0]
    assert (row.runs, row.files, row.rows, row["first"], row["last"]) == (2, 1, 4, "1", "7")


def _times():
    ms = pd.DataFrame({"forward": [1.0, 2.0], "full": [2.0, 4.0]}, index=[1, 2])
    floor = SimpleNamespace(ms=ms, bound=pd.Series({1: "bytes", 2: "bytes"}))
    rows = pd.DataFrame({"metric_name": ["speed"] * 4 + ["memory"], "kernel_provider": ["a", "a", "b", "b", "a"],
                         "kernel_operation_mode": ["forward", "full", "forward", "forward", "full"],
                         "x_value": [1, 2, 1, 2, 2], "y_value_50": [0.99, 5.0, 0.6, 1.4, 100.0]})
    workload = SimpleNamespace(title="loss", on=lambda gpu: rows)
    return summaries.against_floor([workload], [{"NVIDIA H200": floor}])


def test_against_floor_and_its_sentences():
    times = _times()
    assert len(times) == 4 and times["× floor"].round(2).tolist() == [0.99, 1.25, 0.6, 0.7]
    ceilings = pd.DataFrame({"gpu_name": ["NVIDIA H200"] * 2, "kernel_name": ["copy", "copy"], "kernels_lib_commit": ["x", "y"],
                             "y_value_50": [4000.0, 4200.0]})
    text = summaries.floor_sentences(times, ceilings)
    assert text.startswith("3 of the 4 measured times lie below their run's floor (0.60–0.99×).")
    assert "1 of them are within 5% of it (0.99×, 1 bandwidth-bound)" in text and "H200 copy 4000–4200 GB/s" in text
    assert "b `forward` on `loss` sits at 0.60–0.70× (2 points, H200)" in text
    groups = summaries.floor_groups(times)
    assert groups.points.tolist() == [2, 1] and groups.index[0] == ("loss", "b", "forward")


def test_agreement_conclusion_counts_verdicts():
    agreement = pd.DataFrame({"provider": ["liger", "liger", "torch"],
                              "verdict": ["agrees", "slower than the GPUs explain", "faster than the GPUs explain"]})
    text = summaries.agreement_conclusion(agreement)
    assert text.startswith("1 of the 3 points") and "(33%)" in text and "1 are slower and 1 faster" in text
    assert "liger 1 of 2, torch 0 of 1" in text


def test_worst_cases_per_group():
    checks = pd.DataFrame({"dtype": ["bf16", "bf16", "fp32"], "option": ["a", "b", "a"], "err": [1e-3, 4e-3, 1e-7],
                           "tolerance": [1e-2, 1e-2, 1e-5], "passed": [True, True, True]})
    table = summaries.worst_cases(checks, ["dtype"], ["err"], keep=["option"])
    assert table.loc["bf16", "option"] == "b" and table.loc["bf16", "cases"] == 2 and table.loc["fp32", "passed"] == 1


def test_display_names_rename_the_baseline_once():
    from kernels_workbench.charts import BASELINE_NAME

    assert summaries.display_names("baseline loss err") == f"{BASELINE_NAME} loss err"
    assert summaries.display_names("huggingface, kernels_lib, liger") == f"{BASELINE_NAME}, kernels_lib, liger"
    assert summaries.display_names(summaries.display_names("× torch")) == f"× {BASELINE_NAME}"
    assert summaries.display_names("torch_lce, kernels_lib[accurate=True]") == "torch_lce, kernels_lib[accurate=True]"
    table = summaries.display_columns(pd.DataFrame({"torch ms": [1.0]}, index=pd.Index(["a"], name="baseline")))
    assert list(table.columns) == [f"{BASELINE_NAME} ms"] and table.index.name == BASELINE_NAME


def _checks():
    nan = float("nan")
    return pd.DataFrame({"loss": ["l"] * 4, "shape": ["1x2", "3x4", "1x2", "3x4"], "dtype": ["bfloat16", "bfloat16", "float32", "float32"],
                         "reduction": ["mean", "sum", "mean", nan], "kernels_lib loss err": [1e-3, 2e-3, 1e-7, 1e-6],
                         "kernels_lib grad err": [1e-3, 1e-3, 1e-7, 1e-7], "baseline loss err": [1e-3] * 4,
                         "baseline grad err": [1e-3] * 4, "tolerance": [1e-2, 1e-2, 1e-5, 1e-5], "passed": [True, True, True, False]})


def test_check_summary_keeps_the_worst_case_per_group_and_counts():
    from kernels_workbench.charts import BASELINE_NAME

    checks = _checks()
    assert summaries.options_text(checks).tolist() == ["reduction=mean", "reduction=sum", "reduction=mean", "defaults"]
    table = summaries.check_summary(checks, ["dtype"])
    assert table.loc["bfloat16", "options"] == "reduction=sum" and table.loc["float32", "shape"] == "3x4"
    assert (table.loc["float32", "cases"], table.loc["float32", "passed"]) == (2, 1)
    assert f"{BASELINE_NAME} grad err" in table.columns and "baseline loss err" not in table.columns
    assert list(table.columns[-3:]) == ["tolerance", "cases", "passed"]
    assert len(summaries.check_summary(checks, ["dtype", "options"])) == 4
    assert summaries.check_summary(checks, ["reduction"]).loc["mean", "options"] == "defaults"
    assert summaries.options_text(checks.assign(chunk_size=[16.0, float("nan")] * 2)).iloc[0] == "reduction=mean, chunk_size=16"
    suites = summaries.check_summary(checks.assign(baseline=["a", "a", "b", "b"]), ["baseline", "dtype"])
    assert suites.index.names == ["checked against", "dtype"] and "baseline loss err" in suites.columns


def test_coverage_and_agreement_summaries_one_row_per_chart_and_per_provider_mode():
    from kernels_workbench.charts import BASELINE_NAME

    coverage = pd.DataFrame({"workload": ["a", "a", "b"], "published on": ["A100"] * 3, "published providers": ["liger, torch"] * 3,
                             "measured on": ["H100", "H200", "none yet"], "not in this run": ["quack", "–", "–"]})
    table = summaries.coverage_summary(coverage)
    assert table.loc["a", "measured on"] == "H100, H200" and table.loc["a", "GPUs"] == 2 and table.loc["b", "GPUs"] == 0
    assert table.loc["a", "published providers"] == f"liger, {BASELINE_NAME}" and table.loc["a", "not in some run"] == "quack"
    agreement = pd.DataFrame({"workload": ["a", "a", "b"], "gpu": ["H200"] * 3, "provider": ["huggingface", "torch", "liger"],
                              "mode": ["full"] * 3, "ratio / expected": [1.0, 1.5, 0.5],
                              "verdict": ["agrees", "slower than the GPUs explain", "faster than the GPUs explain"]})
    summary = summaries.agreement_summary(agreement)
    row = summary.loc[("H200", BASELINE_NAME, "full")]
    assert (row.points, row.agree, row.slower, row.faster) == (2, 1, 1, 0) and row["ratio / expected, highest"] == 1.5


def test_comparison_sentences_span_every_table():
    table = pd.DataFrame({"× fastest peer": [0.8, 1.2], "fastest peer": ["huggingface", "liger"], "× floor": [1.5, 2.0],
                          "memory × leanest": [0.5, 0.6]}, index=[1, 2])
    text = summaries.comparison_sentences({("dpo", "NVIDIA H200"): table})
    assert "Over the 1 comparison tables (H200; 2 points)" in text and "0.80–1.20× the fastest peer's time" in text
    assert "1.50–2.00× the floor" in text and "It is the fastest at 1 of the 2 points" in text and "(liger, torch (eager))" in text
    assert summaries.comparison_sentences({}).startswith("No GPU run")
