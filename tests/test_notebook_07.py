"""Notebook 07 (KL, JSD, TVD) as papermill runs it in CI: CPU parameters, derivation and checks asserted, the three
published charts exported; the target verdicts judged on synthetic H200 rows of two charts (``measured_dir``), the
third left unmeasured ("not measured yet")."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch

from kernels_lib.workbench import overview, report
from kernels_lib.workbench.bench import get_spec
from kernels_lib.workbench.bench.sweep import MEASURED_COLUMNS

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "07_divergences_jsd_tvd.ipynb"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render
COPY_GBPS = 4000.0
#: kernels_lib's forward runs at this fraction of the copy bandwidth in the synthetic rows (target: ≥ 0.9).
FORWARD_SHARE = 0.95
#: kernels_lib's full over Liger's per x in the synthetic rows: JSD's token chart meets 0.6 everywhere, TVD's misses
#: it at V = 65536.
RATIOS = {
    ("jsd", "BT"): {1024: 0.5, 2048: 0.45, 4096: 0.4, 8192: 0.4},
    ("tvd", "V"): {4096: 0.5, 8192: 0.5, 16384: 0.5, 32768: 0.5, 65536: 0.7, 131072: 0.5},
}


def _synthetic_rows(kernel_name: str, x_name: str) -> pd.DataFrame:
    """H200 rows of the published preset of ``x_name``: kernels_lib at FORWARD_SHARE of the copy bandwidth,
    Liger's full at kernels_lib's / RATIOS, torch 3× Liger; memory per provider."""
    spec = get_spec(kernel_name)
    preset = spec.published_preset(x_name)
    rows = []
    for x, ratio in RATIOS[(kernel_name, x_name)].items():
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
                                 "y_value_80": value, "extra_benchmark_config_str": config, "gpu_name": overview.H200,
                                 "timestamp": "2026-12-01 00:00:00", "liger_version": "0.8.5", "torch_version": "2.11.0",
                                 "triton_version": "3.6.0", "kernels_lib_commit": "run1", "device": "cuda", "timer": "synthetic"})
    return pd.DataFrame(rows, columns=MEASURED_COLUMNS)


def _ceilings() -> pd.DataFrame:
    return pd.DataFrame([{"kernel_name": name, "kernel_provider": "torch", "kernel_operation_mode": "forward", "metric_name": "speed",
                          "x_value": 0, "y_value_50": value, "gpu_name": overview.H200, "timestamp": "2026-12-01 00:00:00",
                          "kernels_lib_commit": "run1", "device": "cuda"}
                         for name, value in (("copy", COPY_GBPS), ("matmul", 700.0))])


@pytest.mark.notebook
def test_divergence_notebook_runs_checks_charts_and_judges_the_targets(tmp_path):
    measured = tmp_path / "measured"
    measured.mkdir()
    pd.concat([_synthetic_rows("jsd", "BT")]).to_csv(measured / "jsd.csv", index=False)  # the V chart stays unmeasured
    _synthetic_rows("tvd", "V").to_csv(measured / "tvd.csv", index=False)
    _ceilings().to_csv(measured / "ceilings.csv", index=False)
    results = tmp_path / "results"
    parameters = {**report.notebook_parameters("cpu"), "results_dir": str(results), "measured_dir": str(measured)}
    html_path = report.run_notebook(NOTEBOOK, tmp_path, parameters, timeout=600)

    executed = nbformat.read(tmp_path / "executed" / NOTEBOOK.name, as_version=4)
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    assert [o for o in outputs if o.get("output_type") == "error"] == []
    assert not any("ipywidgets" in str(o.get("data", {})) for o in outputs)

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

    # The targets, judged on the synthetic rows: the ratios and statuses the rows were made with.
    for (kernel_name, x_name), ratios in RATIOS.items():
        table = pd.read_csv(results / f"targets_{kernel_name}_{x_name}.csv", index_col=0)
        assert table["full / Liger"].to_dict() == pytest.approx(ratios)
        assert table["forward / copy"].to_numpy() == pytest.approx(FORWARD_SHARE)
        verdicts = pd.read_csv(results / f"verdicts_{kernel_name}_{x_name}.csv", index_col=0)["status"]
        assert verdicts["forward ≥ 0.9× copy bandwidth"] == "met"
        assert verdicts["full ≤ 0.6× Liger"] == ("met" if max(ratios.values()) <= 0.6 else "missed")
    assert not (results / "targets_jsd_V.csv").exists()

    html = html_path.read_text(encoding="utf-8")
    assert FALLBACK not in html
    assert html.count("Plotly.newPlot(") == 3 + 3 + 2  # the sweeps, the published charts, speed vs memory where measured
    for title in ("jsd (B = 4, T = 2048)", "jsd (V = 128256)", "tvd (B = 8, T = 2048)"):
        assert title in html
    assert html.count("floor: minimal bytes at the copy bandwidth") == 3  # every published chart has its floor
    assert "GPU rows not measured yet" in html
    # Each run's own time per element: the synthetic kernels_lib rows are bytes at one bandwidth, on the model at every V.
    assert "against each run's own time per element" in html
    assert "tvd (B = 8, T = 2048)</code>, kernels_lib: at V ≤ 8192 1.00–1.00× the model" in html
    assert "./workbench bench jsd --preset published --modes forward,forward_no_grad,backward,full --device cuda" in html
    assert "full ≤ 0.6× Liger <strong>missed</strong>" in html and "full ≤ 0.6× Liger <strong>met</strong>" in html
    # The headline and the conclusion, generated from the same synthetic rows (no typed figure to disagree with them).
    assert "<strong>TVD in one sentence.</strong> On the H200, kernels_lib’s <code>full</code> takes 0.50–0.70× Liger’s time at 0.50× its memory" in html.replace("'", "’")
    assert "<strong>JSD in one sentence.</strong> Not measured on a GPU yet" in html
    conclusion = html[html.index("7. Conclusion"):html.index("Appendix A")]
    assert "0.50–0.70× Liger’s <code>full</code> time; 0.50× Liger’s memory" in conclusion.replace("'", "’")
    assert f"{FORWARD_SHARE:.2f}× the copy bandwidth in <code>forward</code>" in conclusion
    liger_floor = sorted({1 / FORWARD_SHARE / r for r in RATIOS[("tvd", "V")].values()})
    assert f"kernels_lib {1 / FORWARD_SHARE:.2f}×, Liger {liger_floor[0]:.2f}–{liger_floor[-1]:.2f}× the floor" in conclusion
