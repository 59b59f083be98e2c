"""The sweep panel's logic without a browser: what its chart, table and status say, its limits, its colours.

The browser test (tests/test_browser.py) drives the same panel in JupyterLab; these tests hold each rule on
its own, on a CPU or a GPU alike (the panel's CPU behaviour is asserted with ``device="cpu"``).
"""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import kernels_lib
from kernels_workbench import charts, widgets
from kernels_workbench.bench.registry import SPECS, get_spec
from kernels_workbench.bench.sweep import MEASURED_COLUMNS


def _rows(kernel_name: str, points: dict, *, x_name: str = "V", gpu: str = "CPU (Triton interpreter)", notes=None) -> pd.DataFrame:
    """Rows in a sweep's layout: ``points`` maps (provider, mode, metric) to {x: median}."""
    notes = notes or {}
    rows = []
    for (provider, mode, metric), values in points.items():
        for x, y in values.items():
            rows.append({"kernel_name": kernel_name, "kernel_provider": provider, "kernel_operation_mode": mode,
                         "metric_name": metric, "metric_unit": widgets.MEASURE_NAMES[metric], "x_name": x_name,
                         "x_label": x_name, "x_value": x, "y_value_50": y, "y_value_20": y, "y_value_80": y,
                         "gpu_name": gpu, "note": notes.get(provider, "")})
    return pd.DataFrame(rows, columns=MEASURED_COLUMNS)


# ------------------------------------------------------------------------------------------ the palette

