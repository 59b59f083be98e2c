"""studies.bench.host_profile (the host's share of a small call) and the row divergences' small-vocabulary profile script."""

from __future__ import annotations

import importlib
import time

import pandas as pd
import pytest
import torch

from kernels_lib import default_device
from studies.bench import host_profile
from kernels_workbench.bench.sweep import available_providers



def test_host_times_measure_the_calls():
    """A call that sleeps 3 ms reads at least 3 ms per call back to back and after a sync; the count is kept."""
    calls = []
    throughput, latency = host_profile.host_times(lambda: (calls.append(1), time.sleep(0.003)), torch.device("cpu"), 4)
    assert len(calls) == 4 + 5, "the back-to-back calls, then five alone"
    assert throughput >= 3.0 and latency >= 3.0
    assert host_profile.host_microseconds(lambda: time.sleep(0.001), torch.device("cpu"), 3) >= 1000.0


def test_host_ops_name_the_ops_of_a_call():
    x = torch.randn(64, 64)
    rows = host_profile.host_ops(lambda: torch.mm(x, x).sum(), calls=4, warmup=1)
    by_op = {row["op"]: row for row in rows}
    assert by_op["aten::mm"]["calls per step"] == 1.0 and by_op["aten::sum"]["calls per step"] == 1.0
    selfs = [row["self cpu ms per step"] for row in rows]
    assert selfs == sorted(selfs, reverse=True), "the costliest first"


def test_step_rows_time_the_chain_and_the_step_in_alternating_rounds():
    device = default_device()
    order = []
    chain = host_profile.matmul_chain(16, 2, torch.float32, device)
    steps = {"a": lambda: order.append("a"), "b": lambda: (order.append("b"), time.sleep(0.002))}
    rows = pd.DataFrame(host_profile.step_rows(steps, chain, device, rounds=2))
    assert list(rows["round"]) == [1, 1, 2, 2] and list(rows.provider) == ["a", "b", "b", "a"]
    assert (rows["loss in step ms"] == rows["step ms"] - rows["chain ms"]).all()
    b = rows[rows.provider == "b"]
    assert (b["step ms"] >= 2.0).all()


def _script():
    return importlib.import_module("studies.divergence_small_vocab_profile")


def test_divergence_small_vocab_profile_script_cpu_path(tmp_path):
    """At CPU size: every loss, V and provider that loads timed in ``full``, host times positive, the GPU's
    busy time there exactly where a GPU is; kernels_lib's profiled ops; the step rows; provenance on each."""
    script = _script()
    assert script.main(["--out", str(tmp_path), "--size", "small"]) == 0
    times = pd.read_csv(tmp_path / script.FILES["times"])
    assert set(times.loss) == set(script.LOSSES) and set(times.V) == set(script.SIZES["small"]["vocabs"])
    cuda = torch.cuda.is_available()
    for loss in script.LOSSES:
        assert set(times[times.loss == loss].provider) == set(available_providers(loss, script.PROVIDERS)[0])
    assert {"kernels_lib", "torch"} <= set(times.provider)
    assert (times[["do_bench ms", "host ms per call, back to back", "host ms of one call after a sync"]] > 0).all().all()
    assert (times["do_bench p20 ms"] <= times["do_bench p80 ms"]).all()
    assert times["gpu busy ms per call"].notna().all() if cuda else times["gpu busy ms per call"].isna().all()
    ops = pd.read_csv(tmp_path / script.FILES["ops"])
    assert set(ops.loss) == set(script.LOSSES) and "RowDivergenceFunction" in set(ops.op)
    steps = pd.read_csv(tmp_path / script.FILES["step"])
    assert set(steps.V) == set(script.SIZES["small"]["vocabs"][:-1]), "the control V is not stepped"
    for frame in (times, ops, steps):
        assert "kernels_lib_commit" in frame.columns and frame.gpu_name.notna().all()


def test_divergence_small_vocab_profile_refuses_an_unknown_part(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _script().main(["--out", str(tmp_path), "--size", "small", "--parts", "times,timeline"])
    assert "--parts must be among times, ops, step; got timeline" in capsys.readouterr().err
