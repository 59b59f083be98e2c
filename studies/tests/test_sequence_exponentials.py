"""The sequence losses' stored-exponentials route (studies.routes.sequence_exponentials): not the library's.

Put in place for a test's calls as the A/B's arm puts it (every caller of ``sequence_logprobs`` gets the
study's copy): each loss's own checks against its float64 reference, run again with the route on, and a spy
that fails the test where the route was not taken (so a check that passes through the two-pass route
proves nothing about this one). On a CPU the epilogue GEMM runs in Triton's interpreter when
``EPILOGUE_GEMM_WHEN_INTERPRETED`` asks, on float32 operands; on a GPU it is taken for bf16 on Hopper,
so there the half-precision checks run (float16 keeps the two passes: its ``dz`` is formed at a
scale). Losses with a second target (ORPO's and CPO's ``nll_target``) or the token entropy (GRPO's
``return_entropy``) keep the two passes, and are checked to do so.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels_lib
import test_fused_linear_cpo as cpo
import test_fused_linear_dpo as dpo
import test_fused_linear_grpo as grpo
import test_fused_linear_kto as kto
import test_fused_linear_orpo as orpo
from kernels_lib import _sequence_logprobs as library
from kernels_lib.chunks import epilogue
from studies.routes import sequence_exponentials as seq

#: The library's own function, kept before any test puts the route in its callers' place.
LIBRARY_SEQUENCE_LOGPROBS = library.sequence_logprobs

flce_module = importlib.import_module("kernels_lib.fused_linear_cross_entropy")
CUDA = kernels_lib.default_device().type == "cuda"
HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture
def route(monkeypatch):
    """The route on; returns the list its spy appends to at every chunk that takes it."""
    return _take_route(monkeypatch)


def _take_route(monkeypatch, parts=seq.PARTS):
    """The route on for ``parts``, with spies on its two epilogue calls (see :func:`route`)."""
    for name, values in seq.arm(parts=parts).items():
        for key, value in values.items():
            monkeypatch.setattr(importlib.import_module(name), key, value)
    taken = []

    def spy(*args, **kwargs):
        taken.append(kwargs.get("exponentials", False))
        return epilogue.logits_with_loss(*args, **kwargs)

    def spy_no_grad(*args, **kwargs):
        NO_GRAD_CALLS.append(args[0].shape)
        return epilogue.epilogue_loss(*args, **kwargs)

    NO_GRAD_CALLS.clear()
    monkeypatch.setattr(seq, "logits_with_loss", spy)
    monkeypatch.setattr(seq, "epilogue_loss", spy_no_grad)
    return taken


#: The calls of the no-gradient epilogue (a reference model's pass) in the current test (its rows' shapes).
NO_GRAD_CALLS = []


# (test, arguments): each loss's float64 checks, at the dtype the route takes on this machine
if CUDA:
    CASES = [
        (dpo.test_matches_reference_half, (torch.bfloat16,)),
        (orpo.test_matches_reference_half, (torch.bfloat16,)),
        (kto.test_matches_reference_half, (torch.bfloat16,)),
        (cpo.test_matches_reference_half, (torch.bfloat16, False)),
        (cpo.test_matches_reference_half, (torch.bfloat16, True)),
        (grpo.test_half_precision, (torch.bfloat16, "token")),
        (grpo.test_half_precision, (torch.bfloat16, "sequence")),
    ]
else:
    CASES = [
        (dpo.test_matches_reference_float32_chunks, (1,)),
        (dpo.test_options, (dict(average_log_prob=True, loss_type=["sigmoid", "bco_pair", "apo_down"], beta=3.0),)),
        (dpo.test_one_pair_one_token_odd_sizes_no_bias, ()),
        (kto.test_no_bias_odd_shapes_and_unit_grad_output, ()),
        (orpo.test_matches_reference_float32_chunks, (14,)),
        (orpo.test_no_bias_beta_and_odd_shapes, ()),
        (cpo.test_one_pair_one_token_odd_sizes_no_bias, ()),
        (grpo.test_per_token_advantages_and_accurate, ("token",)),
        (grpo.test_odd_sizes_no_bias, (1, 1, "sequence")),
    ]


@pytest.mark.skipif(CUDA and not HOPPER, reason="the epilogue GEMM (TMA) runs on Hopper only; elsewhere the route is not taken")
@pytest.mark.parametrize("check, args", CASES, ids=lambda c: getattr(c, "__module__", "") + "." + getattr(c, "__name__", str(c)))
def test_each_loss_matches_float64_through_the_route(route, check, args):
    check(*args)
    assert route and all(route), f"the route was not taken ({route})"


def test_nan_in_gives_nan_out_through_the_route(route):
    """A NaN in one rejected response's hidden state: the loss, that pair's reward and the gradient NaN,
    the other pair's rewards finite, through the route (bf16 on a GPU: the epilogue GEMM's operands;
    float32 in the interpreter)."""
    if CUDA and not HOPPER:
        pytest.skip("the epilogue GEMM (TMA) runs on Hopper only; elsewhere the route is not taken")
    dtype = torch.bfloat16 if CUDA else torch.float32
    x, w, b, target, ref = dpo.make_inputs(hidden=64, ref_hidden=32, dtype=dtype)
    hit = (3, 4, 0)
    with torch.no_grad():
        x[hit] = float("nan")
    out = dpo.fused_linear_dpo(x, w, target, b, **ref)
    assert route and all(route), f"the route was not taken ({route})"
    assert torch.isnan(out.loss) and torch.isnan(out.rejected_rewards[1]), (out.loss, out.rejected_rewards)
    assert not torch.isnan(out.chosen_rewards).any() and not torch.isnan(out.rejected_rewards[0])
    assert torch.isnan(torch.autograd.grad(out.loss, w)[0]).any()


def _cpo_with_nll_target():
    x, w, b, target = cpo.make_inputs()
    nll_target = target.clone()
    nll_target[1, 0] = -100
    cpo.check_against_reference(x, w, b, target, cpo.TOL[torch.float32], nll_target=nll_target, chunk_size=14)


@pytest.mark.parametrize("check, args", [(_cpo_with_nll_target, ()), (grpo.test_reference_model_and_chunks, (12,)),
                                         (kto.test_matches_reference_float32_chunks, (14,))],
                         ids=["cpo-nll-target", "grpo-entropy", "kto-float32"])
def test_a_second_target_entropy_or_float32_on_a_gpu_keeps_the_two_passes(route, check, args):
    """CPO's NLL target is a second target, GRPO's ``return_entropy`` needs each row's entropy (the
    epilogue forms no ``Σ p z``): never the route. float32 operands on a GPU: not the epilogue GEMM's."""
    if check is kto.test_matches_reference_float32_chunks and not CUDA:
        pytest.skip("the interpreter takes the route for float32 (test_each_loss_matches_float64_through_the_route)")
    check(*args)
    assert not any(route), route


