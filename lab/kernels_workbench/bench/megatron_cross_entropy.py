r"""Cross-entropy on materialized logits against Megatron-LM's: the ``megatron_cross_entropy`` chart.

Published workload (Liger's ``benchmark_megatron_cross_entropy.py``, H100): bf16 logits of
``S × B = 2048 × 4`` tokens, one tensor-parallel rank (``TP = 1``), ``V`` = 4096 … 131072; each
provider returns the per-token loss and the harness calls ``loss.sum().backward()``, which is
``reduction="sum"`` here. Providers, each with the signature of :func:`kernels_lib.cross_entropy`
on ``(N, V)`` logits:

- ``kernels_lib``, ``torch`` (the baseline: ``F.cross_entropy`` on the logits upcast to float32, as
  the published harness's "torch"), as in :mod:`.cross_entropy`;
- ``liger``: ``liger_kernel.megatron.LigerMegatronCrossEntropy`` (CUDA only), the published one
  (per-token loss, reduced as the Megatron adapters do; from Liger 0.8.5 on it defaults to
  Megatron's label smoothing, so it is asked for torch's);
- ``megatron-fused``: ``megatron.core.fusions.fused_cross_entropy.fused_vocab_parallel_cross_entropy``
  (Megatron's ``cross_entropy_loss_fusion=True``);
- ``megatron-unfused``: ``megatron.core.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy``.

The Megatron adapters (package ``megatron-core``, loaded on first use) see the logits as
``[s, b, v] = [N, 1, V]`` and a one-rank tensor-parallel group: the process group is started here
when none is (a one-process group over an in-memory store: NCCL on CUDA, gloo otherwise), and
passed as ``tp_group`` where the function takes one, else Megatron's ``parallel_state`` is
initialized with ``tensor_model_parallel_size=1`` (older releases read the group from there).
What the adapters add to Megatron's per-token loss, so that all providers compute the same thing:

* Megatron has no ``ignore_index`` (an ignored target, -100, falls outside the rank's classes and
  is taken for one another rank owns: its loss is the row's lse): those rows are zeroed after the
  call, which also zeroes their gradient; then the reduction.
* Label smoothing (unfused only): Megatron's ``α`` spreads ``α·V/(V−1)`` of the mass (NeMo's
  convention), torch's ``ε`` spreads ``ε``; the adapter passes ``α = ε (V − 1)/V``. The fused
  function has none and refuses it; class weights are refused by both.
* Megatron upcasts with ``.float()`` and then works in place: on float32 logits that would overwrite
  the caller's tensor, so those get a copy (the published bf16 logits are upcast into a new tensor
  anyway).

Modes: the published harness timed ``backward`` as a fresh forward + backward per repeat (Megatron's
backward rewrites its saved softmax in place, so a retained graph cannot be run backward twice), so
its ``backward`` rows equal its ``full`` rows; compare them with our ``full`` (``SPEC.published_modes``: the
overview's agreement table does). Our ``backward`` mode times backward alone after a fresh forward that
is not timed (:func:`.timing.backward_after_forward`), so it measures the Megatron providers too, and is
not the published ``backward``.
"""

from __future__ import annotations

import inspect

import torch

from kernels_lib import reference
from kernels_lib.cross_entropy import cross_entropy as kernels_lib_cross_entropy
from .cross_entropy import SMALL_VOCAB_AXIS, VOCAB_AXIS, bytes_moved, make_inputs as make_logits_inputs
from .spec import Inputs, LossSpec, Provider, require_cuda

KERNEL_NAME = "megatron_cross_entropy"
MEGATRON_PACKAGE = "megatron-core"


