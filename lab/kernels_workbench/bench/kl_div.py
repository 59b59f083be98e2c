"""KL divergence as the workbench measures it: providers, inputs, the published workload, bytes moved."""

from __future__ import annotations

import torch

from kernels_lib import reference
from kernels_lib.kl_div import kl_div as kernels_lib_kl_div
from .spec import Inputs, LossSpec, Provider, require_cuda, vocab_sweep


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.transformers.kl_div import LigerKLDIVLoss

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_kl_div(input, target, reduction="batchmean", log_target=False):
        key = (reduction, log_target)
        if key not in modules:
            modules[key] = LigerKLDIVLoss(reduction=reduction, log_target=log_target)
        return modules[key](input, target)

    return liger_kl_div


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_kl_div, "kernels_lib.kl_div (Triton)"),
    "torch": Provider("torch", lambda: reference.kl_div, "torch.nn.functional.kl_div (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel LigerKLDIVLoss"),
}


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """Log-probabilities (requires grad) and target probabilities of shape (N, V), as the published harness draws them."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    n, v = int(sizes["N"]), int(sizes["V"])
    logits = torch.randn(n, v, generator=generator, device=device)
    target_logits = torch.randn(n, v, generator=generator, device=device)
    log_target = options.get("log_target", False)
    target = target_logits.log_softmax(-1) if log_target else target_logits.softmax(-1)
    input = logits.log_softmax(-1).to(dtype).requires_grad_()
    target = target.to(dtype)
    kwargs = {"reduction": options.get("reduction", "batchmean"), "log_target": log_target}
    return Inputs(args=(input, target), kwargs=kwargs, grad_inputs=[input])


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    """Bytes a fused kernel must move: read input and target; with a gradient, write it once more."""
    elements = int(sizes["N"]) * int(sizes["V"])
    item = torch.empty((), dtype=dtype).element_size()
    reads = 2 * elements * item
    return reads if mode == "forward_no_grad" else reads + elements * item


SPEC = LossSpec(
    kernel_name="kl_div",
    providers=PROVIDERS,
    make_inputs=make_inputs,
    **vocab_sweep(16384),  # B=8, T=2048
    bytes_moved=bytes_moved,
    baseline="torch",
    default_options={"reduction": "batchmean", "log_target": False},
)
