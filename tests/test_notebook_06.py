"""Notebook 06 (DPO, CPO, SimPO, GRPO) as papermill runs it in CI: CPU parameters, checks asserted,
the four published charts exported."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
import pytest

import notebook_runs  # each notebook executed once, shared with the browser tests

from kernels_lib.workbench import data, report

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

    parity = pd.read_csv(results / "preference_parity.csv")  # section 8: both dtypes, both temperatures, two vocabularies
    assert len(parity) == 2 * 2 * 2 and set(parity["dtype"]) == {"float32", "bfloat16"}
    assert (parity.loc[parity.dtype == "float32", "|Δ| max"] < 1e-3).all()
    assert (parity["|Δ| p50"] <= parity["|Δ| max"]).all() and (parity["tokens"] > 0).all()

    html = html_path.read_text(encoding="utf-8")
    assert html.count("Plotly.newPlot(") >= 2 * len(PUBLISHED)  # a sweep and a published chart per loss
    assert FALLBACK not in html
    for name in PUBLISHED:
        assert f"({name})" in html  # the published chart's title names it

    judged = 0
    for name in LOSSES:  # a chart with H200 rows is judged (section 7); one without names the command that measures it
        measured = data.load_measured(name)
        h200 = measured[measured.gpu_name == "NVIDIA H200"] if len(measured) else measured
        if len(h200):
            commit = h200.sort_values("timestamp").kernels_lib_commit.iloc[-1]
            assert f"(<code>{name}</code>), run of commit {commit} on NVIDIA H200" in html, name
            judged += 1
        else:
            assert f"./workbench bench {name} --preset published" in html, name
    assert html.count("<code>full</code> over B = 2 … 16 is") == judged  # one verdict line per judged chart
    # the stored-exponentials route's A/B: its table where measured, else the command that measures it
    if (data.MEASURED_DIR / "gpu_runs" / "sequence_exponentials_ab.csv").exists():
        assert "alternating rounds (ms, MB):" in html and "on / floor" in html
    else:
        assert "<strong>Not measured on the H200 yet</strong>: on a GPU, <code>python3 -m kernels_lib.workbench.bench." in html
