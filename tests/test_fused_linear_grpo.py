"""Fused linear GRPO against the float64 reference and against TRL 1.16's own ``GRPOTrainer._compute_loss``.

Errors are relative in norm, ``||out - ref|| / ||ref||`` (absolute where the reference is 0), the
reference run on float64 copies of the very inputs the kernel saw. Shapes are small and odd (H = 40,
reference H = 24, V = 1031, T = 6; B = 1 and T = 1 apart): on a machine without a GPU the kernels run
in Triton's interpreter. Every batch but the T = 1 ones holds an all-masked sequence (sequence 1:
completion mask 0 from position 2 on, targets ignored before), padding at the end of sequence 2
(ignored targets) and a completion-mask hole in sequence 3 (valid targets, mask 0: TRL's ``tool_mask``).

Also: a hypothesis property test (the helpers and tolerance rules of ``tests/test_properties.py``:
floors per dtype, 4x the reference's own error in the kernel's arithmetic, the lean dW floors), NaN
propagation, bad inputs naming the argument, determinism, and the two bench specs (presets against
the published CSV, inputs, the check table, a tiny CPU sweep, the Liger adapter on a stand-in).
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
import test_properties as properties  # the hypothesis helpers: run_three, compare, lean_floors, SETTINGS
from kernels_lib import default_device, reference
from kernels_lib._sequence_logprobs import chunk_rows
from kernels_lib.fused_linear_grpo import CLIPPED, LOSS_TYPES, SAMPLING_MODES, FusedLinearGRPOLoss, GRPOOutput, fused_linear_grpo
from kernels_lib.fused_linear_cross_entropy import matmul_dtype
from kernels_workbench.check import TOLERANCE
from sequence_loss_checks import assert_errors_below, double_leaves, grads_of

DEVICE = default_device()

# Relative-error tolerances per input dtype, as tests/test_fused_linear_kto.py: float32 differs from
# the float64 reference only in summation order (observed ~1e-7); bfloat16 / float16 gradients are
# rounded once to the input dtype (u = 2^-8, 2^-11) and dW/db accumulated across chunks in it: 5u, 8u.
#: float32 as kernels_workbench.check.TOLERANCE states it per device (CUDA's float32 matmuls: 3e-5)
TOL = {torch.float32: TOLERANCE[torch.float32], torch.float16: 4e-3, torch.bfloat16: 2e-2}
LEVELS = ("token", "sequence")
METRICS = ("clip_ratio_low_mean", "clip_ratio_low_min", "clip_ratio_high_mean", "clip_ratio_high_max", "clip_ratio_region_mean")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error in norm; absolute where the reference is 0; 0 where both are NaN at the same places."""
    out, ref = out.detach().double(), ref.detach().to(out.device, torch.float64)
    assert out.shape == ref.shape
    nan = torch.isnan(ref)
    if not torch.equal(nan, torch.isnan(out)):
        return math.inf
    out, ref = out[~nan], ref[~nan]
    norm = ref.norm().item()
    return (out - ref).norm().item() / (norm if norm > 0 else 1.0)


def make_inputs(batch=4, seq=6, hidden=40, ref_hidden=24, vocab=1031, dtype=torch.float32, bias=True, seed=0):
    """Policy leaves, targets, completion mask, advantages, old and reference log-probs, a reference model."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if bias else None
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch >= 4 and seq >= 4:
        target[1, :2] = -100  # sequence 1: nothing active (ignored targets, then mask 0)
        mask[1, 2:] = 0
        target[2, -2:] = -100  # padding
        mask[3, 1:3] = 0  # valid targets the mask leaves out
    with torch.no_grad():
        logps = reference.fused_linear_grpo(
            x.double(), w.double(), target, None if b is None else b.double(), advantages=torch.zeros(batch)
        ).per_token_logps.float()
    tensors = dict(
        advantages=torch.randn(batch, generator=gen),
        # near the current policy, so that some ratios fall inside and some outside the clip range
        old_logps=logps + 0.3 * torch.randn(batch, seq, generator=gen),
        ref_logps=logps + 0.5 * torch.randn(batch, seq, generator=gen),
        completion_mask=mask,
    )
    model = dict(
        ref_x=torch.randn(batch, seq, ref_hidden, generator=gen).to(DEVICE, dtype),
        ref_weight=(torch.randn(vocab, ref_hidden, generator=gen) * ref_hidden**-0.5 * 2).to(DEVICE, dtype),
        ref_bias=torch.randn(vocab, generator=gen).to(DEVICE, dtype) if bias else None,
    )
    leaves = [t.to(DEVICE, dtype).requires_grad_() if t is not None else None for t in (x, w, b)]
    return (*leaves, target.to(DEVICE), {k: t.to(DEVICE) for k, t in tensors.items()}, model)


def with_sampler(tensors: dict, seed=11, scale=0.3) -> dict:
    """``tensors`` and the rollout engine's log-probs ``sampler_logps``, near the old ones (one NaN: a
    token the sampler could not score, ratio 1 in TRL)."""
    gen = torch.Generator().manual_seed(seed)
    old = tensors["old_logps"]
    sampler = old + scale * torch.randn(old.shape, generator=gen).to(old.device)
    if old.shape[0] >= 3 and old.shape[1] >= 2:
        sampler[2, 1] = float("nan")
    return tensors | {"sampler_logps": sampler}


def as_double(tensors: dict) -> dict:
    """Floating tensors in float64 (the reference's inputs); the rest as they are."""
    return {k: t.double() if torch.is_tensor(t) and t.is_floating_point() else t for k, t in tensors.items()}


def check_against_reference(x, w, b, target, tensors, tol, grad_output=0.7, **options):
    """Loss, per-token log-probs, metrics and every gradient of the kernel vs the float64 reference."""
    out = fused_linear_grpo(x, w, target, b, **tensors, **options)
    ref_inputs = double_leaves(x, w, b)
    want = reference.fused_linear_grpo(*ref_inputs[:2], target, ref_inputs[2], **as_double(tensors), **options)
    assert isinstance(out, GRPOOutput) and out.loss.dtype == torch.float32 and out.loss.shape == ()
    assert out.per_token_logps.shape == target.shape and not out.per_token_logps.requires_grad
    errors = {}
    for name in GRPOOutput._fields:
        got, expected = getattr(out, name), getattr(want, name)
        assert (got is None) == (expected is None), name
        if got is not None:
            assert got.dtype == torch.float32, name
            errors[name] = rel_err(got, expected)
    assert_errors_below(out.loss, want.loss, (x, w, b), ref_inputs, errors, tol, grad_output, rel_err)
    return out, want


# --------------------------------------------------------------------------- against the float64 reference


@pytest.mark.parametrize("loss_type, level", list(itertools.product(LOSS_TYPES, LEVELS)))
def test_every_loss_type_and_level(loss_type, level):
    """beta > 0, asymmetric epsilons, temperature != 1, old and reference log-probs given, one sequence per chunk."""
    x, w, b, target, tensors, _ = make_inputs()
    out, _ = check_against_reference(
        x, w, b, target, tensors, TOL[torch.float32], loss_type=loss_type, importance_sampling_level=level,
        beta=0.1, epsilon_low=0.1, epsilon_high=0.28, temperature=0.7, max_completion_length=9, chunk_size=6,
        return_entropy=True,
    )
    # the data exercise both sides of the clip range (else the clip branches would go untested)
    if level == "token" and loss_type in CLIPPED:
        assert 0 < out.clip_ratio_region_mean < 1


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_on_policy_without_reference(loss_type, level):
    """TRL with num_iterations = 1: old_logps None (ratio 1, nothing clipped), beta = 0, no reference."""
    x, w, b, target, tensors, _ = make_inputs(seed=1)
    tensors = {k: tensors[k] for k in ("advantages", "completion_mask")}
    out, _ = check_against_reference(
        x, w, b, target, tensors, TOL[torch.float32], loss_type=loss_type, importance_sampling_level=level
    )
    assert out.kl is None and out.entropy is None and out.clip_ratio_region_mean == 0


@pytest.mark.parametrize("chunk_size", [None, 1, 12])  # one chunk; one sequence per chunk; two
def test_reference_model_and_chunks(chunk_size):
    x, w, b, target, tensors, model = make_inputs()
    tensors = {k: v for k, v in tensors.items() if k != "ref_logps"} | model
    check_against_reference(
        x, w, b, target, tensors, TOL[torch.float32], beta=0.04, loss_type="bnpo", chunk_size=chunk_size,
        temperature=1.3, return_entropy=True,
    )


def test_reference_model_equals_its_logps():
    x, w, b, target, tensors, model = make_inputs()
    tensors.pop("ref_logps")
    with torch.no_grad():
        ref_logps = reference.fused_linear_grpo(
            model["ref_x"], model["ref_weight"], target, model["ref_bias"], advantages=tensors["advantages"], temperature=0.8
        ).per_token_logps
    options = dict(beta=0.3, temperature=0.8, chunk_size=6)
    with_model = fused_linear_grpo(x, w, target, b, **tensors, **model, **options)
    given_logps = fused_linear_grpo(x, w, target, b, **tensors, ref_logps=ref_logps, **options)
    for name in ("loss", "kl", *METRICS):
        assert rel_err(getattr(given_logps, name), getattr(with_model, name)) < TOL[torch.float32], name


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, level):
    x, w, b, target, tensors, model = make_inputs(dtype=dtype, seed=2)
    tensors = {k: v for k, v in tensors.items() if k != "ref_logps"} | model
    check_against_reference(
        x, w, b, target, tensors, TOL[dtype], beta=0.1, epsilon_low=0.15, epsilon_high=0.3, chunk_size=12,
        importance_sampling_level=level, loss_type="dr_grpo", max_completion_length=8,
    )


