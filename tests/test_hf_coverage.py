"""Every class of the installed Transformers' causal-LM mapping through kernels_lib.hf.patch (``hf_coverage``).

The walk: one row per ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; no class may be matched with a
difference above the tolerances (a silent difference fails), a refused class must raise naming itself, and the
counts are reported. Rows come from ``data/hf_coverage.json`` when it was written under the current fingerprint
(this module's inputs: ``kernels_lib/hf.py``, ``kernels_workbench/hf_coverage.py``, the Transformers and torch
versions), else every class is checked again here (minutes on 2 CPU cores; ``python -m
kernels_workbench.hf_coverage`` rewrites the file). The kernel itself is checked against the torch stand-in below.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
import transformers

from kernels_lib import default_device, fused_linear_cross_entropy, hf
from kernels_workbench import hf_coverage

#: One worker takes the module under ``--dist loadgroup`` (the GPU target): a machine whose Transformers or torch
#: differs from the cache's walks every class once, not once per worker.
pytestmark = pytest.mark.xdist_group("hf_coverage_walk")


@pytest.fixture(scope="module")
def rows():
    return hf_coverage.coverage(cache=hf_coverage.CACHE)


def test_every_class_of_the_mapping_has_a_row(rows):
    mapping = hf_coverage.causal_lm_mapping()
    assert [(row.model_type, row.cls) for row in rows] == list(mapping.items())
    assert {row.result for row in rows} <= {"matched", "differs", "refused", "could not build"}
    assert all(row.reason for row in rows if row.result != "matched")


def test_no_class_differs_silently(rows):
    """A patched class either matches its own loss and every gradient or is refused: never 'differs'."""
    differs = [f"{row.cls} ({row.model_type}): {row.reason or ''} loss {row.loss_rel_err:.1e}, grads {row.grad_rel_err:.1e}"
               for row in rows if row.result == "differs"]
    assert not differs, "\n".join(differs)
    for row in rows:
        if row.result == "matched":
            assert row.loss_rel_err < hf_coverage.LOSS_TOL and row.grad_rel_err < hf_coverage.GRAD_TOL, row


def test_refused_classes_raise_naming_the_class(rows):
    """Each refusal names the class and its model_type; a refusal read from the forward alone is raised again here."""
    for row in rows:
        if row.result != "refused":
            continue
        assert row.reason.startswith(f"{row.cls} (model_type="), row
        try:
            hf.forward_pattern(getattr(transformers, row.cls))
        except ValueError as error:
            assert f"does not support {row.cls} (model_type=" in str(error)
        # else refused at patch time, on the instance (a head that is not the output embeddings, ...)


def test_matched_count_is_reported(rows, record_property):
    found = hf_coverage.counts(rows)
    record_property("hf_coverage", found)
    print(f"\nhf.patch over {found['rows']} model types: {found}")
    assert found["matched"] + found["differs"] + found["refused"] + found["could not build"] == len(rows)
    assert found["matched_classes"] >= 100  # a floor: the walk found 100+ when this test was written


# ------------------------------------------------------------------------------- the workbench's pieces


def test_torch_stand_in_is_the_kernel():
    """``torch_linear_cross_entropy`` is ``fused_linear_cross_entropy`` for what ``hf.patch`` passes: scale, softcap,
    temperature, ignore_index, num_items_in_batch (the kernel in float32 against the stand-in in float64) and the
    gradients of x, W and b."""
    device = default_device()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(24, 16, generator=generator).to(device)
    w = (torch.randn(40, 16, generator=generator) * 3).to(device)
    b = torch.randn(40, generator=generator).to(device)
    y = torch.randint(0, 40, (24,), generator=generator).to(device)
    y[:5] = -100
    for options in ({}, {"softcap": 5.0, "logit_scale": 0.25, "temperature": 2.0}, {"num_items_in_batch": 7}):
        inputs = [t.clone().requires_grad_() for t in (x, w, b)]
        ours = fused_linear_cross_entropy(inputs[0], inputs[1], y, inputs[2], **options)
        ours.backward()
        wide = [t.double().clone().requires_grad_() for t in (x, w, b)]
        theirs = hf_coverage.torch_linear_cross_entropy(wide[0], wide[1], y, wide[2], **options)
        theirs.backward()
        assert hf_coverage.rel_err(ours.detach().double(), theirs.detach()) < 1e-6, options
        for mine, reference in zip(inputs, wide):
            assert hf_coverage.rel_err(mine.grad.double(), reference.grad) < 1e-5, options


def test_check_tells_matched_refused_and_could_not_build():
    row = hf_coverage.check("cohere", "CohereForCausalLM", kernel="torch")
    assert row.result == "matched" and "× self.logit_scale" in row.pattern
    refused = hf_coverage.check("bamba", "BambaForCausalLM", kernel="torch")
    assert refused.result == "refused" and refused.reason.startswith("BambaForCausalLM (model_type='bamba'): its loss")
    broken = hf_coverage.check("llama", "NoSuchForCausalLM", kernel="torch")
    assert broken.result == "could not build" and "NoSuchForCausalLM" in broken.reason
    with pytest.raises(ValueError, match="kernel must be"):
        hf_coverage.check("llama", "LlamaForCausalLM", kernel="cuda")


def test_a_missed_transform_would_show():
    """The walk's scales are large enough that a transform dropped from the loss is far outside the tolerance."""
    model, inputs, ref_loss, _ = hf_coverage._build_and_run(transformers.GraniteForCausalLM,
                                                            hf_coverage.tiny_config("granite"))
    model.config.logits_scaling = 1.0  # the loss without Granite's division
    with torch.no_grad():
        assert hf_coverage.rel_err(model(**inputs).loss, ref_loss) > 100 * hf_coverage.LOSS_TOL


