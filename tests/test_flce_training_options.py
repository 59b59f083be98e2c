"""What fused linear cross-entropy gained for training: class weights, the gradient-accumulation
normalizer, logit scale and temperature, per-token entropy and top-1 hit, autocast, torch.compile.

Each against the float64 reference (``kernels_lib.reference.fused_linear_cross_entropy``, the same
signature), errors relative in norm, outputs poisoned where the launcher writes them.
"""

from __future__ import annotations

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import reference
from kernels_lib.fused_linear_cross_entropy import CrossEntropyOutput, fused_linear_cross_entropy
from kernels_lib.kernels.cross_entropy_chunk import launch_cross_entropy_chunk

from device_errors import assert_device_error
from test_fused_linear_cross_entropy import DEVICE, TOL, check_against_reference, make_inputs, rel_err


def class_weights(vocab: int, seed: int = 3) -> torch.Tensor:
    return (torch.rand(vocab, generator=torch.Generator().manual_seed(seed)) * 2 + 0.1).to(DEVICE)


NEW_OPTIONS = [
    {"class_weight": True},
    {"class_weight": True, "label_smoothing": 0.2},
    {"class_weight": True, "z_loss_scale": 1e-3, "softcap": 4.0},
    {"logit_scale": 2.5},
    {"temperature": 0.7},
    {"logit_scale": 0.5, "softcap": 3.0, "temperature": 1.6},
    {"temperature": 2.0, "label_smoothing": 0.1, "z_loss_scale": 1e-3},
]


