r"""torch's own ``F.linear_cross_entropy`` as a measured peer, also on a torch that predates it.

torch 2.13 added ``torch.nn.functional.linear_cross_entropy`` with ``torch.nn.LinearCrossEntropyOptions``:
given options, it takes a batch-chunked path whose two custom ops form the gradients in forward. Its
implementation is two pure-Python files, ``torch/nn/modules/linear_cross_entropy.py`` (the ops) and
``linear_cross_entropy_options.py`` (the options and how ``"auto"`` resolves per device and dtype),
which import nothing of torch's beyond its public ops. The lent H200 has torch 2.11, so to measure
torch 2.13's algorithm there, :func:`load` also takes those two files from a folder named by
:data:`FILES_VARIABLE` (copied from a torch 2.13 install at run time; they are not part of this
repository) and calls their chunked ops as torch 2.13's ``F.linear_cross_entropy`` does on its chunked
path: ``options._adjust`` resolves the chunk size and accumulation policy for the call, then the
reduced op (``mean``/``sum``) or the unreduced one (``none``). That is torch 2.13's algorithm on the
installed torch's kernels, and :func:`load` says so in what it returns.

The chunked path covers what the workbench measures: 2-D input, int64 targets, ``mean``/``sum``/
``none``, no label smoothing, no class weights. torch itself falls back to materialized logits
outside it; the adapter in :mod:`.fused_linear_cross_entropy` refuses those options instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch

#: The environment variable naming a folder with torch 2.13's two files (used where torch lacks the function).
FILES_VARIABLE = "KERNELS_LIB_TORCH_LCE_FILES"
FILE_NAMES = {"options": "linear_cross_entropy_options.py", "ops": "linear_cross_entropy.py"}
#: The custom ops' namespace in the files, and the one they are registered under when loaded here (a
#: torch that has the function registered the original names already).
OPS_NAMESPACE, LOADED_NAMESPACE = "torch_nn::", "kernels_lib_torch_lce::"


class TorchLCE(NamedTuple):
    function: Callable  #: ``(input, linear_weight, target, *, linear_bias, reduction, ignore_index, options)``
    options_class: type  #: ``LinearCrossEntropyOptions``
    source: str  #: what runs: ``"torch 2.13.0"`` or ``"torch 2.13's files on torch 2.11.0"``


def _load_file(name: str, path: Path):
    """Import one file as a module of its own; the ops' namespace renamed so it cannot clash."""
    if name in sys.modules:  # custom ops register once per process
        return sys.modules[name]
    text = path.read_text().replace(f'"{OPS_NAMESPACE}', f'"{LOADED_NAMESPACE}')
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    sys.modules[name] = module
    try:
        exec(compile(text, str(path), "exec"), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_files(folder: str | os.PathLike) -> TorchLCE:
    """torch 2.13's chunked ``linear_cross_entropy`` from the two files in ``folder``."""
    folder = Path(folder)
    missing = [f for f in FILE_NAMES.values() if not (folder / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{FILES_VARIABLE}={str(folder)!r} lacks {', '.join(missing)} (torch 2.13's torch/nn/modules/)")
    options_module = _load_file("kernels_lib_torch_lce_options", folder / FILE_NAMES["options"])
    ops = _load_file("kernels_lib_torch_lce_ops", folder / FILE_NAMES["ops"])

    def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, reduction="mean", ignore_index=-100,
                             options=None):
        if input.dim() != 2 or target.dtype != torch.int64 or reduction not in ("mean", "sum", "none") or options is None:
            raise NotImplementedError("torch 2.13's files are called on their chunked path only: 2-D input, int64 "
                                      "targets, reduction mean/sum/none, options given")
        resolved = options._adjust(num_batches=input.shape[0], in_features=input.shape[1],
                                   num_classes=linear_weight.shape[0], dtype=input.dtype, device=input.device)
        if reduction == "none":
            return ops._linear_cross_entropy_batch_chunked_no_reduction(
                input, linear_weight, target, linear_bias, None, ignore_index, resolved.batch_chunk_size,
                resolved.acc_policy, resolved.acc_dtype)
        grad = torch.is_grad_enabled()
        return ops._linear_cross_entropy_batch_chunked(
            input, linear_weight, target, linear_bias, None, reduction, ignore_index, 0.0, resolved.batch_chunk_size,
            resolved.acc_policy, resolved.acc_dtype, resolved.allow_retain_graph, input.requires_grad and grad,
            linear_weight.requires_grad and grad, linear_bias is not None and linear_bias.requires_grad and grad,
        )[0]

    return TorchLCE(linear_cross_entropy, options_module.LinearCrossEntropyOptions,
                    f"torch 2.13's files on torch {torch.__version__}")


def load() -> TorchLCE:
    """torch's ``F.linear_cross_entropy`` where torch has it, else torch 2.13's files from :data:`FILES_VARIABLE`.

    Raises ImportError naming what is missing when neither is there."""
    function = getattr(torch.nn.functional, "linear_cross_entropy", None)
    options_class = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if function is not None and options_class is not None:
        return TorchLCE(function, options_class, f"torch {torch.__version__}")
    folder = os.environ.get(FILES_VARIABLE)
    if folder:
        return load_files(folder)
    missing = " and ".join(name for name, have in (("torch.nn.functional.linear_cross_entropy", function),
                                                    ("torch.nn.LinearCrossEntropyOptions", options_class)) if have is None)
    raise ImportError(f"torch {torch.__version__} has no {missing} (added in torch 2.13); {FILES_VARIABLE} may name a "
                      "folder with torch 2.13's linear_cross_entropy.py and linear_cross_entropy_options.py")