@pytest.mark.parametrize("level", LEVELS)
def test_per_token_advantages_and_accurate(level):
    x, w, b, target, tensors, _ = make_inputs(seed=3)
    gen = torch.Generator().manual_seed(7)
    tensors["advantages"] = torch.randn(target.shape, generator=gen).to(DEVICE)
    check_against_reference(
        x, w, b, target, tensors, TOL[torch.float32], beta=0.2, importance_sampling_level=level, accurate=True, chunk_size=6
    )


@pytest.mark.parametrize(
    "batch, seq, level", [(1, 6, "token"), (1, 6, "sequence"), (3, 1, "token"), (3, 1, "sequence"), (1, 1, "token")]
)
def test_odd_sizes_no_bias(batch, seq, level):
    """B = 1, T = 1 (TRL's metric helpers then take their (B, 1) branch, as ours do), H = 33, no bias."""
    x, w, _, target, tensors, _ = make_inputs(batch=batch, seq=seq, hidden=33, bias=False, seed=4)
    check_against_reference(
        x, w, None, target, tensors, TOL[torch.float32], grad_output=1.0, beta=0.05, importance_sampling_level=level,
        loss_type="bnpo", epsilon_low=0.05, epsilon_high=0.4,
    )


@pytest.mark.parametrize("normalizer", [7.5, "tensor"])
def test_dapo_normalizer(normalizer):
    x, w, b, target, tensors, _ = make_inputs()
    value = torch.tensor([11.0], device=DEVICE) if normalizer == "tensor" else normalizer
    check_against_reference(x, w, b, target, tensors, TOL[torch.float32], loss_type="dapo", beta=0.1, num_items_in_batch=value)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_token_masked_gives_zero(loss_type):
    """No active token at all: TRL's clamps make the loss 0 with zero gradients; the means are 0, the min/max NaN."""
    x, w, b, target, tensors, _ = make_inputs()
    tensors["completion_mask"] = torch.zeros_like(tensors["completion_mask"])
    out, _ = check_against_reference(
        x, w, b, target, tensors, TOL[torch.float32], loss_type=loss_type, max_completion_length=6, beta=0.1
    )
    assert out.loss == 0 and out.kl == 0
    assert torch.isnan(out.clip_ratio_low_min) if loss_type in CLIPPED else out.clip_ratio_low_min is None
    assert all(torch.all(g == 0) for g in grads_of(fused_linear_grpo(x, w, target, b, **tensors, loss_type=loss_type,
                                                                       max_completion_length=6, beta=0.1).loss, (x, w, b), 1.0))


@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_sampling_modes(mode):
    """The vLLM correction in each mode (bounds on both sides), delta and the bias-corrected KL, vs float64;
    a NaN sampler log-prob is ratio 1 (TRL's ``nan_to_num``): the same loss as the old log-prob there."""
    x, w, b, target, tensors, _ = make_inputs(seed=10)
    tensors = with_sampler(tensors)
    options = dict(loss_type="dapo" if mode.startswith("token") else "grpo", beta=0.1, delta=1.2, use_bias_correction_kl=True,
                   vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=0.8,
                   vllm_importance_sampling_clip_max=1.25, chunk_size=6)
    out, _ = check_against_reference(x, w, b, target, tensors, TOL[torch.float32], **options)
    assert torch.isfinite(out.loss)
    filled = tensors["sampler_logps"].clone()
    filled[2, 1] = tensors["old_logps"][2, 1]
    assert torch.equal(fused_linear_grpo(x, w, target, b, **tensors | {"sampler_logps": filled}, **options).loss, out.loss)


def test_logits_of_1e4():
    """Logits of magnitude 1e4: log-probs near 0 and near -2e4 keep their accuracy."""
    x, w, b, target, tensors, _ = make_inputs(seed=5)
    with torch.no_grad():
        x.mul_(300.0)
    tensors.pop("old_logps")
    tensors.pop("ref_logps")
    check_against_reference(x, w, b, target, tensors, TOL[torch.float32], loss_type="bnpo")


# --------------------------------------------------------------------------- against TRL's own loss code


def trl_sampling_ratio(old_per_token_logps, sampling_per_token_logps, completion_mask, tool_mask, opts):
    """TRL 1.16's own lines of the vLLM importance-sampling ratio (``_generate_and_score_completions``,
    grpo_trainer.py 2660–2706), taken from its source and run on a stand-in ``self``: they sit inside
    the generation step, which needs a model and a rollout engine."""
    import inspect
    import textwrap

    from trl.trainer.grpo_trainer import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start = source.index("            if self.use_vllm and self.vllm_importance_sampling_correction:\n                mask =")
    end = source.index("            # Compute the per-token log probabilities for the reference model", start)
    stand_in = SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=opts.get("vllm_importance_sampling_mode", "sequence_mask"),
        vllm_importance_sampling_clip_min=opts.get("vllm_importance_sampling_clip_min"),
        vllm_importance_sampling_clip_max=opts.get("vllm_importance_sampling_clip_max", 3.0),
    )
    scope = dict(self=stand_in, math=math, torch=torch, old_per_token_logps=old_per_token_logps,
                 sampling_per_token_logps=sampling_per_token_logps, completion_mask=completion_mask, tool_mask=tool_mask)
    exec(textwrap.dedent(source[start:end]), scope)  # noqa: S102  (TRL's installed source, read-only)
    return scope["vllm_importance_sampling_ratio"]


