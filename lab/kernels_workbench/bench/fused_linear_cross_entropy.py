r"""Fused linear + cross-entropy as the workbench measures it: providers, inputs, floors, dial, precision.

Providers, each a thin adapter with the signature of :func:`kernels_lib.fused_linear_cross_entropy`
(so a sweep or a check swaps one for another):

- ``kernels_lib``: our function, default options (``dW`` accumulated in the parameter dtype);
  ``kernels_lib[accurate=True]``: the same with ``dW`` accumulated in float32. Any other point of the dial is a
  :func:`kernels_lib_variant` (e.g. ``kernels_lib[chunk_size=2048 accurate=False]``);
- ``torch``: :func:`kernels_lib.reference.fused_linear_cross_entropy`, logits materialized by a
  matmul in the input dtype and upcast to fp32, then ``F.cross_entropy``: the published "huggingface" provider (:data:`PUBLISHED_ALIASES`);
- ``liger``: ``LigerFusedLinearCrossEntropyLoss`` (CUDA only), its defaults (``dW`` accumulated in
  the parameter dtype);
- ``cce``: ``cut_cross_entropy.linear_cross_entropy`` (CUDA only) with ``shift=False``, ``mean``,
  ``ignore_index=-100`` as ours, and its default gradient filter;
- ``liger_sm90``: Liger's CuTe DSL kernel for Hopper,
  ``liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90.liger_fused_linear_cross_entropy_sm90``
  (compute capability 9.0, bf16, ``N`` and ``V`` multiples of its tiles, no bias or options; needs
  ``nvidia-cutlass-dsl``);
- ``quack``: ``quack.linear_cross_entropy.chunked_linear_cross_entropy`` (``quack-kernels`` 0.6.4 with
  its pinned ``nvidia-cutlass-dsl`` 4.6.2; CUDA, no bias or options), its default chunk of 4096 rows,
  ``use_scaled_exp=False``: its scaled-exp path raised a ValueError in ``full`` at ``H = 4096`` on a
  Hopper GPU. It forms the log-sum-exp in the logits GEMM's epilogue and accumulates ``dW`` in float32;
- ``torch_lce``: torch's own chunked ``F.linear_cross_entropy`` (torch >= 2.13) with
  ``options=LinearCrossEntropyOptions()``, its defaults (``acc_policy`` and ``chunking_method``
  ``"auto"``: on CUDA in half precision ``"compact"``, ``dW`` accumulated chunk by chunk in the
  parameter dtype, chunks of ``aspect_ratio:2``); ``torch_lce[acc_policy=accurate]``: the same with
  ``dW`` and the intermediates in float32, its counterpart of our ``accurate=True``. (``options=None``
  is torch's reference path, the logits materialized: our ``torch`` baseline.) Pure torch, so it runs
  on a CPU too; where torch lacks the function (the H200's torch 2.11) it runs torch 2.13's two files
  from the folder ``KERNELS_LIB_TORCH_LCE_FILES`` names (:mod:`.torch_lce`), else it is skipped, naming
  what is missing. Its chunked path has no label smoothing (torch falls back to the reference path), z-loss or
  softcap: refused.
- ``three_matmuls`` (:data:`FLOOR`): not a loss but the floor measured in the same run, the three
  products a fused loss cannot avoid and nothing else: the logits :math:`z = xW^\top` into an
  ``N × V`` buffer of the input dtype, and in backward :math:`dx = z\,W` and :math:`dW = z^\top x`
  with that buffer standing in for :math:`dz` (torch's matmuls: cuBLAS on a GPU). Its ``forward`` /
  ``forward_no_grad`` is the logits product alone. Its memory is that buffer's, not a fused loss's:
  only its time is a floor: ratios to the floor are judged against it, and no peer table counts it as a
  peer.

A provider whose package or GPU is missing is skipped, and the sweep's rows say why.

The arithmetic floor is the matmuls: one logits product :math:`z = xW^\top` of :math:`2NHV` FLOPs
without a gradient, and two more with one (:math:`dx = dz\,W`, :math:`dW = dz^\top x`):
:func:`flops`. The bytes floor (:func:`bytes_moved`) reads :math:`x`, :math:`W` and the targets and,
with a gradient, writes :math:`dx` and :math:`dW` once: at :math:`H = 4096, V = 128256` that is far
below what the matmuls take, so the loss is compute-bound and judged in TFLOP/s.
"""

