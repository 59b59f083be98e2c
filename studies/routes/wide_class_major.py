r"""The wide class-major chunk of the fused cross-entropy: one class-major chunk of ``H < N ≤ k·H`` rows.

The library's class-major route (:mod:`kernels_lib._flce.class_major`) takes a plain loss with a gradient
in one chunk of ``N ≤ H`` rows: forward writes the logits transposed into the weight gradient's own buffer
and defers the gradients to backward. With ``chunk_size`` left to the default, this study's predicate
(:func:`route_takes`) also gives it one chunk of up to ``k·H`` rows where the ``V × N`` logits fit the
default chunk's share of free memory
(:data:`~kernels_lib.chunks.chunk_size.DEFAULT_CHUNK_FREE_FRACTION`): the buffer then holds ``V·N + S·H``
elements instead of ``(V + S)·H``, and forward defers the gradients as at ``N ≤ H`` instead of forming
them chunk by chunk. The library's class-major code already sizes its buffer by ``max(N, H)``; only the
predicate differs.

Why it is not the default: ``dW`` is a view of that buffer, so ``weight.grad`` keeps all of it alive until
the optimizer clears it (at ``N = 2H`` twice the gradient's size, through the rest of a training step's
backward), and its peak is above the chunked route's and torch's ``F.linear_cross_entropy``'s. Its gain is
``forward`` with a gradient (the work waits for backward). The A/B:
``python -m studies.flce_frontier --parts wide_class_major``,
``data/measured/gpu_runs/fused_linear_cross_entropy_wide_class_major_ab.csv``; the runs' story in
``studies/LOG.md``.
"""

from __future__ import annotations

import importlib

import torch

from kernels_lib.chunks.chunk_size import within_free_share

#: The fused cross-entropy's module (the package's attribute of that name is the function).
FLCE = importlib.import_module("kernels_lib.fused_linear_cross_entropy")


def route_takes(rows_per_hidden: int):
    """The class-major predicate with chunks of up to ``rows_per_hidden · H`` rows under the default
    ``chunk_size`` (where the logits fit the default chunk's share of free memory), the library's
    otherwise: set it as ``kernels_lib.fused_linear_cross_entropy._class_major_route_takes`` for an arm."""

    def takes(ops, weight: torch.Tensor, needs, accurate: bool, chunk_size: int | None) -> bool:
        n_rows, hidden = ops.x.shape
        fits = n_rows <= min(ops.chunk_size, hidden)
        if not fits and chunk_size is None and hidden < n_rows <= rows_per_hidden * hidden:
            fits = within_free_share(n_rows, ops.w.shape[0], ops.w.element_size(), ops.free_bytes)
        return (needs[1] and fits and not accurate
                and ops.x.dtype == weight.dtype == ops.w.dtype != torch.float16
                and FLCE._epilogue_gemm_takes(ops.operand(slice(0, 1)), ops.w))

    takes.rows_per_hidden = rows_per_hidden
    return takes


def arm(rows_per_hidden: int = 2) -> dict:
    """The arm's settings for :func:`studies.bench.arms.constants_set`: the fused CE with the wide chunk."""
    return {FLCE.__name__: {"_class_major_route_takes": route_takes(rows_per_hidden)}}
