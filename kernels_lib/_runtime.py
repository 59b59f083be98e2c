"""Where the kernels run: compiled Triton on CUDA, Triton's interpreter on a machine without a GPU.

The choice is made once, when ``kernels_lib`` is imported and before any kernel is defined:
``triton.jit`` reads ``TRITON_INTERPRET`` at decoration time, so the variable must be set before
the kernel modules are imported. On a machine without CUDA we set it; the kernels then take CPU
tensors and run as NumPy code (slow, exact enough to test against a float64 reference). On a CUDA
machine they are compiled and take CUDA tensors only. Nothing here is for the user to set; an
explicit ``TRITON_INTERPRET`` in the environment is respected. Triton reads the variable for its own
``tl`` functions when *it* is first imported: on a CPU, import ``kernels_lib`` before ``triton`` (or
anything that imports it, such as TRL), or export ``TRITON_INTERPRET=1`` (``./workbench lab`` does).
Otherwise every kernel would fail when called ("Cannot call @triton.jit'd outside of the scope of a
kernel"), so the import fails instead, saying so.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") is None:
    if "triton" in sys.modules:
        raise ImportError(
            "kernels_lib runs its kernels in Triton's interpreter on this machine (no CUDA), which Triton reads "
            "when it is first imported, and triton was imported before kernels_lib: import kernels_lib first "
            "(before triton or anything that imports it, such as trl), or set TRITON_INTERPRET=1 in the environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"

#: True when the kernels run through Triton's interpreter (CPU tensors), False when compiled (CUDA).
INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: The device the kernels take tensors on.
KERNEL_DEVICE: str = "cpu" if INTERPRETED else "cuda"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def check_interpreter_versions(triton_version: str, numpy_version: str) -> None:
    """Refuse a combination whose interpreter breaks: triton < 3.9 with numpy >= 2.3 fails on every
    ``for k in range(0, K, BK)`` loop ("only 0-dimensional arrays can be converted", SPEC §5)."""
    if _version(triton_version) < (3, 9) and _version(numpy_version) >= (2, 3):
        raise ImportError(
            f"kernels_lib runs its kernels in Triton's interpreter here, which fails with triton {triton_version} "
            f"and numpy {numpy_version}; install numpy<2.3 or triton>=3.9"
        )


if INTERPRETED:
    import triton

    try:
        import numpy
    except ImportError as error:
        raise ImportError(
            "kernels_lib runs its kernels through Triton's interpreter on this machine (no CUDA), which needs "
            "numpy: pip install 'kernels_lib[interpreter]'"
        ) from error

    check_interpreter_versions(triton.__version__, numpy.__version__)


def default_device() -> torch.device:
    """The device on which this machine's kernels run (``cuda`` when compiled, ``cpu`` when interpreted)."""
    return torch.device(KERNEL_DEVICE)


def check_kernel_device(name: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor the kernels of this machine cannot read, naming the argument."""
    if tensor.device.type != KERNEL_DEVICE:
        mode = "Triton's interpreter (no CUDA on this machine)" if INTERPRETED else "compiled Triton on CUDA"
        raise ValueError(
            f"{name} is on {tensor.device}, but kernels_lib runs its kernels with {mode} and "
            f"needs {KERNEL_DEVICE} tensors; move {name} with .to({KERNEL_DEVICE!r})."
        )
