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
    BASELINE_NAME, COLORS, GAP_LEGEND, GPU_STYLES, NOT_MEASURED_NOTE, PANELS, axis_title, base_provider, legend_keys, line_traces,
    provider_color, scaling_chart, speed_memory_chart,
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
        + _rows("GPU P", "torch", "full", "speed", xs)  # published alone: the panel says "not measured on a GPU yet"
        + _rows("GPU P", "torch", "backward", "speed", xs)  # no panel shows backward
    )
    measured = pd.DataFrame(
        _rows("GPU M", "kernels_lib", "forward", "speed", xs[::-1])  # unsorted on purpose
        + _rows("GPU M", "kernels_lib", "full", "memory", xs)
        + _rows("GPU N", "kernels_lib", "full", "memory", xs)
    )
    figure = scaling_chart(published, measured, x_label="vocab size", title="t")
    lines = line_traces(figure)
    # speed·forward: torch, liger (published) + kernels_lib GPU M; speed·full: none (no measured row);
    # memory·full: kernels_lib on two GPUs.
    assert len(lines) == 5, [line.name for line in lines]
    assert len(_bands(figure)) == 5
    names = [line.name for line in lines]
    assert sorted(names) == sorted(
        [
            f"{BASELINE_NAME} · GPU P (published)", "liger · GPU P (published)", "kernels_lib · GPU M (measured)",
            "kernels_lib · GPU M (measured)", "kernels_lib · GPU N (measured)",
        ]
    )
    styles = {}
    for line in lines:
        assert list(line.x) == sorted(line.x), line.name
        assert ("(published)" in line.name) != ("(measured)" in line.name)
        assert ("GPU P" in line.name) == ("(published)" in line.name)
        assert line.marker.symbol.endswith("-open") == ("(published)" in line.name), f"{line.name}: open markers are published rows"
        assert not line.showlegend, f"{line.name}: a line is named by the provider and GPU legends, not on its own"
        styles.setdefault(line.name.split(" · ")[1].split(" (")[0], set()).add((line.marker.symbol.removesuffix("-open"), line.line.dash))
    # each GPU one marker and dash, three GPUs three of each (unlisted GPUs get spare styles, never one twice)
    assert all(len(found) == 1 for found in styles.values()), styles
    assert len({next(iter(v))[0] for v in styles.values()}) == 3 and len({next(iter(v))[1] for v in styles.values()}) == 3, styles


def test_chart_shows_each_measured_gpu_beside_the_published_rows_labelled():
    """The newest run of each GPU (an H100 80GB and an H200) beside the published A100 rows: each line named
    with its GPU's short label, one colour per provider on every GPU, a marker and a dash per GPU."""
    xs = [2, 4]
    published = pd.DataFrame(_rows("NVIDIA A100-SXM4-80GB", "liger", "full", "speed", xs))
    measured = pd.DataFrame(_rows("NVIDIA H200", "kernels_lib", "full", "speed", xs) + _rows("NVIDIA H200", "liger", "full", "speed", xs)
                            + _rows("NVIDIA H100 80GB HBM3", "kernels_lib", "full", "speed", xs))
    lines = {line.name: line for line in line_traces(scaling_chart(published, measured, x_label="B", title="t"))}
    assert set(lines) == {"liger · A100 80GB (published)", "kernels_lib · H200 (measured)", "liger · H200 (measured)",
                          "kernels_lib · H100 80GB (measured)"}
    assert lines["kernels_lib · H200 (measured)"].line.color == lines["kernels_lib · H100 80GB (measured)"].line.color
    assert lines["liger · A100 80GB (published)"].line.color == lines["liger · H200 (measured)"].line.color
    styles = {name: (line.marker.symbol, line.line.dash) for name, line in lines.items()}
    assert styles["kernels_lib · H100 80GB (measured)"] == GPU_STYLES["H100 80GB"] == ("circle", "solid")
    assert styles["kernels_lib · H200 (measured)"] == styles["liger · H200 (measured)"] == GPU_STYLES["H200"]
    assert styles["liger · A100 80GB (published)"] == ("triangle-up-open", "dash")
    assert len({GPU_STYLES[g][0] for g in ("H100 80GB", "H200", "A100 80GB", "H100 PCIe", "B200")}) == 5, "two GPUs share a marker"
    assert len({GPU_STYLES[g][1] for g in ("H100 80GB", "H200", "A100 80GB", "H100 PCIe", "B200")}) == 5, "two GPUs share a dash"


