"""The GEMM helpers of the fused linear cross-entropy: the logits chunk, in-place products, mixed dtypes.

Every matmul of the routes goes through these: :func:`logits_chunk` forms ``pre · (x_c W^T + b)`` into
the reused buffer (the factor on the matmul's alpha/beta, no extra pass); :func:`matmul_into` and
:func:`addmm_into` write ``dx`` and accumulate ``dW``/``db`` in place, in the accumulator's dtype,
without a temporary where cuBLAS can read and write it directly (a float32 sum from half operands);
:func:`scaled_product_into` is the stored exponentials' ``dx``, ``diag(r) (ẽ W)`` rounded once, in
blocks of :data:`DX_BLOCK_ROWS` rows.

On a machine without CUDA the matmuls run in float32 (:func:`matmul_dtype`; the kernels then run in
Triton's interpreter); on CUDA they run in the input dtype with float32 accumulation inside cuBLAS.
"""

from __future__ import annotations

import torch

from .._runtime import INTERPRETED
from . import triton_backend as backend


def matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the logits chunk and of the matmuls: the input's on CUDA, float32 when interpreted."""
    return torch.float32 if INTERPRETED else dtype


def matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, written in place when the dtypes agree (else through a temporary)."""
    if out.dtype == a.dtype:
        torch.matmul(a, b, out=out)
    else:
        out.copy_(a @ b)


#: Rows of ``dx`` formed per float32 product on the stored-exponentials routes (:func:`scaled_product_into`):
#: at ``H = 4096`` a 16 MiB temporary, against ``N × H × 4`` bytes for the whole product at once. The
#: temporary is alive at ``full``'s peak (the chunk's exponentials, ``dx`` and ``dW`` beside it), so fewer
#: rows lower that peak, for more, smaller products; each product still has ``K = V`` and 1024 rows to
#: fill the GPU.
DX_BLOCK_ROWS = 1024


def scaled_product_into(out: torch.Tensor, e: torch.Tensor, w: torch.Tensor, factors: torch.Tensor,
                        scale: torch.Tensor) -> None:
    r"""``out = diag(factors · scale) (e W)``, rounded once to ``out``'s dtype: the stored exponentials'
    ``dx`` (:mod:`kernels_lib.kernels.shifted_exponentials`).

    On CUDA with 16-bit operands the product comes out of cuBLAS in float32 (``torch.mm(..., out_dtype=)``),
    ``DX_BLOCK_ROWS`` rows at a time, and the row factors are applied to it before the one rounding to
    ``out``'s dtype. Rounding ``e W`` to bfloat16 first and scaling after would round every element of
    ``dx`` twice, a larger error against float64 than the baseline's own. Elsewhere
    (float32 operands, the interpreter) the product is float32 already."""
    if out.dtype != torch.float32 and e.is_cuda:
        for start in range(0, e.shape[0], DX_BLOCK_ROWS):
            rows = slice(start, start + DX_BLOCK_ROWS)
            product = torch.mm(e[rows], w, out_dtype=torch.float32)
            backend.launch_scale_rows(product, factors[rows], scale, out=out[rows])
        return
    matmul_into(out, e, w)
    backend.launch_scale_rows(out, factors, scale, out=out)


def addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, max_temp_numel: int, alpha: float = 1.0,
               first: bool = False) -> None:
    """``acc += alpha · (a @ b)`` in ``acc``'s dtype; with ``first``, ``acc = alpha · (a @ b)`` (its old
    contents, uninitialized memory included, are not read: ``beta = 0``).

    In one ``addmm_`` when the dtypes agree, or on CUDA into a float32 ``acc`` from half operands
    (cuBLAS reads and writes the float32 sum directly: no temporary, no rounding of the product).
    Otherwise slice by slice of ``acc``'s rows, each product made in ``a``'s dtype (a temporary of
    at most ``max_temp_numel`` elements) and added once.
    """
    beta = 0.0 if first else 1.0
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=beta, alpha=alpha)
        return
    if acc.is_cuda and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, beta=beta, alpha=alpha, out=acc)
        return
    step = max(1, max_temp_numel // acc.shape[1])
    for start in range(0, acc.shape[0], step):
        product = a[start : start + step] @ b
        if first:
            acc[start : start + step].copy_(product.mul_(alpha))
        else:
            acc[start : start + step].add_(product, alpha=alpha)


def logits_chunk(buffer: torch.Tensor, x_c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, pre: float = 1.0):
    """``pre · (x_c W^T + b)`` written into the first ``len(x_c)`` rows of ``buffer`` (the factor
    rides on the matmul's alpha/beta: no extra pass); returns that view."""
    out = buffer[: x_c.shape[0]]
    if b is None and pre == 1.0:
        torch.matmul(x_c, w.t(), out=out)
    elif b is None:
        out.addmm_(x_c, w.t(), beta=0.0, alpha=pre)  # beta = 0: out's old contents are ignored, NaN too
    else:
        torch.addmm(b, x_c, w.t(), beta=pre, alpha=pre, out=out)
    return out
