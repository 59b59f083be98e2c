r"""Cross-entropy on materialized logits as the workbench measures it: the ``cross_entropy`` chart.

Published workload (Liger's ``benchmark_cross_entropy.py``, A100): ``B·T = 8 × 2048`` rows of
float32 logits, ``V`` = 4096 … 131072, targets uniform, ``mean``; providers ``liger`` and
``huggingface`` (``torch.nn.CrossEntropyLoss``). Ours, each a thin adapter with the signature of
:func:`kernels_lib.cross_entropy`:

- ``kernels_lib``: our function, defaults (gradient in a buffer of its own);
- ``torch``: :func:`kernels_lib.reference.cross_entropy`, ``F.cross_entropy`` on float32 logits: the
  published "huggingface" provider (:data:`PUBLISHED_ALIASES`);
- ``liger``: ``liger_kernel.transformers.functional.liger_cross_entropy`` (CUDA only), which writes
  the gradient over the logits.

The floor (:func:`bytes_moved`) reads the logits once and, with a gradient, writes it once:
memory-bound, judged against the copy bandwidth. :mod:`.megatron_cross_entropy` is the H100 chart of
the same loss against Megatron-LM's.
"""

from __future__ import annotations

import pandas as pd
import torch

from .. import data
from kernels_lib import reference
from kernels_lib.cross_entropy import cross_entropy as kernels_lib_cross_entropy
from .spec import Inputs, LossSpec, Provider, require_cuda

KERNEL_NAME = "cross_entropy"

#: Names the published CSV uses for our providers: its "huggingface" is our ``torch`` baseline.
PUBLISHED_ALIASES = {"huggingface": "torch"}

#: Options of :func:`make_inputs` that shape the data rather than the call.
DATA_OPTIONS = ("ignore_fraction",)

#: The published chart's vocabulary axis.
VOCAB_AXIS = {"x_name": "V", "x_label": "vocab size", "x_values": [4096, 8192, 16384, 32768, 65536, 131072]}
#: The CPU presets' vocabulary axis (Triton's interpreter is slow).
SMALL_VOCAB_AXIS = {"x_name": "V", "x_label": "vocab size", "x_values": [512, 1024, 2048, 4096]}


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.transformers.functional import liger_cross_entropy

    def liger(logits, target, *, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              inplace=False, host_checks=True):
        del inplace, host_checks  # Liger always writes the gradient over the logits and checks nothing on the host
        return liger_cross_entropy(
            logits, target, weight=weight, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing,
        )

    return liger


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_cross_entropy, "kernels_lib.cross_entropy (Triton)"),
    "torch": Provider("torch", lambda: reference.cross_entropy, "F.cross_entropy on float32 logits (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel liger_cross_entropy"),
}


def n_rows(sizes: dict) -> int:
    """Rows of logits: ``B·T`` (this chart), ``S·B`` (the Megatron chart) or ``N``."""
    if "N" in sizes:
        return int(sizes["N"])
    return int(sizes["B"]) * int(sizes["T"] if "T" in sizes else sizes["S"])


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """``(N, V)`` logits ``~ N(0, 1)`` in ``dtype`` (requires grad), as the published harness draws
    them, and uniform int64 targets of which a fraction ``options["ignore_fraction"]`` is
    ``ignore_index``. The other options are passed to the call."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    n, v = n_rows(sizes), int(sizes["V"])
    logits = torch.randn(n, v, generator=generator, device=device).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=generator, device=device)
    ignored = torch.randperm(n, generator=generator, device=device)[: round(options.get("ignore_fraction", 0.0) * n)]
    target[ignored] = options.get("ignore_index", -100)
    kwargs = {k: val for k, val in options.items() if k not in DATA_OPTIONS}
    return Inputs(args=(logits, target), kwargs=kwargs, grad_inputs=[logits])


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    """Bytes at least moved: read the logits and the int64 targets; with a gradient (every mode but
    ``forward_no_grad``: a fused kernel forms it in forward), write it once."""
    elements = n_rows(sizes) * int(sizes["V"])
    item = torch.empty((), dtype=dtype).element_size()
    reads = elements * item + n_rows(sizes) * 8
    return reads if mode == "forward_no_grad" else reads + elements * item


SPEC = LossSpec(
    kernel_name=KERNEL_NAME,
    providers=PROVIDERS,
    make_inputs=make_inputs,
    published={**VOCAB_AXIS, "sizes": {"B": 8, "T": 2048}, "dtype": torch.float32},
    small={**SMALL_VOCAB_AXIS, "sizes": {"B": 2, "T": 8}, "dtype": torch.float32},
    bytes_moved=bytes_moved,
    baseline="torch",
    default_options={"reduction": "mean"},
)


def published_rows() -> pd.DataFrame:
    """Liger's published rows of this chart (A100), providers renamed as ours (:data:`PUBLISHED_ALIASES`)."""
    rows = data.load_published(KERNEL_NAME)
    return rows.assign(kernel_provider=rows.kernel_provider.replace(PUBLISHED_ALIASES))
