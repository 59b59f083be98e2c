"""Every fused loss follows ``torch.autocast`` (:mod:`kernels_lib._autocast`).

What an AMP step hands a loss: half-precision hidden states next to float32 parameters (and a
float32 teacher or reference head). Inside ``torch.autocast(device_type, dtype=half)`` every head's
operands are rounded to ``half``, as ``F.linear`` would round them, so the call must give what the
same loss gives on copies cast to ``half`` explicitly, outside autocast:

* the loss and ``dx``: the same kernels on the same ``half`` operands (the float32 head is rounded
  before its matmul, on CUDA as in the interpreter), so equal bit for bit; the bound is ``1e-6``,
  float32 rounding, were a reduction's order ever to differ;
* ``dW`` and ``db`` come back float32, the leaves' dtype, accumulated across chunks in float32 (the
  default ``accurate=False`` accumulates in the parameter's dtype, here float32). The explicit call
  uses ``accurate=True``, which accumulates in float32 through the same matmul calls and rounds once
  at the end, so the autocast gradient rounded to ``half`` equals it (bound ``1e-6``), and the
  float32 gradient is within one rounding of it: ``||g - round(g)|| <= u ||g||``, ``u = 2^-8``
  (bfloat16), ``2^-11`` (float16).

Two chunks per call (``chunk_size=6`` of 12 rows: whole pairs and sequences), biases, ignored
positions; the bfloat16 autocast calls go through each loss's ``nn.Module`` form, the float16 ones
through the function. Outside autocast the mixed-dtype call is refused, naming the argument. Shapes
are tiny: without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

import kernels_lib
from kernels_lib import (
    distill_cosine_loss, distill_jsd_loss, fused_linear_cross_entropy, fused_linear_grpo, fused_linear_jsd,
    fused_linear_kto, fused_linear_orpo,
)
from kernels_lib.distillation import DistillCosineLoss, DistillJSDLoss
from kernels_lib.fused_linear_cpo import FusedLinearCPOLoss, FusedLinearSimPOLoss, fused_linear_cpo, fused_linear_simpo
from kernels_lib.fused_linear_cross_entropy import FusedLinearCrossEntropyLoss
from kernels_lib.fused_linear_dpo import FusedLinearDPOLoss, fused_linear_dpo
from kernels_lib.fused_linear_grpo import FusedLinearGRPOLoss
from kernels_lib.fused_linear_jsd import FusedLinearJSDLoss
from kernels_lib.fused_linear_kto import FusedLinearKTOLoss
from kernels_lib.fused_linear_orpo import FusedLinearORPOLoss
from kernels_workbench.check import relative_error

DEVICE = kernels_lib.default_device()
HALVES = (torch.bfloat16, torch.float16)
#: Unit roundoff of each half dtype: one rounding moves a tensor by at most this, relative, in norm.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
CHUNK = 6  # rows per chunk: 2 chunks of the 12 rows, one pair (2 x T) or two sequences each
HEAD = ("x", "weight", "bias")  # the leaves that take gradients
HEADS = (*HEAD, "other_x", "other_weight", "other_bias")  # every head's tensors (advantages stay float32)


def make(seed: int = 0):
    """Float32 tensors: a policy/student head (x ``(4, 3, 8)``, weight, bias; V = 37), a second head
    (``(4, 3, 12)``) serving as teacher or reference, targets with the first position of every
    sequence ignored, KTO's labels and GRPO's advantages."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h, h_other, v = 4, 3, 8, 12, 37
    target = torch.randint(0, v, (b, t), generator=gen)
    target[:, 0] = -100
    tensors = {
        "x": torch.randn(b, t, h, generator=gen),
        "weight": torch.randn(v, h, generator=gen) * h**-0.5,
        "bias": torch.randn(v, generator=gen) * 0.5,
        "other_x": torch.randn(b, t, h_other, generator=gen),
        "other_weight": torch.randn(v, h_other, generator=gen) * 2 * h_other**-0.5,
        "other_bias": torch.randn(v, generator=gen) * 0.5,
        "advantages": torch.randn(b, generator=gen),
    }
    tensors = {k: t.to(DEVICE) for k, t in tensors.items()}
    tensors["target"] = target.to(DEVICE)
    tensors["labels"] = torch.tensor([True, False, True, False], device=DEVICE)
    return tensors


def _teacher(t):
    return {"teacher_x": t["other_x"], "teacher_weight": t["other_weight"], "teacher_bias": t["other_bias"]}


def _reference(t):
    return {"ref_x": t["other_x"], "ref_weight": t["other_weight"], "ref_bias": t["other_bias"]}


def _two_heads(fn, **options):
    def call(t, **kw):
        teacher = _teacher(t)
        out = fn(t["x"], t["weight"], teacher["teacher_x"], teacher["teacher_weight"], t["target"],
                 student_bias=t["bias"], teacher_bias=teacher["teacher_bias"], **options, **kw)
        return out if isinstance(out, torch.Tensor) else out.loss
    return call


