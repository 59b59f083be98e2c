"""Notebook 07 (JSD, TVD) as papermill runs it in CI: CPU parameters, derivation and checks asserted on the shared
execution (:mod:`notebook_runs`), the three published charts exported; the comparison with the peers and the floor
taken on synthetic rows of two GPUs for two charts (``measured_dir``, ``run_checks=False``: the H200's run measured
its ceilings, the H100's none), the third chart left unmeasured ("not measured yet")."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch

import notebook_runs  # each notebook executed once, shared with the browser tests
from kernels_workbench import data, overview, report
from kernels_workbench.bench import get_spec
from kernels_workbench.bench.sweep import MEASURED_COLUMNS

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "07_divergences_jsd_tvd.ipynb"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render
COPY_GBPS = 4000.0
#: kernels_lib's forward (and full: the same 12 B per element) runs at this fraction of the copy bandwidth in the
#: synthetic rows, so its full takes 1 / FORWARD_SHARE the floor where the run measured its ceilings.
FORWARD_SHARE = 0.95
#: Each synthetic run: its GPU, its commit, whether it measured the ceilings.
RUNS = {overview.H200: ("run1", True), overview.H100: ("run2", False)}
#: Per GPU, kernels_lib's full over Liger's per x in the synthetic rows (torch takes 3× Liger's time).
RATIOS = {
    overview.H200: {("jsd", "BT"): {1024: 0.5, 2048: 0.45, 4096: 0.4, 8192: 0.4},
                    ("tvd", "V"): {4096: 0.5, 8192: 0.5, 16384: 0.5, 32768: 0.5, 65536: 0.7, 131072: 0.5}},
    overview.H100: {("jsd", "BT"): {1024: 0.6, 2048: 0.55, 4096: 0.5, 8192: 0.5},
                    ("tvd", "V"): {4096: 0.8, 8192: 0.8, 16384: 0.8, 32768: 0.8, 65536: 0.9, 131072: 0.8}},
}


def _synthetic_rows(kernel_name: str, x_name: str, gpu: str) -> pd.DataFrame:
    """``gpu``'s rows of the published preset of ``x_name``: kernels_lib at FORWARD_SHARE of COPY_GBPS, Liger's full
    at kernels_lib's / RATIOS, torch 3× Liger; memory 100, 200 and 600 MB."""
    spec = get_spec(kernel_name)
    preset = spec.published_preset(x_name)
    rows = []
    for x, ratio in RATIOS[gpu][(kernel_name, x_name)].items():
        sizes = {**preset["sizes"], x_name: x}
        config = json.dumps({**sizes, "dtype": "torch.float32", **spec.default_options})
        floor_ms = spec.bytes_moved(sizes, torch.float32, "forward") / (COPY_GBPS * 1e9) * 1e3
        ours = floor_ms / FORWARD_SHARE
        speed = {"kernels_lib": {"forward": ours, "forward_no_grad": ours * 8 / 12, "full": ours}}
        speed["liger"] = {mode: ours / ratio for mode in ("forward", "forward_no_grad", "full")}
        speed["torch"] = {mode: 3 * ours / ratio for mode in ("forward", "forward_no_grad", "full")}
        memory = {"kernels_lib": 100.0, "liger": 200.0, "torch": 600.0}
        for provider, modes in speed.items():
            for mode, ms in modes.items():
                for metric, value in (("speed", ms), ("memory", memory[provider])):
                    rows.append({"kernel_name": kernel_name, "kernel_provider": provider, "kernel_operation_mode": mode,
                                 "metric_name": metric, "metric_unit": "ms" if metric == "speed" else "MB", "x_name": x_name,
                                 "x_label": preset["x_label"], "x_value": x, "y_value_50": value, "y_value_20": value,
                                 "y_value_80": value, "extra_benchmark_config_str": config, "gpu_name": gpu,
                                 "timestamp": "2026-12-01 00:00:00", "liger_version": "0.8.5", "torch_version": "2.11.0",
                                 "triton_version": "3.6.0", "kernels_lib_commit": RUNS[gpu][0], "device": "cuda", "timer": "synthetic"})
    return pd.DataFrame(rows, columns=MEASURED_COLUMNS)


