"""Fused linear KTO against the float64 reference and TRL 1.16's KTO loss lines.

Errors are relative in norm, ``||out - ref|| / ||ref||``, the reference run on float64 copies of the
very inputs the kernel saw. Shapes are small and odd (H = 40, reference H = 24, V = 1031, T = 7): on
a machine without a GPU the kernels run in Triton's interpreter.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device, reference
from kernels_lib.fused_linear_kto import FusedLinearKTOLoss, KTOOutput, fused_linear_kto
from sequence_loss_checks import assert_errors_below, double_leaves, grads_of

trl_utils = pytest.importorskip("trl.trainer.utils")

DEVICE = default_device()

# Tolerances on the relative error, per input dtype. float32: only summation order differs from the
# float64 reference (observed ~2e-7). In half precision the inputs are the same rounded values for
# both sides; what differs is that dx and dW are rounded once to the input dtype (unit roundoff
# 2^-11 ≈ 4.9e-4 for float16, 2^-8 ≈ 3.9e-3 for bfloat16) and, on CUDA, the logits chunk and dz are
# held in it too: 8u and 5u leave room for a few compounded roundings, while a wrong term is off by O(1).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
AUX = ("chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps")
LABELS = [True, False, False, True, True]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if ref.numel() == 0:
        return 0.0 if out.numel() == 0 else float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def make_inputs(batch=5, seq=7, hidden=40, ref_hidden=24, vocab=1031, dtype=torch.float32, bias=True, seed=0):
    """Policy and reference model; the first two positions of every sequence ignored, example 1 padded at the end."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if bias else None
    target = torch.randint(0, vocab, (batch, seq), generator=gen)
    target[:, :2] = -100
    target[1, -3:] = -100
    ref = dict(
        ref_x=torch.randn(batch, seq, ref_hidden, generator=gen).to(DEVICE, dtype),
        ref_weight=(torch.randn(vocab, ref_hidden, generator=gen) * ref_hidden**-0.5 * 2).to(DEVICE, dtype),
        ref_bias=torch.randn(vocab, generator=gen).to(DEVICE, dtype) if bias else None,
    )
    leaves = [t.to(DEVICE, dtype).requires_grad_() if t is not None else None for t in (x, w, b)]
    return (*leaves, target.to(DEVICE), ref)


def labels_of(values):
    return torch.tensor(values, dtype=torch.bool, device=DEVICE)


def check_against_reference(x, w, b, target, labels, ref, tol, kl=None, grad_output=0.7, **options):
    """Loss, auxiliaries and every gradient of the kernel vs the float64 reference."""
    out = fused_linear_kto(x, w, target, labels, kl, bias=b, **ref, **options)
    ref_inputs = double_leaves(x, w, b)
    ref64 = {k: None if t is None else t.double() for k, t in ref.items()}
    want = reference.fused_linear_kto(*ref_inputs[:2], target, labels, kl, bias=ref_inputs[2], **ref64, **options)
    assert isinstance(out, KTOOutput) and out.loss.dtype == torch.float32 and out.loss.shape == ()
    errors = {name: rel_err(getattr(out, name), getattr(want, name)) for name in ("loss", *AUX)}
    assert_errors_below(out.loss, want.loss, (x, w, b), ref_inputs, errors, tol, grad_output, rel_err)
    return out


