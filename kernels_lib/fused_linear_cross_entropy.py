r"""Fused linear + cross-entropy: the LM-head loss without the ``N × V`` logits.

.. math::

    z = x W^\top + b, \qquad c = s \tanh(z / s)\ \text{(softcap, optional)}, \qquad
    \mathrm{lse}_i = \log \textstyle\sum_j e^{c_{ij}},

    \ell_i = (1-\varepsilon)(\mathrm{lse}_i - c_{i,y_i})
             + \varepsilon\,(\mathrm{lse}_i - \tfrac1V \textstyle\sum_j c_{ij})
             + \lambda\,\mathrm{lse}_i^2
    \quad\text{for valid rows } (y_i \ne \text{ignore\_index}),\ 0 \text{ otherwise},

reduced by ``mean`` (over the valid rows), ``sum`` or ``none``. With :math:`\varepsilon = \lambda = 0`
and no softcap this is ``F.cross_entropy(x @ W.T + b, y)``; with them it is torch's label smoothing,
the z-loss of PaLM, and Gemma 2's logit softcap. The gradient with respect to the logits is

.. math::

    \frac{\partial \ell_i}{\partial z_{ij}} = \Big(p_{ij}(1 + 2\lambda\,\mathrm{lse}_i)
        - (1-\varepsilon)\delta_{j y_i} - \tfrac{\varepsilon}{V}\Big)\big(1 - (c_{ij}/s)^2\big),
    \qquad dx = dz\,W, \quad dW = dz^\top x, \quad db = \textstyle\sum_i dz_i .

Design
------
Rows are processed in chunks of ``chunk_size``. Per chunk: the logits ``x_c W^T + b`` are formed by
one matmul into a reused ``chunk_size × V`` buffer; one Triton kernel
(:mod:`kernels_lib.kernels.cross_entropy_chunk`) computes each row's lse and loss and, when a
gradient is needed, overwrites the buffer in place with ``dz`` already multiplied by the reduction
factor; then ``dx_c = dz W`` (written into ``dx``), ``dW += dz^T x_c`` and ``db += Σ dz``.

* The epilogue route (Hopper, 16-bit operands TMA can take, a plain ``mean``/``sum`` with a
  gradient: no smoothing, z-loss, softcap, statistics or class weights): the chunk's logits come from
  the Triton GEMM of :mod:`kernels_lib.kernels.logits_logsumexp`, which forms each row's lse in its
  epilogue (from the logits as stored) and stores the logits by TMA; the kernel then runs its second
  pass alone, one read and one write of the chunk instead of two reads and a write. On the H200 a
  4096-row chunk took 6.49 + 0.57 ms this way against 6.35 + 0.95 ms for cuBLAS's logits and the
  two passes (``..._frontier_stages.csv``). With :data:`STORE_EXPONENTIALS` (not float16) that pass
  goes too: the GEMM stores the shifted exponentials ``ẽ`` (:mod:`kernels_lib.kernels.shifted_exponentials`;
  shift: each row's target logit, formed before it), the merge of its lse partials subtracts the
  one-hot term and gives each row's factor ``u``, and ``dz = g·diag(u)·ẽ`` puts the factors on
  ``x_c`` (for ``dW``) and on ``dx``, ``N × H`` each, instead of on the ``N × V`` buffer: one pass over
  the logits fewer, for ``full`` 0.99–1.00× the logits route's time at N = 4096 / 8192 / 16384 on the
  H200 (``scripts/flce_frontier.py --parts exponentials``,
  ``gpu_runs/fused_linear_cross_entropy_exponentials_ab.csv``). The factors are applied by one Triton
  kernel (:func:`~kernels_lib.kernels.shifted_exponentials.launch_scale_rows`), not torch's mixed-dtype
  multiplies, which cost five times as long in the profiles (``..._frontier_profile.csv``).
* The class-major route (the same plain loss, one chunk of ``N ≤ H`` rows, or with the default
  ``chunk_size`` of ``N ≤ 2H`` whose logits fit in memory, :data:`CLASS_MAJOR_ROWS_PER_HIDDEN`; ``dW`` in
  the inputs' dtype: the published N = 4096 and 8192 at H = 4096): forward's epilogue GEMM writes the logits
  transposed into the weight gradient's own buffer and gives the loss (:func:`_class_major_logits`);
  backward forms ``dz`` there in place with the upstream gradient in its factor
  (:mod:`kernels_lib.kernels.class_major_gradient`), then ``dx`` and ``dW``, ``dW`` slab by slab over
  the logits already read (:func:`_class_major_gradients`). Forward holds nothing the gradients
  would not hold anyway, so the work waits for backward. Up to ``H`` rows the logits take no memory of their own:
  on the H200 at N = 4096 (bf16, H = 4096, V = 128256) this route about halves the peak of ``full``
  (about 1.1 GB against 2.1 GB for the chunked route, QuACK's about 2.0 GB) at the same time, and with
  the gradients deferred to backward ``forward`` with a gradient takes about 0.7× torch's
  (``scripts/flce_frontier.py --parts frontier``, ``gpu_runs/fused_linear_cross_entropy_frontier.csv``,
  which keeps each measurement with its commit; ``data/measured/README.md`` tells them in order).
* ``mean``/``sum`` (the class-major route apart): the gradient is known in forward, so all of the
  above happens there (three matmuls, the floor); backward only multiplies them in place by ``grad_output``, read on the device
  (no host sync; no pass at all when it is 1), and hands the buffers out: a second backward through
  a retained graph is refused.
* ``none``: the upstream gradient is per row and arrives only in backward, so forward keeps just
  ``lse`` (4 bytes a row) and backward recomputes each logits chunk (a fourth matmul), running the
  kernel without its first pass.
* Without a gradient (``torch.no_grad()`` or no input requiring grad) only the loss is computed.

The default chunk (:func:`default_chunk_size`) holds ``H`` rows, at least 2048 and at most 8192,
growing to ``N / 32`` rows for long batches, and halved while its logits buffer would exceed a quarter
of the device's free memory. Each chunk's ``dW += dz^T x_c`` reads and writes the whole ``V × H``
accumulator once: ``4·V·H`` bytes against ``2·c·V·H`` FLOPs, ``c / 2`` FLOPs per byte, so small chunks
make that pass, not the matmuls, the cost (about ``105 / c`` of a chunk's three matmuls on an H200);
with ``H`` rows the logits buffer is the size of ``dW`` itself, so forward + backward hold at most
twice the gradients. ``chunk_size`` is the dial. On an H200 at N = 8192, H = 4096, V = 128256, bf16
(``data/measured/gpu_runs/fused_linear_cross_entropy_frontier.csv``, ``full``, one run): 512 rows take
43.5 ms at 1193 MiB (Liger's Triton kernel: 54.1 ms, 1129 MiB), 2048 rows 38.4 ms at 1575 MiB, 4096 rows
(this default) 38.2 ms at 2084 MiB, 8192 rows 37.9 ms at 3102 MiB (QuACK's chunked loss in the same run:
38.2 ms at 4072 MiB): past ``H`` rows time hardly falls while memory keeps growing. The
memory-lean point of earlier versions, ``H / 8`` rows, is :func:`lean_chunk_size`: the fused losses
with a second head or a reference model keep it (their memory is judged against Liger's).

``accurate=False`` (the default) accumulates ``dW`` and ``db`` across chunks in the parameter dtype,
as the memory-lean peers do: cuBLAS adds each chunk's float32 product into the bf16/fp16 running
sum, one rounding per chunk. ``accurate=True`` accumulates in float32 and rounds once at the end,
at the price of a ``V × H`` float32 buffer (2.1 GB for a Llama-3 head, +2 GB of peak memory). On
the H200 at the size above, dW's error against float64 is 1.12e-3 accurate (the baseline's own)
and 1.33e-3 lean with 16 chunks, 1.35e-3 with 32 (``..._precision.csv``): 20% more error for 60%
less memory, hence the default. The error grows slowly with the number of chunks; take
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

On a machine without CUDA the matmuls run in float32 (the kernels then run in Triton's
interpreter); on CUDA they run in the input dtype with float32 accumulation inside cuBLAS.

For training (the Hugging Face drop-in, :mod:`kernels_lib.hf`, stands on these): torch's per-class
``class_weight``; ``num_items_in_batch``, the denominator of ``mean`` that gradient accumulation
needs (a count over micro-batches or ranks; a tensor is read on the device, no host sync);
``logit_scale`` and ``temperature`` (``c = softcap_s(a·z)/T`` = ``softcap_{s/T}((a/T)·z)``: the factor
rides on the logits matmul's alpha, the cap is divided by ``T``, and the gradient takes ``a/T``
once more, so the kernel is unchanged); ``return_token_stats`` for the per-token entropy and top-1
hit, read in the same pass as the log-sum-exp; and ``torch.autocast``, whose dtype the matmuls take.

Vocabulary-parallel (``process_group``, or a DTensor ``weight`` sharded on dim 0): each rank holds
rows ``[o_r, o_r + V_r)`` of ``W`` and ``b``, of any sizes (:mod:`kernels_lib._vocab_parallel`). Per
chunk, pass 1 of the kernel writes this rank's partial sums (row max :math:`m_r`, :math:`\log s_r`,
the target's capped logit where this rank owns it, :math:`\sum_j w_j c_j`, and for the token stats
:math:`\sum_j c_j` and the entropy's sums); they are merged over the ranks
(:math:`\mathrm{lse} = M + \log \sum_r s_r e^{m_r - M}`, :math:`M = \max_r m_r`; the target's logit
from its owner; the smoothing term's sum of the logits, the z-loss of the merged lse: all exact);
the loss follows from the merged values, and pass 2 writes this rank's ``dz`` with the global lse.
``dW``/``db`` stay local; ``dx = Σ_r dz_r W_r`` is one all-reduce per call. On the wire per row and
chunk: 1 float (all-reduce MAX) and 2 (SUM), +1 with label smoothing, +3 with token stats; per call
``dx`` (``N × H``) and the 13-int64 check of :func:`~kernels_lib._vocab_parallel.establish`.
Without a process group nothing of this runs: the same kernel launches as before, no extra pass.

Deterministic: the same inputs give bitwise the same loss and gradients run to run (no atomics;
fixed reduction orders). Measured on an H200 at the published sizes, three runs each:
``data/measured/gpu_runs/determinism.csv``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import _validate as v
from . import _vocab_parallel as vp
from ._autocast import compute_dtype_for
from ._target_totals import target_totals
from ._runtime import INTERPRETED
from .kernels.class_major_gradient import launch_class_major_gradient
from .kernels.cross_entropy_chunk import PARTIAL_COLUMNS, launch_cross_entropy_chunk, launch_cross_entropy_partials
from .kernels.logits_logsumexp import launch_logits_logsumexp, logits_logsumexp, tma_unsupported_reason
from .kernels.scale_gradient import launch_scale_gradient
from .kernels.shifted_exponentials import launch_scale_rows, launch_target_logit_shift

REDUCTIONS = ("mean", "sum", "none")

#: The lean chunk's logits are this fraction of the weight gradient: ``H // 8`` rows (:func:`lean_chunk_size`).
LEAN_CHUNK_FRACTION = 8
#: The fewest rows of a lean chunk.
MIN_LEAN_CHUNK_ROWS = 256
#: The fewest rows of a default chunk: the ``dW`` pass then costs about 5% of the chunk's matmuls.
MIN_DEFAULT_CHUNK_ROWS = 2048
#: The most rows of a default chunk (2.1 GB of bf16 logits at ``V = 128256``): on the H200, 8192-row
#: chunks were no faster than 4096 at N = 8192 and 1% faster than 2048 at 262144 tokens per step.
MAX_DEFAULT_CHUNK_ROWS = 8192
#: A default chunk's logits buffer takes at most this fraction of the device memory free at the call.
DEFAULT_CHUNK_FREE_FRACTION = 0.25
#: In Triton's interpreter the epilogue GEMM is a Python loop over tiles, ten times the rest of a test's
#: time: the gradient chunks take it there only when this is True (the tests of that route set it).
EPILOGUE_GEMM_WHEN_INTERPRETED = False
#: The epilogue GEMM of a gradient chunk stores shifted exponentials instead of the logits
#: (:mod:`kernels_lib.kernels.shifted_exponentials`): each row's factor then goes on the matmuls'
#: ``N × H`` side, and no pass reads the ``N × V`` buffer between the GEMM and the matmuls. Not for
#: float16, whose range cannot hold them (its route keeps the logits and the kernel's pass 2); False
#: gives every dtype that route (the A/B of ``scripts/flce_frontier.py --parts exponentials``).
STORE_EXPONENTIALS = True


@dataclass(frozen=True)
class _Options:
    """The non-tensor arguments, as given by the user after validation."""

    ignore_index: int
    reduction: str
    label_smoothing: float
    z_loss_scale: float
    softcap: float | None
    chunk_size: int | None
    accurate: bool
    logit_scale: float = 1.0
    temperature: float = 1.0
    with_stats: bool = False
    host_checks: bool = True

    @property
    def pre_scale(self) -> float:
        """The factor ``logit_scale / temperature`` the raw logits are multiplied by as they are formed:
        ``softcap_s(a·z) / T = softcap_{s/T}((a/T)·z)``, so the kernel sees the scaled logits and the
        cap ``s / T``, and the gradient with respect to the raw logits takes this factor once more."""
        return self.logit_scale / self.temperature

    def kernel_args(self, class_weight=None, weight_sum=None) -> dict:
        return dict(
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            z_loss_scale=self.z_loss_scale,
            softcap=None if self.softcap is None else self.softcap / self.temperature,
            class_weight=class_weight,
            weight_sum=weight_sum,
        )


class CrossEntropyOutput(NamedTuple):
    r"""What :func:`fused_linear_cross_entropy` returns with ``return_token_stats=True``.

    ``loss`` and ``z_loss`` as without it (reduced, or per token with ``reduction="none"``). Per
    token, the target's shape, 0 (False) at ignored tokens, of each token's (scaled, capped)
    distribution :math:`p = \mathrm{softmax}(c)`:

    * ``entropy``: :math:`H_i = \mathrm{lse}_i - \sum_j p_{ij} c_{ij}`, float32; it carries a gradient
      with ``reduction="none"`` (:math:`\partial H/\partial c_j = -p_j(\log p_j + H)`, added in the
      backward pass that recomputes the logits), none with ``mean``/``sum`` (their gradients are
      formed in forward, before any use of the entropy is known);
    * ``is_top1``: bool, whether the target's logit is the row's largest (ties count as hits; token
      accuracy is ``is_top1.sum() / n_valid``);
    * ``mean_logit``: :math:`\frac1V \sum_j c_{ij}`, float32, no gradient;
    * ``log_sum_sq_prob``: :math:`\log \sum_j p_{ij}^2`, float32, no gradient.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor
    entropy: torch.Tensor
    is_top1: torch.Tensor
    mean_logit: torch.Tensor
    log_sum_sq_prob: torch.Tensor


def matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the logits chunk and of the matmuls: the input's on CUDA, float32 when interpreted."""
    return torch.float32 if INTERPRETED else dtype


def default_chunk_size(n_rows: int, hidden: int, n_cols: int | None = None, itemsize: int = 2,
                       free_bytes: int | None = None) -> int:
    """Rows per chunk of :func:`fused_linear_cross_entropy`: ``max(H, N / 32)`` within
    [:data:`MIN_DEFAULT_CHUNK_ROWS`, :data:`MAX_DEFAULT_CHUNK_ROWS`], rounded down to a multiple of
    128 (matmul tiles); halved while its ``rows × n_cols`` buffer of ``itemsize``-byte logits would
    exceed :data:`DEFAULT_CHUNK_FREE_FRACTION` of ``free_bytes`` (when both are given); at most ``n_rows``."""
    rows = min(MAX_DEFAULT_CHUNK_ROWS, max(MIN_DEFAULT_CHUNK_ROWS, hidden, n_rows // 32)) // 128 * 128
    if n_cols is not None:
        while rows > 128 and not _within_free_share(rows, n_cols, itemsize, free_bytes):
            rows = max(128, rows // 2 // 128 * 128)
    return max(1, min(n_rows, rows))


def _within_free_share(rows: int, n_cols: int, itemsize: int, free_bytes: int | None) -> bool:
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


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, written in place when the dtypes agree (else through a temporary)."""
    if out.dtype == a.dtype:
        torch.matmul(a, b, out=out)
    else:
        out.copy_(a @ b)


#: Rows of ``dx`` formed per float32 product on the stored-exponentials routes (:func:`_scaled_product_into`):
#: at ``H = 4096`` a 32 MiB temporary, against ``N × H × 4`` bytes for the whole product at once.
DX_BLOCK_ROWS = 2048


def _scaled_product_into(out: torch.Tensor, e: torch.Tensor, w: torch.Tensor, factors: torch.Tensor,
                         scale: torch.Tensor) -> None:
    r"""``out = diag(factors · scale) (e W)``, rounded once to ``out``'s dtype: the stored exponentials'
    ``dx`` (:mod:`kernels_lib.kernels.shifted_exponentials`).

    On CUDA with 16-bit operands the product comes out of cuBLAS in float32 (``torch.mm(..., out_dtype=)``),
    ``DX_BLOCK_ROWS`` rows at a time, and the row factors are applied to it before the one rounding to
    ``out``'s dtype. Rounding ``e W`` to bfloat16 first and scaling after would round every element of
    ``dx`` twice: on the H200 that route's bf16 ``dx`` had 1.7× the baseline's own error against float64
    at N = 16384, H = 4096, V = 128256 (``data/measured/gpu_runs/gpu_route_errors.csv``). Elsewhere
    (float32 operands, the interpreter) the product is float32 already."""
    if out.dtype != torch.float32 and e.is_cuda:
        for start in range(0, e.shape[0], DX_BLOCK_ROWS):
            rows = slice(start, start + DX_BLOCK_ROWS)
            product = torch.mm(e[rows], w, out_dtype=torch.float32)
            launch_scale_rows(product, factors[rows], scale, out=out[rows])
        return
    _matmul_into(out, e, w)
    launch_scale_rows(out, factors, scale, out=out)


def _addmm_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, max_temp_numel: int, alpha: float = 1.0,
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


def unit_scale(peak: float) -> float:
    """The power of two ``S`` with ``S · peak`` in [1, 2) (1 when ``peak`` is 0 or not finite, so
    that NaN and inf pass through unscaled): float16's ``dz`` is formed at that scale."""
    if not math.isfinite(peak) or peak <= 0.0:
        return 1.0
    return 2.0 ** -math.floor(math.log2(peak))


class _GradientSums:
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
            _matmul_into(self.dx[rows], dz, w)
            if unscale != 1.0:
                self.dx[rows].mul_(unscale)
        if self.dw is not None:
            _addmm_into(self.dw, dz.t(), x_c, max_temp_numel=dz.numel(), alpha=unscale, first=self.first)
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
        ``dz = diag(r) ẽ``, ``r = scale · factors`` (:func:`_logits_with_loss`): ``dx[rows] = diag(r) (ẽ W)``,
        ``dW += ẽᵀ (diag(r) x_c)``, ``db += ẽᵀ r``; the factors never touch the ``N × V`` buffer."""
        if self.dx is not None:
            _scaled_product_into(self.dx[rows], e, w, factors, scale)
        if self.dw is not None:
            _addmm_into(self.dw, e.t(), launch_scale_rows(x_c, factors, scale), max_temp_numel=e.numel(),
                        first=self.first)
        if self.db is not None:
            _addmm_into(self.db.view(1, -1), (factors * scale).to(e.dtype).view(1, -1), e, max_temp_numel=e.numel(),
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
            launch_scale_gradient(grad, upstream)
    return to_dtypes(grads, dtypes)


def _chunks(n_rows: int, chunk_size: int):
    return (slice(start, min(start + chunk_size, n_rows)) for start in range(0, n_rows, chunk_size))


def _logits_chunk(buffer: torch.Tensor, x_c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, pre: float = 1.0):
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


class _Operands:
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

    def chunks(self):
        """Yield ``(rows, x_c, buffer_c)`` chunk by chunk: the chunk's operand and its rows of the reused
        ``chunk_size × V`` buffer, the logits not yet formed."""
        if self.buffer is None:
            self.buffer = torch.empty((self.chunk_size, self.w.shape[0]), dtype=self.w.dtype, device=self.x.device)
        for rows in _chunks(self.x.shape[0], self.chunk_size):
            x_c = self.operand(rows)
            yield rows, x_c, self.buffer[: x_c.shape[0]]

    def __iter__(self):
        """Yield ``(rows, x_c, logits_c)`` chunk by chunk, the logits formed by cuBLAS into the buffer."""
        for rows, x_c, buffer in self.chunks():
            yield rows, x_c, _logits_chunk(buffer, x_c, self.w, self.b, self.pre)


def _reduce(per_row: torch.Tensor, reduction: str, normalizer, shape) -> torch.Tensor:
    """``none``: reshape to the target's shape; ``sum``; ``mean``: the sum divided by ``normalizer``
    (a float, or a one-element tensor such as the Trainer's ``num_items_in_batch``)."""
    if reduction == "none":
        return per_row.view(shape)
    total = per_row.sum()
    return total / normalizer if reduction == "mean" else total


def _factor_tensor(pre: float, normalizer, reduction: str, device) -> torch.Tensor:
    """The gradient factor of every row, ``pre / normalizer`` (``mean``) or ``pre`` (``sum``), as a
    one-element float32 tensor, formed on the device (a tensor normalizer is never read on the host)."""
    if reduction != "mean":
        return torch.full((1,), pre, dtype=torch.float32, device=device)
    if isinstance(normalizer, torch.Tensor):
        return pre / normalizer.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), pre / normalizer, dtype=torch.float32, device=device)


class _FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, class_weight, shape, counts, opts: _Options, needs, compute_dtype,
                shard: vp.VocabShard | None = None):
        normalizer, weight_sum = counts
        if _loss_in_epilogue(opts, needs, class_weight, shard):
            with torch.autocast(x.device.type, enabled=False):
                loss = _epilogue_loss(x, weight, bias, target, opts, compute_dtype)
            z_loss = torch.zeros_like(loss)
            ctx.mark_non_differentiable(z_loss)
            return _reduce(loss, opts.reduction, normalizer, shape), _reduce(z_loss, opts.reduction, normalizer, shape)
        with torch.autocast(x.device.type, enabled=False):  # the dtypes are chosen: compute_dtype
            ops = _Operands(x, weight, bias, opts.chunk_size, compute_dtype, opts.pre_scale)
            n_rows = x.shape[0]
            lse, loss, z_loss = (torch.empty(n_rows, dtype=torch.float32, device=x.device) for _ in range(3))
            stats = torch.empty((n_rows, 3), dtype=torch.float32, device=x.device) if opts.with_stats else None
            top1 = torch.empty(n_rows, dtype=torch.int8, device=x.device) if opts.with_stats else None
            fuse_grad = any(needs) and opts.reduction != "none"
            scale = _factor_tensor(opts.pre_scale, normalizer, opts.reduction, x.device)
            plain = fuse_grad and _plain_loss(opts, class_weight, shard)
            class_major = plain and _class_major_route_takes(ops, weight, needs, opts.accurate, opts.chunk_size)
            if class_major:  # the gradients wait for backward, in the buffer that will be dW
                z_loss.zero_()
                storage, x_c, factors = _class_major_logits(ops, target, lse, loss, opts)
                result = (storage, x_c, ops.w, target, lse, scale, factors)
            else:
                grads = _GradientSums(x, weight, bias, needs, opts.accurate, compute_dtype) if fuse_grad else None
                # float16: dz at the scale that brings the largest factor to [1, 2), undone in float32
                # (see the module's note); class weights multiply a row's factor by up to max |w|.
                if fuse_grad:
                    unscale = grads.dz_unscale(lambda: scale.abs().max() * _max_weight(class_weight))
                    scale = scale / unscale
                else:
                    unscale = 1.0
                kernel_args = opts.kernel_args(class_weight, weight_sum)
                chunk = launch_cross_entropy_chunk if shard is None else _vocab_parallel_chunk(shard)
                if plain:
                    z_loss.zero_()
                epilogue = None  # decided at the first chunk: every chunk's operand is aligned alike
                exponentials = STORE_EXPONENTIALS and not grads.wide if fuse_grad else False
                for rows, x_c, buffer in ops.chunks():
                    if epilogue is None:
                        epilogue = plain and _epilogue_gemm_takes(x_c, ops.w)
                    if epilogue and exponentials:
                        # The GEMM stores the shifted exponentials: no pass over them, the factors on x and dx.
                        e, factors = _logits_with_loss(buffer, x_c, ops, target[rows], lse[rows], loss[rows], opts,
                                                       exponentials=True)
                        grads.add_exponentials(e, factors, scale, x_c, ops.w, rows)
                        continue
                    if epilogue:
                        # The lse from the GEMM's epilogue: the kernel's pass 2 alone reads the logits.
                        logits, _ = _logits_with_loss(buffer, x_c, ops, target[rows], lse[rows], loss[rows], opts)
                        chunk(logits, target[rows], lse=lse[rows], loss=None, z_loss=None, grad_scale=scale, **kernel_args)
                    else:
                        logits = _logits_chunk(buffer, x_c, ops.w, ops.b, ops.pre)
                        chunk(
                            logits,
                            target[rows],
                            lse=lse[rows],
                            loss=loss[rows],
                            z_loss=z_loss[rows],
                            grad_scale=scale if fuse_grad else None,
                            stats=None if stats is None else stats[rows],
                            top1=None if top1 is None else top1[rows],
                            **kernel_args,
                        )
                    if fuse_grad:
                        grads.add_chunk(logits, x_c, ops.w, rows, unscale)
                if fuse_grad and shard is not None and grads.dx is not None:
                    shard.sum_(grads.dx)
                result = grads.result() if fuse_grad else None
        ctx.opts, ctx.needs, ctx.compute_dtype, ctx.weight_sum = opts, needs, compute_dtype, weight_sum
        ctx.shard, ctx.handed_out, ctx.class_major = shard, False, fuse_grad and class_major
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        if fuse_grad:
            ctx.save_for_backward(*result)
        elif any(needs):
            # Plain cross-entropy: the backward's dz_y from 1 - p_y = -expm1(-loss) (the kernel's note)
            plain_rows = not (opts.label_smoothing or opts.z_loss_scale) and class_weight is None
            one_minus_p = torch.expm1(-loss).neg_() if plain_rows else None
            ctx.save_for_backward(x, weight, bias, target, lse, class_weight, stats, one_minus_p)
        ctx.set_materialize_grads(False)  # a gradient that does not arrive is None, not zeros
        z_loss = _reduce(z_loss, opts.reduction, normalizer, shape)
        outputs = [_reduce(loss, opts.reduction, normalizer, shape), z_loss]
        if not opts.with_stats:
            ctx.mark_non_differentiable(z_loss)
            return tuple(outputs)
        entropy, mean_logit, log_sum_sq = (stats[:, k].reshape(shape).clone() for k in range(3))
        outputs += [entropy, top1.view(shape).bool(), mean_logit, log_sum_sq]
        # The entropy is differentiable only where backward recomputes the logits (reduction "none").
        ctx.mark_non_differentiable(*[t for t in outputs[1:] if t is not entropy or fuse_grad or not any(needs)])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_output, _grad_z_loss, grad_entropy=None, *_grad_non_differentiable):
        if ctx.opts.reduction == "none":
            dx, dw, db = _backward_recompute(ctx, grad_output, grad_entropy)
        elif grad_output is None:
            return (None,) * 11
        else:
            if ctx.handed_out:
                raise RuntimeError(
                    "backward ran twice through kernels_lib.fused_linear_cross_entropy (retain_graph=True): with "
                    "reduction 'mean' or 'sum' its gradients are formed once, over the logits' buffer, and were "
                    "already handed out; "
                    "call the loss again, or use reduction='none' (whose backward recomputes them)"
                )
            ctx.handed_out = True
            if ctx.class_major:
                storage, x_c, w, target, lse, scale, factors = ctx.saved_tensors
                factor = scale * grad_output.reshape(1).to(torch.float32)
                dx, dw, db = _class_major_gradients(storage, x_c, w, target, lse, factor, ctx.opts.ignore_index,
                                                    ctx.needs, ctx.dtypes, factors)
            else:
                # The host never waits here (a wait would leave the GPU idle until the next step's first launch).
                dx, dw, db = scaled_to_dtypes(ctx.saved_tensors, grad_output, ctx.dtypes)
        return dx, dw, db, None, None, None, None, None, None, None, None