def test_counts_and_table():
    rows = [hf_coverage.Row("a", "A", "matched", loss_rel_err=0.0, grad_rel_err=0.0),
            hf_coverage.Row("b", "A", "matched", loss_rel_err=0.0, grad_rel_err=0.0),
            hf_coverage.Row("c", "C", "refused", reason="C (model_type='c'): no")]
    found = hf_coverage.counts(rows)
    assert found == {"matched": 2, "differs": 0, "refused": 1, "could not build": 0, "matched_classes": 1, "rows": 3}
    table = hf_coverage.table(rows)
    assert list(table["class"]) == ["A", "A", "C"] and table["pattern / reason"].iloc[2].endswith("no")
    assert math.isnan(hf_coverage.Row("d", "D", "refused").loss_rel_err)


def test_cache_is_reused_only_under_its_fingerprint(tmp_path, monkeypatch):
    rows = [hf_coverage.Row("cohere", "CohereForCausalLM", "matched", loss_rel_err=0.0, grad_rel_err=0.0)]
    path = tmp_path / "cache.json"
    hf_coverage.write_cache(rows, path)
    assert hf_coverage.read_cache(path) == {"cohere": rows[0]}
    monkeypatch.setattr(hf_coverage, "check", lambda *a: pytest.fail("a cached row was checked again"))
    assert hf_coverage.coverage({"cohere": "CohereForCausalLM"}, cache=path) == rows
    monkeypatch.setattr(hf_coverage, "fingerprint", lambda kernel="torch": "another")
    assert hf_coverage.read_cache(path) == {}


def test_a_fresh_sample_of_the_walk_agrees_with_its_rows(rows):
    """The rows are not taken on trust: each run checks a fresh random sample again, the matched ones through the
    fused kernel itself (the walk used the torch stand-in), and each must give its row's result. The seed is in
    the message; ``KERNELS_LIB_HF_SAMPLE_SEED`` repeats a sample."""
    seed = int(os.environ.get("KERNELS_LIB_HF_SAMPLE_SEED", random.SystemRandom().randrange(2**31)))
    pick = random.Random(seed)
    by_result = {result: [row for row in rows if row.result == result] for result in ("matched", "refused")}
    sample = pick.sample(by_result["matched"], 6) + pick.sample(by_result["refused"], 3)
    for row in sample:
        again = hf_coverage.check(row.model_type, row.cls, kernel="kernels_lib" if row.result == "matched" else "torch")
        assert again.result == row.result, f"seed {seed}: {row.cls} ({row.model_type}) was {row.result}, now {again}"
        if again.result == "matched":
            assert again.loss_rel_err < hf_coverage.LOSS_TOL and again.grad_rel_err < hf_coverage.GRAD_TOL, f"seed {seed}: {again}"
