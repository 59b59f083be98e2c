"""The CCE paper's benchmark beside one run of ours at its workload, for the studies.

The paper's rows (``data/published/cce_gemma2_a100.csv``: Gemma 2 (2B)'s head, 8192 tokens, H = 2304,
V = 256000, on an A100) are read in our names; ours come from the bench's ``cce_gemma2`` preset of
``fused_linear_cross_entropy`` (``./workbench bench fused_linear_cross_entropy --preset cce_gemma2``), kept in
the measured CSV beside the published chart's runs (:func:`is_cce_paper_workload` tells them apart).
"""

from __future__ import annotations

import json

import pandas as pd

from kernels_workbench import data
from kernels_workbench.bench.fused_linear_cross_entropy import SPEC

CCE_PAPER_ROWS = data.PUBLISHED_ROWS.parent / "cce_gemma2_a100.csv"
#: The CCE benchmark's names, as ours: its methods as providers, its kinds as modes.
CCE_PAPER_NAMES = {"cce": "cce", "torch_compile": "torch.compile", "baseline": "torch"}
CCE_PAPER_KINDS = {"loss-fw": "forward", "loss-bw": "backward", "loss-fw-bw": "full"}


def cce_paper_rows() -> pd.DataFrame:
    """The CCE paper's benchmark on Gemma 2 (2B)'s head (``data/published/cce_gemma2_a100.csv``: A100-SXM4,
    torch 2.4.1; 8192 tokens, H = 2304, V = 256000), one row per method and kind: ``provider`` (ours:
    ``baseline`` is our ``torch``), ``mode``, ``time ms``, ``memory MB`` (the operation's, as the paper
    measures it)."""
    rows = data.read_rows(CCE_PAPER_ROWS, ["method", "kind", "runtime_ms", "op_mem_mb"])
    return pd.DataFrame({"provider": rows.method.map(CCE_PAPER_NAMES), "mode": rows.kind.map(CCE_PAPER_KINDS),
                         "time ms": rows.runtime_ms, "memory MB": rows.op_mem_mb})


def is_cce_paper_workload(rows: pd.DataFrame) -> pd.Series:
    """Which measured rows are at the CCE paper's workload (8192 tokens, H = 2304, V = 256000)."""
    sizes = SPEC.preset("cce_gemma2")
    config = rows.extra_benchmark_config_str.map(json.loads)
    return ((rows.x_value == sizes["x_values"][0]) & config.map(lambda c: c.get("H") == sizes["sizes"]["H"])
            & config.map(lambda c: c.get("V") == sizes["sizes"]["V"]))


def cce_paper_table(measured: pd.DataFrame | None = None) -> pd.DataFrame:
    """The CCE paper's table (:func:`cce_paper_rows`, A100) with, where given, one run of ours at its workload
    (``measured``: rows of :func:`is_cce_paper_workload` from one run): per provider and mode the time and memory
    of each, and each time over the ``torch`` baseline's of the same source (a ratio only within one run).
    ``forward`` of ours is the published chart's forward (with the gradient's work, where a provider does it
    there), as the paper's ``loss-fw`` is."""
    paper = cce_paper_rows().set_index(["provider", "mode"])
    table = paper.rename(columns={"time ms": "A100 ms (paper)", "memory MB": "A100 MB (paper)"})
    base = paper.xs("torch", level="provider")["time ms"]
    table["A100 × torch"] = [paper.loc[(p, m), "time ms"] / base[m] for p, m in paper.index]
    if measured is not None and len(measured):
        data.run_label(measured)
        speed = measured[measured.metric_name == "speed"].set_index(["kernel_provider", "kernel_operation_mode"]).y_value_50
        memory = measured[measured.metric_name == "memory"].set_index(["kernel_provider", "kernel_operation_mode"]).y_value_50
        ours = pd.DataFrame({"H200 ms": speed, "H200 MB": memory})
        ours.index.names = ["provider", "mode"]
        table = table.join(ours, how="outer")
        h200_base = speed.xs("torch", level=0) if "torch" in speed.index.get_level_values(0) else pd.Series(dtype=float)
        table["H200 × torch"] = [table.loc[(p, m), "H200 ms"] / h200_base.get(m, float("nan")) for p, m in table.index]
    order = {m: i for i, m in enumerate(["forward", "forward_no_grad", "backward", "full"])}
    return table.sort_index(key=lambda idx: idx.map(order) if idx.name == "mode" else idx)