def _plain_loss(opts: _Options, class_weight, shard) -> bool:
    """Whether a row's loss is ``lse - c_y`` alone, so that the log-sum-exp in the epilogue of the logits
    GEMM (:mod:`kernels_lib.kernels.logits_logsumexp`) gives it: plain cross-entropy (no smoothing,
    z-loss, softcap, statistics or class weights), reduced, on one process. ``reduction="none"`` keeps
    the chunked kernel, whose per-token ``(m - z_y) + log s`` keeps the relative accuracy of a loss near
    0 that ``lse - z_y`` would lose."""
    options = opts.label_smoothing or opts.z_loss_scale or opts.softcap is not None or opts.with_stats
    return not options and opts.reduction != "none" and class_weight is None and shard is None


def _loss_in_epilogue(opts: _Options, needs, class_weight, shard) -> bool:
    """Whether the loss alone (no input takes a gradient) comes from the epilogue GEMM, with no chunks
    (the logits never exist): a plain loss (:func:`_plain_loss`), compiled. In Triton's interpreter the
    GEMM is a Python loop over its tiles: at N = 96, H = 64, V = 32000 the loss under ``no_grad`` took
    79-94 s that way against 1.2-1.6 s for forward and backward on the chunks (torch's matmul and the
    kernel's two passes), so there the no-grad loss takes the chunks too, unless
    :data:`EPILOGUE_GEMM_WHEN_INTERPRETED` asks for the GEMM (its tests)."""
    compiled_or_asked = not INTERPRETED or EPILOGUE_GEMM_WHEN_INTERPRETED
    return compiled_or_asked and not any(needs) and _plain_loss(opts, class_weight, shard)


