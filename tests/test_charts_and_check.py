"""Charts, the interactive sweep panel, and the check tables against the float64 reference."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device
from kernels_workbench import data
from kernels_workbench.bench.spec import Provider
from kernels_workbench.bench.registry import get_spec
from kernels_workbench.charts import (
    COLORS, PANELS, axis_title, base_provider, line_traces, provider_color, scaling_chart, speed_memory_chart,
)
from kernels_workbench.check import TOLERANCE, assert_checks_pass, check_against_reference
from kernels_lib.kl_div import kl_div

DEVICE = default_device()


# --------------------------------------------------------------------------- scaling_chart


def _rows(gpu, provider, mode, metric, xs, bands=True):
    rows = []
    for i, x in enumerate(xs):
        row = {
            "kernel_name": "kl_div", "kernel_provider": provider, "kernel_operation_mode": mode,
            "metric_name": metric, "x_value": x, "y_value_50": 1.0 + i, "gpu_name": gpu,
        }
        if bands:
            row.update(y_value_20=0.9 + i, y_value_80=1.1 + i)
        rows.append(row)
    return rows


def _bands(figure):
    return [trace for trace in figure.data if trace.fill == "toself"]


def test_chart_counts_lines_and_bands_for_known_inputs():
    xs = [4096, 8192, 16384]
    published = pd.DataFrame(
        _rows("GPU P", "torch", "forward", "speed", xs)
        + _rows("GPU P", "liger", "forward", "speed", xs)
        + _rows("GPU P", "torch", "full", "speed", xs)
        + _rows("GPU P", "torch", "backward", "speed", xs)  # no panel shows backward
    )
    measured = pd.DataFrame(
        _rows("GPU M", "kernels_lib", "forward", "speed", xs[::-1])  # unsorted on purpose
        + _rows("GPU M", "kernels_lib", "full", "memory", xs)
        + _rows("GPU N", "kernels_lib", "full", "memory", xs)
    )
    figure = scaling_chart(published, measured, x_label="vocab size", title="t")
    lines = line_traces(figure)
    # speed·forward: torch, liger (published) + kernels_lib GPU M; speed·full: torch;
    # memory·full: kernels_lib on two GPUs.
    assert len(lines) == 6
    assert len(_bands(figure)) == 6
    names = [line.name for line in lines]
    assert sorted(names) == sorted(
        [
            "torch · GPU P (published)", "liger · GPU P (published)", "kernels_lib · GPU M (measured)",
            "torch · GPU P (published)", "kernels_lib · GPU M (measured)", "kernels_lib · GPU N (measured)",
        ]
    )
    for line in lines:
        assert list(line.x) == sorted(line.x), line.name
        assert ("(published)" in line.name) != ("(measured)" in line.name)
        assert ("GPU P" in line.name) == ("(published)" in line.name)
        # published dashed; each measured GPU a line style of its own (GPU M first: solid, GPU N: dash-dot)
        assert line.line.dash == {"P": "dash", "M": "solid", "N": "dashdot"}[line.name.split("GPU ")[1][0]], line.name
    # One legend entry per name even when a series appears in two panels.
    shown = [line.name for line in lines if line.showlegend]
    assert sorted(shown) == sorted(set(names))


def test_chart_shows_each_measured_gpu_beside_the_published_rows_labelled():
    """The newest run of each GPU (an H100 80GB and an H200) beside the published A100 rows: each line named
    with its GPU's short label, one colour per provider on every GPU, a line style per GPU."""
    xs = [2, 4]
    published = pd.DataFrame(_rows("NVIDIA A100-SXM4-80GB", "liger", "full", "speed", xs))
    measured = pd.DataFrame(_rows("NVIDIA H200", "kernels_lib", "full", "speed", xs) + _rows("NVIDIA H200", "liger", "full", "speed", xs)
                            + _rows("NVIDIA H100 80GB HBM3", "kernels_lib", "full", "speed", xs))
    lines = {line.name: line for line in line_traces(scaling_chart(published, measured, x_label="B", title="t"))}
    assert set(lines) == {"liger · A100 80GB (published)", "kernels_lib · H200 (measured)", "liger · H200 (measured)",
                          "kernels_lib · H100 80GB (measured)"}
    assert lines["kernels_lib · H200 (measured)"].line.color == lines["kernels_lib · H100 80GB (measured)"].line.color
    assert lines["liger · A100 80GB (published)"].line.color == lines["liger · H200 (measured)"].line.color
    styles = {name: line.line.dash for name, line in lines.items()}
    assert styles["kernels_lib · H100 80GB (measured)"] == "solid" and styles["kernels_lib · H200 (measured)"] == "dashdot"
    assert styles["liger · H200 (measured)"] == "dashdot" and styles["liger · A100 80GB (published)"] == "dash"


