"""The measurement side: sweeps, timing modes, ceilings, the command line, analysis, provenance.

Sweeps run on tiny CPU sizes (the interpreter is slow, and CPU times mean nothing for a GPU): the
tests check the rows' layout and consistency, never a time's value.
"""

from __future__ import annotations

import datetime as dt
import json
import time

import numpy as np
import pandas as pd
import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device
from kernels_workbench import data
from kernels_workbench.bench import analysis, cli, environment
from kernels_workbench.bench.ceilings import measure_ceilings
from kernels_workbench.bench.registry import get_spec, registered_losses
from synthetic_rows import committed_kl_run
from kernels_workbench.bench.sweep import (
    MEASURED_COLUMNS,
    PUBLISHED_COLUMNS,
    available_providers,
    median_of_rounds,
    run_sweep,
)
from kernels_workbench.bench.timing import MODES, backward_after_forward, mode_callable, time_after_setup
from kernels_workbench.check import relative_error

DEVICE = default_device()
ON_CPU = DEVICE.type == "cpu"
TINY = {"x_name": "V", "x_values": [64, 129], "sizes": {"N": 3}, "dtype": torch.float32}
# The ceilings' CUDA time would dominate this file; the CLI tests only need the sweep's rows.
needs_cpu = pytest.mark.skipif(not ON_CPU, reason="CPU-machine behaviour (no CUDA, liger cannot run)")


@pytest.fixture(scope="module")
def sweep():
    progress = []
    rows = run_sweep(
        "kl_div", **TINY, device=DEVICE, modes=MODES, progress=lambda *a: progress.append(a)
    )
    return rows, progress


# --------------------------------------------------------------------------- run_sweep


def test_sweep_columns(sweep):
    rows, _ = sweep
    assert list(rows.columns) == MEASURED_COLUMNS
    assert MEASURED_COLUMNS[: len(PUBLISHED_COLUMNS)] == PUBLISHED_COLUMNS


def test_sweep_one_speed_row_per_provider_x_mode(sweep):
    rows, _ = sweep
    speed = rows[rows.metric_name == "speed"]
    ran = sorted(set(speed.kernel_provider))
    assert {"kernels_lib", "torch"} <= set(ran)
    keys = speed[["kernel_provider", "x_value", "kernel_operation_mode"]].apply(tuple, axis=1)
    assert keys.is_unique
    expected = {(p, x, m) for p in ran for x in TINY["x_values"] for m in MODES}
    assert set(keys) == expected
    assert (speed.metric_unit == "ms").all()
    assert (rows.kernel_name == "kl_div").all()
    assert (rows.x_name == "V").all() and (rows.x_label == "vocab size").all()


def test_sweep_medians_positive_finite_and_ordered(sweep):
    rows, _ = sweep
    speed = rows[rows.metric_name == "speed"]
    for column in ("y_value_20", "y_value_50", "y_value_80"):
        values = speed[column].astype(float)
        assert np.isfinite(values).all() and (values > 0).all(), column
    assert (speed.y_value_20 <= speed.y_value_50).all()
    assert (speed.y_value_50 <= speed.y_value_80).all()


def test_sweep_config_and_provenance(sweep):
    rows, _ = sweep
    for _, row in rows.iterrows():
        config = json.loads(row.extra_benchmark_config_str)
        assert config["N"] == 3 and config["V"] == row.x_value
        assert config["dtype"] == "torch.float32"
        assert config["reduction"] == "batchmean" and config["log_target"] is False
    assert (rows.torch_version == torch.__version__).all()
    assert (rows.device == DEVICE.type).all()
    assert rows.kernels_lib_commit.astype(str).str.len().gt(0).all()


@needs_cpu
def test_sweep_on_cpu_timer_no_memory_liger_skipped(sweep):
    rows, _ = sweep
    assert (rows.metric_name == "speed").all(), "memory rows on CPU"
    assert (rows.timer == "wall_clock_cpu").all()
    assert (rows.gpu_name == environment.device_name("cpu")).all()
    assert "liger" not in set(rows.kernel_provider)
    assert rows.note.str.contains("liger skipped").all()


def test_sweep_progress_reports_every_measurement(sweep):
    rows, progress = sweep
    total = len(rows[rows.metric_name == "speed"])
    assert [done for done, _, _ in progress] == list(range(1, total + 1))
    assert {t for _, t, _ in progress} == {total}


