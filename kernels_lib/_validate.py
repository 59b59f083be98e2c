"""Argument checks shared by the public functions: each error names the argument and what was expected."""

from __future__ import annotations

from collections.abc import Iterable

import torch

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


def require_ndim(name: str, tensor: torch.Tensor, ndim: int) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s); got shape {tuple(tensor.shape)}")


def require_index_dtype(name: str, tensor: torch.Tensor) -> None:
    """Refuse anything but int64/int32 class indices."""
    if tensor.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an int64 or int32 tensor of class indices; got {tensor.dtype}")