def test_chart_axes_log_and_linear():
    frame = pd.DataFrame(_rows("G", "torch", "forward", "speed", [1, 2, 4]))
    figure = scaling_chart(frame, None, x_label="V", title="t")
    axes = [figure.layout[name] for name in figure.layout if name.startswith("xaxis")]
    assert len(axes) == len(PANELS)
    assert all(axis.type == "log" for axis in axes)
    assert all(axis.title.text == "vocabulary size (V)" for axis in axes)  # the one name of the V axis
    linear = scaling_chart(frame, None, x_label="V", title="t", log_x=False)
    assert all(linear.layout[name].type == "linear" for name in linear.layout if name.startswith("xaxis"))


def test_chart_without_p20_p80_has_no_bands():
    frame = pd.DataFrame(_rows("G", "torch", "forward", "speed", [1, 2], bands=False))
    figure = scaling_chart(None, frame, x_label="V", title="t")
    assert len(line_traces(figure)) == 1 and len(_bands(figure)) == 0


def test_chart_empty_inputs_have_no_traces():
    assert len(scaling_chart(None, None, x_label="V", title="t").data) == 0
    assert len(scaling_chart(pd.DataFrame(), pd.DataFrame(), x_label="V", title="t").data) == 0


def test_chart_of_the_committed_kl_data():
    published = data.load_published("kl_div")
    measured = data.load_measured("kl_div")
    measured = measured[measured.gpu_name == "NVIDIA H200"]
    figure = scaling_chart(published, measured, x_label="vocab size", title="KL")
    lines = line_traces(figure)
    # 3 panels x (torch, liger published + kernels_lib, torch, liger measured).
    assert len(lines) == 3 * (2 + 3)
    assert len(_bands(figure)) == len(lines)
    published_lines = [line for line in lines if line.name.endswith("(published)")]
    assert len(published_lines) == 6
    assert all(" · H100 PCIe (published)" in line.name and line.line.dash == "dash" for line in published_lines)
    measured_lines = [line for line in lines if line.name.endswith("(measured)")]
    assert all(" · H200 (measured)" in line.name and line.line.dash == "solid" for line in measured_lines)
    assert {x for line in lines for x in line.x} == {4096, 8192, 16384, 32768, 65536, 131072}


# --------------------------------------------------------------------------- one look


def test_a_provider_has_one_colour_whatever_its_dial_or_series():
    assert base_provider("kernels_lib[chunk_size=256 accurate=False]") == "kernels_lib"
    assert base_provider("liger_sm90 · NVIDIA H200 (measured)") == "liger_sm90"
    assert base_provider("trl OOM") == "trl"
    assert provider_color("kernels_lib[chunk_size=256]") == provider_color("kernels_lib · GPU (measured)") == COLORS["kernels_lib"]
    assert provider_color("trl") != provider_color("kernels_lib[chunk_size=256]")
    assert provider_color("quack") != provider_color("trl")
    assert provider_color("some_new_peer") == provider_color("some_new_peer[x=1]")  # a spare colour, fixed by the name


def test_axis_titles_name_each_workload_once():
    assert {axis_title(label) for label in ("B x T", "tokens", "total tokens")} == {"tokens (B × T)"}
    assert {axis_title(label) for label in ("B", "Batch Size (B)", "batch size B", "B (sequences)")} == {"batch size (B)"}
    assert axis_title("vocab size") == axis_title("V") == "vocabulary size (V)"
    assert axis_title("something else") == "something else"


def test_scaling_chart_draws_kernels_lib_last_times_in_ms_and_ticks_integers():
    xs = [4096, 8192, 16384]
    frame = pd.DataFrame(_rows("G", "kernels_lib", "forward", "speed", xs) + _rows("G", "torch", "forward", "speed", xs)
                         + _rows("G", "kernels_lib[chunk_size=256]", "forward", "speed", xs)
                         + _rows("G", "liger", "full", "memory", xs[:2]))
    figure = scaling_chart(None, frame, x_label="B x T", title="t")
    lines = line_traces(figure)
    ours = [i for i, t in enumerate(figure.data) if base_provider(t.name) == "kernels_lib" and t.fill != "toself"]
    peers = [i for i, t in enumerate(figure.data) if base_provider(t.name) != "kernels_lib" and t.fill != "toself"]
    assert ours and peers and min(ours) > max(peers)
    assert max(i for i, t in enumerate(figure.data) if t.fill == "toself") < min(ours + peers)  # bands below every line
    assert {t.line.color for t in lines if base_provider(t.name) == "kernels_lib"} == {COLORS["kernels_lib"]}
    assert figure.layout.yaxis.title.text == "time (ms)" and figure.layout.yaxis3.title.text == "memory (MB)"
    assert figure.layout.xaxis.title.text == "tokens (B × T)"
    for name in ("xaxis", "xaxis2", "xaxis3"):
        assert list(figure.layout[name].ticktext) == ["4096", "8192", "16384"]
    assert figure.layout.xaxis2.matches == "x"


