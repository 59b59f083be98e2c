"""kernels_lib.hf under DeepSpeed ZeRO-3 itself (not the stand-in of tests/test_hf_zero3.py): a training
step of a patched Llama-shaped model and a tied Qwen2-shaped model against the unpatched model under the
same engine, every gradient compared (``scripts/zero3_check.py``, in a subprocess of its own: DeepSpeed
sets up a process group). Runs on a CUDA machine where deepspeed is installed."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def test_zero3_training_step_matches_the_unpatched_model(tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed here (a pure-Python wheel: DS_BUILD_OPS=0)")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "zero3_check.py"), "--out", str(tmp_path)],
                          cwd=ROOT, env=dict(os.environ, MASTER_PORT=str(29500 + os.getpid() % 500)),
                          capture_output=True, text=True, timeout=600)
    output = (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "zero3_check.csv").exists(), f"no rows (exit {done.returncode}):\n{output}"
    rows = list(csv.DictReader((tmp_path / "zero3_check.csv").open()))
    assert {r["model"] for r in rows} == {"llama (own head)", "qwen2 (tied head)"}, rows
    for row in rows:
        assert row["head_partitioned"] == "True", f"{row['model']}: ZeRO-3 did not partition the head:\n{output}"
        assert row["fused_head_calls"] == "1" and row["logits_formed"] == "False", f"{row['model']}: the fused head did not run: {row}"
        assert float(row["loss_rel_err"]) < 1e-5, f"{row['model']}: loss {row['loss_kernels_lib']} vs {row['loss_hf']}"
        assert float(row["worst_grad_rel_err"]) < 1e-4, f"{row['model']}: {row['worst_grad_parameter']} {row['worst_grad_rel_err']}"
    assert done.returncode == 0, output
