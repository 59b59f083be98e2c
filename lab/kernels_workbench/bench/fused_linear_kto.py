r"""Fused linear + KTO as the workbench measures it: providers, inputs, the published workload, floors.

Providers, each a thin adapter with the signature of :func:`kernels_lib.fused_linear_kto`
(returning a result with ``.loss``, or the loss tensor):

- ``kernels_lib``: our function, default options (the reference model through the same chunks,
  without gradient);
- ``huggingface``: :func:`kernels_lib.reference.fused_linear_kto`, TRL 1.16's KTO loss on full
  logits (matmuls in the input dtype, upcast to fp32): the published "huggingface" provider;
- ``liger``: ``liger_kernel.chunked_loss.LigerFusedLinearKTOLoss`` with its reference model
  (CUDA only; ``torch.compile``d chunk step, which fails under torch 2.11: the sweep records the
  error as the row's note).

The published workload (Liger's ``benchmark_kto_loss.py``, H100): ``B`` unpaired sequences of
``T = 512`` tokens, ``H = 1024``, ``V = 128256``, bf16, a bias on both heads, ``β = 0.1``,
``ignore_index = 42`` with a random share of the targets set to it (about a quarter on average:
here ``ignore_fraction = 0.25``), random preference labels and a random precomputed ``kl``. Only the
policy head's weight and bias take gradients there (the hidden states do not): ``input_grad=False``
by default, ``True`` to also form ``dx`` as a trainer would.

Floors: the policy's logits :math:`2BTHV` FLOPs, the reference's the same again; with a gradient
``dW = dz^\top x`` (and ``dx = dz W`` with ``input_grad``): :func:`flops`.
"""

from __future__ import annotations

import torch

from .. import data
from kernels_lib import reference
from kernels_lib.fused_linear_kto import fused_linear_kto as kernels_lib_kto
from .fused_linear_orpo import ignore_tokens
from .spec import Inputs, LossSpec, Provider, policy_and_reference, require_cuda

KERNEL_NAME = "kto_loss"

#: Options of :func:`make_inputs` that shape the data rather than the call.
DATA_OPTIONS = ("bias", "ignore_fraction", "input_grad")


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.chunked_loss import LigerFusedLinearKTOLoss

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_kto(x, weight, target, preference_labels, kl=None, *, bias=None, ref_x=None, ref_weight=None,
                  ref_bias=None, ref_logps=None, beta=0.1, ignore_index=-100, average_log_prob=False,
                  desirable_weight=1.0, undesirable_weight=1.0, chunk_size=None, accurate=False):
        del chunk_size, accurate  # ours alone: Liger runs its own defaults
        if ref_logps is not None or desirable_weight != 1.0 or undesirable_weight != 1.0:
            raise NotImplementedError("Liger's KTO takes a reference model, not its log-probs, and has no example weights")
        key = (ignore_index, beta, average_log_prob)
        if key not in modules:
            modules[key] = LigerFusedLinearKTOLoss(
                ignore_index=ignore_index, beta=beta, use_ref_model=True, average_log_prob=average_log_prob
            )
        out = modules[key](x, weight, target, bias, preference_labels, ref_x, ref_weight, ref_bias, kl)
        return out[0]  # (loss, aux outputs)

    return liger_kto


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_kto, "kernels_lib.fused_linear_kto (Triton)"),
    "huggingface": Provider("huggingface", lambda: reference.fused_linear_kto, "TRL 1.16's KTO on fp32 logits (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel.chunked_loss LigerFusedLinearKTOLoss"),
}


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """Policy ``x`` ``(B, T, H)``, ``weight`` ``(V, H)`` (and bias ``(V,)`` with ``options["bias"]``),
    the reference model's ``ref_x``, ``ref_weight`` (, ``ref_bias``) of the same shapes, targets
    ``(B, T)`` with a fraction ``options["ignore_fraction"]`` at ``ignore_index`` (each sequence's
    first token kept valid), random bool labels and a random scalar ``kl``.

    The policy's weight and bias take gradients, ``x`` too with ``options["input_grad"]``; the
    reference takes none. ``x, ref_x ~ N(0, 1)``, heads ``~ N(0, 1/H)``: logits of unit scale.
    """
    device = torch.device(device)
    b, v = int(sizes["B"]), int(sizes["V"])
    ignore_index = options.get("ignore_index", -100)
    generator = torch.Generator(device=device).manual_seed(seed)
    (x, weight, bias), (ref_x, ref_weight, ref_bias), target = policy_and_reference(sizes, dtype, device, options, generator)
    # A drawn target equal to ignore_index is ignored too (as in the published harness), except the first.
    target[:, 0] = torch.where(target[:, 0] == ignore_index, (ignore_index + 1) % v, target[:, 0])
    ignore_tokens(target, options.get("ignore_fraction", 0.0), ignore_index, generator)
    labels = torch.rand(b, generator=generator, device=device) < 0.5
    kl = torch.randn((), generator=generator, device=device)
    grad_inputs = ([x] if options.get("input_grad") else []) + [weight] + ([bias] if bias is not None else [])
    for tensor in grad_inputs:
        tensor.requires_grad_()
    kwargs = {
        "bias": bias, "ref_x": ref_x, "ref_weight": ref_weight, "ref_bias": ref_bias,
        **{k: val for k, val in options.items() if k not in DATA_OPTIONS},
    }
    return Inputs(args=(x, weight, target, labels, kl), kwargs=kwargs, grad_inputs=grad_inputs)


def flops(sizes: dict, mode: str, input_grad: bool = False) -> float:
    """Matmul FLOPs, ``2·B·T·H·V`` per product: the policy's and the reference's logits for the loss
    (``forward``, ``forward_no_grad``), ``dW`` (and ``dx`` with ``input_grad``) for the gradients
    (``backward``), both for ``full``."""
    product = 2.0 * int(sizes["B"]) * int(sizes["T"]) * int(sizes["H"]) * int(sizes["V"])
    gradients = 1 + int(input_grad)
    products = {"forward": 2, "forward_no_grad": 2, "backward": gradients, "full": 2 + gradients}[mode]
    return product * products


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    """Bytes at least moved: read both models' hidden states and heads and the int64 targets; with a
    gradient write ``dW`` (the published harness's only gradient besides the bias's)."""
    rows, h, v = int(sizes["B"]) * int(sizes["T"]), int(sizes["H"]), int(sizes["V"])
    item = torch.empty((), dtype=dtype).element_size()
    reads = 2 * (rows * h + v * h) * item + rows * 8
    return reads + v * h * item if mode in ("backward", "full") else reads


def published_rows():
    """Liger's published rows of KTO (H100)."""
    return data.load_published(KERNEL_NAME)


SPEC = LossSpec(
    kernel_name=KERNEL_NAME,
    providers=PROVIDERS,
    make_inputs=make_inputs,
    published={
        "x_name": "B",
        "x_label": "Batch Size (B)",
        "x_values": [2, 4, 8, 16, 32],
        "sizes": {"T": 512, "H": 1024, "V": 128256},
        "dtype": torch.bfloat16,
    },
    small={
        "x_name": "B",
        "x_label": "Batch Size (B)",
        "x_values": [2, 4, 8],
        "sizes": {"T": 8, "H": 32, "V": 257},
        "dtype": torch.bfloat16,
    },
    bytes_moved=bytes_moved,
    matmul_flops=flops,
    baseline="huggingface",
    default_options={"beta": 0.1, "ignore_index": 42, "bias": True, "ignore_fraction": 0.25, "input_grad": False},
)