def _reduce(per_token: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """A per-token loss of shape ``(N,)`` with the ignored tokens zeroed, reduced as ``F.cross_entropy``
    does (``mean`` over the kept tokens)."""
    kept = target != ignore_index
    per_token = torch.where(kept, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total / kept.sum() if reduction == "mean" else total


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.megatron import LigerMegatronCrossEntropy

    modules: dict[tuple, torch.nn.Module] = {}
    # Liger >= 0.8.5 follows Megatron's smoothing unless told torch's; 0.8.0 (published) had torch's only.
    torch_smoothing = (
        {"label_smoothing_formula": "pytorch"}
        if "label_smoothing_formula" in inspect.signature(LigerMegatronCrossEntropy).parameters else {}
    )

    def liger(logits, target, *, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              inplace=False, host_checks=True):
        del inplace, host_checks
        if weight is not None:
            raise NotImplementedError("LigerMegatronCrossEntropy takes no class weights")
        key = (ignore_index, label_smoothing)
        if key not in modules:
            modules[key] = LigerMegatronCrossEntropy(
                ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none", **torch_smoothing
            )
        per_token = modules[key](logits.unsqueeze(1), target.unsqueeze(1)).reshape(-1)
        return _reduce(per_token, target, ignore_index, reduction)

    return liger


def _import_megatron(module: str, name: str):
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except ImportError as error:
        raise ImportError(
            f"the Megatron providers need the package {MEGATRON_PACKAGE} (pip install {MEGATRON_PACKAGE}); "
            f"importing {module}.{name} failed: {error}"
        ) from error


def one_rank_group(device: torch.device):
    """The tensor-parallel group of one rank: the world group, started here (an in-memory store, one
    process) when no process group is; refused when the world has more than one rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError(f"the Megatron providers run TP = 1 in one process; the process group has {dist.get_world_size()} ranks")
    return dist.group.WORLD


def _megatron_call(function, device: torch.device):
    """``call(logits_3d, target_2d, *extra)`` with the one-rank group as ``tp_group`` where ``function``
    takes one, else with Megatron's ``parallel_state`` initialized at ``tensor_model_parallel_size=1``."""
    group = one_rank_group(device)
    if "tp_group" in inspect.signature(function).parameters:
        return lambda *args: function(*args, tp_group=group)
    parallel_state = _import_megatron("megatron.core", "parallel_state")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    return function


def _megatron_provider(fused: bool):
    module, name = (
        ("megatron.core.fusions.fused_cross_entropy", "fused_vocab_parallel_cross_entropy")
        if fused else ("megatron.core.tensor_parallel.cross_entropy", "vocab_parallel_cross_entropy")
    )

    def load():
        function = _import_megatron(module, name)
        calls: dict[torch.device, object] = {}

        def megatron(logits, target, *, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                     inplace=False, host_checks=True):
            del inplace, host_checks
            if weight is not None:
                raise NotImplementedError(f"Megatron's {name} takes no class weights")
            if fused and label_smoothing:
                raise NotImplementedError(f"Megatron's {name} has no label smoothing")
            if logits.device not in calls:
                calls[logits.device] = _megatron_call(function, logits.device)
            n_classes = logits.shape[-1]
            logits_3d = (logits.clone() if logits.dtype == torch.float32 else logits).unsqueeze(1)
            extra = () if fused else (label_smoothing * (n_classes - 1) / n_classes,)
            per_token = calls[logits.device](logits_3d, target.unsqueeze(1), *extra).reshape(-1)
            return _reduce(per_token, target, ignore_index, reduction)

        return megatron

    return Provider(f"megatron-{'fused' if fused else 'unfused'}", load, f"megatron-core {name} (TP = 1)")


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_cross_entropy, "kernels_lib.cross_entropy (Triton)"),
    "torch": Provider("torch", lambda: reference.cross_entropy, "F.cross_entropy on float32 logits (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel LigerMegatronCrossEntropy"),
    "megatron-fused": _megatron_provider(fused=True),
    "megatron-unfused": _megatron_provider(fused=False),
}


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """``(S·B, V)`` logits and targets as :func:`.cross_entropy.make_inputs` draws them; ``TP`` must be 1."""
    if int(sizes.get("TP", 1)) != 1:
        raise ValueError(f"TP must be 1 (one tensor-parallel rank); got {sizes['TP']}")
    return make_logits_inputs(sizes, dtype, device, options, seed)


SPEC = LossSpec(
    kernel_name=KERNEL_NAME,
    providers=PROVIDERS,
    make_inputs=make_inputs,
    published={**VOCAB_AXIS, "sizes": {"S": 2048, "B": 4, "TP": 1}, "dtype": torch.bfloat16},
    small={**SMALL_VOCAB_AXIS, "sizes": {"S": 8, "B": 2, "TP": 1}, "dtype": torch.bfloat16},
    bytes_moved=bytes_moved,
    baseline="torch",
    default_options={"reduction": "sum"},
    published_modes={"backward": "full"},  # the published harness's backward: a fresh forward and backward
)
