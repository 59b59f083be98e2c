"""The overview's logic (kernels_workbench.overview, charts.add_floor) and notebook 00 as papermill runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

import notebook_runs  # each notebook executed once, shared with the browser tests
import torch

import nbformat

from kernels_workbench import charts, data, overview, report
from kernels_workbench.bench import fused_linear_cross_entropy as flce

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "00_overview.ipynb"
KL_CONFIG = {"N": 16384, "V": 4096, "dtype": "torch.float32", "reduction": "batchmean", "log_target": False}


def _rows(gpu, provider, ms, x_values=(4096, 8192), modes=("forward", "full"), commit="aaa", timestamp="2026-01-01 00:00:00",
          metric="speed", config=KL_CONFIG):
    """Rows in the measured layout: ``ms`` per x (a number or a list)."""
    ms = ms if isinstance(ms, list) else [ms] * len(x_values)
    return pd.DataFrame([
        {"kernel_name": "kl_div", "kernel_provider": provider, "kernel_operation_mode": mode, "metric_name": metric,
         "x_name": "V", "x_label": "vocab size", "x_value": x, "y_value_50": value, "y_value_20": value, "y_value_80": value,
         "extra_benchmark_config_str": json.dumps({**config, "V": x}), "gpu_name": gpu, "timestamp": timestamp,
         "kernels_lib_commit": commit, "torch_version": "2.11.0", "triton_version": "3.6.0", "liger_version": "0.8.5",
         "cce_version": None, "device": "cuda", "timer": "cuda_events_do_bench"}
        for mode in modes for x, value in zip(x_values, ms)
    ])


def _ceilings(copy_by_commit: dict, matmul=700.0):
    rows = []
    for commit, (copy, stamp) in copy_by_commit.items():
        for name, rate in (("copy", copy), ("matmul", matmul)):
            rows.append({"kernel_name": name, "gpu_name": overview.H200, "kernels_lib_commit": commit, "timestamp": stamp, "y_value_50": rate})
    return pd.DataFrame(rows)


def _kl_workload(published, measured):
    return overview.Workload("kl_div", {"B": 8, "T": 2048}, published, measured)


def test_workloads_are_the_published_charts_with_matching_measured_rows():
    found = overview.workloads()
    names = [w.kernel_name for w in found]
    assert names.count("fused_linear_orpo_loss") == 2  # published at T = 1024 and T = 4096
    assert {"fused_linear_cross_entropy", "kl_div", "kto_loss"} <= set(names)
    orpo = [w for w in found if w.kernel_name == "fused_linear_orpo_loss"]
    assert {w.config["T"] for w in orpo} == {1024, 4096}
    for workload in found:
        assert workload.published.extra_benchmark_config_str.nunique() == 1
        if len(workload.measured):
            assert set(workload.measured.gpu_name) <= set(overview.DATASHEETS.index), set(workload.measured.gpu_name)  # GPUs we know
            assert set(workload.measured.device) == {"cuda"}
    flce_workload = next(w for w in found if w.kernel_name == "fused_linear_cross_entropy")
    assert "huggingface" not in set(flce_workload.published.kernel_provider)  # renamed as the spec's baseline, torch


def test_belongs_compares_sizes_and_dtype_only():
    published = {"T": 1024, "H": 4096, "V": 128256, "dtype": "torch.bfloat16", "ignore_index": 42}
    assert overview.belongs({"B": 4, "T": 1024, "H": 4096, "V": 128256, "dtype": "torch.bfloat16", "ignore_index": -100}, published, "B")
    assert not overview.belongs({"B": 4, "T": 4096, "H": 4096, "V": 128256, "dtype": "torch.bfloat16"}, published, "B")
    assert not overview.belongs({"T": 1024, "dtype": "torch.float32"}, published, "B")
    assert overview.belongs({"N": 16384, "V": 4096}, {"B": 8, "T": 2048}, "V")  # no size in common


def test_workloads_match_measured_rows_by_axis_and_sizes(tmp_path, monkeypatch):
    """JSD's two charts: the V sweep (B = 4, T = 2048) and the B200 token sweep, whose config names V
    ``vocab_size``. Rows join the chart of their axis, and the token chart only at its V."""
    from kernels_workbench import data

    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    vocab = _rows(overview.H200, "kernels_lib", 1.0, config={"N": 8192, "dtype": "torch.float32"}).assign(kernel_name="jsd")
    tokens = _rows(overview.H200, "kernels_lib", 1.0, x_values=(1024, 2048))
    other_v = _rows(overview.H200, "kernels_lib", 1.0, x_values=(4096,))
    for frame, v in ((tokens, 128256), (other_v, 32000)):
        frame["kernel_name"], frame["x_name"], frame["x_label"] = "jsd", "BT", "total tokens"
        frame["extra_benchmark_config_str"] = [json.dumps({"V": v, "BT": int(x), "dtype": "torch.float32"}) for x in frame.x_value]
    pd.concat([vocab, tokens, other_v]).to_csv(tmp_path / "jsd.csv", index=False)
    charts_of_jsd = {w.x_name: w for w in overview.workloads() if w.kernel_name == "jsd"}
    assert charts_of_jsd["BT"].config["V"] == 128256 and charts_of_jsd["BT"].title == "jsd (V = 128256)"
    assert sorted(charts_of_jsd["BT"].measured.x_value.unique()) == [1024, 2048]
    assert sorted(charts_of_jsd["V"].measured.x_value.unique()) == [4096, 8192]
    assert (charts_of_jsd["V"].measured.x_name == "V").all()


def test_a_point_measured_under_two_config_strings_counts_once(tmp_path, monkeypatch):
    """The tensor-parallel bench records the Megatron chart's workload with ``"TP": 1`` in its config,
    the chart's sweep without: both belong to the chart, and the newer row of each point is the one
    kept (the agreement table then has one row per point, not a duplicate-index error)."""
    from kernels_workbench import data

    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    config = {"S": 2048, "B": 4, "dtype": "torch.bfloat16", "reduction": "sum"}
    old = _rows(overview.H200, "kernels_lib", 2.0, config={**config, "TP": 1}, commit="old")
    new = _rows(overview.H200, "kernels_lib", 1.0, config=config, commit="new", timestamp="2026-02-01 00:00:00")
    pd.concat([old, new]).assign(kernel_name="megatron_cross_entropy").to_csv(tmp_path / "megatron_cross_entropy.csv", index=False)
    (chart,) = [w for w in overview.workloads() if w.kernel_name == "megatron_cross_entropy"]
    assert set(chart.measured.kernels_lib_commit) == {"new"} and len(chart.measured) == len(new)
    table = overview.agreement_table(chart, None)
    assert not table.duplicated(["provider", "mode", "x"]).any()


def test_workload_floor_uses_the_ceilings_of_the_rows_run():
    ceilings = _ceilings({"old": (3000.0, "2026-01-01 00:00:00"), "run": (4000.0, "2026-01-02 00:00:00"), "new": (5000.0, "2026-01-03 00:00:00")})
    workload = _kl_workload(_rows("NVIDIA H100 PCIe", "torch", 2.0), _rows(overview.H200, "kernels_lib", 1.0, commit="run"))
    floor = overview.workload_floor(workload, ceilings)
    assert floor.ms.loc[4096, "full"] == pytest.approx(12 * 16384 * 4096 / 4000e9 * 1e3), "the copy bandwidth of the rows' own run"
    assert set(floor.bound) == {"bytes"}
    assert "copy 4000 GB/s measured in this run" in floor.describe() and "run" not in floor.describe().split(";")[0]
    unmeasured = overview.workload_floor(_kl_workload(workload.published, workload.measured.iloc[:0]), ceilings)
    assert unmeasured is None, "no run: no floor (never the newest run's ceilings)"
    assert overview.workload_floor(workload, ceilings[ceilings.kernel_name == "matmul"]) is None, "no copy ceiling in the run: no floor"


def test_agreement_judges_the_ratio_against_the_datasheets():
    published = pd.concat([_rows("NVIDIA H100 PCIe", "torch", 10.0), _rows("NVIDIA H100 PCIe", "liger", 10.0)])
    expected = 2.0 / 4.8  # a bandwidth-bound loss: H100 PCIe over H200 bandwidth
    measured = pd.concat([
        _rows(overview.H200, "torch", 10.0 * expected),  # what the GPUs explain
        _rows(overview.H200, "liger", [10.0 * expected * 2, 10.0 * expected / 2]),  # slower, then faster
        _rows(overview.H200, "kernels_lib", 1.0),  # not published: not compared
    ])
    workload = _kl_workload(published, measured)
    floor = overview.workload_floor(workload, _ceilings({"aaa": (4000.0, "2026-01-01 00:00:00")}))
    table = overview.agreement_table(workload, floor)
    assert set(table.provider) == {"torch", "liger"} and len(table) == 2 * 2 * 2
    assert table.expected.unique() == pytest.approx([expected])
    torch_rows = table[table.provider == "torch"]
    assert (torch_rows.verdict == "agrees").all() and torch_rows["ratio / expected"].to_numpy() == pytest.approx(1.0)
    liger = table[table.provider == "liger"].set_index(["mode", "x"]).verdict
    assert liger["full", 4096] == "slower than the GPUs explain" and liger["full", 8192] == "faster than the GPUs explain"
    summary = overview.agreement_summary(table).set_index(["provider", "mode"])
    assert summary.loc[("torch", "full"), "agree"] == 2 and summary.loc[("liger", "full"), "agree"] == 0
    assert summary.loc[("liger", "full"), "of"] == 2
    assert overview.agreement_table(_kl_workload(published, measured.iloc[:0]), floor).empty
    assert (overview.agreement_table(workload, None).verdict == "no floor to judge by").all()


def test_speed_memory_x_prefers_the_most_providers():
    speed = pd.concat([_rows(overview.H200, p, 1.0, x_values=(1, 2, 3, 4)) for p in ("a", "b")])
    memory = pd.concat([_rows(overview.H200, "a", 5.0, x_values=(1, 2, 3, 4), metric="memory"),
                        _rows(overview.H200, "b", 5.0, x_values=(2, 3, 4), metric="memory")])
    assert overview.speed_memory_x(pd.concat([speed, memory])) == 3  # middle of 2, 3, 4
    assert overview.speed_memory_x(speed) is None


def test_environment_table_has_one_row_per_run():
    rows = pd.concat([_rows(overview.H200, "torch", 1.0, commit="aaa"), _rows(overview.H200, "torch", 1.0, commit="bbb", timestamp="2026-02-01 00:00:00")])
    table = overview.environment_table({"kl_div": rows, "empty": rows.iloc[:0]})
    assert list(table.kernels_lib_commit) == ["aaa", "bbb"] and set(table.file) == {"kl_div"}
    assert list(table.columns[:3]) == ["file", "gpu_name", "kernels_lib_commit"]
    assert table.set_index("kernels_lib_commit").loc["bbb", "first"] == "2026-02-01 00:00:00"
    assert table.cce_version.eq("–").all() and table.torch_version.eq("2.11.0").all()
    published = overview.published_environment()
    assert published.loc["kl_div", "gpu_name"] == "NVIDIA H100 PCIe"


def test_add_floor_draws_on_speed_panels_only():
    figure = charts.scaling_chart(None, _rows(overview.H200, "torch", 1.0), x_label="V", title="t")
    before = len(figure.data)
    floor = pd.DataFrame({"forward": [0.1, 0.2], "full": [0.3, 0.6]}, index=[4096, 8192])
    charts.add_floor(figure, floor, name="floor")
    added = figure.data[before:]
    assert len(added) == 2 and [t.name for t in added] == ["floor", "floor"]
    assert [t.showlegend for t in added] == [True, False]
    assert list(added[1].y) == [0.3, 0.6] and added[1].line.dash == "dot"


@pytest.mark.notebook
@notebook_runs.GROUP
def test_overview_notebook_runs_and_exports_every_chart():
    html_path, results, executed_path = notebook_runs.executed(NOTEBOOK)
    coverage = pd.read_csv(results / "coverage.csv")
    published = overview.workloads()
    # one coverage row per (chart, GPU we measured it on), one per chart measured on none
    assert len(coverage) == sum(max(1, len(w.gpus)) for w in published)
    assert set(coverage["measured on"]) == {data.gpu_label(g) for w in published for g in w.gpus} | ({"none yet"} if any(
        not w.gpus for w in published) else set())
    agreement = pd.read_csv(results / "agreement.csv")
    measured = [w for w in published if len(w.measured)]
    assert set(agreement.workload) == {w.title for w in measured if set(w.measured.kernel_provider) & set(w.published.kernel_provider)}
    assert set(agreement.gpu) <= {data.gpu_label(g) for w in measured for g in w.gpus}
    assert agreement.verdict.isin(["agrees", "slower than the GPUs explain", "faster than the GPUs explain"]).all()
    html = html_path.read_text(encoding="utf-8")
    speed_memory = sum(overview.speed_memory_x(w.on(g)) is not None for w in measured for g in w.gpus)
    assert html.count("Plotly.newPlot(") == len(published) + speed_memory  # a scaling chart each, speed vs memory per GPU
    unmeasured = [w for w in published if not len(w.measured)]
    # The notice itself (bold), not the markdown cell that explains it (italic).
    assert ("<strong>No measured rows yet</strong>" in html) == bool(unmeasured)
    assert ("Every workload has rows measured on" in html) == (not unmeasured)
    assert "NVIDIA datasheets" in html and "H100 PCIe" in html
    assert "overview.H200" not in "".join(c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")


def test_across_runs_shows_one_providers_time_in_every_run():
    """The logits-level JSD's full at V = 4096 moved 0.74 → 0.35 ms between runs of the H200 whose V = 16384
    points agree (937d4a2, 428f387): the spread is the run's, not the kernel's."""
    def row(commit, stamp, x, y, provider="kernels_lib", mode="full", gpu="NVIDIA H200"):
        return dict(kernel_provider=provider, kernel_operation_mode=mode, metric_name="speed", x_value=x, y_value_50=y,
                    kernels_lib_commit=commit, gpu_name=gpu, timestamp=stamp)

    rows = pd.DataFrame([row("937d4a2", "2026-12-02 06:16", 4096, 0.74), row("937d4a2", "2026-12-02 06:16", 16384, 0.454),
                         row("428f387", "2026-12-02 14:18", 4096, 0.35), row("428f387", "2026-12-02 14:18", 16384, 0.458),
                         row("6ef9242", "2026-11-30 13:50", 4096, 0.64), row("6ef9242", "2026-11-30 13:50", 16384, 0.588),
                         row("428f387", "2026-12-02 14:18", 4096, 9.0, provider="liger"),
                         row("428f387", "2026-12-02 14:18", 4096, 9.0, mode="forward")])
    table = overview.across_runs(rows, "kernels_lib", "full")
    assert list(table.columns) == ["6ef9242", "937d4a2", "428f387", "newest / oldest", "max / min"]  # oldest first
    assert table.loc[4096, "max / min"] == pytest.approx(0.74 / 0.35)
    assert table.loc[16384, "newest / oldest"] == pytest.approx(0.458 / 0.588)
    with pytest.raises(ValueError, match="runs on"):
        overview.across_runs(pd.concat([rows, pd.DataFrame([row("1111111", "2026-12-03", 4096, 1.0, gpu="NVIDIA A100")])]),
                             "kernels_lib", "full")


def test_per_element_excess_models_each_run_by_its_large_points():
    """Each run's time per element (N·V, from its large points) predicts its small ones; the excess and the run's
    own p80 − p20 per point. Two runs at different rates keep their own models; a run without a large point raises."""
    def row(commit, stamp, v, y, spread=0.0, provider="kernels_lib", n=8192):
        config = json.dumps({"N": n, "V": v, "dtype": "torch.float32"})
        return dict(kernel_provider=provider, kernel_operation_mode="full", metric_name="speed", x_value=v, y_value_50=y,
                    y_value_20=y - spread / 2, y_value_80=y + spread / 2, extra_benchmark_config_str=config,
                    kernels_lib_commit=commit, gpu_name="NVIDIA H200", timestamp=stamp)

    per_element = 3.2e-9  # ms per element
    rows = pd.DataFrame([row("aaaaaaa", "2026-12-01", 4096, per_element * 8192 * 4096 + 0.5, spread=0.2),
                         row("aaaaaaa", "2026-12-01", 32768, per_element * 8192 * 32768, spread=0.004),
                         row("aaaaaaa", "2026-12-01", 65536, per_element * 8192 * 65536),
                         row("bbbbbbb", "2026-12-02", 4096, 2 * per_element * 8192 * 4096),
                         row("bbbbbbb", "2026-12-02", 32768, 2 * per_element * 8192 * 32768),
                         row("bbbbbbb", "2026-12-02", 4096, 99.0, provider="liger")])
    rows = pd.concat([rows, rows.iloc[[1]].assign(y_value_50=per_element * 8192 * 32768 * 3)])  # 32768 twice: index repeats
    rows = pd.concat([rows, rows.iloc[[1]].assign(y_value_50=per_element * 8192 * 32768 / 3)])  # and a third time
    table = overview.per_element_excess(rows, "kernels_lib", "full", fit_from=32768)
    assert list(table.run) == ["aaaaaaa"] * 3 + ["bbbbbbb"] * 2  # oldest run first, one row per point, the peer's left out
    assert set(table.gpu) == {"NVIDIA H200"}
    assert table[(table.run == "aaaaaaa") & (table.x == 32768)]["measured ms"].item() == pytest.approx(per_element * 8192 * 32768)
    first = table[(table.run == "aaaaaaa") & (table.x == 4096)].iloc[0]
    assert first["model ms"] == pytest.approx(per_element * 8192 * 4096)
    assert first["excess ms"] == pytest.approx(0.5) and first["p80 - p20 ms"] == pytest.approx(0.2)
    assert first["measured / model"] == pytest.approx(1 + 0.5 / (per_element * 8192 * 4096))
    assert table[table.run == "bbbbbbb"]["excess ms"].abs().max() < 1e-12  # its own rate, twice the other's
    assert overview._elements(json.dumps({"B": 2, "T": 3, "V": 5})) == 30  # the logits-level CE's configuration
    with pytest.raises(ValueError, match="run aaaaaaa .* no kernels_lib full point at x >= 131072"):
        overview.per_element_excess(rows, "kernels_lib", "full", fit_from=131072)


def test_agreement_pairs_a_published_mode_with_the_mode_of_ours_that_measures_the_same():
    """Megatron's published backward is a fresh forward and backward (its SPEC.published_modes: our full): the
    agreement table pairs it with our full, named backward, and never with our backward alone; other losses pair
    mode with mode."""
    published = pd.concat([_rows("NVIDIA H100 PCIe", "megatron-fused", 10.0, modes=("forward", "backward", "full"))])
    measured = pd.concat([_rows(overview.H200, "megatron-fused", 3.0, modes=("forward",)),
                          _rows(overview.H200, "megatron-fused", 7.0, modes=("full",)),
                          _rows(overview.H200, "megatron-fused", 0.5, modes=("backward",))])
    megatron = overview.Workload("megatron_cross_entropy", {"S": 2048, "B": 4, "TP": 1}, published.assign(kernel_name="megatron_cross_entropy"),
                                 measured.assign(kernel_name="megatron_cross_entropy"))
    table = overview.agreement_table(megatron, None).set_index(["mode", "x"])["measured ms"]
    assert table["backward", 4096] == 7.0 and table["full", 4096] == 7.0 and table["forward", 4096] == 3.0
    kl = overview.agreement_table(_kl_workload(published.assign(kernel_name="kl_div"), measured.assign(kernel_name="kl_div")), None)
    assert kl.set_index(["mode", "x"])["measured ms"]["backward", 4096] == 0.5


# --------------------------------------------------------------------------- two GPUs


def test_a_chart_holds_the_newest_run_of_each_gpu_labelled(tmp_path, monkeypatch):
    """KL measured on an H200 (two runs) and on an H100 80GB (one, older): the chart holds the newest run of
    each GPU, none preferred; coverage, floors and the agreement are per GPU, each with its own ceilings
    and datasheet."""
    from kernels_workbench import data

    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    h200_old = pd.concat([_rows(overview.H200, p, 2.0, commit="h200old") for p in ("kernels_lib", "torch")])
    h200_new = _rows(overview.H200, "kernels_lib", 1.0, commit="h200new", timestamp="2026-03-01 00:00:00")
    h100 = pd.concat([_rows(overview.H100, p, ms, commit="h100run", timestamp="2026-02-01 00:00:00")
                      for p, ms in (("kernels_lib", 1.5), ("torch", 3.0))])
    pd.concat([h200_old, h200_new, h100]).to_csv(tmp_path / "kl_div.csv", index=False)
    (kl,) = [w for w in overview.workloads() if w.kernel_name == "kl_div"]
    assert kl.gpus == [overview.H100, overview.H200]
    assert set(kl.on(overview.H200).kernels_lib_commit) == {"h200new"} and set(kl.on(overview.H100).kernels_lib_commit) == {"h100run"}
    assert set(kl.measured.gpu_name) == {overview.H100, overview.H200}
    assert "run of commit h100run on NVIDIA H100 80GB HBM3" in kl.run and "run of commit h200new on NVIDIA H200" in kl.run
    assert [w.gpus for w in overview.workloads(overview.H100) if w.kernel_name == "kl_div"] == [[overview.H100]]
    rows = {r["measured on"]: r for r in overview.coverage_rows(kl)}
    assert set(rows) == {"H100 80GB", "H200"}
    assert rows["H200"]["not in this run"].startswith("torch") and rows["H100 80GB"]["measured providers"] == "kernels_lib, torch"
    assert overview.coverage(kl)["measured on"] == "H100 80GB; H200"
    ceilings = pd.concat([_ceilings({"h200new": (4000.0, "2026-03-01 00:00:00")}),
                          _ceilings({"h100run": (3000.0, "2026-02-01 00:00:00")}).assign(gpu_name=overview.H100)])
    floors = overview.workload_floors(kl, ceilings)
    assert set(floors) == {overview.H100, overview.H200}
    assert "copy 3000 GB/s" in floors[overview.H100].describe() and "copy 4000 GB/s" in floors[overview.H200].describe()
    published = _rows("NVIDIA H100 PCIe", "torch", 10.0)
    workload = overview.Workload("kl_div", {"B": 8, "T": 2048}, published, kl.measured, kl.runs)
    table = overview.agreement_table(workload, floors)
    assert set(table.gpu) == {"H100 80GB"}  # torch was in the H100's run only (the H200's newest has none)
    assert table.expected.unique() == pytest.approx([2.0 / 3.35])  # the H100 PCIe over the H100 80GB's bandwidth
    compact = overview.agreement_compact(table)
    assert list(compact.columns[:3]) == ["chart", "GPU", "provider"] and list(compact.GPU) == ["H100 80GB"]
    assert "on the H100 80GB" in overview.agreement_sentences(table.assign(ratio=table.ratio * 3, **{"ratio / expected": 3.0},
                                                                          verdict="slower than the GPUs explain"))
    ratios = overview.datasheet_ratios({"NVIDIA A100-SXM4-80GB"}, [overview.H100, overview.H200]).set_index("measured on")
    assert ratios.loc["H200", "bandwidth ×"] == pytest.approx(4.8 / 2.039) and ratios.loc["H100 80GB", "bf16 rate ×"] == pytest.approx(989 / 312)
