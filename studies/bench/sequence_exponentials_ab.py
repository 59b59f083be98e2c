"""The A/B of the sequence losses' stored-exponentials route against their two passes, beside the floor.

The route (:mod:`studies.routes.sequence_exponentials`, not the library's) takes each chunk's log-probs
from the fused cross-entropy's epilogue GEMM and puts the weights on the row factors of ``x`` and
``dx``, so no pass reads the ``chunk × V`` buffer between the matmuls. The study's target is 1.05× the
matmul floor for every fused loss; DPO, GRPO, CPO and SimPO were at 1.06–1.25× through the two passes.

For each loss (``fused_linear_dpo_loss``, ``fused_linear_orpo_loss``, ``fused_linear_cpo_loss``, ``fused_linear_simpo_loss``,
``fused_linear_grpo_loss_token``, ``fused_linear_grpo_loss_sequence``, ``kto_loss``) at its published
sizes, ``full`` (forward and backward) of kernels_lib with the route off (``kernels_lib``) and on
(:data:`ARM`), in ``rounds`` alternating rounds (the arms' order reversed every other round: the GPU
drifts over a run), speed and memory, each row the median over the rounds; the loss's matmuls alone
at its shapes (:data:`FLOOR`, :func:`matmuls_alone`: the floor measured in each round, on a GPU) as a
provider of its own; the floor from the matmul rate of a short 8192³ product measured in the same run
(:func:`kernels_workbench.floor.floor_at`, the workbench's one floor), as ``floor_ms`` beside every row; and the two arms' loss and gradients at the smallest B against each
other (``rel_diff``: ‖on − off‖ / ‖off‖ over the loss and every gradient, the largest).

``--arms grad,no_grad`` measures each half of the route beside the library instead (the gradient chunks
through the stored exponentials, or the pass without a gradient through the epilogue GEMM): which half a
difference comes from. On a GPU (the seven losses took about 5 minutes on an H100 at ``--rounds 2``;
``--losses`` splits it over calls):

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=/tmp/site:$PWD python3 -m studies.bench.sequence_exponentials_ab \\
        $OUT/gpu_runs/sequence_exponentials_ab.csv

``--size small`` runs it at the CPU presets (Triton's interpreter, which takes the route only when
:data:`kernels_lib.fused_linear_cross_entropy.EPILOGUE_GEMM_WHEN_INTERPRETED` asks: this module asks).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from pathlib import Path

import pandas as pd
import torch

from kernels_workbench import data
from kernels_workbench import floor as one_floor
from studies.bench.arms import constants_set
from studies.routes import sequence_exponentials
from kernels_workbench.bench.ceilings import measure_ceilings
from kernels_workbench.bench import get_spec
from kernels_workbench.bench.sweep import available_providers, median_of_rounds, run_sweep
from kernels_workbench.bench.timing import _loss, time_callable

#: The losses on the sequence log-prob pipeline whose published workload has no second target.
LOSSES = ("fused_linear_dpo_loss", "fused_linear_orpo_loss", "fused_linear_cpo_loss", "fused_linear_simpo_loss", "fused_linear_grpo_loss_token",
          "fused_linear_grpo_loss_sequence", "kto_loss")
#: The route's arm, as its rows name the provider.
ARM = "kernels_lib[store_exponentials=True]"
#: The arms ``--arms`` can add beside the library (``kernels_lib``): the whole route, or one of its halves
#: (:data:`studies.routes.sequence_exponentials.PARTS`: the gradient chunks, the pass without a gradient).
ARMS = {"on": (ARM, ("grad", "no_grad")), "grad": ("kernels_lib[store_exponentials=grad]", ("grad",)),
        "no_grad": ("kernels_lib[store_exponentials=no_grad]", ("no_grad",))}


def route(parts: tuple[str, ...]) -> contextlib.AbstractContextManager:
    """The route on for ``parts`` (the study's ``sequence_logprobs`` in every caller, the interpreter asked to
    take the epilogue GEMM too), or off with no parts (the library as it is), for the calls inside."""
    return constants_set(sequence_exponentials.arm(parts=parts) if parts else {})


def _loss_and_grads(kernel_name: str, point: dict, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The kernels_lib provider's loss and gradients at ``point``, on the spec's inputs (fixed seed)."""
    spec = get_spec(kernel_name)
    fn = available_providers(kernel_name, ["kernels_lib"])[0]["kernels_lib"]
    inputs = spec.make_inputs(point, dtype, device, spec.default_options)
    loss = _loss(fn(*inputs.args, **inputs.kwargs))
    grads = torch.autograd.grad(loss, inputs.grad_inputs)
    return [loss.detach().float(), *(g.float() for g in grads)]