def test_chart_axes_log_and_linear():
    frame = pd.DataFrame(_rows("G", "torch", "forward", "speed", [1, 2, 4]))
    figure = scaling_chart(None, frame, x_label="V", title="t")
    axes = [figure.layout[name] for name in figure.layout if name.startswith("xaxis")]
    assert len(axes) == len(PANELS)
    assert all(axis.type == "log" for axis in axes)
    assert all(axis.title.text == "vocabulary size V" for axis in axes)  # the one name of the V axis
    linear = scaling_chart(None, frame, x_label="V", title="t", log_x=False)
    assert all(linear.layout[name].type == "linear" for name in linear.layout if name.startswith("xaxis"))


def test_chart_without_p20_p80_has_no_bands():
    frame = pd.DataFrame(_rows("G", "torch", "forward", "speed", [1, 2], bands=False))
    figure = scaling_chart(None, frame, x_label="V", title="t")
    assert len(line_traces(figure)) == 1 and len(_bands(figure)) == 0


def test_chart_empty_inputs_draw_no_line_and_say_so():
    for published, measured in ((None, None), (pd.DataFrame(), pd.DataFrame())):
        figure = scaling_chart(published, measured, x_label="V", title="t")
        assert line_traces(figure) == [] and legend_keys(figure) == []
        assert [a.text.replace("<br>", " ") for a in figure.layout.annotations if a.name == "note"] == [NOT_MEASURED_NOTE] * len(PANELS)


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
    assert all(" · H100 PCIe (published)" in line.name and line.line.dash == GPU_STYLES["H100 PCIe"][1] for line in published_lines)
    measured_lines = [line for line in lines if line.name.endswith("(measured)")]
    assert all(" · H200 (measured)" in line.name and line.line.dash == GPU_STYLES["H200"][1] for line in measured_lines)
    assert {x for line in lines for x in line.x} == {4096, 8192, 16384, 32768, 65536, 131072}
    assert {k.name for k in legend_keys(figure, "legend2") if k.name != GAP_LEGEND} == {"H200", "H100 PCIe (published)"}
    assert sorted(k.name for k in legend_keys(figure)) == sorted(["kernels_lib", "liger", BASELINE_NAME])


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
    assert {axis_title(label) for label in ("B x T", "tokens", "total tokens", "tokens (B × T)")} == {"tokens (B·T)"}
    assert {axis_title(label) for label in ("B", "Batch Size (B)", "batch size B", "B (sequences)")} == {"batch size B"}
    assert axis_title("vocab size") == axis_title("V") == "vocabulary size V"
    assert axis_title("something else") == "something else"


def test_scaling_chart_draws_kernels_lib_last_times_in_ms_and_ticks_integers():
    xs = [4096, 8192, 16384]
    frame = pd.DataFrame(_rows("G", "kernels_lib", "forward", "speed", xs) + _rows("G", "torch", "forward", "speed", xs)
                         + _rows("G", "kernels_lib[chunk_size=256]", "forward", "speed", xs)
                         + _rows("G", "kernels_lib", "full", "speed", xs)
                         + _rows("G", "liger", "full", "memory", xs[:2]))
    figure = scaling_chart(None, frame, x_label="B x T", title="t")
    lines = line_traces(figure)
    drawn = [t for t in figure.data if t.fill != "toself" and t.name]
    ours = [i for i, t in enumerate(drawn) if base_provider(t.name) == "kernels_lib"]
    peers = [i for i, t in enumerate(drawn) if base_provider(t.name) in ("torch", "liger")]
    assert ours and peers and min(ours) > max(peers), "a peer's line or legend entry drawn over kernels_lib's"
    assert max(i for i, t in enumerate(figure.data) if t.fill == "toself") < min(
        i for i, t in enumerate(figure.data) if t.fill != "toself")  # bands below every line
    assert {t.line.color for t in lines if base_provider(t.name) == "kernels_lib"} == {COLORS["kernels_lib"]}
    assert figure.layout.yaxis.title.text == "time (ms)" and figure.layout.yaxis3.title.text == "peak memory beyond inputs (MB)"
    assert figure.layout.xaxis.title.text == "tokens (B·T)"
    for name in ("xaxis", "xaxis2", "xaxis3"):
        assert list(figure.layout[name].ticktext) == ["4096", "8192", "16384"]
    assert figure.layout.xaxis2.matches == "x"


