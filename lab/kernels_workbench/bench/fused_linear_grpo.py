r"""Fused linear + GRPO as the workbench measures it: two specs (token- and sequence-level importance
sampling), providers, inputs, the published workload, floors.

Providers, each a thin adapter with the signature of :func:`kernels_lib.fused_linear_grpo.fused_linear_grpo`
(returning a result with ``.loss``):

- ``kernels_lib``: our function, default options (the reference model through the same chunks,
  without gradient);
- ``torch``: :func:`kernels_lib.reference.fused_linear_grpo`, TRL 1.16's GRPO loss on full logits
  (matmuls in the input dtype, upcast to fp32): the published "torch" provider (Liger's
  ``TorchLMHeadGRPO``, the same lines);
- ``liger``: ``liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`` with its reference model (CUDA
  only; ``torch.compile``d chunk step, one sequence per chunk by default), every loss type and option
  of Liger 0.8.5's module passed through (``delta``, SAPO's and VESPO's constants, the bias-corrected
  KL); the sampler's log-probs and entropy masking it does not take: refused, naming them. Its
  ``luspo`` is TRL's earlier line: it counts padded positions that TRL 1.16 masks first, so its rows
  are TRL's loss only without padding (as in the published workload).

The published workload (Liger's ``benchmark_grpo_loss.py``, A100, two charts
``fused_linear_grpo_loss_token`` and ``fused_linear_grpo_loss_sequence``): ``B`` completions of
``T = 1024`` tokens, ``H = 4096``, ``V = 128256``, bf16, no bias; the policy's ``x`` and head
take gradients; a reference model of its own head (``ref_x``, ``ref_weight``) without gradient;
``β = 0.1`` (``TorchLMHeadGRPO``'s default), ``ε = 0.2`` both sides, temperature 1, no old
log-probs (on-policy), an all-ones attention mask, advantages ``randn(B)`` and the loss the masked
token mean (``bnpo``; with an all-ones mask it equals ``dapo``); the two charts differ only in
``importance_sampling_level``. Modes ``forward``, ``backward``, ``full`` and ``full`` memory.

Other loss types (TRL 1.16's, :data:`LOSS_TYPES`): ``./workbench bench fused_linear_grpo_loss_token
--option loss_type=cispo --option epsilon_high=5.0`` (any option of :data:`EXTRA_OPTIONS` or the
defaults); ``dr_grpo`` without ``max_completion_length`` takes ``T``. The rows record the options.
They all share the pass (the logits matmul, the stats pass, ``dz``, ``dx``, ``dW``); only the
per-token weights in torch differ, so their times should agree within noise: a sweep over them
checks that.

Floors: the policy's logits :math:`2BTHV` FLOPs and the reference's the same again; with a
gradient ``dx = dz W`` and ``dW = dz^\top x`` (:func:`flops`).
"""

from __future__ import annotations

import json

import pandas as pd
import torch

from kernels_lib import reference
from kernels_lib.fused_linear_grpo import fused_linear_grpo as kernels_lib_grpo
from .. import data
from .fused_linear_orpo import ignore_tokens
from .spec import Inputs, LossSpec, Provider, policy_and_reference, preference_sweep, require_cuda
from .trl_head import trl_provider

KERNEL_NAMES = {"token": "fused_linear_grpo_loss_token", "sequence": "fused_linear_grpo_loss_sequence"}