def _lab(hex_color: str) -> tuple[float, float, float]:
    """CIELAB of an sRGB colour (D65): perceptual distances between palette colours."""
    def linear(c):
        return ((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92

    r, g, b = (linear(int(hex_color[i:i + 2], 16) / 255) for i in (1, 3, 5))
    x, y, z = ((r * 0.4124 + g * 0.3576 + b * 0.1805) / 0.95047, r * 0.2126 + g * 0.7152 + b * 0.0722,
               (r * 0.0193 + g * 0.1192 + b * 0.9505) / 1.08883)

    def f(t):
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def test_every_registered_variant_has_its_own_colour_apart_from_every_other():
    variants = {name for spec in SPECS.values() for name in spec.providers if "[" in name}
    assert variants, "no registered variant: the test would hold nothing"
    missing = sorted(variants - set(charts.VARIANT_COLORS))
    assert missing == [], f"variants drawn in their provider's colour (add them to charts.VARIANT_COLORS): {missing}"
    others = {**{k: v for k, v in charts.COLORS.items()}, **charts.VARIANT_COLORS}
    for variant, colour in charts.VARIANT_COLORS.items():
        for name, other in others.items():
            if name == variant:
                continue
            distance = sum((a - b) ** 2 for a, b in zip(_lab(colour), _lab(other))) ** 0.5
            assert distance >= 20, f"{variant} ({colour}) and {name} ({other}) are {distance:.0f} ΔE apart: too alike to tell apart"


def test_every_provider_and_variant_colour_is_apart_from_every_other():
    """One fixed palette: no two providers (nor a provider and the floor) alike; the baseline's keys share
    one colour because they are one provider under one display name."""
    palette = {name: colour for name, colour in {**charts.COLORS, **charts.VARIANT_COLORS, "floor": charts.FLOOR_COLOR}.items()
               if charts.DISPLAY_NAMES.get(name, name) == name or name == "torch"}
    assert {charts.COLORS[k] for k in charts.DISPLAY_NAMES} == {charts.COLORS["torch"]}, "the baseline's keys in two colours"
    names = sorted(palette)
    close = [(a, b, round(sum((x - y) ** 2 for x, y in zip(_lab(palette[a]), _lab(palette[b]))) ** 0.5))
             for i, a in enumerate(names) for b in names[i + 1:]]
    close = [item for item in close if item[2] < 20]
    assert close == [], f"providers too alike to tell apart (ΔE < 20): {close}"
    dark = [name for name, colour in palette.items() if name != "floor" and _lab(colour)[0] < 25]
    assert dark == [], f"near-black providers, read as the floor or as each other: {dark}"


def test_provider_color_is_keyed_by_variant_then_provider():
    accurate = charts.VARIANT_COLORS["kernels_lib[accurate=True]"]
    assert charts.provider_color("kernels_lib[accurate=True]") == accurate
    assert charts.provider_color("kernels_lib[accurate=True] · H100 80GB (measured)") == accurate
    assert charts.provider_color("kernels_lib") == charts.COLORS["kernels_lib"] != accurate
    assert charts.provider_color("torch_lce[acc_policy=accurate]") != charts.provider_color("torch_lce")
    # a dial's point keeps its provider's colour; the baseline's display name is the baseline's blue
    assert charts.provider_color("kernels_lib[chunk_size=256]") == charts.COLORS["kernels_lib"]
    assert charts.provider_color(widgets.BASELINE_NAME + " · CPU (measured)") == charts.COLORS["torch"] == charts.COLORS["huggingface"]
    assert charts.palette_key("kernels_lib[accurate=True] OOM") == "kernels_lib[accurate=True]"


def test_a_variant_is_drawn_in_its_own_colour_in_the_scaling_and_the_speed_memory_chart():
    points = {(p, "full", m): {1024: 2.0, 2048: 3.0} for p in ("kernels_lib", "kernels_lib[accurate=True]", "torch") for m in ("speed", "memory")}
    rows = _rows("fused_linear_cross_entropy", points, x_name="BT", gpu="NVIDIA H100 80GB HBM3")
    figure = charts.scaling_chart(None, rows, x_label="BT", title="t", panels=[("speed", "full")])
    colours = {t.name.split(" · ")[0]: t.line.color for t in charts.line_traces(figure)}
    assert colours == {"kernels_lib": charts.COLORS["kernels_lib"], widgets.BASELINE_NAME: charts.COLORS["torch"],
                       "kernels_lib[accurate=True]": charts.VARIANT_COLORS["kernels_lib[accurate=True]"]}
    scatter = charts.speed_memory_chart(rows, 2048)
    assert {t.name: t.marker.color for t in scatter.data} == colours


# ------------------------------------------------------------------------------------ names and titles

def test_every_loss_has_a_display_name_and_one_baseline_name():
    unnamed = [name for name in SPECS if widgets.loss_label(name) == name]
    assert unnamed == [], f"losses whose panel title would be their kernel_name: {unnamed}"
    dpo, grpo = get_spec("fused_linear_dpo_loss"), get_spec("fused_linear_grpo_loss_token")
    assert (dpo.baseline, grpo.baseline) == ("huggingface", "torch")  # two keys in the data, one meaning
    assert widgets.display_provider(dpo, "huggingface") == widgets.display_provider(grpo, "torch") == widgets.BASELINE_NAME
    assert widgets.display_provider(grpo, "trl") == "trl" and widgets.display_provider(dpo, "kernels_lib") == "kernels_lib"


def test_chart_title_carries_the_loss_the_fixed_sizes_and_the_dtype_and_on_a_cpu_the_interpreter():
    cpu = widgets.chart_title("DPO (fused linear)", "CPU", {"B": 4, "T": 8, "H": 32, "V": 257}, "bfloat16", x_name="B", interpreted=True)
    assert "DPO (fused linear)" in cpu and "T=8, H=32, V=257" in cpu and "bfloat16" in cpu and "B=4" not in cpu
    assert widgets.INTERPRETER_NOTE in cpu and "rank nothing" in widgets.INTERPRETER_NOTE
    gpu = widgets.chart_title("DPO (fused linear)", "NVIDIA H100", {"B": 4, "T": 1024, "H": 4096, "V": 128256}, "bfloat16", x_name="B",
                              interpreted=False)
    assert widgets.INTERPRETER_NOTE not in gpu and gpu != cpu
    other = widgets.chart_title("DPO (fused linear)", "CPU", {"B": 4, "T": 16, "H": 32, "V": 257}, "bfloat16", x_name="B", interpreted=True)
    assert other != cpu  # two sweeps of other sizes are told apart by their titles


def test_skip_reason_reads_as_a_sentence():
    assert widgets.skip_reason("RuntimeError: Liger's kernels need CUDA (they do not run in Triton's interpreter)") == \
        "Liger's kernels need CUDA (they do not run in Triton's interpreter)"
    assert widgets.skip_reason("ImportError: the Megatron providers need megatron-core (pip install megatron-core); importing x failed") == \
        "the Megatron providers need megatron-core (pip install megatron-core)"


# ------------------------------------------------------------------------------------------ the chart

def _notes(figure) -> list[str]:
    titles = {f"time · {m}" for m in widgets.MODES} | {f"memory · {m}" for m in widgets.MODES}
    return [a.text.replace("<br>", " ") for a in figure.layout.annotations if a.text not in titles]


def test_before_a_sweep_each_subplot_says_what_will_appear_and_memory_on_a_cpu_why_it_stays_empty():
    spec = get_spec("kl_div")
    panels = widgets.chart_panels(["forward", "full"])
    assert panels == [("speed", "forward"), ("speed", "full"), ("memory", "full")]
    empty = widgets.panel_figure(pd.DataFrame(), spec, panels=panels, x_name="V", title="t", interpreted=True, swept=False)
    notes = _notes(empty)
    assert len(notes) == 3 and all("after Run sweep" in n and "time (ms)" in n for n in notes[:2])
    assert notes[2].startswith("not measured here") and "GPU" in notes[2]
    on_gpu = widgets.panel_figure(pd.DataFrame(), spec, panels=panels, x_name="V", title="t", interpreted=False, swept=False)
    assert len(_notes(on_gpu)) == 3 and all("after Run sweep" in n for n in _notes(on_gpu))


def test_after_a_sweep_only_empty_subplots_say_why_and_cpu_times_are_named_interpreter_times():
    spec = get_spec("kl_div")
    rows = _rows("kl_div", {("kernels_lib", "full", "speed"): {512: 1.0, 1024: 2.0}, ("torch", "full", "speed"): {512: 0.1, 1024: 0.2},
                            ("kernels_lib", "forward", "speed"): {512: float("nan")}, ("torch", "forward", "speed"): {512: float("nan")}})
    panels = widgets.chart_panels(["forward", "full"])
    figure = widgets.panel_figure(rows, spec, panels=panels, x_name="V", title="t", interpreted=True, swept=True)
    notes = _notes(figure)
    assert len(notes) == 2 and "failed at every point" in notes[0] and notes[1].startswith("not measured here")
    # every provider's time on one "time (ms)" axis; only kernels_lib's line says it ran in the interpreter
    assert figure.layout.yaxis2.title.text == "time (ms)"
    names = {t.name.split(" · ")[0] for t in charts.line_traces(figure) if t.name}
    assert names == {f"kernels_lib {charts.INTERPRETER_LABEL}", widgets.BASELINE_NAME}, names
    gpu = widgets.panel_figure(rows.assign(gpu_name="NVIDIA H200"), spec, panels=panels, x_name="V", title="t", interpreted=False,
                               swept=True)
    assert gpu.layout.yaxis2.title.text == "time (ms)"
    assert {t.name.split(" · ")[0] for t in charts.line_traces(gpu)} == {"kernels_lib", widgets.BASELINE_NAME}


def test_summary_table_speaks_as_people_do():
    spec = get_spec("fused_linear_dpo_loss")
    rows = _rows("fused_linear_dpo_loss", {("kernels_lib", "full", "speed"): {2: 1.5, 4: 2.5}, ("huggingface", "full", "speed"): {2: 1.0, 4: float("nan")},
                                           ("kernels_lib", "full", "memory"): {2: 10.0, 4: 20.0}}, x_name="B")
    table = widgets.summary_table(rows, spec)
    assert list(table.index.names) == ["mode", "provider"]
    assert list(table.columns.names) == [None, "batch size B"]
    assert list(dict.fromkeys(table.columns.get_level_values(0))) == ["time (ms)", "peak memory beyond inputs (MB)"]
    ours = f"kernels_lib {charts.INTERPRETER_LABEL}"  # the rows ran on a CPU: kernels_lib in the interpreter, the baseline natively
    assert list(table.index) == [("full", ours), ("full", widgets.BASELINE_NAME)]
    assert table.loc[("full", ours), ("time (ms)", 4)] == 2.5
    on_gpu = widgets.summary_table(rows.assign(gpu_name="NVIDIA H200"), spec)
    assert list(on_gpu.index) == [("full", "kernels_lib"), ("full", widgets.BASELINE_NAME)]
    assert pd.isna(table.loc[("full", widgets.BASELINE_NAME), ("time (ms)", 4)])  # a failed point stays, as NaN
    text = table.to_string()
    assert not any(raw in text for raw in ("metric_name", "kernel_operation_mode", "x_value", "kernel_provider", "huggingface"))


def test_a_size_above_the_cap_is_capped_with_a_message_saying_the_cap_and_why():
    assert widgets.capped("V", 300, 1028) == (300, "")
    value, message = widgets.capped("V", 99999, 1028)
    assert value == 1028 and "99999" in message and "1028" in message and f"{widgets.CAP_FACTOR}×" in message and "minutes" in message
    assert widgets.capped("V", 0, 1028)[0] == 1


def test_sweep_status_names_each_provider_that_did_not_run_and_each_failure():
    spec = get_spec("kl_div")
    rows = _rows("kl_div", {("kernels_lib", "full", "speed"): {512: 1.0, 1024: float("nan")}, ("torch", "full", "speed"): {512: 0.1, 1024: 0.2}},
                 notes={"kernels_lib": "OutOfMemoryError: out of memory; liger skipped (RuntimeError: needs CUDA)"})
    status = widgets.sweep_status(rows, spec, ["kernels_lib", "torch", "liger"], {"liger": "RuntimeError: Liger's kernels need CUDA"}, 3.21)
    assert status.startswith("done: 4 points in 3.2 s")
    assert "not run here: liger (Liger's kernels need CUDA)" in status
    assert "kernels_lib failed at 1 of 2 points (OutOfMemoryError: out of memory)" in status
    assert "torch (eager) failed" not in status
    assert "liger" not in widgets.sweep_status(rows[rows.kernel_provider == "torch"], spec, ["torch"], {"liger": "x"}, 1.0)


# ------------------------------------------------------------------------------------------ the panel

@pytest.fixture
def kl_panel():
    """A panel as on a CPU (no kernel runs in the tests that use it: their sweeps are stubbed)."""
    return widgets.SweepPanel("kl_div", "cpu", get_spec("kl_div").small)


def test_a_provider_that_cannot_run_here_is_not_ticked_and_is_named_with_its_reason(kl_panel):
    skipped = kl_panel.skipped
    expected_skipped = {"liger"} if not torch.cuda.is_available() else set()
    assert expected_skipped <= set(skipped)  # on a CPU, Liger's Triton kernels cannot run
    for name, box in kl_panel.providers.items():
        assert box.value == (name not in skipped), name
        if name in skipped:
            assert "cannot run here" in box.description and skip_in(kl_panel.not_here.value, skipped[name])
    assert kl_panel.providers["torch"].description == widgets.BASELINE_NAME
    assert kl_panel.providers["kernels_lib"].description == f"kernels_lib {charts.INTERPRETER_LABEL}"  # a CPU panel


def test_only_kernels_lib_is_labelled_as_run_in_the_interpreter_and_only_on_a_cpu():
    spec = get_spec("fused_linear_grpo_loss_token")
    label = charts.INTERPRETER_LABEL
    assert widgets.display_provider(spec, "kernels_lib", "cpu") == f"kernels_lib {label}"
    assert widgets.display_provider(spec, "torch", "cpu") == widgets.BASELINE_NAME
    assert widgets.display_provider(spec, "trl", "cpu") == "trl"
    assert widgets.display_provider(spec, "kernels_lib", "cuda") == widgets.display_provider(spec, "kernels_lib") == "kernels_lib"
    assert "kernels_lib" in widgets.INTERPRETER_NOTE and "natively" in widgets.INTERPRETER_NOTE


def test_the_progress_line_names_providers_as_the_chart_does(kl_panel):
    kl_panel._progress(3, 8, "torch full V=512")
    assert kl_panel.status.value == f"running 3/8: {widgets.BASELINE_NAME} full V=512", kl_panel.status.value
    kl_panel._progress(4, 8, "kernels_lib full V=512")
    assert kl_panel.status.value == f"running 4/8: kernels_lib {charts.INTERPRETER_LABEL} full V=512"


def skip_in(html: str, reason: str) -> bool:
    return widgets.skip_reason(reason) in html


def test_the_panel_states_its_caps_and_caps_a_typed_size_with_a_message(kl_panel):
    assert "V ≤ 8192" in kl_panel.limits.value and "N ≤ 64" in kl_panel.limits.value
    kl_panel.sizes["N"].value = 1000
    assert kl_panel.sizes["N"].value == 64
    assert "N = 1000" in kl_panel.size_message.value and "set to 64" in kl_panel.size_message.value
    kl_panel.sizes["N"].value = 32
    assert kl_panel.sizes["N"].value == 32 and kl_panel.size_message.value == ""
    assert "N=32" in kl_panel.figure.layout.title.text  # before a sweep the title follows the settings


def test_before_a_sweep_the_chart_says_what_will_appear(kl_panel):
    notes = _notes(kl_panel.figure)
    assert any("after Run sweep" in n for n in notes) and all(list(t.x) == [None] for t in kl_panel.figure.data)
    assert "KL divergence" in kl_panel.figure.layout.title.text and "float32" in kl_panel.figure.layout.title.text
    kl_panel.modes.value = ["forward", "backward", "full"]
    assert len([a for a in kl_panel.figure.layout.annotations if a.text.startswith("time · ")]) == 3


def test_the_status_says_running_the_moment_a_sweep_starts_and_names_what_did_not_run(kl_panel, monkeypatch):
    seen = {}

    def fake_sweep(kernel_name, *, x_name, x_values, sizes, dtype, device, providers, modes, progress):
        seen.update(status=kl_panel.status.value, progress=(kl_panel.progress.value, kl_panel.progress.max), providers=providers)
        points = {(p, m, "speed"): {x: 1.0 for x in x_values} for p in providers for m in modes}
        return _rows(kernel_name, points, x_name=x_name)

    monkeypatch.setattr(widgets, "run_sweep", fake_sweep)
    kl_panel.status.value = "done: an earlier sweep"
    kl_panel.skipped = {**kl_panel.skipped, "liger": "RuntimeError: Liger's kernels need CUDA"}  # as on a CPU, on any machine
    kl_panel.providers["liger"].value = True
    kl_panel.run()
    n_values = len([v for v in kl_panel.x_values.options if kl_panel.x_values.value[0] <= v <= kl_panel.x_values.value[1]])
    assert seen["status"].startswith(f"running 0/{n_values * 2 * 2}"), seen["status"]
    assert seen["progress"] == (0, n_values * 2 * 2) and seen["providers"] == ["kernels_lib", "torch"]
    assert "not run here: liger (Liger's kernels need CUDA)" in kl_panel.status.value
    assert kl_panel.status.value.startswith(f"done: {n_values * 2 * 2} points")
    assert _notes(kl_panel.figure) == [widgets.NO_MEMORY_NOTE]  # the speed subplots hold lines; memory says why it is empty
    assert widgets.INTERPRETER_NOTE in kl_panel.figure.layout.title.text


def test_nothing_ticked_says_so_instead_of_sweeping(kl_panel, monkeypatch):
    monkeypatch.setattr(widgets, "run_sweep", lambda *a, **k: pytest.fail("swept with nothing to run"))
    for box in kl_panel.providers.values():
        box.value = False
    kl_panel.run()
    assert kl_panel.status.value.startswith("nothing to run")


def test_a_real_sweep_on_this_machine_fills_the_chart_and_the_table():
    """One point through the real run_sweep on this machine's device (Triton's interpreter on a CPU): lines in
    the chart, the table's people's names, memory measured on a GPU only."""
    device = kernels_lib.default_device()
    kl_panel = widgets.SweepPanel("kl_div", device, get_spec("kl_div").small)
    kl_panel.x_values.value = (512, 512)
    kl_panel.modes.value = ["full"]
    for name, box in kl_panel.providers.items():
        box.value = name in ("kernels_lib", "torch")
    rows = kl_panel.run()
    assert set(rows.kernel_provider) == {"kernels_lib", "torch"} and rows.y_value_50.notna().all()
    names = {t.name.split(" · ")[0] for t in charts.line_traces(kl_panel.figure) if t.name}
    assert names == {widgets.display_provider(kl_panel.spec, "kernels_lib", device), widgets.BASELINE_NAME}
    table = widgets.summary_table(rows, kl_panel.spec)
    assert list(table.columns) == [("time (ms)", 512)] + ([("peak memory beyond inputs (MB)", 512)] if device.type == "cuda" else [])
    assert (widgets.INTERPRETER_NOTE in kl_panel.figure.layout.title.text) == (device.type != "cuda")


def test_chooser_is_wide_enough_for_its_longest_label():
    labels = [("GRPO, sequence-level importance sampling", "a"), ("DPO", "b")]
    dropdown = widgets.chooser(labels)
    assert dropdown.layout.width == f"{len(labels[0][0]) + len('loss') + 8}ch"
    assert dropdown.style.description_width == "initial"


def test_sweep_chooser_shows_the_chosen_loss_under_its_label(monkeypatch):
    shown = []
    monkeypatch.setattr(widgets, "sweep_panel", lambda name, device, preset, *, label=None: shown.append((name, label)))
    dpo, grpo = get_spec("fused_linear_dpo_loss"), get_spec("fused_linear_grpo_loss_sequence")
    choices = {"DPO": (dpo.kernel_name, dpo.small), "GRPO, sequence-level importance sampling": (grpo.kernel_name, grpo.small)}
    dropdown = widgets.sweep_chooser(choices, "cpu")
    dropdown.value = "GRPO, sequence-level importance sampling"
    assert shown == [(dpo.kernel_name, "DPO"), (grpo.kernel_name, "GRPO, sequence-level importance sampling")]
    assert dropdown.layout.width == f"{len('GRPO, sequence-level importance sampling') + len('loss') + 8}ch"
