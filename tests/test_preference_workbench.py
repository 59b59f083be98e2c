"""kernels_workbench.preference: notebook 06's derivation check (run on the notebook's own naive losses, read
from the notebook), and its headline per GPU from the newest run of each loss."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from kernels_workbench import data, preference

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_preference_dpo_cpo_simpo_grpo.ipynb"


def _notebook_functions() -> dict:
    """The naive losses and the derived gradients as notebook 06 defines them (its cells, run here)."""
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    namespace = {"torch": torch, "F": F}
    first = next(c for c in cells if c.startswith("def token_logps("))
    second = next(c for c in cells if c.startswith("def grpo("))
    exec(first, namespace)  # noqa: S102  (the notebook's own code)
    exec(second[: second.index("\nderivation, clipped =")], namespace)  # noqa: S102
    return namespace


def test_derivation_check_passes_the_notebook_s_gradients_and_names_a_wrong_one():
    f = _notebook_functions()
    table, clipped = preference.derivation_check(f["paired"], f["grpo"], f["token_logps"], f["derived_grads"], seed=0)
    assert set(table["loss"]) == {"DPO", "CPO", "SimPO", "GRPO (token)", "GRPO (sequence)"}
    assert len(table) == 5 * len(preference.DERIVATION_SHAPES) and (table.filter(like=" vs ") < 1e-12).all().all()
    assert clipped > 0, "off-policy: some tokens clipped, so the clipped branch of the weights is checked"

    def wrong(x, w, b, y, weights):
        dx, dw, db = f["derived_grads"](x, w, b, y, weights)
        return dx, dw * 1.01, db

    with pytest.raises(AssertionError, match="derivation check failed"):
        preference.derivation_check(f["paired"], f["grpo"], f["token_logps"], wrong, seed=0)


def _run(name: str, gpu: str, commit: str, ours: dict, liger: dict, baseline: str = "huggingface") -> pd.DataFrame:
    rows = []
    for provider, values in (("kernels_lib", ours), ("liger", liger), (baseline, {b: 2 * v for b, v in ours.items()})):
        for b, ms in values.items():
            for metric, y in (("speed", ms), ("memory", 10 * ms)):
                rows.append({"kernel_name": name, "kernel_provider": provider, "kernel_operation_mode": "full", "metric_name": metric,
                             "x_value": b, "y_value_50": y, "gpu_name": gpu, "device": "cuda", "kernels_lib_commit": commit,
                             "timestamp": "2026-12-05 09:00", "extra_benchmark_config_str": "{}"})
    return pd.DataFrame(rows)


def test_headline_per_gpu_over_the_losses(monkeypatch):
    runs = {"fused_linear_dpo_loss": pd.concat([_run("fused_linear_dpo_loss", "NVIDIA H200", "abc1234", {2: 8.0, 16: 40.0}, {2: 10.0, 16: 50.0}),
                                                _run("fused_linear_dpo_loss", "NVIDIA H100 80GB HBM3", "def5678", {2: 9.0}, {2: 10.0})]),
            "fused_linear_cpo_loss": _run("fused_linear_cpo_loss", "NVIDIA H200", "abc1234", {4: 6.0}, {4: 10.0})}
    monkeypatch.setattr(data, "load_measured", lambda name, latest=True: runs.get(name, pd.DataFrame()))
    said = preference.headline({"fused_linear_dpo_loss": "DPO", "fused_linear_cpo_loss": "CPO"})
    assert "On the H200, kernels_lib's `full` takes 0.60–0.80× Liger's time, 0.50× the baseline's" in said
    assert "at 0.60–0.80× Liger's memory, over 2 losses and B = 2–16" in said
    assert "On the H100 80GB, kernels_lib's `full` takes 0.90× Liger's time" in said and "over 1 losses" in said
    monkeypatch.setattr(data, "load_measured", lambda name, latest=True: pd.DataFrame())
    assert preference.headline({"fused_linear_dpo_loss": "DPO"}).startswith("Not measured on a GPU yet")
