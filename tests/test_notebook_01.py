"""Notebook 01 (fused linear cross-entropy) as papermill runs it in CI: CPU parameters, checks asserted,
figures exported."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch

import notebook_runs  # each notebook executed once, shared with the browser tests
from kernels_lib.workbench import report

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
    assert html.count("Plotly.newPlot(") >= 3  # the sweep, the published chart, speed vs memory
    assert FALLBACK not in html
    assert "bf16 accumulation gives a dW error" in html
    # §11 from the committed past-floor run: what 0.92× of the three matmuls' time asks of the GEMMs, in TFLOP/s
    assert "What 0.92× asks of the GEMMs" in html and re.search(r"needs \d+–\d+ TFLOP/s", html)
    assert "Targets not judged yet" in html or " targets" in html and "meets" in html
    # §8b/8d from the committed gpu_runs: the profile per provider, the timeline, the class-major stages, QuACK's A/B
    for heading in ("kernels ms per step", "do_bench against the GPU", "class-major route's stages at N = 4096",
                    "by slab size", "The default beside QuACK alone"):
        assert heading in html, heading
    has_h200 = "H200 rows have not been measured yet" not in html
    assert has_h200 or "scripts/flce_dial_precision_stages.py" in html
