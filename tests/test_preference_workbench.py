"""kernels_workbench.preference: notebook 06's derivation check (run on the notebook's own naive losses, read
from the notebook), and its headline per GPU from the newest run of each loss."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from kernels_workbench import data, preference

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "06_preference_dpo_cpo_simpo_grpo.ipynb"


def _notebook_functions() -> dict:
    """The naive losses and the derived gradients as notebook 06 defines them (its cells, run here)."""
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    namespace = {"torch": torch, "F": F}
    first = next(c for c in cells if c.startswith("def token_logps("))
    second = next(c for c in cells if c.startswith("def grpo("))
    exec(first, namespace)  # noqa: S102  (the notebook's own code)
    exec(second[: second.index("\nderivation, clipped =")], namespace)  # noqa: S102
    return namespace


def test_derivation_check_passes_the_notebook_s_gradients_and_names_a_wrong_one():
    f = _notebook_functions()
    table, clipped = preference.derivation_check(f["paired"], f["grpo"], f["token_logps"], f["derived_grads"], seed=0)
    assert set(table["loss"]) == {"DPO", "CPO", "SimPO", "GRPO (token)", "GRPO (sequence)"}
    assert len(table) == 5 * len(preference.DERIVATION_SHAPES) and (table.filter(like=" vs ") < 1e-12).all().all()
    assert clipped > 0, "off-policy: some tokens clipped, so the clipped branch of the weights is checked"

    def wrong(x, w, b, y, weights):
        dx, dw, db = f["derived_grads"](x, w, b, y, weights)
        return dx, dw * 1.01, db

    with pytest.raises(AssertionError, match="derivation check failed"):
        preference.derivation_check(f["paired"], f["grpo"], f["token_logps"], wrong, seed=0)
