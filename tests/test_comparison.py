"""The per-run comparison the notebooks print under each published chart: each ratio within one run, the
floor from that run's own ceilings, memory against the leanest peer that allocates anything."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from kernels_workbench import floor as one_floor
from kernels_workbench import comparison, overview
from kernels_workbench.bench.registry import get_spec

GPU = "NVIDIA H100 80GB HBM3"
CONFIG = {"N": 16384, "dtype": "torch.float32", "reduction": "batchmean", "log_target": False}


def _rows(provider, ms, mb, commit="c1", gpu=GPU, xs=(4096, 8192), timestamp="2026-01-01 00:00:00"):
    """kl_div rows of one provider: ``ms`` and ``mb`` are a value or {x: value} (NaN: not measured there)."""
    at = lambda value, x: value.get(x, float("nan")) if isinstance(value, dict) else value  # noqa: E731
    return pd.DataFrame([
        {"kernel_name": "kl_div", "kernel_provider": provider, "kernel_operation_mode": mode, "metric_name": metric,
         "x_name": "V", "x_value": x, "y_value_50": at(value, x), "extra_benchmark_config_str": json.dumps({**CONFIG, "V": x}),
         "gpu_name": gpu, "timestamp": timestamp, "kernels_lib_commit": commit, "device": "cuda"}
        for mode in ("forward", "full") for x in xs for metric, value in (("speed", ms), ("memory", mb))])


def _ceilings(commit="c1", gpu=GPU, copy=3000.0, matmul=700.0):
    return pd.DataFrame([{"kernel_name": name, "gpu_name": gpu, "kernels_lib_commit": commit, "timestamp": "2026-01-01 00:00:00",
                          "y_value_50": value} for name, value in (("copy", copy), ("matmul", matmul))])


def _run():
    return pd.concat([_rows("kernels_lib", {4096: 1.0, 8192: 2.0}, 100.0), _rows("liger", {4096: 2.0, 8192: 5.0}, 200.0),
                      _rows("torch", {4096: 4.0, 8192: 4.0}, {4096: 0.5, 8192: 400.0}),
                      _rows("kernels_lib[accurate=True]", 0.1, 1.0)], ignore_index=True)


def test_ratios_to_each_peer_the_fastest_and_the_leanest():
    table = comparison.comparison(_run(), _ceilings())
    assert table.index.name == "V" and list(table.index) == [4096, 8192]
    assert "× kernels_lib[accurate=True]" not in table, "a configuration of kernels_lib is not a peer"
    assert table["× liger"].tolist() == pytest.approx([0.5, 0.4])
    assert table["× torch"].tolist() == pytest.approx([0.25, 0.5])
    assert table["fastest peer"].tolist() == ["liger", "torch"]  # 2.0 < 4.0 at 4096; 4.0 < 5.0 at 8192
    assert table["× fastest peer"].tolist() == pytest.approx([0.5, 0.5])
    # torch's 0.5 MB at V = 4096 is no base for a ratio: the leanest peer there is Liger
    assert table["leanest peer"].tolist() == ["liger", "liger"]
    assert table["memory × leanest"].tolist() == pytest.approx([0.5, 0.5])


def test_the_floor_is_the_runs_own_ceilings():
    table = comparison.comparison(_run(), _ceilings(copy=3000.0))
    spec = get_spec("kl_div")
    for v, ours in ((4096, 1.0), (8192, 2.0)):
        sizes = {"N": 16384, "V": v}
        floor = spec.bytes_moved(sizes, torch.float32, "full") / 3000e9 * 1e3
        assert one_floor.floor_at("kl_div", sizes, torch.float32, "full", {"copy": 3000.0, "matmul": 700.0})[0] == pytest.approx(floor)
        assert table.loc[v, "× floor"] == pytest.approx(ours / floor)


def test_no_floor_from_another_runs_ceilings():
    table = comparison.comparison(_run(), _ceilings(commit="other"))
    assert table["× floor"].isna().all(), "the ceilings of another run must not make a floor for this one"
    assert comparison.floor_ms(_run(), pd.concat([_ceilings(commit="c1", gpu="NVIDIA H200")])).isna().all(), "another GPU's"


def test_a_peer_missing_at_one_x_is_not_measured_there():
    rows = pd.concat([_rows("kernels_lib", 1.0, 100.0), _rows("liger", {4096: 2.0}, {4096: 200.0})], ignore_index=True)
    table = comparison.comparison(rows, _ceilings())
    assert table.loc[4096, "× liger"] == pytest.approx(0.5)
    assert pd.isna(table.loc[8192, "× liger"]) and pd.isna(table.loc[8192, "× fastest peer"])
    assert pd.isna(table.loc[8192, "memory × leanest"])


def test_refuses_two_runs_and_a_missing_provider():
    with pytest.raises(ValueError, match="one run"):
        comparison.comparison(pd.concat([_run(), _rows("liger", 1.0, 1.0, commit="c2")]), _ceilings())
    with pytest.raises(ValueError, match="ours='kernels_lib' has no full time"):
        comparison.comparison(_rows("liger", 1.0, 1.0), _ceilings())
    with pytest.raises(ValueError, match="no rows"):
        comparison.comparison(_run().iloc[:0], _ceilings())


def test_summary_says_each_gpu_and_its_ranges():
    text = comparison.summary({GPU: comparison.comparison(_run(), _ceilings())})
    assert text.startswith("- **H100 80GB**") and "V = 4096–8192" in text
    assert "0.50× the fastest peer's time" in text and "0.50× the leanest peer's memory" in text
    assert comparison.summary({GPU: comparison.comparison(_run(), _ceilings(commit="x"))}).count("no floor (the run measured no ceilings)") == 1
    assert comparison.summary({}).startswith("Not measured on a GPU yet")


def _published(ms: dict, gpu="NVIDIA A100-SXM4-80GB", provider="liger"):
    return pd.DataFrame([{"kernel_name": "kl_div", "kernel_provider": provider, "kernel_operation_mode": "full", "metric_name": "speed",
                          "x_name": "V", "x_value": x, "y_value_50": y, "extra_benchmark_config_str": json.dumps({**CONFIG, "V": x}),
                          "gpu_name": gpu} for x, y in ms.items()])


def test_a_peer_far_from_its_published_figure_on_a_slower_gpu_is_marked_and_not_the_fastest():
    run = _run()  # Liger 2.0 and 5.0 ms on the H100
    far = comparison.far_from_published(run, _published({4096: 0.9, 8192: 4.0}))
    assert set(far) == {"liger"} and far["liger"] == pytest.approx(2.0 / 0.9), "2.2× its A100 figure on a faster GPU"
    table = comparison.comparison(run, _ceilings(), published=_published({4096: 0.9, 8192: 4.0}))
    assert f"× liger ({comparison.FAR})" in table and "× liger" not in table
    assert (table["fastest peer"] == "torch").all() and table["× fastest peer"].tolist() == pytest.approx([0.25, 0.5])


def test_a_peer_near_its_published_figure_or_on_a_faster_published_gpu_is_kept():
    run = _run()
    assert comparison.far_from_published(run, _published({4096: 1.5, 8192: 4.0})) == {}, "within 2× of its figure"
    assert comparison.far_from_published(run, _published({4096: 0.5}, gpu="NVIDIA B200")) == {}, "published on a faster GPU"
    table = comparison.comparison(run, _ceilings(), published=_published({4096: 1.5}))
    assert "× liger" in table and table.loc[4096, "fastest peer"] == "liger"


def test_fastest_and_leanest_peers_are_picked_in_one_place():
    """Per x: the least time among the peers not far from their published figure; the least memory among the
    peers with at least MIN_PEER_MB (a smaller one is no base for a ratio)."""
    speed = pd.DataFrame({"liger": [2.0, 1.0], "torch": [3.0, 4.0], "cce": [1.0, float("nan")]}, index=[1, 2])
    peer, ms = comparison.fastest_peers(speed, far={"cce"})
    assert list(peer) == ["liger", "liger"] and list(ms) == [2.0, 1.0]
    peer, ms = comparison.fastest_peers(speed)
    assert list(peer) == ["cce", "liger"] and list(ms) == [1.0, 1.0]
    memory = pd.DataFrame({"liger": [0.5, 30.0], "torch": [20.0, 10.0]}, index=[1, 2])
    peer, mb = comparison.leanest_peers(memory)
    assert list(peer) == ["torch", "torch"] and list(mb) == [20.0, 10.0]
    assert comparison.leanest_peers(memory[["liger"]].iloc[:1])[0].empty
    assert math.isnan(comparison.memory_bases(0.5)) and comparison.memory_bases(2.0) == 2.0
