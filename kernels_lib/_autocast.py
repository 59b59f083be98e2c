r"""``torch.autocast`` at the entry of every fused loss: the dtype the head's matmuls run in.

Under an enabled autocast region for a tensor's device type, ``F.linear(x, W, b)`` casts ``x``,
``W`` and ``b`` to :func:`torch.get_autocast_dtype` whatever their own dtypes, so an AMP step hands a
loss bfloat16 (or float16) hidden states next to float32 parameters. The fused losses follow the
same rule, the one place it is written being here:

* :func:`compute_dtype_for` names the dtype a head's operands are rounded to: the autocast dtype
  inside a region enabled for ``x``'s device type, else ``x``'s own. Each head resolves it from its
  own ``x`` (a teacher or a reference model likewise, as ``F.linear`` would cast it).
* :func:`mixes_dtypes` says whether a head's tensors may differ in dtype: only inside such a
  region, where they are all cast anyway; outside it a mismatch is refused, naming the argument
  (:func:`kernels_lib._validate.require_head_dtype`), as before.

Past the entry the pipelines run with autocast disabled (the dtypes are chosen; torch's own
autocast would otherwise recast the ``out=`` matmuls of the chunk loop), and the gradients come back
in each leaf's own dtype: a float32 head gets a float32 ``dW``, accumulated across chunks in float32
(:class:`~kernels_lib.chunks.gradient_sums.GradientSums` keeps ``dW`` in the parameter's
dtype). The loss is float32 in every case.
"""

from __future__ import annotations

import torch


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``torch.autocast`` casts matmul operands to on ``device``'s type, None where it is off."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def mixes_dtypes(x: torch.Tensor) -> bool:
    """Whether a head whose input is ``x`` may mix dtypes: autocast is on for ``x``'s device type."""
    return autocast_dtype(x.device) is not None


def compute_dtype_for(x: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: the autocast dtype when autocast is on for x's device
    (as ``nn.Linear`` would run), else x's own."""
    return autocast_dtype(x.device) or x.dtype
