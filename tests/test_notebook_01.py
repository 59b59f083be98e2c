"""Notebook 01 (fused linear cross-entropy) as papermill runs it in CI: CPU parameters, checks asserted,
the headline and the default route's kernels shown, figures exported."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch

import notebook_runs  # each notebook executed once, shared with the browser tests
from kernels_workbench import report

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_cross_entropy.ipynb"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render


@pytest.mark.notebook
@notebook_runs.GROUP
def test_flce_notebook_runs_checks_and_exports_figures():
    html_path, results, executed_path = notebook_runs.executed(NOTEBOOK)

    checks = pd.read_csv(results / "flce_checks.csv")
    assert len(checks) == 3 * 8 * 2  # dtypes x option sets x shapes
    assert checks["passed"].all()
    assert set(checks["dtype"]) == {"float32", "bfloat16", "float16"}
    assert set(checks["reduction"]) == {"mean", "sum", "none"}
    assert {"label_smoothing", "z_loss_scale", "softcap", "bias"} <= set(checks.columns)
    fp32 = checks[checks.dtype == "float32"]
    assert (fp32["kernels_lib loss err"] < 1e-5).all() and (fp32["kernels_lib grad err"] < 1e-5).all()
    hf = pd.read_csv(results / "flce_transformers_checks.csv")
    assert len(hf) == 6 and hf["passed"].all()
    assert (hf.loc[hf.dtype == "float32", "kernels_lib vs ForCausalLMLoss (loss)"] < 1e-5).all()
    lce_path = results / "flce_torch_lce_checks.csv"
    if hasattr(torch.nn.functional, "linear_cross_entropy") or os.environ.get("KERNELS_LIB_TORCH_LCE_FILES"):
        lce = pd.read_csv(lce_path)  # torch's own function as the baseline, both policies, every dtype and shape
        assert len(lce) == 2 * 3 * 4 * 2 and lce["passed"].all()
        assert set(lce["baseline"]) == {"torch_lce", "torch_lce[acc_policy=accurate]"}
        assert (lce.loc[lce.dtype == "float32", ["kernels_lib loss err", "kernels_lib grad err"]] < 1e-5).all().all()
    else:
        assert not lce_path.exists()

    executed = nbformat.read(executed_path, as_version=4)
    errors = [o for c in executed.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    assert not any("ipywidgets" in str(o.get("data", {})) for c in executed.cells for o in c.get("outputs", []))

    html = html_path.read_text(encoding="utf-8")
    assert html.count("Plotly.newPlot(") >= 3  # the sweep, the published chart, speed against memory per GPU
    assert FALLBACK not in html
    # the headline, generated from the newest run of each GPU (or saying none was measured)
    assert "In one sentence." in html
    assert re.search(r"the floor on the [^:]+: the loss(?:'|&#39;)s own matmuls \(`three_matmuls`\) timed in this run", html) or "Not measured on a GPU yet" in html
    # the default route's own kernels, shown from their source
    for kernel in ("target_logit_shift_kernel", "scale_rows_kernel"):
        assert kernel in html, kernel
    assert "bf16 accumulation gives a dW error" in html
    assert "× floor" in html or "No GPU rows yet" in html  # the comparison table per GPU
    assert "Conclusion" in html and "fused_cross_entropy_studies.ipynb" in html  # the studies are an appendix away
    # the studies' sections are no longer here
    for gone in ("frontier run: commit", "What 0.92× asks of the GEMMs", "Past the floor", "in Gluon"):
        assert gone not in html, gone
