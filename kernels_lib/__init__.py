"""kernels_lib: Triton kernels for LM-head losses that never materialize what they need not.

The losses need torch and triton only. ``kernels_lib.hf`` patches Hugging Face causal LMs (it needs
transformers). The notebooks' workbench is a package beside this one (``lab/`` in the repository).

:mod:`kernels_lib._runtime` chooses the backend (compiled Triton on CUDA, Triton's interpreter
otherwise) before any kernel module is imported; on a CPU it may come after ``triton`` (or
transformers, or TRL): Triton's own helpers are then switched to the interpreter.
"""

from . import _runtime  # noqa: F401  (must come first: sets TRITON_INTERPRET on CPU machines)
from ._runtime import INTERPRETED, KERNEL_DEVICE, default_device
from .cross_entropy import CrossEntropyLoss, cross_entropy
from .fused_linear_cross_entropy import CrossEntropyOutput, FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from .fused_linear_cpo import CPOOutput, FusedLinearCPOLoss, FusedLinearSimPOLoss, fused_linear_cpo, fused_linear_simpo
from .fused_linear_dpo import DPOOutput, FusedLinearDPOLoss, fused_linear_dpo
from .fused_linear_grpo import FusedLinearGRPOLoss, GRPOOutput, GRPOPerToken, fused_linear_grpo
from .fused_linear_token_logprobs import TokenLogprobsOutput, fused_linear_token_logprobs
from .fused_linear_kto import FusedLinearKTOLoss, fused_linear_kto
from .fused_linear_orpo import FusedLinearORPOLoss, fused_linear_orpo
from .jsd import JSDLoss, jsd
from .fused_linear_jsd import FusedLinearJSDLoss, fused_linear_jsd
from .distillation import DistillCosineLoss, DistillJSDLoss, DistillationOutput, distill_cosine_loss, distill_jsd_loss
from .kl_div import KLDivLoss, kl_div
from .linear_cross_entropy import linear_cross_entropy
from .tvd import TVDLoss, tvd

__all__ = [
    "kl_div",
    "KLDivLoss",
    "cross_entropy",
    "CrossEntropyLoss",
    "jsd",
    "JSDLoss",
    "tvd",
    "TVDLoss",
    "fused_linear_cross_entropy",
    "FusedLinearCrossEntropyLoss",
    "CrossEntropyOutput",
    "linear_cross_entropy",
    "fused_linear_orpo",
    "FusedLinearORPOLoss",
    "fused_linear_kto",
    "FusedLinearKTOLoss",
    "fused_linear_dpo",
    "FusedLinearDPOLoss",
    "DPOOutput",
    "fused_linear_cpo",
    "fused_linear_simpo",
    "FusedLinearCPOLoss",
    "FusedLinearSimPOLoss",
    "CPOOutput",
    "fused_linear_grpo",
    "FusedLinearGRPOLoss",
    "GRPOOutput",
    "GRPOPerToken",
    "fused_linear_token_logprobs",
    "TokenLogprobsOutput",
    "fused_linear_jsd",
    "FusedLinearJSDLoss",
    "distill_jsd_loss",
    "distill_cosine_loss",
    "DistillJSDLoss",
    "DistillCosineLoss",
    "DistillationOutput",
    "INTERPRETED",
    "KERNEL_DEVICE",
    "default_device",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``kernels_lib.hf`` (the Hugging Face drop-in) on first use: it imports transformers, which the
    losses themselves do not need."""
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'kernels_lib' has no attribute {name!r}")
