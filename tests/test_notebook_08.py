"""Notebook 08 (fused linear JSD, distillation losses) as papermill runs it in CI: CPU parameters, derivation and
checks asserted on the shared execution (:mod:`notebook_runs`), the three published charts exported; each chart
compared per GPU on synthetic rows (``measured_dir``, ``run_checks=False``):
fused_linear_jsd on the H200 over two runs (the newest compared) and on the H100, with TRL's provider;
distill_cosine_loss on the H200; the third (distill_jsd_loss) left unmeasured ("not measured yet"). Each run measured
ceilings of its own, so a floor taken from another run's or another GPU's ceilings would show in the ratios."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import nbformat
import pandas as pd
import pytest

import notebook_runs  # each notebook executed once, shared with the browser tests
from kernels_workbench import overview, report
from kernels_workbench.bench import get_spec
from kernels_workbench.bench.sweep import MEASURED_COLUMNS

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "08_distillation.ipynb"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render
BTS = (1024, 2048, 4096, 8192)
PEERS = ("liger", "torch", "trl")
H100, H200 = overview.H100, overview.H200
LABELS = {H100: "H100 80GB", H200: "H200"}
#: The synthetic runs, (chart, commit) -> its GPU, timestamp, and per BT kernels_lib's full time over each peer's
#: (Liger, torch, TRL); None: the peer not measured. run0 is the older H200 run: its ratios must not show.
RUNS = {
    ("fused_linear_jsd", "run0"): (H200, "2026-11-30 00:00:00", {bt: (0.9 if bt == 8192 else 0.7, 0.8, 0.95) for bt in BTS}),
    ("fused_linear_jsd", "run1"): (H200, "2026-12-01 00:00:00", {bt: (0.7, 0.8, 0.9) for bt in BTS}),
    ("fused_linear_jsd", "runh"): (H100, "2026-11-29 00:00:00", {bt: (0.6, 0.85, 0.75) for bt in BTS}),
    ("distill_cosine_loss", "run1"): (H200, "2026-12-01 00:00:00", {bt: (0.75, 0.9 if bt == 1024 else 0.8, None) for bt in BTS}),
}
#: Per run, the ceilings it measured: copy GB/s, matmul TFLOP/s (run0's matmul rate is half the newest H200 run's).
CEILINGS = {"run0": (4000.0, 350.0), "run1": (4000.0, 700.0), "runh": (3000.0, 600.0)}
#: Per GPU, kernels_lib's full time over the matmul floor of its run's own ceilings.
OVER_FLOOR = {H200: 1.25, H100: 1.6}
#: Peak memory (MB) per GPU and provider: the leanest peer is Liger on the H200, TRL on the H100.
MEMORY = {H200: {"kernels_lib": 900.0, "liger": 1200.0, "torch": 30000.0, "trl": 3500.0},
          H100: {"kernels_lib": 600.0, "liger": 1200.0, "torch": 30000.0, "trl": 1000.0}}
SUITES = {
    "fused_linear_jsd vs reference", "fused_linear_jsd vs TRL generalized_jsd_loss",
    "fused_linear_jsd vs TRL ChunkedDivergenceFunction", "distill_jsd_loss vs reference",
    "distill_jsd_loss vs F.cross_entropy + TRL generalized_jsd_loss", "distill_cosine_loss vs reference",
    "distill_cosine_loss vs F.cross_entropy + F.cosine_similarity",
}


def _synthetic_rows(kernel_name: str, commit: str) -> pd.DataFrame:
    """Rows of the published preset: kernels_lib's full at OVER_FLOOR of the run's matmul floor, each peer's full at
    kernels_lib's / its RUNS ratio, forward at half of full; memory per MEMORY."""
    spec = get_spec(kernel_name)
    flops = importlib.import_module(spec.make_inputs.__module__).flops
    gpu, timestamp, ratios_per_bt = RUNS[(kernel_name, commit)]
    rows = []
    for bt, ratios in ratios_per_bt.items():
        sizes = {**spec.published["sizes"], "BT": bt}
        config = json.dumps({**sizes, "dtype": "torch.bfloat16", **spec.default_options})
        ours = flops(sizes, "full") / (CEILINGS[commit][1] * 1e12) * 1e3 * OVER_FLOOR[gpu]
        full = {"kernels_lib": ours, **{p: ours / r for p, r in zip(PEERS, ratios) if r is not None}}
        for provider, ms in full.items():
            for mode, metric, value, unit in (("forward", "speed", ms / 2, "ms"), ("full", "speed", ms, "ms"),
                                              ("forward", "memory", MEMORY[gpu][provider], "MB"),
                                              ("full", "memory", MEMORY[gpu][provider], "MB")):
                rows.append({"kernel_name": kernel_name, "kernel_provider": provider, "kernel_operation_mode": mode,
                             "metric_name": metric, "metric_unit": unit, "x_name": "BT", "x_label": "B x T", "x_value": bt,
                             "y_value_50": value, "y_value_20": value, "y_value_80": value,
                             "extra_benchmark_config_str": config, "gpu_name": gpu,
                             "timestamp": timestamp, "liger_version": "0.8.5", "torch_version": "2.11.0",
                             "triton_version": "3.6.0", "kernels_lib_commit": commit, "device": "cuda", "timer": "synthetic"})
    return pd.DataFrame(rows, columns=MEASURED_COLUMNS)


