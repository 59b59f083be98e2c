"""The gradient sums of the fused linear cross-entropy: ``dx`` per chunk, ``dW`` and ``db`` over the chunks.

:class:`GradientSums` takes each chunk's ``dz`` (or its stored exponentials and row factors) and adds
its three products: ``dx_c = dz W``, ``dW += dz^T x_c``, ``db += Σ dz``, the first chunk writing
rather than adding (no zeroing pass). :func:`scaled_to_dtypes` hands gradients formed in forward out
of backward, times ``grad_output`` read on the device. The chunked route, the distillation and the
sequence losses (:mod:`kernels_lib._distillation`, :mod:`kernels_lib._sequence_logprobs`) share it.

``accurate=False`` (the default) accumulates ``dW`` and ``db`` across chunks in the parameter dtype,
as the memory-lean peers do: cuBLAS adds each chunk's float32 product into the bf16/fp16 running
sum, one rounding per chunk. ``accurate=True`` accumulates in float32 and rounds once at the end,
at the price of a ``V × H`` float32 buffer (2.1 GB for a Llama-3 head, +2 GB of peak memory). With
float32 accumulation dW's error against float64 is the baseline's own; in the parameter dtype it is a
little larger, for much less memory, hence the default (notebook 01, section 4, measures both). The error
grows slowly with the number of chunks; take
``accurate=True`` for very long batches or when loss curves must match a float32-accumulating
baseline. With float32 parameters the two modes are the same.

float16: its gradients would underflow. A token's ``dz = g·(p - δ)`` with ``g = 1/n_valid`` and
``p ≈ 1/V`` is ~2e-9 at N = 4096, V = 128256: below float16's smallest subnormal (6e-8), so it
would round to 0 in the float16 buffer, and a GradScaler could not help, since the gradient is
formed in forward, before ``grad_output`` (the loss scale) is known. So for float16 inputs the
kernel writes ``dz`` at a power-of-two scale ``S`` that brings the largest ``|g|`` to [1, 2)
(``mean``: the scale of ``sum``), the matmuls take that scaled ``dz``, and ``1/S`` is applied in
float32 (``alpha`` of the ``dW`` accumulation, a multiply of each ``dx`` chunk); ``dx``, ``dW``
and ``db`` are then held in float32 until backward has multiplied them by ``grad_output``, and
rounded to float16 last. Cost, float16 only: ``dW``/``db`` accumulate in float32 whatever
``accurate`` says, and ``dx`` is a float32 buffer (+2 bytes per element of ``x`` and ``W``).
bfloat16 has float32's exponent range and needs none of this.
"""

from __future__ import annotations

import math

import torch

from . import triton_backend as backend
from .matmuls import addmm_into, matmul_into, scaled_product_into


def unit_scale(peak: float) -> float:
    """The power of two ``S`` with ``S · peak`` in [1, 2) (1 when ``peak`` is 0 or not finite, so
    that NaN and inf pass through unscaled): float16's ``dz`` is formed at that scale."""
    if not math.isfinite(peak) or peak <= 0.0:
        return 1.0
    return 2.0 ** -math.floor(math.log2(peak))


