r"""What notebook 01 (fused linear + cross-entropy) computes beyond the bench: the derivation's and the
log-sum-exp merge's float64 checks, the check against Transformers' ``ForCausalLMLoss``, the budget of one
call, the precision of ``dx`` and ``dW``, and the newest GPU run of each GPU (:func:`gpu_runs`). Its
comparisons, floor and headline are the workbench's one set (:mod:`.comparison`, :mod:`.floor`,
:func:`.narrative.headline`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pandas as pd
import torch
import torch.nn.functional as F

from kernels_lib import reference
from kernels_lib.fused_linear_cross_entropy import fused_linear_cross_entropy as kernels_lib_flce
from . import data
from .bench import fused_linear_cross_entropy as flce
from .check import BASELINE_MARGIN, TOLERANCE, relative_error

#: The derivation's cases: (label_smoothing, z_loss_scale, softcap), each with every reduction.
DERIVATION_OPTIONS = [(0.0, 0.0, None), (0.1, 0.0, None), (0.0, 1e-2, None), (0.0, 0.0, 2.0), (0.2, 1e-2, 3.0)]
#: The committed chunk-size dial of kernels_lib (``studies/flce_dial_precision_stages.py`` writes it).
DIAL_FILE = "gpu_runs/fused_linear_cross_entropy_dial.csv"
#: Its committed precision run: loss, ``dx`` and ``dW`` against float64 per provider at the published size.
PRECISION_FILE = "gpu_runs/fused_linear_cross_entropy_precision.csv"


def derivation_check(naive_loss: Callable, derived_grads: Callable, seed: int = 0) -> pd.DataFrame:
    """The notebook's naive loss against the baseline, and its derived ``dx``, ``dW`` against autograd, in
    float64 on a 9 × 13 head of 29 classes (two rows ignored), per option set and reduction; raises naming
    the worst case when any error exceeds 1e-12."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 13, generator=generator, dtype=torch.float64, requires_grad=True)
    w = torch.randn(29, 13, generator=generator, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 29, (9,), generator=generator)
    y[[2, 5]] = -100
    rows = []
    for eps, lam, s in DERIVATION_OPTIONS:
        for reduction in ("none", "sum", "mean"):
            loss = naive_loss(x @ w.T, y, eps, lam, s, reduction=reduction)
            upstream = (torch.randn(9, generator=generator, dtype=torch.float64) if reduction == "none"
                        else torch.ones((), dtype=torch.float64))
            auto_dx, auto_dw = torch.autograd.grad(loss, (x, w), upstream)
            dx, dw = derived_grads(x.detach(), w.detach(), y, eps, lam, s, reduction, upstream)
            baseline = reference.fused_linear_cross_entropy(x, w, y, reduction=reduction, label_smoothing=eps,
                                                            z_loss_scale=lam, softcap=s)
            rows.append({"label_smoothing": eps, "z_loss_scale": lam, "softcap": s, "reduction": reduction,
                         "naive vs baseline (loss)": relative_error(loss, baseline),
                         "derived vs autograd (dx)": relative_error(dx, auto_dx),
                         "derived vs autograd (dW)": relative_error(dw, auto_dw)})
    table = pd.DataFrame(rows)
    errors = table.filter(like=" vs ")
    if not (errors < 1e-12).all().all():
        worst = errors.max(axis=1).idxmax()
        raise AssertionError(f"derivation check failed: {table.loc[worst].to_dict()}")
    return table


#: The options each row of the derivation table adds beyond the classic three, as checked by
#: :func:`row_options_check` (``True`` for ``token_weight``: the check draws the weights).
ROW_OPTIONS = {
    "ignored rows dropped": {},
    "every row through the matmuls": {"skip_ignored": False},
    "token_weight": {"token_weight": True},
    "token_scaling (DFT)": {"token_scaling": True},
    "token_weight + token_scaling, softcap, smoothing, z-loss": {
        "token_weight": True, "token_scaling": True, "softcap": 4.0, "label_smoothing": 0.1, "z_loss_scale": 1e-2},
    "return_lse (loss + Σ g·lse)": {"return_lse": True, "return_predicted": True},
}


