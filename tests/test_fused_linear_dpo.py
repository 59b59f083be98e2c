"""Fused linear DPO against the float64 reference and TRL 1.16's own ``DPOTrainer._compute_loss``.

Errors are relative in norm, ``||out - ref|| / ||ref||``, the reference run on float64 copies of the
very inputs the kernel saw. Shapes are small and odd (H = 40, reference H = 24, V = 1031 (prime),
T = 7; and n = 1, T = 1, H = 33, V = 509): on a machine without a GPU the kernels run in Triton's
interpreter.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device, reference
from kernels_lib.fused_linear_dpo import LOSS_TYPES, DPOOutput, FusedLinearDPOLoss, fused_linear_dpo
from sequence_loss_checks import assert_errors_below, double_leaves, grads_of

dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")

DEVICE = default_device()

# Tolerances on the relative error, per input dtype, as the ORPO and KTO tests: float32, only the
# summation order differs from the float64 reference (observed ~2e-7); in half precision dx and dW
# are rounded once to the input dtype (u = 2^-11 float16, 2^-8 bfloat16; on CUDA the logits chunk and
# dz are held in it too): 8u and 5u leave room for a few compounded roundings, a wrong term is O(1).
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
AUX = DPOOutput._fields[1:]
#: The option each loss type needs beyond the defaults.
NEEDS = {"exo_pair": {"label_smoothing": 1e-3}, "robust": {"label_smoothing": 0.2}, "discopop": {"discopop_tau": 0.3}}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    if ref.norm() == 0:
        return out.norm().item()
    return ((out - ref).norm() / ref.norm()).item()


def make_inputs(n=2, seq=7, hidden=40, ref_hidden=24, vocab=1031, dtype=torch.float32, bias=True, seed=0):
    """n pairs and a reference model; the first two positions of every sequence ignored (a prompt),
    pair 0's chosen one padded at the end (T >= 4)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, seq, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * hidden**-0.5 * 2
    b = torch.randn(vocab, generator=gen) if bias else None
    target = torch.randint(0, vocab, (2 * n, seq), generator=gen)
    if seq >= 4:
        target[:, :2] = -100
        target[0, -2:] = -100
    ref = dict(
        ref_x=torch.randn(2 * n, seq, ref_hidden, generator=gen).to(DEVICE, dtype),
        ref_weight=(torch.randn(vocab, ref_hidden, generator=gen) * ref_hidden**-0.5 * 2).to(DEVICE, dtype),
        ref_bias=torch.randn(vocab, generator=gen).to(DEVICE, dtype) if bias else None,
    )
    leaves = [t.to(DEVICE, dtype).requires_grad_() if t is not None else None for t in (x, w, b)]
    return (*leaves, target.to(DEVICE), ref)