def _epilogue_gemm_takes(x_c: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a gradient chunk's logits come from the epilogue GEMM: where its Hopper (TMA) kernel runs
    for 16-bit operands (its logits within 2% of cuBLAS's, and the kernel's first pass saved); elsewhere
    cuBLAS's matmul and the kernel's two passes are the faster route. In Triton's interpreter: when
    :data:`EPILOGUE_GEMM_WHEN_INTERPRETED` says so."""
    if INTERPRETED:
        return EPILOGUE_GEMM_WHEN_INTERPRETED
    return x_c.dtype in (torch.bfloat16, torch.float16) and tma_unsupported_reason(x_c, w) is None


def _logits_with_loss(buffer, x_c, ops: "_Operands", target_c, lse_c, loss_c, opts: _Options,
                      exponentials: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Form a chunk's logits into ``buffer`` with the epilogue GEMM, which gives each row's lse (copied
    into ``lse_c``) and target logit as it goes; ``loss_c = lse - c_y`` (0 at ignored rows). Returns
    ``(buffer, None)``; with ``exponentials`` the buffer holds the shifted exponentials ``ẽ`` instead
    (:mod:`kernels_lib.kernels.shifted_exponentials`), and the second element is each row's factor
    ``u_i = exp(c*_i - lse_i)`` (float32; 0 at ignored rows, NaN at targets outside ``[0, V)``), so
    that ``dz = g · diag(u) ẽ``."""
    factors = None
    if exponentials:  # the shift goes in, the row factors come out
        factors = launch_target_logit_shift(x_c, ops.w, ops.b, target_c, ops.pre, opts.ignore_index)
    lse, target_logit = launch_logits_logsumexp(x_c, ops.w, ops.b, target_c, alpha=ops.pre,
                                                ignore_index=opts.ignore_index, logits_out=buffer, shift=factors)
    lse_c.copy_(lse)
    loss_c.copy_(torch.where(target_c != opts.ignore_index, lse - target_logit, 0.0))
    return buffer, factors


#: Rows of ``dW`` each matmul of the class-major route forms; its buffer holds as many rows beyond ``V``.
#: 8448 = 33 × 256: at H = 4096 a slab is 33 × 32 tiles of 256 × 128, 1056 = 8 × 132 (eight full waves on
#: the H200's 132 SMs). On the H200 at N = 4096, V = 128256 the slabs took 6.30 / 6.18 / 6.12 ms against
#: 6.37 / 6.28 / 6.25 in slabs of 8192, three runs (``gpu_runs/fused_linear_cross_entropy_class_major_stages.csv``,
#: ``scripts/flce_frontier.py --parts class_major``), for 2 MB more of buffer.
CLASS_MAJOR_SLAB_ROWS = 8448
#: With ``chunk_size`` left to the default, the class-major route also takes one chunk of ``H < N ≤ k·H``
#: rows (``k`` this constant) where its ``V × N`` logits fit the default chunk's share of free memory
#: (:data:`DEFAULT_CHUNK_FREE_FRACTION`): the buffer then holds ``V·N + S·H`` elements instead of
#: ``(V + S)·H``, and forward defers the gradients as at ``N ≤ H`` instead of forming them chunk by
#: chunk. On the H200 at N = 8192 (H = 4096, V = 128256, bf16; ``scripts/flce_frontier.py --parts
#: wide_class_major``, ``gpu_runs/fused_linear_cross_entropy_wide_class_major_ab.csv``, medians of three
#: alternating rounds) ``k = 2`` took ``forward``
#: with a gradient from 37.67 ms to 12.91 (torch's 17.62) and ``full`` from 37.50 to 37.12 ms (QuACK's
#: 37.35) at 2198 MB against 2100 (QuACK's 4072; MB as the CSVs count them, 2^20 bytes). Beyond ``2H``
#: the logits outgrow the memory target (``≤ 0.6×`` QuACK's peak): at N = 16384 they alone take 4008 MB,
#: 0.97× QuACK's 4136, so 2.
CLASS_MAJOR_ROWS_PER_HIDDEN = 2


def _class_major_route_takes(ops: "_Operands", weight: torch.Tensor, needs, accurate: bool,
                             chunk_size: int | None) -> bool:
    """Whether a plain loss with a gradient takes the class-major route (:func:`_class_major_gradients`):
    one chunk of at most ``H`` rows (within ``ops.chunk_size``), or with the default ``chunk_size`` (None)
    of at most ``CLASS_MAJOR_ROWS_PER_HIDDEN · H`` rows whose logits fit the default chunk's share of free
    memory; ``dW`` wanted, ``x``, ``W`` and the matmuls in one dtype (so ``dW`` and the logits can share a
    buffer; not ``accurate``, not float16, whose sums are float32), on the epilogue GEMM's machine."""
    n_rows, hidden = ops.x.shape
    fits = n_rows <= min(ops.chunk_size, hidden)
    if not fits and chunk_size is None and hidden < n_rows <= CLASS_MAJOR_ROWS_PER_HIDDEN * hidden:
        fits = _within_free_share(n_rows, ops.w.shape[0], ops.w.element_size(), ops.free_bytes)
    return (needs[1] and fits and not accurate
            and ops.x.dtype == weight.dtype == ops.w.dtype != torch.float16
            and _epilogue_gemm_takes(ops.operand(slice(0, 1)), ops.w))


def _class_major_logits(ops: "_Operands", target, lse, loss, opts: _Options):
    r"""Forward of the class-major route: the logits inside the weight gradient's buffer, the loss.

    ``dW`` (``V × H``) will take the first ``V·H`` elements of a buffer of ``V·max(N, H) + S·H`` (``S`` =
    :data:`CLASS_MAJOR_SLAB_ROWS`; ``(V + S)·H`` while ``N ≤ H``); the epilogue GEMM writes the logits
    class-major, :math:`z^\top` (``V × N``), into its last ``V·N`` elements and gives each row's lse and target logit:
    ``lse`` and ``loss = lse - z_y`` (0 at ignored rows) are written (float32 ``(N,)``). With
    :data:`STORE_EXPONENTIALS` the GEMM writes the shifted exponentials :math:`\tilde e^\top` there instead.
    Returns the buffer, the operand ``x`` in the matmul dtype and the rows' factors (or None), for
    :func:`_class_major_gradients`."""
    n_rows, hidden = ops.x.shape
    n_cols = ops.w.shape[0]
    x_c = ops.operand(slice(0, n_rows))
    storage = torch.empty(n_cols * max(n_rows, hidden) + min(CLASS_MAJOR_SLAB_ROWS, n_cols) * hidden,
                          dtype=ops.w.dtype, device=x_c.device)
    _, factors = _logits_with_loss(_class_major_view(storage, n_cols, n_rows).t(), x_c, ops, target, lse, loss, opts,
                                   exponentials=STORE_EXPONENTIALS)
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

    With ``factors`` (:func:`_logits_with_loss`) the buffer holds the shifted exponentials
    :math:`\tilde e^\top` instead, and no kernel touches it: ``dz = diag(r) ẽ``, ``r = factor · factors``,
    so ``dx = diag(r) (ẽ W)``, ``db = ẽᵀ r`` and the slabs read ``diag(r) x``."""
    n_rows, hidden = x_c.shape
    n_cols = w.shape[0]
    z_t = _class_major_view(storage, n_cols, n_rows)
    need_x, _, need_b = needs
    if factors is None:
        launch_class_major_gradient(z_t, lse, target, factor, ignore_index)
        operand = x_c
    else:
        operand = launch_scale_rows(x_c, factors, factor)
    dx = None
    if need_x and factors is None:
        dx = torch.mm(z_t.t(), w)
    elif need_x:
        dx = torch.empty((n_rows, hidden), dtype=w.dtype, device=w.device)
        _scaled_product_into(dx, z_t.t(), w, factors, factor)
    db = None
    if need_b:
        db = z_t.sum(1, dtype=torch.float32) if factors is None else torch.mv(z_t, (factors * factor).to(z_t.dtype))
        db = db.to(dtypes[2])
    dw = storage[: n_cols * hidden].view(n_cols, hidden)
    slab = min(CLASS_MAJOR_SLAB_ROWS, n_cols)
    for start in range(0, n_cols, slab):
        torch.mm(z_t[start:start + slab], operand, out=dw[start:start + slab])
    return dx, dw, db


def _epilogue_loss(x, weight, bias, target, opts: _Options, compute_dtype) -> torch.Tensor:
    """Per row ``lse - c_y`` (0 at ignored rows), float32, from the logits GEMM's epilogue: no logits
    buffer, one pass over ``W``. The operands are rounded to ``compute_dtype`` first, as the matmul would."""
    x, weight = x.to(compute_dtype), weight.to(compute_dtype)
    bias = None if bias is None else bias.to(compute_dtype)
    lse, target_logit = logits_logsumexp(x, weight, bias, target, alpha=opts.pre_scale, ignore_index=opts.ignore_index)
    return torch.where(target != opts.ignore_index, lse - target_logit, 0.0)


def _max_weight(class_weight: torch.Tensor | None):
    """The largest ``|w_j|`` (1 without class weights): the most a row's weight can scale its gradient."""
    return 1.0 if class_weight is None else class_weight.abs().max()


def _backward_recompute(ctx, grad_output: torch.Tensor | None, grad_entropy: torch.Tensor | None = None):
    """Backward of ``reduction="none"``: recompute each logits chunk, form ``dz`` from the saved lse
    (and the saved entropy, when the entropy has an upstream gradient; for plain cross-entropy the
    saved ``1 - p_y``, so that ``dz_y`` keeps its relative accuracy where ``p_y -> 1``)."""
    x, weight, bias, target, lse, class_weight, stats, one_minus_p = ctx.saved_tensors
    opts = ctx.opts

    def row_factors(grad):  # per row, times the gradient's factor with respect to the raw logits
        if grad is None:
            return torch.zeros_like(lse)
        return (grad.reshape(-1).to(torch.float32) * opts.pre_scale).contiguous()

    scale, entropy_scale = row_factors(grad_output), None if grad_entropy is None else row_factors(grad_entropy)
    with torch.autocast(x.device.type, enabled=False):
        ops = _Operands(x, weight, bias, opts.chunk_size, ctx.compute_dtype, opts.pre_scale)
        grads = _GradientSums(x, weight, bias, ctx.needs, opts.accurate, ctx.compute_dtype)

        def peak():  # float16: the largest |grad_output · pre · w| (and |grad_entropy · pre|) to [1, 2)
            peak = scale.abs().max() * _max_weight(class_weight)
            return peak if entropy_scale is None else torch.maximum(peak, entropy_scale.abs().max())

        unscale = grads.dz_unscale(peak)
        if unscale != 1.0:
            scale = scale / unscale
            entropy_scale = None if entropy_scale is None else entropy_scale / unscale
        kernel_args = opts.kernel_args(class_weight, ctx.weight_sum)
        if ctx.shard is not None:  # the saved lse and entropy are the merged ones: pass 2 needs nothing more
            kernel_args.update(ctx.shard.kernel_args())
        for rows, x_c, logits in ops:
            launch_cross_entropy_chunk(
                logits, target[rows], lse=lse[rows], loss=None, z_loss=None, grad_scale=scale[rows],
                stats=None if entropy_scale is None else stats[rows],
                entropy_grad=None if entropy_scale is None else entropy_scale[rows],
                one_minus_p=None if one_minus_p is None else one_minus_p[rows],
                **kernel_args,
            )
            grads.add_chunk(logits, x_c, ops.w, rows, unscale)
        if ctx.shard is not None and grads.dx is not None:
            ctx.shard.sum_(grads.dx)
    return to_dtypes(grads.result(), ctx.dtypes)


def _vocab_parallel_chunk(shard: vp.VocabShard):
    r"""The per-chunk stage on one vocabulary shard, with :func:`launch_cross_entropy_chunk`'s arguments.

    Pass 1 writes this rank's partial sums (:data:`~kernels_lib.kernels.cross_entropy_chunk.PARTIAL_COLUMNS`);
    :meth:`~kernels_lib._vocab_parallel.VocabShard.merge_logsumexp` merges them into the global
    :math:`M` and :math:`\log S` (``lse = M + log S``) and sums, in the same all-reduce, the target's
    capped logit :math:`c_y` (from the rank that owns it, 0 elsewhere), with label smoothing
    :math:`\sum_j w_j c_j`, and with token stats :math:`\sum_j c_j`,
    :math:`D = \sum_r e^{m_r - M}(d_r + (M - m_r) s_r)` and :math:`Q = \sum_r e^{2(m_r - M)} q_r`
    (``d``, ``q`` rescaled from each rank's maximum to the global one). The loss terms are then the
    kernel's pass-1 formulas on the merged values,

    .. math::

        \ell = (1-\varepsilon)\,r\,((M - c_y) + \log S)
               + \tfrac{\varepsilon}{V}\big((W M - \textstyle\sum_j w_j c_j) + W \log S\big) + r\lambda\,\mathrm{lse}^2,
        \quad H = D/S + \log S, \quad \log\textstyle\sum_j p_j^2 = \log Q - 2\log S,

    top-1 is :math:`c_y \ge M`; and pass 2 writes this rank's ``dz`` with the global lse. Wire per
    row: 1 float (MAX) and 2 floats (SUM: :math:`S`, :math:`c_y`), +1 with label smoothing, +3 with
    token stats; float32.
    """

    def chunk(logits, target, *, lse, loss, z_loss, grad_scale, stats, top1, ignore_index, label_smoothing,
              z_loss_scale, softcap, class_weight, weight_sum):
        partial = torch.empty((logits.shape[0], len(PARTIAL_COLUMNS)), dtype=torch.float32, device=logits.device)
        launch_cross_entropy_partials(
            logits, target, partial, col_offset=shard.offset, ignore_index=ignore_index, softcap=softcap,
            class_weight=class_weight, with_stats=stats is not None,
        )
        m, log_s, c_y, sum_wc, sum_c, d, q = partial.unbind(1)

        def extra(shift):
            columns = [c_y] + ([sum_wc] if label_smoothing else [])
            if stats is not None:
                decay = torch.exp(shift)
                columns += [sum_c, decay * (d - shift * torch.exp(log_s)), decay.square() * q]
            return columns

        big_m, log_big_s, sums = shard.merge_logsumexp(m, log_s, extra)
        c_y, sums = sums[0], list(sums[1:])
        n_classes = shard.n_classes
        valid = target != ignore_index
        r = 1.0 if class_weight is None else class_weight[torch.where(valid, target, 0).long()]
        total = n_classes if class_weight is None else weight_sum
        lse.copy_(big_m + log_big_s)
        z_term = r * z_loss_scale * lse.square()
        ce = (1.0 - label_smoothing) * r * ((big_m - c_y) + log_big_s)
        if label_smoothing:
            ce = ce + (label_smoothing / n_classes) * ((total * big_m - sums.pop(0)) + total * log_big_s)
        loss.copy_(torch.where(valid, ce + z_term, 0.0))
        z_loss.copy_(torch.where(valid, z_term, 0.0))
        if stats is not None:
            sum_c, big_d, big_q = sums
            entropy = big_d * torch.exp(-log_big_s) + log_big_s
            columns = (entropy, sum_c / n_classes, torch.log(big_q) - 2.0 * log_big_s)
            stats.copy_(torch.where(valid.unsqueeze(1), torch.stack(columns, 1), 0.0))
            top1.copy_(valid & (c_y >= big_m))
        if grad_scale is not None:
            launch_cross_entropy_chunk(
                logits, target, lse=lse, loss=None, z_loss=None, grad_scale=grad_scale, ignore_index=ignore_index,
                label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
                class_weight=class_weight, weight_sum=weight_sum, **shard.kernel_args(),
            )

    return chunk


def _validate_tensors(x, weight, target, bias, class_weight, vocab_parallel: bool = False) -> None:
    """The tensors' checks; ``vocab_parallel``: ``weight`` and ``bias`` are this rank's shard, and
    ``class_weight``'s length (the global ``V``) is checked over the ranks
    (:func:`kernels_lib._vocab_parallel.establish`)."""
    v.require_linear_loss_inputs(x, weight, target)
    tensors = {"x": x, "weight": weight, "target": target}
    if bias is not None:
        v.require_bias("bias", bias, weight)
        tensors["bias"] = bias
    if class_weight is not None:
        v.require_tensor("class_weight", class_weight)
        v.require_float("class_weight", class_weight)
        if class_weight.dim() != 1 or (not vocab_parallel and class_weight.shape != weight.shape[:1]):
            raise ValueError(
                f"class_weight must have shape (V,) = ({weight.shape[0]},), one weight per class; got {tuple(class_weight.shape)}"
            )
        tensors["class_weight"] = class_weight
    v.require_same_device(tensors)


def _validate_options(
    ignore_index, reduction, label_smoothing, z_loss_scale, softcap, return_z_loss, chunk_size, accurate,
    logit_scale=1.0, temperature=1.0, return_token_stats=False,
) -> None:
    v.require_int("ignore_index", ignore_index)
    v.require_choice("reduction", reduction, REDUCTIONS)
    v.require_probability("label_smoothing", label_smoothing)
    v.require_real("z_loss_scale", z_loss_scale)
    if z_loss_scale < 0:
        raise ValueError(f"z_loss_scale must be >= 0; got {z_loss_scale}")
    if softcap is not None:
        v.require_real("softcap", softcap)
        if softcap <= 0:
            raise ValueError(f"softcap must be None or > 0; got {softcap}")
    v.require_real("logit_scale", logit_scale)
    v.require_real("temperature", temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    v.require_bool("return_z_loss", return_z_loss)
    v.require_bool("return_token_stats", return_token_stats)
    v.require_chunk_options(chunk_size, accurate)


def _validate_num_items(num_items_in_batch, reduction: str) -> None:
    """None, a positive int, or a one-element real tensor (read on the device, never on the host)."""
    if num_items_in_batch is None:
        return
    if reduction != "mean":
        raise ValueError(
            f"num_items_in_batch replaces the denominator of reduction='mean'; got reduction={reduction!r}"
        )
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1 or num_items_in_batch.is_complex() or num_items_in_batch.dtype == torch.bool:
            raise ValueError(
                "num_items_in_batch must be a positive int or a one-element real tensor; "
                f"got a {num_items_in_batch.dtype} tensor of shape {tuple(num_items_in_batch.shape)}"
            )
        return
    v.require_int("num_items_in_batch", num_items_in_batch)
    if num_items_in_batch < 1:
        raise ValueError(f"num_items_in_batch must be >= 1; got {num_items_in_batch}")


def _normalizer(num_items_in_batch, valid_normalizer: torch.Tensor):
    """The denominator of ``mean``: ``num_items_in_batch`` when given, else the valid rows' total
    weight (their number without class weights; 1 where that is 0, so an all-ignored batch gives 0),
    a device tensor never read on the host."""
    if num_items_in_batch is not None:
        return num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else float(num_items_in_batch)
    return valid_normalizer


@torch.compiler.disable
def fused_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    chunk_size: int | None = None,
    accurate: bool = False,
    class_weight: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    logit_scale: float = 1.0,
    temperature: float = 1.0,
    return_token_stats: bool = False,
    host_checks: bool = True,
    process_group=None,
):
    """Cross-entropy of the logits ``x @ weight.T + bias`` against ``target``, never materializing them.

    Args:
        x: hidden states, shape ``(..., H)`` (leading dims flatten to ``N`` rows); float32,
            bfloat16 or float16. Gradients flow to it.
        weight: the LM head, ``(V, H)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        target: class indices of shape ``x.shape[:-1]``, int64 or int32, aligned with the rows (no
            shift inside), each in ``[0, V)`` or equal to ``ignore_index``.
        bias: optional ``(V,)``, the dtype of ``x`` (any inside ``torch.autocast``). Gradients flow to it.
        ignore_index: target value of rows that contribute nothing (loss and gradient 0).
        reduction: ``"mean"`` (over the valid rows), ``"sum"`` or ``"none"`` (per row, shape of
            ``target``, 0 at ignored rows).
        label_smoothing: ε in [0, 1], as ``torch.nn.functional.cross_entropy`` defines it.
        z_loss_scale: λ ≥ 0; adds ``λ·lse²`` per valid row to the loss.
        softcap: ``s > 0`` replaces the logits by ``s·tanh(z/s)`` before everything, or None.
        return_z_loss: also return the z-loss term alone (same reduction), for logging: it is
            already included in the loss, and no gradient flows through this second output.
        chunk_size: rows per chunk, or None for :func:`default_chunk_size` (``H`` rows, at least 2048,
            fewer when the device's free memory is short).
        accurate: accumulate ``dW``/``db`` over chunks in float32 rather than in the parameter dtype
            (default False: saves a ``V × H`` float32 buffer; about 20% more dW error at 16 chunks).
        class_weight: torch's per-class ``weight`` ``(V,)``: a row's loss is multiplied by
            ``w_y`` and ``mean`` divides by ``Σ_valid w_y``; with label smoothing the smoothing term is
            ``(ε/V) Σ_j w_j (lse − c_j)``, as ``F.cross_entropy(weight=...)`` computes it. The z-loss
            term of a row is weighted by ``w_y`` too.
        num_items_in_batch: with ``mean``, divide the summed loss by this count instead of by the
            valid rows of this call: Hugging Face's gradient-accumulation normalizer (the
            ``Trainer`` passes the valid-token count of the whole accumulated batch), and the way to
            normalize by a global token count over micro-batches or data-parallel ranks. An int, or a
            one-element tensor (read on the device: no host sync).
        logit_scale: the logits are multiplied by it before the softcap (models with a logit scale).
        temperature: ``T > 0``; the (scaled, capped) logits are divided by it:
            ``c = softcap_s(logit_scale · z) / T``, the order of TRL's fused head.
        return_token_stats: return a :class:`CrossEntropyOutput` with the per-token entropy (with its
            gradient under ``reduction="none"``), top-1 hit, mean logit and ``log Σ p²``, computed in
            the same pass over the logits (what training loggers and TRL's trainers read off the
            logits this function never returns).
        host_checks: True (default): the targets' range is checked on the host, so a bad target
            raises a ValueError naming it (on CUDA read at the end of the call behind an event that
            waits for the check alone, not for the matmuls). False: no host sync at all, for a training step whose
            CPU must run ahead of the GPU (small steps are launch-bound): the valid-token count stays
            on the device, the range is asserted there (``torch._assert_async``: a device-side assert
            on CUDA, as torch's ``cross_entropy`` gives). :func:`kernels_lib.hf.patch` uses False. (With a process group the
            call's one check over the ranks reads the targets' range on the host in any case.)
        process_group: a ``torch.distributed`` group over which the vocabulary is split
            (:mod:`kernels_lib._vocab_parallel`): ``weight`` (``V_r × H``) and ``bias`` (``V_r``) are
            this rank's rows ``[o_r, o_r + V_r)`` of the head, in group-rank order, of any sizes;
            ``x``, ``target`` (global class indices), ``class_weight`` (global, ``(V,)``) and every
            option are the same on every rank, and so is the returned loss. Or None with a DTensor
            ``weight`` (and ``bias``) sharded ``(Shard(0),)`` over a 1-D device mesh: the mesh's group.
            Every option works; the result equals the single-process one up to float rounding. The
            gradient of ``x`` is complete on every rank (summed over the ranks inside; do not reduce
            it again); those of ``weight`` and ``bias`` are the local shard's. Every rank of the group
            must make the call (and, with ``reduction="none"``, the backward). Wire: once per call an
            all_gather of 13 int64 per rank (the check) and, when ``x`` needs a gradient, one
            all-reduce of ``dx`` (``N × H``, in ``dx``'s dtype: float32 for float16 inputs); per chunk
            and row, float32: 1 (max) + 2 (sum-exp, the target's logit from its owner), +1 with
            label smoothing (the sum of the logits), +3 with ``return_token_stats`` (the entropy's
            and ``Σ p²``'s sums, the sum of the logits). Nothing of size ``V`` crosses.

    Returns:
        The loss in float32 whatever the input dtype (as Transformers' ``ForCausalLMLoss``, which
        upcasts the logits); or ``(loss, z_loss)`` with ``return_z_loss``; or a
        :class:`CrossEntropyOutput` with ``return_token_stats``. With ``reduction="none"`` the loss
        is per token, ``−log p(target)`` at ``ε = λ = 0`` (its negative is the token log-prob, with
        gradient). With ``mean`` and every target ignored the loss is 0 and all gradients are 0
        (torch gives NaN), so a batch of pure padding does not poison training. NaN in ``x``,
        ``weight`` or ``bias`` gives a NaN loss.

    Mixed precision: under ``torch.autocast`` the head's matmuls run in the autocast dtype (the
    operands are rounded to it, as ``nn.Linear`` would be, so ``x``, ``weight`` and ``bias`` may differ
    in dtype there: half hidden states and a float32 head), the loss is float32, and the gradients
    come back in each input's own dtype, accumulated in float32 across chunks for float32 parameters
    (:mod:`kernels_lib._autocast`; every fused loss does the same).

    Memory: with ``mean``/``sum`` the gradients are formed in forward and held until backward
    (``dx``, ``dW``, ``db``: the size of the inputs). With ``none`` forward keeps one float per row
    (the log-sum-exp) and backward recomputes the logits chunk by chunk (one more matmul).

    Under ``torch.compile`` this function is not traced (``torch.compiler.disable``): one graph break
    per call, the kernels run as they do eagerly.

    Raises:
        TypeError: a non-tensor, a dtype other than float32/bfloat16/float16 for ``x``/``weight``/
            ``bias`` or differing between them, a non-integer ``target``, an option of the wrong type.
        ValueError: shapes that do not fit (naming the argument), empty ``x``, tensors on different
            devices or one the kernels cannot run on, targets outside ``[0, V)`` other than
            ``ignore_index``, an option out of range, ``num_items_in_batch`` with a reduction other
            than ``mean``. With a process group, on every rank: any of these on any rank (the
            others raise the same type, naming it), ranks that disagree on ``x``'s shape, the
            targets or the options, targets outside the global ``[0, V)``, a DTensor not sharded
            ``(Shard(0),)`` over a 1-D mesh or on another group than ``process_group``.
    """
    group = vp.find_group(process_group, {"weight": weight, "bias": bias})
    grad_on = torch.is_grad_enabled()

    def check():
        _validate_tensors(x, weight, target, bias, class_weight, vocab_parallel=group is not None)
        _validate_options(
            ignore_index, reduction, label_smoothing, z_loss_scale, softcap, return_z_loss, chunk_size, accurate,
            logit_scale, temperature, return_token_stats,
        )
        _validate_num_items(num_items_in_batch, reduction)
        v.require_bool("host_checks", host_checks)

    shard = None
    if group is None:
        check()
    else:
        dtensor_vocab = weight.shape[0] if vp.is_dtensor(weight) else None
        weight, bias = vp.local(weight), vp.local(bias)

        def options():
            return (
                ignore_index, reduction, label_smoothing, z_loss_scale, softcap, return_z_loss, chunk_size, accurate,
                logit_scale, temperature, return_token_stats, host_checks, bias is None, x.dtype,
                num_items_in_batch if not isinstance(num_items_in_batch, torch.Tensor) else "tensor",
                tuple(bool(t is not None and t.requires_grad and grad_on) for t in (x, weight, bias)),
            )

        shard = vp.establish(
            group, weight, check, rows=lambda: x.numel() // x.shape[-1], targets=lambda: {"target": target},
            ignore_index=ignore_index, options=options, class_weight=lambda: class_weight,
            dtensor_vocab=dtensor_vocab,
        )
    n_classes = weight.shape[0] if shard is None else shard.n_classes
    float_weight = None if class_weight is None else class_weight.detach().float().contiguous()
    # With a shard, establish has checked the range on the host already (as in kernels_lib.cross_entropy).
    totals = target_totals(target, n_classes, ignore_index, float_weight, host_checks and shard is None)
    weight_sum, range_check = totals.weight_sum, totals.check
    normalizer = _normalizer(num_items_in_batch, totals.normalizer)
    needs = tuple(bool(t is not None and t.requires_grad and grad_on) for t in (x, weight, bias))
    opts = _Options(
        ignore_index, reduction, float(label_smoothing), float(z_loss_scale),
        None if softcap is None else float(softcap), chunk_size, accurate,
        float(logit_scale), float(temperature), return_token_stats, host_checks,
    )
    outputs = _FusedLinearCrossEntropyFunction.apply(
        x.reshape(-1, x.shape[-1]), weight, bias, target.reshape(-1).contiguous(),
        float_weight, target.shape, (normalizer, weight_sum), opts, needs, compute_dtype_for(x), shard,
    )
    if range_check is not None:
        range_check.raise_if_bad()
    if return_token_stats:
        return CrossEntropyOutput(*outputs)
    loss, z_loss = outputs
    return (loss, z_loss) if return_z_loss else loss


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`fused_linear_cross_entropy`;
    ``forward(x, weight, target, bias=None, num_items_in_batch=None)``.

    The module holds the options (and ``class_weight`` as a buffer, as ``nn.CrossEntropyLoss`` holds
    its ``weight``): the LM head's ``weight`` (and ``bias``) stay with the model and are passed at
    each call.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss_scale: float = 0.0,
        softcap: float | None = None,
        return_z_loss: bool = False,
        chunk_size: int | None = None,
        accurate: bool = False,
        class_weight: torch.Tensor | None = None,
        logit_scale: float = 1.0,
        temperature: float = 1.0,
        return_token_stats: bool = False,
    ):
        super().__init__()
        _validate_options(
            ignore_index, reduction, label_smoothing, z_loss_scale, softcap, return_z_loss, chunk_size, accurate,
            logit_scale, temperature, return_token_stats,
        )
        self.options = dict(
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss_scale=z_loss_scale,
            softcap=softcap,
            return_z_loss=return_z_loss,
            chunk_size=chunk_size,
            accurate=accurate,
            logit_scale=logit_scale,
            temperature=temperature,
            return_token_stats=return_token_stats,
        )
        self.register_buffer("class_weight", class_weight)

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ):
        return fused_linear_cross_entropy(
            x, weight, target, bias, class_weight=self.class_weight, num_items_in_batch=num_items_in_batch,
            **self.options,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={val!r}" for k, val in self.options.items())
