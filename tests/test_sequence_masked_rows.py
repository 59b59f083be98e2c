"""The sequence losses with their ignored positions dropped before the head's matmuls (``skip_ignored``).

DPO, CPO, SimPO, ORPO, KTO and GRPO run the shared pipeline of :mod:`kernels_lib._sequence_logprobs`,
which gathers the valid rows, sums them per sequence by segments and scatters ``dx`` back. Each loss is
checked with ``skip_ignored=True`` against ``skip_ignored=False`` and against its float64 reference
(:mod:`kernels_lib.reference`): the loss, every output and the gradients of ``x``, ``weight`` and
``bias``, with no ignored position, ragged masks of odd sizes, sequences with no valid token where the
loss allows them, and chunks that hold one sequence (or pair) or several.
"""

from __future__ import annotations

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import default_device, reference
from kernels_lib._sequence_logprobs import row_plan
from kernels_lib.fused_linear_cpo import fused_linear_cpo, fused_linear_simpo
from kernels_lib.fused_linear_dpo import fused_linear_dpo
from kernels_lib.fused_linear_grpo import fused_linear_grpo
from kernels_lib.fused_linear_kto import fused_linear_kto
from kernels_lib.fused_linear_orpo import fused_linear_orpo

DEVICE = default_device()
T, H, V, H_REF = 7, 12, 37, 10
TOL_REF = 2e-5  # float32 kernel against the float64 reference
TOL_SKIP = 2e-6  # skip_ignored on against off: the same float32 arithmetic up to summation order
GRAD_OUTPUT = 0.7


def targets(batch: int, masks: str, seed: int) -> torch.Tensor:
    """``(batch, T)`` targets: ``"none"`` ignored, ``"ragged"`` (a prompt and a padding of each sequence's own
    length, at least one valid token each), ``"empty"`` (ragged, and sequences 1 and 2 with no valid token)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, V, (batch, T), generator=gen)
    if masks != "none":
        for k in range(batch):
            prompt = int(torch.randint(0, T - 1, (), generator=gen))
            pad = int(torch.randint(0, T - prompt, (), generator=gen))
            target[k, :prompt] = -100
            if pad:
                target[k, T - pad:] = -100
    if masks == "empty":
        target[1:3] = -100
    return target.to(DEVICE)


def head(batch: int, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, T, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * H**-0.5 * 2
    b = torch.randn(V, generator=gen) if bias else None
    return [None if t is None else t.to(DEVICE) for t in (x, w, b)]


def reference_head(batch: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 2)
    return dict(ref_x=torch.randn(batch, T, H_REF, generator=gen).to(DEVICE),
                ref_weight=(torch.randn(V, H_REF, generator=gen) * H_REF**-0.5 * 2).to(DEVICE),
                ref_bias=torch.randn(V, generator=gen).to(DEVICE))


def fields(out, prefix: str = "") -> dict:
    """Every tensor of an output tuple by name (nested tuples flattened), None fields left out."""
    named = {}
    for name, value in zip(out._fields, out):
        if isinstance(value, tuple):
            named.update(fields(value, f"{prefix}{name}."))
        elif value is not None:
            named[prefix + name] = value
    return named


def run(fn, head_tensors, target, dtype=torch.float32, **kwargs):
    """The outputs by name and ``d loss / d (x, weight, bias)`` (upstream ``GRAD_OUTPUT``)."""
    leaves = [None if t is None else t.to(dtype).requires_grad_() for t in head_tensors]
    out = fn(leaves[0], leaves[1], target, leaves[2], **kwargs)
    present = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(out.loss, present, torch.tensor(GRAD_OUTPUT, dtype=out.loss.dtype, device=DEVICE))
    named = fields(out)
    named.update({f"d{name}": g for name, g in zip(("x", "weight", "bias"), grads)})
    return named


def assert_close(got: dict, want: dict, tol: float, what: str) -> None:
    assert set(want) <= set(got), f"{what}: missing {set(want) - set(got)}"
    for name, w in want.items():
        g, w = got[name].detach().double(), w.detach().double()
        assert g.shape == w.shape, f"{what}: {name} shape {tuple(g.shape)} vs {tuple(w.shape)}"
        assert torch.equal(torch.isnan(g), torch.isnan(w)), f"{what}: {name} NaN where the other is not"
        g, w = torch.nan_to_num(g), torch.nan_to_num(w)
        err = (g - w).norm() / w.norm().clamp(min=1e-30)
        assert err <= tol or (g - w).abs().max() <= tol, f"{what}: {name} relative error {err:.3g} > {tol}"


def check(kernel, ref_fn, head_tensors, target, ref_kwargs=None, **kwargs):
    """``skip_ignored`` on against off and against the float64 reference; returns the outputs with it on."""
    on = run(kernel, head_tensors, target, skip_ignored=True, **kwargs)
    off = run(kernel, head_tensors, target, skip_ignored=False, **kwargs)
    assert_close(on, off, TOL_SKIP, "skip_ignored on vs off")
    ref_args = {k: v for k, v in kwargs.items() if k != "chunk_size"}
    if ref_kwargs is not None:
        ref_args.update(ref_kwargs)
    want = run(ref_fn, head_tensors, target, dtype=torch.float64, **{
        k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in ref_args.items()})
    assert_close(on, {k: v for k, v in want.items() if k in on}, TOL_REF, "kernel vs float64 reference")
    dropped = target == -100
    if "nll_target" in kwargs:  # the NLL reads the chosen half's nll_target: those rows are kept
        n = target.shape[0] // 2
        dropped[:n] &= kwargs["nll_target"][:n] == -100
    assert not on["dx"][dropped].any()  # dx is 0 at every dropped position
    return on


#: (masks, chunk_size): nothing ignored in one chunk; ragged in one chunk, one sequence (pair) per chunk,
#: and a few per chunk, packed by their kept rows.
SWEEP = [("none", None), ("ragged", None), ("ragged", 1), ("ragged", 3 * T)]


def pair_inputs(masks, seed=0, n=3):
    return head(2 * n, seed), targets(2 * n, masks, seed)


DPO_OPTIONS = {"sum": dict(), "average": dict(average_log_prob=True),
               "sigmoid+sft": dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]), "ipo": dict(loss_type="ipo")}


@pytest.mark.parametrize("masks, chunk_size, options", [
    *((m, c, "sum") for m, c in SWEEP), *(("ragged", 3 * T, o) for o in ("average", "sigmoid+sft")), ("ragged", 1, "ipo"),
])
def test_dpo(masks, chunk_size, options):
    tensors, target = pair_inputs(masks)
    check(fused_linear_dpo, reference.fused_linear_dpo, tensors, target, chunk_size=chunk_size,
          **reference_head(target.shape[0], 0), **DPO_OPTIONS[options])


def test_dpo_given_reference_logps():
    tensors, target = pair_inputs("ragged", seed=3)
    ref_logps = torch.randn(target.shape[0], device=DEVICE) - 5
    check(fused_linear_dpo, reference.fused_linear_dpo, tensors, target, ref_logps=ref_logps, chunk_size=T)


@pytest.mark.parametrize("masks, chunk_size, loss_type", [
    *((m, c, "sigmoid") for m, c in SWEEP), ("ragged", 3 * T, "ipo"), ("ragged", 1, "simpo"),
])
def test_cpo_and_simpo(masks, chunk_size, loss_type):
    tensors, target = pair_inputs(masks, seed=1)
    if loss_type == "simpo":
        check(fused_linear_simpo, reference.fused_linear_simpo, tensors, target, chunk_size=chunk_size)
    else:
        check(fused_linear_cpo, reference.fused_linear_cpo, tensors, target, chunk_size=chunk_size, loss_type=loss_type)


@pytest.mark.parametrize("chunk_size", [1])
def test_cpo_nll_target_reads_rows_target_ignores(chunk_size):
    """The NLL's targets (prompt and response) are valid where ``target`` masks the prompt: those rows are kept."""
    tensors, target = pair_inputs("ragged", seed=2)
    nll_target = torch.where(target == -100, torch.randint(0, V, target.shape, device=DEVICE), target)
    nll_target[:, -1] = -100
    check(fused_linear_cpo, reference.fused_linear_cpo, tensors, target, chunk_size=chunk_size, nll_target=nll_target)
    check(fused_linear_orpo, reference.fused_linear_orpo, tensors, target, chunk_size=chunk_size, nll_target=nll_target)


