r"""What notebook 06 (DPO, CPO, SimPO, GRPO) computes beyond the bench: the float64 check of the derived gradients
(the notebook's naive losses and weights against autograd and the baseline), the check of every GRPO loss type of
TRL 1.16 against float64, and the fixed-grid sweep a non-interactive run draws.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch

from .. import reference
from .check import relative_error
from .narrative import span

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
    """Every loss type of TRL 1.16 (:data:`kernels_lib.workbench.bench.fused_linear_grpo.LOSS_TYPES`) through
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


def headline(losses: dict, names: dict | None = None) -> str:
    """One sentence per GPU: kernels_lib's ``full`` time (and memory) as multiples of Liger's, the baseline's and
    TRL's fused head's, over the losses (``losses``: kernel name → label) and batch sizes of the newest run of
    each loss on that GPU; "not measured" for a peer no run measured."""
    from . import data
    from .bench import get_spec
    from .bench.analysis import preference_targets

    per_gpu: dict[str, list[pd.DataFrame]] = {}
    for name in losses:
        for gpu, run in data.newest_run_per_gpu(data.load_measured(name, latest=False)).items():
            per_gpu.setdefault(gpu, []).append(preference_targets(run, {}, baseline=get_spec(name).baseline)
                                               .rename(columns=lambda c: c.replace(f"/ {get_spec(name).baseline}", "/ baseline")))
    if not per_gpu:
        return "Not measured on a GPU yet: the published rows alone are drawn below."

    sentences = []
    for gpu, tables in per_gpu.items():
        table = pd.concat(tables)
        said = [f"{span(table[column])} {who}" for column, who in
                (("full / Liger", "Liger's time"), ("full / baseline", "the baseline's"), ("full / TRL head", "TRL's fused head's"))
                if column in table]
        sentences.append(f"On the {data.gpu_label(gpu)}, kernels_lib's `full` takes " + ", ".join(said)
                         + f" at {span(table['memory / Liger'])} Liger's memory, over {len(tables)} losses and B = "
                         + f"{int(table.index.min())}–{int(table.index.max())} (the newest run of each loss).")
    return " ".join(sentences)