@pytest.mark.parametrize("names", [["nope"], ["kernels_lib", "nope", "other"]])
def test_unknown_provider_raises_naming_it(names):
    with pytest.raises(ValueError, match="nope"):
        run_sweep("kl_div", **TINY, device=DEVICE, providers=names)
    with pytest.raises(ValueError, match="nope"):
        available_providers("kl_div", names)


def test_unknown_mode_raises_naming_it():
    with pytest.raises(ValueError, match="sideways"):
        run_sweep("kl_div", **TINY, device=DEVICE, modes=("forward", "sideways"))


def test_unknown_loss_and_empty_axis():
    with pytest.raises(ValueError, match="nope_loss"):
        get_spec("nope_loss")
    assert "kl_div" in registered_losses()
    with pytest.raises(ValueError, match="x_values"):
        run_sweep("kl_div", x_name="V", x_values=[], sizes={"N": 3}, dtype=torch.float32, device=DEVICE)


@needs_cpu
def test_available_providers_names_liger_reason():
    loaded, skipped = available_providers("kl_div")
    assert set(loaded) == {"kernels_lib", "torch"}
    assert set(skipped) == {"liger"} and "CUDA" in skipped["liger"]


def test_sweep_with_one_provider_and_option():
    rows = run_sweep(
        "kl_div", **TINY, device=DEVICE, providers=["kernels_lib"], modes=("forward_no_grad",),
        options={"reduction": "sum", "log_target": True},
    )
    assert set(rows.kernel_provider) == {"kernels_lib"}
    assert set(rows.kernel_operation_mode) == {"forward_no_grad"}
    assert len(rows[rows.metric_name == "speed"]) == len(TINY["x_values"])
    config = json.loads(rows.extra_benchmark_config_str.iloc[0])
    assert config["reduction"] == "sum" and config["log_target"] is True
    assert not rows.note.str.contains("liger").any()  # liger was not asked for


# --------------------------------------------------------------------------- mode_callable


class Probe:
    """A provider call on a fixed leaf: counts calls and whether grad mode was on."""

    def __init__(self):
        self.x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
        self.calls, self.grad_enabled = 0, []

    def __call__(self):
        self.calls += 1
        self.grad_enabled.append(torch.is_grad_enabled())
        return (self.x * self.x).sum()


def test_mode_forward():
    probe = Probe()
    fn = mode_callable(probe, [probe.x], "forward")
    assert probe.calls == 0
    fn()
    fn()
    assert probe.calls == 2 and probe.grad_enabled == [True, True]
    assert probe.x.grad is None


def test_mode_forward_no_grad():
    probe = Probe()
    fn = mode_callable(probe, [probe.x], "forward_no_grad")
    fn()
    assert probe.calls == 1 and probe.grad_enabled == [False]
    assert torch.is_grad_enabled()
    assert probe.x.grad is None


def test_mode_full_clears_grads_each_call():
    probe = Probe()
    fn = mode_callable(probe, [probe.x], "full")
    fn()
    fn()
    assert probe.calls == 2
    assert torch.equal(probe.x.grad, 2 * probe.x.detach())  # not accumulated over the two calls


def test_mode_backward_runs_a_fresh_forward_before_each_timed_backward():
    """backward_after_forward: setup clears the gradients and runs the forward, timed its backward, once each."""
    probe = Probe()
    setup, timed = backward_after_forward(probe, [probe.x])
    assert probe.calls == 0
    for calls in (1, 2, 3):
        setup()
        assert probe.calls == calls and probe.x.grad is None
        timed()
        assert torch.equal(probe.x.grad, 2 * probe.x.detach())  # one backward's, not accumulated
    with pytest.raises(KeyError):
        timed()  # a second backward needs its own forward
    with pytest.raises(ValueError, match="backward_after_forward"):
        mode_callable(probe, [probe.x], "backward")


def test_time_after_setup_leaves_the_setup_out():
    """A setup that sleeps 20 ms before a call that sleeps 2 ms: the times are the call's; each call after a setup."""
    order = []
    timing = time_after_setup(lambda: (order.append("s"), time.sleep(0.02)), lambda: (order.append("t"), time.sleep(0.002)),
                              torch.device("cpu"), cpu_repeats=4)
    assert order == ["s", "t"] * 5
    assert 2.0 <= timing.p20 <= timing.p50 <= timing.p80 < 15.0 and timing.timer == "wall_clock_cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events and torch.cuda._sleep: the CPU path is the test above")