#: The measured floor's provider name: the loss's matmuls alone at its shapes (:func:`matmuls_alone`).
FLOOR = "matmuls alone"
#: The gradient products of a published workload's ``full``: ``dx`` and ``dW``, but KTO's harness takes
#: the head's gradient alone (its spec's ``flops``: ``input_grad=False``).
GRADIENTS = {"kto_loss": ("dW",)}


def products(kernel_name: str, sizes: dict) -> int:
    """How many ``(B·T) × H × V`` products a ``full`` call of the loss makes (its spec's ``flops``):
    the reference model's logits where it has one, the policy's logits, ``dx`` and ``dW``."""
    flops = importlib.import_module(get_spec(kernel_name).make_inputs.__module__).flops
    rows, hidden, vocab = int(sizes["B"]) * int(sizes["T"]), int(sizes["H"]), int(sizes["V"])
    count = flops(sizes, "full") / (2.0 * rows * hidden * vocab)
    if abs(count - round(count)) > 1e-9:
        raise ValueError(f"{kernel_name}'s full FLOPs are {count} products of (B·T) × H × V, not a whole number: "
                         "its floor is not these matmuls")
    return round(count)


def matmuls_alone(kernel_name: str, sizes: dict, dtype: torch.dtype, device: torch.device):
    """The floor measured at the loss's own shapes, as the fused CE's ``three_matmuls``: with
    ``R = B·T`` rows, the logits ``x Wᵀ`` into an ``R × V`` buffer once per logits product of the loss
    (:func:`products` less its gradient products), then ``dx = G W`` (where :data:`GRADIENTS` has it) and
    ``dW = Gᵀ x`` from that buffer; cuBLAS on a GPU, the
    whole ``R`` at once, nothing else. Returns the callable to time."""
    rows, hidden, vocab = int(sizes["B"]) * int(sizes["T"]), int(sizes["H"]), int(sizes["V"])
    gradients = GRADIENTS.get(kernel_name, ("dx", "dW"))
    logits_products = products(kernel_name, sizes) - len(gradients)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen, device=device) * hidden**-0.5).to(dtype)
    buffer = torch.empty(rows, vocab, dtype=dtype, device=device)

    def run():
        for _ in range(logits_products):
            torch.matmul(x, w.t(), out=buffer)
        return (buffer @ w if "dx" in gradients else None), buffer.t() @ x

    return run


def arms_difference(kernel_name: str, point: dict, dtype: torch.dtype, device: torch.device) -> float:
    """The largest ‖on − off‖ / ‖off‖ over the loss and every gradient of the two arms at ``point``."""
    with route(()):
        off = _loss_and_grads(kernel_name, point, dtype, device)
    with route(ARMS["on"][1]):
        on = _loss_and_grads(kernel_name, point, dtype, device)
    return max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(on, off))