class GradientSums:
    """``dx`` per chunk, ``dW`` and ``db`` summed over chunks, from each chunk's ``dz`` (the first chunk
    writes them, the others add: every row lies in exactly one chunk, so at least one chunk comes).

    ``dW``/``db`` accumulate in float32 when ``accurate`` (rounded to the parameter dtype once, in
    :meth:`result`), else in the parameter dtype. For float16 inputs (``wide``) each chunk's ``dz``
    comes at a power-of-two scale that :meth:`add_chunk` undoes in float32 (``unscale``), and
    ``dx``, ``dW``, ``db`` stay float32 in :meth:`result`: the caller rounds them with
    :func:`to_dtypes` after applying ``grad_output`` (see the module's note on float16).
    """

    def __init__(self, x, weight, bias, needs, accurate: bool, compute_dtype: torch.dtype | None = None):
        need_x, need_w, need_b = needs
        self.wide = (compute_dtype or x.dtype) == torch.float16
        self.first = True  # the first chunk writes dW and db (no zeroing pass, no read of zeros)

        def accumulator(param):
            wide = accurate or self.wide
            return torch.empty(param.shape, dtype=torch.float32 if wide else param.dtype, device=param.device)

        self.dx = torch.empty(x.shape, dtype=torch.float32 if self.wide else x.dtype, device=x.device) if need_x else None
        self.dw = accumulator(weight) if need_w else None
        self.db = accumulator(bias) if need_b else None
        self.dtypes = (weight.dtype, bias.dtype if bias is not None else None)

    def dz_unscale(self, peak) -> float:
        """The ``unscale`` of :meth:`add_chunk` for gradient factors whose largest magnitude is
        ``peak()`` (a function, called only for float16 inputs, where reading it may cost a host
        sync): ``1 / unit_scale(peak())`` for float16, 1 otherwise."""
        return 1.0 / unit_scale(float(peak())) if self.wide else 1.0

    def add_chunk(self, dz: torch.Tensor, x_c: torch.Tensor, w: torch.Tensor, rows: slice, unscale: float = 1.0) -> None:
        """Add the contribution of one chunk whose buffer holds ``dz / unscale``:
        ``dx[rows] = unscale · dz W``, ``dW += unscale · dzᵀ x_c``, ``db += unscale · Σ dz``."""
        if self.dx is not None:
            matmul_into(self.dx[rows], dz, w)
            if unscale != 1.0:
                self.dx[rows].mul_(unscale)
        if self.dw is not None:
            addmm_into(self.dw, dz.t(), x_c, max_temp_numel=dz.numel(), alpha=unscale, first=self.first)
        if self.db is not None:
            column_sums = dz.sum(0, dtype=torch.float32)
            if self.first:
                self.db.copy_(column_sums.mul_(unscale))
            else:
                self.db.add_(column_sums, alpha=unscale)
        self.first = False

    def add_exponentials(self, e: torch.Tensor, factors: torch.Tensor, scale: torch.Tensor, x_c: torch.Tensor,
                         w: torch.Tensor, rows: slice) -> None:
        """Add the contribution of one chunk whose buffer holds the shifted exponentials ``ẽ``, with
        ``dz = diag(r) ẽ``, ``r = scale · factors`` (:func:`~kernels_lib.chunks.epilogue.logits_with_loss`):
        ``dx[rows] = diag(r) (ẽ W)``, ``dW += ẽᵀ (diag(r) x_c)``, ``db += ẽᵀ r``; the factors never touch
        the ``N × V`` buffer."""
        if self.dx is not None:
            scaled_product_into(self.dx[rows], e, w, factors, scale)
        if self.dw is not None:
            addmm_into(self.dw, e.t(), backend.launch_scale_rows(x_c, factors, scale), max_temp_numel=e.numel(),
                       first=self.first)
        if self.db is not None:
            addmm_into(self.db.view(1, -1), (factors * scale).to(e.dtype).view(1, -1), e, max_temp_numel=e.numel(),
                       first=self.first)
        self.first = False

    def result(self):
        """``(dx, dW, db)``: in the inputs' dtypes, or float32 when ``wide``."""
        if self.wide:
            return self.dx, self.dw, self.db
        dw = None if self.dw is None else self.dw.to(self.dtypes[0])
        db = None if self.db is None else self.db.to(self.dtypes[1])
        return self.dx, dw, db


def to_dtypes(grads, dtypes):
    """Each gradient rounded to its input's dtype (``None`` stays ``None``)."""
    return tuple(None if g is None else g.to(d) for g, d in zip(grads, dtypes))


def scaled_to_dtypes(grads, grad_output: torch.Tensor, dtypes):
    """Gradients formed in forward, handed out by backward: each multiplied in place by ``grad_output``
    (read on the device, :mod:`kernels_lib.kernels.scale_gradient`: no host sync, nothing moves when
    it is 1), then rounded to its input's dtype (:func:`to_dtypes`)."""
    upstream = grad_output.to(torch.float32).contiguous()
    for grad in grads:
        if grad is not None:
            backend.launch_scale_gradient(grad, upstream)
    return to_dtypes(grads, dtypes)
