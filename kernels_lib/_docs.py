"""Argument descriptions shared by several losses, written once: a docstring line ``name: <shared>`` (or
``name: <shared:key>`` where losses share one argument's description under another key) is replaced by the
description of :data:`SHARED` at that line's indent (its continuation four spaces deeper)."""

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
    "paired_process_group": (
        "split the vocabulary over this ``torch.distributed`` group (or None with a DTensor ``weight``/``bias`` "
        "sharded ``(Shard(0),)`` over a 1-D mesh): ``weight`` ``(V_r, H)`` and ``bias`` ``(V_r,)`` are this rank's "
        "rows, in group-rank order, of any sizes; ``x``, the targets (global ids) and the options are the same on "
        "every rank, and so are the outputs. ``dx`` comes back complete on every rank, ``dW``/``db`` as the local "
        "slices. Every option works. Wire: once per call an all_gather of 13 int64 per rank (the checks over the "
        "ranks); per chunk and row 3 float32 (4 with ``nll_target``: the shards' lse max, sum-exp, the target's "
        "logit from its owner); once ``dx`` (``2n·T × H``)."
    ),
}
MARK = "<shared>"
WIDTH = 116


def shared_arguments(function):
    """Fill ``function``'s docstring lines ``name: <shared>`` from :data:`SHARED` (a line may go on after the mark's
    line, four spaces deeper: it stays, after the shared text). Returns ``function``."""

    def fill(match: re.Match) -> str:
        indent, name, key = match.group(1), match.group(2), match.group(3) or match.group(2)
        if key not in SHARED:
            raise KeyError(f"{function.__qualname__}: no shared description of {key!r} (known: {sorted(SHARED)})")
        return textwrap.fill(f"{name}: {SHARED[key]}", WIDTH, initial_indent=indent, subsequent_indent=indent + "    ")

    function.__doc__ = re.sub(r"^( +)(\w+): <shared(?::(\w+))?>$", fill, function.__doc__, flags=re.M)
    return function
