"""Generalized JSD as the workbench measures it: providers, inputs, the published workload, bytes moved."""

from __future__ import annotations

import torch

from ... import reference
from ...jsd import jsd as kernels_lib_jsd
from .kl_div import bytes_moved  # the same traffic: read two (N, V) inputs, write the gradient
from .spec import Inputs, LossSpec, Provider, require_cuda, vocab_sweep


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.transformers.jsd import LigerJSD

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_jsd(student_logp, teacher_logp, *, beta=0.5, ignore_index=-100, target=None, reduction="batchmean"):
        # LigerJSD(beta)(log_q=student, log_p=teacher): the same beta as ours and TRL's (kernels_lib.jsd).
        if reduction != "batchmean":
            raise ValueError(f"LigerJSD only reduces by the non-ignored rows (batchmean); got {reduction!r}")
        key = (beta, ignore_index)
        if key not in modules:
            modules[key] = LigerJSD(beta=beta, ignore_index=ignore_index)
        return modules[key](student_logp, teacher_logp, target)

    return liger_jsd


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_jsd, "kernels_lib.jsd (Triton)"),
    "torch": Provider("torch", lambda: reference.jsd, "TRL generalized_jsd_loss composition (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel LigerJSD"),
}


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """Student log-probabilities (requires grad) and teacher log-probabilities, (N, V)."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    n, v = int(sizes["N"]), int(sizes["V"])
    student = torch.randn(n, v, generator=generator, device=device).log_softmax(-1)
    teacher = torch.randn(n, v, generator=generator, device=device).log_softmax(-1)
    student = student.to(dtype).requires_grad_()
    kwargs = {"beta": options.get("beta", 0.5), "reduction": options.get("reduction", "batchmean")}
    return Inputs(args=(student, teacher.to(dtype)), kwargs=kwargs, grad_inputs=[student])


SPEC = LossSpec(
    kernel_name="jsd",
    providers=PROVIDERS,
    make_inputs=make_inputs,
    **vocab_sweep(8192),  # B=4, T=2048
    bytes_moved=bytes_moved,
    baseline="torch",
    default_options={"beta": 0.5, "reduction": "batchmean"},
)