@pytest.mark.parametrize("masks, chunk_size", SWEEP[::2] + SWEEP[3:])
def test_orpo(masks, chunk_size):
    tensors, target = pair_inputs(masks, seed=4)
    check(fused_linear_orpo, reference.fused_linear_orpo, tensors, target, chunk_size=chunk_size)


def kto(x, w, target, bias=None, **kwargs):
    return fused_linear_kto(x, w, target, LABELS, bias=bias, **kwargs)


def kto_reference(x, w, target, bias=None, **kwargs):
    return reference.fused_linear_kto(x, w, target, LABELS, bias=bias, **kwargs)


LABELS = torch.tensor([True, False, False, True, True], device=DEVICE)


@pytest.mark.parametrize("masks, chunk_size, average_log_prob", [*((m, c, False) for m, c in SWEEP), ("ragged", 1, True)])
def test_kto(masks, chunk_size, average_log_prob):
    tensors, target = head(5, 5), targets(5, masks, 5)
    check(kto, kto_reference, tensors, target, chunk_size=chunk_size, average_log_prob=average_log_prob,
          kl=torch.tensor(0.3, device=DEVICE), **reference_head(5, 5))


GRPO_CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo", beta=0.05),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=T),
    "dapo-num-items": dict(loss_type="dapo", num_items_in_batch=11.0),
    "luspo": dict(loss_type="luspo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.1),
    "sapo-sequence": dict(loss_type="sapo", importance_sampling_level="sequence"),
    "vespo": dict(loss_type="vespo"),
}