def _resolve(options: dict, vocab: int, dtype=torch.float32) -> dict:
    resolved = dict(options)
    if resolved.get("class_weight") is True:
        resolved["class_weight"] = class_weights(vocab).to(dtype)
    return resolved


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", NEW_OPTIONS, ids=lambda o: "-".join(o))
def test_new_options_match_reference(reduction, options):
    """Loss, dx, dW, db against float64 (V = 1031, H = 72, chunks of 16 rows, every fifth row ignored)."""
    x, w, b, target = make_inputs()
    opts = _resolve(options, w.shape[0])
    if "class_weight" in opts:  # the reference runs in float64: give it float64 weights, the kernel float32
        ref_weight = opts["class_weight"].double()
        loss = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, chunk_size=16, **opts)
        inputs = [t.detach().double().requires_grad_() for t in (x, w, b)]
        ref = reference.fused_linear_cross_entropy(*inputs[:2], target, inputs[2], reduction=reduction,
                                                   **{**opts, "class_weight": ref_weight})
        grad_output = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) + 0.5
        got = torch.autograd.grad(loss, (x, w, b), grad_output)
        want = torch.autograd.grad(ref, inputs, grad_output.double())
        errors = [rel_err(loss, ref)] + [rel_err(g, r) for g, r in zip(got, want)]
        assert max(errors) < TOL[torch.float32], errors
    else:
        check_against_reference(x, w, b, target, TOL[torch.float32], reduction=reduction, chunk_size=16, **opts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_class_weight_and_temperature_in_half_precision(dtype):
    """float16 with class weights: the power-of-two gradient scale includes max |w| (no underflow, no overflow)."""
    x, w, b, target = make_inputs(dtype=dtype)
    check_against_reference(x, w, b, target, TOL[dtype], chunk_size=16, class_weight=class_weights(w.shape[0]),
                            temperature=0.8)


def test_class_weight_matches_torch_cross_entropy_weight():
    """torch's semantics: mean divides by the valid rows' total weight (not their number)."""
    x, w, b, target = make_inputs(bias=False)
    weights = class_weights(w.shape[0])
    logits = (x.detach().double() @ w.detach().double().T)
    want = torch.nn.functional.cross_entropy(logits, target, weight=weights.double(), ignore_index=-100)
    got = fused_linear_cross_entropy(x.detach(), w.detach(), target, class_weight=weights)
    assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_items_in_batch_is_the_mean_denominator(as_tensor):
    """Two micro-batches, each divided by the whole batch's valid count: their gradients add up to the
    whole batch's mean gradient (Hugging Face's gradient accumulation)."""
    x, w, b, target = make_inputs(lead=(40,))
    n_valid = int((target != -100).sum())
    num_items = torch.tensor(n_valid, device=DEVICE) if as_tensor else n_valid
    whole = fused_linear_cross_entropy(x, w, target, b)
    want = torch.autograd.grad(whole, (x, w, b))
    parts, grads = [], [torch.zeros_like(t) for t in (w, b)]
    dx = torch.zeros_like(x)
    for rows in (slice(0, 13), slice(13, 40)):  # uneven micro-batches
        x_part = x.detach()[rows].clone().requires_grad_()
        loss = fused_linear_cross_entropy(x_part, w, target[rows], b, num_items_in_batch=num_items)
        g = torch.autograd.grad(loss, (x_part, w, b))
        dx[rows] = g[0]
        grads = [acc + gi for acc, gi in zip(grads, g[1:])]
        parts.append(loss)
    assert rel_err(sum(parts), whole) < 1e-6
    for got, ref in zip([dx, *grads], want):
        assert rel_err(got, ref) < 1e-5


def test_num_items_in_batch_needs_mean_and_a_count():
    x, w, b, target = make_inputs(lead=(5,), vocab=67, hidden=8)
    with pytest.raises(ValueError, match="num_items_in_batch replaces the denominator"):
        fused_linear_cross_entropy(x, w, target, b, reduction="sum", num_items_in_batch=3)
    with pytest.raises(ValueError, match="num_items_in_batch must be >= 1"):
        fused_linear_cross_entropy(x, w, target, b, num_items_in_batch=0)
    with pytest.raises(TypeError, match="num_items_in_batch must be an int"):
        fused_linear_cross_entropy(x, w, target, b, num_items_in_batch=2.5)
    with pytest.raises(ValueError, match="one-element real tensor"):
        fused_linear_cross_entropy(x, w, target, b, num_items_in_batch=torch.ones(2))


@pytest.mark.parametrize(
    "name, value, error, fragment",
    [
        ("class_weight", torch.ones(3), ValueError, "class_weight must have shape (V,)"),
        ("class_weight", torch.ones(67, dtype=torch.int64), TypeError, "class_weight must be a floating tensor"),
        ("class_weight", [1.0] * 67, TypeError, "class_weight must be a torch.Tensor"),
        ("temperature", 0.0, ValueError, "temperature must be > 0"),
        ("temperature", float("nan"), TypeError, "temperature must be a finite real number"),
        ("logit_scale", "2", TypeError, "logit_scale must be a finite real number"),
        ("return_token_stats", 1, TypeError, "return_token_stats must be a bool"),
    ],
)
def test_bad_new_options_name_the_argument(name, value, error, fragment):
    x, w, b, target = make_inputs(lead=(5,), vocab=67, hidden=8)
    if isinstance(value, torch.Tensor):
        value = value.to(DEVICE)
    with pytest.raises(error, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        fused_linear_cross_entropy(x, w, target, b, **{name: value})


@pytest.mark.parametrize("softcap, temperature", [(None, 1.0), (3.0, 0.7)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_token_stats_match_the_materialized_logits(softcap, temperature, reduction):
    """Entropy and top-1 hit per token equal those of the float64 logits; the loss is unchanged by
    asking for them. Half the targets are set to the row's argmax so that hits and misses both occur."""
    x, w, b, target = make_inputs(lead=(3, 13))
    logits = x.detach().double() @ w.detach().double().T + b.detach().double()
    capped = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    target = torch.where(torch.arange(13, device=DEVICE) % 2 == 0, capped.argmax(-1), target)
    target[0, 0] = -100
    out = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, softcap=softcap, temperature=temperature,
                                     return_token_stats=True, chunk_size=8)
    assert isinstance(out, CrossEntropyOutput)
    ref = reference.fused_linear_cross_entropy(*(t.detach().double() for t in (x, w)), target, b.detach().double(),
                                               reduction=reduction, softcap=softcap, temperature=temperature,
                                               return_token_stats=True)
    valid = target != -100
    assert out.entropy.shape == target.shape and out.entropy.dtype == torch.float32
    for name in ("entropy", "mean_logit", "log_sum_sq_prob"):
        got, want = getattr(out, name), getattr(ref, name)
        assert got.shape == target.shape and got.dtype == torch.float32 and (got[~valid] == 0).all(), name
        assert rel_err(got, want) < 1e-6, name
    assert out.is_top1.dtype == torch.bool and torch.equal(out.is_top1, ref.is_top1)
    assert out.is_top1[valid].any() and not out.is_top1[valid].all() and not out.is_top1[~valid].any()
    assert out.loss.requires_grad and out.entropy.requires_grad == (reduction == "none")
    assert not (out.mean_logit.requires_grad or out.log_sum_sq_prob.requires_grad or out.is_top1.requires_grad)
    plain = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, softcap=softcap,
                                       temperature=temperature, chunk_size=8)
    assert torch.equal(plain, out.loss)


def test_token_log_probs_with_gradient_are_minus_the_per_token_loss():
    """reduction='none' gives −log p(target) per token with its gradient (what a fused head returns)."""
    x, w, b, target = make_inputs(lead=(2, 9))
    logp = -fused_linear_cross_entropy(x, w, target, b, reduction="none", temperature=0.9)
    ref_in = [t.detach().double().requires_grad_() for t in (x, w, b)]
    logits = (ref_in[0] @ ref_in[1].T + ref_in[2]) / 0.9
    valid = target != -100
    want = logits.log_softmax(-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
    assert rel_err(logp, want) < 1e-6
    seed = torch.randn(logp.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    for got, ref in zip(torch.autograd.grad(logp, (x, w, b), seed), torch.autograd.grad(want, ref_in, seed.double())):
        assert rel_err(got, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap, temperature", [(None, 1.0), (4.0, 0.8)])
def test_entropy_gradient_with_reduction_none(dtype, softcap, temperature):
    """An entropy bonus (GRPO's): the gradient of Σ a·logp + Σ b·H matches float64 autograd."""
    x, w, b, target = make_inputs(lead=(2, 11), dtype=dtype)
    out = fused_linear_cross_entropy(x, w, target, b, reduction="none", softcap=softcap, temperature=temperature,
                                     return_token_stats=True, chunk_size=8)
    inputs = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = reference.fused_linear_cross_entropy(*inputs[:2], target, inputs[2], reduction="none", softcap=softcap,
                                               temperature=temperature, return_token_stats=True)
    gen = torch.Generator().manual_seed(5)
    a, c = (torch.randn(target.shape, generator=gen).to(DEVICE) for _ in range(2))
    got = torch.autograd.grad((out.loss * a).sum() + (out.entropy * c).sum(), (x, w, b))
    want = torch.autograd.grad((ref.loss * a.double()).sum() + (ref.entropy * c.double()).sum(), inputs)
    for g, r in zip(got, want):
        assert g.dtype == dtype and rel_err(g, r) < TOL[dtype]
    only_entropy = torch.autograd.grad(
        fused_linear_cross_entropy(x, w, target, b, reduction="none", return_token_stats=True).entropy.sum(), (x,)
    )[0]
    want_entropy = torch.autograd.grad(
        reference.fused_linear_cross_entropy(*inputs[:2], target, inputs[2], reduction="none",
                                             return_token_stats=True).entropy.sum(), inputs[:1]
    )[0]
    assert rel_err(only_entropy, want_entropy) < TOL[dtype]


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_launcher_writes_every_stat(softcap):
    """Poisoned stats (NaN) and top-1 (-1) buffers: every row is written, ignored rows with 0."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(7, 301, generator=gen) * 3).to(DEVICE)
    target = torch.randint(0, 301, (7,), generator=gen).to(DEVICE)
    target[2] = -100
    lse, loss, z_loss = (torch.full((7,), float("nan"), device=DEVICE) for _ in range(3))
    stats = torch.full((7, 3), float("nan"), device=DEVICE)
    top1 = torch.full((7,), -1, dtype=torch.int8, device=DEVICE)
    launch_cross_entropy_chunk(logits, target, lse=lse, loss=loss, z_loss=z_loss, grad_scale=None, stats=stats,
                               top1=top1, ignore_index=-100, label_smoothing=0.0, z_loss_scale=0.0, softcap=softcap)
    capped = logits.double() if softcap is None else softcap * torch.tanh(logits.double() / softcap)
    logp = capped.log_softmax(-1)
    want = torch.stack([-(logp.exp() * logp).sum(-1), capped.mean(-1), torch.logsumexp(2 * logp, -1)], dim=1)
    want[2] = 0
    assert not stats.isnan().any() and rel_err(stats, want) < 1e-6
    assert set(top1.tolist()) <= {0, 1} and top1[2] == 0


def test_autocast_runs_the_head_in_the_autocast_dtype():
    """Under CPU/CUDA autocast (bf16) with float32 parameters: the loss is the loss of the same call on
    bf16 copies (the operands rounded as nn.Linear's would be, the logits chunk in bf16 on CUDA),
    float32; the gradients are float32 (dW accumulated in float32) and within bf16 rounding of the
    bf16 call's."""
    x, w, b, target = make_inputs(bias=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        loss = fused_linear_cross_entropy(x, w, target, b, chunk_size=16)
    grads = torch.autograd.grad(loss, (x, w, b))
    assert loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    halves = [t.detach().bfloat16().requires_grad_() for t in (x, w, b)]
    want = fused_linear_cross_entropy(*halves[:2], target, halves[2], chunk_size=16)
    assert rel_err(loss, want) < 1e-6
    for got, ref in zip(grads, torch.autograd.grad(want, halves)):
        assert rel_err(got, ref) < 1e-2
    unrounded = fused_linear_cross_entropy(x.detach(), w.detach(), target, b.detach())
    assert rel_err(loss, unrounded) > 1e-6  # autocast did change the operands


def test_torch_compile_calls_the_kernels_behind_one_graph_break():
    """The public function is torch.compiler.disable'd: a compiled caller gets the eager result."""
    x, w, b, target = make_inputs(lead=(9,), vocab=131, hidden=16)

    def step(x, w, b, target):
        return fused_linear_cross_entropy(x * 1.0, w, target, b) * 2.0

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(x, w, b, target)
    assert explanation.graph_break_count == 1
    compiled = torch.compile(step, backend="eager")
    got = compiled(x, w, b, target)
    want = step(x, w, b, target)
    assert torch.equal(got, want)
    assert all(torch.equal(g, r) for g, r in zip(torch.autograd.grad(got, (x, w, b)), torch.autograd.grad(want, (x, w, b))))


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("num_items", [None, 29])
def test_without_host_checks_the_results_are_the_same(reduction, num_items):
    """host_checks=False (no host sync: the count on the device, backward always scales) changes nothing
    in the loss or the gradients, with class weights too."""
    x, w, b, target = make_inputs()
    if reduction == "none" and num_items is not None:
        return
    upstream = 2.0
    results = []
    for host_checks in (True, False):
        loss = fused_linear_cross_entropy(x, w, target, b, reduction=reduction, num_items_in_batch=num_items,
                                          class_weight=class_weights(w.shape[0]), chunk_size=16,
                                          host_checks=host_checks)
        grads = torch.autograd.grad(loss.sum() * upstream, (x, w, b))
        results.append((loss.detach(), *grads))
    for a, c in zip(*results):
        assert torch.allclose(a, c, rtol=1e-6, atol=1e-7)


def test_without_host_checks_a_bad_target_is_still_an_error():
    """The range is asserted on the device (an immediate RuntimeError on a CPU; a device-side assert on CUDA)."""
    assert_device_error(
        "fused_linear_cross_entropy(x, w, target, b, host_checks=False)",
        r"target holds values outside \[0, 67\)",
        setup="""
            from kernels_lib.fused_linear_cross_entropy import fused_linear_cross_entropy
            from test_fused_linear_cross_entropy import make_inputs
            x, w, b, target = make_inputs(lead=(5,), vocab=67, hidden=8)
            target[1] = 67
        """)
    x, w, b, target = make_inputs(lead=(5,), vocab=67, hidden=8)
    with pytest.raises(TypeError, match="host_checks must be a bool"):
        fused_linear_cross_entropy(x, w, target, b, host_checks=0)