def _library_route():
    """Every caller back on the library's ``sequence_logprobs`` (the two passes), inside a test that took the route."""
    for name in seq.CALLERS:
        setattr(importlib.import_module(name), "sequence_logprobs", LIBRARY_SEQUENCE_LOGPROBS)


def test_the_library_calls_its_own_two_passes():
    """Outside an arm every caller runs the library's function, which has no such route (the package imports
    nothing from studies/); the arm names every module that calls it."""
    for name in seq.CALLERS:
        assert importlib.import_module(name).sequence_logprobs is LIBRARY_SEQUENCE_LOGPROBS, name
    assert not hasattr(library, "STORE_EXPONENTIALS")


def test_the_ab_measures_both_arms_in_alternating_rounds(capsys):
    """studies.bench.sequence_exponentials_ab at the CPU preset: both arms at every B, the
    medians of two rounds, the arms' loss and gradients close, the floor where ceilings were measured."""
    from studies.bench import sequence_exponentials_ab as ab

    table = ab.sequence_exponentials_ab(("kto_loss",), size="small", rounds=2, device=kernels_lib.default_device(), x_values=(2, 4))
    speed = table[table.metric_name == "speed"]
    providers = {"kernels_lib", ab.ARM} | ({ab.FLOOR} if CUDA else set())  # the matmuls alone: timed on a GPU only
    assert set(speed.kernel_provider) == providers
    assert speed.groupby("kernel_provider").x_value.apply(sorted).tolist() == [[2, 4]] * len(providers)
    assert speed.y_value_50.notna().all() and (speed.y_value_50 > 0).all()
    assert speed.note.str.contains("median of 2 rounds").all() and (table["rounds"] == 2).all()
    assert table.rel_diff.between(0, 1e-2).all(), table.rel_diff.unique()
    assert speed.floor_ms.notna().all() == CUDA  # the matmul rate is measured on a GPU only
    out = capsys.readouterr().out
    assert out.index("round 1 of 2, route off") < out.index("round 1 of 2, route on") < out.index("round 2 of 2, route on")
    assert out.index("round 2 of 2, route on") < out.index("round 2 of 2, route off")  # the order reversed
    test_the_library_calls_its_own_two_passes()  # restored


