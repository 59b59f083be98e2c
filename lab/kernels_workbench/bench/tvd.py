"""Total variation distance as the workbench measures it: providers, inputs, the published workload, bytes moved."""

from __future__ import annotations

import torch

from kernels_lib import reference
from kernels_lib.tvd import tvd as kernels_lib_tvd
from .jsd import ignored_rows
from .kl_div import bytes_moved  # the same traffic: read two (N, V) inputs, write the gradient
from .spec import Inputs, LossSpec, Provider, require_cuda, vocab_sweep


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.transformers.tvd import LigerTVDLoss

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_tvd(p, q, *, ignore_index=-100, target=None, reduction="batchmean"):
        key = (reduction, ignore_index)
        if key not in modules:
            modules[key] = LigerTVDLoss(reduction=reduction, ignore_index=ignore_index)
        return modules[key](p, q, target)

    return liger_tvd


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_tvd, "kernels_lib.tvd (Triton)"),
    "torch": Provider("torch", lambda: reference.tvd, "0.5 * (p - q).abs() in torch (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel LigerTVDLoss"),
}


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """Probabilities p (requires grad) and q, (N, V); with the option ``ignore_fraction`` > 0, a
    ``target`` ignoring about that fraction of the rows (:func:`.jsd.ignored_rows`)."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    n, v = int(sizes["N"]), int(sizes["V"])
    p = torch.randn(n, v, generator=generator, device=device).softmax(-1)
    q = torch.randn(n, v, generator=generator, device=device).softmax(-1)
    p = p.to(dtype).requires_grad_()
    kwargs = {"reduction": options.get("reduction", "batchmean"), **ignored_rows(n, options.get("ignore_fraction", 0.0), generator, device)}
    return Inputs(args=(p, q.to(dtype)), kwargs=kwargs, grad_inputs=[p])


SPEC = LossSpec(
    kernel_name="tvd",
    providers=PROVIDERS,
    make_inputs=make_inputs,
    **vocab_sweep(16384),  # B=8, T=2048
    bytes_moved=bytes_moved,
    baseline="torch",
    default_options={"reduction": "batchmean"},
)
