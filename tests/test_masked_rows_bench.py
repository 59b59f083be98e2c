"""scripts/masked_rows_bench.py end to end at a tiny size on the CPU: well-formed rows in the measured layout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from kernels_workbench.bench import masked_rows as mr
from kernels_workbench.bench.sweep import MEASURED_COLUMNS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import masked_rows_bench  # noqa: E402


def test_the_script_writes_one_row_per_provider_and_share(tmp_path):
    providers = ["kernels_lib", "kernels_lib[skip_ignored=False]", "liger", "three_matmuls[valid rows]"]
    assert masked_rows_bench.main(["--out", str(tmp_path), "--device", "cpu", "--tiny", "--percents", "0,50",
                                   "--providers", ",".join(providers)]) == 0
    rows = pd.read_csv(tmp_path / f"{mr.KERNEL_NAME}.csv")
    assert list(rows.columns) == MEASURED_COLUMNS
    ran = [p for p in providers if p != "liger"]  # Liger needs CUDA: named in the notes, no rows
    assert sorted(zip(rows.kernel_provider, rows.x_value)) == sorted((p, x) for p in ran for x in (0, 50))
    assert (rows.metric_name == "speed").all() and (rows.y_value_50 > 0).all()
    assert (rows.y_value_20 <= rows.y_value_50).all() and (rows.y_value_50 <= rows.y_value_80).all()
    assert rows.note.str.contains("liger skipped").all()
    assert rows[["gpu_name", "torch_version", "triton_version", "kernels_lib_commit"]].notna().all().all()
    config = json.loads(rows.extra_benchmark_config_str.iloc[-1])
    assert config["masked_percent"] == 50 and config["H"] == mr.TINY["H"] and config["dtype"] == "torch.bfloat16"


def test_the_prompt_share_of_each_sequence_is_masked():
    inputs = mr.make_inputs(mr.TINY, mr.DTYPE, "cpu", 25)
    target = inputs.args[2].view(mr.TINY["sequences"], mr.TINY["T"])
    prompt = mr.TINY["T"] // 4
    assert (target[:, :prompt] == -100).all() and (target[:, prompt:] >= 0).all()
    assert mr.flops(mr.TINY, 25) == 6.0 * mr.TINY["sequences"] * (mr.TINY["T"] - prompt) * mr.TINY["H"] * mr.TINY["V"]
