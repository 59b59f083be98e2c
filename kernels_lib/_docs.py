"""Argument descriptions shared by several losses, written once: a docstring line ``name: <shared>`` is replaced by
the description of :data:`SHARED` at that line's indent (its continuation four spaces deeper)."""

from __future__ import annotations

import re
import textwrap

#: The description of each shared argument.
SHARED = {
    "skip_ignored": (
        "True (default): the positions whose target is ``ignore_index`` are dropped before the head's matmuls "
        "(their rows of ``x`` gathered out; ``dx`` is 0 there); the loss, the outputs and every gradient are "
        "unchanged, and a NaN in a dropped row of ``x`` reaches nothing. Counting them is one host sync per head "
        "the call runs (the policy's, and the reference model's when given); nothing is gathered when none is "
        "ignored. False: every position through the matmuls, no sync."
    ),
}
MARK = "<shared>"
WIDTH = 116


def shared_arguments(function):
    """Fill ``function``'s docstring lines ``name: <shared>`` from :data:`SHARED` (a line may go on after the mark's
    line, four spaces deeper: it stays, after the shared text). Returns ``function``."""

    def fill(match: re.Match) -> str:
        indent, name = match.group(1), match.group(2)
        if name not in SHARED:
            raise KeyError(f"{function.__qualname__}: no shared description of {name!r} (known: {sorted(SHARED)})")
        return textwrap.fill(f"{name}: {SHARED[name]}", WIDTH, initial_indent=indent, subsequent_indent=indent + "    ")

    function.__doc__ = re.sub(rf"^( +)(\w+): {re.escape(MARK)}$", fill, function.__doc__, flags=re.M)
    return function
