"""The CCE paper's table (:mod:`studies.bench.cce_paper`): its rows in our names, the bench preset of its
workload, our run beside it (ratios within each source only), and its workload told apart from the
published chart's in the committed CSV."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kernels_workbench import data
from kernels_workbench.bench import fused_linear_cross_entropy as flce
from studies.bench import cce_paper


def test_cce_paper_table_and_workload():
    """The CCE paper's Gemma 2 rows as its README prints them, the preset of its workload, and our run beside them:
    ratios to the baseline within each source only."""
    paper = cce_paper.cce_paper_rows()
    assert len(paper) == 9 and set(paper.provider) == {"cce", "torch.compile", "torch"}
    full = paper.set_index(["provider", "mode"])
    assert full.loc[("torch", "full"), "time ms"] == 208.8 and full.loc[("cce", "forward"), "memory MB"] == 1.1
    preset = flce.SPEC.preset("cce_gemma2")
    assert preset["sizes"] == {"H": 2304, "V": 256000} and preset["x_values"] == [8192]
    config = json.dumps({"H": 2304, "V": 256000, "dtype": "torch.bfloat16"})
    rows = pd.DataFrame([
        {"kernel_provider": p, "kernel_operation_mode": "full", "metric_name": m, "y_value_50": v, "x_value": 8192,
         "extra_benchmark_config_str": config, "kernels_lib_commit": "abc1234", "gpu_name": "NVIDIA H200",
         "timestamp": "2026-12-02 12:00"}
        for p, m, v in [("kernels_lib", "speed", 40.0), ("torch", "speed", 80.0), ("kernels_lib", "memory", 900.0)]
    ])
    other = rows.assign(extra_benchmark_config_str=json.dumps({"H": 4096, "V": 128256}))
    assert cce_paper.is_cce_paper_workload(pd.concat([rows, other])).tolist() == [True] * 3 + [False] * 3
    table = cce_paper.cce_paper_table(rows)
    assert table.loc[("kernels_lib", "full"), "H200 × torch"] == 0.5 and table.loc[("kernels_lib", "full"), "H200 MB"] == 900.0
    assert table.loc[("cce", "full"), "A100 × torch"] == pytest.approx(134.8 / 208.8)
    assert pd.isna(table.loc[("kernels_lib", "full"), "A100 ms (paper)"])  # ours is not in the paper
    with pytest.raises(ValueError, match="one run"):
        cce_paper.cce_paper_table(pd.concat([rows, rows.assign(kernels_lib_commit="fff0000")]))


def test_published_and_cce_paper_workloads_are_told_apart():
    """The CSV keeps the CCE paper's run beside the published chart's: each predicate picks its own rows."""
    rows = data.load_measured(flce.KERNEL_NAME, latest=False)
    published, cce = flce.is_published_workload(rows), cce_paper.is_cce_paper_workload(rows)
    assert published.any() and cce.any() and not (published & cce).any()
    configs = rows[cce].extra_benchmark_config_str.map(json.loads)
    assert configs.map(lambda c: (c["H"], c["V"]) == (2304, 256000)).all() and set(rows[cce].x_value) == {8192}
