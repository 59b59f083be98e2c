"""What the Gluon kernels share: Gluon's Hopper imports (or why they are missing) and the GPU's SM count.

Gluon (``triton.experimental.gluon``) ships with Triton >= 3.4; where it is missing or lacks the Hopper
pieces, :data:`GLUON_IMPORT_ERROR` says why and the names below are not defined, so each kernel module
defines its kernels only ``if GLUON_IMPORT_ERROR is None`` and its launcher takes its fallback.
"""

from __future__ import annotations

import functools

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # The TMA load's name: ``async_copy_global_to_shared`` in Triton 3.6 (the H200's), ``async_load``
    # since (3.9 refuses the old name).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    GLUON_IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - depends on the installed Triton
    GLUON_IMPORT_ERROR = f"triton {triton.__version__} has no usable Gluon ({exc})"


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    """The streaming multiprocessors of a CUDA device: the persistent grids' size."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
