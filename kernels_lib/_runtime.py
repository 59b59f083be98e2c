"""Where the kernels run: compiled Triton on CUDA, Triton's interpreter on a machine without a GPU.

The choice is made once, when ``kernels_lib`` is imported and before any kernel is defined:
``triton.jit`` reads ``TRITON_INTERPRET`` at decoration time, so the variable must be set before
the kernel modules are imported. On a machine without CUDA we set it; the kernels then take CPU
tensors and run as NumPy code (slow, exact enough to test against a float64 reference). On a CUDA
machine they are compiled and take CUDA tensors only. Nothing here is for the user to set; an
explicit ``TRITON_INTERPRET`` in the environment is respected.

Import order does not matter. ``triton.jit`` reads ``TRITON_INTERPRET`` (through
``triton.knobs.runtime.interpret``) when it decorates, so setting it here is enough for every kernel
of kernels_lib, which are all defined after this module runs. What it is not enough for is Triton's
own ``@triton.jit`` helpers in ``triton.language`` (``tl.sum``, ``tl.max``, ``tl.cdiv``, ...): they were
decorated when *Triton* was imported, and if that was before kernels_lib (``from transformers import
LlamaForCausalLM`` imports Triton, so does TRL) they are compiled-mode ``JITFunction`` objects that an
interpreted kernel cannot call ("Cannot call @triton.jit'd outside of the scope of a kernel").
:func:`_interpret_loaded_triton` then re-wraps those helpers as the interpreter's own
``InterpretedFunction`` (what they would have been had the variable been set first), in the modules
and as ``tl.tensor`` methods. A Triton whose internals differ (no ``InterpretedFunction``, no ``.fn``
on its ``JITFunction``) gets the old rule back as an ImportError: import kernels_lib first, or export
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import sys

import torch


def _interpret_loaded_triton() -> int:
    """Turn the ``@triton.jit`` helpers of an already imported ``triton.language`` into interpreted ones.

    Every ``JITFunction`` attribute of the loaded ``triton.language*`` modules, and every one set on
    ``tl.tensor`` as a method (``x.sum()``), is replaced by ``InterpretedFunction(f.fn)``, one per
    function; as methods they are wrapped in a plain function so that the tensor binds as ``self``,
    as Triton itself does for interpreted member functions. Returns how many attributes were replaced.
    """
    from triton.language import core
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted: dict[int, object] = {}  # by id: hashing a JITFunction walks its globals

    def convert(function):
        if id(function) not in interpreted:
            interpreted[id(function)] = InterpretedFunction(function.fn)
        return interpreted[id(function)]

    replaced = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, attribute, convert(value))
                replaced += 1
    for attribute, value in list(vars(core.tensor).items()):
        if isinstance(value, JITFunction):
            function = convert(value)
            setattr(core.tensor, attribute, lambda *args, _function=function, **kwargs: _function(*args, **kwargs))
            replaced += 1
    return replaced


def _require_numpy() -> None:
    """Triton's interpreter imports numpy when its first kernel is decorated: without it, say what to install
    here, before Triton fails deep inside ``triton.language``."""
    try:
        import numpy  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "kernels_lib runs its kernels through Triton's interpreter on this machine (no CUDA), which needs "
            "numpy: install the interpreter extra (pip install '.[interpreter]' from a clone, or numpy itself)"
        ) from error


if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") is None:
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _require_numpy()
    except ImportError:
        del os.environ["TRITON_INTERPRET"]  # as it was
        raise
    if "triton" in sys.modules:
        try:
            _interpret_loaded_triton()
        except (ImportError, AttributeError) as error:
            del os.environ["TRITON_INTERPRET"]  # as it was: a later import must not take the interpreter as set
            raise ImportError(
                "kernels_lib runs its kernels in Triton's interpreter on this machine (no CUDA), and triton was "
                "imported before kernels_lib without it; this Triton's helpers could not be switched to the "
                f"interpreter ({error}): import kernels_lib first (before triton or anything that imports it, "
                "such as transformers' models or trl), or set TRITON_INTERPRET=1 in the environment"
            ) from error

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
    _require_numpy()
    import numpy
    import triton

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


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (a host sync would be an error there)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