def _ceilings() -> pd.DataFrame:
    """The copy and matmul ceilings of every run that measured them (the H200's)."""
    return pd.DataFrame([{"kernel_name": name, "kernel_provider": "torch", "kernel_operation_mode": "forward", "metric_name": "speed",
                          "x_value": 0, "y_value_50": value, "gpu_name": gpu, "timestamp": "2026-12-01 00:00:00",
                          "kernels_lib_commit": commit, "device": "cuda"}
                         for gpu, (commit, measured) in RUNS.items() if measured for name, value in (("copy", COPY_GBPS), ("matmul", 700.0))])


def _span(values) -> str:
    """``0.50–0.70×`` over ``values``, as the notebook's sentences say a range."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}×" if low == high else f"{low}–{high}×"


@pytest.mark.notebook
@notebook_runs.GROUP
def test_divergence_notebook_derives_bounds_and_passes_its_checks():
    """The shared execution at CPU parameters: the derivation against float64, the bounds, every check."""
    _, results, executed_path = notebook_runs.executed(NOTEBOOK)
    executed = nbformat.read(executed_path, as_version=4)
    assert [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"] == []
    derivation = pd.read_csv(results / "divergence_derivation.csv")
    assert {"JSD β=0.0", "JSD β=0.5", "JSD β=1.0", "TVD"} <= set(derivation["loss"])
    assert (derivation.filter(like=" vs ") < 1e-12).all().all()
    bounds = pd.read_csv(results / "divergence_bounds.csv")
    assert bounds.filter(like="≤").all().all() and len(bounds) == 9

    checks = pd.read_csv(results / "divergence_checks.csv")
    assert checks["passed"].all()
    assert set(checks["baseline"]) == {"jsd vs reference.jsd", "jsd vs TRL generalized_jsd_loss", "tvd vs reference.tvd", "tvd vs 0.5 · F.l1_loss"}
    assert set(checks["dtype"]) == {"float32", "bfloat16", "float16"}
    assert set(checks.loc[checks["loss"] == "jsd", "beta"]) >= {0.0, 0.5, 1.0}
    assert (checks.loc[checks.dtype == "float32", ["kernels_lib loss err", "kernels_lib grad err"]] < 1e-5).all().all()


@pytest.mark.notebook
def test_divergence_notebook_charts_and_compares_each_gpu(tmp_path):
    """The same notebook over synthetic rows of two GPUs (``measured_dir``), its checks left to the shared run."""
    measured = tmp_path / "measured"
    measured.mkdir()
    for kernel_name, x_name in (("jsd", "BT"), ("tvd", "V")):  # JSD's V chart stays unmeasured
        pd.concat([_synthetic_rows(kernel_name, x_name, gpu) for gpu in RUNS]).to_csv(measured / f"{kernel_name}.csv", index=False)
    _ceilings().to_csv(measured / "ceilings.csv", index=False)
    results = tmp_path / "results"
    parameters = {**report.notebook_parameters("cpu"), "results_dir": str(results), "measured_dir": str(measured),
                  "run_checks": False}
    html_path = report.run_notebook(NOTEBOOK, tmp_path, parameters, timeout=600)

    executed = nbformat.read(tmp_path / "executed" / NOTEBOOK.name, as_version=4)
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    assert [o for o in outputs if o.get("output_type") == "error"] == []
    assert not any("ipywidgets" in str(o.get("data", {})) for o in outputs)

    assert not (results / "divergence_checks.csv").exists()  # run_checks=False: the shared run checks

    # Each GPU's comparison per measured chart: the ratios the synthetic rows were made with; the floor (and forward's
    # share of the copy bandwidth) only where the run measured its ceilings, never another run's.
    expected = {f"comparison_{k}_{x}_{data.gpu_label(gpu).replace(' ', '_')}.csv" for gpu in RUNS for k, x in RATIOS[gpu]}
    assert {p.name for p in results.glob("comparison_*.csv")} == expected  # JSD's V chart has none
    assert not list(results.glob("targets_*.csv")) and not list(results.glob("verdicts_*.csv"))
    for gpu, (_, has_ceilings) in RUNS.items():
        for (kernel_name, x_name), ratios in RATIOS[gpu].items():
            table = pd.read_csv(results / f"comparison_{kernel_name}_{x_name}_{data.gpu_label(gpu).replace(' ', '_')}.csv", index_col=0)
            assert table.index.name == x_name and list(table.index) == list(ratios)
            assert table["× liger"].to_dict() == pytest.approx(ratios)
            assert table["× torch"].to_dict() == pytest.approx({x: r / 3 for x, r in ratios.items()})
            assert set(table["fastest peer"]) == {"liger"} and table["× fastest peer"].to_dict() == pytest.approx(ratios)
            assert table["kernels_lib MB"].to_numpy() == pytest.approx(100.0)
            assert set(table["leanest peer"]) == {"liger"} and table["memory × leanest"].to_numpy() == pytest.approx(0.5)
            if has_ceilings:
                assert table["× floor"].to_numpy() == pytest.approx(1 / FORWARD_SHARE)
                assert table["forward / copy"].to_numpy() == pytest.approx(FORWARD_SHARE)
            else:
                assert table["× floor"].isna().all() and table["forward / copy"].isna().all()

    html = html_path.read_text(encoding="utf-8").replace("&#39;", "'").replace("’", "'")
    assert FALLBACK not in html
    # The sweeps, the published charts, speed against memory for each measured chart on each GPU.
    assert html.count("Plotly.newPlot(") == 3 + 3 + sum(len(r) for r in RATIOS.values())
    for title in ("jsd (B = 4, T = 2048)", "jsd (V = 128256)", "tvd (B = 8, T = 2048)"):
        assert title in html
    # each published chart with H200 rows has the H200's floor; the H100's run measured no ceilings and the chart
    # without measured rows borrows none: no floor there
    assert html.count("floor on the H200: minimal bytes at the copy bandwidth; matmul 700 TFLOP/s and copy 4000 GB/s measured in this run") == 2
    assert "floor on the H100 80GB" not in html
    assert "GPU rows not measured yet" in html
    for gpu, (commit, _) in RUNS.items():  # each GPU's table under its own run's line
        assert f"run of commit {commit} on {gpu}" in html
    # Each run's own time per element: the synthetic kernels_lib rows are bytes at one bandwidth, on the model at every V.
    assert "against each run's own time per element" in html
    assert "tvd (B = 8, T = 2048)</code>, kernels_lib: at V ≤ 8192 1.00× the model" in html
    assert "./workbench bench jsd --preset published --modes forward,forward_no_grad,backward,full --device cuda" in html
    for word in ("<strong>met</strong>", "<strong>missed</strong>", "DIVERGENCE_TARGETS", "hold ourselves to", "verdict"):
        assert word not in html
    # The headline and the conclusion, generated from the comparison tables (no typed figure to disagree with them).
    floor = f"{1 / FORWARD_SHARE:.2f}× the floor"
    tvd = {gpu: RATIOS[gpu][("tvd", "V")].values() for gpu in RUNS}
    # The headline: one sentence, every chart of each GPU (the jsd and tvd charts' ratios together).
    both = {gpu: [*RATIOS[gpu][("jsd", "BT")].values(), *RATIOS[gpu][("tvd", "V")].values()] for gpu in RUNS}
    assert (f"<strong>In one sentence.</strong> JSD and TVD, kernels_lib's <code>full</code>: on the H100 80GB (2 charts), "
            f"{_span(both[overview.H100])} the fastest peer's time, 0.50× the leanest peer's memory and the floor not measured; "
            f"on the H200 (2 charts), {_span(both[overview.H200])} the fastest peer's time, 0.50× the leanest peer's memory "
            f"and {floor}.</p>") in html
    conclusion = html[html.index("7. Conclusion"):html.index("Appendix A")]
    liger_floor = _span([1 / FORWARD_SHARE / r for r in tvd[overview.H200]])
    assert (f"<code>tvd (B = 8, T = 2048)</code> on the H200 (V = 4096–131072): kernels_lib's <code>full</code> takes "
            f"{_span(tvd[overview.H200])} the fastest peer's time (Liger); {floor}, where Liger takes {liger_floor}; 0.50× the "
            f"leanest peer's memory; its <code>forward</code> moves its bytes at {FORWARD_SHARE:.2f}× the copy bandwidth.") in conclusion
    assert (f"<code>tvd (B = 8, T = 2048)</code> on the H100 80GB (V = 4096–131072): kernels_lib's <code>full</code> takes "
            f"{_span(tvd[overview.H100])} the fastest peer's time (Liger); no floor (the run measured no ceilings); 0.50× the "
            "leanest peer's memory.") in conclusion
    assert "<code>jsd (B = 4, T = 2048)</code>: not measured on a GPU yet." in conclusion
