r"""Checks of a kernel against its baseline, as a table a notebook prints and a test asserts.

For each case (a dtype and the loss's options) the same random inputs go to three calls:

- ``kernels_lib`` in the case's dtype;
- the baseline (Transformers / torch) in the same dtype;
- the baseline on float64 copies: the reference.

Errors are :math:`\lVert out - ref \rVert / \lVert ref \rVert` over the loss and over each
gradient, for the kernel and for the baseline. A case passes when the kernel's error is within the
dtype's tolerance, or within :data:`BASELINE_MARGIN` of the baseline's own error in that dtype (a
gradient that the dtype cannot represent fails both alike and the table shows it). NaN never passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd
import torch

from kernels_lib._runtime import INTERPRETED
from .bench.spec import Inputs
from .bench.registry import get_spec

#: How much more error than the baseline's own a kernel may have where both exceed the tolerance.
#: Two equally exact float32 summation orders land apart by a random factor on ill-conditioned sums:
#: 1.2× measured on an H200 (KTO's float32 dW, B = 8, T = 512, V = 128256, both errors ~1e-5).
BASELINE_MARGIN = 1.5

#: Relative-error tolerance per input dtype. The outputs are rounded to the input dtype, whose
#: unit roundoff is 2**-24 (fp32), 2**-8 (bf16), 2**-11 (fp16); accumulation is float32, so the
#: fp32 bound is set by summing ~1e6 terms (~1e-6) with headroom, and the 16-bit bounds by one
#: rounding of each output (about 0.5-1 ulp relative, in norm) with a factor of 2-4 of headroom.
#: On CUDA the float32 bound is 3e-5: cuBLAS and the Triton GEMMs sum float32 products in tile and
#: split orders of their own, and on a loss whose terms cancel (GRPO's clipped ratios) that gave
#: 1.14e-5 on an H200 where the baseline's own error was 5.8e-6. 3e-5 stays ten times below a
#: matmul that slipped into tf32 (~3e-4), which still fails.
TOLERANCE = {torch.float32: 1e-5 if INTERPRETED else 3e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (``||out||`` when ``ref`` is all zeros); NaN if either holds NaN."""
    out, ref = out.detach().double(), ref.detach().to(device=out.device, dtype=torch.float64)
    if out.shape != ref.shape:
        raise ValueError(f"out has shape {tuple(out.shape)} but ref has {tuple(ref.shape)}")
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return math.nan
    denominator = ref.norm().item()
    difference = (out - ref).norm().item()
    return difference / denominator if denominator > 0 else difference


def _converted(inputs: Inputs, dtype: torch.dtype | None) -> Inputs:
    """A fresh copy of ``inputs`` (floating tensors cast to ``dtype`` when given), leaves that take gradients."""
    mapping = {}

    def convert(value):
        if not isinstance(value, torch.Tensor):
            return value
        copy = value.detach().clone()
        if dtype is not None and copy.is_floating_point():
            copy = copy.to(dtype)
        if any(value is g for g in inputs.grad_inputs):
            copy.requires_grad_()
            mapping[id(value)] = copy
        return copy

    args = tuple(convert(a) for a in inputs.args)
    kwargs = {k: convert(v) for k, v in inputs.kwargs.items()}
    return Inputs(args, kwargs, [mapping[id(g)] for g in inputs.grad_inputs])


def _loss_tensor(out) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


def _run(fn, inputs: Inputs, upstream: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = _loss_tensor(fn(*inputs.args, **inputs.kwargs))
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), [g.grad for g in inputs.grad_inputs]


def check_against_reference(
    kernel_name: str, cases: list[dict], sizes: dict, device: torch.device | str, seed: int = 0,
    *, kernel: Callable | None = None, baseline: Callable | None = None,
) -> pd.DataFrame:
    """One row per case: the errors of kernels_lib and of the baseline against the float64 reference.

    ``cases``: dicts with ``dtype`` and any of the loss's options (e.g. ``reduction``, ``log_target``).
    The upstream gradient is 1 for a scalar loss (as in training) and random otherwise. ``kernel`` and
    ``baseline`` (callables with the provider signature of the loss's spec) replace the spec's
    ``kernels_lib`` provider and its baseline, e.g. to check against a peer's own function.
    """
    spec = get_spec(kernel_name)
    kernel = kernel or spec.providers["kernels_lib"].load()
    baseline = baseline or spec.providers[spec.baseline].load()
    rows = []
    for number, case in enumerate(cases):
        options = {k: v for k, v in case.items() if k != "dtype"}
        dtype = case["dtype"]
        inputs = spec.make_inputs(sizes, dtype, device, {**spec.default_options, **options}, seed + number)
        reference_loss, reference_grads = None, None
        reference_inputs = _converted(inputs, torch.float64)
        shape = _loss_tensor(baseline(*reference_inputs.args, **reference_inputs.kwargs)).shape
        generator = torch.Generator().manual_seed(seed + number)
        upstream = torch.ones(shape, dtype=torch.float64) if not shape else torch.randn(shape, generator=generator, dtype=torch.float64)
        upstream = upstream.to(inputs.grad_inputs[0].device)
        reference_loss, reference_grads = _run(baseline, reference_inputs, upstream)
        kernel_loss, kernel_grads = _run(kernel, _converted(inputs, None), upstream)
        baseline_loss, baseline_grads = _run(baseline, _converted(inputs, None), upstream)
        row = {"loss": kernel_name, "shape": "x".join(map(str, inputs.args[0].shape)), "dtype": str(dtype).replace("torch.", ""), **options}
        errors = {
            "kernels_lib loss err": relative_error(kernel_loss, reference_loss),
            "kernels_lib grad err": max(relative_error(k, r) for k, r in zip(kernel_grads, reference_grads)),
            "baseline loss err": relative_error(baseline_loss, reference_loss),
            "baseline grad err": max(relative_error(b, r) for b, r in zip(baseline_grads, reference_grads)),
        }
        tolerance = TOLERANCE[dtype]
        passed = all(
            not math.isnan(errors[f"kernels_lib {what} err"])
            and errors[f"kernels_lib {what} err"] <= max(tolerance, BASELINE_MARGIN * errors[f"baseline {what} err"])
            for what in ("loss", "grad")
        )
        rows.append({**row, **errors, "tolerance": tolerance, "passed": passed})
    return pd.DataFrame(rows)


def assert_checks_pass(table: pd.DataFrame) -> None:
    """Raise AssertionError listing the failing rows of a :func:`check_against_reference` table."""
    failing = table[~table["passed"]]
    if len(failing):
        raise AssertionError(f"{len(failing)} of {len(table)} checks failed:\n{failing.to_string(index=False)}")
