"""Rows per chunk of the fused linear cross-entropy: the default (time first) and the lean one (memory first).

The default chunk (:func:`default_chunk_size`) holds ``H`` rows, at least 2048 and at most 8192,
growing to ``N / 32`` rows for long batches, and halved while its logits buffer would exceed a quarter
of the device's free memory. Each chunk's ``dW += dz^T x_c`` reads and writes the whole ``V × H``
accumulator once: ``4·V·H`` bytes against ``2·c·V·H`` FLOPs, ``c / 2`` FLOPs per byte, so small chunks
make that pass, not the matmuls, the cost (of the order of ``100 / c`` of a chunk's three matmuls on a
GPU that runs ``dW``'s read and write at its memory bandwidth); with ``H`` rows the logits buffer is the
size of ``dW`` itself, so forward + backward hold at most twice the gradients. ``chunk_size`` is the dial:
past ``H`` rows time hardly falls while memory keeps growing (every point of the dial beside the peers:
notebook 01). The
memory-lean budget, ``H / 8`` rows, is :func:`lean_chunk_size`: the two-head losses take it or 2048 rows, whichever
is more (``kernels_lib._distillation.two_head_chunk_size``); the sequence losses take ``H / 2`` rows, at least 1024
(``kernels_lib._sequence_logprobs.chunk_rows``).

The choice costs one query of the device's free memory per call (:func:`free_device_bytes`), made only
when ``chunk_size`` is left to the default.
"""

from __future__ import annotations

import torch


#: The lean chunk's logits are this fraction of the weight gradient: ``H // 8`` rows (:func:`lean_chunk_size`).
LEAN_CHUNK_FRACTION = 8
#: The fewest rows of a lean chunk.
MIN_LEAN_CHUNK_ROWS = 256
#: The fewest rows of a default chunk: the ``dW`` pass then costs about 5% of the chunk's matmuls.
MIN_DEFAULT_CHUNK_ROWS = 2048
#: The most rows of a default chunk (2.1 GB of bf16 logits at ``V = 128256``): past it the ``dW`` pass is a
#: small part of the chunk's matmuls, so more rows buy memory use and little time.
MAX_DEFAULT_CHUNK_ROWS = 8192
#: A default chunk's logits buffer takes at most this fraction of the device memory free at the call.
DEFAULT_CHUNK_FREE_FRACTION = 0.25


def default_chunk_size(n_rows: int, hidden: int, n_cols: int | None = None, itemsize: int = 2,
                       free_bytes: int | None = None) -> int:
    """Rows per chunk of :func:`fused_linear_cross_entropy`: ``max(H, N / 32)`` within
    [:data:`MIN_DEFAULT_CHUNK_ROWS`, :data:`MAX_DEFAULT_CHUNK_ROWS`], rounded down to a multiple of
    128 (matmul tiles); halved while its ``rows × n_cols`` buffer of ``itemsize``-byte logits would
    exceed :data:`DEFAULT_CHUNK_FREE_FRACTION` of ``free_bytes`` (when both are given); at most ``n_rows``."""
    rows = min(MAX_DEFAULT_CHUNK_ROWS, max(MIN_DEFAULT_CHUNK_ROWS, hidden, n_rows // 32)) // 128 * 128
    if n_cols is not None:
        while rows > 128 and not within_free_share(rows, n_cols, itemsize, free_bytes):
            rows = max(128, rows // 2 // 128 * 128)
    return max(1, min(n_rows, rows))


def within_free_share(rows: int, n_cols: int, itemsize: int, free_bytes: int | None) -> bool:
    """Whether a ``rows × n_cols`` logits buffer of ``itemsize``-byte elements stays within
    :data:`DEFAULT_CHUNK_FREE_FRACTION` of ``free_bytes`` (always, when that is unknown: None)."""
    return free_bytes is None or rows * n_cols * itemsize <= DEFAULT_CHUNK_FREE_FRACTION * free_bytes


def lean_chunk_size(n_rows: int, hidden: int) -> int:
    """Rows per chunk where memory comes first: ``hidden // 8`` (the logits chunk is an eighth of the
    weight gradient), at least :data:`MIN_LEAN_CHUNK_ROWS`, rounded down to a multiple of 128, at most
    ``n_rows``. The default of the losses with a second head or a reference model."""
    rows = max(MIN_LEAN_CHUNK_ROWS, hidden // LEAN_CHUNK_FRACTION)
    rows -= rows % 128
    return max(1, min(n_rows, rows))


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes a new buffer can take on ``device``: the driver's free memory plus what torch's caching
    allocator holds unused; None off CUDA (no limit is applied there)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
