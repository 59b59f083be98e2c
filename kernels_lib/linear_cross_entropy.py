r"""``torch.nn.functional.linear_cross_entropy``'s signature over :func:`kernels_lib.fused_linear_cross_entropy`.

torch 2.13 added ``F.linear_cross_entropy(input, linear_weight, target, *, linear_bias, weight,
reduction, ignore_index, label_smoothing, options)``: by definition

.. math::

    \ell = \mathrm{cross\_entropy}(x W^\top + b,\ y;\ w, \varepsilon, \text{ignore\_index}), \qquad
    \text{mean} = \frac{\sum_i w_{y_i}\,\ell_i}{\sum_{i\ \text{valid}} w_{y_i}},

with its per-class ``weight`` :math:`w` (1 when None), label smoothing :math:`\varepsilon` whose
smoothing term is weighted by :math:`w_j` inside the sum over classes, and ``mean`` divided by the
valid rows' total class weight (their number without ``weight``). :func:`linear_cross_entropy` takes
exactly those arguments, defaults and shapes, so a torch user switches with one import, and runs
them through :func:`kernels_lib.fused_linear_cross_entropy` (no ``N × V`` logits): ``linear_weight``
is our ``weight``, ``linear_bias`` our ``bias``, torch's ``weight`` our ``class_weight``. What the
adapter adds to keep torch's semantics where ours differ:

* the loss comes back in ``input``'s dtype, as torch's (float32 inside ``torch.autocast``, whose
  ``cross_entropy`` runs in float32); ours is float32 always;
* ``mean`` over no weight at all (every target ignored, or class weights 0 on every valid row) is NaN,
  as torch's 0/0; ours gives 0 there. The gradients stay 0, as torch's reference path gives for an
  all-ignored batch (its chunked path gives NaN);
* ``ignore_index=None`` (torch's default) is -100, as torch maps it for class-index targets;
* the errors name torch's arguments (``input``, ``linear_weight``, ``linear_bias``, ``weight``).

``options`` (:class:`torch.nn.LinearCrossEntropyOptions`) maps onto our dials:

* ``acc_policy``: ``"compact"`` accumulates the weight gradient chunk by chunk into the parameter's
  dtype, as our ``accurate=False``; ``"balanced"`` and ``"accurate"`` keep a float32 ``V × H``
  accumulator, our ``accurate=True``; ``"auto"`` is our default, ``accurate=False`` (torch's CUDA pick,
  ``"compact"``; its CPU pick for half inputs is ``"accurate"`` because its low-precision CPU matmuls
  are emulated, which ours are not: on a CPU our matmuls run in float32). What the choice trades
  (``dW``'s error against float64, for a ``V × H`` float32 buffer) is measured in notebook 01.
  ``options=None`` (torch's
  reference path, which materializes the logits) runs our default too: the point of the switch is
  not to hold them.
* ``batch_chunk_size`` is our ``chunk_size``; ``chunking_method="aspect_ratio[:k]"`` computes the
  chunk torch's heuristic names, :math:`2^{\lceil \log_2 \lceil N / \lceil V/H \rceil \rceil \rceil} / k`
  rows (at most ``N``): a chunk whose logits are about the size of ``input``, over ``k``; ``"auto"``
  is our :func:`~kernels_lib.fused_linear_cross_entropy.default_chunk_size`, chosen from GPU measurements
  (notebook 01), not torch's A100 pick; ``None`` is one chunk.
  Both given and disagreeing is refused, as torch refuses it.
* ``acc_dtype``: None, float32 or ``input``'s dtype (ours accumulates the loss in float32 in every case,
  and ``dW`` as ``acc_policy`` says); another is refused.
* ``allow_retain_graph=True`` with ``mean``/``sum``: ours forms the gradients in forward and refuses a
  second backward through them, so the adapter takes ``reduction="none"`` (forward keeps the
  log-sum-exp, backward recomputes the logits: one matmul more) and reduces it itself; a retained
  graph can then be backpropagated again, as torch's option promises.

Rows whose target is ``ignore_index`` are dropped before the matmuls, as in
:func:`~kernels_lib.fused_linear_cross_entropy` (its ``skip_ignored``: one host sync per call to count
them), so the call's cost follows the valid rows; the loss and gradients are unchanged.

Refused, naming what to do: class-probability targets (``target`` of the logits' shape, floating)
and the K-dimensional loss (``linear_weight`` of shape ``(C, d_1, …, d_K, H)``): neither is one
head's class-index cross-entropy, which is all the fused kernel computes. ``input`` is ``(H,)`` or
``(N, H)`` as torch requires (a ``(B, T, H)`` input is refused, as torch refuses it: reshape it).
"""