def test_the_ab_ratios_pair_the_arms_and_the_floor_of_one_run():
    from studies.bench import sequence_exponentials_ab as ab

    def row(provider, metric, y, commit="abc1234"):
        return dict(kernel_name="fused_linear_dpo_loss", kernel_provider=provider, metric_name=metric, x_value=16, y_value_50=y,
                    floor_ms=90.0, rel_diff=1e-3, kernels_lib_commit=commit, gpu_name="NVIDIA H200", timestamp="2026-12-05")

    import pandas as pd

    rows = pd.DataFrame([row("kernels_lib", "speed", 124.0), row(ab.ARM, "speed", 105.0), row(ab.FLOOR, "speed", 100.0),
                         row("kernels_lib", "memory", 3000.0), row(ab.ARM, "memory", 2900.0)])
    table = ab.ratios(rows).loc[("fused_linear_dpo_loss", 16)]
    assert table["off / floor"] == pytest.approx(1.24) and table["on / floor"] == pytest.approx(1.05)
    assert table["on / off"] == pytest.approx(105 / 124) and table["short-matmul floor ms"] == 90.0
    assert table["on MB"] == 2900.0 and table["rel_diff"] == 1e-3
    with pytest.raises(ValueError):
        ab.ratios(pd.concat([rows, pd.DataFrame([row(ab.ARM, "speed", 1.0, commit="def5678")])]))


def test_the_floor_runs_the_losses_products_at_their_shapes():
    from studies.bench import sequence_exponentials_ab as ab

    sizes = {"B": 2, "T": 8, "H": 32, "V": 257}
    assert ab.products("fused_linear_dpo_loss", sizes) == 4  # the reference's logits, the policy's, dx, dW
    assert ab.products("fused_linear_cpo_loss", sizes) == 3  # no reference model
    assert {name: ab.products(name, sizes) for name in ab.LOSSES} == {
        "fused_linear_dpo_loss": 4, "fused_linear_orpo_loss": 3, "fused_linear_cpo_loss": 3, "fused_linear_simpo_loss": 3,
        "fused_linear_grpo_loss_token": 4, "fused_linear_grpo_loss_sequence": 4, "kto_loss": 3}  # KTO: dW alone
    dx, dw = ab.matmuls_alone("fused_linear_dpo_loss", sizes, torch.float32, torch.device("cpu"))()
    assert dx.shape == (16, 32) and dw.shape == (257, 32) and torch.isfinite(dx).all()
    dx, dw = ab.matmuls_alone("kto_loss", sizes, torch.float32, torch.device("cpu"))()
    assert dx is None and dw.shape == (257, 32)