def check_against_reference(x, w, b, target, ref, tol, grad_output=0.7, **options):
    """Loss, auxiliaries and every gradient of the kernel vs the float64 reference."""
    out = fused_linear_dpo(x, w, target, b, **ref, **options)
    ref_inputs = double_leaves(x, w, b)
    ref64 = {k: None if t is None else t.double() for k, t in ref.items()}
    want = reference.fused_linear_dpo(*ref_inputs[:2], target, ref_inputs[2], **ref64, **options)
    assert isinstance(out, DPOOutput) and out.loss.dtype == torch.float32 and out.loss.shape == ()
    assert all(getattr(out, name).shape == (x.shape[0] // 2,) for name in AUX)
    errors = {name: rel_err(getattr(out, name), getattr(want, name)) for name in ("loss", *AUX)}
    assert_errors_below(out.loss, want.loss, (x, w, b), ref_inputs, errors, tol, grad_output, rel_err)
    return out


@pytest.mark.parametrize("chunk_size", [None, 1, 14, 30])  # one chunk; one pair per chunk (2T = 14 rows); 2 pairs
def test_matches_reference_float32_chunks(chunk_size):
    x, w, b, target, ref = make_inputs(n=3)
    check_against_reference(x, w, b, target, ref, TOL[torch.float32], chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_half(dtype):
    x, w, b, target, ref = make_inputs(dtype=dtype)
    check_against_reference(x, w, b, target, ref, TOL[dtype], chunk_size=14, beta=0.5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type(loss_type):
    x, w, b, target, ref = make_inputs(n=3)
    check_against_reference(x, w, b, target, ref, TOL[torch.float32], loss_type=loss_type, chunk_size=14, **NEEDS.get(loss_type, {}))


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type=["sigmoid", "sft", "robust"], loss_weights=[1.0, 0.5, 2.0], label_smoothing=0.3),
        dict(f_divergence_type="forward_kl", loss_type=["ipo", "hinge"]),
        dict(f_divergence_type="js_divergence", beta=2.0),
        dict(average_log_prob=True, loss_type=["sigmoid", "bco_pair", "apo_down"], beta=3.0),
        dict(loss_type="sft"),
    ],
    ids=["weighted-list", "forward-kl", "js", "average", "sft-only"],
)
def test_options(options):
    x, w, b, target, ref = make_inputs(n=3)
    check_against_reference(x, w, b, target, ref, TOL[torch.float32], chunk_size=30, **options)


def test_one_pair_one_token_odd_sizes_no_bias():
    """n = 1 pair, T = 1 (one token per sequence), H = 33, V = 509 (prime), no bias; grad_output = 1."""
    x, w, _, target, ref = make_inputs(n=1, seq=1, hidden=33, ref_hidden=5, vocab=509, bias=False)
    for loss_type in ("sigmoid", "ipo"):
        check_against_reference(x, w, None, target, ref, TOL[torch.float32], grad_output=1.0, loss_type=loss_type)


@pytest.mark.parametrize("average_log_prob", [False, True])
def test_ref_logps_given_equals_reference_model(average_log_prob):
    x, w, b, target, ref = make_inputs()
    with_model = fused_linear_dpo(x, w, target, b, **ref, average_log_prob=average_log_prob, chunk_size=14)
    # The reference model's own log-probs: the policy outputs of a run with the reference as policy.
    ref_run = fused_linear_dpo(ref["ref_x"], ref["ref_weight"], target, ref["ref_bias"], ref_logps=torch.zeros(4, device=DEVICE),
                               average_log_prob=average_log_prob)
    ref_logps = torch.cat([ref_run.chosen_logps, ref_run.rejected_logps])
    given = fused_linear_dpo(x, w, target, b, ref_logps=ref_logps, average_log_prob=average_log_prob, chunk_size=14)
    for name in ("loss", *AUX):
        assert rel_err(getattr(given, name), getattr(with_model, name)) < TOL[torch.float32], name
    check_against_reference(x, w, b, target, {"ref_logps": ref_logps}, TOL[torch.float32], average_log_prob=average_log_prob)


# --------------------------------------------------------------------------- TRL's own code


class _FusedHeadModel(torch.nn.Module):
    """Stands in for a causal LM under TRL 1.16's fused-head protocol: ``model(..., labels=labels,
    fused_lm_head=True)`` gives per-token log-probs of ``labels[:, 1:]`` (0 at -100) from the logits of
    a head on ``hidden`` (fp32, as a model's head upcast), plus the logged fields (zeros). A module, as
    TRL's code may walk a model's submodules (on the H200's torch 2.11 it read ``_modules``)."""

    is_gradient_checkpointing = False

    def __init__(self, hidden, head, head_bias):
        super().__init__()
        self.logits = F.linear(hidden.float(), head.float(), None if head_bias is None else head_bias.float())

    def forward(self, *, labels, fused_lm_head, **_model_kwargs):
        assert fused_lm_head
        y = labels[:, 1:]
        mask = y != -100
        log_probs = torch.log_softmax(self.logits, -1).gather(-1, torch.where(mask, y, 0).unsqueeze(-1)).squeeze(-1) * mask
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=mask & False)


