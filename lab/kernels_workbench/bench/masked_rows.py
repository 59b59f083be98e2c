r"""The LM-head loss of an SFT batch with its prompt positions masked: does the head's time follow the valid tokens?

The workload: Llama-3.2-1B's head (``H = 2048``, ``V = 128256``, bfloat16), 16 sequences of 2048
tokens, the first ``p`` % of each sequence's positions labelled ``-100`` (the prompt, as an SFT
collator masks it), ``p`` in :data:`MASKED_PERCENTS`; forward and backward of the loss (mode
``full``: ``dx`` and ``dW``), ``mean`` over the valid tokens. A loss that drops the masked rows before
the head's matmuls does ``6·(1 - p)·N·H·V`` FLOPs; one that runs every row does ``6·N·H·V`` whatever
``p``.

Providers, each with :func:`kernels_lib.fused_linear_cross_entropy`'s signature (those of the
fused cross-entropy's spec, :mod:`.fused_linear_cross_entropy`, where they exist):

- ``kernels_lib``: the default (ignored rows dropped, ``skip_ignored=True``);
  ``kernels_lib[skip_ignored=False]``: every row through the matmuls, the same function;
- ``liger``: ``LigerFusedLinearCrossEntropyLoss``; ``cce``: ``cut_cross_entropy.linear_cross_entropy``
  (CUDA only, as in the fused cross-entropy's spec);
- ``trl``: TRL's fused head as its trainers call it (``trl.kernels.ChunkedLogProbFunction`` on the
  valid positions, :func:`.trl_head.trl_head_token_logps`), the loss ``-Σ log p / n_valid``;
- ``three_matmuls``: the floor at every row (the spec's :data:`~.fused_linear_cross_entropy.FLOOR`);
  ``three_matmuls[valid rows]``: the same three products on the valid rows alone, after their gather:
  the floor of a loss that drops the masked rows.

Each point is timed by :func:`.timing.time_after_setup` (CUDA events around the call alone, at least
5 repeats, median and p20/p80), its peak memory minus the inputs by :func:`.timing.peak_memory_mib`;
the rows take the measured layout (:data:`.sweep.MEASURED_COLUMNS`: GPU, versions and commit on each),
``x_name = "masked_percent"``. ``scripts/masked_rows_bench.py`` runs it and writes the CSV.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from .environment import package_version, provenance
from .fused_linear_cross_entropy import FLOOR, PROVIDERS as FLCE_PROVIDERS, kernels_lib_variant
from .fused_linear_cross_entropy import make_inputs as flce_inputs
from .spec import Inputs, Provider
from .sweep import MEASURED_COLUMNS
from .timing import mode_callable, peak_memory_mib, time_after_setup

KERNEL_NAME = "fused_linear_cross_entropy_masked_rows"
MASKED_PERCENTS = (0, 25, 50, 75)
#: Llama-3.2-1B's head, 16 × 2048 tokens.
WORKLOAD = {"sequences": 16, "T": 2048, "H": 2048, "V": 128256}
#: The same path at a size Triton's interpreter runs in seconds (the CPU check).
TINY = {"sequences": 4, "T": 16, "H": 32, "V": 263}
DTYPE = torch.bfloat16
IGNORE_INDEX = -100


def make_inputs(sizes: dict, dtype: torch.dtype, device, percent: int, seed: int = 0) -> Inputs:
    """``x`` (N, H), ``weight`` (V, H) as the fused cross-entropy's bench makes them, and targets whose
    first ``percent`` % positions of each of the ``sequences`` rows of ``T`` tokens are ``-100``."""
    n = sizes["sequences"] * sizes["T"]
    inputs = flce_inputs({"N": n, "H": sizes["H"], "V": sizes["V"]}, dtype, device, {"ignore_fraction": 0.0}, seed)
    x, weight, target, bias = inputs.args
    prompt = round(percent / 100 * sizes["T"])
    target.view(sizes["sequences"], sizes["T"])[:, :prompt] = IGNORE_INDEX
    return Inputs(args=(x, weight, target, bias), kwargs={"ignore_index": IGNORE_INDEX, "reduction": "mean"},
                  grad_inputs=inputs.grad_inputs)


def _load_trl():
    import trl.kernels  # noqa: F401  (ImportError names the missing package)

    from .trl_head import trl_head_token_logps

    def trl_loss(x, weight, target, bias=None, *, ignore_index=IGNORE_INDEX, reduction="mean"):
        logps, _ = trl_head_token_logps(x, weight, bias, target, ignore_index)
        return -logps.sum() / (target != ignore_index).sum().clamp(min=1)

    return trl_loss


class _GatherThenThreeMatmuls(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, index):
        kept = x.index_select(0, index)
        logits = kept @ weight.T
        ctx.save_for_backward(kept, weight, logits, index)
        ctx.rows = x.shape[0]
        return logits[0, 0].float()

    @staticmethod
    def backward(ctx, grad_output):
        kept, weight, logits, index = ctx.saved_tensors
        dx = kept.new_zeros((ctx.rows, kept.shape[1])).index_copy_(0, index, logits @ weight)
        return dx, logits.T @ kept, None


def _load_valid_floor():
    def valid_rows_floor(x, weight, target, bias=None, **options):
        del bias, options
        index = torch.nonzero(target.reshape(-1) != IGNORE_INDEX).squeeze(1)
        return _GatherThenThreeMatmuls.apply(x.reshape(-1, x.shape[-1]), weight, index)

    return valid_rows_floor


PROVIDERS: dict[str, Provider] = {
    "kernels_lib": FLCE_PROVIDERS["kernels_lib"],
    "kernels_lib[skip_ignored=False]": kernels_lib_variant(skip_ignored=False),
    "liger": FLCE_PROVIDERS["liger"],
    "cce": FLCE_PROVIDERS["cce"],
    "trl": Provider("trl", _load_trl, "TRL's fused head (ChunkedLogProbFunction on the valid positions), -mean log p"),
    FLOOR: FLCE_PROVIDERS[FLOOR],
    f"{FLOOR}[valid rows]": Provider(f"{FLOOR}[valid rows]", _load_valid_floor,
                                     "the valid rows gathered, then the three products on them alone"),
}


def flops(sizes: dict, percent: int) -> float:
    """The matmul FLOPs of forward and backward on the valid rows: ``6·n_valid·H·V``."""
    valid = sizes["sequences"] * (sizes["T"] - round(percent / 100 * sizes["T"]))
    return 6.0 * valid * sizes["H"] * sizes["V"]


def measure(providers: Sequence[str], sizes: dict, device, *, percents: Sequence[int] = MASKED_PERCENTS,
            rep_ms: float = 800.0, log: Callable[[str], None] = print, seed: int = 0) -> pd.DataFrame:
    """Every provider at every masked share, mode ``full``, in the measured layout: a ``speed`` row (ms)
    and on CUDA a ``memory`` row (MiB: peak during the call minus the inputs) per point. A provider
    that cannot run here is named in every row's note; one that fails at a point gives a NaN row
    naming the error."""
    device = torch.device(device)
    unknown = [name for name in providers if name not in PROVIDERS]
    if unknown:
        raise ValueError(f"providers must be among {', '.join(PROVIDERS)}; got unknown {', '.join(unknown)}")
    loaded, skipped = {}, {}
    for name in providers:
        try:
            loaded[name] = PROVIDERS[name].load()
        except (ImportError, RuntimeError) as error:
            skipped[name] = f"{type(error).__name__}: {error}"
    skipped_note = "; ".join(f"{n} skipped ({why})" for n, why in skipped.items())
    stamp = provenance(device)
    trl_version = package_version("trl")
    rows = []
    for percent in percents:
        config = json.dumps({**sizes, "N": sizes["sequences"] * sizes["T"], "dtype": str(DTYPE),
                             "masked_percent": percent, "mode": "full", "reduction": "mean"})
        for name, fn in loaded.items():
            result = _measure(fn, sizes, device, percent, rep_ms, seed)
            notes = [result.get("error", ""), f"trl {trl_version}" if name == "trl" else "", skipped_note]
            base = {"kernel_name": KERNEL_NAME, "kernel_provider": name, "kernel_operation_mode": "full",
                    "x_name": "masked_percent", "x_label": "masked positions (%)", "x_value": percent,
                    "extra_benchmark_config_str": config, **stamp, "device": device.type,
                    "note": "; ".join(filter(None, notes))}
            timing = result.get("timing")
            rows.append({**base, "metric_name": "speed", "metric_unit": "ms",
                         "y_value_50": timing.p50 if timing else float("nan"),
                         "y_value_20": timing.p20 if timing else float("nan"),
                         "y_value_80": timing.p80 if timing else float("nan"),
                         "timer": timing.timer if timing else ""})
            if device.type == "cuda":
                memory = result.get("memory", float("nan"))
                rows.append({**base, "metric_name": "memory", "metric_unit": "MB", "y_value_50": memory,
                             "y_value_20": memory, "y_value_80": memory, "timer": "torch.cuda.max_memory_allocated"})
            shown = f"{timing.p50:.2f} ms [{timing.p20:.2f}, {timing.p80:.2f}]" if timing else result.get("error")
            log(f"{percent:>3} % masked  {name:<34} {shown}")
    return pd.DataFrame(rows, columns=MEASURED_COLUMNS)


def _measure(fn, sizes: dict, device: torch.device, percent: int, rep_ms: float, seed: int) -> dict:
    inputs = timed = None
    try:
        inputs = make_inputs(sizes, DTYPE, device, percent, seed)
        timed = mode_callable(lambda: fn(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full")
        memory = peak_memory_mib(timed, device, inputs.grad_inputs)
        timing = time_after_setup(lambda: None, timed, device, rep_ms=rep_ms, budget_ms=max(3 * rep_ms, 3000.0))
        return {"timing": timing, "memory": memory}
    except Exception as error:  # a provider's failure is a recorded NaN row, not a lost run
        return {"error": f"{type(error).__name__}: {next(iter(str(error).splitlines()), '')}"}
    finally:
        inputs = timed = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