def _ceilings() -> pd.DataFrame:
    gpus = {commit: gpu for (_, commit), (gpu, _, _) in RUNS.items()}
    times = {commit: timestamp for (_, commit), (_, timestamp, _) in RUNS.items()}
    return pd.DataFrame([{"kernel_name": name, "kernel_provider": "torch", "kernel_operation_mode": "forward", "metric_name": "rate",
                          "x_value": 0, "y_value_50": value, "gpu_name": gpus[commit], "timestamp": times[commit],
                          "kernels_lib_commit": commit, "device": "cuda"}
                         for commit, (copy, matmul) in CEILINGS.items() for name, value in (("copy", copy), ("matmul", matmul))])



def _assert_comparison(table: pd.DataFrame, kernel_name: str, commit: str) -> None:
    """``table`` (a comparison CSV) holds, per BT, the ratios the run's synthetic rows were made with."""
    gpu, _, ratios = RUNS[(kernel_name, commit)]
    assert list(table.index) == list(BTS)
    for i, peer in enumerate(PEERS):
        if ratios[BTS[0]][i] is None:
            assert f"× {peer}" not in table
        else:
            assert table[f"× {peer}"].to_dict() == pytest.approx({bt: r[i] for bt, r in ratios.items()})
    fastest = {bt: max((r, p) for p, r in zip(PEERS, rs) if r is not None) for bt, rs in ratios.items()}
    assert table["fastest peer"].to_dict() == {bt: p for bt, (_, p) in fastest.items()}
    assert table["× fastest peer"].to_dict() == pytest.approx({bt: r for bt, (r, _) in fastest.items()})
    assert table["× floor"].to_numpy() == pytest.approx(OVER_FLOOR[gpu])  # the floor of the run's own ceilings
    memory = {p: MEMORY[gpu][p] for p, r in zip(PEERS, ratios[BTS[0]]) if r is not None}
    leanest = min(memory, key=memory.get)
    assert set(table["leanest peer"]) == {leanest}
    assert table["memory × leanest"].to_numpy() == pytest.approx(MEMORY[gpu]["kernels_lib"] / memory[leanest])


