"""The wide class-major chunk (studies.routes.wide_class_major): one class-major chunk of H < N ≤ k·H rows,
as the A/B's arm puts it in place. Its numbers against the float64 reference, where it is taken, and what
``weight.grad`` then holds; the library's own predicate (N ≤ H) is tested in
``tests/test_fused_linear_cross_entropy.py``."""

from __future__ import annotations

import pytest

from kernels_lib import fused_linear_cross_entropy
from studies.routes import wide_class_major
from test_fused_linear_cross_entropy import (  # noqa: F401  (fixtures: class_major_route, epilogue_route)
    ROUTE_DTYPE, TOL, check_against_reference, class_major_route, epilogue_route, flce_class_major, flce_module,
    make_inputs,
)
from two_heads import poisoned_allocations  # noqa: F401  (a fixture)


def test_the_library_predicate_is_the_default():
    assert flce_module._class_major_route_takes.__module__ == "kernels_lib.fused_linear_cross_entropy"
    assert wide_class_major.arm(3)[flce_module.__name__]["_class_major_route_takes"].rows_per_hidden == 3


@pytest.mark.parametrize(
    "lead, hidden, vocab, bias, options",
    [
        ((101,), 72, 1031, True, dict(reduction="mean")),  # H < N < 2H: the buffer is the logits' V·N + S·H
        ((2, 40), 40, 517, False, dict(reduction="sum", logit_scale=0.5)),  # N = 2H exactly
    ],
)
def test_wide_class_major_route_matches_reference(lead, hidden, vocab, bias, options, class_major_route,
                                                  poisoned_allocations, monkeypatch):
    """With the wide predicate at 2 H rows (the A/B's arm) and the default chunk_size, one chunk of
    H < N ≤ 2H rows takes the class-major route (forward defers the gradients); the slabs of dW, written
    over the logits they have read, never reach the ones still to be read. Loss and every gradient as the
    float64 reference."""
    monkeypatch.setattr(flce_module, "_class_major_route_takes", wide_class_major.route_takes(2))
    x, w, b, target = make_inputs(lead, hidden, vocab, ROUTE_DTYPE, bias=bias, ignore_every=5)
    loss = fused_linear_cross_entropy(x, w, target, b, **options)
    assert x.grad is None and len(class_major_route) == 1, "one chunk, the gradients left to backward"
    check_against_reference(x, w, b, target, TOL[ROUTE_DTYPE], **options)
    assert loss.isfinite()


def test_wide_class_major_route_only_within_its_limit(class_major_route, monkeypatch):
    """Beyond 2H rows, or with an explicit chunk_size below N, or at 1 H rows per chunk (the library's own
    limit): the chunked route."""
    for rows_per_hidden, lead, options in [(2, (145,), {}), (2, (101,), dict(chunk_size=64)), (1, (101,), {})]:
        monkeypatch.setattr(flce_module, "_class_major_route_takes", wide_class_major.route_takes(rows_per_hidden))
        x, w, b, target = make_inputs(lead, 72, 517, ROUTE_DTYPE)
        fused_linear_cross_entropy(x, w, target, b, skip_ignored=False, **options)  # N rows as given
    assert class_major_route == []


@pytest.mark.parametrize("rows_per_hidden", [1, 2])
def test_weight_grad_holds_what_the_route_says(rows_per_hidden, class_major_route, monkeypatch):
    """``weight.grad`` of the class-major route is a view of its buffer and keeps all of it: ``(V + S)·H``
    elements at N ≤ H; at H < N ≤ 2H the library's limit (chunked route) gives a gradient of its own size, the
    wide chunk one that holds ``V·N + S·H`` (why it is not the default)."""
    monkeypatch.setattr(flce_module, "_class_major_route_takes", wide_class_major.route_takes(rows_per_hidden))
    hidden, vocab, slab = 40, 517, flce_class_major.CLASS_MAJOR_SLAB_ROWS
    for rows in (hidden, 2 * hidden):
        x, w, b, target = make_inputs((rows,), hidden, vocab, ROUTE_DTYPE)
        fused_linear_cross_entropy(x, w, target, b, skip_ignored=False).backward()  # N rows as given
        held = w.grad.untyped_storage().nbytes() // w.grad.element_size()
        wide = rows > hidden and rows_per_hidden == 2
        expected = vocab * rows + slab * hidden if wide else (vocab + slab) * hidden if rows <= hidden else vocab * hidden
        assert held == expected, (rows, rows_per_hidden, held, expected)
    assert len(class_major_route) == (2 if rows_per_hidden == 2 else 1)
