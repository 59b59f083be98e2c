r"""What notebook 06 (DPO, CPO, SimPO, GRPO) computes beyond the bench: the float64 check of the derived gradients
(the notebook's naive losses and weights against autograd and the baseline), the check of every GRPO loss type of
TRL 1.16 against float64, and the fixed-grid sweep a non-interactive run draws. For notebooks 03 (ORPO) and 04 (KTO):
their GPU runs split by sequence length (one configuration per comparison), the clauses said of those comparisons (the
floor multiples per GPU, the points a provider could not run), and the per-run table of their appendices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pandas as pd
import torch

from kernels_lib import reference
from . import data
from .bench.analysis import medians
from .check import relative_error
from .comparison import comparison, floor_ms, run_rates
from .narrative import floor_multiples, name

#: The derivation's shapes (B, T, H, V): an ignored token in each, GRPO off-policy so that some tokens are clipped.
DERIVATION_SHAPES = [(2, 3, 5, 11), (4, 6, 8, 29), (6, 4, 7, 50)]


def derivation_check(paired: Callable, grpo: Callable, token_logps: Callable, derived_grads: Callable,
                     seed: int = 0) -> tuple[pd.DataFrame, int]:
    """The notebook's naive losses (``paired(kind, x, W, b, y, ref_sums)`` for DPO, CPO, SimPO;
    ``grpo(level, x, W, b, y, advantages, old, ref)``), each returning ``(loss, per-token weights)``, against the
    baseline (:mod:`kernels_lib.reference`), and ``derived_grads(x, W, b, y, w)`` against autograd, in float64 at
    :data:`DERIVATION_SHAPES`. Returns the table and how many tokens the last case clipped at the token level;
    raises naming the worst case when an error exceeds 1e-12."""
    generator = torch.Generator().manual_seed(seed)
    rows, clipped = [], 0
    for B, T, H, V in DERIVATION_SHAPES:
        x = torch.randn(B, T, H, generator=generator, dtype=torch.float64, requires_grad=True)
        w = torch.randn(V, H, generator=generator, dtype=torch.float64, requires_grad=True)
        b = torch.randn(V, generator=generator, dtype=torch.float64, requires_grad=True)
        y = torch.randint(0, V, (B, T), generator=generator)
        y[0, -1] = -100  # an ignored token
        valid = y != -100
        ref_sums = torch.randn(B, generator=generator, dtype=torch.float64) - 3 * T
        advantages = torch.randn(B, generator=generator, dtype=torch.float64)
        ref_tok = (torch.randn(B, T, generator=generator, dtype=torch.float64) - 3) * valid
        with torch.no_grad():
            old = (token_logps(x, w, b, y)[0] + 0.3 * torch.randn(B, T, generator=generator, dtype=torch.float64)) * valid
        cases = {
            "DPO": (lambda: paired("DPO", x, w, b, y, ref_sums), lambda: reference.fused_linear_dpo(x, w, y, b, ref_logps=ref_sums).loss),
            "CPO": (lambda: paired("CPO", x, w, b, y, None), lambda: reference.fused_linear_cpo(x, w, y, b).loss),
            "SimPO": (lambda: paired("SimPO", x, w, b, y, None), lambda: reference.fused_linear_simpo(x, w, y, b).loss),
            **{f"GRPO ({level})": ((lambda level=level: grpo(level, x, w, b, y, advantages, old, ref_tok)),
                                   (lambda level=level: reference.fused_linear_grpo(
                                       x, w, y, b, advantages=advantages, old_logps=old, ref_logps=ref_tok, beta=0.1,
                                       loss_type="bnpo", importance_sampling_level=level).loss))
               for level in ("token", "sequence")},
        }
        for name, (naive, baseline) in cases.items():
            loss, weights = naive()
            auto = torch.autograd.grad(loss, (x, w, b))
            derived = derived_grads(x.detach(), w.detach(), b.detach(), y, weights)
            rows.append({"loss": name, "B, T, H, V": f"{B}, {T}, {H}, {V}",
                         "naive vs reference (loss)": relative_error(loss, baseline()),
                         **{f"derived vs autograd ({n})": relative_error(d, a) for n, d, a in zip(("dx", "dW", "db"), derived, auto)}})
        with torch.no_grad():
            rho = (token_logps(x, w, b, y)[0] - old).exp()
        a = advantages[:, None]
        clipped = int(((((a > 0) & (rho > 1.2)) | ((a < 0) & (rho < 0.8))) & valid).sum())
    table = pd.DataFrame(rows)
    errors = table.filter(like=" vs ")
    if not (errors < 1e-12).all().all():
        raise AssertionError(f"derivation check failed: {table.loc[errors.max(axis=1).idxmax()].to_dict()}")
    return table, clipped


def grpo_family_check(device, seed: int = 0) -> pd.DataFrame:
    """Every loss type of TRL 1.16 (:data:`kernels_workbench.bench.fused_linear_grpo.LOSS_TYPES`) through
    ``kernels_lib.fused_linear_grpo`` against the float64 reference at one small shape (padding, old, reference and
    sampler log-probs with TRL's ``token_mask`` correction, ``delta`` for the clipped types, ``return_per_token``):
    the loss, its error and the gradients', the share of active tokens whose ratio was clipped, the largest ratio."""
    import kernels_lib
    from kernels_lib.fused_linear_grpo import CLIPPED

    from .bench.fused_linear_grpo import LOSS_TYPES

    gen = torch.Generator().manual_seed(seed)
    B, T, H, V = 4, 7, 24, 1031
    gx, gw = torch.randn(B, T, H, generator=gen), torch.randn(V, H, generator=gen) * H**-0.5 * 2
    gy = torch.randint(0, V, (B, T), generator=gen)
    gy[1, -3:] = -100  # padding
    with torch.no_grad():
        near = reference.fused_linear_grpo(gx.double(), gw.double(), gy, advantages=torch.zeros(B)).per_token_logps.float()
    inputs = dict(advantages=torch.randn(B, generator=gen), old_logps=near + 0.3 * torch.randn(B, T, generator=gen),
                  ref_logps=near + 0.5 * torch.randn(B, T, generator=gen), sampler_logps=near + 0.2 * torch.randn(B, T, generator=gen))
    active, family = gy != -100, []
    for loss_type, what in LOSS_TYPES.items():
        options = dict(loss_type=loss_type, beta=0.05, max_completion_length=T, return_per_token=True,
                       vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=2.0,
                       delta=1.6 if loss_type in CLIPPED else None, epsilon_high=5.0 if loss_type == "cispo" else 0.28)
        x_, w_ = (t.detach().clone().to(device).requires_grad_() for t in (gx, gw))
        out = kernels_lib.fused_linear_grpo(x_, w_, gy.to(device), **{k: t.to(device) for k, t in inputs.items()}, **options)
        out.loss.backward()
        x64, w64 = (t.detach().double().requires_grad_() for t in (gx, gw))
        want = reference.fused_linear_grpo(x64, w64, gy, **{k: t.double() for k, t in inputs.items()}, **options)
        want.loss.backward()
        flags = out.per_token.is_region_clipped if out.per_token.is_region_clipped is not None else out.per_token.is_high_clipped
        family.append({"loss_type": loss_type, "what it is": what, "loss": out.loss.item(),
                       "loss err": relative_error(out.loss, want.loss), "dx err": relative_error(x_.grad, x64.grad),
                       "dW err": relative_error(w_.grad, w64.grad),
                       "clipped share": float("nan") if flags is None else (flags.cpu() & active).sum().item() / active.sum().item(),
                       "max ratio": out.per_token.importance_ratio.max().item()})
    return pd.DataFrame(family)


def fixed_grid_sweeps(losses: dict, presets: dict, size: str, device) -> dict[str, pd.DataFrame]:
    """The sweep a non-interactive run draws, per loss of ``losses`` (name → label): its preset's grid, ``forward``
    and ``full`` at full size; on a CPU ``full`` alone at the grid's first two points (the interpreter is slow)."""
    from .bench import run_sweep

    sweeps = {}
    for name in losses:
        preset = presets[name]
        x_values = preset["x_values"] if size == "full" else preset["x_values"][:2]
        modes = ["forward", "full"] if size == "full" else ["full"]
        sweeps[name] = run_sweep(name, x_name=preset["x_name"], x_values=x_values, sizes=preset["sizes"],
                                 dtype=preset["dtype"], device=device, modes=modes)
    return sweeps


# Notebooks 03 (ORPO) and 04 (KTO): their GPU runs split by one entry of the workload's configuration (the sequence
# length T), compared per GPU (:mod:`.comparison`), and the sentences said of those comparisons.


def config_entry(rows: pd.DataFrame, key: str) -> pd.Series:
    """Per row, the entry ``key`` of its ``extra_benchmark_config_str`` (JSON); None where the row has none."""
    return rows.extra_benchmark_config_str.map(lambda text: json.loads(text).get(key) if isinstance(text, str) else None)


def by_config(rows: pd.DataFrame, key: str = "T") -> dict:
    """The CUDA rows of ``rows`` split by the value of their configuration entry ``key`` (ascending): ``{value: rows}``,
    so that the newest run of each GPU taken in each part (:func:`.data.newest_run_per_gpu`) holds one configuration
    (one chart) and every ratio taken in it is within one commit on one GPU."""
    rows = data.cuda_rows(rows)
    if not len(rows):
        return {}
    values = config_entry(rows, key)
    return {value: rows[values == value].reset_index(drop=True) for value in sorted(set(values.dropna().tolist()))}


def ceilings_note(run: pd.DataFrame, ceilings: pd.DataFrame) -> str:
    """The ceilings the run measured, which set its floor: ``matmul 690 TFLOP/s and copy 3042 GB/s measured in the
    same run``, or that it measured none (:func:`.comparison.run_rates`)."""
    rates = run_rates(run, ceilings)
    said = [f"{kind} {rates[kind]:.0f} {unit}" for kind, unit in (("matmul", "TFLOP/s"), ("copy", "GB/s")) if kind in rates]
    return " and ".join(said) + " measured in the same run" if said else "no ceilings measured in this run: no floor"


def not_measured(run: pd.DataFrame, mode: str = "full") -> list[str]:
    """Per provider of the run whose ``mode`` time is recorded without a figure (a failed point: the row's note
    says why), one clause: ``the baseline's `full` did not fit in memory at B = 16``."""
    speed = run[(run.metric_name == "speed") & (run.kernel_operation_mode == mode) & run.y_value_50.isna()]
    axis = str(run.x_name.iloc[0]) if "x_name" in run and len(run) else "x"
    clauses = []
    for provider, rows in speed.groupby("kernel_provider", sort=False):
        notes = rows.note.astype(object).fillna("").astype(str) if "note" in rows else pd.Series("", index=rows.index)
        xs = ", ".join(str(int(x)) for x in sorted(rows.x_value))
        memory = notes.str.contains("OutOfMemoryError|out of memory", case=False).all()
        why = "did not fit in memory" if memory else "failed (" + (notes.iloc[0].split(":")[0] or "no reason recorded") + ")"
        clauses.append(f"{name(provider)}'s `{mode}` {why} at {axis} = {xs}")
    return clauses


def floor_multiples_by_gpu(runs: dict, ceilings: pd.DataFrame, x, providers=("kernels_lib", "liger")) -> str:
    """One bullet per GPU (``runs``: GPU → its run): each provider's ``full`` time at ``x`` as a multiple of the floor
    of the same run (:func:`.comparison.floor_ms`), :func:`.narrative.floor_multiples`."""
    if not runs:
        return "Not measured on a GPU yet: nothing to set against the floor."
    lines = []
    for gpu, run in runs.items():
        full, floor = medians(run, "speed", "full"), floor_ms(run, ceilings).get(x, math.nan)
        times = {p: float(full.at[x, p]) if p in full and x in full.index else math.nan for p in providers}
        axis, label = str(run.x_name.iloc[0]) if "x_name" in run else "x", data.gpu_label(gpu)
        if x not in full.index:
            lines.append(f"- On the {label}: {axis} = {x} not measured in its newest run.")
        elif not math.isfinite(floor):
            lines.append(f"- On the {label}: no floor at {axis} = {x}, its newest run measured no ceilings.")
        else:
            lines.append("- " + floor_multiples(times, float(floor), at=f"{axis} = {x} on the {label}"))
    return "\n".join(lines)


def floor_share(run: pd.DataFrame, ceilings: pd.DataFrame, x) -> str:
    """The floor of the run at ``x`` as a share of the fastest ``full`` time measured there (which provider, how
    long): how far the arithmetic alone is from what any provider reaches."""
    full, floor = medians(run, "speed", "full"), float(floor_ms(run, ceilings).get(x, math.nan))
    axis, label = str(run.x_name.iloc[0]) if "x_name" in run else "x", data.gpu_label(str(run.gpu_name.iloc[0]))
    fastest = full.loc[x].dropna() if x in full.index else pd.Series(dtype=float)
    if not len(fastest) or not math.isfinite(floor):
        return f"On the {label} at {axis} = {x}: no floor or no time measured, no share to state."
    who = str(fastest.idxmin())
    return (f"On the {label} at {axis} = {x}, the floor is {floor:.1f} ms, {floor / fastest[who]:.0%} of the fastest `full` "
            f"measured there ({name(who)}, {fastest[who]:.1f} ms).")


def per_run_table(rows: pd.DataFrame, ceilings: pd.DataFrame, x, key: str = "T") -> pd.DataFrame:
    """Every CUDA run of ``rows`` (per value of the configuration entry ``key``), its :func:`.comparison.comparison`
    at ``x``: kernels_lib's time, the fastest peer and the time over its, over the floor of the run's own ceilings,
    and the memory over the leanest peer's. One row per run and ``key``, by GPU, oldest run first; a run that did
    not measure ``x`` is left out."""
    out = []
    for value, part in by_config(rows, key).items():
        for commit, gpu in data.runs(part):
            run = data.one_run(part, commit, gpu)
            table = comparison(run, ceilings)
            if x in table.index:
                row = table.loc[x]
                out.append({"GPU": data.gpu_label(gpu), key: value, "run": data.run_label(run), "kernels_lib ms": row["kernels_lib ms"],
                            **{c: row[c] for c in ("fastest peer", "× fastest peer", "× floor", "memory × leanest")}})
    table = pd.DataFrame(out, columns=["GPU", key, "run", "kernels_lib ms", "fastest peer", "× fastest peer", "× floor",
                                       "memory × leanest"])
    return table.sort_values(["GPU", key], kind="stable").reset_index(drop=True)