# --------------------------------------------------------------------------- what a reader tells apart


def _two_gpus_and_published(x=(1024, 2048, 4096)):
    measured = pd.DataFrame([row for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200") for provider in ("kernels_lib", "torch", "liger")
                             for metric in ("speed", "memory") for mode in ("forward", "full")
                             for row in _rows(gpu, provider, mode, metric, list(x))])
    published = pd.DataFrame([row for provider in ("huggingface", "liger") for metric in ("speed", "memory") for mode in ("forward", "full")
                              for row in _rows("NVIDIA A100-SXM4-80GB", provider, mode, metric, list(x))])
    return published, measured


def test_provider_is_a_colour_and_gpu_a_marker_and_dash_each_named_once_in_the_legend():
    published, measured = _two_gpus_and_published()
    figure = scaling_chart(published, measured, x_label="BT", title="t")
    providers, gpus = legend_keys(figure), legend_keys(figure, "legend2")
    # "huggingface" (published) and "torch" (measured) are the one baseline: one legend entry
    assert sorted(k.name for k in providers) == sorted([BASELINE_NAME, "kernels_lib", "liger"]), [k.name for k in providers]
    assert sorted(k.name for k in gpus) == ["A100 80GB (published)", "H100 80GB", "H200"], [k.name for k in gpus]
    assert len({k.line.color for k in providers}) == 3, "two providers' legend entries share a colour"
    assert len({k.line.color for k in gpus}) == 1, "a GPU's legend entry is coloured: a reader would take it for a provider"
    assert figure.layout.legend2.title.text.startswith("GPU") and figure.layout.legend.title.text.startswith("provider")
    assert "open marker: published" in figure.layout.legend2.title.text
    alone = scaling_chart(None, measured, x_label="BT", title="t")
    assert "published" not in alone.layout.legend2.title.text, "the GPU legend explains markers of rows the chart does not draw"
    key_style = {k.name: (k.marker.symbol, k.line.dash) for k in gpus}
    for line in line_traces(figure):
        provider, rest = line.name.split(" · ")
        gpu, source = rest.rsplit(" (", 1)
        assert not line.showlegend, f"{line.name} has a legend entry of its own (provider × GPU)"
        assert line.line.color == next(k.line.color for k in providers if k.name == provider), f"{line.name}: not its provider's colour"
        key = gpu + " (published)" if source == "published)" else gpu
        assert (line.marker.symbol, line.line.dash) == key_style[key], f"{line.name}: not its GPU's marker and dash"
        assert line.legendgroup == provider, f"{line.name}: clicking its provider's legend entry would not hide it"


def test_each_gpus_floor_is_drawn_in_its_gpus_marker_and_dash():
    from kernels_workbench.charts import FLOOR_COLOR, add_floor

    _, measured = _two_gpus_and_published()
    figure = scaling_chart(None, measured, x_label="BT", title="t")
    floor = pd.DataFrame({"forward": [0.5, 1.0, 2.0], "full": [1.5, 3.0, 6.0]}, index=[1024, 2048, 4096])
    for gpu in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        add_floor(figure, floor, gpu=gpu)
    floors = [t for t in line_traces(figure) if t.name.startswith("floor")]
    assert sorted({t.name for t in floors}) == ["floor · H100 80GB", "floor · H200"]
    assert len(floors) == 4  # two speed panels, two GPUs
    for trace in floors:
        gpu = trace.name.split(" · ")[1]
        assert (trace.marker.symbol, trace.line.dash) == GPU_STYLES[gpu], f"{trace.name} not in its GPU's style"
        assert trace.line.color == FLOOR_COLOR and not trace.showlegend
    h100, h200 = ({(t.marker.symbol, t.line.dash) for t in floors if t.name.endswith(g)} for g in ("H100 80GB", "H200"))
    assert h100 != h200, "the H100's and the H200's floors look alike"
    assert FLOOR_COLOR not in {provider_color(p) for p in COLORS}, "the floor is drawn in a provider's colour"
    assert [k.name for k in legend_keys(figure)].count("floor") == 1, "the floor is named once in the provider legend"


