"""scripts/masked_rows_bench.py end to end at a tiny size on the CPU: well-formed rows in the measured layout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

import kernels_lib

from kernels_workbench.bench import masked_rows as mr
from kernels_workbench.bench.sweep import MEASURED_COLUMNS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import masked_rows_bench  # noqa: E402


@pytest.mark.skipif(not kernels_lib.INTERPRETED, reason="--device cpu: the kernels take CPU tensors only in Triton's "
                    "interpreter (on a GPU the script runs at its full size: scripts/masked_rows_bench.py)")
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


def synthetic_run(path: Path) -> Path:
    """A GPU run's rows in the measured layout: kernels_lib follows the valid tokens, a peer does not."""
    rows = []
    for provider, times in (("kernels_lib", [100, 76, 51, 27]), ("liger", [200, 199, 201, 198])):
        for percent, ms in zip(mr.MASKED_PERCENTS, times):
            rows.append(dict.fromkeys(MEASURED_COLUMNS) | {
                "kernel_name": mr.KERNEL_NAME, "kernel_provider": provider, "kernel_operation_mode": "full",
                "metric_name": "speed", "metric_unit": "ms", "x_name": "masked_percent", "x_value": percent,
                "y_value_50": ms, "y_value_20": ms * 0.99, "y_value_80": ms * 1.01, "gpu_name": "NVIDIA H100 80GB HBM3",
                "timestamp": "t", "kernels_lib_commit": "c0ffee1", "device": "cuda", "torch_version": "2.13",
                "triton_version": "3.9"})
    pd.DataFrame(rows, columns=MEASURED_COLUMNS).to_csv(path, index=False)
    return path


def test_the_chart_and_its_sentence_read_a_run(tmp_path):
    from kernels_workbench import masked_rows

    assert masked_rows.newest_runs(tmp_path / "absent.csv") is None
    runs = masked_rows.newest_runs(synthetic_run(tmp_path / "run.csv"))
    (gpu, rows), = runs.items()
    relative = masked_rows.relative_times(rows)
    ours = relative[relative.provider == "kernels_lib"].set_index("masked %")
    assert ours.loc[0, "time / unmasked"] == 1 and abs(ours.loc[75, "time / unmasked"] - 0.27) < 1e-12
    assert ours.loc[75, "valid share"] == 0.25
    figure = masked_rows.figure(rows, gpu)
    assert len(figure.data) == 2 * 2 + 1  # two panels per provider, the valid-token share
    assert list(figure.data[-1].y) == [1.0, 0.75, 0.5, 0.25]
    text = masked_rows.sentence(rows)
    assert "75 % of the positions masked (25% of the tokens valid)" in text and "0.27 of its unmasked time" in text
    assert "0.99" in text  # Liger's 198 / 200
