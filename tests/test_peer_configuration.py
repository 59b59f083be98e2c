"""A peer measured far from its published figure, beside its own benchmark's configuration (notebook 06)."""

import pandas as pd
import pytest

from kernels_workbench import peer_configuration as pc


def _published(times):
    return pd.DataFrame([{"kernel_provider": "liger", "kernel_operation_mode": "full", "metric_name": "speed",
                          "x_value": b, "y_value_50": ms, "gpu_name": "NVIDIA A100-SXM4-80GB"} for b, ms in times.items()])


def _rows(arms, times):
    return pd.DataFrame([{"arm": arm, "importance_sampling_level": "token", "B": b, "ms_p50": ms * factor,
                          "gpu_name": "NVIDIA H100 80GB HBM3", "liger_version": "0.8.5", "torch_version": "2.11.0"}
                         for arm, factor in arms.items() for b, ms in times.items()])


PUBLISHED = {"token": _published({2: 40.0, 16: 320.0})}


def test_each_arm_over_the_published_figure_at_its_b():
    table = pc.table(_rows({"bench_adapter": 3.0, "liger_own": 1.0}, {2: 40.0, 16: 320.0}), PUBLISHED)
    assert table["bench_adapter × published"].tolist() == pytest.approx([3.0, 3.0])
    assert table["liger_own × published"].tolist() == pytest.approx([1.0, 1.0])
    assert table["published ms"].tolist() == [40.0, 320.0]


def test_without_the_own_configuration_the_gap_is_said_unexplained():
    text = pc.sentence(_rows({"bench_adapter": 3.0}, {2: 40.0, 16: 320.0}), PUBLISHED)
    assert "3.0× its published time" in text and "A100 80GB" in text and "H100 80GB" in text
    assert "unexplained" in text and "liger-kernel 0.8.5" in text


def test_with_both_arms_the_sentence_gives_the_own_configuration_ratio():
    text = pc.sentence(_rows({"bench_adapter": 3.0, "liger_own": 1.1}, {2: 40.0, 16: 320.0}), PUBLISHED)
    assert "1.1× that time" in text and "unexplained" not in text


def test_no_rows_say_the_study_has_not_run(tmp_path):
    assert pc.read(tmp_path / "missing.csv").empty
    assert "not been run" in pc.sentence(pd.DataFrame())


def test_the_committed_rows_read_back():
    rows = pc.read()
    if rows.empty:
        pytest.fail(f"{pc.FILE} is missing: notebook 06 reads it")
    assert set(rows.arm) <= set(pc.ARMS) and pc.table(rows)["published ms"].notna().all()