def test_tables_print_integers_as_integers_and_keep_small_errors_visible():
    from kernels_workbench.charts import table_number

    assert [table_number(v) for v in (128256.0, 2.0, 0.0, -3.0)] == ["128256", "2", "0", "-3"]
    assert [table_number(v) for v in (3.914, 1066.0625, 25.8213)] == ["3.914", "1066.062", "25.821"]
    assert [table_number(v) for v in (2.5e-16, 1.234e-7, 12345678.5)] == ["2.5e-16", "1.23e-07", "1.23e+07"]
    assert table_number(float("nan")) == "NaN"


def test_speed_memory_chart_names_providers_in_the_legend_not_beside_the_markers():
    rows = pd.DataFrame([
        {"kernel_provider": provider, "kernel_operation_mode": "full", "metric_name": metric, "x_value": 8, "y_value_50": value}
        for provider, ms, mb in (("kernels_lib", 20.0, 500.0), ("kernels_lib[chunk_size=1024]", 20.1, 505.0), ("torch", 60.0, 9000.0))
        for metric, value in (("speed", ms), ("memory", mb))
    ])
    figure = speed_memory_chart(rows, 8)
    # one legend entry per provider: the dial's point is a diamond in kernels_lib's own trace, named on hover
    assert [trace.name for trace in figure.data] == ["torch", "kernels_lib"]
    assert all(trace.mode == "markers" and trace.text is None for trace in figure.data)
    assert figure.layout.showlegend is True
    ours = figure.data[1]
    assert list(ours.marker.symbol) == ["circle", "diamond"] and list(ours.customdata) == ["kernels_lib", "kernels_lib[chunk_size=1024]"]
    assert ours.marker.color == figure.data[1].marker.color == COLORS["kernels_lib"]
    assert figure.layout.yaxis.title.text == "time, full (ms)"
    # the log axis is labelled at 1-2-5 steps only (no "2 3 … 9" minor labels): 500 … 10000
    assert list(figure.layout.xaxis.tickvals) == [500, 1000, 2000, 5000, 10000] and list(figure.layout.xaxis.ticktext) == ["500", "1000", "2000", "5000", "10000"]


def test_log_ticks_label_decade_steps_and_never_an_empty_axis():
    from kernels_workbench.charts import log_ticks

    assert log_ticks([120, 9000])["tickvals"] == [200, 500, 1000, 2000, 5000, 10000]
    assert all(str(t)[0] in "125" for t in log_ticks([3, 40000])["tickvals"])
    narrow = log_ticks([1300, 1320])  # no 1-2-5 step within 1130–1518: the ends, two digits
    assert narrow["tickvals"] == [1300.0] and narrow["ticktext"] == ["1300"]
    assert log_ticks([]) == {}


# --------------------------------------------------------------------------- SweepPanel


PRESET = {"x_name": "V", "x_label": "vocab size", "x_values": [64, 128], "sizes": {"N": 2}, "dtype": torch.float32}


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU panel: liger cannot run and is left out")
def test_sweep_panel_runs_and_redraws():
    from kernels_workbench.widgets import SweepPanel

    panel = SweepPanel("kl_div", DEVICE, PRESET)
    assert all(list(trace.x) == [None] for trace in panel.figure.data)  # before a sweep: empty subplots that say so
    assert panel.x_values.value == (64, 128)
    rows = panel.run()
    assert rows is panel.rows and len(rows) > 0
    speed = rows[rows.metric_name == "speed"]
    assert set(speed.x_value) == {64, 128}
    assert set(speed.kernel_provider) == {"kernels_lib", "torch"}
    assert set(speed.kernel_operation_mode) == {"forward", "full"}
    assert len(speed) == 2 * 2 * 2
    lines = [trace for trace in panel.figure.data if trace.fill != "toself" and trace.name]
    assert len(lines) == 2 * 2  # (kernels_lib, torch) x (speed·forward, speed·full)
    assert {x for line in lines for x in line.x} == {64, 128}
    assert panel.progress.value == panel.progress.max == 8
    assert panel.status.value.startswith("done: 8 points")

    panel.x_values.value = (32, 64)
    panel.modes.value = ("forward",)
    panel.providers["torch"].value = False
    panel.run()
    lines = [trace for trace in panel.figure.data if trace.fill != "toself" and trace.name]
    assert len(lines) == 1
    assert {x for line in lines for x in line.x} == {32, 64}
    assert set(panel.rows.kernel_provider) == {"kernels_lib"}


