"""The operands of the fused linear cross-entropy: the inputs cast once, the chunks, the logits buffer.

:class:`Operands` rounds ``W`` and ``b`` to the head's dtype once per call (the autocast dtype for
float32 inputs, then float32 when interpreted), each chunk of ``x`` as it comes, picks the chunk size
(:mod:`kernels_lib.chunks.chunk_size`) and allocates the one ``chunk_size × V`` logits buffer every
chunk reuses, at the first chunk (a route that forms no chunks, the class-major one, allocates none).
Its memory is that buffer and the cast copies of ``W`` and ``b`` where the dtype changes.
"""

from __future__ import annotations

import torch

from .chunk_size import default_chunk_size, free_device_bytes
from .matmuls import logits_chunk, matmul_dtype


def chunk_slices(n_rows: int, chunk_size: int):
    return (slice(start, min(start + chunk_size, n_rows)) for start in range(0, n_rows, chunk_size))


class Operands:
    """The inputs cast once to the matmul dtype, the chunking, and the reused logits buffer.

    ``compute_dtype`` (default: x's) is the dtype the head runs in, e.g. the autocast dtype for
    float32 inputs: the operands are rounded to it (then held in float32 when interpreted, where
    the matmuls run in float32). ``pre`` multiplies the logits as they are formed."""

    def __init__(self, x, weight, bias, chunk_size: int | None, compute_dtype: torch.dtype | None = None, pre: float = 1.0):
        self.compute_dtype = compute_dtype or x.dtype
        dtype = matmul_dtype(self.compute_dtype)
        self.x, self.w = x, weight.to(self.compute_dtype).to(dtype)
        self.b = bias.to(self.compute_dtype).to(dtype) if bias is not None else None
        self.pre = pre
        n_rows, n_cols = x.shape[0], weight.shape[0]
        #: The device's free bytes, queried once where the default chunk depends on them (else None).
        self.free_bytes = free_device_bytes(x.device) if chunk_size is None else None
        if chunk_size is None:
            chunk_size = default_chunk_size(n_rows, x.shape[1], n_cols, dtype.itemsize, self.free_bytes)
        self.chunk_size = min(chunk_size, n_rows)
        self.buffer = None  # allocated by the first chunks(): a route that forms no chunks needs none

    def operand(self, rows: slice) -> torch.Tensor:
        """The rows ``rows`` of ``x`` in the matmul dtype."""
        return self.x[rows].to(self.compute_dtype).to(self.w.dtype)

    def chunks(self, slices=None):
        """Yield ``(rows, x_c, buffer_c)`` chunk by chunk: the chunk's operand and its rows of the reused
        ``chunk_size × V`` buffer, the logits not yet formed. ``slices``: the chunks' rows, each at most
        ``chunk_size`` long (default: consecutive ``chunk_size`` rows)."""
        if self.buffer is None:
            self.buffer = torch.empty((self.chunk_size, self.w.shape[0]), dtype=self.w.dtype, device=self.x.device)
        for rows in chunk_slices(self.x.shape[0], self.chunk_size) if slices is None else slices:
            x_c = self.operand(rows)
            yield rows, x_c, self.buffer[: x_c.shape[0]]

    def __iter__(self):
        """Yield ``(rows, x_c, logits_c)`` chunk by chunk, the logits formed by cuBLAS into the buffer."""
        for rows, x_c, buffer in self.chunks():
            yield rows, x_c, logits_chunk(buffer, x_c, self.w, self.b, self.pre)
