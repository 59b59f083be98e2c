r"""Fused linear + SimPO as the workbench measures it: providers, inputs, the published workload, floors.

Providers, each a thin adapter with the signature of :func:`kernels_lib.fused_linear_cpo.fused_linear_simpo`
(returning a result with ``.loss``, or the loss tensor):

- ``kernels_lib``: our function, default options (CPO's code with ``loss_type="simpo"``);
- ``huggingface``: :func:`kernels_lib.reference.fused_linear_simpo`, TRL 1.16's
  ``CPOTrainer(loss_type="simpo")`` on full logits (a matmul in the input dtype, upcast to fp32):
  the published "huggingface" provider;
- ``liger``: ``liger_kernel.chunked_loss.LigerFusedLinearSimPOLoss`` (CUDA only), its defaults (one
  pair per chunk, ``torch.compile``d chunk step, averaged log-probs, target margin ``gamma`` = our
  ``simpo_gamma``, NLL on the chosen half weighted by its ``alpha`` = our ``cpo_alpha``).

The published workload (Liger's ``benchmark_simpo_loss.py``, A100) is CPO's and ORPO's: ``x`` of
shape ``(B, T, H)`` with ``B`` counting chosen and rejected rows together, no ignored token, ``x``
and the weight taking gradients, no bias; ``T = 1024``, ``H = 4096``, ``V = 128256``, bf16. Inputs,
FLOPs and bytes are ORPO's (:mod:`.fused_linear_orpo`).
"""

from __future__ import annotations

import torch

from kernels_lib import reference
from kernels_lib.fused_linear_cpo import fused_linear_simpo as kernels_lib_simpo
from .. import data
from .fused_linear_orpo import bytes_moved, flops, make_inputs
from .spec import LossSpec, Provider, preference_sweep, require_cuda
from .trl_head import trl_provider

__all__ = ["KERNEL_NAME", "PROVIDERS", "SPEC", "bytes_moved", "flops", "make_inputs", "published_rows"]

KERNEL_NAME = "fused_linear_simpo_loss"


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.chunked_loss import LigerFusedLinearSimPOLoss

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_simpo(x, weight, target, bias=None, *, beta=0.1, simpo_gamma=0.5, label_smoothing=0.0, cpo_alpha=1.0,
                    alpha=0.0, ignore_index=-100, nll_target=None, chunk_size=None, accurate=False):
        del chunk_size, accurate  # ours alone: Liger runs its own defaults
        if alpha != 0.0 or nll_target is not None:
            raise NotImplementedError("Liger's SimPO has no AlphaPO rewards and no nll_target")
        key = (ignore_index, beta, simpo_gamma, label_smoothing, cpo_alpha)
        if key not in modules:
            modules[key] = LigerFusedLinearSimPOLoss(
                ignore_index=ignore_index, beta=beta, alpha=cpo_alpha, label_smoothing=label_smoothing,
                compute_nll_loss=cpo_alpha != 0.0, gamma=simpo_gamma,
            )
        # Liger's forward takes the weight first and returns (loss, aux outputs).
        return modules[key](weight, x, target, bias)[0]

    return liger_simpo


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_simpo, "kernels_lib.fused_linear_simpo (Triton)"),
    "huggingface": Provider(
        "huggingface", lambda: reference.fused_linear_simpo, "TRL 1.16's CPOTrainer(loss_type='simpo') on fp32 logits (the baseline)"
    ),
    "liger": Provider("liger", _load_liger, "liger_kernel.chunked_loss LigerFusedLinearSimPOLoss"),
    "trl": trl_provider(reference.fused_linear_simpo, "SimPO"),
}


def published_rows():
    """Liger's published rows of SimPO (A100), from ``data/published/`` (copied unchanged from the published CSV)."""
    return data.load_published(KERNEL_NAME)


SPEC = LossSpec(
    kernel_name=KERNEL_NAME,
    providers=PROVIDERS,
    make_inputs=make_inputs,
    **preference_sweep(),
    bytes_moved=bytes_moved,
    matmul_flops=flops,
    baseline="huggingface",
    default_options={"beta": 0.1, "simpo_gamma": 0.5, "ignore_index": -100, "ignore_fraction": 0.0},
)
