"""kernels_lib: Triton kernels for LM-head losses that never materialize what they need not.

Import order matters: :mod:`kernels_lib._runtime` chooses the backend (compiled Triton on CUDA,
Triton's interpreter otherwise) before any kernel module is imported.
"""

from . import _runtime  # noqa: F401  (must come first: sets TRITON_INTERPRET on CPU machines)
from ._runtime import INTERPRETED, KERNEL_DEVICE, default_device
from .fused_linear_cross_entropy import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .fused_linear_kto import FusedLinearKTOLoss, fused_linear_kto
from .fused_linear_orpo import FusedLinearORPOLoss, fused_linear_orpo
from .kl_div import KLDivLoss, kl_div

__all__ = [
    "kl_div",
    "KLDivLoss",
    "fused_linear_cross_entropy",
    "FusedLinearCrossEntropyLoss",
    "fused_linear_orpo",
    "FusedLinearORPOLoss",
    "fused_linear_kto",
    "FusedLinearKTOLoss",
    "INTERPRETED",
    "KERNEL_DEVICE",
    "default_device",
]
__version__ = "0.1.0"