def test_published_memory_is_on_an_axis_of_its_own_titled_so():
    from kernels_workbench.charts import PUBLISHED_MEMORY_TITLE

    published, measured = _two_gpus_and_published()
    figure = scaling_chart(published, measured, x_label="BT", title="t")
    memory = [t for t in line_traces(figure) if t.xaxis == "x3"]
    ours = {t.yaxis for t in memory if t.name.endswith("(measured)")}
    theirs = {t.yaxis for t in memory if t.name.endswith("(published)")}
    assert len(ours) == 1 and len(theirs) == 1 and ours != theirs, f"published memory on our axis: {ours} {theirs}"
    titles = {name: figure.layout[name.replace("y", "yaxis", 1)].title.text for name in ours | theirs}
    assert titles[ours.pop()] == "peak memory beyond inputs (MB)"
    assert titles[theirs.pop()] == PUBLISHED_MEMORY_TITLE and "inputs included" in PUBLISHED_MEMORY_TITLE
    speed = {t.yaxis for t in line_traces(figure) if t.xaxis == "x"}
    assert len(speed) == 1, "published and measured times belong on one axis (one definition)"


def test_a_panel_with_published_rows_only_says_not_measured_instead():
    published, measured = _two_gpus_and_published()
    figure = scaling_chart(published, measured[measured.metric_name == "speed"], x_label="BT", title="t")
    assert not [t for t in line_traces(figure) if t.xaxis == "x3"], "published memory drawn alone in the memory panel"
    notes = [a for a in figure.layout.annotations if a.name == "note"]
    assert len(notes) == 1 and notes[0].text.replace("<br>", " ").startswith(NOT_MEASURED_NOTE), [a.text for a in notes]
    x_low, x_high = figure.layout.xaxis3.domain
    assert x_low <= notes[0].x <= x_high, "the note is not in the memory panel"
    assert [t for t in line_traces(figure) if t.xaxis == "x"], "the measured speed panel lost its lines"


def test_a_gap_in_a_line_says_why():
    from kernels_workbench.charts import gap_traces

    xs = [1024, 2048, 4096]
    rows = pd.DataFrame(_rows("NVIDIA H200", "kernels_lib", "full", "speed", xs) + _rows("NVIDIA H200", "liger", "full", "speed", xs[:2])
                        + _rows("NVIDIA H200", "torch", "full", "speed", xs))
    rows["note"] = ""
    oom = (rows.kernel_provider == "torch") & (rows.x_value == 4096)
    rows.loc[oom, "y_value_50"] = float("nan")
    rows.loc[oom, "note"] = "OutOfMemoryError: CUDA out of memory. Tried to allocate 7.8 GiB; torch skipped"
    figure = scaling_chart(None, rows, x_label="BT", title="t", panels=[("speed", "full")])
    lines = {t.name.split(" · ")[0]: t for t in line_traces(figure)}
    assert list(lines["liger"].x) == xs and lines["liger"].y[-1] is None, "liger's line silently ends instead of breaking"
    gaps = {t.name.split(" · ")[0]: list(t.text) for t in gap_traces(figure)}
    assert gaps == {"liger": ["not measured at tokens (B·T) = 4096"], BASELINE_NAME: ["out of memory at tokens (B·T) = 4096"]}, gaps
    assert GAP_LEGEND in [k.name for k in legend_keys(figure, "legend2")], "no legend entry says what the ✕ means"
    whole = scaling_chart(None, rows[rows.kernel_provider == "kernels_lib"], x_label="BT", title="t", panels=[("speed", "full")])
    assert gap_traces(whole) == [] and GAP_LEGEND not in [k.name for k in legend_keys(whole, "legend2")]


def test_on_a_cpu_only_kernels_libs_kernels_are_labelled_as_interpreted():
    from kernels_workbench.charts import INTERPRETER_LABEL, display_name

    cpu = "CPU (Triton interpreter)"
    rows = pd.DataFrame([row for p in ("kernels_lib", "kernels_lib[accurate=True]", "torch", "trl")
                         for row in _rows(cpu, p, "full", "speed", [64, 128])])
    figure = scaling_chart(None, rows, x_label="V", title="t", panels=[("speed", "full")])
    labelled = {k.name for k in legend_keys(figure) if INTERPRETER_LABEL in k.name}
    assert labelled == {f"kernels_lib {INTERPRETER_LABEL}", f"kernels_lib[accurate=True] {INTERPRETER_LABEL}"}, labelled
    assert {k.name for k in legend_keys(figure)} - labelled == {BASELINE_NAME, "trl"}
    assert not any(INTERPRETER_LABEL in t.name for t in line_traces(figure) if base_provider(t.name) != "kernels_lib")
    assert [k.name for k in legend_keys(figure, "legend2")] == ["CPU"]
    assert display_name("trl", cpu) == "trl" and display_name("kernels_lib", "NVIDIA H200") == "kernels_lib"


