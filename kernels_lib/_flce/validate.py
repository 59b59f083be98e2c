"""The fused linear cross-entropy's argument checks: each error names the argument and what it got.

The generic checks (a tensor, a float dtype, shapes of a linear loss, one device) are
:mod:`kernels_lib._validate`'s; these add the cross-entropy's own: the bias and class weights against
the head, the options' ranges, and ``num_items_in_batch`` (an int, or a one-element tensor that is
never read on the host). They run on the host before any launch and read no tensor's values; with a
process group they run on every rank inside :func:`kernels_lib._vocab_parallel.establish`, so that a
rank that fails fails them all.
"""

from __future__ import annotations

import torch

from .. import _validate as v
from .options import REDUCTIONS


def _validate_tensors(x, weight, target, bias, class_weight, vocab_parallel: bool = False) -> None:
    """The tensors' checks; ``vocab_parallel``: ``weight`` and ``bias`` are this rank's shard, and
    ``class_weight``'s length (the global ``V``) is checked over the ranks
    (:func:`kernels_lib._vocab_parallel.establish`)."""
    v.require_linear_loss_inputs(x, weight, target)
    tensors = {"x": x, "weight": weight, "target": target}
    if bias is not None:
        v.require_bias("bias", bias, weight)
        tensors["bias"] = bias
    if class_weight is not None:
        v.require_tensor("class_weight", class_weight)
        v.require_float("class_weight", class_weight)
        if class_weight.dim() != 1 or (not vocab_parallel and class_weight.shape != weight.shape[:1]):
            raise ValueError(
                f"class_weight must have shape (V,) = ({weight.shape[0]},), one weight per class; got {tuple(class_weight.shape)}"
            )
        tensors["class_weight"] = class_weight
    v.require_same_device(tensors)


def _validate_options(
    ignore_index, reduction, label_smoothing, z_loss_scale, softcap, return_z_loss, chunk_size, accurate,
    logit_scale=1.0, temperature=1.0, return_token_stats=False,
) -> None:
    v.require_int("ignore_index", ignore_index)
    v.require_choice("reduction", reduction, REDUCTIONS)
    v.require_probability("label_smoothing", label_smoothing)
    v.require_real("z_loss_scale", z_loss_scale)
    if z_loss_scale < 0:
        raise ValueError(f"z_loss_scale must be >= 0; got {z_loss_scale}")
    if softcap is not None:
        v.require_real("softcap", softcap)
        if softcap <= 0:
            raise ValueError(f"softcap must be None or > 0; got {softcap}")
    v.require_real("logit_scale", logit_scale)
    v.require_real("temperature", temperature)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    v.require_bool("return_z_loss", return_z_loss)
    v.require_bool("return_token_stats", return_token_stats)
    v.require_chunk_options(chunk_size, accurate)


def _validate_num_items(num_items_in_batch, reduction: str) -> None:
    """None, a positive int, or a one-element real tensor (read on the device, never on the host)."""
    if num_items_in_batch is None:
        return
    if reduction != "mean":
        raise ValueError(
            f"num_items_in_batch replaces the denominator of reduction='mean'; got reduction={reduction!r}"
        )
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1 or num_items_in_batch.is_complex() or num_items_in_batch.dtype == torch.bool:
            raise ValueError(
                "num_items_in_batch must be a positive int or a one-element real tensor; "
                f"got a {num_items_in_batch.dtype} tensor of shape {tuple(num_items_in_batch.shape)}"
            )
        return
    v.require_int("num_items_in_batch", num_items_in_batch)
    if num_items_in_batch < 1:
        raise ValueError(f"num_items_in_batch must be >= 1; got {num_items_in_batch}")