def test_the_ab_puts_the_short_matmul_floor_from_the_runs_ceilings(monkeypatch):
    """The ceilings' rows name the rate by kernel_name ("copy", "matmul"): the floor_ms column comes from them."""
    import pandas as pd

    from kernels_workbench import floor as one_floor
    from studies.bench import sequence_exponentials_ab as ab

    fake = pd.DataFrame({"kernel_name": ["copy", "matmul"], "metric_name": ["rate", "rate"], "y_value_50": [4000.0, 700.0]})
    monkeypatch.setattr(ab, "measure_ceilings", lambda device: fake)
    table = ab.sequence_exponentials_ab(("fused_linear_cpo_loss",), size="small", rounds=1, device=kernels_lib.default_device(),
                                        x_values=(2,))
    speed = table[(table.metric_name == "speed") & (table.kernel_provider == "kernels_lib")].iloc[0]
    sizes = {**ab.get_spec("fused_linear_cpo_loss").small["sizes"], "B": 2}
    want = one_floor.floor_at("fused_linear_cpo_loss", sizes, ab.get_spec("fused_linear_cpo_loss").small["dtype"], "full",
                              {"copy": 4000.0, "matmul": 700.0})[0]
    assert speed.floor_ms == pytest.approx(want)


def test_the_ab_script_appends_calls_of_some_losses(tmp_path, monkeypatch):
    from studies.bench import sequence_exponentials_ab as ab

    calls = []

    def fake(losses, size, rounds, arms):
        calls.append(tuple(losses))
        assert arms == (["on"] if len(calls) < 3 else ["grad", "no_grad"]), arms
        import pandas as pd

        return pd.DataFrame([dict(kernel_name=name, kernel_provider=provider, metric_name="speed", x_value=2, y_value_50=1.0,
                                  floor_ms=float("nan"), rel_diff=0.0, kernels_lib_commit="abc1234", gpu_name="NVIDIA H200",
                                  timestamp="2026-12-05", rounds=rounds)
                             for name in losses for provider in ("kernels_lib", ab.ARM)])

    monkeypatch.setattr(ab, "sequence_exponentials_ab", fake)
    out = tmp_path / "gpu_runs" / "sequence_exponentials_ab.csv"
    assert ab.main([str(out), "--losses", "kto_loss", "--rounds", "1"]) == 0
    assert ab.main([str(out), "--losses", "fused_linear_dpo_loss,fused_linear_cpo_loss", "--rounds", "1"]) == 0
    import pandas as pd

    rows = pd.read_csv(out)
    assert calls == [("kto_loss",), ("fused_linear_dpo_loss", "fused_linear_cpo_loss")] and len(rows) == 6
    assert set(ab.ratios(rows).index.get_level_values(0)) == {"kto_loss", "fused_linear_dpo_loss", "fused_linear_cpo_loss"}
    assert ab.main([str(out), "--losses", "kto_loss", "--rounds", "1", "--arms", "grad,no_grad"]) == 0
    with pytest.raises(SystemExit):
        ab.main([str(out), "--losses", "jsd"])
    with pytest.raises(SystemExit):
        ab.main([str(out), "--losses", "kto_loss", "--arms", "both"])


def test_a_reference_pass_takes_the_epilogue_gemm_without_chunks(route):
    """DPO's reference model (no gradient) through the no-gradient epilogue: one call over its valid rows, the
    loss and gradients as the two-pass route's, the reference log-probs equal to the reference's own."""
    x, w, b, target, ref = dpo.make_inputs(n=3)
    with_route = fused_linear_dpo_outputs(x, w, b, target, ref)
    valid = int((target != -100).sum())  # the reference's valid rows of its 2n·T (skip_ignored), H_ref = 24, at once
    assert 0 < valid < 6 * 7 and [tuple(shape) for shape in NO_GRAD_CALLS] == [(valid, 24)]
    _library_route()
    without = fused_linear_dpo_outputs(x, w, b, target, ref)
    for a, b_ in zip(with_route, without):
        assert torch.allclose(a, b_, rtol=2e-5, atol=1e-6), (a, b_)


def fused_linear_dpo_outputs(x, w, b, target, ref):
    from kernels_lib.fused_linear_dpo import fused_linear_dpo

    out = fused_linear_dpo(x, w, target, b, **ref, chunk_size=14)
    grads = torch.autograd.grad(out.loss, [t for t in (x, w, b) if t is not None])
    return [out.loss.detach(), out.chosen_rewards, out.rejected_rewards, *grads]