#: name -> call(tensors, **options) -> the scalar loss; each loss with its second head where it takes one.
LOSSES = {
    "cross_entropy": lambda t, **kw: fused_linear_cross_entropy(t["x"], t["weight"], t["target"], t["bias"], **kw),
    "jsd": _two_heads(fused_linear_jsd, beta=0.3, temperature=1.5),
    "distill_jsd": _two_heads(distill_jsd_loss, beta=0.7, temperature=2.0),
    "distill_cosine": _two_heads(distill_cosine_loss, beta=0.5),
    "orpo": lambda t, **kw: fused_linear_orpo(t["x"], t["weight"], t["target"], t["bias"], **kw).loss,
    "dpo": lambda t, **kw: fused_linear_dpo(t["x"], t["weight"], t["target"], t["bias"], **_reference(t), **kw).loss,
    "cpo": lambda t, **kw: fused_linear_cpo(t["x"], t["weight"], t["target"], t["bias"], **kw).loss,
    "simpo": lambda t, **kw: fused_linear_simpo(t["x"], t["weight"], t["target"], t["bias"], **kw).loss,
    "kto": lambda t, **kw: fused_linear_kto(
        t["x"], t["weight"], t["target"], t["labels"], 0.05, bias=t["bias"], **_reference(t), **kw
    ).loss,
    "grpo": lambda t, **kw: fused_linear_grpo(
        t["x"], t["weight"], t["target"], t["bias"], advantages=t["advantages"], **_reference(t), beta=0.04,
        temperature=0.9, **kw
    ).loss,
}


def _module_two_heads(module):
    def call(t):
        teacher = _teacher(t)
        out = module(t["x"], t["weight"], teacher["teacher_x"], teacher["teacher_weight"], t["target"],
                     student_bias=t["bias"], teacher_bias=teacher["teacher_bias"])
        return out if isinstance(out, torch.Tensor) else out.loss
    return call


#: name -> the nn.Module form called as a model's loss would call it (the options of LOSSES, chunk_size=CHUNK).
MODULES = {
    "cross_entropy": lambda t: FusedLinearCrossEntropyLoss(chunk_size=CHUNK)(
        t["x"], t["weight"], t["target"], t["bias"]
    ),
    "jsd": _module_two_heads(FusedLinearJSDLoss(beta=0.3, temperature=1.5, chunk_size=CHUNK)),
    "distill_jsd": _module_two_heads(DistillJSDLoss(beta=0.7, temperature=2.0, chunk_size=CHUNK)),
    "distill_cosine": _module_two_heads(DistillCosineLoss(beta=0.5, chunk_size=CHUNK)),
    "orpo": lambda t: FusedLinearORPOLoss(chunk_size=CHUNK)(t["x"], t["weight"], t["target"], t["bias"]).loss,
    "dpo": lambda t: FusedLinearDPOLoss(chunk_size=CHUNK)(
        t["x"], t["weight"], t["target"], t["bias"], **_reference(t)
    ).loss,
    "cpo": lambda t: FusedLinearCPOLoss(chunk_size=CHUNK)(t["x"], t["weight"], t["target"], t["bias"]).loss,
    "simpo": lambda t: FusedLinearSimPOLoss(chunk_size=CHUNK)(t["x"], t["weight"], t["target"], t["bias"]).loss,
    "kto": lambda t: FusedLinearKTOLoss(chunk_size=CHUNK)(
        t["x"], t["weight"], t["target"], t["labels"], 0.05, bias=t["bias"], **_reference(t)
    ).loss,
    "grpo": lambda t: FusedLinearGRPOLoss(beta=0.04, temperature=0.9, chunk_size=CHUNK)(
        t["x"], t["weight"], t["target"], t["bias"], advantages=t["advantages"], **_reference(t)
    ).loss,
}


def _leaves(tensors, dtypes):
    """Fresh copies, each floating tensor cast to ``dtypes.get(name, float32)``; the head's take gradients."""
    out = {}
    for name, t in tensors.items():
        t = t.detach().clone()
        if t.is_floating_point():
            t = t.to(dtypes.get(name, torch.float32))
        out[name] = t.requires_grad_(name in HEAD)
    return out


