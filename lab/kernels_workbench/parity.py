r"""Log-prob parity with a sampler: kernels_lib's per-token log-probs against a rollout engine's.

An RL trainer scores the sampled tokens with its own head (here :func:`kernels_lib.fused_linear_token_logprobs`,
the logits never materialized) while the rollout engine that sampled them computed
:math:`\log\operatorname{softmax}(z/T)_y` from logits it did materialize, in the model's dtype. The two
differ by rounding alone, and that difference is what enters the importance ratio
:math:`e^{\ell^\text{trainer} - \ell^\text{sampler}}` of an off-policy correction (TRL's
``vllm_importance_sampling_correction``): a ratio of :math:`e^{\Delta}` per token where the policies
are equal. This module measures it, per dtype and temperature, on a given head:

.. math::

    \Delta_i = \ell^{\text{kernels\_lib}}_i - \ell^{\text{engine}}_i, \qquad
    \ell^{\text{engine}}_i = \log\operatorname{softmax}\big(\operatorname{fl}_d(x_i W^\top + b) / T\big)_{y_i},

where :math:`\operatorname{fl}_d` is the logits as the engine holds them: the matmul in dtype
:math:`d` (float32 or bfloat16) with the result stored in :math:`d`, then ``torch.log_softmax`` of
those values upcast to float32 (a sampler's softmax runs in float32 on the stored logits).
kernels_lib sees the same ``x``, ``W``, ``b`` rounded to :math:`d`. The tokens :math:`y_i` are
sampled from the engine's distribution at :math:`T` (what a rollout would score), with a fixed
generator. Both are also compared with the float64 log-prob of the same rounded inputs, so the
table says which side the difference comes from.

Sizes: a ``N × V`` float64 logits tensor for the truth (``N = 4096``, ``V = 151936``: 5 GB) and
one of the engine's dtype: for the GPU at the real vocabularies, small ones on a CPU.
"""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
import torch
import torch.nn.functional as F

from kernels_lib.fused_linear_token_logprobs import fused_linear_token_logprobs
from . import charts

#: The vocabularies users compare at: Llama-3's and Qwen2.5's tokenizers.
VOCABULARIES = {"Llama-3": 128256, "Qwen2.5": 151936}
DTYPES = (torch.float32, torch.bfloat16)
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


def _quantile(values: torch.Tensor, q: float) -> float:
    """``torch.quantile`` (linear interpolation) in float64, on the host (it refuses over 2**24 values)."""
    return torch.quantile(values.detach().double().cpu(), q).item()


def engine_logprobs(x, weight, bias, target, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """A rollout engine's log-probs of ``target``: logits materialized in ``dtype``, then
    ``torch.log_softmax(logits.float() / temperature)``; float32, ``target``'s shape."""
    logits = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)


def _sampled(x, weight, bias, temperature, dtype, generator) -> torch.Tensor:
    """One token per row from the engine's distribution at ``temperature``."""
    logits = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).float()
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator).squeeze(-1)


