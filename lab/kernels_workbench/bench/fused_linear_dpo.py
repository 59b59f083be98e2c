r"""Fused linear + DPO as the workbench measures it: providers, inputs, a workload, floors.

Liger's published benchmark CSV has no DPO chart, so ``fused_linear_dpo_loss`` (our name) takes
the workload of its CPO and SimPO charts, plus the reference model DPO needs.

Providers, each a thin adapter with the signature of :func:`kernels_lib.fused_linear_dpo.fused_linear_dpo`
(returning a result with ``.loss``, or the loss tensor):

- ``kernels_lib``: our function, default options (the reference model through the same chunks,
  without gradient);
- ``huggingface``: :func:`kernels_lib.reference.fused_linear_dpo`, TRL 1.16's DPO loss on full
  logits (matmuls in the input dtype, upcast to fp32), the reference model's under ``no_grad``;
- ``liger``: ``liger_kernel.chunked_loss.LigerFusedLinearDPOLoss`` with its reference model (CUDA
  only; one pair per chunk, ``torch.compile``d chunk step, no NLL), for the loss types it has.

The workload: ``x`` and ``ref_x`` of shape ``(B, T, H)`` with ``B`` counting chosen and rejected rows
together (``B = 2`` is one pair), the policy's and the reference's heads ``(V, H)``, targets drawn
uniformly with no ignored token, ``x`` and the policy's weight taking gradients, the reference
nothing, no bias; ``B = 2 … 16``, ``T = 1024``, ``H = 4096``, ``V = 128256``, bf16, ``β = 0.1``, sigmoid.

Floors: the policy's logits and the reference's, :math:`2BTHV` FLOPs each; with a gradient
``dx = dz W`` and ``dW = dz^\top x``: :func:`flops` (four products for ``full``).
"""

from __future__ import annotations

import torch

from kernels_lib import reference
from kernels_lib.fused_linear_dpo import fused_linear_dpo as kernels_lib_dpo
from .fused_linear_orpo import ignore_tokens
from .spec import Inputs, LossSpec, Provider, policy_and_reference, preference_sweep, require_cuda
from .trl_head import trl_provider

KERNEL_NAME = "fused_linear_dpo_loss"

#: Options of :func:`make_inputs` that shape the data rather than the call.
DATA_OPTIONS = ("bias", "ignore_fraction")

#: Liger 0.8's DPO loss types (``LigerFusedLinearDPOLoss._SUPPORTED_LOSS_TYPES``).
LIGER_LOSS_TYPES = ("sigmoid", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop")


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_dpo(x, weight, target, bias=None, *, ref_x=None, ref_weight=None, ref_bias=None, ref_logps=None, beta=0.1,
                  loss_type="sigmoid", loss_weights=None, label_smoothing=0.0, discopop_tau=0.05,
                  f_divergence_type="reverse_kl", ignore_index=-100, average_log_prob=False, chunk_size=None, accurate=False):
        del chunk_size, accurate  # ours alone: Liger runs its own defaults
        if ref_logps is not None:
            raise NotImplementedError("Liger's DPO takes a reference model, not its log-probs")
        if not isinstance(loss_type, str) or loss_type not in LIGER_LOSS_TYPES or loss_weights not in (None, [1.0], (1.0,)):
            raise NotImplementedError(f"Liger's DPO has one loss type among {', '.join(LIGER_LOSS_TYPES)}; got {loss_type!r}")
        if f_divergence_type != "reverse_kl":
            raise NotImplementedError("Liger's DPO has no f-divergences")
        key = (ignore_index, beta, loss_type, label_smoothing, discopop_tau, average_log_prob)
        if key not in modules:
            modules[key] = LigerFusedLinearDPOLoss(
                ignore_index=ignore_index, beta=beta, compute_nll_loss=False, use_ref_model=True,
                average_log_prob=average_log_prob, loss_type=loss_type, label_smoothing=label_smoothing,
                discopop_tau=discopop_tau,
            )
        # Liger's forward takes the weight first and returns (loss, aux outputs).
        return modules[key](weight, x, target, bias, ref_x, ref_weight, ref_bias)[0]

    return liger_dpo


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_dpo, "kernels_lib.fused_linear_dpo (Triton)"),
    "huggingface": Provider("huggingface", lambda: reference.fused_linear_dpo, "TRL 1.16's DPO on fp32 logits (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel.chunked_loss LigerFusedLinearDPOLoss"),
    "trl": trl_provider(reference.fused_linear_dpo, "DPO"),
}


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """Policy ``x`` ``(B, T, H)`` (chosen rows, then rejected) and ``weight`` ``(V, H)``, both requiring
    grad, the reference model's ``ref_x`` and ``ref_weight`` of the same shapes (no grad), int64 targets
    ``(B, T)`` with a fraction ``options["ignore_fraction"]`` at ``ignore_index`` (each sequence's first
    token kept valid); a bias ``(V,)`` on both heads when ``options["bias"]`` (the policy's requiring grad).

    ``x, ref_x ~ N(0, 1)``, heads ``~ N(0, 1/H)``: logits of unit scale. ``B`` must be even (pairs).
    The other options (``beta``, ``loss_type``, ...) go to the call.
    """
    device = torch.device(device)
    if int(sizes["B"]) % 2:
        raise ValueError(f"B counts chosen and rejected rows together and must be even; got {sizes['B']}")
    generator = torch.Generator(device=device).manual_seed(seed)
    (x, weight, bias), (ref_x, ref_weight, ref_bias), target = policy_and_reference(sizes, dtype, device, options, generator)
    ignore_tokens(target, options.get("ignore_fraction", 0.0), options.get("ignore_index", -100), generator)
    grad_inputs = [x, weight] + ([bias] if bias is not None else [])
    for tensor in grad_inputs:
        tensor.requires_grad_()
    kwargs = {
        "ref_x": ref_x, "ref_weight": ref_weight, "ref_bias": ref_bias,
        **{k: val for k, val in options.items() if k not in DATA_OPTIONS},
    }
    return Inputs(args=(x, weight, target, bias), kwargs=kwargs, grad_inputs=grad_inputs)


def flops(sizes: dict, mode: str) -> float:
    """Matmul FLOPs, ``2·B·T·H·V`` per product: the policy's and the reference's logits for the loss
    (``forward``, ``forward_no_grad``), ``dx`` and ``dW`` for the gradients (``backward``), all four for ``full``."""
    product = 2.0 * int(sizes["B"]) * int(sizes["T"]) * int(sizes["H"]) * int(sizes["V"])
    return product * {"forward": 2, "forward_no_grad": 2, "backward": 2, "full": 4}[mode]


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    """Bytes at least moved: read both models' hidden states and heads and the int64 targets; with a
    gradient write ``dx`` and ``dW``."""
    rows, h, v = int(sizes["B"]) * int(sizes["T"]), int(sizes["H"]), int(sizes["V"])
    item = torch.empty((), dtype=dtype).element_size()
    reads = 2 * (rows * h + v * h) * item + rows * 8
    return reads + (rows * h + v * h) * item if mode in ("backward", "full") else reads


SPEC = LossSpec(
    kernel_name=KERNEL_NAME,
    providers=PROVIDERS,
    make_inputs=make_inputs,
    **preference_sweep(),
    bytes_moved=bytes_moved,
    matmul_flops=flops,
    baseline="huggingface",
    default_options={"beta": 0.1, "loss_type": "sigmoid", "ignore_index": -100, "ignore_fraction": 0.0},
)