def test_no_grad_log_probs_through_the_epilogue(route):
    """The sequence sums without a gradient (the study's ``sequence_logprobs``): equal to the library's two
    passes', token log-probs included, ignored rows 0, a logit scale applied."""
    gen = torch.Generator().manual_seed(5)
    device = kernels_lib.default_device()
    x = torch.randn(3 * 5, 24, generator=gen).to(device)
    w = (torch.randn(263, 24, generator=gen) * 0.3).to(device)
    target = torch.randint(0, 263, (15,), generator=gen).to(device)
    target[[0, 7]] = -100
    outs = []
    for sequence_logprobs in (seq.sequence_logprobs, LIBRARY_SEQUENCE_LOGPROBS):
        token = torch.full((15,), float("nan"), device=device)
        sums, sums2, grads = sequence_logprobs(x, w, None, target, seq_len=5, rows_per_chunk=5, ignore_index=-100,
                                                   logit_scale=0.7, token_logps=token)
        assert sums2 is None and grads is None
        outs.append((sums, token))
    assert len(NO_GRAD_CALLS) == 1
    assert torch.allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5) and (outs[0][1][[0, 7]] == 0).all()


@pytest.mark.parametrize("parts", [("grad",), ("no_grad",)], ids=lambda p: "+".join(p))
def test_an_arm_of_one_half_takes_the_route_for_that_half_only(monkeypatch, parts):
    """``parts=("grad",)``: the gradient chunks take the stored exponentials and the reference model's pass the
    two passes; ``("no_grad",)`` the other way round. Either way the loss and gradients are the library's."""
    taken = _take_route(monkeypatch, parts)
    x, w, b, target, ref = dpo.make_inputs(n=3)
    half = fused_linear_dpo_outputs(x, w, b, target, ref)
    assert (any(taken), bool(NO_GRAD_CALLS)) == ("grad" in parts, "no_grad" in parts), \
        f"parts {parts}: gradient chunks through the exponentials {taken}, no-gradient epilogue calls {NO_GRAD_CALLS}"
    _library_route()
    without = fused_linear_dpo_outputs(x, w, b, target, ref)
    for a, b_ in zip(half, without):
        assert torch.allclose(a, b_, rtol=2e-5, atol=1e-6), (parts, a, b_)


@pytest.mark.parametrize("parts", [(), ("grad", "dx")])
def test_an_arm_names_the_parts_it_refuses(parts):
    with pytest.raises(ValueError, match="parts must be a non-empty subset"):
        seq.arm(parts=parts)


def test_the_ab_measures_each_half_of_the_route_beside_the_library(capsys):
    """``arms=("grad", "no_grad")``: both halves in every round beside the library, each over it in ``ratios``."""
    from studies.bench import sequence_exponentials_ab as ab

    table = ab.sequence_exponentials_ab(("kto_loss",), size="small", rounds=1, device=kernels_lib.default_device(),
                                        x_values=(2,), arms=("grad", "no_grad"))
    speed = table[table.metric_name == "speed"]
    expected = {"kernels_lib", ab.ARMS["grad"][0], ab.ARMS["no_grad"][0]} | ({ab.FLOOR} if CUDA else set())
    assert set(speed.kernel_provider) == expected, set(speed.kernel_provider)
    ratios = ab.ratios(table)
    assert ratios["grad only / off"].notna().all() and ratios["no_grad only / off"].notna().all(), ratios
    assert ratios["on ms"].isna().all(), "the whole route was not measured, yet a time was given for it"
    out = capsys.readouterr().out
    assert out.index("route off") < out.index("route grad") < out.index("route no_grad"), out
    with pytest.raises(ValueError, match="arms must be among"):
        ab.sequence_exponentials_ab(("kto_loss",), size="small", arms=("both",))
    test_the_library_calls_its_own_two_passes()  # restored
