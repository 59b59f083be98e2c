r"""Fused linear + CPO as the workbench measures it: providers, inputs, the published workload, floors.

Providers, each a thin adapter with the signature of :func:`kernels_lib.fused_linear_cpo.fused_linear_cpo`
(returning a result with ``.loss``, or the loss tensor):

- ``kernels_lib``: our function, default options;
- ``huggingface``: :func:`kernels_lib.reference.fused_linear_cpo`, TRL 1.16's CPO on full logits
  (a matmul in the input dtype, upcast to fp32): the published "huggingface" provider;
- ``liger``: ``liger_kernel.chunked_loss.LigerFusedLinearCPOLoss`` (CUDA only), its defaults (one
  pair per chunk, ``torch.compile``d chunk step, summed log-probs, NLL on the chosen half weighted by
  its ``alpha`` = our ``cpo_alpha``); sigmoid loss only.

The published workload (Liger's ``benchmark_cpo_loss.py``, A100): as ORPO's, ``x`` of shape
``(B, T, H)`` with ``B`` counting chosen and rejected rows together (``B = 2`` is one pair), targets
drawn uniformly with no ignored token, ``x`` and the head's weight taking gradients, no bias;
``T = 1024``, ``H = 4096``, ``V = 128256``, bf16. Inputs, FLOPs and bytes are ORPO's
(:mod:`.fused_linear_orpo`): three logits-sized matmuls for ``full``.
"""

from __future__ import annotations

import torch

from kernels_lib import reference
from kernels_lib.fused_linear_cpo import fused_linear_cpo as kernels_lib_cpo
from .. import data
from .fused_linear_orpo import bytes_moved, flops, make_inputs
from .spec import LossSpec, Provider, preference_sweep, require_cuda
from .trl_head import trl_provider

__all__ = ["KERNEL_NAME", "PROVIDERS", "SPEC", "bytes_moved", "flops", "make_inputs", "published_rows"]

KERNEL_NAME = "fused_linear_cpo_loss"


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.chunked_loss import LigerFusedLinearCPOLoss

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_cpo(x, weight, target, bias=None, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, cpo_alpha=1.0,
                  simpo_gamma=0.5, alpha=0.0, ignore_index=-100, nll_target=None, chunk_size=None, accurate=False):
        del simpo_gamma, chunk_size, accurate  # ours alone: Liger runs its own defaults
        if loss_type != "sigmoid" or alpha != 0.0 or nll_target is not None:
            raise NotImplementedError("Liger's CPO is the sigmoid loss on the targets only (no hinge/ipo/simpo, AlphaPO or nll_target)")
        key = (ignore_index, beta, label_smoothing, cpo_alpha)
        if key not in modules:
            modules[key] = LigerFusedLinearCPOLoss(
                ignore_index=ignore_index, beta=beta, alpha=cpo_alpha, label_smoothing=label_smoothing,
                compute_nll_loss=cpo_alpha != 0.0,
            )
        # Liger's forward takes the weight first and returns (loss, aux outputs).
        return modules[key](weight, x, target, bias)[0]

    return liger_cpo


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_cpo, "kernels_lib.fused_linear_cpo (Triton)"),
    "huggingface": Provider("huggingface", lambda: reference.fused_linear_cpo, "TRL 1.16's CPO on fp32 logits (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel.chunked_loss LigerFusedLinearCPOLoss"),
    "trl": trl_provider(reference.fused_linear_cpo, "CPO"),
}


def published_rows():
    """Liger's published rows of CPO (A100), from ``data/published/`` (copied unchanged from the published CSV)."""
    return data.load_published(KERNEL_NAME)


SPEC = LossSpec(
    kernel_name=KERNEL_NAME,
    providers=PROVIDERS,
    make_inputs=make_inputs,
    **preference_sweep(),
    bytes_moved=bytes_moved,
    matmul_flops=flops,
    baseline="huggingface",
    default_options={"beta": 0.1, "ignore_index": -100, "ignore_fraction": 0.0},
)