def sequence_exponentials_ab(losses=LOSSES, size: str = "published", rounds: int = 3,
                             device: torch.device | str | None = None, x_values=None, arms=("on",)) -> pd.DataFrame:
    """The A/B's rows (module docstring): the sweep's columns, ``floor_ms``, ``rel_diff``, ``rounds``.
    ``x_values``: the preset's sizes to measure (default all of them). ``arms``: keys of :data:`ARMS` measured
    beside the library, all in each round (``rel_diff`` is the whole route's, ``"on"``)."""
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        raise ValueError(f"arms must be among {', '.join(ARMS)}, got {', '.join(map(str, arms)) or 'none'}")
    order = [("off", "kernels_lib", ())] + [(key, *ARMS[key]) for key in arms]
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    ceilings = measure_ceilings(device)
    rates = dict(zip(ceilings.kernel_name, ceilings.y_value_50)) if len(ceilings) else {}  # "copy" GB/s, "matmul" TFLOP/s
    out = []
    for kernel_name in losses:
        spec = get_spec(kernel_name)
        preset = spec.published if size == "published" else spec.small
        preset = {**preset, "x_values": list(x_values or preset["x_values"])}
        per_round = []
        for round_ in range(rounds):
            for key, provider, parts in (order if round_ % 2 == 0 else order[::-1]):
                print(f"sequence_exponentials_ab: {kernel_name} round {round_ + 1} of {rounds}, route {key}", flush=True)
                with route(parts):
                    rows = run_sweep(kernel_name, x_name=preset["x_name"], x_values=preset["x_values"], sizes=preset["sizes"],
                                     dtype=preset["dtype"], device=device, providers=["kernels_lib"], modes=("full",))
                per_round.append(rows.assign(kernel_provider=provider, round=round_ + 1))
            arm_rows = per_round[-1]
            for x in preset["x_values"] if device.type == "cuda" else ():  # the floor in the same round (on a GPU:
                # the interpreter's time says nothing about it)
                timing = time_callable(matmuls_alone(kernel_name, {**preset["sizes"], preset["x_name"]: int(x)},
                                                     preset["dtype"], device), device)
                torch.cuda.empty_cache()
                per_round.append(arm_rows[arm_rows.x_value == x].head(1).assign(
                    kernel_provider=FLOOR, metric_name="speed", metric_unit="ms", y_value_50=timing.p50, y_value_20=timing.p20,
                    y_value_80=timing.p80, timer=timing.timer, round=round_ + 1))
        table = median_of_rounds(pd.concat(per_round, ignore_index=True))
        smallest = {**preset["sizes"], preset["x_name"]: int(min(preset["x_values"]))}
        table["rel_diff"] = arms_difference(kernel_name, smallest, preset["dtype"], device)
        table["floor_ms"] = [
            one_floor.floor_at(kernel_name, {**preset["sizes"], preset["x_name"]: int(x)}, preset["dtype"], "full",
                               rates)[0] if rates and metric == "speed" else float("nan")
            for x, metric in zip(table.x_value, table.metric_name)]
        table["rounds"] = rounds
        out.append(table)
    return pd.concat(out, ignore_index=True)


def ratios(rows: pd.DataFrame) -> pd.DataFrame:
    """Per loss and ``x`` of one A/B run: the ``full`` medians (ms) of the two arms and of the matmuls
    alone, ``off / floor``, ``on / floor`` (issue 30's target: ≤ 1.05), ``on / off`` (below 1: the route
    is faster), the short-matmul floor's ``floor_ms``, the memory of each arm (MB) and ``rel_diff``.
    Raises ValueError naming the runs when ``rows`` mix runs (:func:`kernels_workbench.data.run_label`)."""
    data.run_label(rows)
    speed = rows[rows.metric_name == "speed"].pivot_table(index=["kernel_name", "x_value"], columns="kernel_provider",
                                                         values="y_value_50")
    memory = rows[rows.metric_name == "memory"].pivot_table(index=["kernel_name", "x_value"], columns="kernel_provider",
                                                           values="y_value_50")
    out = pd.DataFrame({"off ms": speed["kernels_lib"], "on ms": speed[ARM] if ARM in speed else float("nan")})
    out["floor ms"] = speed[FLOOR] if FLOOR in speed else float("nan")
    out["off / floor"], out["on / floor"] = out["off ms"] / out["floor ms"], out["on ms"] / out["floor ms"]
    out["on / off"] = out["on ms"] / out["off ms"]
    out["short-matmul floor ms"] = rows[rows.metric_name == "speed"].groupby(["kernel_name", "x_value"]).floor_ms.first()
    for column, provider in (("off MB", "kernels_lib"), ("on MB", ARM)):  # NaN where a run measured no memory
        out[column] = memory[provider] if provider in memory else float("nan")
    out["rel_diff"] = rows.groupby(["kernel_name", "x_value"]).rel_diff.first()
    for key in ("grad", "no_grad"):  # an arm of one half of the route, where the run measured it
        if ARMS[key][0] in speed:
            out[f"{key} only / off"] = speed[ARMS[key][0]] / out["off ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the CSV to append to (its header once)")
    parser.add_argument("--size", choices=("published", "small"), default="published")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--arms", default="on", help=f"comma-separated among {', '.join(ARMS)}: measured beside the library")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.losses.split(",")) - set(LOSSES))
    if unknown:
        parser.error(f"--losses takes {', '.join(LOSSES)}; got {', '.join(unknown)}")
    arms = args.arms.split(",")
    if sorted(set(arms) - set(ARMS)):
        parser.error(f"--arms takes {', '.join(ARMS)}; got {args.arms}")
    table = sequence_exponentials_ab(args.losses.split(","), size=args.size, rounds=args.rounds, arms=arms)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # appended: the losses measured over several calls (--losses) make one run of one commit
    table.to_csv(args.out, index=False, mode="a", header=not args.out.exists())
    print(ratios(table).round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