def trl_dpo(x, w, b, target, ref, precomputed=False, beta=0.1, loss_type="sigmoid", loss_weights=None,
            label_smoothing=0.0, discopop_tau=0.05, f_divergence_type="reverse_kl"):
    """``DPOTrainer._compute_loss`` (dpo_trainer.py lines 1285-1612) run on a stand-in trainer: TRL's
    loss (its gradient through the fake model's logits) and its logged means."""
    n = x.shape[0] // 2
    valid = target != -100
    # A prompt token, then the completion: labels = input_ids masked where completion_mask == 0 (line 1298).
    input_ids = torch.cat([torch.zeros_like(target[:, :1]), torch.where(valid, target, 1)], 1)
    completion_mask = torch.cat([torch.zeros_like(target[:, :1]), valid.long()], 1)
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), completion_mask=completion_mask)
    ref_model = _FusedHeadModel(ref["ref_x"], ref["ref_weight"], ref["ref_bias"])
    if precomputed:
        with torch.no_grad():
            ref_logps = ref_model(labels=input_ids.masked_fill(completion_mask == 0, -100), fused_lm_head=True).log_probs.sum(1)
        inputs |= dict(ref_chosen_logps=ref_logps[:n], ref_rejected_logps=ref_logps[n:])
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    trainer = SimpleNamespace(
        model=_FusedHeadModel(x, w, b), ref_model=ref_model, precompute_ref_logps=precomputed,
        accelerator=SimpleNamespace(device=x.device, gather_for_metrics=lambda t: t, gather=lambda t: t),
        aux_loss_enabled=False, ld_alpha=None, f_divergence_type=f_divergence_type, f_alpha_divergence_coef=1.0,
        loss_types=types, loss_weights=loss_weights or [1.0] * len(types), beta=beta, label_smoothing=label_smoothing,
        use_weighting=False, args=SimpleNamespace(discopop_tau=discopop_tau, gradient_checkpointing_kwargs=None),
        _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )
    loss = dpo_trainer.DPOTrainer._compute_loss(trainer, trainer.model, inputs, return_outputs=False)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss, logged


#: Our per-pair outputs whose mean TRL logs, by its metric name.
LOGGED = {
    "rewards/chosen": "chosen_rewards", "rewards/rejected": "rejected_rewards", "rewards/accuracies": "reward_accuracies",
    "rewards/margins": "reward_margins", "logps/chosen": "chosen_logps", "logps/rejected": "rejected_logps",
}


@pytest.mark.parametrize(
    "options",
    [
        {},
        dict(precomputed=True, beta=0.3),
        dict(loss_type="ipo"),
        dict(loss_type="robust", label_smoothing=0.2),
        dict(loss_type="exo_pair", label_smoothing=1e-3),
        dict(loss_type=["sigmoid", "sft", "sigmoid_norm"], loss_weights=[1.0, 0.3, 2.0]),
        dict(loss_type=["nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down"], beta=0.5),
        dict(loss_type=["discopop", "hinge"], discopop_tau=0.2, beta=0.05),
        dict(loss_type=["sigmoid", "ipo"], f_divergence_type="forward_kl"),
        dict(loss_type="sigmoid", f_divergence_type="js_divergence"),
    ],
    ids=["sigmoid", "precomputed", "ipo", "robust", "exo", "sft+norm", "logratio-terms", "discopop+hinge", "fkl", "js"],
)
def test_matches_trl(options):
    """Kernel and reference against TRL's ``_compute_loss``: the loss, its gradients (through TRL's
    autograd) and the six logged means."""
    x, w, b, target, ref = make_inputs(n=3)
    target[4, 2:5] = -100  # a shorter rejected completion: the length-normalized types see it
    trl_loss, logged = trl_dpo(x, w, b, target, ref, **options)
    want = grads_of(trl_loss, (x, w, b), torch.tensor(1.0, device=DEVICE))
    kwargs = {k: val for k, val in options.items() if k != "precomputed"}
    for impl in (fused_linear_dpo, reference.fused_linear_dpo):
        out = impl(x, w, target, b, **ref, chunk_size=14, **kwargs)
        errors = {"loss": rel_err(out.loss, trl_loss)}
        errors |= {name: abs(getattr(out, ours).mean().item() - logged[name]) / max(abs(logged[name]), 1e-3) for name, ours in LOGGED.items()}
        got = grads_of(out.loss, (x, w, b), torch.tensor(1.0, device=DEVICE))
        errors |= {n: rel_err(g, r) for n, g, r in zip(("dx", "dW", "db"), got, want)}
        assert all(e < TOL[torch.float32] for e in errors.values()), (impl.__module__, errors)


# --------------------------------------------------------------------------- behaviour


