"""The epilogue stage of the fused linear cross-entropy: the logits GEMM that gives each row's lse as it goes.

For a plain loss (``lse - c_y``: no smoothing, z-loss, softcap, statistics or class weights; the
predicates are :mod:`kernels_lib.fused_linear_cross_entropy`'s) the Triton GEMM of
:mod:`kernels_lib.kernels.logits_logsumexp` forms each row's lse in its epilogue, from the logits as
stored, and the target's logit beside it:

* without a gradient (:func:`epilogue_loss`) that is the loss, and the logits never exist: no buffer,
  one pass over ``W``;
* for a gradient chunk (:func:`logits_with_loss`, Hopper, 16-bit operands TMA can take) the GEMM also
  stores the logits by TMA, and the chunk kernel runs its second pass alone: one read and one write of
  the chunk instead of two reads and a write, for a GEMM that does more than cuBLAS's logits product
  (the epilogue's exponentials and partial sums).
* With the stored exponentials (``STORE_EXPONENTIALS``, not float16) that pass goes too: the GEMM
  stores the shifted exponentials ``ẽ`` (:mod:`kernels_lib.kernels.shifted_exponentials`; shift: each
  row's target logit, formed before it), the merge of its lse partials subtracts the one-hot term and
  gives each row's factor ``u``, and ``dz = g·diag(u)·ẽ`` puts the factors on ``x_c`` (for ``dW``) and
  on ``dx``, ``N × H`` each, instead of on the ``N × V`` buffer: one pass over the logits fewer, for two
  ``N × H`` row scalings. The factors are applied by one Triton kernel
  (:func:`~kernels_lib.kernels.shifted_exponentials.launch_scale_rows`), which reads and writes each
  element once, where torch's mixed-dtype multiply makes float32 temporaries.

The chunked route (:mod:`kernels_lib._flce.chunked`) and the class-major one
(:mod:`kernels_lib._flce.class_major`) both form their logits here. Of the loss's options both functions
read only ``opts.ignore_index`` and ``opts.pre_scale`` (the factor on the logits), so any object with
those two attributes serves (the fused cross-entropy's options, or a study's): the stage does not
depend on the cross-entropy's option type.
"""

from __future__ import annotations

import torch

from . import triton_backend as backend
from .operands import Operands


def logits_with_loss(buffer, x_c, ops: "Operands", target_c, lse_c, loss_c, opts,
                     exponentials: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Form a chunk's logits into ``buffer`` with the epilogue GEMM, which gives each row's lse (copied
    into ``lse_c``) and target logit as it goes; ``loss_c = lse - c_y`` (0 at ignored rows). Returns
    ``(buffer, None)``; with ``exponentials`` the buffer holds the shifted exponentials ``ẽ`` instead
    (:mod:`kernels_lib.kernels.shifted_exponentials`), and the second element is each row's factor
    ``u_i = exp(c*_i - lse_i)`` (float32; 0 at ignored rows, NaN at targets outside ``[0, V)``), so
    that ``dz = g · diag(u) ẽ``."""
    factors = None
    if exponentials:  # the shift goes in, the row factors come out
        factors = backend.launch_target_logit_shift(x_c, ops.w, ops.b, target_c, ops.pre, opts.ignore_index)
    lse, target_logit = backend.launch_logits_logsumexp(x_c, ops.w, ops.b, target_c, alpha=ops.pre,
                                                        ignore_index=opts.ignore_index, logits_out=buffer,
                                                        shift=factors)
    lse_c.copy_(lse)
    loss_c.copy_(torch.where(target_c != opts.ignore_index, lse - target_logit, 0.0))
    return buffer, factors


def epilogue_loss(x, weight, bias, target, opts, compute_dtype) -> torch.Tensor:
    """Per row ``lse - c_y`` (0 at ignored rows), float32, from the logits GEMM's epilogue: no logits
    buffer, one pass over ``W``. The operands are rounded to ``compute_dtype`` first, as the matmul would."""
    x, weight = x.to(compute_dtype), weight.to(compute_dtype)
    bias = None if bias is None else bias.to(compute_dtype)
    lse, target_logit = backend.logits_logsumexp(x, weight, bias, target, alpha=opts.pre_scale,
                                                 ignore_index=opts.ignore_index)
    return torch.where(target != opts.ignore_index, lse - target_logit, 0.0)