#: TRL 1.16's loss types (``GRPOConfig.loss_type``), each with what it is (the notebook's table and the dashboard).
LOSS_TYPES = {
    "grpo": "clipped surrogate, mean per sequence then over the batch (DeepSeekMath's GRPO)",
    "bnpo": "clipped surrogate, mean over the batch's active tokens (the published charts' loss)",
    "dr_grpo": "clipped surrogate, sum over B · max_completion_length (Dr. GRPO: no length bias)",
    "dapo": "clipped surrogate, sum over the active tokens of the whole generation batch (num_items_in_batch)",
    "cispo": "the detached, capped ratio min(ρ, ε_high) times A times the log-prob (ScaleRL's CISPO)",
    "sapo": "a sigmoid gate σ(τ(ρ − 1))·4/τ instead of the clip, τ by the advantage's sign (SAPO)",
    "luspo": "clipped surrogate, each sequence's sum (the mean scaled by its length), mean over B (LUSPO)",
    "vespo": "a detached Gamma weight of the sequence's log-ratio times A times the log-prob (VESPO)",
}
#: Options ``--option`` may set beyond the spec's defaults (:attr:`LossSpec.extra_options`).
EXTRA_OPTIONS = {
    "delta": "cap of the unclipped ratio (two-sided clipping; clipped loss types)",
    "max_completion_length": "dr_grpo's L_max (default here: T)",
    "temperature": "the logits divided by it",
    "use_bias_correction_kl": "the KL times the ratio",
    "sapo_temperature_pos": "sapo's τ for A > 0", "sapo_temperature_neg": "sapo's τ for A <= 0",
    "vespo_k_pos": "vespo's k for A >= 0", "vespo_lambda_pos": "vespo's λ for A >= 0",
    "vespo_k_neg": "vespo's k for A < 0", "vespo_lambda_neg": "vespo's λ for A < 0",
    "return_entropy": "also the mean entropy", "return_per_token": "also the per-token ratios and clip flags",
}

#: Options of :func:`make_inputs` that shape the data rather than the call.
DATA_OPTIONS = ("bias", "ignore_fraction", "input_grad")


def _load_liger():
    require_cuda("Liger")
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    modules: dict[tuple, torch.nn.Module] = {}

    def liger_grpo(x, weight, target, bias=None, *, advantages, old_logps=None, ref_logps=None, ref_x=None,
                   ref_weight=None, ref_bias=None, completion_mask=None, beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
                   importance_sampling_level="token", loss_type="grpo", max_completion_length=None,
                   num_items_in_batch=None, temperature=1.0, ignore_index=-100, delta=None,
                   sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, use_bias_correction_kl=False,
                   vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                   return_entropy=False, return_per_token=False, chunk_size=None, accurate=False, **unsupported):
        del chunk_size, accurate, return_per_token  # ours alone: Liger runs its own defaults and logs its own metrics
        if unsupported:  # sampler_logps (Liger takes the ratio itself), top_entropy_quantile, ...
            raise NotImplementedError(f"Liger's GRPO adapter does not take {', '.join(sorted(unsupported))}")
        if advantages.dim() != 1 or return_entropy:
            raise NotImplementedError("Liger's GRPO takes (B,) advantages and computes no entropy")
        # every option of the module, in the order of its signature: one compiled module per setting
        settings = dict(beta=beta, use_ref_model=ref_x is not None, epsilon_low=epsilon_low, epsilon_high=epsilon_high,
                        loss_type=loss_type, max_completion_length=max_completion_length,
                        importance_sampling_level=importance_sampling_level,
                        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                        temperature=temperature, delta=delta, use_bias_correction_kl=use_bias_correction_kl,
                        vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                        vespo_lambda_neg=vespo_lambda_neg)
        key = tuple(settings.items())
        if key not in modules:
            modules[key] = LigerFusedLinearGRPOLoss(**settings)
        valid = target != ignore_index
        mask = valid if completion_mask is None else valid & (completion_mask != 0)
        out = modules[key](
            x, weight, torch.where(valid, target, 0), mask.to(x.dtype), advantages, bias, ref_logps, old_logps,
            ref_x, ref_weight, ref_bias, num_items_in_batch=num_items_in_batch,
        )
        return out[0]  # (loss, metrics)

    return liger_grpo