def trl_grpo(x, w, b, target, tensors, opts, processes=1, accumulation=1, steps_per_generation=1):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` itself (trl/trainer/grpo_trainer.py 3020–3292), called on a stand-in.

    The stand-in's ``_get_per_token_logps_and_entropies`` is TRL's fused head (``add_fused_lm_head``'s
    fused branch, trl/trainer/utils.py 1642–1660, as on a machine without Triton: every position
    scored by ``ChunkedLogProbFunction``, ``masked_fill(~mask, 0)``) on ``x`` and the head; the
    reference log-probs come from the same head under ``torch.no_grad()`` on the reference model, as
    ``_generate_and_score_completions`` computes them (grpo_trainer.py 2709–2720). Our completion mask enters as TRL's
    ``tool_mask`` beside ``completion_mask = labels != -100``. Returns the loss and the logged metrics.
    """
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    labels = target
    valid = labels != -100

    def fused_head(hidden, head, head_bias):
        out = ChunkedLogProbFunction.apply(
            hidden.reshape(-1, hidden.shape[-1]), head, head_bias, labels.clamp(min=0).reshape(-1),
            opts.get("temperature", 1.0), _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy"),
        )
        return [t.view(valid.shape).masked_fill(~valid, 0) for t in out[:2]]

    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **_):
        assert logits_to_keep == target.shape[1]
        logps, entropy = fused_head(x, w, b)
        return logps, entropy, None

    inputs = dict(
        prompt_ids=torch.zeros(target.shape[0], 0, dtype=torch.long, device=target.device),
        prompt_mask=torch.zeros(target.shape[0], 0, dtype=torch.long, device=target.device),
        completion_ids=target.clamp(min=0),
        completion_mask=valid.long(),
        tool_mask=tensors["completion_mask"],
        advantages=tensors["advantages"],
        num_items_in_batch=(valid.long() * tensors["completion_mask"]).sum(),
    )
    if tensors.get("old_logps") is not None:
        inputs["old_per_token_logps"] = tensors["old_logps"]
    sampler = tensors.get("sampler_logps")
    if sampler is not None:  # TRL computes old_per_token_logps whenever the correction is on (2643–2656)
        if "old_per_token_logps" not in inputs:
            with torch.no_grad():
                inputs["old_per_token_logps"] = fused_head(x, w, b)[0]
        inputs["importance_sampling_ratio"] = trl_sampling_ratio(
            inputs["old_per_token_logps"], sampler, inputs["completion_mask"], inputs["tool_mask"], opts
        )
    if opts.get("beta", 0.0) != 0.0:
        with torch.no_grad():
            inputs["ref_per_token_logps"] = fused_head(tensors["ref_x"], tensors["ref_weight"], tensors["ref_bias"])[0]
    defaults = dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                    vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=False, delta=None)
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=sampler is not None,
        vllm_importance_sampling_correction=sampler is not None,
        importance_sampling_level=opts.get("importance_sampling_level", "token"), beta=opts.get("beta", 0.0),
        loss_type=opts["loss_type"], epsilon_low=opts.get("epsilon_low", 0.2), epsilon_high=opts.get("epsilon_high", 0.2),
        max_completion_length=opts.get("max_completion_length"), get_gamma_weights=GRPOTrainer.get_gamma_weights,
        args=SimpleNamespace(**{k: opts.get(k, d) for k, d in defaults.items()}, steps_per_generation=steps_per_generation),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=accumulation,
        accelerator=SimpleNamespace(num_processes=processes, reduce=lambda t, reduction: t, gather=lambda t: t),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies,
    )
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    metrics = {name.replace("/", "_"): values[-1] for name, values in trainer._metrics["train"].items()}
    return loss, metrics


@pytest.mark.parametrize("loss_type, level", list(itertools.product(LOSS_TYPES, LEVELS)))
def test_matches_trl(loss_type, level):
    """Kernel and reference against TRL's own loss code: loss, metrics, and the gradients of its autograd path."""
    pytest.importorskip("trl")
    x, w, b, target, tensors, model = make_inputs(seed=6)
    tensors = {k: v for k, v in tensors.items() if k != "ref_logps"} | model
    opts = dict(
        loss_type=loss_type, importance_sampling_level=level, beta=0.1, epsilon_low=0.1, epsilon_high=0.28,
        temperature=0.7, max_completion_length=9,
    )
    assert_matches_trl(x, w, b, target, tensors, opts)


def assert_matches_trl(x, w, b, target, tensors, opts):
    """Loss, the metrics TRL logs (exactly those not None) and the gradients, kernel and reference, vs TRL."""
    loss, metrics = trl_grpo(x, w, b, target, tensors, opts)
    want = grads_of(loss, (x, w, b), torch.tensor(1.0, device=DEVICE))
    expected = {"entropy"} | ({"kl"} if opts.get("beta", 0.0) != 0.0 else set()) | {"cispo": {"cispo_clip_ratio"}, "sapo": set(), "vespo": {"vespo_phi_seq_mean"}}.get(
        opts["loss_type"], set(METRICS))
    assert set(metrics) == expected
    for impl in (fused_linear_grpo, reference.fused_linear_grpo):
        out = impl(x, w, target, b, **tensors, **opts, return_entropy=True, chunk_size=12)
        assert {k for k, t in out._asdict().items() if t is not None} == expected | {"loss", "per_token_logps"}
        errors = {"loss": rel_err(out.loss, loss)}
        errors |= {name: rel_err(getattr(out, name), torch.tensor(value, dtype=torch.float64)) for name, value in metrics.items()}
        got = grads_of(out.loss, (x, w, b), torch.tensor(1.0, device=DEVICE))
        errors |= {n: rel_err(g, r) for n, g, r in zip(("dx", "dW", "db"), got, want)}
        assert all(e < TOL[torch.float32] for e in errors.values()), (impl.__module__, errors, loss, out.loss)


@pytest.mark.parametrize("loss_type, level, options", [
    ("grpo", "token", dict(delta=1.05)),
    ("luspo", "sequence", dict(delta=1.02, use_bias_correction_kl=True)),
    ("dapo", "token", dict(use_bias_correction_kl=True, vllm_importance_sampling_mode="token_truncate",
                           vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.3)),
    ("bnpo", "sequence", dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=1.5)),
    ("cispo", "token", dict(epsilon_high=1.1, vllm_importance_sampling_mode="token_mask",
                            vllm_importance_sampling_clip_min=0.7, vllm_importance_sampling_clip_max=1.4)),
    ("sapo", "sequence", dict(sapo_temperature_pos=0.7, sapo_temperature_neg=2.0,
                              vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_clip_max=1.2)),
    ("vespo", "token", dict(temperature=1.0, beta=0.0, vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.0,
                            vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_min=0.9)),
])
@pytest.mark.parametrize("old", ["given", "on_policy"])
def test_options_match_trl(loss_type, level, options, old):
    """delta, use_bias_correction_kl, the four vLLM sampling-ratio modes (TRL's own ratio lines) and the
    cispo/sapo/vespo constants against TRL's own loss; ``on_policy``: old_logps None (TRL's ratio then
    comes from the current policy)."""
    pytest.importorskip("trl")
    x, w, b, target, tensors, model = make_inputs(seed=9)
    tensors = {k: v for k, v in tensors.items() if k != "ref_logps"} | model
    if any(k.startswith("vllm") for k in options):
        tensors = with_sampler(tensors, scale=0.2)
    if old == "on_policy":
        tensors.pop("old_logps")
    opts = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1, epsilon_low=0.1, temperature=0.7,
                max_completion_length=9) | {"epsilon_high": 0.28} | options
    if opts["beta"] == 0.0:  # TRL then logs no kl
        tensors = {k: t for k, t in tensors.items() if not k.startswith("ref_")}
    assert_matches_trl(x, w, b, target, tensors, opts)
    if old == "on_policy":
        return  # ratio 1: delta and the bias correction leave the loss as it is
    # each option is exercised: without it (and without the sampler) the loss differs
    plain = {k: v for k, v in opts.items() if k not in options or k in ("epsilon_high", "temperature")}
    without = fused_linear_grpo(x, w, target, b, **{k: t for k, t in tensors.items() if k != "sampler_logps"}, **plain)
    assert rel_err(fused_linear_grpo(x, w, target, b, **tensors, **opts).loss, without.loss) > 1e-4


def per_token_case(loss_type, level, seed=6, reference_model=False):
    """Inputs with old, reference and sampler log-probs, and the options every per-token field needs."""
    x, w, b, target, tensors, model = make_inputs(seed=seed)
    if reference_model:  # TRL's loss takes the reference model's log-probs from its head
        tensors = {k: v for k, v in tensors.items() if k != "ref_logps"} | model
    tensors = with_sampler(tensors, scale=0.2)
    opts = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.1, epsilon_low=0.1, epsilon_high=0.28,
                temperature=1.0, max_completion_length=9, return_entropy=True, return_per_token=True, chunk_size=12,
                vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.7,
                vllm_importance_sampling_clip_max=1.3, delta=1.6 if loss_type in CLIPPED else None)
    if loss_type == "cispo":
        opts["epsilon_high"] = 1.1
    return x, w, b, target, tensors, opts


@pytest.mark.parametrize("loss_type, level", list(itertools.product(LOSS_TYPES, LEVELS)))
def test_per_token_values(loss_type, level):
    """return_per_token: the ratios, entropy and sampling ratio against the float64 reference; the clip
    flags equal to its flags away from the clip bounds, and their masked means are the logged clip ratios."""
    x, w, b, target, tensors, opts = per_token_case(loss_type, level)
    out = fused_linear_grpo(x, w, target, b, **tensors, **opts)
    ref_inputs = double_leaves(x, w, b)
    want = reference.fused_linear_grpo(*ref_inputs[:2], target, ref_inputs[2], **as_double(tensors), **opts)
    got, expected = out.per_token, want.per_token
    for name in type(got)._fields:
        assert (getattr(got, name) is None) == (getattr(expected, name) is None), name
    for name in ("importance_ratio", "entropy", "sampling_ratio"):
        t = getattr(got, name)
        assert t.dtype == torch.float32 and t.shape == target.shape and not t.requires_grad, name
        assert rel_err(t, getattr(expected, name)) < TOL[torch.float32], name
    assert (got.is_high_clipped is not None) == (loss_type in CLIPPED or loss_type == "cispo")
    if got.is_high_clipped is None:
        return
    active = (tensors["completion_mask"] != 0) & (target != -100)
    ratio = expected.importance_ratio
    if loss_type == "cispo":
        bounds, metric = [opts["epsilon_high"]], {"is_high_clipped": out.cispo_clip_ratio}
    else:
        ratio = ratio.clamp(max=opts["delta"])
        bounds = [1 - opts["epsilon_low"], 1 + opts["epsilon_high"]]
        metric = {"is_low_clipped": out.clip_ratio_low_mean, "is_high_clipped": out.clip_ratio_high_mean,
                  "is_region_clipped": out.clip_ratio_region_mean}
    away = torch.stack([(ratio - bound).abs() > 1e-4 for bound in bounds]).all(0)
    for name, mean in metric.items():
        flag = getattr(got, name)
        assert flag.dtype == torch.bool and flag.shape == target.shape
        assert torch.equal(flag[away], getattr(expected, name)[away]), name
        assert not flag[~active].any(), name  # inactive tokens are never counted
        if level == "token":
            assert abs(flag.sum() / active.sum() - mean) < 1e-6, name
    if level == "token":  # the data reach both sides of a bound (else the flags would go untested)
        assert got.is_high_clipped.any() and not got.is_high_clipped[active].all()


@pytest.mark.parametrize("loss_type, level", [("grpo", "token"), ("dapo", "sequence"), ("cispo", "token")])
def test_per_token_flags_give_trl_metrics(loss_type, level):
    """The clip flags' means over the active tokens (per sequence at the sequence level, as TRL's
    ``masked_seq_mean`` of a ``(B, 1)`` flag) are the clip ratios TRL's own ``_compute_loss`` logs."""
    pytest.importorskip("trl")
    x, w, b, target, tensors, opts = per_token_case(loss_type, level, seed=3, reference_model=True)
    if level == "sequence":  # a sequence's mean log-ratio is near 0: a narrow range clips some
        opts |= dict(epsilon_low=0.02, epsilon_high=0.02)
    trl_opts = {k: v for k, v in opts.items() if k not in ("return_entropy", "return_per_token", "chunk_size")}
    _, metrics = trl_grpo(x, w, b, target, tensors, trl_opts)
    per_token = fused_linear_grpo(x, w, target, b, **tensors, **opts).per_token
    active = ((tensors["completion_mask"] != 0) & (target != -100)).double()
    if level == "token":
        means = {name: (getattr(per_token, name).double() * active).sum() / active.sum()
                 for name in ("is_low_clipped", "is_high_clipped", "is_region_clipped")
                 if getattr(per_token, name) is not None}
    else:  # (B, 1) in TRL: an unmasked mean over the sequences (TRL's T = 1 branch), here the per-sequence flag
        seq = lambda flag: (flag.double() * active).amax(-1)  # noqa: E731
        means = {name: seq(getattr(per_token, name)).mean() for name in ("is_low_clipped", "is_high_clipped",
                                                                       "is_region_clipped")}
    names = {"is_low_clipped": "clip_ratio_low_mean", "is_high_clipped": "clip_ratio_high_mean",
             "is_region_clipped": "clip_ratio_region_mean"}
    if loss_type == "cispo":
        names = {"is_high_clipped": "cispo_clip_ratio"}
    for name, metric in names.items():
        assert abs(means[name].item() - metrics[metric]) < 1e-6, (name, means[name], metrics[metric])
    assert any(metrics[m] > 0 for m in names.values())


def test_dapo_normalizer_as_trl_forms_it():
    """TRL's dapo divides by num_items_in_batch / num_processes * accumulation / steps_per_generation: that value given."""
    x, w, b, target, tensors, _ = make_inputs(seed=8)
    opts = dict(loss_type="dapo")
    loss, _ = trl_grpo(x, w, b, target, tensors, opts, processes=2, accumulation=3, steps_per_generation=4)
    count = (tensors["completion_mask"] * (target != -100)).sum()
    out = fused_linear_grpo(x, w, target, b, **{k: tensors[k] for k in ("advantages", "old_logps", "completion_mask")},
                            **opts, num_items_in_batch=count / 2 * 3 / 4)
    assert rel_err(out.loss, loss) < TOL[torch.float32]


# --------------------------------------------------------------------------- behaviour


def test_module_no_grad_and_reference_untouched():
    x, w, b, target, tensors, model = make_inputs()
    model = {k: t.requires_grad_() for k, t in model.items()}  # an unfrozen reference model: still no gradient to it
    tensors.pop("ref_logps")
    module = FusedLinearGRPOLoss(beta=0.2, loss_type="bnpo", chunk_size=12)
    assert "loss_type='bnpo'" in repr(module)
    out = module(x, w, target, b, **tensors, **model)
    assert torch.equal(out.loss, fused_linear_grpo(x, w, target, b, **tensors, **model, beta=0.2, loss_type="bnpo", chunk_size=12).loss)
    out.loss.backward()
    assert all(t.grad is None for t in model.values()) and x.grad is not None and w.grad is not None
    with torch.no_grad():
        assert fused_linear_grpo(x, w, target, b, **tensors, **model, beta=0.2).loss.grad_fn is None


def test_deterministic():
    x, w, b, target, tensors, _ = make_inputs()
    runs = []
    for _ in range(2):
        out = fused_linear_grpo(x, w, target, b, **tensors, beta=0.1, importance_sampling_level="sequence", chunk_size=6)
        runs.append([out.loss, out.per_token_logps, *grads_of(out.loss, (x, w, b), 1.0)])
    assert all(torch.equal(a, c) for a, c in zip(*runs))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
@pytest.mark.parametrize("where", ["x", "advantages", "old_logps", "ref_logps"])
def test_nan_propagates(where):
    """NaN at an active token (or in an active sequence's advantage) makes the loss NaN, as in TRL."""
    x, w, b, target, tensors, _ = make_inputs()
    with torch.no_grad():
        if where == "x":
            x[2, 1, 0] = float("nan")
        elif where == "advantages":
            tensors["advantages"][2] = float("nan")
        else:
            tensors[where][2, 1] = float("nan")
    out = fused_linear_grpo(x, w, target, b, **tensors, beta=0.1)
    assert torch.isnan(out.loss)
    dx = grads_of(out.loss, (x,), 1.0)[0]
    assert torch.isnan(dx[2]).any()


def bad_inputs():
    x, w, b, target, tensors, model = make_inputs()
    out_of_range = target.clone()
    out_of_range[1, 4] = 1031
    return [
        (dict(advantages=tensors["advantages"][:3]), ValueError, "advantages must have shape (B,)"),
        (dict(advantages=tensors["advantages"].long()), TypeError, "advantages must be a floating"),
        (dict(advantages=tensors["advantages"].tolist()), TypeError, "advantages must be a torch.Tensor"),
        (dict(old_logps=tensors["old_logps"][:, 1:]), ValueError, "old_logps must have shape (B, T)"),
        (dict(old_logps=tensors["old_logps"].long()), TypeError, "old_logps must be a floating"),
        (dict(ref_logps=tensors["ref_logps"][None]), ValueError, "ref_logps must have shape (B, T)"),
        (dict(completion_mask=tensors["completion_mask"][:, :2]), ValueError, "completion_mask must have shape"),
        (dict(completion_mask=tensors["completion_mask"].to(torch.complex64)), TypeError, "completion_mask must be a bool"),
        (dict(target=out_of_range), ValueError, "target holds 1 value"),
        (dict(target=target.float()), TypeError, "target must be an int64 or int32"),
        (dict(x=x[:, :, 1:]), ValueError, "weight must have shape"),
        (dict(x=x[0]), ValueError, "x must have 3 dimension"),
        (dict(weight=w.half()), TypeError, "weight must have the dtype of x"),
        (dict(bias=b[1:]), ValueError, "bias must have shape"),
        (dict(model, ref_logps=None, ref_weight=model["ref_weight"][:, 1:]), ValueError, "ref_weight must have shape"),
        (dict(model, ref_logps=None, ref_x=model["ref_x"][:, 1:]), ValueError, "ref_x must have shape"),
        (dict(model, ref_logps=None, ref_weight=None), ValueError, "needs ref_x and ref_weight"),
        (dict(model), ValueError, "not both"),
        (dict(ref_logps=None, beta=0.1), ValueError, "beta=0.1 needs the reference"),
        (dict(loss_type="ppo"), ValueError, "loss_type must be one of"),
        (dict(importance_sampling_level="seq"), ValueError, "importance_sampling_level must be one of"),
        (dict(loss_type="dr_grpo"), ValueError, "give max_completion_length"),
        (dict(loss_type="dr_grpo", max_completion_length=0), ValueError, "max_completion_length must be None or a positive"),
        (dict(num_items_in_batch=10), ValueError, "num_items_in_batch is the normalizer of loss_type 'dapo', 'cispo'"),
        (dict(loss_type="dapo", num_items_in_batch=0), ValueError, "num_items_in_batch must be > 0"),
        (dict(loss_type="dapo", num_items_in_batch=torch.ones(2)), ValueError, "num_items_in_batch must be a positive"),
        (dict(temperature=0.0), ValueError, "temperature must be > 0"),
        (dict(epsilon_low=math.nan), TypeError, "epsilon_low must be a finite"),
        (dict(epsilon_high="0.2"), TypeError, "epsilon_high must be a finite"),
        (dict(beta=math.inf), TypeError, "beta must be a finite"),
        (dict(return_entropy=1), TypeError, "return_entropy must be a bool"),
        (dict(chunk_size=0), ValueError, "chunk_size must be None or a positive int"),
        (dict(x=x.detach().to("meta")), ValueError, "x on meta"),
        (dict(advantages=tensors["advantages"].to("meta")), ValueError, "advantages on meta"),
    ]


@pytest.mark.parametrize("change,error,match", bad_inputs())
def test_bad_inputs_name_the_argument(change, error, match):
    x, w, b, target, tensors, _ = make_inputs()
    args = dict(x=x, weight=w, target=target, bias=b, **tensors) | change
    with pytest.raises(error, match=match.replace("(", r"\(").replace(")", r"\)")):
        fused_linear_grpo(**args)


def test_module_validates_its_options():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        FusedLinearGRPOLoss(loss_type="ppo")
    with pytest.raises(ValueError, match="give max_completion_length"):
        FusedLinearGRPOLoss(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="top_entropy_quantile=0.2 < 1"):
        FusedLinearGRPOLoss(top_entropy_quantile=0.2)
    assert "delta=1.5" in repr(FusedLinearGRPOLoss(delta=1.5))


# --------------------------------------------------------------------------- property test


@st.composite
def grpo_cases(draw):
    batch, seq = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    beta = draw(st.sampled_from([0.0, 0.04, 0.5]))
    loss_type = draw(st.sampled_from(LOSS_TYPES))
    old = draw(st.booleans())
    sampler = draw(st.sampled_from([None, *SAMPLING_MODES]))
    if loss_type == "vespo" and sampler is not None and sampler.startswith("sequence"):
        sampler = "token" + sampler[len("sequence"):]  # TRL's vespo takes the token modes only
    return dict(
        batch=batch,
        seq=seq,
        hidden=draw(st.sampled_from([1, 3, 5, 8])),
        vocab=draw(st.sampled_from([1, 2, 7, 13])),
        bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(properties.DTYPES)),
        loss_type=loss_type,
        importance_sampling_level=draw(st.sampled_from(LEVELS)),
        beta=beta,
        reference=draw(st.sampled_from(["logps", "model"] if beta else [None, "logps", "model"])),
        old=old,
        delta=draw(st.sampled_from([None, 1.05, 1.5])) if loss_type in CLIPPED else None,
        use_bias_correction_kl=draw(st.booleans()),
        sampler=sampler,
        sampler_clip=draw(st.sampled_from([(None, 3.0), (0.8, 1.3), (0.5, None)])),
        epsilons=draw(st.sampled_from([(0.2, 0.2), (0.1, 0.28), (0.0, 0.0), (0.5, 2.0)])),
        temperature=draw(st.sampled_from([1.0, 0.6, 1.7])),
        token_advantages=draw(st.booleans()),
        masked=draw(st.sampled_from([0.0, 0.3, 0.7])),
        ignore_index=draw(st.sampled_from([-100, -1])),
        chunk_size=draw(st.one_of(st.none(), st.integers(1, batch * seq))),
        accurate=draw(st.booleans()),
        return_entropy=draw(st.booleans()),
        return_per_token=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=properties.examples(150), **properties.SETTINGS)
@given(grpo_cases())
def test_fused_linear_grpo_matches_reference(case):
    """As tests/test_properties.py: loss, per-token log-probs, metrics and gradients against the float64
    reference, tolerances from its floors and the reference's own error in the kernel's arithmetic."""
    gen = torch.Generator().manual_seed(case["seed"])
    batch, seq, hidden, vocab, dtype = (case[k] for k in ("batch", "seq", "hidden", "vocab", "dtype"))
    x = torch.randn(batch, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if case["bias"] else None
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    target = torch.where(torch.rand(batch, seq, generator=gen) < case["masked"] / 2, case["ignore_index"], target).to(DEVICE)
    completion_mask = (torch.rand(batch, seq, generator=gen) >= case["masked"] / 2).to(DEVICE)
    adv_shape = (batch, seq) if case["token_advantages"] else (batch,)
    tensors = dict(advantages=torch.randn(adv_shape, generator=gen).to(DEVICE), completion_mask=completion_mask)
    near = -torch.rand(batch, seq, generator=gen) * 3  # log-probs of the order of the policy's
    if case["old"]:
        tensors["old_logps"] = (near + 0.3 * torch.randn(batch, seq, generator=gen)).to(DEVICE)
    if case["sampler"] is not None:
        tensors["sampler_logps"] = (near + 0.3 * torch.randn(batch, seq, generator=gen)).to(DEVICE)
    if case["reference"] == "logps":
        tensors["ref_logps"] = (near + 0.5 * torch.randn(batch, seq, generator=gen)).to(DEVICE)
    elif case["reference"] == "model":
        tensors["ref_x"] = torch.randn(batch, seq, 3, generator=gen).to(DEVICE)
        tensors["ref_weight"] = torch.randn(vocab, 3, generator=gen).to(DEVICE)
    options = {k: case[k] for k in ("loss_type", "importance_sampling_level", "beta", "temperature", "ignore_index",
                                     "chunk_size", "accurate", "return_entropy", "return_per_token")}
    options |= dict(epsilon_low=case["epsilons"][0], epsilon_high=case["epsilons"][1], max_completion_length=seq + 1)
    options |= dict(delta=case["delta"], use_bias_correction_kl=case["use_bias_correction_kl"])
    if case["sampler"] is not None:
        options |= dict(vllm_importance_sampling_mode=case["sampler"], vllm_importance_sampling_clip_min=case["sampler_clip"][0],
                        vllm_importance_sampling_clip_max=case["sampler_clip"][1])

    def call(fn):
        def run(x_, w_, b_):
            given = tensors if fn is fused_linear_grpo else {
                k: t.to(x_.dtype) if k.startswith("ref_x") or k == "ref_weight" else t for k, t in tensors.items()
            }
            out = fn(x_, w_, target, b_, **given, **options)._asdict()
            per_token = out.pop("per_token")
            if per_token is not None:  # the floating per-token values (the flags: test_per_token_values)
                for name in ("importance_ratio", "entropy", "sampling_ratio"):
                    if getattr(per_token, name) is not None:
                        out["per_token_" + name] = getattr(per_token, name)
            return {k: t for k, t in out.items() if t is not None}
        return run

    upstream = torch.rand((), generator=gen, dtype=torch.float64) + 0.5
    got, want, baseline, dz = properties.run_three((call(fused_linear_grpo), call(reference.fused_linear_grpo)), [x, w, b], dtype, upstream)
    assert got["loss"].dtype == torch.float32 and set(got) == set(want)
    # NaN where the reference has NaN (clip_ratio_low_min / high_max over no active sequence), at the same places
    for name in list(got):
        nan = torch.isnan(want[name])
        assert torch.equal(torch.isnan(got[name]), nan), (name, case)
        if nan.all():
            del got[name], want[name], baseline[name]
        elif nan.any():
            got[name], want[name], baseline[name] = got[name][~nan], want[name][~nan], baseline[name][~nan]
    sequences_per_chunk = chunk_rows(case["chunk_size"], seq, batch * seq, hidden) // seq
    chunk_of_row = (torch.arange(batch) // sequences_per_chunk)[:, None].expand(-1, seq)
    floors = dict.fromkeys(got, TOLERANCE[matmul_dtype(dtype)]) | {"dx": TOLERANCE[dtype]}
    floors |= properties.lean_floors(dtype, case["accurate"], dz, x.to(dtype), chunk_of_row, want)
    for name, floor in properties.cancellation_floors(dz, x.to(dtype), want, dtype).items():
        floors[name] = max(floors[name], floor)
    logits = x.to(dtype).double() @ w.to(dtype).double().t() + (0 if b is None else b.to(dtype).double())
    scaled = logits / case["temperature"]
    for name, floor in properties.logit_rounding_floors(dz, x.to(dtype), torch.maximum(logits.abs(), scaled.abs()), want, dtype).items():
        floors[name] = max(floors[name], floor)
    if "kl" in want:
        floors["kl"] = max(floors["kl"], kl_cancellation_floor(case, want, tensors, target, dtype))
    properties.compare(got, want, baseline, floors, case)


def kl_cancellation_floor(case, want, tensors, target, dtype) -> float:
    """The ``kl`` metric's floor where it cancels: TRL's ``exp(d) - d - 1`` (``d = ref - logp``, times
    ``coef_1`` with ``use_bias_correction_kl``) is ~ d²/2 for small ``d``, so float32 evaluation of its
    three terms, whoever does it, is no more accurate than ``u·Σ(e^d + |d| + 1)·c`` over the active
    tokens, relative to ``Σ kl``. Seen on the H200 (float16 inputs, one token near its reference's
    log-prob): 2.65e-3 against a 2e-3 floor, the float32 reference landing closer by chance."""
    logp = want["per_token_logps"]
    if case["reference"] == "logps":
        ref = tensors["ref_logps"].double()
    else:
        ref = reference._token_logps(tensors["ref_x"].to(dtype).double(), tensors["ref_weight"].to(dtype).double(), None,
                                     target, case["ignore_index"], case["temperature"])[0]
    mask = (target != case["ignore_index"]).double() * tensors["completion_mask"].double()
    d = ref - logp
    coef = torch.ones_like(logp)
    if case["use_bias_correction_kl"]:
        log_ratio = logp - tensors["old_logps"].double() if "old_logps" in tensors else torch.zeros_like(logp)
        if case["importance_sampling_level"] == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(logp)
        coef = log_ratio.exp()
    terms = ((d.exp() + d.abs() + 1) * coef * mask).sum().item()
    total = abs(((d.exp() - d - 1) * coef * mask).sum().item())
    return properties.BASELINE_FACTOR * properties.UNIT_ROUNDOFF[torch.float32] * terms / total if total > 0 else 0.0


# --------------------------------------------------------------------------- the bench specs


def test_registered_with_the_published_presets():
    import json

    from kernels_workbench import data
    from kernels_workbench.bench import fused_linear_grpo as bench
    from kernels_workbench.bench.registry import get_spec, registered_losses

    for level, name in bench.KERNEL_NAMES.items():
        assert name in registered_losses()
        spec = get_spec(name)
        assert list(spec.providers) == ["kernels_lib", "torch", "liger", "trl"] and spec.baseline == "torch"
        assert spec.published == {"x_name": "B", "x_label": "B", "x_values": [2, 4, 8, 16],
                                  "sizes": {"T": 1024, "H": 4096, "V": 128256}, "dtype": torch.bfloat16}
        assert spec.default_options["importance_sampling_level"] == level and spec.default_options["beta"] == 0.1
        rows = data.load_published(name)  # copied unchanged from the published CSV
        assert set(rows.kernel_provider) == {"liger", "torch"} and set(rows.x_value) == {2, 4, 8, 16}
        assert set(rows.kernel_operation_mode) == {"forward", "backward", "full"}
        config = json.loads(rows.extra_benchmark_config_str.iloc[0])
        assert config == {"T": 1024, "H": 4096, "V": 128256, "importance_sampling_level": level, "dtype": "torch.bfloat16"}
    sizes = {"B": 2, "T": 3, "H": 5, "V": 7}
    assert bench.flops(sizes, "forward") == 2 * 2 * 30 * 7 and bench.flops(sizes, "full") == 4 * 2 * 30 * 7
    assert bench.bytes_moved(sizes, torch.bfloat16, "forward") == 2 * (30 + 35) * 2 + 6 * 8


def test_bench_inputs_and_checks():
    from kernels_workbench.bench import fused_linear_grpo as bench
    from kernels_workbench.check import assert_checks_pass, check_against_reference

    spec = bench.SPEC_SEQUENCE
    inputs = bench.make_inputs({"B": 3, "T": 5, "H": 16, "V": 67}, torch.bfloat16, DEVICE, spec.default_options, seed=1)
    x, weight, target, bias = inputs.args
    kw = inputs.kwargs
    assert x.shape == kw["ref_x"].shape == (3, 5, 16) and weight.shape == kw["ref_weight"].shape == (67, 16)
    assert bias is None and inputs.grad_inputs == [x, weight] and not kw["ref_x"].requires_grad
    assert kw["advantages"].shape == (3,) and kw["completion_mask"].shape == (3, 5)
    assert {k for k in kw if not k.startswith("ref_")} == {
        "advantages", "completion_mask", "beta", "epsilon_low", "epsilon_high", "loss_type", "importance_sampling_level"
    }
    cases = [{"dtype": torch.float32}, {"dtype": torch.bfloat16}, {"dtype": torch.float32, "bias": True, "ignore_fraction": 0.3}]
    for name in bench.KERNEL_NAMES.values():
        assert_checks_pass(check_against_reference(name, cases, {"B": 3, "T": 4, "H": 16, "V": 67}, DEVICE))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU-machine behaviour (no CUDA: Liger cannot run)")
def test_tiny_sweep_both_charts():
    from kernels_workbench.bench.sweep import MEASURED_COLUMNS, run_sweep

    for name in ("fused_linear_grpo_loss_token", "fused_linear_grpo_loss_sequence"):
        rows = run_sweep(name, x_name="B", x_values=[2], sizes={"T": 4, "H": 16, "V": 67}, dtype=torch.float32,
                         device=DEVICE, modes=["forward", "full"])
        assert list(rows.columns) == MEASURED_COLUMNS and len(rows) == 3 * 2  # TRL's head runs on CPU too
        assert set(rows.kernel_provider) == {"kernels_lib", "torch", "trl"} and rows.y_value_50.notna().all()
        assert rows.note.str.contains("liger skipped").all()


def test_liger_adapter(monkeypatch):
    """Liger's module (a stand-in here: CUDA only) gets the mask, the clamped targets and the reference model."""
    import sys
    import types

    from kernels_workbench.bench import fused_linear_grpo as bench

    log = []

    class Module:
        def __init__(self, **options):
            log.append(("init", options))

        def __call__(self, *args, **kwargs):
            log.append(("call", args, kwargs))
            return torch.tensor(2.5), []

    chunked = types.ModuleType("liger_kernel.chunked_loss")
    chunked.LigerFusedLinearGRPOLoss = Module
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.chunked_loss", chunked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fn = bench.PROVIDERS["liger"].load()
    inputs = bench.make_inputs({"B": 2, "T": 3, "H": 4, "V": 5}, torch.float32, "cpu", bench.SPEC_TOKEN.default_options)
    x, w, target, bias = inputs.args
    target[0, 1] = -100
    assert fn(*inputs.args, **inputs.kwargs).item() == 2.5
    assert log[0][1] == dict(beta=0.1, use_ref_model=True, epsilon_low=0.2, epsilon_high=0.2, loss_type="bnpo",
                             max_completion_length=None, importance_sampling_level="token", temperature=1.0,
                             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, delta=None,
                             use_bias_correction_kl=False, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0,
                             vespo_lambda_neg=2.0)
    args = log[1][1]
    assert args[0] is x and args[1] is w and args[2][0, 1] == 0 and args[3][0, 1] == 0 and args[3].sum() == 5
    assert args[8] is inputs.kwargs["ref_x"] and args[9] is inputs.kwargs["ref_weight"]
    with pytest.raises(NotImplementedError, match="entropy"):
        fn(*inputs.args, **inputs.kwargs, return_entropy=True)
    fn(*inputs.args, **inputs.kwargs, delta=1.5, vespo_k_neg=4.0)  # an option: a module of its own
    assert log[-2][0] == "init" and log[-2][1]["delta"] == 1.5 and log[-2][1]["vespo_k_neg"] == 4.0
    with pytest.raises(NotImplementedError, match="sampler_logps"):
        fn(*inputs.args, **inputs.kwargs, sampler_logps=torch.zeros_like(target, dtype=torch.float32))


def test_liger_adapter_against_float64_every_loss_type(monkeypatch):
    """The adapter with Liger's real module (its chunk step not compiled: on a CPU, and to test the adapter,
    not torch.compile): every loss type and option it passes, off-policy, against the float64 reference,
    so a measured Liger row is TRL's loss with the options the row records."""
    grpo_module = pytest.importorskip("liger_kernel.chunked_loss.grpo_loss")
    import functools

    from kernels_workbench.bench import fused_linear_grpo as bench
    from kernels_workbench.bench import spec as bench_spec

    monkeypatch.setattr(grpo_module, "LigerFusedLinearGRPOLoss",
                        functools.partial(grpo_module.LigerFusedLinearGRPOLoss, compiled=False))
    monkeypatch.setattr("liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss", grpo_module.LigerFusedLinearGRPOLoss)
    monkeypatch.setattr(bench, "require_cuda", lambda what: None)
    fn = bench.PROVIDERS["liger"].load()
    g = torch.Generator().manual_seed(7)
    b, t, h, v = 3, 6, 8, 37
    x, w = torch.randn(b, t, h, generator=g, dtype=torch.float64), torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    full = torch.randint(0, v, (b, t), generator=g)
    target = full.clone()
    target[1, -2:] = -100
    with torch.no_grad():
        near = reference.fused_linear_grpo(x, w, full, advantages=torch.zeros(b)).per_token_logps
    advantages = torch.randn(b, generator=g, dtype=torch.float64)
    old = near + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    for loss_type in LOSS_TYPES:
        options = dict(loss_type=loss_type, beta=0.0, max_completion_length=t,
                       epsilon_high=5.0 if loss_type == "cispo" else 0.28, delta=1.6 if loss_type in CLIPPED else None,
                       sapo_temperature_neg=1.2, vespo_k_pos=1.5)
        # Liger 0.8.5's luspo is TRL's earlier line, (per_token_loss * mask.sum(1, keepdim=True)).mean():
        # it counts the padded positions that TRL 1.16 masks out first (grpo_trainer.py, "so mask before
        # aggregating"); the two agree without padding, so luspo is compared there, and shown to differ with it
        targets = full if loss_type == "luspo" else target
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        got = fn(x1, w, targets, advantages=advantages, old_logps=old, **options)
        want = reference.fused_linear_grpo(x2, w, targets, advantages=advantages, old_logps=old, **options).loss
        (dx_got,), (dx_want,) = torch.autograd.grad(got, [x1]), torch.autograd.grad(want, [x2])
        assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()), (loss_type, got.item(), want.item())
        assert (dx_got - dx_want).norm() <= 1e-5 * dx_want.norm(), loss_type
        if loss_type == "luspo":
            padded = fn(x, w, target, advantages=advantages, old_logps=old, **options)
            trl = reference.fused_linear_grpo(x, w, target, advantages=advantages, old_logps=old, **options).loss
            assert abs(padded.item() - trl.item()) > 1e-3 * abs(trl.item()), "Liger's luspo now masks padding: update the note"


def test_bench_loss_types_and_options():
    """The bench names every loss type of the function, fills dr_grpo's L_max, and takes the options."""
    from kernels_workbench.bench import fused_linear_grpo as bench

    assert tuple(bench.LOSS_TYPES) == LOSS_TYPES and all(bench.LOSS_TYPES.values())
    assert set(bench.EXTRA_OPTIONS) <= set(FusedLinearGRPOLoss().options) | {"max_completion_length"}
    options = bench.SPEC_TOKEN.default_options | {"loss_type": "dr_grpo"}
    inputs = bench.make_inputs({"B": 2, "T": 5, "H": 8, "V": 31}, torch.float32, DEVICE, options)
    assert inputs.kwargs["max_completion_length"] == 5
    out = fused_linear_grpo(*inputs.args, **inputs.kwargs)
    assert torch.isfinite(out.loss)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU-machine behaviour (no CUDA: Liger cannot run)")
def test_cli_option_sweeps_another_loss_type(tmp_path, monkeypatch, capsys):
    """``--option loss_type=cispo --option epsilon_high=5.0``: the rows record both; an unknown option is refused."""
    import json

    from kernels_workbench import data
    from kernels_workbench.bench import cli

    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path / "measured")
    base = ["fused_linear_grpo_loss_token", "--values", "2", "--size", "T=3", "--size", "H=8", "--size", "V=31",
            "--providers", "kernels_lib", "--modes", "forward", "--dtype", "float32"]
    assert cli.main(base + ["--option", "loss_type=cispo", "--option", "epsilon_high=5.0"]) == 0
    rows = data.read_rows(tmp_path / "measured" / "fused_linear_grpo_loss_token.csv")
    config = json.loads(rows.extra_benchmark_config_str.iloc[0])
    assert config["loss_type"] == "cispo" and config["epsilon_high"] == 5.0 and rows.y_value_50.notna().all()
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(base + ["--option", "lost_type=cispo", "--dry-run"])
    assert info.value.code == 2 and "has no option 'lost_type'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(base + ["--option", "loss_type", "--dry-run"])
    assert "NAME=VALUE" in capsys.readouterr().err


def test_other_loss_types_stay_off_the_published_chart():
    """A ``--option loss_type=cispo`` sweep at the published sizes is not the published (bnpo) chart's row."""
    import json

    import pandas as pd

    from kernels_workbench import overview
    from kernels_workbench.bench import fused_linear_grpo as bench

    spec = bench.SPEC_TOKEN
    sizes = {"T": 1024, "H": 4096, "V": 128256, "dtype": "torch.bfloat16"}
    configs = [sizes | spec.default_options, sizes | spec.default_options | {"loss_type": "cispo"},
               sizes | spec.default_options | {"delta": 1.5}]
    rows = pd.DataFrame({"x_name": "B", "kernel_name": spec.kernel_name,
                         "extra_benchmark_config_str": [json.dumps(c) for c in configs]})
    kept = overview.of_chart(rows, {"T": 1024, "H": 4096, "V": 128256, "importance_sampling_level": "token",
                                    "dtype": "torch.bfloat16"}, "B")
    assert list(kept.index) == [0]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the script's CPU size (the GPU runs it at the published size)")
def test_loss_types_script_and_table(tmp_path):
    """scripts/grpo_loss_types.py at CPU size: a row per loss type and provider, medians of its rounds; the
    table of one run has a row per loss type, ratios that are the rows' own, and refuses two runs."""
    import importlib.util
    from pathlib import Path

    import pandas as pd

    from kernels_workbench.bench import fused_linear_grpo as bench

    path = Path(__file__).resolve().parents[1] / "scripts" / "grpo_loss_types.py"
    spec = importlib.util.spec_from_file_location("grpo_loss_types", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path), "--size", "small", "--loss-types", "grpo,cispo"]) == 0
    rows = pd.read_csv(tmp_path / script.FILE)
    assert set(rows.loss_type) == {"grpo", "cispo"} and rows.note.str.contains("median of 2 rounds").all()
    assert (rows.y_value_50 > 0).all() and set(rows.kernel_provider) == {"kernels_lib", "torch", "trl"}
    config = rows[rows.loss_type == "cispo"].extra_benchmark_config_str.iloc[0]
    assert '"loss_type": "cispo"' in config and '"epsilon_high": 5.0' in config
    rows["matmul_tflops"] = 100.0  # the CPU measures no ceiling: a rate to check the floor's arithmetic
    run_ceilings = pd.DataFrame([{"kernel_name": "copy", "gpu_name": rows.gpu_name.iloc[0], "kernels_lib_commit": rows.kernels_lib_commit.iloc[0],
                                  "timestamp": rows.timestamp.iloc[0], "y_value_50": 1e3}])  # the run's copy bandwidth, GB/s
    assert bench.loss_type_table(rows, run_ceilings.iloc[:0])["floor ms"].isna().all(), "no copy bandwidth of the run: not measured"
    table = bench.loss_type_table(rows, run_ceilings)
    assert list(table.index) == ["grpo", "cispo"]
    ours = rows[(rows.loss_type == "grpo") & (rows.kernel_provider == "kernels_lib")].y_value_50.item()
    theirs = rows[(rows.loss_type == "grpo") & (rows.kernel_provider == "trl")].y_value_50.item()
    assert table.loc["grpo", "kernels_lib / trl"] == pytest.approx(ours / theirs)
    from kernels_workbench import floor as one_floor  # the one floor: the longer of the matmuls and the minimal bytes

    sizes = {"B": 2, "T": 3, "H": 8, "V": 31}
    floor = max(bench.flops(sizes, "full") / 100e12 * 1e3, bench.bytes_moved(sizes, torch.float32, "full") / 1e12 * 1e3)
    assert floor == one_floor.floor_at(bench.KERNEL_NAMES["token"], sizes, torch.float32, "full", {"matmul": 100.0, "copy": 1e3})[0]
    assert table.loc["grpo", "floor ms"] == pytest.approx(floor) and table.loc["grpo", "kernels_lib / floor"] == pytest.approx(ours / floor)
    other = rows.assign(kernels_lib_commit="another")
    with pytest.raises(ValueError, match="one run"):
        bench.loss_type_table(pd.concat([rows, other.iloc[:1]]))
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path), "--size", "small", "--loss-types", "nope"])


# --------------------------------------------------------------------------- hand-derived weights at ties


def _tie_block(level: str):
    """A ``(6, 5)`` float64 block whose ratios sit on every tie of the clipped surrogate: ``c = 1`` exactly
    (``t1 = t2`` inside the clip range), ``c`` on both clip bounds (``clamp``'s closed range), ``c`` on
    ``delta``, ``A = 0`` (``t1 = t2 = 0``), and ordinary tokens; masked and fractional-mask tokens.
    Returns ``(logp, old, ref, sampler, advantages, mask, bounds)`` with the bounds ``(low, high, delta)``
    three of the token-level ratios themselves (so that ``1 - ε_low``, ``1 + ε_high`` and ``δ`` equal them)."""
    gen = torch.Generator().manual_seed(5)
    logp = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 3
    rho = torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.4
    rho[0] = 0.0  # c = 1: the two arguments of min are equal
    rho[1, :3] = -0.25  # on 1 - eps_low
    rho[2, :3] = 0.3  # on 1 + eps_high
    rho[3, :2] = 0.6  # on delta
    old = logp - rho
    c = torch.exp(logp - old)  # the ratios as the loss forms them (logp - old rounds): the bounds are three of them
    c_low, c_high, c_delta = c[1, 0].item(), c[2, 0].item(), c[3, 0].item()
    ref = logp + torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.3
    sampler = old + torch.randn(6, 5, generator=gen, dtype=torch.float64) * 0.2
    advantages = torch.tensor([[0.7], [-1.1], [0.9], [1.3], [0.0], [-0.4]], dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.float64)
    mask[5, 3:] = 0.0
    mask[4, 1] = 0.5
    if level == "sequence":  # whole sequences at c = 1, and on the bounds, at the sequence level too
        old[1] = logp[1] + 0.25
        old[2] = logp[2] - 0.3
    return logp, old, ref, sampler, advantages, mask, (c_low, c_high, c_delta)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_weights_equal_autograd_at_ties(loss_type, level):
    """The hand-derived per-token weights (``_token_weights``) equal autograd of the per-token loss and its
    normalization on a chunk's log-prob block, at the ties of ``min`` and ``clamp`` (torch's rules), with
    and without the KL, its bias correction, a sampling ratio and ``delta``, for every loss type."""
    grpo = importlib.import_module("kernels_lib.fused_linear_grpo")  # the module (the package's name is the function)

    logp, old, ref, sampler, advantages, mask, (c_low, c_high, c_delta) = _tie_block(level)
    # The exact bounds: 1 - (1 - c) == c and (c - 1) + 1 == c for c in [0.5, 2] (Sterbenz).
    assert 1 - (1 - c_low) == c_low and 1 + (c_high - 1) == c_high
    if level == "token":  # the ties are there: the bounds and c = 1 are hit exactly
        c = torch.exp(logp - old)
        assert (c == 1).any() and (c == c_low).any() and (c == c_high).any() and (c == c_delta).any()
    variants = [dict(), dict(beta=0.2), dict(beta=0.3, use_bias_correction_kl=True),
                dict(sampler=True, vllm_importance_sampling_mode="token_truncate"),
                dict(sampler=True, vllm_importance_sampling_mode="sequence_mask" if loss_type != "vespo" else "token_mask")]
    if loss_type in CLIPPED:
        variants.append(dict(delta=c_delta, beta=0.1))
    variants.append(dict(on_policy=True, beta=0.2))  # old_logps=None: the ratio is 1 (a tie), its gradient 1
    checked = 0
    for variant in variants:
        variant = dict(variant)
        with_sampler = variant.pop("sampler", False)
        previous = None if variant.pop("on_policy", False) else old
        opts = grpo._GRPOOptions(
            epsilon_low=1 - c_low, epsilon_high=(c_high - 1) if loss_type != "cispo" else c_high,
            importance_sampling_level=level, loss_type=loss_type, max_completion_length=7, **variant,
        ).resolved((True, True, False))
        normalizer = torch.tensor(11.0, dtype=torch.float64)
        s = sampler if with_sampler else None
        r = ref if opts.beta != 0.0 else None
        block = logp.clone().requires_grad_()
        per_token_loss, _, _ = grpo._per_token_loss(block, previous, r, s, advantages, mask, opts)
        (expected,) = torch.autograd.grad(grpo._normalized(per_token_loss, mask, opts, normalizer), block)
        scale = grpo._sequence_scale(mask, opts, normalizer)
        got = grpo._token_weights(logp, previous, r, s, advantages, mask, scale, opts)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14, msg=lambda m: f"{variant}: {m}")
        checked += 1
    assert checked == len(variants)