def logprob_differences(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperatures=(1.0,),
    dtypes=DTYPES,
    seed: int = 0,
    chunk_size: int | None = None,
) -> dict:
    """Per ``(dtype, temperature)``: a dict of float64 tensors (``N`` tokens each) ``delta`` (kernels_lib
    minus the engine), ``kernels_lib_error`` and ``engine_error`` (each minus the float64 log-prob of the
    same rounded inputs), for tokens sampled from the engine at that temperature.

    ``x`` ``(N, H)`` and ``weight`` ``(V, H)`` (and ``bias``) are floating tensors on one device; they
    are rounded to each dtype in ``dtypes`` (float32, bfloat16 or float16).
    """
    if not (torch.is_tensor(x) and x.dim() == 2 and x.is_floating_point()):
        raise ValueError(f"x must be a floating (N, H) tensor; got {type(x).__name__} {getattr(x, 'shape', '')}")
    if not (torch.is_tensor(weight) and weight.dim() == 2 and weight.shape[1] == x.shape[1]):
        raise ValueError(f"weight must be a (V, H) tensor with H = {x.shape[1]}; got {getattr(weight, 'shape', weight)}")
    bad = [d for d in dtypes if d not in (torch.float32, torch.bfloat16, torch.float16)]
    if bad or not dtypes:
        raise ValueError(f"dtypes must be a non-empty sequence of torch.float32, torch.bfloat16, torch.float16; got {dtypes}")
    bad_t = [t for t in temperatures if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0]
    if bad_t or not temperatures:
        raise ValueError(f"temperatures must be a non-empty sequence of numbers > 0; got {temperatures}")
    out = {}
    for dtype in dtypes:
        xs, ws = x.detach().to(dtype), weight.detach().to(dtype)
        bs = None if bias is None else bias.detach().to(dtype)
        for temperature in temperatures:
            generator = torch.Generator(device=x.device).manual_seed(seed)
            with torch.no_grad():
                target = _sampled(xs, ws, bs, temperature, dtype, generator)
                ours = fused_linear_token_logprobs(xs, ws, target, bs, temperature=float(temperature),
                                                   chunk_size=chunk_size).logps.double()
                engine = engine_logprobs(xs, ws, bs, target, temperature, dtype).double()
                truth = torch.log_softmax(F.linear(xs.double(), ws.double(), None if bs is None else bs.double())
                                          / temperature, dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
            out[(dtype, float(temperature))] = {
                "delta": ours - engine, "kernels_lib_error": ours - truth, "engine_error": engine - truth,
            }
    return out


def summarize(differences: dict, vocabulary: str = "") -> pd.DataFrame:
    """One row per ``(dtype, temperature)`` of :func:`logprob_differences`: ``|Δ|`` at p50, p90, p99 and
    its max, the mean (signed) ``Δ``, the tokens, and the max error of each side against float64."""
    rows = []
    for (dtype, temperature), diff in differences.items():
        delta = diff["delta"]
        size = delta.abs()
        rows.append({
            "vocabulary": vocabulary, "dtype": str(dtype).replace("torch.", ""), "temperature": temperature,
            "tokens": delta.numel(),
            **{f"|Δ| {name}": _quantile(size, q) for name, q in QUANTILES.items()},
            "|Δ| max": size.max().item(), "mean Δ": delta.mean().item(),
            "kernels_lib max err": diff["kernels_lib_error"].abs().max().item(),
            "engine max err": diff["engine_error"].abs().max().item(),
        })
    return pd.DataFrame(rows)


def random_head(n_tokens: int, hidden: int, vocab: int, device, *, logit_std: float = 3.0, seed: int = 0):
    """Hidden states ``N(0, 1)`` ``(n_tokens, hidden)`` and a head ``N(0, logit_std²/hidden)`` ``(vocab,
    hidden)`` in float32: logits of standard deviation ``logit_std``, the scale of an LM head's."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n_tokens, hidden, generator=generator, device=device)
    weight = torch.randn(vocab, hidden, generator=generator, device=device) * (logit_std / math.sqrt(hidden))
    return x, weight


def parity_table(vocabularies: dict, n_tokens: int, hidden: int, device, *, temperatures=(1.0,), dtypes=DTYPES,
                 logit_std: float = 3.0, seed: int = 0) -> tuple[pd.DataFrame, dict]:
    """:func:`summarize` over ``vocabularies`` (name -> V), each on a :func:`random_head`; returns the
    table and the differences by ``(name, dtype, temperature)`` (for :func:`parity_chart`)."""
    tables, all_differences = [], {}
    for name, vocab in vocabularies.items():
        x, weight = random_head(n_tokens, hidden, vocab, device, logit_std=logit_std, seed=seed)
        differences = logprob_differences(x, weight, temperatures=temperatures, dtypes=dtypes, seed=seed)
        tables.append(summarize(differences, f"{name} (V = {vocab})"))
        all_differences |= {(name, *key): diff for key, diff in differences.items()}
        del x, weight
    return pd.concat(tables, ignore_index=True), all_differences


#: A colour per dtype in :func:`parity_chart` (from the figures' spare colours).
DTYPE_COLORS = {"float32": charts.SPARE_COLORS[5], "bfloat16": charts.SPARE_COLORS[6], "float16": charts.SPARE_COLORS[7]}

#: The probability levels of :func:`parity_chart`'s x axis (1 is the max).
CHART_LEVELS = (0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)


def parity_chart(differences: dict, title: str = "Log-prob parity with a sampler") -> go.Figure:
    """Quantiles of ``|Δ|`` (log scale) against the level, one line per vocabulary, dtype and temperature
    (a colour per dtype, :data:`DTYPE_COLORS`: the lines are one comparison, not providers; dashes by
    vocabulary, markers by temperature)."""
    figure = go.Figure()
    names = list(dict.fromkeys(key[0] for key in differences))
    temperatures = list(dict.fromkeys(key[2] for key in differences))
    colors = DTYPE_COLORS
    for (name, dtype, temperature), diff in differences.items():
        size = diff["delta"].abs().double().cpu()
        dtype_name = str(dtype).replace("torch.", "")
        # |Δ| = 0 (both sides bit-identical) cannot sit on a log axis: drawn at 1e-12
        values = [max(_quantile(size, q) if q < 1 else size.max().item(), 1e-12) for q in CHART_LEVELS]
        figure.add_trace(go.Scatter(
            x=[f"p{100 * q:g}" if q < 1 else "max" for q in CHART_LEVELS], y=values, mode="lines+markers",
            # not "provider · series": the lines are one comparison (the browser test reads " · " as a provider's)
            name=f"{dtype_name} logits, {name}, T = {temperature:g}",
            line={"color": colors.get(dtype_name, "#7f7f7f"), "dash": ["solid", "dash", "dot"][names.index(name) % 3]},
            marker={"symbol": ["circle", "square", "diamond", "triangle-up"][temperatures.index(temperature) % 4]},
        ))
    figure.update_layout(**charts.wrapped_title(title), xaxis_title="quantile of |Δ| over the sampled tokens",
                         yaxis_title="|log p (kernels_lib) − log p (engine)|", yaxis_type="log", height=480)
    return figure
