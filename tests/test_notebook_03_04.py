"""Notebooks 03 (ORPO) and 04 (KTO) as papermill runs them in CI: CPU parameters, checks asserted,
figures exported."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pandas as pd
import pytest

import notebook_runs  # each notebook executed once, shared with the browser tests
from kernels_lib.workbench import report

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
ORPO, KTO = NOTEBOOKS / "03_orpo.ipynb", NOTEBOOKS / "04_kto.ipynb"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render


def _run(notebook: Path) -> tuple[Path, str]:
    html_path, results, executed_path = notebook_runs.executed(notebook)
    executed = nbformat.read(executed_path, as_version=4)
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    assert [o for o in outputs if o.get("output_type") == "error"] == []
    assert not any("ipywidgets" in str(o.get("data", {})) for o in outputs)
    html = html_path.read_text(encoding="utf-8")
    assert html.count("Plotly.newPlot(") >= 3  # the sweep, the published chart, speed vs memory
    assert FALLBACK not in html
    assert "GPU rows have not been measured yet" not in html or "scripts/published_sweeps.py" in html
    return results, html


@pytest.mark.notebook
@notebook_runs.GROUP
def test_orpo_notebook_runs_checks_and_exports_figures():
    results, html = _run(ORPO)
    trl = pd.read_csv(results / "orpo_trl_checks.csv")
    assert len(trl) == 6 and trl["passed"].all()
    assert set(trl["dtype"]) == {"float32", "bfloat16", "float16"}
    assert (trl.loc[trl.dtype == "float32", "kernels_lib vs TRL (loss)"] < 1e-5).all()
    checks = pd.read_csv(results / "orpo_checks.csv")
    assert len(checks) == 2 * 3 * 3 and checks["passed"].all()
    assert "log1mexp" in html and "The naive form is infinite" in html
    _says_headline_and_conclusion(html, "9. Conclusion")
    assert "the floor and Liger" in html or "no floor margin to state" in html  # the generated margin, or why there is none


@pytest.mark.notebook
@notebook_runs.GROUP
def test_kto_notebook_runs_checks_and_exports_figures():
    results, html = _run(KTO)
    checks = pd.read_csv(results / "kto_checks.csv")
    assert len(checks) == 2 * 3 * 3 and checks["passed"].all()
    assert (checks.loc[checks.dtype == "float32", "kernels_lib loss err"] < 1e-5).all()
    labels = pd.read_csv(results / "kto_label_checks.csv")
    assert len(labels) == 12 and labels["passed"].all()
    assert set(labels["labels"]) == {"mixed", "all desirable", "all undesirable"}
    assert "Published H100" in html
    _says_headline_and_conclusion(html, "9. Conclusion")
    assert "against the matmul floor" in html or "Not measured on a GPU yet" in html


def _says_headline_and_conclusion(html: str, conclusion: str) -> None:
    """The generated headline (from the newest GPU run, or why there is none) and the conclusion before any appendix."""
    assert "In one sentence.</strong> On the " in html or "In one sentence.</strong> Not measured on a GPU yet" in html
    assert conclusion in html and html.index(conclusion) < html.index("Appendix")