@pytest.mark.parametrize("chunk_size", [None, 1, 14])  # one chunk; one sequence per chunk; two
def test_matches_reference_float32_chunks(chunk_size):
    x, w, b, target, ref = make_inputs()
    check_against_reference(x, w, b, target, labels_of(LABELS), ref, TOL[torch.float32], chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_half(dtype):
    x, w, b, target, ref = make_inputs(dtype=dtype)
    check_against_reference(x, w, b, target, labels_of(LABELS), ref, TOL[dtype], kl=0.3, chunk_size=14)


@pytest.mark.parametrize(
    "options",
    [
        dict(average_log_prob=True),
        dict(beta=0.5, desirable_weight=1.33, undesirable_weight=0.7),
        dict(average_log_prob=True, beta=2.0, chunk_size=7),
    ],
)
def test_options(options):
    x, w, b, target, ref = make_inputs()
    kl = torch.tensor([0.8], device=DEVICE)
    check_against_reference(x, w, b, target, labels_of(LABELS), ref, TOL[torch.float32], kl=kl, **options)


@pytest.mark.parametrize("labels", [[True] * 5, [False] * 5])
def test_one_sided_batches(labels):
    x, w, b, target, ref = make_inputs()
    out = check_against_reference(x, w, b, target, labels_of(labels), ref, TOL[torch.float32], kl=0.2)
    empty = out.rejected_rewards if labels[0] else out.chosen_rewards
    assert empty.shape == (0,) and (out.chosen_logps if labels[0] else out.rejected_logps).shape == (5,)


def test_no_bias_odd_shapes_and_unit_grad_output():
    x, w, _, target, ref = make_inputs(batch=3, seq=6, hidden=33, ref_hidden=33, vocab=517, bias=False)
    check_against_reference(x, w, None, target, labels_of([False, True, False]), ref, TOL[torch.float32], grad_output=1.0)


@pytest.mark.parametrize("average_log_prob", [False, True])
def test_ref_logps_given_equals_reference_model(average_log_prob):
    x, w, b, target, ref = make_inputs()
    labels = labels_of(LABELS)
    with_model = fused_linear_kto(x, w, target, labels, 0.1, bias=b, **ref, average_log_prob=average_log_prob)
    ref_logps = reference.fused_linear_kto(
        ref["ref_x"], ref["ref_weight"], target, labels_of([True] * 5), bias=ref["ref_bias"],
        ref_logps=torch.zeros(5, device=DEVICE), average_log_prob=average_log_prob,
    ).chosen_logps
    given = fused_linear_kto(x, w, target, labels, 0.1, bias=b, ref_logps=ref_logps, average_log_prob=average_log_prob)
    for name in ("loss", *AUX):
        assert rel_err(getattr(given, name), getattr(with_model, name)) < TOL[torch.float32], name


def trl_kto(x, w, b, target, labels, ref, kl, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0):
    """TRL 1.16 ``KTOTrainer._compute_loss`` (kto_trainer.py lines 1401-1482, 1548) on fp32 logits, transcribed.

    Per-token log-probs through TRL's own ``selective_log_softmax``, masked as its fused head does.
    """
    self = SimpleNamespace(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight)

    def completion_logps(hidden, head, head_bias):
        logits = F.linear(hidden.float(), head.float(), None if head_bias is None else head_bias.float())
        mask = target != -100
        per_token_logps = trl_utils.selective_log_softmax(logits, torch.where(mask, target, 0)) * mask
        return per_token_logps.sum(-1)

    completion = completion_logps(x, w, b)
    with torch.no_grad():
        ref_completion = completion_logps(ref["ref_x"], ref["ref_weight"], ref["ref_bias"])
    chosen_idx = torch.nonzero(labels, as_tuple=False).view(-1)
    rejected_idx = torch.nonzero(~labels, as_tuple=False).view(-1)
    chosen_logps = completion.index_select(0, chosen_idx)
    rejected_logps = completion.index_select(0, rejected_idx)
    chosen_logratios = chosen_logps - ref_completion.index_select(0, chosen_idx)
    chosen_losses = 1 - F.sigmoid(self.beta * (chosen_logratios - kl))
    rejected_logratios = rejected_logps - ref_completion.index_select(0, rejected_idx)
    rejected_losses = 1 - F.sigmoid(self.beta * (kl - rejected_logratios))
    losses = torch.cat((self.desirable_weight * chosen_losses, self.undesirable_weight * rejected_losses), 0)
    return dict(
        loss=losses.nanmean(), chosen_rewards=self.beta * chosen_logratios.detach(),
        rejected_rewards=self.beta * rejected_logratios.detach(), chosen_logps=chosen_logps, rejected_logps=rejected_logps,
    )


@pytest.mark.parametrize("labels", [LABELS, [True] * 5])
def test_matches_trl(labels):
    """Kernel and reference against TRL's lines: values, and the gradients of its autograd path."""
    x, w, b, target, ref = make_inputs()
    labels = labels_of(labels)
    kl = torch.tensor([0.25], device=DEVICE)  # TRL's shape: a one-element tensor, detached
    options = dict(beta=0.3, desirable_weight=1.2, undesirable_weight=0.8)
    trl = trl_kto(x, w, b, target, labels, ref, kl, **options)
    want = grads_of(trl["loss"], (x, w, b), torch.tensor(1.0, device=DEVICE))
    for impl in (fused_linear_kto, reference.fused_linear_kto):
        out = impl(x, w, target, labels, kl, bias=b, **ref, chunk_size=14, **options)
        errors = {name: rel_err(getattr(out, name), trl[name]) for name in trl}
        errors.update(
            {n: rel_err(g, r) for n, g, r in zip(("dx", "dW", "db"), grads_of(out.loss, (x, w, b), torch.tensor(1.0, device=DEVICE)), want)}
        )
        assert all(e < TOL[torch.float32] for e in errors.values()), (impl.__module__, errors)


def test_module_no_grad_and_reference_untouched():
    x, w, b, target, ref = make_inputs()
    ref = {k: t.requires_grad_() for k, t in ref.items()}  # an unfrozen reference model: still no gradient to it
    labels = labels_of(LABELS)
    module = FusedLinearKTOLoss(beta=0.2, chunk_size=14)
    assert "beta=0.2" in repr(module)
    out = module(x, w, target, labels, bias=b, **ref)
    assert torch.equal(out.loss, fused_linear_kto(x, w, target, labels, bias=b, **ref, beta=0.2, chunk_size=14).loss)
    out.loss.backward()
    assert all(t.grad is None for t in ref.values()) and x.grad is not None
    with torch.no_grad():
        assert fused_linear_kto(x, w, target, labels, bias=b, **ref).loss.grad_fn is None


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
def test_nan_propagates():
    x, w, b, target, ref = make_inputs()
    labels = labels_of(LABELS)
    with torch.no_grad():
        x[2, 4, 0] = float("nan")
    out = fused_linear_kto(x, w, target, labels, bias=b, **ref)
    assert torch.isnan(out.loss) and torch.isnan(out.rejected_logps[1])  # example 2 is the second undesirable
    nan_kl = fused_linear_kto(x.detach(), w.detach(), target, labels, torch.tensor(float("nan"), device=DEVICE), bias=b, **ref)
    assert torch.isnan(nan_kl.loss)


def bad_inputs():
    x, w, b, target, ref = make_inputs()
    empty = target.clone()
    empty[3] = -100
    out_of_range = target.clone()
    out_of_range[1, 2] = -1
    no_ref = dict(ref_x=None, ref_weight=None, ref_bias=None)
    return [
        (dict(preference_labels=labels_of(LABELS[:4])), ValueError, "preference_labels must have shape"),
        (dict(preference_labels=labels_of(LABELS).long()), TypeError, "preference_labels must be a bool"),
        (dict(target=out_of_range), ValueError, "target holds 1 value"),
        (dict(target=empty), ValueError, "target has 1 sequence"),
        (dict(target=target[:, 1:]), ValueError, "target must have shape"),
        (dict(x=x[:, :, 1:]), ValueError, "weight must have shape"),
        (dict(ref_x=ref["ref_x"][:, 1:]), ValueError, "ref_x must have shape"),
        (dict(ref_weight=ref["ref_weight"][1:]), ValueError, "ref_weight must have shape"),
        (dict(ref_weight=ref["ref_weight"][:, 1:]), ValueError, "ref_weight must have shape"),
        (dict(ref_weight=ref["ref_weight"].half()), TypeError, "ref_weight must have the dtype of ref_x"),
        (dict(ref_bias=ref["ref_bias"][1:]), ValueError, "ref_bias must have shape"),
        (dict(ref_logps=torch.zeros(5, device=DEVICE)), ValueError, "not both"),
        (no_ref, ValueError, "give ref_logps"),
        (dict(no_ref, ref_logps=torch.zeros(4, device=DEVICE)), ValueError, "ref_logps must have shape"),
        (dict(no_ref, ref_logps=torch.zeros(5, dtype=torch.long, device=DEVICE)), TypeError, "ref_logps must be a floating"),
        (dict(kl=torch.zeros(2, device=DEVICE)), ValueError, "kl must be"),
        (dict(kl="0.1"), TypeError, "kl must be a finite"),
        (dict(weight=w.half()), TypeError, "weight must have the dtype of x"),
        (dict(bias=b[1:]), ValueError, "bias must have shape"),
        (dict(x=x.detach().to("meta")), ValueError, "x on meta"),
        (dict(average_log_prob=1), TypeError, "average_log_prob must be a bool"),
        (dict(desirable_weight=None), TypeError, "desirable_weight must be a finite"),
    ]


@pytest.mark.parametrize("change,error,match", bad_inputs())
def test_bad_inputs_name_the_argument(change, error, match):
    x, w, b, target, ref = make_inputs()
    args = dict(x=x, weight=w, target=target, preference_labels=labels_of(LABELS), bias=b, **ref) | change
    with pytest.raises(error, match=match):
        fused_linear_kto(**args)
