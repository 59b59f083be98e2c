"""Arguments described once (``kernels_lib._docs``): every loss that marks a shared argument shows its description,
in the function's and its module's docstring; an unknown mark is refused by name."""

from __future__ import annotations

import pytest

import kernels_lib
from kernels_lib import _docs


@pytest.mark.parametrize("name", ["fused_linear_dpo", "fused_linear_cpo", "fused_linear_orpo", "fused_linear_kto",
                                  "fused_linear_grpo"])
def test_the_sequence_losses_show_the_shared_skip_ignored(name):
    function = getattr(kernels_lib, name)
    module = {"fused_linear_dpo": "FusedLinearDPOLoss", "fused_linear_cpo": "FusedLinearCPOLoss",
              "fused_linear_orpo": "FusedLinearORPOLoss", "fused_linear_kto": "FusedLinearKTOLoss",
              "fused_linear_grpo": "FusedLinearGRPOLoss"}[name]
    for doc in (function.__doc__, getattr(kernels_lib, module).__doc__):
        assert _docs.MARK not in doc
        flat = " ".join(doc.split())
        assert "skip_ignored: " + " ".join(_docs.SHARED["skip_ignored"].split()) in flat


def test_a_mark_is_filled_at_its_indent_and_an_unknown_one_refused():
    def f():
        """Args:
            skip_ignored: <shared>
                a line of its own.
        """

    text = _docs.shared_arguments(f).__doc__
    lines = text.splitlines()
    assert lines[1].startswith("            skip_ignored: True (default)")
    assert all(line.startswith("                ") for line in lines[2:-1])
    assert lines[-2].strip() == "a line of its own."

    def g():
        """Args:
            nothing_known: <shared>
        """

    with pytest.raises(KeyError, match="nothing_known"):
        _docs.shared_arguments(g)


@pytest.mark.parametrize("name", ["fused_linear_cpo", "fused_linear_orpo"])
def test_a_mark_with_a_key_takes_that_description(name):
    flat = " ".join(getattr(kernels_lib, name).__doc__.split())
    assert "process_group: " + " ".join(_docs.SHARED["paired_process_group"].split()) in flat
    assert _docs.MARK not in flat and "<shared:" not in flat
