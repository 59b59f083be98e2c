r"""Fused linear + generalized JSD as the workbench measures it: providers, inputs, floors.

Providers, each a thin adapter with the signature of :func:`kernels_lib.fused_linear_jsd.fused_linear_jsd`:

- ``kernels_lib``: our function, default options;
- ``torch``: :func:`kernels_lib.reference.fused_linear_jsd`, both heads' logits materialized (a matmul
  in the input dtype, upcast to fp32), ``log_softmax``, TRL's ``generalized_jsd_loss`` composition:
  the published "torch" provider (the baseline);
- ``liger``: ``liger_kernel.transformers.LigerFusedLinearJSD`` (CUDA only): the same loss and beta,
  ``batchmean`` only, no biases;
- ``trl``: TRL 1.16's ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction`` (two heads in
  4096-token × 32768-vocab tiles, logits recomputed in backward, float32 accumulation; runs on the
  CPU in torch). It returns the unmasked per-token divergence (and the student's entropy, dropped
  here): the adapter masks the rows ``target == ignore_index`` and reduces as ours (TRL's trainers
  do that step themselves). Same beta and temperature convention: mixture ``(1 - beta) p_student +
  beta p_teacher``, 0 = KL(teacher ‖ student).

The published workload (Liger's ``benchmark_fused_linear_jsd.py``, H100): ``BT`` = 1024 … 8192 rows,
student and teacher both ``H = 4096``, ``V = 128256``, bf16, no bias, no labels, ``beta = 0.5``,
``T = 1``, modes forward and full. Liger drew inputs and weights from ``torch.rand`` (logits near
``H/4`` with a spread of about 14, an almost one-hot softmax); :func:`make_inputs` draws unit-scale
logits instead (``x ~ N(0, 1)``, ``W ~ N(0, 1/H)``, as the cross-entropy spec): the timings do not
depend on the values, the accuracy checks do.

Floors: the logits products of both heads (:math:`2NVH_s + 2NVH_t` FLOPs) without a gradient, plus
``dx`` and ``dW`` of the student (:math:`4NVH_s`) with one (:func:`flops`); bytes: read both heads'
inputs and weights (and the targets), with a gradient write ``dx`` and ``dW`` (:func:`bytes_moved`).
Compute-bound at the published sizes.
"""

from __future__ import annotations

import torch

from kernels_lib import reference
from kernels_lib.fused_linear_jsd import fused_linear_jsd as kernels_lib_fused_linear_jsd
from .. import data
from .spec import Inputs, LossSpec, Provider, require_cuda

KERNEL_NAME = "fused_linear_jsd"

#: Options of :func:`make_inputs` that shape the data rather than the call.
DATA_OPTIONS = ("bias", "ignore_fraction", "student_hidden")


def _masked_reduce(per_row: torch.Tensor, target, ignore_index: int, reduction: str, n_cols: int) -> torch.Tensor:
    """Sum the per-row divergence over the kept rows and divide as :func:`kernels_lib.fused_linear_jsd` does."""
    if target is not None:
        kept = target.reshape(-1) != ignore_index
        per_row = torch.where(kept, per_row, torch.zeros((), dtype=per_row.dtype, device=per_row.device))
        rows = kept.sum().clamp_min(1)
    else:
        rows = per_row.shape[0]
    total = per_row.sum()
    return {"sum": total, "batchmean": total / rows, "mean": total / (rows * n_cols)}[reduction]


def _load_trl():
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    def trl_fused_linear_jsd(student_x, student_weight, teacher_x, teacher_weight, target=None, *, student_bias=None,
                             teacher_bias=None, beta=0.5, temperature=1.0, ignore_index=-100, reduction="batchmean",
                             chunk_size=None, accurate=False):
        del chunk_size, accurate  # ours alone: TRL runs its own tiles and float32 accumulation
        divergence, _entropy = ChunkedDivergenceFunction.apply(
            student_x.reshape(-1, student_x.shape[-1]), student_weight, student_bias,
            teacher_x.detach().reshape(-1, teacher_x.shape[-1]), teacher_weight.detach(),
            None if teacher_bias is None else teacher_bias.detach(), float(beta), float(temperature),
        )
        return _masked_reduce(divergence, target, ignore_index, reduction, student_weight.shape[0])

    return trl_fused_linear_jsd


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.transformers import LigerFusedLinearJSD

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_fused_linear_jsd(student_x, student_weight, teacher_x, teacher_weight, target=None, *, student_bias=None,
                               teacher_bias=None, beta=0.5, temperature=1.0, ignore_index=-100, reduction="batchmean",
                               chunk_size=None, accurate=False):
        del chunk_size, accurate  # ours alone: Liger sizes its own chunks
        if student_bias is not None or teacher_bias is not None or reduction != "batchmean":
            raise NotImplementedError("LigerFusedLinearJSD has no biases and reduces by the kept rows only (batchmean)")
        key = (beta, ignore_index, temperature)
        if key not in modules:
            modules[key] = LigerFusedLinearJSD(jsd_beta=beta, ignore_index=ignore_index, temperature=temperature)
        return modules[key](
            student_x.reshape(-1, student_x.shape[-1]), student_weight, teacher_x.reshape(-1, teacher_x.shape[-1]),
            teacher_weight, None if target is None else target.reshape(-1),
        )

    return liger_fused_linear_jsd


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_fused_linear_jsd, "kernels_lib.fused_linear_jsd (Triton)"),
    "torch": Provider("torch", lambda: reference.fused_linear_jsd, "fp32 logits of both heads + TRL's JSD composition (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel LigerFusedLinearJSD"),
    "trl": Provider("trl", _load_trl, "trl.kernels.chunked_divergence.ChunkedDivergenceFunction, masked and reduced"),
}


