"""``scripts/tensor_parallel_bench.py --small``: two gloo ranks on CPU write the CSVs the notebook and
the overview read, with kernels_lib's rows measured and the peers that cannot run here noted."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch.distributed as dist

from kernels_workbench import data, overview
from kernels_workbench.bench.sweep import MEASURED_COLUMNS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "tensor_parallel_bench.py"

def _interpreter_unavailable() -> str | None:
    """Why ``--small``'s gloo ranks cannot run their kernels in Triton's interpreter here (None if they can).
    The ranks hold CPU tensors, so on a CUDA machine they interpret too; some machines' triton and numpy
    cannot (kernels_lib._runtime.check_interpreter_versions): the GPU path is the torchrun run."""
    from kernels_lib._runtime import check_interpreter_versions  # first: kernels_lib before triton

    import numpy
    import triton

    try:
        check_interpreter_versions(triton.__version__, numpy.__version__)
    except ImportError as error:
        return str(error)
    return None


_NO_INTERPRETER = _interpreter_unavailable()
pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo"),
    pytest.mark.skipif(_NO_INTERPRETER is not None, reason=f"--small's gloo ranks: {_NO_INTERPRETER}"),
]


def _script():
    spec = importlib.util.spec_from_file_location("tensor_parallel_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    done = subprocess.run([sys.executable, str(SCRIPT), "--small", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, done.stdout


def test_schema_and_kernels_lib_rows(written):
    out, log = written
    module = _script()
    rows = pd.read_csv(out / "tensor_parallel.csv")
    assert list(rows.columns) == module.COLUMNS
    assert "done" in log
    speed = rows[rows.metric_name == "speed"]
    for kernel_name in ("fused_linear_cross_entropy", "megatron_cross_entropy", "cross_entropy"):
        ours = speed[(speed.kernel_name == kernel_name) & (speed.kernel_provider == "kernels_lib")]
        assert set(zip(ours.tp, ours.kernel_operation_mode)) == {(1, "forward"), (1, "full"), (2, "forward"), (2, "full")}
        assert (ours.y_value_50 > 0).all() and ours.note.isna().all(), ours[["tp", "note"]]
        # The counted wire is kernels_lib's documented format, and nothing at TP = 1.
        assert (ours.comm_bytes == ours.comm_bytes_analytic).all(), ours[["tp", "comm_bytes", "comm_bytes_analytic"]]
        assert (ours[ours.tp == 1].comm_bytes == 0).all() and (ours[ours.tp == 2].comm_bytes > 0).all()
        assert (ours[ours.tp == 2].comm_ms > 0).all()
        assert all(len(json.loads(r)) == 2 for r in ours.rank_medians)


def test_baselines_and_skipped_peers(written):
    out, _ = written
    rows = pd.read_csv(out / "tensor_parallel.csv")
    speed = rows[(rows.metric_name == "speed") & (rows.kernel_name == "fused_linear_cross_entropy")]
    torch_rows = speed[speed.kernel_provider == "torch_loss_parallel"].set_index(["tp", "kernel_operation_mode"])
    assert (torch_rows.y_value_50 > 0).all()
    # loss_parallel all-reduces 3 floats a row in forward; full adds dx (N × H float32 here).
    n, h = 16, 32
    assert torch_rows.loc[(2, "forward"), "comm_bytes"] == 3 * 4 * n
    assert torch_rows.loc[(2, "full"), "comm_bytes"] == 3 * 4 * n + n * h * 4
    liger_tp = speed[speed.kernel_provider == "liger_tp"]
    assert liger_tp.y_value_50.isna().all() and liger_tp.note.str.startswith("skipped:").all()
    if importlib.util.find_spec("megatron") is None:
        megatron = rows[rows.kernel_provider.str.startswith("megatron")]
        assert len(megatron) and megatron.note.str.contains("megatron-core").all()
    # Providers of TP = 1 only have no TP = 2 rows.
    assert not len(rows[rows.kernel_provider.isin(["torch", "liger"]) & (rows.tp == 2)])


@pytest.mark.parametrize("workload", ["megatron_cross_entropy", "cross_entropy"])
def test_published_layout_matches_the_published_chart(written, workload):
    out, _ = written
    rows = data.read_rows(out / f"{workload}.csv")
    assert list(rows.columns) == MEASURED_COLUMNS
    assert {"kernels_lib", "kernels_lib[TP=2]", "torch"} <= set(rows.kernel_provider)
    published = overview._config(data.load_published(workload).extra_benchmark_config_str.iloc[0])
    for provider, belongs in (("kernels_lib", True), ("kernels_lib[TP=2]", workload == "cross_entropy")):
        mine = rows[rows.kernel_provider == provider]
        measured = overview._config(mine.extra_benchmark_config_str.iloc[0])
        # The published configuration at the small sizes (its TP kept): what the overview matches on.
        config = {k: (measured[k] if k.isupper() and k != "TP" else v) for k, v in published.items()}
        assert overview.belongs(measured, config, "V") is belongs, (provider, measured, config)
        assert {k for k in published if k.isupper()} <= set(measured)
        assert not math.isnan(mine.y_value_50.iloc[0])


def test_tensor_parallel_sizes():
    module = _script()
    assert module.tensor_parallel_sizes(1) == [1]
    assert module.tensor_parallel_sizes(2) == [1, 2]
    assert module.tensor_parallel_sizes(8) == [1, 2, 4, 8]
    assert module.tensor_parallel_sizes(6) == [1, 6]


def test_four_ranks_measure_tp_1_2_4_in_one_launch(tmp_path):
    """Four gloo ranks: TP = 1, 2 and 4 in one launch, the TP = 2 groups of consecutive ranks measured
    at once; kernels_lib's counted wire equals its documented format at each TP, and every rank's
    median is in the row."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--small", "--ranks", "4", "--workloads", "flce", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = pd.read_csv(tmp_path / "tensor_parallel.csv")
    speed = rows[rows.metric_name == "speed"]
    ours = speed[speed.kernel_provider == "kernels_lib"]
    assert set(zip(ours.tp, ours.kernel_operation_mode)) == {(k, m) for k in (1, 2, 4) for m in ("forward", "full")}
    assert (ours.y_value_50 > 0).all() and ours.note.isna().all(), ours[["tp", "note"]]
    assert (ours.comm_bytes == ours.comm_bytes_analytic).all() and (ours[ours.tp > 1].comm_bytes > 0).all()
    assert all(len(json.loads(r)) == 4 for r in ours.rank_medians)
    config = {json.loads(c)["TP"] for c in ours.extra_benchmark_config_str}
    assert config == {1, 2, 4}
    n, h = 16, 32  # loss_parallel's wire does not depend on TP: 3 floats a row, and dx in full
    torch_rows = speed[speed.kernel_provider == "torch_loss_parallel"].set_index(["tp", "kernel_operation_mode"])
    assert torch_rows.loc[(4, "forward"), "comm_bytes"] == 3 * 4 * n
    assert torch_rows.loc[(4, "full"), "comm_bytes"] == 3 * 4 * n + n * h * 4