def test_summary_table():
    from kernels_workbench.widgets import summary_table

    assert summary_table(pd.DataFrame()).empty
    frame = pd.DataFrame(_rows("G", "torch", "forward", "speed", [1, 2]))
    table = summary_table(frame)
    assert list(table.columns) == [("time (ms)", 1), ("time (ms)", 2)]
    assert table.loc[("forward", "torch"), ("time (ms)", 2)] == 2.0


# --------------------------------------------------------------------------- check tables


SIZES = {"N": 3, "V": 100}
CASES = [
    {"dtype": dtype, "reduction": reduction, "log_target": log_target}
    for dtype in (torch.float32, torch.bfloat16)
    for reduction in ("batchmean", "none")
    for log_target in (False, True)
] + [{"dtype": torch.float16, "reduction": "sum", "log_target": False}, {"dtype": torch.float32, "reduction": "mean"}]


def test_check_against_reference_passes():
    table = check_against_reference("kl_div", CASES, SIZES, DEVICE)
    assert len(table) == len(CASES)
    assert table.passed.all(), table.to_string()
    assert (table["shape"] == "3x100").all()
    assert list(table.dtype[:2]) == ["float32", "float32"]
    for column in ("kernels_lib loss err", "kernels_lib grad err", "baseline loss err", "baseline grad err"):
        assert (table[column] >= 0).all(), column
    assert (table.tolerance == [TOLERANCE[c["dtype"]] for c in CASES]).all()
    fp32 = table[table.dtype == "float32"]
    assert (fp32["kernels_lib loss err"] <= 1e-5).all() and (fp32["kernels_lib grad err"] <= 1e-5).all()
    assert_checks_pass(table)


def _wrong(*args, **kwargs):
    return kl_div(*args, **kwargs) * 1.01


def test_check_catches_a_wrong_kernel(monkeypatch):
    providers = get_spec("kl_div").providers
    monkeypatch.setitem(providers, "kernels_lib", Provider("kernels_lib", lambda: _wrong, "off by 1%"))
    # 1% is beyond the float32 and float16 tolerances (bfloat16's, 1.6%, would let it through).
    cases = [{"dtype": torch.float32, "reduction": "batchmean"}, {"dtype": torch.float16, "reduction": "none"}]
    table = check_against_reference("kl_div", cases, SIZES, DEVICE)
    assert not table.passed.any(), table.to_string()
    assert (table["kernels_lib loss err"] > 5e-3).all()
    with pytest.raises(AssertionError, match="2 of 2 checks failed"):
        assert_checks_pass(table)


def test_check_catches_a_wrong_gradient(monkeypatch):
    def wrong(input, target, reduction="batchmean", log_target=False):
        # The right loss value, but only half of it carries a gradient (a missing factor of 2).
        loss = kl_div(input, target, reduction=reduction, log_target=log_target)
        return loss * 0.5 + loss.detach() * 0.5

    providers = get_spec("kl_div").providers
    monkeypatch.setitem(providers, "kernels_lib", Provider("kernels_lib", lambda: wrong, "half gradient"))
    table = check_against_reference("kl_div", [{"dtype": torch.float32}], SIZES, DEVICE)
    assert table["kernels_lib loss err"].iloc[0] <= 1e-5
    assert table["kernels_lib grad err"].iloc[0] == pytest.approx(0.5, rel=1e-3)
    assert not table.passed.iloc[0]
    with pytest.raises(AssertionError):
        assert_checks_pass(table)


def test_check_nan_never_passes(monkeypatch):
    def nan_kernel(input, target, reduction="batchmean", log_target=False):
        return kl_div(input, target, reduction=reduction, log_target=log_target) * float("nan")

    providers = get_spec("kl_div").providers
    monkeypatch.setitem(providers, "kernels_lib", Provider("kernels_lib", lambda: nan_kernel, "NaN"))
    table = check_against_reference("kl_div", [{"dtype": torch.float32}], SIZES, DEVICE)
    assert not table.passed.iloc[0]


def test_sweep_panel_sweeps_any_axis_of_the_loss():
    from kernels_workbench.widgets import SweepPanel

    preset = {"x_name": "V", "x_label": "vocab size", "x_values": [64, 128], "sizes": {"N": 4}, "dtype": torch.float32}
    panel = SweepPanel("kl_div", "cpu", preset)
    panel.providers["liger"].value = False
    panel.modes.value = ["full"]
    panel.axis.value = "N"
    assert panel.sizes["N"].disabled and not panel.sizes["V"].disabled
    panel.sizes["V"].value = 100
    low, high = panel.x_values.options[0], panel.x_values.options[1]
    panel.x_values.value = (low, high)
    rows = panel.run()
    assert set(rows.x_name) == {"N"}
    assert sorted(set(rows.x_value)) == [low, high]
    assert all('"V": 100' in config for config in rows.extra_benchmark_config_str)
    assert panel.figure.layout.xaxis.title.text == "rows (N)"  # the N axis by its one name