def row_options_check(seed: int = 0, device="cpu", tolerance: float = 1e-5) -> pd.DataFrame:
    """kernels_lib against the float64 baseline for each of :data:`ROW_OPTIONS` and every reduction, on a
    41 × 19 head of 263 classes in float32 with about a third of the rows ignored: the relative errors of
    the loss and of ``dx``, ``dW``, ``db`` under a random upstream gradient (with ``return_lse``, of the
    objective ``Σ u·loss + Σ g·lse``), and whether the predicted classes are the float64 argmax. Raises
    naming the worst case when an error exceeds ``tolerance`` or a predicted class differs."""
    generator = torch.Generator().manual_seed(seed)
    n, h, v = 41, 19, 263
    x, w = torch.randn(n, h, generator=generator), torch.randn(v, h, generator=generator) * h**-0.5 * 2
    b, weights = torch.randn(v, generator=generator) / 4, torch.rand(n, generator=generator) * 2
    target = torch.randint(0, v, (n,), generator=generator)
    target[torch.rand(n, generator=generator) < 0.35] = -100
    rows = []
    for name, options in ROW_OPTIONS.items():
        for reduction in ("none", "sum", "mean"):
            got, want = ({**options, "reduction": reduction, "token_weight": weights.to(device, dtype)
                          if options.get("token_weight") else None} for dtype in (torch.float32, torch.float64))
            results = [_row_options_run(x, w, b, target, kwargs, device, dtype, generator_seed=seed)
                       for kwargs, dtype in ((got, torch.float32), (want, torch.float64))]
            (loss, grads, predicted), (ref_loss, ref_grads, ref_predicted) = results
            row = {"option": name, "reduction": reduction, "loss err": relative_error(loss, ref_loss)}
            row.update({f"{g} err": relative_error(a, c) for g, a, c in zip(("dx", "dW", "db"), grads, ref_grads)})
            row["predicted = argmax"] = None if predicted is None else bool(torch.equal(predicted.cpu(), ref_predicted.cpu()))
            rows.append(row)
    table = pd.DataFrame(rows)
    errors = table.filter(like=" err")
    failed = (errors > tolerance).any(axis=1) | table["predicted = argmax"].eq(False)
    if failed.any():
        raise AssertionError(f"row options check failed: {table[failed].iloc[0].to_dict()}")
    return table


def _row_options_run(x, w, b, target, options, device, dtype, generator_seed: int):
    """One call (kernels_lib in float32, the baseline in float64): the loss, its gradients, the predicted classes."""
    function = kernels_lib_flce if dtype == torch.float32 else reference.fused_linear_cross_entropy
    leaves = [t.to(device, dtype).requires_grad_() for t in (x, w, b)]
    out = function(*leaves[:2], target.to(device), leaves[2], **options)
    loss = out.loss if isinstance(out, tuple) else out
    upstream = torch.rand(loss.shape, generator=torch.Generator().manual_seed(generator_seed), dtype=torch.float64) + 0.5
    objective = (loss * upstream.to(device, dtype)).sum()
    if options.get("return_lse"):
        g_lse = torch.randn(out.lse.shape, generator=torch.Generator().manual_seed(generator_seed + 1), dtype=torch.float64)
        objective = objective + (out.lse * g_lse.to(device, dtype)).sum()
    predicted = out.predicted if isinstance(out, tuple) else None
    return loss, torch.autograd.grad(objective, leaves), predicted