from __future__ import annotations

import functools
import json

import pandas as pd
import torch

from .. import data
from kernels_lib import reference
from kernels_lib.fused_linear_cross_entropy import fused_linear_cross_entropy as kernels_lib_flce
from .spec import Inputs, LossSpec, Provider, require_cuda

KERNEL_NAME = "fused_linear_cross_entropy"

#: Names the published CSV uses for our providers: its "huggingface" is our ``torch`` baseline.
PUBLISHED_ALIASES = {"huggingface": "torch"}

#: Options of :func:`make_inputs` that shape the data rather than the call.
DATA_OPTIONS = ("bias", "ignore_fraction")


def variant_name(options: dict) -> str:
    """``kernels_lib[k=v ...]`` for the non-default options (``kernels_lib`` when there are none).

    Options are separated by spaces, not commas: the CLI splits ``--providers`` on commas.
    """
    shown = " ".join(f"{k}={v}" for k, v in options.items())
    return f"kernels_lib[{shown}]" if shown else "kernels_lib"


def kernels_lib_variant(**options) -> Provider:
    """Our function with ``options`` (``chunk_size``, ``accurate``) bound: one point of the dial."""
    fn = functools.partial(kernels_lib_flce, **options) if options else kernels_lib_flce
    return Provider(variant_name(options), lambda: fn, f"kernels_lib.fused_linear_cross_entropy({options})")


def _peer_options(peer: str, chunk_size, accurate, return_z_loss) -> None:
    """The peers take our signature; ``chunk_size``/``accurate`` are ours alone and are ignored
    (each peer runs its own defaults), ``return_z_loss`` is refused (the outputs differ)."""
    del chunk_size, accurate
    if return_z_loss:
        raise NotImplementedError(f"the {peer} adapter returns the loss only")


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_flce(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   z_loss_scale=0.0, softcap=None, return_z_loss=False, chunk_size=None, accurate=True):
        _peer_options("Liger", chunk_size, accurate, return_z_loss)
        key = (ignore_index, reduction, label_smoothing, z_loss_scale, softcap)
        if key not in modules:
            modules[key] = LigerFusedLinearCrossEntropyLoss(
                ignore_index=ignore_index, lse_square_scale=z_loss_scale, label_smoothing=label_smoothing,
                reduction=reduction, softcap=softcap,
            )
        # Liger's forward takes the weight first: forward(lin_weight, _input, target, bias).
        return modules[key](weight, x.reshape(-1, x.shape[-1]), target.reshape(-1), bias)

    return liger_flce


def _load_cce():
    require_cuda("CCE")
    from cut_cross_entropy import linear_cross_entropy

    def cce_flce(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                 z_loss_scale=0.0, softcap=None, return_z_loss=False, chunk_size=None, accurate=True):
        _peer_options("CCE", chunk_size, accurate, return_z_loss)
        if bias is not None or label_smoothing or z_loss_scale:
            raise NotImplementedError("cut_cross_entropy 25.1 has no bias, label smoothing or z-loss")
        # shift=False: targets aligned with the rows, as ours (CCE can shift them itself).
        return linear_cross_entropy(
            x, weight, target, ignore_index=ignore_index, softcap=softcap, reduction=reduction, shift=False
        )

    return cce_flce


def _plain_peer(peer: str, bias, label_smoothing, z_loss_scale, softcap) -> None:
    """Refuse what the CuTe DSL peers do not compute: bias, label smoothing, z-loss, softcap."""
    if bias is not None or label_smoothing or z_loss_scale or softcap is not None:
        raise NotImplementedError(f"{peer} has no bias, label smoothing, z-loss or softcap")


def _load_liger_sm90():
    require_cuda("Liger's CuTe DSL FLCE")
    from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import liger_fused_linear_cross_entropy_sm90

    if torch.cuda.get_device_capability() != (9, 0):
        raise RuntimeError("Liger's CuTe DSL FLCE is written for Hopper (compute capability 9.0)")

    def liger_sm90_flce(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                        z_loss_scale=0.0, softcap=None, return_z_loss=False, chunk_size=None, accurate=True):
        _peer_options("Liger sm90", chunk_size, accurate, return_z_loss)
        _plain_peer("Liger's CuTe DSL FLCE", bias, label_smoothing, z_loss_scale, softcap)
        return liger_fused_linear_cross_entropy_sm90(
            x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), ignore_index=ignore_index, reduction=reduction
        )

    return liger_sm90_flce


