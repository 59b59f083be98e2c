"""Generalized JSD as the workbench measures it: providers, inputs, the two published workloads, bytes moved.

Liger published two JSD charts: a vocabulary sweep (H100 PCIe, N = B·T = 8192 rows) and a token sweep
(B200, ``BT`` = 1024 … 8192 rows of V = 128256; ``benchmark_jsd.py``'s ``x_name`` "BT", float32
log-probabilities, β = 0.5). The first is ``SPEC.published``, the second the
preset ``published_tokens`` (``./workbench bench jsd --preset published_tokens``); the rows count is
``N`` in the one and ``BT`` in the other, as the charts name it.
"""

from __future__ import annotations

import torch

from kernels_lib import reference
from kernels_lib.jsd import jsd as kernels_lib_jsd
from . import kl_div
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


def rows_of(sizes: dict) -> int:
    """The number of rows: ``N`` (the vocabulary chart's name) or ``BT`` (the token chart's)."""
    return int(sizes["N"] if "N" in sizes else sizes["BT"])


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """Student log-probabilities (requires grad) and teacher log-probabilities, (rows, V); with the
    option ``ignore_fraction`` > 0, a ``target`` (rows,) whose entries are ``-100`` (ignored rows) at
    about that fraction of the rows."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    n, v = rows_of(sizes), int(sizes["V"])
    student = torch.randn(n, v, generator=generator, device=device).log_softmax(-1)
    teacher = torch.randn(n, v, generator=generator, device=device).log_softmax(-1)
    student = student.to(dtype).requires_grad_()
    kwargs = {"beta": options.get("beta", 0.5), "reduction": options.get("reduction", "batchmean")}
    kwargs.update(ignored_rows(n, options.get("ignore_fraction", 0.0), generator, device))
    return Inputs(args=(student, teacher.to(dtype)), kwargs=kwargs, grad_inputs=[student])


def ignored_rows(n: int, fraction: float, generator: torch.Generator, device) -> dict:
    """``{"target": labels}`` with ``-100`` at about ``fraction`` of the ``n`` rows (at least one
    row kept), or ``{}`` when ``fraction`` is 0."""
    if not fraction:
        return {}
    target = torch.randint(0, 7, (n,), generator=generator, device=device)
    target[torch.rand(n, generator=generator, device=device) < fraction] = -100
    target[0] = 3
    return {"target": target}


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    """KL's traffic (:func:`.kl_div.bytes_moved`): read two (rows, V) inputs, write the gradient."""
    return kl_div.bytes_moved({"N": rows_of(sizes), "V": sizes["V"]}, dtype, mode)


SPEC = LossSpec(
    kernel_name="jsd",
    providers=PROVIDERS,
    make_inputs=make_inputs,
    **vocab_sweep(8192),  # B=4, T=2048
    bytes_moved=bytes_moved,
    baseline="torch",
    default_options={"beta": 0.5, "reduction": "batchmean"},
    presets={
        "published_tokens": {
            "x_name": "BT",
            "x_label": "total tokens",
            "x_values": [1024, 2048, 4096, 8192],
            "sizes": {"V": 128256},
            "dtype": torch.float32,
        }
    },
)
