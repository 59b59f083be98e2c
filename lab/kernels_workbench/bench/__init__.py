"""Measurement: providers behind one call signature per loss, timing and memory, sweeps, ceilings, the CLI.

Rows come out in the column layout of the published benchmark CSV (SPEC §3) plus provenance
columns, so published and measured rows plot together (:mod:`kernels_workbench.charts`).
"""

from .spec import LossSpec
from .registry import get_spec, registered_losses
from .sweep import MEASURED_COLUMNS, run_sweep

__all__ = ["LossSpec", "get_spec", "registered_losses", "run_sweep", "MEASURED_COLUMNS"]