PROVIDERS = {
    "kernels_lib": Provider("kernels_lib", lambda: kernels_lib_grpo, "kernels_lib.fused_linear_grpo (Triton)"),
    "torch": Provider("torch", lambda: reference.fused_linear_grpo, "TRL 1.16's GRPO loss on fp32 logits (the baseline)"),
    "liger": Provider("liger", _load_liger, "liger_kernel.chunked_loss LigerFusedLinearGRPOLoss"),
    "trl": trl_provider(reference.fused_linear_grpo, "GRPO"),
}


def make_inputs(sizes: dict, dtype: torch.dtype, device, options: dict, seed: int = 0) -> Inputs:
    """Policy ``x`` ``(B, T, H)`` and ``weight`` ``(V, H)`` (and a bias ``(V,)`` with
    ``options["bias"]``), the reference model's ``ref_x``, ``ref_weight`` (, ``ref_bias``) of the same
    shapes, int64 targets ``(B, T)`` (a fraction ``options["ignore_fraction"]`` at ``ignore_index``,
    each sequence's first token kept), an all-ones completion mask and advantages ``randn(B)``.

    The policy's weight and bias take gradients, ``x`` too unless ``options["input_grad"]`` is
    False (the published harness's ``_input`` requires grad); the reference takes none. ``x, ref_x ~
    N(0, 1)``, heads ``~ N(0, 1/H)``: logits of unit scale. The other options go to the call.
    """
    device = torch.device(device)
    b, t = int(sizes["B"]), int(sizes["T"])
    ignore_index = options.get("ignore_index", -100)
    generator = torch.Generator(device=device).manual_seed(seed)
    (x, weight, bias), (ref_x, ref_weight, ref_bias), target = policy_and_reference(sizes, dtype, device, options, generator)
    ignore_tokens(target, options.get("ignore_fraction", 0.0), ignore_index, generator)
    advantages = torch.randn(b, generator=generator, device=device)
    completion_mask = torch.ones(b, t, dtype=torch.long, device=device)
    grad_inputs = ([x] if options.get("input_grad", True) else []) + [weight] + ([bias] if bias is not None else [])
    for tensor in grad_inputs:
        tensor.requires_grad_()
    kwargs = {
        "advantages": advantages, "completion_mask": completion_mask,
        "ref_x": ref_x, "ref_weight": ref_weight, "ref_bias": ref_bias,
        **{k: val for k, val in options.items() if k not in DATA_OPTIONS},
    }
    if kwargs.get("loss_type") == "dr_grpo" and kwargs.get("max_completion_length") is None:
        kwargs["max_completion_length"] = t  # dr_grpo's L_max: the completions' length here
    return Inputs(args=(x, weight, target, bias), kwargs=kwargs, grad_inputs=grad_inputs)


def flops(sizes: dict, mode: str, input_grad: bool = True) -> float:
    """Matmul FLOPs, ``2·B·T·H·V`` per product: the policy's and the reference's logits for the loss
    (``forward``, ``forward_no_grad``), ``dx`` and ``dW`` for the gradients (``backward``; ``dW``
    alone without ``input_grad``), all for ``full``."""
    product = 2.0 * int(sizes["B"]) * int(sizes["T"]) * int(sizes["H"]) * int(sizes["V"])
    gradients = 1 + int(input_grad)
    products = {"forward": 2, "forward_no_grad": 2, "backward": gradients, "full": 2 + gradients}[mode]
    return product * products


def bytes_moved(sizes: dict, dtype: torch.dtype, mode: str) -> int:
    """Bytes at least moved: read both models' hidden states and heads and the int64 targets; with a
    gradient write ``dx`` and ``dW``."""
    rows, h, v = int(sizes["B"]) * int(sizes["T"]), int(sizes["H"]), int(sizes["V"])
    item = torch.empty((), dtype=dtype).element_size()
    reads = 2 * (rows * h + v * h) * item + rows * 8
    return reads + (rows * h + v * h) * item if mode in ("backward", "full") else reads