def test_time_after_setup_on_cuda_times_the_call_alone():
    """On a GPU: a setup that keeps the GPU busy ~20x longer than the call is left out of the events' time."""
    device = torch.device("cuda")
    sleep = lambda cycles: torch.cuda._sleep(cycles)  # noqa: E731
    alone = time_after_setup(lambda: None, lambda: sleep(1_000_000), device)
    after = time_after_setup(lambda: sleep(20_000_000), lambda: sleep(1_000_000), device)
    assert after.timer == "cuda_events_after_setup" and alone.p50 > 0
    assert after.p50 == pytest.approx(alone.p50, rel=0.25), (alone, after)


def test_backward_of_a_loss_that_hands_its_gradients_out_once_is_measured():
    """kernels_lib's fused CE refuses a second backward through one graph (its gradients are formed in forward and
    handed out once): the sweep's backward, one fresh forward per timed backward, measures it, with dx and dW right."""
    spec = get_spec("fused_linear_cross_entropy")
    frame = run_sweep("fused_linear_cross_entropy", x_name="BT", x_values=[5], sizes={"H": 24, "V": 67}, dtype=torch.float32,
                      device=DEVICE, providers=["kernels_lib", "torch"], modes=["backward"])
    speed = frame[frame.metric_name == "speed"].set_index("kernel_provider")
    assert speed.y_value_50.notna().all() and (speed.y_value_50 > 0).all(), speed.note.tolist()
    assert not speed.note.str.contains("Error").any()
    inputs = spec.make_inputs({"BT": 5, "H": 24, "V": 67}, torch.float32, DEVICE, spec.default_options)
    fn = spec.providers["kernels_lib"].load()
    setup, timed = backward_after_forward(lambda: fn(*inputs.args, **inputs.kwargs), inputs.grad_inputs)
    for _ in range(2):  # the second backward has its own forward: no "backward ran twice"
        setup()
        timed()
    x, w = inputs.grad_inputs
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    reference = spec.providers["torch"].load()
    reference(x64, w64, *inputs.args[2:], **inputs.kwargs).backward()
    assert relative_error(x.grad, x64.grad) < 1e-5 and relative_error(w.grad, w64.grad) < 1e-5


def test_mode_unknown():
    with pytest.raises(ValueError, match="sideways"):
        mode_callable(Probe(), [], "sideways")


def test_modes_with_kernels_lib_kl_div():
    spec = get_spec("kl_div")
    fn = spec.providers["kernels_lib"].load()
    for mode in MODES:
        inputs = spec.make_inputs({"N": 2, "V": 33}, torch.float32, DEVICE, spec.default_options, 0)
        call = lambda: fn(*inputs.args, **inputs.kwargs)  # noqa: E731
        if mode == "backward":
            setup, timed = backward_after_forward(call, inputs.grad_inputs)
            setup()
            timed()
        else:
            mode_callable(call, inputs.grad_inputs, mode)()
        (x,) = inputs.grad_inputs
        if mode in ("full", "backward"):
            target = inputs.args[1]
            assert torch.allclose(x.grad, -target / 2), mode
        else:
            assert x.grad is None, mode


# --------------------------------------------------------------------------- ceilings


@needs_cpu
def test_measure_ceilings_on_cpu_is_empty():
    frame = measure_ceilings("cpu")
    assert isinstance(frame, pd.DataFrame)
    assert len(frame) == 0
    assert list(frame.columns) == MEASURED_COLUMNS


# --------------------------------------------------------------------------- command line

CLI_ARGS = ["kl_div", "--x", "V", "--values", "64,129", "--size", "N=3", "--providers", "kernels_lib,torch", "--modes", "forward,full"]


@pytest.fixture
def measured_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path / "measured")
    return tmp_path / "measured"


