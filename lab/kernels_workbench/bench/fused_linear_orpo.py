r"""Fused linear + ORPO as the workbench measures it: providers, inputs, the published workload, floors.

Providers, each a thin adapter with the signature of :func:`kernels_lib.fused_linear_orpo`
(returning a result with ``.loss``, or the loss tensor):

- ``kernels_lib``: our function, default options;
- ``huggingface``: :func:`kernels_lib.reference.fused_linear_orpo`, TRL's ORPO on full logits
  (a matmul in the input dtype, upcast to fp32): the published "huggingface" provider;
- ``liger``: ``liger_kernel.chunked_loss.LigerFusedLinearORPOLoss`` (CUDA only), its defaults
  (one pair per chunk, ``torch.compile``d chunk step, NLL on the chosen half).

The published workload (Liger's ``benchmark_orpo_loss.py``, A100): ``x`` of shape ``(B, T, H)``
with ``B`` **counting chosen and rejected rows together** (the first ``B/2`` chosen, the rest
rejected: ``B = 2`` is one pair), targets drawn uniformly with no ignored token, ``x`` and the
head's weight taking gradients, no bias; ``T = 1024`` (also ``T = 4096`` in the CSV), ``H = 4096``,
``V = 128256``, bf16.

Floors: ``B·T`` rows meet the head, so one logits product is :math:`2BTHV` FLOPs and ``full``
(logits, ``dx = dz W``, ``dW = dz^\top x``) is three of them (:func:`flops`); the bytes floor reads
``x``, ``W`` and the targets and, with a gradient, writes ``dx`` and ``dW`` (:func:`bytes_moved`).
"""

from __future__ import annotations

import json

import pandas as pd
import torch

from kernels_lib import reference
from kernels_lib.fused_linear_orpo import fused_linear_orpo as kernels_lib_orpo
from .. import data
from .spec import Inputs, LossSpec, Provider, preference_sweep, require_cuda

KERNEL_NAME = "fused_linear_orpo_loss"

#: Options of :func:`make_inputs` that shape the data rather than the call.
DATA_OPTIONS = ("bias", "ignore_fraction")


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.chunked_loss import LigerFusedLinearORPOLoss

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_orpo(x, weight, target, bias=None, *, beta=0.1, ignore_index=-100, nll_target=None,
                   chunk_size=None, accurate=False):
        del chunk_size, accurate  # ours alone: Liger runs its own defaults
        key = (ignore_index, beta)
        if key not in modules:
            modules[key] = LigerFusedLinearORPOLoss(ignore_index=ignore_index, beta=beta)
        # Liger's forward takes the weight first and returns (loss, aux outputs).
        return modules[key](weight, x, target, bias, nll_target)[0]

    return liger_orpo


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_orpo, "kernels_lib.fused_linear_orpo (Triton)"),
    "huggingface": Provider(
        "huggingface", lambda: reference.fused_linear_orpo, "TRL's ORPO on fp32 logits (the baseline)"
    ),
    "liger": Provider("liger", _load_liger, "liger_kernel.chunked_loss LigerFusedLinearORPOLoss"),
}


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """``x`` ``(B, T, H)`` (chosen rows, then rejected) and ``weight`` ``(V, H)``, both requiring grad,
    int64 targets ``(B, T)`` of which a fraction ``options["ignore_fraction"]`` is ``ignore_index``
    (never a whole sequence: its first token stays valid); a bias ``(V,)`` when ``options["bias"]``.

    ``x ~ N(0, 1)`` and ``W ~ N(0, 1/H)``: logits of unit scale, as on the published random data.
    ``B`` must be even (pairs). The other options (``beta``, ``ignore_index``) go to the call.
    """
    device = torch.device(device)
    b, t, h, v = (int(sizes[k]) for k in ("B", "T", "H", "V"))
    if b % 2:
        raise ValueError(f"B counts chosen and rejected rows together and must be even; got {b}")
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(b, t, h, generator=generator, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=generator, device=device) * h**-0.5).to(dtype).requires_grad_()
    bias = (torch.randn(v, generator=generator, device=device) * 0.1).to(dtype).requires_grad_() if options.get("bias") else None
    target = torch.randint(0, v, (b, t), generator=generator, device=device)
    ignore_tokens(target, options.get("ignore_fraction", 0.0), options.get("ignore_index", -100), generator)
    kwargs = {k: val for k, val in options.items() if k not in DATA_OPTIONS}
    grad_inputs = [x, weight] + ([bias] if bias is not None else [])
    return Inputs(args=(x, weight, target, bias), kwargs=kwargs, grad_inputs=grad_inputs)


def ignore_tokens(target: torch.Tensor, fraction: float, ignore_index: int, generator: torch.Generator) -> None:
    """Set ``round(fraction · B·(T−1))`` random positions of ``target`` ``(B, T)`` other than the
    first of each sequence to ``ignore_index``, in place: every sequence keeps a valid token."""
    b, t = target.shape
    positions = torch.randperm(b * (t - 1), generator=generator, device=target.device)[: round(fraction * b * (t - 1))]
    target[positions // (t - 1), positions % (t - 1) + 1] = ignore_index


def flops(sizes: dict, mode: str) -> float:
    """Matmul FLOPs: ``2·B·T·H·V`` per product; 1 for the loss alone, 2 for the gradients
    (``backward``), 3 for ``full``."""
    rows = int(sizes["B"]) * int(sizes["T"])
    products = {"forward": 1, "forward_no_grad": 1, "backward": 2, "full": 3}[mode]
    return 2.0 * rows * int(sizes["H"]) * int(sizes["V"]) * products


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    """Bytes at least moved: read ``x``, ``W`` and the int64 targets; with a gradient write ``dx``, ``dW``."""
    rows, h, v = int(sizes["B"]) * int(sizes["T"]), int(sizes["H"]), int(sizes["V"])
    item = torch.empty((), dtype=dtype).element_size()
    reads = (rows * h + v * h) * item + rows * 8
    return reads + (rows * h + v * h) * item if mode in ("backward", "full") else reads


def published_rows(seq_len: int | None = None) -> pd.DataFrame:
    """Liger's published rows of ORPO (A100) with their ``T`` as a column, optionally only ``T = seq_len``."""
    rows = data.load_published(KERNEL_NAME)
    rows = rows.assign(T=[json.loads(c)["T"] for c in rows.extra_benchmark_config_str])
    return rows if seq_len is None else rows[rows["T"] == seq_len].reset_index(drop=True)


SPEC = LossSpec(
    kernel_name=KERNEL_NAME,
    providers=PROVIDERS,
    make_inputs=make_inputs,
    **preference_sweep(),
    # The published chart's second sequence length (the A100 rows hold T = 1024 and T = 4096).
    presets={"published_t4096": {**preference_sweep()["published"], "sizes": {"T": 4096, "H": 4096, "V": 128256}}},
    bytes_moved=bytes_moved,
    matmul_flops=flops,
    baseline="huggingface",
    default_options={"beta": 0.1, "ignore_index": -100, "ignore_fraction": 0.0},
)
