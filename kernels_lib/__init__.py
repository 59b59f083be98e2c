"""kernels_lib: Triton kernels for LM-head losses that never materialize what they need not.

Import order matters: :mod:`kernels_lib._runtime` chooses the backend (compiled Triton on CUDA,
Triton's interpreter otherwise) before any kernel module is imported.
"""

from . import _runtime  # noqa: F401  (must come first: sets TRITON_INTERPRET on CPU machines)
from ._runtime import INTERPRETED, KERNEL_DEVICE, default_device
from .fused_linear_cross_entropy import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .kl_div import KLDivLoss, kl_div

__all__ = [
    "kl_div",
    "KLDivLoss",
    "fused_linear_cross_entropy",
    "FusedLinearCrossEntropyLoss",
    "INTERPRETED",
    "KERNEL_DEVICE",
    "default_device",
]
__version__ = "0.1.0"