def _load_quack():
    require_cuda("QuACK")
    from quack.linear_cross_entropy import chunked_linear_cross_entropy

    def quack_flce(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   z_loss_scale=0.0, softcap=None, return_z_loss=False, chunk_size=None, accurate=True):
        _peer_options("QuACK", chunk_size, accurate, return_z_loss)
        _plain_peer("QuACK", bias, label_smoothing, z_loss_scale, softcap)
        return chunked_linear_cross_entropy(
            x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), ignore_index=ignore_index, reduction=reduction,
            use_scaled_exp=False,
        )

    return quack_flce


TORCH_LCE_POLICIES = {"torch_lce": None, "torch_lce[acc_policy=accurate]": "accurate"}


def _load_torch_lce(acc_policy: str | None):
    """torch's ``F.linear_cross_entropy`` on its chunked path, ``acc_policy`` set (None: its "auto");
    torch 2.13's files on an older torch (:func:`.torch_lce.load`)."""
    from . import torch_lce as torch_lce_files

    function, options_class, _ = torch_lce_files.load()
    options = options_class() if acc_policy is None else options_class(acc_policy=acc_policy)

    def torch_lce(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                  z_loss_scale=0.0, softcap=None, return_z_loss=False, chunk_size=None, accurate=True):
        _peer_options("torch's linear_cross_entropy", chunk_size, accurate, return_z_loss)
        if label_smoothing or z_loss_scale or softcap is not None:
            raise NotImplementedError(
                "torch's chunked linear_cross_entropy has no label smoothing (it falls back to the reference path), "
                "z-loss or softcap"
            )
        loss = function(
            x.reshape(-1, x.shape[-1]), weight, target.reshape(-1), linear_bias=bias, reduction=reduction,
            ignore_index=ignore_index, options=options,
        )
        return loss.reshape(target.shape) if reduction == "none" else loss

    return torch_lce


#: The floor's provider name (:func:`_load_three_matmuls`).
FLOOR = "three_matmuls"


class _ThreeMatmuls(torch.autograd.Function):
    """The logits product in forward, the two gradient products in backward (the logits buffer as
    ``dz``); the returned scalar is one logit, so backward starts from it without another pass."""

    @staticmethod
    def forward(ctx, x, weight):
        logits = x @ weight.T
        ctx.save_for_backward(x, weight, logits)
        return logits[0, 0].float()

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, logits = ctx.saved_tensors
        return logits @ weight, logits.T @ x


def _load_three_matmuls():
    def three_matmuls(x, weight, target, bias=None, *, chunk_size=None, accurate=True, return_z_loss=False, **options):
        """The floor at ``x``'s and ``weight``'s shapes; the loss's options (and ``bias``, a vector)
        do not change the three products, so they are accepted and unused."""
        _peer_options("three matmuls", chunk_size, accurate, return_z_loss)
        del target, bias, options
        return _ThreeMatmuls.apply(x.reshape(-1, x.shape[-1]), weight)

    return three_matmuls