def test_hinge_beyond_the_margin_has_zero_gradient():
    """hinge: a pair with β·Δ ≥ 1 contributes nothing, its gradient 0 (relu's, as TRL's autograd has it)."""
    x, w, b, target, ref = make_inputs()
    ref_logps = torch.tensor([-1e4, -1e4, 0.0, 0.0], device=DEVICE)  # chosen log-ratios ~ +1e4: far past the margin
    out = fused_linear_dpo(x, w, target, b, ref_logps=ref_logps, loss_type="hinge")
    assert out.loss.item() == 0.0 and (out.reward_margins > 1).all()
    assert all(torch.count_nonzero(g) == 0 for g in torch.autograd.grad(out.loss, (x, w, b)))
    active = fused_linear_dpo(x, w, target, b, ref_logps=ref_logps, loss_type="hinge", beta=1e-6)  # β·Δ ≈ 0.01
    assert 0.95 < active.loss.item() < 1.0 and torch.count_nonzero(torch.autograd.grad(active.loss, w)[0]) > 0


def test_module_no_grad_and_reference_untouched():
    x, w, b, target, ref = make_inputs()
    ref = {k: t.requires_grad_() for k, t in ref.items()}  # an unfrozen reference model: still no gradient to it
    module = FusedLinearDPOLoss(beta=0.2, loss_type=["sigmoid", "ipo"], chunk_size=14)
    assert "beta=0.2" in repr(module) and "'ipo'" in repr(module)
    out = module(x, w, target, b, **ref)
    want = fused_linear_dpo(x, w, target, b, **ref, beta=0.2, loss_type=["sigmoid", "ipo"], chunk_size=14)
    assert torch.equal(out.loss, want.loss)
    out.loss.backward()
    assert all(t.grad is None for t in ref.values()) and x.grad is not None
    assert all(not getattr(out, name).requires_grad for name in AUX)
    with torch.no_grad():
        assert fused_linear_dpo(x, w, target, b, **ref).loss.grad_fn is None


def test_second_backward_is_refused():
    x, w, b, target, ref = make_inputs()
    loss = fused_linear_dpo(x, w, target, b, **ref).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Every ``torch.empty``/``empty_like`` of a floating dtype comes NaN-filled: an output element (a
    sequence's sum, a row of dx, the logits buffer) that the pipeline fails to write shows as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


@pytest.mark.parametrize("chunk_size", [None, 14, 30])  # 3 pairs: one chunk, one pair each, 2 + 1
def test_every_output_written(poisoned_allocations, chunk_size):
    x, w, b, target, ref = make_inputs(n=3)
    out = check_against_reference(x, w, b, target, ref, TOL[torch.float32], chunk_size=chunk_size, loss_type=["sigmoid", "sft"])
    assert not any(torch.isnan(t).any() for t in out)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
@pytest.mark.parametrize("where", ["x", "weight", "bias", "ref_x", "ref_weight", "ref_logps"])
def test_nan_propagates(where):
    """A NaN in sequence 3's path (pair 1's rejected response; in a head, at the row of its token 4's
    target) makes the loss NaN, that pair's rewards NaN (not pair 0's), and the gradient NaN."""
    x, w, b, target, ref = make_inputs()
    if where == "ref_logps":
        ref = {"ref_logps": torch.tensor([-3.0, -4.0, -5.0, -6.0], device=DEVICE)}
    tensors = {"x": x, "weight": w, "bias": b, **ref}
    hit = target[3, 4].item()
    index = {"x": (3, 4, 0), "weight": (hit, 0), "bias": (hit,), "ref_x": (3, 4, 0), "ref_weight": (hit, 0), "ref_logps": (3,)}[where]
    with torch.no_grad():
        tensors[where][index] = float("nan")
    out = fused_linear_dpo(x, w, target, b, **ref)
    assert torch.isnan(out.loss) and torch.isnan(out.rejected_rewards[1])
    if where in ("x", "ref_x", "ref_logps"):
        assert not torch.isnan(out.chosen_rewards).any() and not torch.isnan(out.rejected_rewards[0])
    assert torch.isnan(torch.autograd.grad(out.loss, w)[0]).any()


def bad_inputs():
    x, w, b, target, ref = make_inputs()
    empty = target.clone()
    empty[2] = -100
    no_ref = dict(ref_x=None, ref_weight=None, ref_bias=None)
    return [
        (dict(x=x[:3], target=target[:3]), ValueError, "odd batch"),
        (dict(target=empty), ValueError, "target has 1 sequence"),
        (dict(ref_x=ref["ref_x"][:, 1:]), ValueError, "ref_x must have shape"),
        (dict(no_ref, ref_logps=torch.zeros(2, device=DEVICE)), ValueError, r"ref_logps must have shape \(2n,\)"),
        (dict(ref_logps=torch.zeros(4, device=DEVICE)), ValueError, "not both"),
        (no_ref, ValueError, "give ref_logps"),
        (dict(loss_type="aot"), ValueError, "loss_type 'aot' is not supported"),
        (dict(loss_type="dpo"), ValueError, "loss_type must be one of"),
        (dict(loss_type=[]), TypeError, "loss_type must be a str or a non-empty list"),
        (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0]), ValueError, "loss_weights must be None or a list of 2"),
        (dict(loss_weights=[float("nan")]), TypeError, "loss_weights must be a finite"),
        (dict(label_smoothing=0.1), ValueError, "label_smoothing=0.1 is read only by loss_type 'robust' and 'exo_pair'"),
        (dict(loss_type="robust", label_smoothing=0.5), ValueError, r"label_smoothing must be in \[0, 0.5\)"),
        (dict(loss_type="exo_pair"), ValueError, r"label_smoothing must be in \(0, 1\)"),
        (dict(beta=0.0), ValueError, "beta must be > 0"),
        (dict(discopop_tau=0), ValueError, "discopop_tau must be > 0"),
        (dict(f_divergence_type="alpha_divergence"), ValueError, "'alpha_divergence' is not supported"),
        (dict(f_divergence_type="kl"), ValueError, "f_divergence_type must be one of"),
        (dict(f_divergence_type="forward_kl", loss_type="nca_pair"), ValueError, "f_divergence_type 'forward_kl' goes only with"),
        (dict(average_log_prob=True, loss_type="ipo"), ValueError, "average_log_prob=True with loss_type 'ipo'"),
        (dict(average_log_prob=1), TypeError, "average_log_prob must be a bool"),
    ]