def make_heads(n: int, h_student: int, h_teacher: int, v: int, dtype, device, options: dict, seed: int):
    """``(student_x, student_weight, teacher_x, teacher_weight, target, student_bias, teacher_bias)``:
    unit-scale logits (``x ~ N(0, 1)``, ``W ~ N(0, 1/H)``), the student's tensors requiring grad;
    biases with ``options["bias"]``; ``target`` None without ``options["ignore_fraction"]`` (the
    published workload has no labels), else uniform with that fraction set to ``ignore_index``."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def head(h):
        x = torch.randn(n, h, generator=gen, device=device).to(dtype)
        w = (torch.randn(v, h, generator=gen, device=device) * h**-0.5).to(dtype)
        b = (torch.randn(v, generator=gen, device=device) * 0.1).to(dtype) if options.get("bias") else None
        return x, w, b

    (sx, sw, sb), (tx, tw, tb) = head(h_student), head(h_teacher)
    for t in (sx, sw, sb):
        if t is not None:
            t.requires_grad_()
    target = None
    if options.get("ignore_fraction") is not None:
        target = torch.randint(0, v, (n,), generator=gen, device=device)
        ignored = torch.randperm(n, generator=gen, device=device)[: round(options["ignore_fraction"] * n)]
        target[ignored] = options.get("ignore_index", -100)
    return sx, sw, tx, tw, target, sb, tb


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """The two heads of :func:`make_heads` at ``BT`` (or ``N``) rows, ``H`` for both (``student_hidden``
    overrides the student's), ``V``; the other options are passed to the call."""
    n = int(sizes["BT"] if "BT" in sizes else sizes["N"])
    h, v = int(sizes["H"]), int(sizes["V"])
    sx, sw, tx, tw, target, sb, tb = make_heads(n, int(options.get("student_hidden", h)), h, v, dtype, device, options, seed)
    kwargs = {k: val for k, val in options.items() if k not in DATA_OPTIONS}
    kwargs.update(student_bias=sb, teacher_bias=tb)
    return Inputs(args=(sx, sw, tx, tw, target), kwargs=kwargs, grad_inputs=[t for t in (sx, sw, sb) if t is not None])


def two_head_flops(n: int, h_student: int, h_teacher: int, v: int, mode: str) -> float:
    """Matmul FLOPs of a two-head loss: both logits products (``2·N·V·(H_s + H_t)``) for the loss,
    ``dx`` and ``dW`` of the student (``4·N·V·H_s``) for the gradients, all of them for ``full``."""
    forward = 2.0 * n * v * (h_student + h_teacher)
    backward = 4.0 * n * v * h_student
    return {"forward": forward, "forward_no_grad": forward, "backward": backward, "full": forward + backward}[mode]


def two_head_bytes(n: int, h_student: int, h_teacher: int, v: int, dtype: torch.dtype, mode: str, labels: bool) -> int:
    """Bytes at least moved: read both heads' inputs and weights (and int64 labels); with a gradient
    (``backward``, ``full``) write ``dx`` and ``dW`` of the student too."""
    item = torch.empty((), dtype=dtype).element_size()
    reads = (n * h_student + v * h_student + n * h_teacher + v * h_teacher) * item + (n * 8 if labels else 0)
    return reads + (n * h_student + v * h_student) * item if mode in ("backward", "full") else reads


def flops(sizes: dict, mode: str) -> float:
    n = int(sizes["BT"] if "BT" in sizes else sizes["N"])
    return two_head_flops(n, int(sizes["H"]), int(sizes["H"]), int(sizes["V"]), mode)


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    n = int(sizes["BT"] if "BT" in sizes else sizes["N"])
    return two_head_bytes(n, int(sizes["H"]), int(sizes["H"]), int(sizes["V"]), dtype, mode, labels=False)


def published_rows():
    """Liger's published rows of this loss (H100), from ``data/published/`` (copied unchanged)."""
    return data.load_published(KERNEL_NAME)


SPEC = LossSpec(
    kernel_name=KERNEL_NAME,
    providers=PROVIDERS,
    make_inputs=make_inputs,
    published={"x_name": "BT", "x_label": "B x T", "x_values": [1024, 2048, 4096, 8192],
               "sizes": {"H": 4096, "V": 128256}, "dtype": torch.bfloat16},
    small={"x_name": "BT", "x_label": "B x T", "x_values": [8, 16, 32], "sizes": {"H": 32, "V": 257},
           "dtype": torch.bfloat16},
    bytes_moved=bytes_moved,
    matmul_flops=flops,
    baseline="torch",
    default_options={"beta": 0.5, "temperature": 1.0, "reduction": "batchmean"},
)