PROVIDERS = {
    "kernels_lib": kernels_lib_variant(),
    "kernels_lib[accurate=True]": kernels_lib_variant(accurate=True),
    "torch": Provider("torch", lambda: reference.fused_linear_cross_entropy, "fp32 logits + F.cross_entropy (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel LigerFusedLinearCrossEntropyLoss"),
    "cce": Provider("cce", _load_cce, "cut_cross_entropy.linear_cross_entropy"),
    "liger_sm90": Provider("liger_sm90", _load_liger_sm90, "Liger-Kernel's CuTe DSL FLCE for Hopper (sm90)"),
    "quack": Provider("quack", _load_quack, "quack.linear_cross_entropy.chunked_linear_cross_entropy"),
    **{
        name: Provider(name, functools.partial(_load_torch_lce, policy),
                       f"torch.nn.functional.linear_cross_entropy, LinearCrossEntropyOptions(acc_policy={policy or 'auto'!r})")
        for name, policy in TORCH_LCE_POLICIES.items()
    },
    FLOOR: Provider(FLOOR, _load_three_matmuls, "the floor: logits, dx and dW as three torch matmuls (cuBLAS on a GPU), nothing else"),
}


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """``x`` (N, H) and ``weight`` (V, H), both requiring grad, and int64 targets of which a fraction
    ``options["ignore_fraction"]`` is ``ignore_index``; a bias (V,) when ``options["bias"]``.

    ``x ~ N(0, 1)`` and ``W ~ N(0, 1/H)`` give logits of unit scale: the softmax is dense, as on the
    published benchmark's random data (a gradient filter such as CCE's skips nothing). The other
    options are passed to the call.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    n, h, v = int(sizes["N"]) if "N" in sizes else int(sizes["BT"]), int(sizes["H"]), int(sizes["V"])
    x = torch.randn(n, h, generator=generator, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=generator, device=device) * h**-0.5).to(dtype).requires_grad_()
    bias = (torch.randn(v, generator=generator, device=device) * 0.1).to(dtype).requires_grad_() if options.get("bias") else None
    ignore_index = options.get("ignore_index", -100)
    target = torch.randint(0, v, (n,), generator=generator, device=device)
    ignored = torch.randperm(n, generator=generator, device=device)[: round(options.get("ignore_fraction", 0.0) * n)]
    target[ignored] = ignore_index
    kwargs = {k: val for k, val in options.items() if k not in DATA_OPTIONS}
    grad_inputs = [x, weight] + ([bias] if bias is not None else [])
    return Inputs(args=(x, weight, target, bias), kwargs=kwargs, grad_inputs=grad_inputs)


def _nhv(sizes: dict) -> tuple[int, int, int]:
    n = sizes["N"] if "N" in sizes else sizes["BT"]
    return int(n), int(sizes["H"]), int(sizes["V"])


def flops(sizes: dict, mode: str) -> float:
    """The matmul FLOPs a call must do: ``2·N·H·V`` per product; 1 product for the loss alone
    (``forward``, ``forward_no_grad``), 2 for the gradients (``backward``), 3 for ``full``."""
    n, h, v = _nhv(sizes)
    products = {"forward": 1, "forward_no_grad": 1, "backward": 2, "full": 3}[mode]
    return 2.0 * n * h * v * products


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    """Bytes at least moved: read ``x``, ``W`` (input dtype) and the int64 targets; with a gradient
    (``backward``, ``full``) write ``dx`` and ``dW`` too."""
    n, h, v = _nhv(sizes)
    item = torch.empty((), dtype=dtype).element_size()
    reads = (n * h + v * h) * item + n * 8
    return reads + (n * h + v * h) * item if mode in ("backward", "full") else reads


SPEC = LossSpec(
    kernel_name=KERNEL_NAME,
    providers=PROVIDERS,
    make_inputs=make_inputs,
    published={
        "x_name": "BT",
        "x_label": "tokens",
        "x_values": [4096, 8192, 16384],
        "sizes": {"H": 4096, "V": 128256},
        "dtype": torch.bfloat16,
    },
    small={
        "x_name": "BT",
        "x_label": "tokens",
        "x_values": [8, 16, 32],
        "sizes": {"H": 64, "V": 1031},
        "dtype": torch.bfloat16,
    },
    presets={
        # The CCE paper's workload (studies/bench/cce_paper.py): 8192 tokens of Gemma 2 (2B)'s head.
        "cce_gemma2": {"x_name": "BT", "x_label": "tokens", "x_values": [8192], "sizes": {"H": 2304, "V": 256000},
                       "dtype": torch.bfloat16},
    },
    bytes_moved=bytes_moved,
    matmul_flops=flops,
    own_matmuls=FLOOR,
    baseline="torch",
    default_options={"reduction": "mean", "ignore_index": -100, "ignore_fraction": 0.05},
)

def published_rows() -> pd.DataFrame:
    """Liger's published rows of this loss (A100), providers renamed as ours (:data:`PUBLISHED_ALIASES`)."""
    rows = data.load_published(KERNEL_NAME)
    return rows.assign(kernel_provider=rows.kernel_provider.replace(PUBLISHED_ALIASES))


def is_published_workload(rows: pd.DataFrame) -> pd.Series:
    """Which measured rows are at the published chart's sizes (``H = 4096, V = 128256``, any N): the CSV
    also keeps other workloads' runs (the CCE paper's, ``studies/bench/cce_paper.py``), which are not the chart's."""
    sizes = SPEC.published["sizes"]
    if not len(rows):
        return pd.Series(dtype=bool, index=rows.index)
    config = rows.extra_benchmark_config_str.map(json.loads)
    return config.map(lambda c: all(c.get(k) == v for k, v in sizes.items())).astype(bool)
