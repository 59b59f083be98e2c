"""kernels_workbench.fused_cross_entropy: what notebook 01 computes beyond the bench (the derivation's check,
the ForCausalLMLoss check, the budget, the precision sentence, and the headline and comparison of a GPU run)."""

from __future__ import annotations

import json

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from kernels_lib import default_device
from kernels_workbench import data
from kernels_workbench import fused_cross_entropy as fce
from kernels_workbench.bench import fused_linear_cross_entropy as flce

CONFIG = json.dumps({"H": 4096, "V": 128256, "dtype": "torch.bfloat16"})


def _run(values: dict, gpu: str = "NVIDIA H100 80GB HBM3", commit: str = "abc1234") -> pd.DataFrame:
    """One run's rows from {(provider, metric): {N: median}} in mode ``full``, at the published workload."""
    return pd.DataFrame([
        {"kernel_name": flce.KERNEL_NAME, "kernel_provider": p, "kernel_operation_mode": "full", "metric_name": m,
         "x_value": n, "y_value_50": y, "extra_benchmark_config_str": CONFIG, "gpu_name": gpu, "device": "cuda",
         "kernels_lib_commit": commit, "timestamp": "2026-12-05 09:00"}
        for (p, m), by_n in values.items() for n, y in by_n.items()])


RUN = _run({("kernels_lib", "speed"): {4096: 20.0, 8192: 40.0}, ("torch", "speed"): {4096: 25.0, 8192: 50.0},
            ("liger", "speed"): {4096: 40.0, 8192: 100.0}, (flce.FLOOR, "speed"): {4096: 19.0, 8192: 40.0},
            ("kernels_lib[chunk_size=256]", "speed"): {4096: 10.0, 8192: 20.0},
            ("kernels_lib", "memory"): {4096: 1000.0, 8192: 2000.0}, ("torch", "memory"): {4096: 4000.0, 8192: 10000.0}})


def _naive(z, y, eps=0.0, lam=0.0, s=None, ignore_index=-100, reduction="mean"):
    c = s * torch.tanh(z / s) if s else z
    lse, valid = c.logsumexp(-1), y != ignore_index
    c_y = c.gather(1, y.clamp(min=0)[:, None])[:, 0]
    per_row = torch.where(valid, (1 - eps) * (lse - c_y) + eps * (lse - c.mean(-1)) + lam * lse**2, 0.0)
    return {"none": per_row, "sum": per_row.sum(), "mean": per_row.sum() / valid.sum()}[reduction]


def _derived(x, w, y, eps, lam, s, reduction, upstream, ignore_index=-100, sign=1.0):
    z = x @ w.T
    c = s * torch.tanh(z / s) if s else z
    lse = c.logsumexp(-1, keepdim=True)
    dc = (c - lse).exp() * (1 + 2 * lam * lse) - (1 - eps) * F.one_hot(y.clamp(min=0), w.shape[0]).double() - eps / w.shape[0]
    dz = dc * (1 - (c / s) ** 2) if s else dc
    valid = y != ignore_index
    g = {"none": upstream, "sum": torch.ones_like(lse[:, 0]), "mean": torch.ones_like(lse[:, 0]) / valid.sum()}[reduction]
    dz = sign * torch.where(valid[:, None], dz * g[:, None], 0.0)
    return dz @ w, dz.T @ x


def test_derivation_check_passes_the_right_gradient_and_names_a_wrong_one():
    table = fce.derivation_check(_naive, _derived, seed=3)
    assert len(table) == 5 * 3 and (table.filter(like=" vs ") < 1e-12).all().all()
    with pytest.raises(AssertionError, match="derivation check failed"):
        fce.derivation_check(_naive, lambda *args: _derived(*args, sign=-1.0), seed=3)


def test_transformers_check_on_a_tiny_batch():
    row = fce.transformers_check(torch.float32, "sum", (1, 5, 16, 33), 0, default_device())
    assert row["passed"] and row["kernels_lib loss err"] < 1e-5 and row["shape"] == "B=1 T=5 H=16 V=33"


def test_budget_counts_the_three_matmuls_and_the_chunks():
    sizes = {"N": 8192, "H": 4096, "V": 128256}
    table, extra = fce.budget(sizes, {"full": 35.0}, 4096)
    assert table.loc["matmul TFLOP", "full"] == pytest.approx(3 * 2 * 8192 * 4096 * 128256 / 1e12)
    assert table.loc["matmul TFLOP", "forward_no_grad"] == pytest.approx(table.loc["matmul TFLOP", "full"] / 3)
    assert table.iloc[2]["full"] == 35.0 and math.isnan(table.iloc[2]["forward_no_grad"]), "the floor as given, per mode"
    assert extra["chunks"] == 2 and extra["logits buffer (MiB)"] == pytest.approx(4096 * 128256 * 2 / 2**20)
    assert "not measured" in fce.budget(sizes, None, 4096)[0].index[2]


def test_precision_sentence_from_a_table():
    table = pd.DataFrame({"provider": ["kernels_lib[chunk_size=2 accurate=False]", "kernels_lib[chunk_size=2 accurate=True]", "torch"],
                          "dW err": [4e-3, 1e-3, 2e-3]})
    said = fce.precision_sentence(table, 128, 2)
    assert said.startswith("Here, with 64 chunks, bf16 accumulation gives a dW error of 4.00e-03 against 1.00e-03")
    assert "(4.0×)" in said and "has 2.00e-03" in said


def test_committed_run_keeps_the_newest_run_of_each_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    assert fce.committed_run(fce.DIAL_FILE) is None
    path = tmp_path / fce.DIAL_FILE
    path.parent.mkdir(parents=True)
    pd.concat([RUN, RUN.assign(kernels_lib_commit="old0001", timestamp="2026-12-01")]).to_csv(path, index=False)
    assert set(fce.committed_run(fce.DIAL_FILE).kernels_lib_commit) == {"abc1234"}


def test_row_options_check_covers_every_option_and_reduction():
    """Notebook 01's table of row options: every option set × reduction within 1e-5 of float64, the
    predicted classes the argmax."""
    table = fce.row_options_check(seed=1, device=default_device())  # the kernels' device, as notebook 01
    assert len(table) == 3 * len(fce.ROW_OPTIONS) and set(table.reduction) == {"none", "sum", "mean"}
    assert (table.filter(like=" err") < 1e-5).all().all()
    assert table["predicted = argmax"].dropna().all() and table["predicted = argmax"].notna().any()
