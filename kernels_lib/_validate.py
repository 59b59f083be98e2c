"""Argument checks shared by the public functions: each error names the argument and what was expected."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._autocast import mixes_dtypes
from ._runtime import check_kernel_device

#: Floating dtypes the kernels load (and accumulate in float32).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def require_float(name: str, tensor: torch.Tensor) -> None:
    """Refuse integer, bool, complex and float64 tensors (the kernels compute in float32)."""
    if tensor.dtype not in KERNEL_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in KERNEL_DTYPES)
        raise TypeError(f"{name} must be a floating tensor of dtype {allowed}; got {tensor.dtype}")


def require_same_shape(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Refuse differing shapes (torch would broadcast silently; we do not)."""
    if a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape; got {tuple(a.shape)} and {tuple(b.shape)}"
            " (kernels_lib does not broadcast)"
        )


def require_same_device(tensors: dict[str, torch.Tensor]) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device; got {listed}")
    for name, tensor in tensors.items():
        check_kernel_device(name, tensor)


def require_nonempty(name: str, tensor: torch.Tensor, min_dim: int = 1) -> None:
    if tensor.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimension(s); got shape {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise ValueError(f"{name} must not be empty; got shape {tuple(tensor.shape)}")


def require_choice(name: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def require_same_dtype(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Refuse differing dtypes (torch would promote or fail inside a matmul; we say which argument)."""
    if a.dtype != b.dtype:
        raise TypeError(f"{name_b} must have the dtype of {name_a} ({a.dtype}); got {b.dtype}")


def require_head_dtype(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """A head's tensors (``x``, ``weight``, ``bias``) share one dtype, except inside ``torch.autocast``
    for ``a``'s device type, where the matmuls cast them all to its dtype (:mod:`kernels_lib._autocast`)."""
    if a.dtype != b.dtype and not mixes_dtypes(a):
        raise TypeError(
            f"{name_b} must have the dtype of {name_a} ({a.dtype}); got {b.dtype}"
            " (inside torch.autocast they may differ: both are cast to its dtype)"
        )


def require_ndim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s); got shape {tuple(tensor.shape)}")


def require_index_dtype(name: str, tensor: torch.Tensor) -> None:
    """Refuse anything but int64/int32 class indices."""
    if tensor.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 or int32 tensor of class indices; got {tensor.dtype}")


def require_shape(name: str, tensor: torch.Tensor, shape, described: str) -> None:
    """Refuse a shape other than ``shape`` (``described`` says where it comes from, e.g. ``"x.shape[:-1]"``)."""
    if tensor.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {described} = {tuple(shape)}; got {tuple(tensor.shape)}")


def require_linear_head(name: str, weight: torch.Tensor, hidden: int, n_cols: int | None = None) -> None:
    """Refuse a head that is not ``(V, H)`` with ``H = hidden`` (and ``V = n_cols`` when given)."""
    if weight.dim() != 2:
        raise ValueError(f"{name} must have 2 dimensions, shape (V, H) with H = {hidden}; got shape {tuple(weight.shape)}")
    if weight.numel() == 0:
        raise ValueError(f"{name} must not be empty: shape (V, {hidden}) with V >= 1; got {tuple(weight.shape)}")
    v_ok = n_cols is None or weight.shape[0] == n_cols
    if weight.shape[1] != hidden or not v_ok:
        want = f"({'V' if n_cols is None else n_cols}, {hidden})"
        raise ValueError(f"{name} must have shape {want} (V, H) with H = {hidden}; got {tuple(weight.shape)}")


def require_bias(name: str, bias: torch.Tensor, weight: torch.Tensor, weight_name: str = "weight") -> None:
    """Refuse a bias that is not a ``(V,)`` tensor of the dtype of its head (any float dtype under
    autocast: :func:`require_head_dtype`)."""
    require_tensor(name, bias)
    require_float(name, bias)
    require_head_dtype(weight_name, weight, name, bias)
    if bias.shape != weight.shape[:1]:
        raise ValueError(f"{name} must have shape (V,) = ({weight.shape[0]},); got {tuple(bias.shape)}")


def require_real(name: str, value) -> None:
    """Refuse anything but a finite int or float (bools too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or abs(value) == float("inf"):
        raise TypeError(f"{name} must be a finite real number; got {value!r}")


def require_probability(name: str, value) -> None:
    """A finite real number in [0, 1] (label smoothing)."""
    require_real(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1]; got {value!r}")


def require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")


def require_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r}")


def require_chunk_options(chunk_size, accurate) -> None:
    """``chunk_size``: None or a positive int; ``accurate``: a bool (the fused linear losses' dials)."""
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int; got {chunk_size!r}")
    require_bool("accurate", accurate)


def require_head_inputs(x, weight, x_ndim: int | None = None, names=("x", "weight"), n_cols: int | None = None) -> None:
    """The checks of a head's input ``x`` (..., H) and ``weight`` (V, H): tensors, float dtypes that
    agree (or differ under autocast: :func:`require_head_dtype`), x's rank (``x_ndim``), non-empty,
    the head's shape (``n_cols`` classes when given)."""
    x_name, weight_name = names
    require_tensor(x_name, x)
    require_tensor(weight_name, weight)
    require_float(x_name, x)
    require_float(weight_name, weight)
    require_head_dtype(x_name, x, weight_name, weight)
    if x_ndim is not None:
        require_ndim(x_name, x, x_ndim)
    require_nonempty(x_name, x)
    require_linear_head(weight_name, weight, x.shape[-1], n_cols=n_cols)


def require_linear_loss_inputs(x, weight, target, x_ndim: int | None = None) -> None:
    """The checks every fused linear loss makes of ``x`` (..., H), ``weight`` (V, H) and ``target``
    (``x.shape[:-1]``, integer): :func:`require_head_inputs`, then the targets' dtype and shape.
    ``x_ndim`` fixes x's rank (the preference losses take (B, T, H))."""
    require_head_inputs(x, weight, x_ndim)
    require_tensor("target", target)
    require_index_dtype("target", target)
    require_shape("target", target, x.shape[:-1], "x.shape[:-1]")


def out_of_range_targets(target: torch.Tensor, n_cols: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, bad)`` masks of ``target``: not ``ignore_index``, and valid but outside ``[0, n_cols)``.
    The caller counts ``bad`` on the device and reads the count once its kernels are queued
    (:class:`TargetCheck`, :class:`HostCounts`); if non-zero, it raises :func:`targets_out_of_range_error`."""
    valid = target != ignore_index
    return valid, valid & ((target < 0) | (target >= n_cols))


def targets_out_of_range_error(name: str, target: torch.Tensor, bad: torch.Tensor, n_bad: int, n_cols: int, ignore_index: int) -> ValueError:
    """The error for ``n_bad`` targets outside ``[0, n_cols)`` (the first one quoted)."""
    return ValueError(
        f"{name} holds {n_bad} value(s) outside [0, {n_cols}) that are not ignore_index={ignore_index}"
        f" (e.g. {target[bad][0].item()})"
    )


def device_scalar(value, device: torch.device) -> torch.Tensor:
    """``value`` (a tensor or a Python number) as a detached float32 scalar on ``device``: a tensor is moved,
    a number filled in place on the device (``torch.tensor(number, device=cuda)`` would be a blocking copy
    from the host on every call)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(value), dtype=torch.float32, device=device)


class HostCounts:
    """A few integer counts made on the device, read on the host without stalling the GPU.

    On CUDA the counts (a small int tensor, computed before the call's kernels) are copied to pinned
    host memory behind an event; :meth:`read` waits for that event alone, which waits for the counts
    (queued before the call's kernels), never for the kernels, so the CPU keeps launching ahead of the
    GPU. On a CPU they are read at once. Either way they are the counts as they were when the check
    was made. The pinned buffer and its event are reused from call to call (a free list per device,
    size and dtype; creating them cost tens of microseconds of host time per call): a pair goes back
    to the list once :meth:`read` has waited on it, so no copy can still be writing it."""

    _free: dict[tuple, list] = {}  # (device index, numel, dtype) -> [(pinned counts, event)], guarded by the GIL

    def __init__(self, counts: torch.Tensor):
        counts = counts.reshape(-1)
        self.values: list[int] | None = None
        self.event = None
        if counts.is_cuda:
            self.key = (counts.device.index, counts.numel(), counts.dtype)
            free = HostCounts._free.setdefault(self.key, [])
            if free:
                self.host, self.event = free.pop()
            else:
                self.host, self.event = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True), torch.cuda.Event()
            self.host.copy_(counts, non_blocking=True)
            self.event.record(torch.cuda.current_stream(counts.device))
        else:  # nothing to wait for: read now
            self.values, self.host = [int(c) for c in counts.tolist()], None

    def read(self) -> list[int]:
        """The counts as Python ints (the first call on CUDA waits for their copy; later calls return the same)."""
        if self.values is None:
            self.event.synchronize()
            self.values = [int(c) for c in self.host.tolist()]
            HostCounts._free[self.key].append((self.host, self.event))
            self.host = self.event = None
        return self.values


class TargetCheck:
    """The deferred checks of a ``target`` tensor, counted on the device and read on the host only by
    :meth:`raise_if_bad`, which the caller runs once the call's kernels are queued (at the end of the call
    or, when the call forms a gradient, at the start of its backward): the counts travel in one
    :class:`HostCounts` copy, so the GPU never waits for the host.

    Always: the values outside ``[0, n_cols)`` other than ``ignore_index`` (refused by
    :func:`raise_out_of_range`, naming ``name``). ``n_bad``, that count as a one-element device tensor
    made before the call's kernels (:mod:`kernels_lib.kernels.target_totals`), or None to count it here
    from the target's masks (:func:`out_of_range_targets`; the not-``ignore_index`` mask then stays on
    the check as ``valid``, for callers that weigh tokens by it).

    ``sequences`` (``target`` ``(S, T)``): ``"every"`` refuses sequences with no valid token (their
    average log-prob would be 0/0), ``"any"`` only a ``target`` with no valid token at all; either keeps
    ``counts``, the valid tokens per sequence (float32). ``extra`` integer device scalars ride in the same
    copy, read by :meth:`extra_counts`. A range check alone copies the one count (no stacking: the
    cross-entropy's path costs what it did); the kernels read only in-range targets' entries, so the work
    done on a refused ``target`` is discarded, never out of bounds."""

    def __init__(self, target: torch.Tensor, n_cols: int, ignore_index: int, name: str = "target", *,
                 n_bad: torch.Tensor | None = None, sequences: str | None = None, extra: tuple[torch.Tensor, ...] = ()):
        if sequences not in (None, "every", "any"):
            raise ValueError(f"sequences must be None, 'every' or 'any'; got {sequences!r}")
        self.target, self.n_cols, self.ignore_index, self.name = target, n_cols, ignore_index, name
        self.sequences = sequences
        self.valid: torch.Tensor | None = None  #: the not-``ignore_index`` mask, when counted here
        self.counts: torch.Tensor | None = None  #: valid tokens per sequence (float32), with ``sequences``
        if n_bad is None:
            self.valid, bad = out_of_range_targets(target, n_cols, ignore_index)
            n_bad = bad.sum()
        if sequences is None and not extra:
            self.host = HostCounts(n_bad)
            return
        counts = (target != ignore_index if self.valid is None else self.valid).sum(-1)
        empty = counts == 0 if sequences == "every" else (counts.sum() == 0).view(1)
        self.counts = counts.to(torch.float32)
        # One copy for the checks and the caller's ``extra`` integer scalars (read by :meth:`extra_counts`).
        self.host = HostCounts(torch.stack([n_bad, empty.sum(), *(e.reshape(()).to(torch.int64) for e in extra)]))

    def extra_counts(self) -> list[int]:
        """The ``extra`` scalars as Python ints (waits for the checks' copy alone, never for the call's kernels)."""
        return self.host.read()[2:]

    def raise_if_bad(self) -> None:
        values = self.host.read()
        if values[0]:
            raise_out_of_range(self.name, self.target, self.n_cols, self.ignore_index)
        n_empty = values[1] if self.sequences is not None else 0
        if n_empty and self.sequences == "every":
            first = torch.nonzero(self.counts == 0)[0, 0].item()
            raise ValueError(
                f"{self.name} has {n_empty} sequence(s) with no valid token (every position is ignore_index="
                f"{self.ignore_index}; e.g. sequence {first}): its log-prob is undefined; drop it from the batch"
            )
        if n_empty:
            raise ValueError(f"{self.name} has no valid token (all ignore_index={self.ignore_index}): its mean would be 0/0")


def check_targets(target: torch.Tensor, n_cols: int, ignore_index: int, name: str = "target", *,
                  sequences: str | None = None, extra: tuple[torch.Tensor, ...] = ()) -> TargetCheck:
    """The :class:`TargetCheck` of ``target`` counted from its masks (its ``valid`` mask kept; with
    ``sequences``, its ``counts`` per sequence for the call): its ``raise_if_bad`` for the call's end."""
    return TargetCheck(target, n_cols, ignore_index, name, sequences=sequences, extra=extra)


def raise_out_of_range(name: str, target: torch.Tensor, n_cols: int, ignore_index: int) -> None:
    """Raise :func:`targets_out_of_range_error` for ``target``, once its count said it holds a bad value
    (the masks are made again here: only a refused call pays for them)."""
    _, bad = out_of_range_targets(target, n_cols, ignore_index)
    raise targets_out_of_range_error(name, target, bad, int(bad.sum()), n_cols, ignore_index)