def test_one_display_name_for_the_baseline_in_charts():
    from kernels_workbench.charts import DISPLAY_NAMES, display_name

    assert {display_name(k) for k in ("torch", "huggingface", "baseline")} == {BASELINE_NAME}
    assert set(DISPLAY_NAMES.values()) == {BASELINE_NAME}
    assert provider_color(BASELINE_NAME) == COLORS["torch"]
    rows = pd.DataFrame([{"kernel_provider": p, "kernel_operation_mode": "full", "metric_name": m, "x_value": 8, "y_value_50": 1.0}
                         for p in ("huggingface", "kernels_lib") for m in ("speed", "memory")])
    assert [t.name for t in speed_memory_chart(rows, 8).data] == [BASELINE_NAME, "kernels_lib"]


def test_speed_memory_chart_of_published_rows_titles_memory_as_published():
    rows = pd.DataFrame([{"kernel_provider": p, "kernel_operation_mode": "full", "metric_name": m, "x_value": 8, "y_value_50": 1.0,
                          "liger_version": "0.4.2"} for p in ("huggingface", "liger") for m in ("speed", "memory")])
    assert "inputs included" in speed_memory_chart(rows, 8).layout.xaxis.title.text
    assert "beyond inputs" in speed_memory_chart(rows.drop(columns="liger_version"), 8).layout.xaxis.title.text


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
    assert [trace.name for trace in figure.data] == [BASELINE_NAME, "kernels_lib"]  # the baseline by its one name
    assert all(trace.mode == "markers" and trace.text is None for trace in figure.data)
    assert figure.layout.showlegend is True
    ours = figure.data[1]
    assert list(ours.marker.symbol) == ["circle", "diamond"] and list(ours.customdata) == ["kernels_lib", "kernels_lib[chunk_size=1024]"]
    assert ours.marker.color == figure.data[1].marker.color == COLORS["kernels_lib"]
    assert figure.layout.yaxis.title.text == "time, full (ms)"
    assert figure.layout.xaxis.title.text == "peak memory beyond inputs, full (MB)"
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
    lines = line_traces(panel.figure)
    assert len(lines) == 2 * 2  # (kernels_lib, torch) x (speed·forward, speed·full)
    assert {x for line in lines for x in line.x} == {64, 128}
    assert panel.progress.value == panel.progress.max == 8
    assert panel.status.value.startswith("done: 8 points")

    panel.x_values.value = (32, 64)
    panel.modes.value = ("forward",)
    panel.providers["torch"].value = False
    panel.run()
    lines = line_traces(panel.figure)
    assert len(lines) == 1
    assert {x for line in lines for x in line.x} == {32, 64}
    assert set(panel.rows.kernel_provider) == {"kernels_lib"}


def test_summary_table():
    from kernels_workbench.widgets import summary_table

    assert summary_table(pd.DataFrame()).empty
    frame = pd.DataFrame(_rows("G", "torch", "forward", "speed", [1, 2]))
    table = summary_table(frame)
    assert list(table.columns) == [("time (ms)", 1), ("time (ms)", 2)]
    assert table.loc[("forward", BASELINE_NAME), ("time (ms)", 2)] == 2.0  # the baseline by its one display name


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
    assert panel.figure.layout.xaxis.title.text == "rows N"  # the N axis by its one name


def test_a_log_scaling_chart_keeps_its_end_sizes_inside_the_panel():
    """The first size's label sat on the panel's corner, over the y axis's '0' (01's published chart in the
    browser test): the x range is padded past both ends."""
    import math

    import pandas as pd

    from kernels_workbench import charts

    rows = pd.DataFrame([{"kernel_name": "k", "kernel_provider": p, "kernel_operation_mode": "full", "metric_name": "speed",
                          "x_value": x, "y_value_50": 1.0 + i, "gpu_name": "NVIDIA H100 80GB HBM3"}
                         for i, p in enumerate(("kernels_lib", "liger")) for x in (4096, 8192, 16384)])
    figure = charts.scaling_chart(None, rows, x_label="BT", log_x=True, title="t")
    low, high = figure.layout.xaxis.range
    assert low < math.log10(4096) and high > math.log10(16384), (low, high)
    assert figure.layout.xaxis.ticklabelstandoff >= 8 and figure.layout.yaxis.ticklabelstandoff >= 6
