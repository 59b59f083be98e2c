"""Notebook 06 (DPO, CPO, SimPO, GRPO) as papermill runs it in CI: CPU parameters, checks asserted,
the four published charts exported."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
import pytest

from kernels_lib.workbench import report

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_preference_dpo_cpo_simpo_grpo.ipynb"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render
PUBLISHED = ("fused_linear_cpo_loss", "fused_linear_simpo_loss", "fused_linear_grpo_loss_token", "fused_linear_grpo_loss_sequence")
LOSSES = ("fused_linear_dpo_loss", *PUBLISHED)


@pytest.mark.notebook
def test_preference_notebook_runs_checks_and_exports_the_published_charts(tmp_path):
    results = tmp_path / "results"
    parameters = {**report.notebook_parameters("cpu"), "results_dir": str(results)}
    html_path = report.run_notebook(NOTEBOOK, tmp_path, parameters, timeout=600)

    executed = nbformat.read(tmp_path / "executed" / NOTEBOOK.name, as_version=4)
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    assert [o for o in outputs if o.get("output_type") == "error"] == []
    assert not any("ipywidgets" in str(o.get("data", {})) for o in outputs)

    derivation = pd.read_csv(results / "preference_derivation.csv")
    assert set(derivation["loss"]) == {"DPO", "CPO", "SimPO", "GRPO (token)", "GRPO (sequence)"}
    assert (derivation.filter(like=" vs ") < 1e-12).all().all()

    checks = pd.read_csv(results / "preference_checks.csv")
    assert len(checks) == len(LOSSES) * 3 * 2 * 2 and checks["passed"].all()  # losses × dtypes × options × shapes
    assert set(checks["loss"]) == set(LOSSES)
    assert set(checks["dtype"]) == {"float32", "bfloat16", "float16"}
    assert (checks.loc[checks.dtype == "float32", "kernels_lib loss err"] < 1e-5).all()

    html = html_path.read_text(encoding="utf-8")
    assert html.count("Plotly.newPlot(") >= 2 * len(PUBLISHED)  # a sweep and a published chart per loss
    assert FALLBACK not in html
    for name in PUBLISHED:
        assert f"({name})" in html  # the published chart's title names it
    assert "H200 rows not measured yet" not in html or "./workbench bench fused_linear_cpo_loss --preset published" in html