from __future__ import annotations

import torch

from . import _validate as v
from .fused_linear_cross_entropy import REDUCTIONS, fused_linear_cross_entropy

#: torch's ``acc_policy`` → our ``accurate`` (see the module's docstring).
ACC_POLICIES = {"auto": False, "compact": False, "balanced": True, "accurate": True}

#: The default of torch's ``ignore_index=None`` for class-index targets.
DEFAULT_IGNORE_INDEX = -100


def options_class():
    """``torch.nn.LinearCrossEntropyOptions``, or None where torch lacks it (torch < 2.13)."""
    return getattr(torch.nn, "LinearCrossEntropyOptions", None)


def aspect_ratio_chunk(n_rows: int, hidden: int, n_classes: int, factor: int = 1) -> int:
    r"""Rows of torch's ``chunking_method="aspect_ratio:factor"``: the next power of two of
    :math:`\lceil N / \lceil V/H \rceil \rceil`, divided by ``factor``, at most ``N``, at least 1."""
    per_row = -(-n_classes // hidden)
    rows = -(-n_rows // per_row)
    return max(1, min((1 << (rows - 1).bit_length()) // factor, n_rows))


def resolve_options(options, n_rows: int, hidden: int, n_classes: int, dtype: torch.dtype):
    """``(chunk_size, accurate, allow_retain_graph)`` for ``options`` (None: our defaults)."""
    if options is None:
        return None, False, False
    cls = options_class()
    if cls is None or not isinstance(options, cls):
        want = "torch.nn.LinearCrossEntropyOptions or None" if cls else "None (this torch has no LinearCrossEntropyOptions)"
        raise TypeError(f"options must be {want}; got {type(options).__name__}")
    if options.acc_policy not in ACC_POLICIES:
        raise ValueError(f"options.acc_policy must be one of {', '.join(map(repr, ACC_POLICIES))}; got {options.acc_policy!r}")
    if options.acc_dtype not in (None, torch.float32, dtype):
        raise ValueError(
            f"options.acc_dtype must be None, torch.float32 or input's dtype ({dtype}); got {options.acc_dtype}"
            " (kernels_lib accumulates in float32)"
        )
    method, chunk = options.chunking_method, options.batch_chunk_size
    given = None if chunk is None else min(chunk, n_rows)
    if method == "auto":
        chunk_size = given  # None: our default chunk
    elif method is None:
        chunk_size = n_rows if given is None else given
    else:
        name, _, factor = method.partition(":")
        if name != "aspect_ratio" or not (factor or "1").isdigit() or int(factor or "1") < 1:
            raise ValueError(f"options.chunking_method must be 'auto', 'aspect_ratio[:k]' or None; got {method!r}")
        chunk_size = aspect_ratio_chunk(n_rows, hidden, n_classes, int(factor or "1"))
        if given is not None and given != chunk_size:
            raise ValueError(
                f"options.batch_chunk_size ({chunk}) and options.chunking_method ({method!r}, {chunk_size} rows here)"
                " give different chunks; pass only one"
            )
    return chunk_size, ACC_POLICIES[options.acc_policy], bool(options.allow_retain_graph)


def _validate(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing) -> None:
    """torch's argument checks, naming torch's arguments."""
    v.require_tensor("input", input)
    v.require_tensor("linear_weight", linear_weight)
    v.require_tensor("target", target)
    v.require_float("input", input)
    v.require_float("linear_weight", linear_weight)
    v.require_head_dtype("input", input, "linear_weight", linear_weight)
    if input.dim() not in (1, 2):
        raise ValueError(
            f"input must have shape (H,) or (N, H), as torch's linear_cross_entropy requires; got {tuple(input.shape)}"
            " (reshape a (B, T, H) input to (B*T, H) and its target to (B*T,))"
        )
    v.require_nonempty("input", input)
    hidden = input.shape[-1]
    if linear_weight.dim() > 2:
        raise NotImplementedError(
            f"linear_weight of shape {tuple(linear_weight.shape)} asks for torch's K-dimensional loss "
            "(C, d_1, ..., d_K, H); kernels_lib.linear_cross_entropy takes one head (C, H): "
            "use torch.nn.functional.linear_cross_entropy for it"
        )
    v.require_linear_head("linear_weight", linear_weight, hidden)
    n_classes = linear_weight.shape[0]
    if target.is_floating_point() and target.shape == (*input.shape[:-1], n_classes):
        raise NotImplementedError(
            "target holds class probabilities (floating, of the logits' shape "
            f"{tuple(target.shape)}); kernels_lib.linear_cross_entropy takes class indices (int64) of shape "
            f"{tuple(input.shape[:-1])}: use torch.nn.functional.linear_cross_entropy for soft targets"
        )
    v.require_index_dtype("target", target)
    v.require_shape("target", target, input.shape[:-1], "input.shape[:-1]")
    tensors = {"input": input, "linear_weight": linear_weight, "target": target}
    if linear_bias is not None:
        v.require_bias("linear_bias", linear_bias, linear_weight, weight_name="linear_weight")
        tensors["linear_bias"] = linear_bias
    if weight is not None:
        v.require_tensor("weight", weight)
        v.require_float("weight", weight)
        if weight.shape != (n_classes,):
            raise ValueError(
                f"weight (the per-class weights) must have shape (C,) = ({n_classes},), one per row of "
                f"linear_weight; got {tuple(weight.shape)}"
            )
        tensors["weight"] = weight
    v.require_same_device(tensors)
    v.require_choice("reduction", reduction, REDUCTIONS)
    if ignore_index is not None:
        v.require_int("ignore_index", ignore_index)
    v.require_probability("label_smoothing", label_smoothing)


def _valid_weight(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """The denominator of torch's ``mean``: the valid rows' total class weight, a float32 device tensor."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum(dtype=torch.float32)
    per_row = weight.detach().float()[torch.where(valid, target, 0).long()]
    return torch.where(valid, per_row, 0.0).sum()


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options=None,
) -> torch.Tensor:
    """``torch.nn.functional.linear_cross_entropy``, computed without the ``N × C`` logits.

    ``F.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight=weight,
    reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing)`` by
    :func:`kernels_lib.fused_linear_cross_entropy`; the mapping of each argument and of ``options``
    is the module's docstring.

    Args:
        input: ``(N, H)`` or ``(H,)``; float32, bfloat16 or float16.
        linear_weight: the head ``(C, H)``, ``input``'s dtype (any inside ``torch.autocast``).
        target: class indices, shape ``input.shape[:-1]``, int64 (or int32), in ``[0, C)`` or
            ``ignore_index``.
        linear_bias: ``(C,)`` or None.
        weight: per-class weights ``(C,)`` or None, as ``F.cross_entropy``'s ``weight``.
        reduction: ``"mean"`` (divided by the valid rows' total class weight), ``"sum"``, ``"none"``.
        ignore_index: None (-100) or the target value of rows that count for nothing.
        label_smoothing: ε in [0, 1], as ``F.cross_entropy``.
        options: None or a ``torch.nn.LinearCrossEntropyOptions``.

    Returns:
        The loss in ``input``'s dtype (float32 under ``torch.autocast``): a scalar, or with
        ``"none"`` one per row, shape ``target.shape``. NaN in gives NaN out.
    """
    _validate(input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing)
    ignore_index = DEFAULT_IGNORE_INDEX if ignore_index is None else ignore_index
    rows_x, rows_t = input.reshape(-1, input.shape[-1]), target.reshape(-1)
    chunk_size, accurate, retain = resolve_options(
        options, rows_x.shape[0], input.shape[-1], linear_weight.shape[0], input.dtype
    )
    inner = "none" if retain and reduction != "none" else reduction
    loss = fused_linear_cross_entropy(
        rows_x, linear_weight, rows_t, linear_bias, ignore_index=ignore_index, reduction=inner,
        label_smoothing=label_smoothing, chunk_size=chunk_size, accurate=accurate, class_weight=weight,
    )
    if reduction == "mean":
        total = _valid_weight(rows_t, weight, ignore_index)
        if inner == "none":
            loss = loss.sum() / total  # 0/0 is NaN, as torch's
        else:  # ours gives 0 where torch divides 0 by 0: its NaN, gradients left as they are (0)
            loss = loss + torch.where(total == 0, torch.nan, 0.0)
    elif reduction == "sum" and inner == "none":
        loss = loss.sum()
    else:
        loss = loss.reshape(target.shape) if reduction == "none" else loss
    autocast = torch.is_autocast_enabled(input.device.type)
    return loss if autocast else loss.to(input.dtype)