def transformers_check(dtype: torch.dtype, reduction: str, shape: tuple, seed: int, device) -> dict:
    """kernels_lib against Transformers' ``ForCausalLMLoss`` on one ``(B, T, H, V)`` batch: logits from the head
    in ``dtype``, the labels shifted by ``ForCausalLMLoss`` (ours: the labels shifted left, the last position
    ignored; the first third of the first sequence padded with -100); both against the float64 baseline.
    ``sum`` is ``num_items_in_batch = 1``. ``passed``: within the dtype's tolerance or
    :data:`~kernels_workbench.check.BASELINE_MARGIN` of ``ForCausalLMLoss``'s own error."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    b, t, h, v = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, generator=gen).to(device, dtype)
    w = (torch.randn(v, h, generator=gen) * h**-0.5).to(device, dtype)
    labels = torch.randint(0, v, (b, t), generator=gen).to(device)
    labels[0, : t // 3] = -100
    target = F.pad(labels[:, 1:], (0, 1), value=-100)

    def run(loss_fn, cast):
        leaves = [tensor.detach().clone().to(cast).requires_grad_() for tensor in (x, w)]
        loss = loss_fn(*leaves)
        return loss, torch.autograd.grad(loss, leaves)

    from kernels_lib import fused_linear_cross_entropy

    ours, ours_grads = run(lambda xk, wk: fused_linear_cross_entropy(xk, wk, target, reduction=reduction), dtype)
    hf, hf_grads = run(lambda xh, wh: ForCausalLMLoss(xh @ wh.T, labels, vocab_size=v,
                                                      num_items_in_batch=1 if reduction == "sum" else None), dtype)
    ref, ref_grads = run(lambda xr, wr: reference.fused_linear_cross_entropy(xr, wr, target, reduction=reduction),
                         torch.float64)
    row = {"dtype": str(dtype).replace("torch.", ""), "reduction": reduction, "shape": f"B={b} T={t} H={h} V={v}",
           "kernels_lib loss err": relative_error(ours, ref),
           "kernels_lib grad err": max(relative_error(g, r) for g, r in zip(ours_grads, ref_grads)),
           "ForCausalLMLoss loss err": relative_error(hf, ref),
           "ForCausalLMLoss grad err": max(relative_error(g, r) for g, r in zip(hf_grads, ref_grads)),
           "kernels_lib vs ForCausalLMLoss (loss)": relative_error(ours, hf)}
    row["passed"] = all(row[f"kernels_lib {w} err"] <= max(TOLERANCE[dtype], BASELINE_MARGIN * row[f"ForCausalLMLoss {w} err"])
                        for w in ("loss", "grad"))
    return row


def budget(sizes: dict, floors: dict[str, float] | None = None, chunk_rows: int | None = None) -> tuple[pd.DataFrame, pd.Series]:
    """What one call must spend at ``sizes`` (``N``, ``H``, ``V``; bf16): the matmul TFLOP and the minimal bytes per
    mode (the spec's :meth:`~.bench.spec.LossSpec.flops`, :meth:`~.bench.spec.LossSpec.min_bytes`) and the floor
    (``floors``: mode → ms of :func:`.floor.floor` of a run at these sizes; "not measured" where absent); and what
    chunks of ``chunk_rows`` rows (the default chunk when None) add (the logits buffer, the ``dW`` accumulator's
    traffic, ``accurate=True``'s float32 copy)."""
    if chunk_rows is None:
        from kernels_lib.fused_linear_cross_entropy import default_chunk_size

        chunk_rows = default_chunk_size(sizes["N"], sizes["H"])
    floors = floors or {}
    n_chunks = -(-sizes["N"] // chunk_rows)
    weight_bytes = sizes["V"] * sizes["H"] * 2
    spec = flce.SPEC
    modes = {mode: [spec.flops(sizes, mode) / 1e12, spec.min_bytes(sizes, torch.bfloat16, mode) / 2**20,
                    floors.get(mode, math.nan)] for mode in ("forward_no_grad", "full")}
    label = "floor of the run (ms)" if any(math.isfinite(v) for v in floors.values()) else "floor (ms): not measured"
    table = pd.DataFrame(modes, index=["matmul TFLOP", "minimal bytes (MiB)", label])
    extra = pd.Series({
        "default chunk (rows)": chunk_rows, "chunks": n_chunks,
        "logits buffer (MiB)": chunk_rows * sizes["V"] * 2 / 2**20,
        "float32 dW accumulator, accurate=True (MiB)": 2 * weight_bytes / 2**20,
        "dW traffic over all chunks, bf16 (GiB)": n_chunks * 2 * weight_bytes / 2**30,
        "logits traffic of the two-pass kernel (GiB)": 3 * sizes["N"] * sizes["V"] * 2 / 2**30,
    }, name="per call")
    return table, extra


def _float64_reference(inputs):
    """Loss and gradients of the baseline on float64 copies of a bench ``Inputs``."""
    copies = [t.detach().double().requires_grad_() for t in inputs.grad_inputs]
    _, _, target, bias = inputs.args
    loss = reference.fused_linear_cross_entropy(copies[0], copies[1], target, copies[2] if bias is not None else None,
                                                **inputs.kwargs)
    loss.backward()
    return loss.detach(), [c.grad for c in copies]


def gradient_errors(sizes: dict, dtype: torch.dtype, device, providers: dict, *, seed: int = 0,
                    options: dict | None = None) -> pd.DataFrame:
    r"""Relative errors ``||out − ref|| / ||ref||`` of the loss, ``dx`` and ``dW`` of each provider
    (name → callable with our signature) against the baseline in float64, on the same inputs.

    ``dx`` is formed once per row, so its error is one rounding of the dtype; ``dW`` is a sum over all
    N rows, so an accumulator in the parameter dtype adds one rounding per chunk (about
    :math:`\sqrt{n_\text{chunks}}` roundings in norm) where a float32 one rounds once at the end.
    """
    inputs = flce.make_inputs(sizes, dtype, device, {"reduction": "mean", **(options or {})}, seed)
    ref_loss, (ref_dx, ref_dw, *_) = _float64_reference(inputs)
    rows = []
    for name, fn in providers.items():
        for tensor in inputs.grad_inputs:
            tensor.grad = None
        loss = fn(*inputs.args, **inputs.kwargs)
        loss.backward()
        x, weight = inputs.grad_inputs[:2]
        rows.append({"provider": name, "loss err": relative_error(loss, ref_loss), "dx err": relative_error(x.grad, ref_dx),
                     "dW err": relative_error(weight.grad, ref_dw)})
    table = pd.DataFrame(rows)
    n, h, v = flce._nhv(sizes)
    table.insert(1, "shape", f"N={n} H={h} V={v}")
    table.insert(2, "dtype", str(dtype).replace("torch.", ""))
    return table


def precision_sentence(precision: pd.DataFrame, rows: int, chunk_rows: int) -> str:
    """The bf16 accumulation's ``dW`` error against float32 accumulation at ``chunk_rows`` rows per chunk,
    and the baseline's, from a :func:`gradient_errors` table of ``rows`` rows (one generated sentence)."""
    errors = precision.set_index("provider")["dW err"]
    lean = errors.get(flce.variant_name({"chunk_size": chunk_rows, "accurate": False}), math.nan)
    exact = errors.get(flce.variant_name({"chunk_size": chunk_rows, "accurate": True}), math.nan)
    base = errors.get("torch", math.nan)
    return (f"Here, with {-(-rows // chunk_rows)} chunks, bf16 accumulation gives a dW error of {lean:.2e} against "
            f"{exact:.2e} for float32 accumulation ({lean / exact:.1f}×); the baseline, one product in float32, has {base:.2e}.")


def committed_run(name: str) -> pd.DataFrame | None:
    """A committed GPU run under ``data/measured/`` (``DIAL_FILE``, ``PRECISION_FILE``): its newest run per
    GPU, or None where the file is absent."""
    path = data.measured_file(name)
    if not path.exists():
        return None
    rows = data.read_table(path)
    return pd.concat(data.newest_run_per_gpu(rows).values(), ignore_index=True)


def gpu_runs(rows: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The newest run of each GPU among ``rows`` at the published workload (not the CCE paper's)."""
    if not len(rows):
        return {}
    return data.newest_run_per_gpu(rows[flce.is_published_workload(rows)])