@needs_cpu
def test_cli_dry_run_prints_and_appends_nothing(measured_dir, capsys):
    assert cli.main(CLI_ARGS + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "kernels_lib" in out and "torch" in out and "forward" in out and "129" in out
    assert "appended" not in out
    assert not measured_dir.exists() or not any(measured_dir.iterdir())


@needs_cpu
def test_cli_appends_twice_with_one_header(measured_dir, capsys):
    assert cli.main(CLI_ARGS) == 0
    assert cli.main(CLI_ARGS + ["--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    path = measured_dir / "kl_div.csv"
    assert out.count(f"appended 8 rows to {path}") == 2
    lines = path.read_text().splitlines()
    header = ",".join(MEASURED_COLUMNS)
    assert lines[0] == header and lines.count(header) == 1
    rows = data.read_rows(path)
    assert list(rows.columns) == MEASURED_COLUMNS
    assert len(rows) == 16
    dtypes = rows.extra_benchmark_config_str.map(lambda s: json.loads(s)["dtype"])
    assert (dtypes == "torch.float32").sum() == 8 and (dtypes == "torch.bfloat16").sum() == 8
    assert not (measured_dir / "ceilings.csv").exists()  # no ceilings on CPU
    # load_measured keeps one row per key: both dtypes differ in config, so all 16 stay.
    assert len(data.load_measured("kl_div")) == 16


@pytest.mark.parametrize(
    "extra,fragment",
    [
        (["--providers", "kernels_lib,nope"], "nope"),
        (["--modes", "forward,sideways"], "sideways"),
        (["--values=0"], "positive"),
        (["--values=64,-3"], "positive"),
        (["--values", "64,abc"], "integers"),
        (["--size", "N=0"], "NAME=POSITIVE_INT"),
        (["--size", "N3"], "NAME=POSITIVE_INT"),
        (["--size", "=3"], "NAME=POSITIVE_INT"),
        (["--size", "N=-2"], "NAME=POSITIVE_INT"),
        (["--dtype", "float64"], "float64"),
        (["--device", "tpu"], "tpu"),
    ],
)
def test_cli_rejects_bad_arguments(extra, fragment, measured_dir, capsys):
    base = ["kl_div", "--values", "64", "--size", "N=2", "--dry-run"]
    with pytest.raises(SystemExit) as info:
        cli.main(base + extra)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err, err
    assert not measured_dir.exists()


@pytest.mark.parametrize(
    "extra,fragment",
    [(["--x", "T", "--size", "N=2"], "--x must be one of"), (["--x", "N"], "needs the fixed size(s) V")],
    ids=["unknown-axis", "swept-axis-without-other-size"],
)
def test_cli_rejects_axes_the_loss_lacks(extra, fragment, measured_dir, capsys):
    """A usage error (exit 2, message), not a KeyError from inside the sweep."""
    with pytest.raises(SystemExit) as info:
        cli.main(["kl_div", "--values", "4", "--dry-run"] + extra)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.gpu_memory(5)  # on a GPU: the matmul ceiling's operands
def test_cli_sweeps_another_axis_given_the_fixed_sizes(measured_dir, capsys):
    args = ["kl_div", "--x", "N", "--values", "1,2", "--size", "V=33", "--providers", "kernels_lib", "--modes", "forward", "--dry-run"]
    assert cli.main(args) == 0
    assert not measured_dir.exists()


def test_named_presets_and_their_axes():
    spec = get_spec("jsd")
    tokens = spec.preset("published_tokens")
    assert tokens["x_name"] == "BT" and tokens["sizes"] == {"V": 128256} and tokens["x_values"] == [1024, 2048, 4096, 8192]
    assert spec.preset("published") is spec.published and spec.preset("small") is spec.small
    assert spec.published_preset("BT") is tokens and spec.published_preset("V") is spec.published
    assert spec.published_preset("H") is None
    with pytest.raises(ValueError, match="published_tokens"):
        spec.preset("nope")
    # The token chart counts rows as BT: the same inputs and bytes as N rows.
    assert spec.bytes_moved({"BT": 3, "V": 64}, torch.float32, "full") == spec.bytes_moved({"N": 3, "V": 64}, torch.float32, "full") == 12 * 3 * 64
    inputs = spec.make_inputs({"BT": 3, "V": 64}, torch.float32, "cpu", dict(spec.default_options))
    assert inputs.args[0].shape == (3, 64) and "target" not in inputs.kwargs
    ignoring = spec.make_inputs({"N": 40, "V": 8}, torch.float32, "cpu", {"ignore_fraction": 0.5})
    ignored = ignoring.kwargs["target"] == -100
    assert 0 < int(ignored.sum()) < 40 and not ignored[0]


@needs_cpu
def test_cli_runs_the_token_preset_with_the_published_axis(measured_dir, capsys):
    args = ["jsd", "--preset", "published_tokens", "--values", "2,3", "--size", "V=64", "--providers", "kernels_lib,torch", "--modes", "forward"]
    assert cli.main(args) == 0
    rows = data.read_rows(measured_dir / "jsd.csv")
    assert len(rows) == 2 * 2 and set(rows.x_value) == {2, 3}
    assert (rows.x_name == "BT").all() and (rows.x_label == "total tokens").all()
    for _, row in rows.iterrows():
        config = json.loads(row.extra_benchmark_config_str)
        assert config == {"V": 64, "BT": row.x_value, "dtype": "torch.float32", "beta": 0.5, "reduction": "batchmean"}


@pytest.mark.parametrize("loss,preset", [("kl_div", "published_tokens"), ("jsd", "tokens")])
def test_cli_rejects_a_preset_the_loss_lacks(loss, preset, measured_dir, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([loss, "--preset", preset, "--dry-run"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert preset in err and "published, small" in err
    assert not measured_dir.exists()


@needs_cpu
def test_token_preset_rows_land_on_the_b200_chart_only(measured_dir, capsys):
    """The CLI's rows at the published V, relabelled as an H200 run (the overview reads CUDA rows only): they join
    the B200 token chart, not the H100 vocabulary chart, and give it a floor of 12 B per element."""
    from kernels_workbench import overview

    assert cli.main(["jsd", "--preset", "published_tokens", "--values", "1", "--providers", "kernels_lib", "--modes", "forward"]) == 0
    path = measured_dir / "jsd.csv"
    rows = data.read_rows(path).assign(gpu_name=overview.H200, device="cuda")
    rows.to_csv(path, index=False)
    charts = {w.x_name: w for w in overview.workloads() if w.kernel_name == "jsd"}
    assert set(charts) == {"V", "BT"}
    assert len(charts["BT"].measured) == 1 and charts["BT"].measured.x_value.tolist() == [1]
    assert len(charts["V"].measured) == 0
    assert charts["BT"].title == "jsd (V = 128256)"
    ceilings = pd.DataFrame([{"kernel_name": name, "gpu_name": overview.H200, "kernels_lib_commit": rows.kernels_lib_commit.iloc[0],
                              "timestamp": "2026-01-01 00:00:00", "y_value_50": value} for name, value in (("copy", 4000.0), ("matmul", 700.0))])
    floor = overview.workload_floor(charts["BT"], ceilings)
    assert list(floor.ms.index) == [1, 1024, 2048, 4096, 8192]
    assert floor.ms.loc[8192, "full"] == pytest.approx(12 * 8192 * 128256 / 4000e9 * 1e3)
    assert "copy 4000 GB/s" in floor.describe() and set(floor.bound) == {"bytes"}


def test_cli_rejects_unknown_loss(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["nope_loss", "--dry-run"])
    assert info.value.code == 2
    assert "nope_loss" in capsys.readouterr().err


@needs_cpu
def test_cli_rejects_cuda_on_cpu_machine(measured_dir, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["kl_div", "--values", "64", "--size", "N=2", "--device", "cuda"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "cuda" in err and "cpu" in err
    assert not measured_dir.exists()


# --------------------------------------------------------------------------- analysis on committed data


@pytest.fixture(scope="module")
def committed():
    return committed_kl_run()


def test_committed_measurements_cover_the_published_workload(committed):
    rows, _ = committed
    assert list(rows.columns) == MEASURED_COLUMNS
    assert len(rows) == 6 * 3 * 4 * 2  # x, providers, modes, metrics (speed and memory)
    assert sorted(set(rows.x_value)) == [4096, 8192, 16384, 32768, 65536, 131072]
    assert set(rows.kernel_provider) == {"kernels_lib", "torch", "liger"}
    assert set(rows.kernel_operation_mode) == set(MODES)


def test_medians(committed):
    rows, _ = committed
    table = analysis.medians(rows, "speed", "forward")
    assert list(table.index) == [4096, 8192, 16384, 32768, 65536, 131072]
    assert set(table.columns) == {"kernels_lib", "torch", "liger"}
    row = rows[
        (rows.metric_name == "speed") & (rows.kernel_operation_mode == "forward")
        & (rows.kernel_provider == "torch") & (rows.x_value == 32768)
    ]
    assert len(row) == 1
    assert table.loc[32768, "torch"] == pytest.approx(row.y_value_50.iloc[0])


@pytest.mark.parametrize("mode,bytes_per_element", [("forward", 12), ("forward_no_grad", 8), ("full", 12)])
def test_achieved_bandwidth_is_bytes_over_time(committed, mode, bytes_per_element):
    rows, _ = committed
    bandwidth = analysis.achieved_bandwidth(rows, "kl_div", "kernels_lib", mode)
    assert list(bandwidth.index) == [4096, 8192, 16384, 32768, 65536, 131072]
    row = rows[
        (rows.metric_name == "speed") & (rows.kernel_operation_mode == mode)
        & (rows.kernel_provider == "kernels_lib") & (rows.x_value == 65536)
    ].iloc[0]
    # Computed independently: N = 16384 rows of V = 65536 fp32 elements, 4 bytes each.
    expected = 16384 * 65536 * bytes_per_element / (row.y_value_50 / 1e3) / 1e9
    assert bandwidth.loc[65536] == pytest.approx(expected, rel=1e-12)
    assert (bandwidth > 0).all()


def test_ceiling_is_the_newest(committed):
    _, ceilings = committed
    copies = ceilings[(ceilings.kernel_name == "copy") & (ceilings.gpu_name == "NVIDIA H200")]
    newest = copies.sort_values("timestamp").y_value_50.iloc[-1]
    assert analysis.ceiling(ceilings, "copy", "NVIDIA H200") == pytest.approx(newest)
    with pytest.raises(ValueError, match="NVIDIA A100"):
        analysis.ceiling(ceilings, "copy", "NVIDIA A100")


# --------------------------------------------------------------------------- provenance


def test_provenance_keys_and_values():
    stamp = environment.provenance(DEVICE)
    assert set(stamp) == {
        "gpu_name", "timestamp", "liger_version", "cce_version", "torch_version", "triton_version", "kernels_lib_commit",
        "quack_version", "cutlass_dsl_version",
    }
    assert set(stamp) <= set(MEASURED_COLUMNS)
    assert stamp["torch_version"] == torch.__version__
    dt.datetime.strptime(stamp["timestamp"], "%Y-%m-%d %H:%M:%S")
    assert stamp["kernels_lib_commit"]
    if ON_CPU:
        assert stamp["gpu_name"] == "CPU (Triton interpreter)"


def test_commit_override(monkeypatch):
    environment.git_commit.cache_clear()
    monkeypatch.setenv("KERNELS_LIB_COMMIT", "abc123def456")
    try:
        assert environment.git_commit() == "abc123def456"
        assert environment.provenance(DEVICE)["kernels_lib_commit"] == "abc123def456"
    finally:
        environment.git_commit.cache_clear()
    monkeypatch.delenv("KERNELS_LIB_COMMIT")
    try:
        assert environment.git_commit() != "abc123def456"
    finally:
        environment.git_commit.cache_clear()


def test_package_version():
    assert environment.package_version("torch").split("+")[0] == torch.__version__.split("+")[0]
    assert environment.package_version("no-such-distribution-kernels-lib") == ""
    assert environment.device_name("cpu") == "CPU (Triton interpreter)"


def test_median_of_rounds():
    """Three rounds of two points: each y value is its median over the rounds, the rest the first
    round's, the note says so (after any note the row had), and the round column is gone."""
    base = {c: "" for c in MEASURED_COLUMNS}
    rows = []
    for number, (a, b) in enumerate([(3.0, 10.0), (1.0, 30.0), (2.0, 20.0)], start=1):
        for provider, value, note in (("kernels_lib", a, ""), ("torch", b, "liger skipped (no wheel)")):
            rows.append({**base, "kernel_name": "k", "kernel_provider": provider, "kernel_operation_mode": "full",
                         "metric_name": "speed", "x_value": 8, "y_value_50": value, "y_value_20": value - 0.5,
                         "y_value_80": value + 0.5, "timestamp": f"t{number}", "note": note, "round": number})
    table = median_of_rounds(pd.DataFrame(rows))
    assert list(table.columns) == MEASURED_COLUMNS
    table = table.set_index("kernel_provider")
    assert table.loc["kernels_lib", ["y_value_50", "y_value_20", "y_value_80"]].tolist() == [2.0, 1.5, 2.5]
    assert table.loc["torch", "y_value_50"] == 20.0 and (table.timestamp == "t1").all()
    assert table.loc["kernels_lib", "note"] == "median of 3 rounds, providers in alternating order"
    assert table.loc["torch", "note"] == "liger skipped (no wheel); median of 3 rounds, providers in alternating order"
    with pytest.raises(ValueError, match="round"):
        median_of_rounds(pd.DataFrame(rows).drop(columns="round"))


