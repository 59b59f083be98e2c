r"""The distillation losses as the workbench measures them: ``distill_jsd_loss`` and ``distill_cosine_loss``.

Providers, each a thin adapter with the signature of :func:`kernels_lib.distillation.distill_jsd_loss`
(returning a :class:`~kernels_lib.distillation.DistillationOutput`, whose ``.loss`` the sweep times):

- ``kernels_lib``: our function, default options;
- ``torch``: :func:`kernels_lib.reference.distill_jsd_loss` / ``distill_cosine_loss``, both heads'
  logits materialized (a matmul in the input dtype, upcast to fp32), Liger's formulas on them: the
  published "torch" provider (the baseline);
- ``liger``: ``liger_kernel.chunked_loss.LigerFusedLinearJSDLoss`` /
  ``LigerFusedLinearCosineSimilarityLoss`` (CUDA only; ``torch.compile``\d chunk steps of 1024 rows),
  with ``return_soft_hard_loss=True`` so the three fields compare.

The published workload (Liger's ``benchmark_distill_jsd_loss.py`` on an H100 and
``benchmark_distill_cosine_loss.py`` on an A100): ``BT`` = 1024 … 8192 rows, a student head of
``H/2 = 2048`` and a teacher head of ``H = 4096`` (the scripts' ``nn.Linear(H // 2, V)`` and
``nn.Linear(H, V)``), ``V = 128256``, bf16, no bias, uniform targets with none ignored,
``weight_hard_loss = weight_soft_loss = 0.5``, ``beta = 0.5``, ``T = 1``; modes forward and full.
Inputs as :func:`.fused_linear_jsd.make_heads` draws them (unit-scale logits; Liger's ``torch.rand``
inputs only change the values, not the work).

Floors (:func:`flops`, :func:`bytes_moved`): the two logits products (``2·N·V·(H/2 + H)``), the
student's ``dx`` and ``dW`` (``4·N·V·H/2``); bytes: both heads' inputs and weights and the labels
read, ``dx`` and ``dW`` written with a gradient. The hard loss and either soft loss add no matmul.
"""

from __future__ import annotations

import importlib

import torch

from kernels_lib import reference
from kernels_lib.distillation import DistillationOutput, distill_cosine_loss, distill_jsd_loss
from .. import data
from .fused_linear_jsd import make_heads, two_head_bytes, two_head_flops
from .spec import Inputs, LossSpec, Provider, require_cuda

KERNEL_NAMES = ("distill_jsd_loss", "distill_cosine_loss")

#: Options of :func:`make_inputs` that shape the data rather than the call.
DATA_OPTIONS = ("bias", "ignore_fraction")


def _load_liger(class_name: str):
    """A loader of Liger's chunked module ``class_name`` as an adapter with our signature."""

    def load():
        require_cuda("Liger")
        cls = getattr(importlib.import_module("liger_kernel.chunked_loss"), class_name)
        modules: dict[tuple, torch.nn.Module] = {}

        def liger_distill(student_x, student_weight, teacher_x, teacher_weight, target, *, student_bias=None,
                          teacher_bias=None, weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, temperature=1.0,
                          ignore_index=-100, chunk_size=None, accurate=False):
            del chunk_size, accurate  # ours alone: Liger runs its defaults (1024-row chunks, compiled)
            key = (weight_hard_loss, weight_soft_loss, beta, temperature, ignore_index)
            if key not in modules:
                modules[key] = cls(weight_hard_loss=weight_hard_loss, weight_soft_loss=weight_soft_loss, beta=beta,
                                   ignore_index=ignore_index, temperature=temperature, return_soft_hard_loss=True)
            # Liger's forward takes the input first here: (x_s, W_s, x_t, W_t, labels, b_s, b_t) -> (loss, soft, hard).
            loss, soft, hard = modules[key](
                student_x.reshape(-1, student_x.shape[-1]), student_weight, teacher_x.reshape(-1, teacher_x.shape[-1]),
                teacher_weight, target.reshape(-1), student_bias, teacher_bias,
            )
            return DistillationOutput(loss, hard, soft)

        return liger_distill

    return load


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """A student head of ``H // 2`` and a teacher head of ``H`` (the published scripts'), ``BT`` rows,
    targets with a fraction ``options["ignore_fraction"]`` (default 0) ignored; the other options are
    passed to the call."""
    n = int(sizes["BT"] if "BT" in sizes else sizes["N"])
    h, v = int(sizes["H"]), int(sizes["V"])
    data_options = {**options, "ignore_fraction": options.get("ignore_fraction", 0.0)}
    sx, sw, tx, tw, target, sb, tb = make_heads(n, h // 2, h, v, dtype, device, data_options, seed)
    kwargs = {k: val for k, val in options.items() if k not in DATA_OPTIONS}
    kwargs.update(student_bias=sb, teacher_bias=tb)
    return Inputs(args=(sx, sw, tx, tw, target), kwargs=kwargs, grad_inputs=[t for t in (sx, sw, sb) if t is not None])


def _n_h_v(sizes: dict) -> tuple[int, int, int]:
    return int(sizes["BT"] if "BT" in sizes else sizes["N"]), int(sizes["H"]), int(sizes["V"])


def flops(sizes: dict, mode: str) -> float:
    n, h, v = _n_h_v(sizes)
    return two_head_flops(n, h // 2, h, v, mode)


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    n, h, v = _n_h_v(sizes)
    return two_head_bytes(n, h // 2, h, v, dtype, mode, labels=True)


def published_rows(kernel_name: str):
    """Liger's published rows of ``kernel_name`` (one of :data:`KERNEL_NAMES`), copied unchanged."""
    if kernel_name not in KERNEL_NAMES:
        raise ValueError(f"kernel_name must be one of {', '.join(KERNEL_NAMES)}; got {kernel_name!r}")
    return data.load_published(kernel_name)


def _spec(kernel_name: str, ours, baseline, liger_class: str) -> LossSpec:
    workload = {"x_name": "BT", "x_label": "B x T", "dtype": torch.bfloat16}
    return LossSpec(
        kernel_name=kernel_name,
        providers={
            "kernels_lib": Provider("kernels_lib", lambda: ours, f"kernels_lib.{kernel_name} (Triton)"),
            "torch": Provider("torch", lambda: baseline, f"fp32 logits of both heads + Liger's {kernel_name} formulas (the baseline)"),
            "liger": Provider("liger", _load_liger(liger_class), f"liger_kernel.chunked_loss {liger_class}"),
        },
        make_inputs=make_inputs,
        published={**workload, "x_values": [1024, 2048, 4096, 8192], "sizes": {"H": 4096, "V": 128256}},
        small={**workload, "x_values": [8, 16, 32], "sizes": {"H": 32, "V": 257}},
        bytes_moved=bytes_moved,
        matmul_flops=flops,
        baseline="torch",
        default_options={"weight_hard_loss": 0.5, "weight_soft_loss": 0.5, "beta": 0.5, "temperature": 1.0,
                         "ignore_index": -100},
    )


SPEC_JSD = _spec("distill_jsd_loss", distill_jsd_loss, reference.distill_jsd_loss, "LigerFusedLinearJSDLoss")
SPEC_COSINE = _spec("distill_cosine_loss", distill_cosine_loss, reference.distill_cosine_loss,
                    "LigerFusedLinearCosineSimilarityLoss")
#: Both charts (the registry reads ``SPECS``); ``SPEC`` is the first, as in :mod:`.fused_linear_grpo`.
SPECS = (SPEC_JSD, SPEC_COSINE)
SPEC = SPEC_JSD