@pytest.mark.notebook
@notebook_runs.GROUP
def test_distillation_notebook_derives_and_passes_its_checks():
    """The shared execution at CPU parameters: the derivation against float64 and every check."""
    _, results, executed_path = notebook_runs.executed(NOTEBOOK)
    executed = nbformat.read(executed_path, as_version=4)
    assert [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"] == []
    derivation = pd.read_csv(results / "distillation_derivation.csv")
    assert set(derivation["loss"]) == {"fused_linear_jsd", "distill_jsd_loss", "distill_cosine_loss"}
    assert {0.0, 1.0} <= set(derivation.loc[derivation["loss"] == "fused_linear_jsd", "β"]) and (derivation["T"] != 1).any()
    assert (derivation.filter(like=" vs ") < 1e-12).all().all()

    checks = pd.read_csv(results / "distillation_checks.csv")
    assert checks["passed"].all() and set(checks["baseline"]) == SUITES
    assert set(checks["dtype"]) == {"float32", "bfloat16", "float16"}
    assert (checks.loc[checks.dtype == "float32", ["kernels_lib loss err", "kernels_lib grad err"]] < 1e-5).all().all()
    trl = checks[checks["baseline"].str.contains("TRL")]
    assert {0.0, 0.5, 1.0} <= set(trl["beta"]) and (trl["temperature"] != 1).all() and (trl["ignore_fraction"] > 0).all()
    every_row_ignored = checks[checks["ignore_fraction"] == 1.0]
    assert len(every_row_ignored) == 3 * 2 and (every_row_ignored[["kernels_lib loss err", "kernels_lib grad err"]] == 0).all().all()


@pytest.mark.notebook
def test_distillation_notebook_charts_and_compares_per_gpu(tmp_path):
    """The same notebook over synthetic rows (``measured_dir``), its checks left to the shared run."""
    measured = tmp_path / "measured"
    measured.mkdir()
    for kernel_name in ("fused_linear_jsd", "distill_cosine_loss"):
        pd.concat([_synthetic_rows(name, commit) for name, commit in RUNS if name == kernel_name]).to_csv(
            measured / f"{kernel_name}.csv", index=False)
    _ceilings().to_csv(measured / "ceilings.csv", index=False)
    results = tmp_path / "results"
    parameters = {**report.notebook_parameters("cpu"), "results_dir": str(results), "measured_dir": str(measured),
                  "run_checks": False}
    html_path = report.run_notebook(NOTEBOOK, tmp_path, parameters, timeout=600)

    executed = nbformat.read(tmp_path / "executed" / NOTEBOOK.name, as_version=4)
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    assert [o for o in outputs if o.get("output_type") == "error"] == []
    assert not any("ipywidgets" in str(o.get("data", {})) for o in outputs)

    assert not (results / "distillation_checks.csv").exists()  # run_checks=False: the shared run checks

    # Per chart and GPU, the newest run's comparison (run0, the older H200 run, nowhere); no target or verdict written.
    newest = {("fused_linear_jsd", H200): "run1", ("fused_linear_jsd", H100): "runh", ("distill_cosine_loss", H200): "run1"}
    files = {(name, gpu): results / f"comparison_{name}_{LABELS[gpu].replace(' ', '_')}.csv" for name, gpu in newest}
    assert {p.name for p in results.glob("comparison_*.csv")} == {path.name for path in files.values()}
    assert not [*results.glob("targets_*"), *results.glob("verdicts_*")]
    tables = {key: pd.read_csv(path, index_col=0) for key, path in files.items()}
    for (name, gpu), commit in newest.items():
        _assert_comparison(tables[(name, gpu)], name, commit)
    h200, h100 = tables[("fused_linear_jsd", H200)], tables[("fused_linear_jsd", H100)]
    assert [h200[f"× {peer}"].to_numpy() for peer in PEERS] == [pytest.approx(0.7), pytest.approx(0.8), pytest.approx(0.9)]
    assert set(h200["fastest peer"]) == {"trl"} and h200["memory × leanest"].to_numpy() == pytest.approx(0.75)
    assert set(h100["fastest peer"]) == {"torch"} and set(h100["leanest peer"]) == {"trl"}
    assert h100["× floor"].to_numpy() == pytest.approx(1.6) and h100["memory × leanest"].to_numpy() == pytest.approx(0.6)

    html = html_path.read_text(encoding="utf-8")
    assert FALLBACK not in html
    assert html.count("Plotly.newPlot(") == 3 + 3 + 3  # the sweeps, the published charts, speed vs memory per chart and GPU
    for name in ("fused_linear_jsd", "distill_jsd_loss", "distill_cosine_loss"):
        assert f"{name} (H = 4096, V = 128256, bfloat16)" in html
    # Each GPU's floor from its own run's ceilings, labelled (none for the unmeasured chart).
    assert html.count("floor on the H100 80GB: matmul FLOPs at the matmul rate; matmul 600 TFLOP/s and copy 3000 GB/s measured in this run") == 1
    assert html.count("floor on the H200: matmul FLOPs at the matmul rate; matmul 700 TFLOP/s and copy 4000 GB/s measured in this run") == 2
    assert "H100 80GB: copy 3000 GB/s, matmul 600 TFLOP/s" in html and "H200: copy 4000 GB/s, matmul 700 TFLOP/s" in html
    assert "GPU rows not measured yet" in html
    assert "./workbench bench distill_jsd_loss --preset published --modes forward,full --device cuda" in html
    for target in ("≤ 0.8× Liger", "≤ 0.85× torch", "verdict", "<strong>met</strong>", "<strong>missed</strong>", "hold ourselves to"):
        assert target not in html
    # The headline, the bullets and the conclusion, generated from the same rows (no typed figure to disagree with them).
    assert ("<strong>In one sentence.</strong> Distillation losses, kernels_lib's <code>full</code>: on the H100 80GB "
            "(BT = 1024–8192), 0.85× the fastest peer's time, 0.60× the leanest peer's memory and 1.60× the floor; on the H200 "
            "(2 charts), 0.80–0.90× the fastest peer's time, 0.75× the leanest peer's memory and 1.25× the floor.</p>") in html
    assert ("On the H100 80GB, kernels_lib's <code>full</code> time over each peer's: Liger 0.60×; torch 0.85×; TRL 0.75×; "
            "0.85× the fastest peer's, 1.60× the floor; memory 0.60× the leanest peer's (TRL).") in html
    # Where the time goes: each provider over the floor; the conclusion: a few sentences over every comparison table.
    time_goes = html[html.index("7. Where the time goes"):html.index("8. Conclusion")]
    assert "<code>fused_linear_jsd · H100 80GB</code>: <code>full</code> at kernels_lib 1.60×" in time_goes
    conclusion = html[html.index("8. Conclusion"):html.index("Appendix A")]
    assert "Over the 3 comparison tables (H100 80GB, H200; " in conclusion
    assert "<code>full</code> takes 0.80–0.90× the fastest peer's time (" in conclusion
    assert "1.25–1.60× the floor and 0.60–0.75× the leanest peer's memory." in conclusion
