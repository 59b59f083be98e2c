"""The log-prob parity check with a sampler (``kernels_workbench.parity``), at small sizes.

The differences are recomputed here from their definition (the engine's logits materialized in the
dtype, ``log_softmax`` in float32 at the temperature) and the summary checked against them; float32
parity must be at float32 rounding (a temperature applied on one side only would be off by O(1)),
bfloat16's larger; bad arguments are refused naming them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels_lib  # sets up the backend before the kernels are defined
from kernels_lib import default_device, fused_linear_token_logprobs
from kernels_workbench import parity

DEVICE = default_device()


def head(n=48, hidden=24, vocab=1031, seed=1):
    return parity.random_head(n, hidden, vocab, DEVICE, logit_std=3.0, seed=seed)


def test_differences_from_their_definition():
    x, w = head()
    diffs = parity.logprob_differences(x, w, temperatures=(0.7,), dtypes=(torch.bfloat16,), seed=3)
    assert set(diffs) == {(torch.bfloat16, 0.7)}
    delta = diffs[(torch.bfloat16, 0.7)]["delta"]
    # the sampled tokens are not returned: recover them from the same generator, as the module draws them
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    xs, ws = x.to(torch.bfloat16), w.to(torch.bfloat16)
    logits = F.linear(xs, ws).float()
    target = torch.multinomial(torch.softmax(logits / 0.7, -1), 1, generator=generator).squeeze(-1)
    engine = torch.log_softmax(logits / 0.7, -1).gather(-1, target[:, None]).squeeze(-1)
    ours = fused_linear_token_logprobs(xs, ws, target, temperature=0.7).logps
    assert torch.equal(delta, (ours - engine).double())
    table = parity.summarize(diffs, "test")
    row = table.iloc[0]
    size = delta.abs()
    assert row["tokens"] == x.shape[0] and row["dtype"] == "bfloat16" and row["temperature"] == 0.7
    assert row["|Δ| p50"] == pytest.approx(torch.quantile(size, 0.5).item())
    assert row["|Δ| p99"] == pytest.approx(torch.quantile(size, 0.99).item())
    assert row["|Δ| max"] == size.max().item() and row["mean Δ"] == pytest.approx(delta.mean().item())
    assert row["|Δ| p50"] <= row["|Δ| p90"] <= row["|Δ| p99"] <= row["|Δ| max"]


def test_float32_at_rounding_bfloat16_coarser():
    table, diffs = parity.parity_table({"tiny": 1031}, 48, 24, DEVICE, temperatures=(1.0, 0.6), seed=0)
    assert len(table) == 4 and set(diffs) == {("tiny", d, t) for d in parity.DTYPES for t in (1.0, 0.6)}
    by = table.set_index(["dtype", "temperature"])
    for t in (1.0, 0.6):
        f32, bf16 = by.loc[("float32", t)], by.loc[("bfloat16", t)]
        assert f32["|Δ| max"] < 1e-4 and f32["kernels_lib max err"] < 1e-4 and f32["engine max err"] < 1e-4
        # the engine's bfloat16 logits are rounded to 2^-8 relative: its error against float64 is bfloat16's
        assert bf16["engine max err"] > 10 * f32["engine max err"] and bf16["|Δ| max"] < 0.5
        # |Δ| is at most the two sides' errors against float64 (float64's own rounding aside), and
        # kernels_lib's error is of the engine's size: one rounding of the logits each
        assert bf16["|Δ| max"] <= 1.01 * (bf16["kernels_lib max err"] + bf16["engine max err"])
        assert bf16["kernels_lib max err"] <= 2 * bf16["engine max err"]
        if kernels_lib.INTERPRETED:
            # the interpreter's chunk logits are float32, so the two sides round differently
            assert bf16["|Δ| p99"] > 10 * f32["|Δ| p99"]
        elif t == 1.0:
            # compiled, the chunk logits are the bfloat16 matmul's as the engine's: the same rounding, so
            # their difference is float32's (an ulp where the accumulation orders differ)
            assert bf16["|Δ| p99"] < 1e-4
        # compiled at T != 1 kernels_lib rounds z/T (1/T is the matmul's alpha), the engine z before
        # dividing: two roundings of one size, so |Δ| is of the order of either's error (no bound beyond it)
    figure = parity.parity_chart(diffs)
    assert len(figure.data) == 4 and figure.layout.yaxis.type == "log"
    assert all(min(trace.y) > 0 and list(trace.y) == sorted(trace.y) for trace in figure.data)


@pytest.mark.parametrize("change, match", [
    (dict(dtypes=(torch.float64,)), "dtypes"),
    (dict(dtypes=()), "dtypes"),
    (dict(temperatures=(0.0,)), "temperatures"),
    (dict(temperatures=(True,)), "temperatures"),
])
def test_bad_arguments_named(change, match):
    x, w = head(n=4, hidden=8, vocab=17)
    with pytest.raises(ValueError, match=match):
        parity.logprob_differences(x, w, **change)


def test_bad_tensors_named():
    x, w = head(n=4, hidden=8, vocab=17)
    with pytest.raises(ValueError, match="weight"):
        parity.logprob_differences(x, w[:, :5])
    with pytest.raises(ValueError, match="x must be"):
        parity.logprob_differences(x[0], w)


def test_committed_h200_rows_hold_what_the_notebook_says():
    """The full-size H200 rows (data/measured/gpu_runs/logprob_parity.csv, notebook 06 §8): float32 at float32
    rounding; bf16 at T = 1 the same rounded logits on both sides; at T != 1 |Δ| within the two errors, and
    kernels_lib's error within 2× the engine's."""
    import pandas as pd

    from kernels_workbench import data

    path = data.MEASURED_DIR / "gpu_runs" / "logprob_parity.csv"
    rows = data.one_run(pd.read_csv(path))
    assert set(rows.vocabulary) == {f"{name} (V = {v})" for name, v in parity.VOCABULARIES.items()}
    f32, bf16 = rows[rows.dtype == "float32"], rows[rows.dtype == "bfloat16"]
    assert (f32["|Δ| max"] < 1e-5).all()
    assert (bf16[bf16.temperature == 1.0]["|Δ| p99"] < 1e-5).all()
    assert (bf16["|Δ| max"] <= 1.01 * (bf16["kernels_lib max err"] + bf16["engine max err"])).all()
    assert (bf16["kernels_lib max err"] <= 2 * bf16["engine max err"]).all()