def grpo_inputs(masks, seed=6, batch=5):
    tensors, target = head(batch, seed), targets(batch, masks, seed)
    gen = torch.Generator().manual_seed(seed + 3)
    extra = dict(advantages=torch.randn(batch, generator=gen).to(DEVICE),
                 old_logps=(-torch.rand(batch, T, generator=gen) * 4).to(DEVICE),
                 completion_mask=(torch.rand(batch, T, generator=gen) > 0.2).to(DEVICE))
    return tensors, target, extra


@pytest.mark.parametrize("masks, case", [("none", "grpo"), ("ragged", "grpo"), *(("empty", c) for c in GRPO_CASES)])
def test_grpo_loss_types(masks, case):
    tensors, target, extra = grpo_inputs(masks)
    options = dict(GRPO_CASES[case])
    if options.get("beta"):
        extra.update(reference_head(target.shape[0], 6))
    out = check(fused_linear_grpo, reference.fused_linear_grpo, tensors, target, chunk_size=2 * T, temperature=0.8,
                return_per_token=True, **extra, **options)
    assert not out["per_token_logps"][target == -100].any()


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_grpo_entropy_reference_and_chunks(chunk_size):
    tensors, target, extra = grpo_inputs("empty", seed=7)
    check(fused_linear_grpo, reference.fused_linear_grpo, tensors, target, chunk_size=chunk_size, beta=0.1,
          return_entropy=True, return_per_token=True, sampler_logps=extra["old_logps"] - 0.1,
          **extra, **reference_head(target.shape[0], 7))


def test_grpo_every_position_ignored():
    """Row 0 stands for them all: the loss and every gradient 0, as without the option."""
    tensors, target, extra = grpo_inputs("none", seed=8)
    target = torch.full_like(target, -100)
    out = check(fused_linear_grpo, reference.fused_linear_grpo, tensors, target, beta=0.1, return_entropy=True,
                **extra, **reference_head(target.shape[0], 8))
    assert out["loss"] == 0 and not out["dx"].any() and not out["dweight"].any() and not out["dbias"].any()


def test_plan_chunks_hold_whole_groups_of_kept_rows():
    target = targets(6, "empty", 9).reshape(-1)
    valid = (target != -100).view(6, T).sum(1).tolist()
    plan = row_plan(target, -100, T, 2 * T, group_seqs=2)
    assert plan.index.tolist() == torch.nonzero(target != -100).squeeze(1).tolist()
    assert plan.seq.tolist() == (plan.index // T).tolist()
    seqs_seen = 0
    for rows, seqs in plan.chunks:
        assert seqs.start == seqs_seen and seqs.start % 2 == 0 and (seqs.stop % 2 == 0 or seqs.stop == 6)
        assert rows.stop - rows.start == sum(valid[seqs]) and (rows.stop - rows.start <= 2 * T or seqs.stop - seqs.start == 2)
        seqs_seen = seqs.stop
    assert seqs_seen == 6
    assert row_plan(targets(6, "none", 9).reshape(-1), -100, T, 2 * T) is None  # nothing ignored: nothing gathered
    assert row_plan(target, -100, T, 2 * T, enabled=False) is None


LOSSES = {
    "dpo": (fused_linear_dpo, lambda batch: reference_head(batch, 0)),
    "cpo": (fused_linear_cpo, lambda batch: {}),
    "simpo": (fused_linear_simpo, lambda batch: {}),
    "orpo": (fused_linear_orpo, lambda batch: {}),
    "kto": (kto, lambda batch: reference_head(batch, 0)),
    "grpo": (fused_linear_grpo, lambda batch: grpo_inputs("ragged", batch=batch)[2]),
}


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on NaN
@pytest.mark.parametrize("name", list(LOSSES))
def test_nan_in_a_kept_row_reaches_the_loss_and_a_dropped_row_reaches_nothing(name):
    fn, extra = LOSSES[name]
    batch = 5 if name in ("kto", "grpo") else 6
    (x, w, b), target = head(batch, 10), targets(batch, "ragged", 10)
    kept, dropped = torch.nonzero(target != -100)[0].tolist(), torch.nonzero(target == -100)[0].tolist()
    clean = run(fn, (x, w, b), target, **extra(batch))
    with_nan = x.clone()
    with_nan[kept[0], kept[1], 0] = float("nan")
    assert torch.isnan(run(fn, (with_nan, w, b), target, **extra(batch))["loss"])
    with_nan = x.clone()
    with_nan[dropped[0], dropped[1], 0] = float("nan")
    assert_close(run(fn, (with_nan, w, b), target, **extra(batch)), clean, TOL_SKIP, "NaN in a dropped row")


@pytest.mark.parametrize("name", list(LOSSES))
def test_skip_ignored_is_checked(name):
    fn, extra = LOSSES[name]
    batch = 5 if name in ("kto", "grpo") else 6
    (x, w, b), target = head(batch, 11), targets(batch, "ragged", 11)
    with pytest.raises(TypeError, match="skip_ignored"):
        fn(x, w, target, bias=b, skip_ignored=1, **extra(batch))