def published_rows(level: str = "token"):
    """Liger's published rows of GRPO (A100) at ``importance_sampling_level`` ``level``."""
    return data.load_published(KERNEL_NAMES[level])


def _spec(level: str) -> LossSpec:
    return LossSpec(
        kernel_name=KERNEL_NAMES[level],
        providers=PROVIDERS,
        make_inputs=make_inputs,
        **preference_sweep(),
        bytes_moved=bytes_moved,
        matmul_flops=flops,
        baseline="torch",
        default_options={
            "beta": 0.1, "epsilon_low": 0.2, "epsilon_high": 0.2, "loss_type": "bnpo",
            "importance_sampling_level": level, "bias": False, "ignore_fraction": 0.0, "input_grad": True,
        },
        extra_options=EXTRA_OPTIONS,
    )


SPEC_TOKEN = _spec("token")
SPEC_SEQUENCE = _spec("sequence")
#: Both charts; :mod:`.registry` reads ``SPECS`` where a module defines more than one ``SPEC``.
SPECS = (SPEC_TOKEN, SPEC_SEQUENCE)
SPEC = SPEC_TOKEN


def loss_type_table(rows: pd.DataFrame, ceilings: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per loss type from one run of ``scripts/grpo_loss_types.py``
    (``data/measured/gpu_runs/fused_linear_grpo_loss_types.csv``): each provider's ``full`` median (ms), its
    memory (MB, peak minus inputs, where measured), kernels_lib's time over each peer's and each provider's
    over the floor of ``full``: :func:`kernels_workbench.floor.floor_at` at the run's own rates
    (:func:`kernels_workbench.floor.run_rates`: the ``matmul_tflops`` it measured, the copy bandwidth of its
    commit on its GPU in ``ceilings``, by default ``data/measured/ceilings.csv``), ``floor bound`` saying which
    is longer; NaN ("not measured") where the run has no such rate.

    A provider missing from the run (Liger off CUDA) has no column; a loss type it failed on, NaN.
    Raises ``ValueError`` (:func:`..data.run_label`) when ``rows`` mix runs."""
    from .. import floor as one_floor  # the one floor (it reads the specs' registry, which imports this module)

    data.run_label(rows)
    full = rows[rows.kernel_operation_mode == "full"]
    order = [t for t in LOSS_TYPES if t in set(full.loss_type)]
    speed = full[full.metric_name == "speed"].pivot_table(index="loss_type", columns="kernel_provider", values="y_value_50")
    memory = full[full.metric_name == "memory"].pivot_table(index="loss_type", columns="kernel_provider", values="y_value_50")
    providers = [p for p in PROVIDERS if p in speed.columns]
    table = pd.DataFrame(index=pd.Index(order, name="loss type"))
    for provider in providers:
        table[f"{provider} ms"] = speed[provider]
    for provider in providers:
        if provider in memory.columns:
            table[f"{provider} MB"] = memory[provider]
    for provider in providers[1:]:
        table[f"kernels_lib / {provider}"] = speed["kernels_lib"] / speed[provider]
    config = json.loads(full.extra_benchmark_config_str.iloc[0])
    sizes = {**{k: v for k, v in config.items() if k[:1].isupper() and isinstance(v, int)}, "B": int(full.x_value.iloc[0])}
    dtype = getattr(torch, str(config.get("dtype", "torch.bfloat16")).replace("torch.", ""))
    ceilings = data.load_measured("ceilings", latest=False) if ceilings is None else ceilings
    floor_ms, bound, _, _ = one_floor.floor_at(KERNEL_NAMES["token"], sizes, dtype, "full", one_floor.run_rates(rows, ceilings),
                                               options={k: v for k, v in config.items() if k == "input_grad"})
    table["floor ms"], table["floor bound"] = floor_ms, bound
    for provider in providers:
        table[f"{provider} / floor"] = speed[provider] / floor_ms
    return table
