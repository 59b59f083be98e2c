r"""The class-major route of the fused linear cross-entropy: the logits inside the weight gradient's buffer.

For a plain loss with a gradient in one chunk of ``N ≤ H`` rows (``dW`` in the inputs' dtype: the
published N = 4096 at H = 4096; the choice is
:func:`kernels_lib.fused_linear_cross_entropy._class_major_route_takes`),
forward's epilogue GEMM (:mod:`kernels_lib.chunks.epilogue`) writes the logits transposed into the
weight gradient's own buffer and gives the loss (:func:`_class_major_logits`); backward forms ``dz``
there in place with the upstream gradient in its factor (:mod:`kernels_lib.kernels.class_major_gradient`),
then ``dx`` and ``dW``, ``dW`` slab by slab over the logits already read (:func:`_class_major_gradients`).
Forward holds nothing the gradients would not hold anyway, so the work waits for backward. ``dW`` is
a view of the buffer, so ``weight.grad`` keeps the whole buffer alive: ``S·H`` elements beyond ``dW``
while ``N ≤ H`` (``S`` = :data:`CLASS_MAJOR_SLAB_ROWS`: 66 MiB at H = 4096 in bf16, 6.6% of ``dW``),
``V·(N - H) + S·H`` beyond it for ``N > H`` (why the route stops at ``H`` rows).

Up to ``H`` rows the logits take no memory of their own, so the peak of ``full`` is about the gradients'
alone, about half the chunked route's at the same time; with the gradients deferred to backward,
``forward`` with a gradient does the logits' work alone. Measured beside every peer in notebook 01.
"""

from __future__ import annotations

import torch

from ..chunks import triton_backend as backend
from ..chunks.epilogue import logits_with_loss
from ..chunks.matmuls import scaled_product_into
from ..chunks.operands import Operands
from .options import _Options


#: Rows of ``dW`` each matmul of the class-major route forms; its buffer holds as many rows beyond ``V``.
#: 8448 = 33 × 256: at H = 4096 a slab is 33 × 32 tiles of 256 × 128, 1056 = 8 × 132 (eight full waves on
#: a Hopper GPU's 132 SMs), a little faster than slabs of 8192 for 2 MB more of buffer (the stages study in
#: ``studies/``).
CLASS_MAJOR_SLAB_ROWS = 8448


def _class_major_logits(ops: "Operands", target, lse, loss, opts: _Options, *, exponentials: bool):
    r"""Forward of the class-major route: the logits inside the weight gradient's buffer, the loss.

    ``dW`` (``V × H``) will take the first ``V·H`` elements of a buffer of ``V·max(N, H) + S·H`` (``S`` =
    :data:`CLASS_MAJOR_SLAB_ROWS`; ``(V + S)·H`` while ``N ≤ H``); the epilogue GEMM writes the logits
    class-major, :math:`z^\top` (``V × N``), into its last ``V·N`` elements and gives each row's lse and target logit:
    ``lse`` and ``loss = lse - z_y`` (0 at ignored rows) are written (float32 ``(N,)``). With
    ``exponentials`` (:data:`~kernels_lib.fused_linear_cross_entropy.STORE_EXPONENTIALS`) the GEMM writes
    the shifted exponentials :math:`\tilde e^\top` there instead.
    Returns the buffer, the operand ``x`` in the matmul dtype and the rows' factors (or None), for
    :func:`_class_major_gradients`."""
    n_rows, hidden = ops.x.shape
    n_cols = ops.w.shape[0]
    x_c = ops.operand(slice(0, n_rows))
    storage = torch.empty(n_cols * max(n_rows, hidden) + min(CLASS_MAJOR_SLAB_ROWS, n_cols) * hidden,
                          dtype=ops.w.dtype, device=x_c.device)
    _, factors = logits_with_loss(_class_major_view(storage, n_cols, n_rows).t(), x_c, ops, target, lse, loss, opts,
                                  exponentials=exponentials)
    return storage, x_c, factors


def _class_major_view(storage: torch.Tensor, n_cols: int, n_rows: int) -> torch.Tensor:
    """The class-major logits :math:`z^\top` (``V × N``): the last ``V·N`` elements of ``storage``."""
    return storage[storage.numel() - n_cols * n_rows:].view(n_cols, n_rows)


def _class_major_gradients(storage, x_c, w, target, lse, factor, ignore_index: int, needs, dtypes, factors=None):
    r"""Backward of the class-major route: ``(dx, dW, db)`` from the logits :func:`_class_major_logits` left.

    :mod:`kernels_lib.kernels.class_major_gradient` turns :math:`z^\top` into :math:`dz^\top` in place,
    times ``factor`` (the reduction's, times the upstream gradient: one element); ``dx = dz W`` and
    ``db`` read it whole; then ``dW[v:v+S] = dz^T[v:v+S] x``, ``v = 0, S, 2S, …``, each written below
    the slabs still to be read (slab ``k`` ends at ``(v+S)·H``, the unread ones begin at
    ``T - (V-v)·N`` in a buffer of ``T`` elements: no overlap while ``(v+S)·H ≤ T - (V-v)·N`` for every
    ``v``, that is ``T ≥ V·max(N, H) + S·H``). While ``N ≤ H`` the logits take no memory of their own:
    peak memory is ``dW`` + ``S·H`` + ``dx``, against ``dW`` + ``N·V`` on the chunked route, at the same
    three matmuls; for ``N > H`` the buffer is the logits' ``V·N`` + ``S·H``, and ``dW`` reuses it.
    ``dW`` is the first ``V·H`` elements of ``storage``; ``db`` in ``dtypes[2]``.

    With ``factors`` (:func:`logits_with_loss`) the buffer holds the shifted exponentials
    :math:`\tilde e^\top` instead, and no kernel touches it: ``dz = diag(r) ẽ``, ``r = factor · factors``,
    so ``dx = diag(r) (ẽ W)``, ``db = ẽᵀ r`` and the slabs read ``diag(r) x``."""
    n_rows, hidden = x_c.shape
    n_cols = w.shape[0]
    z_t = _class_major_view(storage, n_cols, n_rows)
    need_x, _, need_b = needs
    if factors is None:
        backend.launch_class_major_gradient(z_t, lse, target, factor, ignore_index)
        operand = x_c
    else:
        operand = backend.launch_scale_rows(x_c, factors, factor)
    dx = None
    if need_x and factors is None:
        dx = torch.mm(z_t.t(), w)
    elif need_x:
        dx = torch.empty((n_rows, hidden), dtype=w.dtype, device=w.device)
        scaled_product_into(dx, z_t.t(), w, factors, factor)
    db = None
    if need_b:
        db = z_t.sum(1, dtype=torch.float32) if factors is None else torch.mv(z_t, (factors * factor).to(z_t.dtype))
        db = db.to(dtypes[2])
    dw = storage[: n_cols * hidden].view(n_cols, hidden)
    slab = min(CLASS_MAJOR_SLAB_ROWS, n_cols)
    for start in range(0, n_cols, slab):
        torch.mm(z_t[start:start + slab], operand, out=dw[start:start + slab])
    return dx, dw, db