@pytest.mark.parametrize("change,error,match", bad_inputs())
def test_bad_inputs_name_the_argument(change, error, match):
    x, w, b, target, ref = make_inputs()
    args = dict(x=x, weight=w, target=target, bias=b, **ref) | change
    with pytest.raises(error, match=match):
        fused_linear_dpo(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("with_reference_model", [True, False], ids=["reference-model", "ref-logps"])
def test_sppo_hard_at_least_as_close_to_float64_as_trls_formula(dtype, with_reference_model):
    """``sppo_hard`` is quadratic in the log-ratios, ``(a - 1/(2β))² + (b + 1/(2β))²``, so their rounding is
    amplified: at Liger-Kernel's shape (3 pairs, T = 47, H = 31, V = 123) its own tests and ours disagree
    by more than its float32 tolerance. Settled against float64: kernels_lib's loss, rewards and gradients
    are at least as close to it as TRL's formula run in the same dtype (:func:`reference.fused_linear_dpo`)."""
    opts = dict(loss_type="sppo_hard", beta=0.1)
    for seed in range(3):
        x, w, b, target, ref = make_inputs(n=3, seq=47, hidden=31, ref_hidden=31, vocab=123, dtype=dtype, seed=seed)
        if not with_reference_model:
            ref = {"ref_logps": (torch.randn(6, generator=torch.Generator().manual_seed(seed)) * 5 - 100).to(DEVICE)}
        ours = fused_linear_dpo(x, w, target, b, **ref, **opts)
        trl = reference.fused_linear_dpo(x, w, target, b, **ref, **opts)
        leaves64 = [t.detach().double().requires_grad_() for t in (x, w, b)]
        exact = reference.fused_linear_dpo(leaves64[0], leaves64[1], target, leaves64[2],
                                           **{k: None if v is None else v.double() for k, v in ref.items()}, **opts)
        grads = {name: torch.autograd.grad(out.loss, [x, w, b]) for name, out in (("ours", ours), ("trl", trl))}
        exact_grads = torch.autograd.grad(exact.loss, leaves64)
        for i, what in enumerate(("loss", "chosen_rewards", "rejected_rewards", "dx", "dW", "db")):
            got, base, want = ((getattr(ours, what), getattr(trl, what), getattr(exact, what)) if i < 3 else
                               (grads["ours"][i - 3], grads["trl"][i - 3], exact_grads[i - 3]))
            mine, theirs = rel_err(got, want), rel_err(base, want)
            # 1.25x and a float32 rounding's floor: the two sum the same terms in another order
            assert mine <= 1.25 * theirs + 2e-7, (f"seed {seed} {what}: kernels_lib {mine:.3g} from float64, "
                                                  f"TRL's formula in {dtype} {theirs:.3g}")
