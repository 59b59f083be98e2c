"""Notebook 06 (DPO, CPO, SimPO, GRPO) as papermill runs it in CI: CPU parameters, checks asserted,
the four published charts exported."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
import pytest

import notebook_runs  # each notebook executed once, shared with the browser tests

from kernels_workbench import data, report

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_preference_dpo_cpo_simpo_grpo.ipynb"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render
PUBLISHED = ("fused_linear_cpo_loss", "fused_linear_simpo_loss", "fused_linear_grpo_loss_token", "fused_linear_grpo_loss_sequence")
LOSSES = ("fused_linear_dpo_loss", *PUBLISHED)


@pytest.mark.notebook
@notebook_runs.GROUP
def test_preference_notebook_runs_checks_and_exports_the_published_charts():
    html_path, results, executed_path = notebook_runs.executed(NOTEBOOK)

    executed = nbformat.read(executed_path, as_version=4)
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

    parity = pd.read_csv(results / "preference_parity.csv")  # the appendix: both dtypes, both temperatures, two vocabularies
    assert len(parity) == 2 * 2 * 2 and set(parity["dtype"]) == {"float32", "bfloat16"}
    assert (parity.loc[parity.dtype == "float32", "|Δ| max"] < 1e-3).all()
    assert (parity["|Δ| p50"] <= parity["|Δ| max"]).all() and (parity["tokens"] > 0).all()

    html = html_path.read_text(encoding="utf-8")
    assert html.count("Plotly.newPlot(") >= 2 * len(PUBLISHED)  # a sweep and a published chart per loss
    assert FALLBACK not in html
    for name in PUBLISHED:
        assert f"({name})" in html  # the published chart's title names it

    assert "In one sentence." in html and "Conclusion" in html
    compared = 0
    for name in LOSSES:  # per GPU measured, the newest run's comparison (section 7); none: the command that measures it
        runs = data.newest_run_per_gpu(data.load_measured(name, latest=False))
        for gpu, run in runs.items():
            assert f"({name}) on the {data.gpu_label(gpu)}: the {data.run_label(run)}" in html, (name, gpu)
            compared += 1
        if not runs:
            assert f"./workbench bench {name} --preset published" in html, name
    assert html.count("<code>full</code> over B = ") == compared  # one comparison line per loss and GPU
    # our targets, the run history and the sequence route's A/B are studies, not this notebook's
    for gone in ("sequence_exponentials_ab", "Issue 13", "worst ratio", "stored-exponentials route"):
        assert gone not in html, gone
    assert "sequence_losses_studies.ipynb" in html