@pytest.mark.parametrize("half", HALVES, ids=str)
@pytest.mark.parametrize("name", list(LOSSES))
def test_autocast_equals_the_explicitly_cast_call(name, half):
    call = LOSSES[name]
    base = make(seed=len(name))
    # What AMP hands over: half hidden states, float32 parameters and second head.
    amp = _leaves(base, {"x": half})
    with torch.autocast(DEVICE.type, dtype=half):  # bfloat16 through the nn.Module form, float16 the function
        loss = MODULES[name](amp) if half == torch.bfloat16 else call(amp, chunk_size=CHUNK)
    grads = torch.autograd.grad(loss, [amp[k] for k in HEAD])
    # The same call on copies cast to half, outside autocast.
    cast = _leaves(base, dict.fromkeys(HEADS, half))
    want = call(cast, chunk_size=CHUNK, accurate=True)
    want_grads = torch.autograd.grad(want, [cast[k] for k in HEAD])

    assert loss.dtype == torch.float32 and not torch.isnan(loss)
    assert relative_error(loss, want) <= 1e-6, (relative_error(loss, want), loss.item(), want.item())
    for key, got, ref in zip(HEAD, grads, want_grads, strict=True):
        assert got.dtype == amp[key].dtype and got.shape == amp[key].shape, (key, got.dtype)
        assert ref.abs().sum() > 0, key  # a gradient that can fail the comparison
        rounded = relative_error(got.to(half), ref)
        assert rounded <= 1e-6, (key, rounded)
        assert relative_error(got, ref) <= UNIT_ROUNDOFF[half], (key, relative_error(got, ref))


def test_float32_inputs_run_in_the_autocast_dtype():
    """All-float32 inputs under autocast (an unwrapped float32 model): every head is rounded to bfloat16,
    so the loss is the explicitly cast call's, and differs from the float32 one."""
    base = make(seed=11)
    for name in ("jsd", "dpo"):
        call = LOSSES[name]
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = call(_leaves(base, {}), chunk_size=CHUNK)
        want = call(_leaves(base, dict.fromkeys(HEADS, torch.bfloat16)), chunk_size=CHUNK)
        plain = call(_leaves(base, {}), chunk_size=CHUNK)
        assert relative_error(loss, want) <= 1e-6, name
        assert relative_error(loss, plain) > 1e-6, name  # autocast did round the operands


#: name -> [(the tensor made float32 while the rest is half, the argument the error names, its pair)].
MISMATCHES = {
    "cross_entropy": [("weight", "weight", "x"), ("bias", "bias", "weight")],
    "jsd": [("weight", "student_weight", "student_x"), ("other_weight", "teacher_weight", "teacher_x")],
    "distill_jsd": [("weight", "student_weight", "student_x"), ("other_bias", "teacher_bias", "teacher_weight")],
    "distill_cosine": [("weight", "student_weight", "student_x")],
    "orpo": [("weight", "weight", "x"), ("bias", "bias", "weight")],
    "dpo": [
        ("weight", "weight", "x"), ("other_weight", "ref_weight", "ref_x"), ("other_bias", "ref_bias", "ref_weight"),
    ],
    "cpo": [("weight", "weight", "x")],
    "simpo": [("bias", "bias", "weight")],
    "kto": [("weight", "weight", "x"), ("other_weight", "ref_weight", "ref_x")],
    "grpo": [("weight", "weight", "x"), ("other_weight", "ref_weight", "ref_x")],
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_outside_autocast_mixed_dtypes_are_refused_naming_the_argument(name):
    assert set(MISMATCHES) == set(LOSSES) == set(MODULES)
    base = make()
    for changed, argument, pair in MISMATCHES[name]:
        tensors = _leaves(base, {k: torch.bfloat16 for k in HEADS if k != changed})
        message = f"{argument} must have the dtype of {pair} \\(torch.bfloat16\\); got torch.float32"
        with pytest.raises(TypeError, match=message):
            LOSSES[name](tensors, chunk_size=CHUNK)
    # Autocast for another device type does not apply to these tensors: still refused.
    other = "cpu" if DEVICE.type != "cpu" else None
    if other is not None:
        with torch.autocast(other, dtype=torch.bfloat16), pytest.raises(TypeError, match="must have the dtype of"):
            LOSSES[name](_leaves(base, {"x": torch.bfloat16}), chunk_size=CHUNK)


def test_logits_logsumexp_follows_autocast():
    """The head's log-sum-exp kernel (the fused cross-entropy's no-gradient route) shares the head checks,
    so it casts as they allow: inside autocast, bfloat16 ``x`` with a float32 head is the bfloat16 call."""
    from kernels_lib.kernels.logits_logsumexp import logits_logsumexp

    t = make(seed=7)
    x, w, b, target = t["x"].reshape(-1, 8), t["weight"], t["bias"], t["target"].reshape(-1)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        lse, picked = logits_logsumexp(x.bfloat16(), w, b, target)
    want_lse, want_picked = logits_logsumexp(x.bfloat16(), w.bfloat16(), b.bfloat16(), target)
    assert relative_error(lse, want_lse) <= 1e-6 and relative_error(picked, want_picked) <= 1e-6
    with pytest.raises(TypeError, match="weight must have the dtype of x"):
        logits_logsumexp(x.bfloat16(), w, b, target)
