"""Which causal LMs of the installed Transformers :func:`kernels_lib.hf.patch` matches, checked one by one.

For each class of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (one row per ``model_type``): the forward's pattern is read
(:func:`kernels_lib.hf.forward_pattern`; a departure is *refused*, naming the class and the reason); a tiny random
configuration is built (:func:`tiny_config`: hidden 32, 2 layers, vocabulary 128, 4 experts, the logit transforms
switched on with values that matter); and the patched model's loss and every parameter's gradient are compared
with the unpatched model's own, in float32 (on the CPU for ``kernel="torch"``, on the kernels' device for the kernel), the head's weights scaled so that the logits spread over
about ±20 (a missed softcap of 10 or a logit scale of 4 is then off by far more than the tolerance).
``kernel="torch"`` runs the patched forward with :func:`torch_linear_cross_entropy` in place of the kernel: the same
function of the same arguments in plain torch, so that the walk over some 200 classes checks what is per class (the
forward read, the head, the transforms and their values, the shift, the terms kept) at torch's speed on a CPU; the
kernel's agreement with that function is checked in ``tests/test_fused_linear_cross_entropy.py`` and, through
:func:`kernels_lib.hf.patch`, on a few classes with ``kernel="kernels_lib"`` (``tests/test_hf.py``).
Rows are kept in :data:`CACHE` (``data/hf_coverage.json``) under a fingerprint of everything they depend on
(:func:`fingerprint`: ``kernels_lib/hf.py``, the functions here that build, run and judge a class, the
Transformers and torch versions); a
walk with another fingerprint checks every class again (``python -m kernels_workbench.hf_coverage`` rewrites it).
Results: ``matched`` (within ``LOSS_TOL``/``GRAD_TOL``), ``differs`` (patched, but outside them: a failure),
``refused`` (:func:`patch` raises, naming the class), ``could not build`` (the tiny configuration or the unpatched
model fails: the reason is kept).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from contextlib import contextmanager

import torch
import torch.nn.functional as F

#: Relative tolerances, ``||a - b|| / ||b||``, of the loss and of every parameter's gradient (tests/test_hf.py's).
LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
#: Liger-Kernel's hand-patched model families (``liger_kernel.transformers.monkey_patch``), the anchor the table is read against.
LIGER_FAMILIES = 45
LOGIT_SPREAD = 20.0  # the logits' standard deviation the head is scaled to (about)
BATCH, SEQUENCE = 2, 8

#: Sizes and options set on a configuration (and its text sub-configuration) where it has the attribute.
SMALL = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
    "n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 64, "n_positions": 128, "n_ctx": 128, "d_model": 32,
    "decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 64, "encoder_layers": 2,
    "encoder_attention_heads": 4, "encoder_ffn_dim": 64, "num_layers": 2, "num_heads": 4, "ffn_dim": 64,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "rotary_dim": 8, "n_shared_experts": 1, "num_shared_experts": 1, "pad_token_id": 0, "is_decoder": True,
    "output_router_logits": True, "router_aux_loss_coef": 0.1, "aux_loss_coef": 0.1,
    "final_logit_softcapping": 10.0, "logits_soft_cap": 10.0, "logit_scale": 0.5, "logits_scaling": 4.0,
    "use_cache": False,
}
#: A tiny configuration whose model has more parameters than this is not built (a sub-configuration not shrunk).
MAX_PARAMETERS = 16_000_000


@dataclasses.dataclass
class Row:
    """One ``model_type`` of the mapping and what :func:`check` found."""

    model_type: str
    cls: str
    result: str  # "matched" | "differs" | "refused" | "could not build"
    reason: str = ""
    pattern: str = ""
    loss_rel_err: float = math.nan
    grad_rel_err: float = math.nan
    seconds: float = 0.0


def torch_linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, softcap=None, logit_scale=1.0,
                               temperature=1.0, num_items_in_batch=None, chunk_size=None, accurate=False,
                               host_checks=True, skip_ignored=True):
    """:func:`kernels_lib.fused_linear_cross_entropy` for the arguments :func:`kernels_lib.hf.patch` passes, in torch:
    ``c = softcap_s(a·(x Wᵀ + b)) / T``, cross-entropy against ``target``, the mean over valid rows or the sum over
    ``num_items_in_batch`` (float32 logits, formed whole over every row: dropping the ignored rows first, as the
    kernel does by default, changes no value)."""
    logits = F.linear(x, weight, bias).float() * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    if num_items_in_batch is None:
        return F.cross_entropy(logits, target, ignore_index=ignore_index)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum") / num_items_in_batch


@contextmanager
def counted_kernel(kernel: str = "kernels_lib"):
    """Within the block, :func:`kernels_lib.hf.patch`'s loss calls are counted (the list yielded gets one entry per
    call) and run the fused kernel (``"kernels_lib"``) or :func:`torch_linear_cross_entropy` (``"torch"``)."""
    from kernels_lib import hf

    if kernel not in ("kernels_lib", "torch"):
        raise ValueError(f"kernel must be 'kernels_lib' or 'torch'; got {kernel!r}")
    original = hf.fused_linear_cross_entropy
    function = original if kernel == "kernels_lib" else torch_linear_cross_entropy
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    hf.fused_linear_cross_entropy = counted
    try:
        yield calls
    finally:
        hf.fused_linear_cross_entropy = original


def causal_lm_mapping() -> dict[str, str]:
    """``model_type -> class name`` of the installed Transformers' ``AutoModelForCausalLM``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {key: (value if isinstance(value, str) else value[0]) for key, value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def _small(config) -> dict:
    """:data:`SMALL`'s values for the attributes ``config`` has (not read-only properties; MLA attention keeps its own
    heads), and the same for each of its sub-configurations."""
    skip = {key for key in SMALL if isinstance(getattr(type(config), key, None), property)}
    if getattr(config, "kv_lora_rank", None) is not None:
        skip |= {"num_key_value_heads", "head_dim"}
    kwargs = {key: value for key, value in SMALL.items() if hasattr(config, key) and key not in skip}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            kwargs[name] = {"model_type": getattr(sub, "model_type", None), **_small(sub)}
            if kwargs[name]["model_type"] in (None, ""):
                del kwargs[name]["model_type"]
    return kwargs


def tiny_configs(model_type: str, cls=None):
    """The tiny configurations to try, in order: ``model_type``'s configuration class with :data:`SMALL`'s values
    where it has the attribute (sub-configurations shrunk alike), then the model class's own configuration class
    (a text model mapped under its multimodal ``model_type``), then the sub-configurations given whole with the
    values merged in, then the default number of layers (a layer pattern fixed for it)."""
    from transformers import CONFIG_MAPPING

    classes = [CONFIG_MAPPING[model_type]]
    own = getattr(cls, "config_class", None)
    if own is not None and own is not classes[0]:
        classes.append(own)
    for config_class in classes:
        default = config_class()
        yield lambda config_class=config_class, default=default: config_class(**_small(default))
    default = classes[0]()

    def merged():
        kwargs = _small(default)
        for name in getattr(default, "sub_configs", {}) or {}:
            sub = getattr(default, name, None)
            if isinstance(kwargs.get(name), dict) and hasattr(sub, "to_dict"):
                whole = {k: v for k, v in sub.to_dict().items() if not k.endswith("layer_types")}
                kwargs[name] = {**whole, **kwargs[name]}
        return classes[0](**kwargs)

    yield merged

    def default_depth():  # configurations whose layer pattern is fixed for their default depth
        kwargs = {key: value for key, value in _small(default).items() if key not in ("num_hidden_layers", "num_layers", "n_layer")}
        return classes[0](**kwargs)

    yield default_depth


def tiny_config(model_type: str, cls=None):
    """The first of :func:`tiny_configs` that builds."""
    errors = []
    for make in tiny_configs(model_type, cls):
        try:
            return make()
        except Exception as error:  # noqa: BLE001 - the next way is tried; the first error is reported
            errors.append(error)
    raise errors[0]


def rel_err(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


def grad_err(grads: dict, reference: dict) -> float:
    """The worst parameter's ``‖g − g_ref‖`` over the larger of its ``‖g_ref‖`` and a thousandth of the largest
    parameter gradient's norm: a gradient that is zero in exact arithmetic (a key projection's bias under softmax)
    holds rounding alone, and its error is read on the model's scale rather than its own."""
    scale = max((float(g.norm()) for g in reference.values()), default=0.0) * 1e-3
    return max((float((grads[n] - g).norm()) / max(float(g.norm()), scale, 1e-30) for n, g in reference.items()),
               default=0.0)


def _loss_and_grads(model, inputs) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _first_line(error: BaseException, limit: int = 160) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _build_and_run(cls, config, device="cpu"):
    """The model of ``config`` on ``device`` (its head scaled so that the logits spread), its inputs, its own loss
    and gradients."""
    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny configuration still has {size / 1e6:.0f}M parameters (a part SMALL does not shrink)")
    torch.manual_seed(0)
    model = cls(config).float().to(device).eval()
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        with torch.no_grad():
            weight.normal_(0.0, LOGIT_SPREAD / math.sqrt(weight.shape[-1]))
    vocab = weight.shape[0] if isinstance(weight, torch.Tensor) else SMALL["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, min(vocab, SMALL["vocab_size"]), (BATCH, SEQUENCE), generator=generator)
    # labels drawn apart from the inputs: a decoder whose loss is not shifted (CrossEntropyLoss on the positions as
    # they are) with tied embeddings would otherwise predict its own inputs, and a loss of 0 checks nothing
    labels = torch.randint(3, min(vocab, SMALL["vocab_size"]), (BATCH, SEQUENCE), generator=generator)
    labels[0, :3] = -100
    inputs = {name: t.to(device) for name, t in
              {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}.items()}
    ref_loss, ref_grads = _loss_and_grads(model, inputs)
    if not torch.isfinite(ref_loss):
        raise ValueError(f"the unpatched loss is {ref_loss.item()}")
    return model, inputs, ref_loss, ref_grads


def check(model_type: str, class_name: str, kernel: str = "kernels_lib") -> Row:
    """One class: refused (by its forward's pattern or at :func:`patch`), could not build, or compared; ``kernel``:
    ``"kernels_lib"`` (the fused kernel, on :func:`kernels_lib.default_device`: a GPU where there is one) or
    ``"torch"`` (:func:`torch_linear_cross_entropy`, :func:`counted_kernel`, on the CPU)."""
    if kernel not in ("kernels_lib", "torch"):
        raise ValueError(f"kernel must be 'kernels_lib' or 'torch'; got {kernel!r}")
    import transformers

    from kernels_lib import default_device, hf

    device = default_device() if kernel == "kernels_lib" else "cpu"
    start = time.perf_counter()
    row = Row(model_type, class_name, "refused")
    try:
        cls = getattr(transformers, class_name)
        row.pattern = hf.forward_pattern(cls).describe()
    except ValueError as error:
        row.reason = str(error).removeprefix("kernels_lib.hf does not support ")
        row.seconds = time.perf_counter() - start
        return row
    except Exception as error:  # noqa: BLE001 - an import that fails is a row, not a crash
        row.result, row.reason = "could not build", _first_line(error)
        return row
    failures = []
    for make in tiny_configs(model_type, cls):
        try:
            model, inputs, ref_loss, ref_grads = _build_and_run(cls, make(), device)
            break
        except Exception as error:  # noqa: BLE001 - each class's failure to build is a row with its reason
            failures.append(error)
    else:
        row.result, row.reason = "could not build", _first_line(failures[0])
        row.seconds = time.perf_counter() - start
        return row
    try:
        hf.patch(model)
    except ValueError as error:
        row.reason = str(error).removeprefix("kernels_lib.hf does not support ").removeprefix("kernels_lib.hf: ")
        row.seconds = time.perf_counter() - start
        return row
    try:
        with counted_kernel(kernel) as calls:
            loss, grads = _loss_and_grads(model, inputs)
    finally:
        hf.unpatch(model)
    row.loss_rel_err = rel_err(loss, ref_loss)
    missing = sorted(set(ref_grads) ^ set(grads))
    row.grad_rel_err = math.inf if missing else grad_err(grads, ref_grads)
    ok = row.loss_rel_err < LOSS_TOL and row.grad_rel_err < GRAD_TOL
    row.result = "matched" if ok else "differs"
    if missing:
        row.reason = f"gradients present on one side only: {', '.join(missing[:3])}"
    if len(calls) != 1:  # the patched forward must have formed the loss once, through the kernel
        row.result, row.reason = "differs", f"the patched forward called the kernel {len(calls)} times, not once"
    row.seconds = time.perf_counter() - start
    return row


#: The rows of the last full walk and the fingerprint they were computed under.
CACHE = Path(__file__).resolve().parents[2] / "data" / "hf_coverage.json"


#: The functions whose sources the rows depend on (bound here, so that a test replacing one changes no fingerprint).
_JUDGING = (check, _build_and_run, tiny_configs, _small, _loss_and_grads, rel_err, grad_err, torch_linear_cross_entropy,
            counted_kernel)


def fingerprint(kernel: str = "torch") -> str:
    """What the rows depend on: ``kernels_lib/hf.py``, the functions and values of this module that build, run and
    judge a class, the Transformers and torch versions, and the kernel; rows under another fingerprint are not reused."""
    import inspect

    import transformers

    from kernels_lib import hf

    digest = hashlib.sha256(Path(hf.__file__).read_bytes())
    for function in _JUDGING:
        digest.update(inspect.getsource(function).encode())
    constants = (SMALL, LOSS_TOL, GRAD_TOL, LOGIT_SPREAD, BATCH, SEQUENCE, MAX_PARAMETERS, transformers.__version__,
                 torch.__version__, kernel)
    digest.update(repr(constants).encode())
    return digest.hexdigest()[:16]


def read_cache(path: Path = CACHE, kernel: str = "torch") -> dict[str, Row]:
    """The cached rows by ``model_type`` when ``path`` was written under the current :func:`fingerprint`, else {}."""
    if not path.exists():
        return {}
    stored = json.loads(path.read_text())
    if stored.get("fingerprint") != fingerprint(kernel):
        return {}
    return {row["model_type"]: Row(**row) for row in stored["rows"]}


def write_cache(rows: list[Row], path: Path = CACHE, kernel: str = "torch") -> None:
    import transformers

    stored = {"fingerprint": fingerprint(kernel), "transformers": transformers.__version__, "torch": torch.__version__,
              "kernel": kernel, "rows": [dataclasses.asdict(row) for row in rows]}
    path.write_text(json.dumps(stored, indent=1, allow_nan=True) + "\n")


def coverage(mapping: dict[str, str] | None = None, kernel: str = "torch", cache: Path | None = None) -> list[Row]:
    """:func:`check` for every ``model_type`` of ``mapping`` (default: the installed causal-LM mapping). With ``cache``,
    rows cached there under the current :func:`fingerprint` are reused (a row is reused only for the same class)."""
    mapping = causal_lm_mapping() if mapping is None else mapping
    cached = read_cache(cache, kernel) if cache is not None else {}
    rows = []
    for model_type, class_name in mapping.items():
        row = cached.get(model_type)
        rows.append(row if row is not None and row.cls == class_name else check(model_type, class_name, kernel))
    return rows


def counts(rows: list[Row]) -> dict[str, int]:
    """Rows per result, and the distinct classes matched (``matched_classes``)."""
    found = {result: sum(row.result == result for row in rows) for result in ("matched", "differs", "refused", "could not build")}
    found["matched_classes"] = len({row.cls for row in rows if row.result == "matched"})
    found["rows"] = len(rows)
    return found


def table(rows: list[Row]):
    """The rows as a DataFrame: class, model_type, result, the errors, the pattern or the reason."""
    import pandas as pd

    return pd.DataFrame([
        {"class": row.cls, "model_type": row.model_type, "result": row.result,
         "loss rel. err.": row.loss_rel_err, "max grad rel. err.": row.grad_rel_err,
         "pattern / reason": row.reason or row.pattern}
        for row in rows
    ])



#: What stops a class, read from its reason: (label, a pattern of the reason text).
STOPPERS = (
    ("head is not the output embeddings (a transform before the projection)", "which is not its output embeddings"),
    ("head is not an nn.Linear", "has no nn.Linear LM head"),
    ("loss is not ForCausalLMLoss nor CrossEntropyLoss (z-loss, custom loss, sliced logits)", "its loss is not"),
    ("an unknown transform of the logits", "a transform kernels_lib does not know"),
    ("the logits are used after the loss", "uses the logits after the loss"),
    ("no `if labels is not None:` loss at the top level", "has no top-level"),
    ("the head's call is not self.<head>(hidden states)", "forms the logits as"),
    ("tiny configuration not built", ""),
)


def stoppers(rows: list[Row]):
    """The rows not matched, grouped by what stops them: count and the classes."""
    import pandas as pd

    groups: dict[str, list[str]] = {}
    for row in rows:
        if row.result == "matched":
            continue
        if row.result == "differs":
            label = "differs (a failure)"
        elif row.result == "could not build":
            label = "tiny configuration not built"
        else:
            label = next((name for name, text in STOPPERS if text and text in row.reason), "other")
        groups.setdefault(label, []).append(row.cls)
    return pd.DataFrame([{"what stops it": label, "model types": len(names), "classes": ", ".join(sorted(set(names)))}
                         for label, names in sorted(groups.items(), key=lambda item: -len(item[1]))])


def summary(rows: list[Row], transformers_version: str) -> str:
    """One paragraph of the counts, every figure from ``rows``."""
    found = counts(rows)
    ratio = found["matched_classes"] / LIGER_FAMILIES
    differs = (f" **{found['differs']} differ: a failure.**" if found["differs"] else
               " None is patched with a difference above the tolerances.")
    return (
        f"Of the {found['rows']} model types Transformers {transformers_version} maps to `AutoModelForCausalLM`, "
        f"`hf.patch` matches {found['matched']} ({found['matched_classes']} classes) on their own loss and every "
        f"gradient (relative errors below {LOSS_TOL:g} and {GRAD_TOL:g}), refuses {found['refused']} by name with "
        f"the reason, and {found['could not build']} could not be built from a tiny configuration.{differs} "
        f"Liger-Kernel patches about {LIGER_FAMILIES} model families by hand: {ratio:.1f}× as many classes matched."
    )


if __name__ == "__main__":  # python -m kernels_workbench.hf_coverage: walk the mapping and rewrite data/hf_coverage.json
    mapping = causal_lm_mapping()
    found = []
    for i, (model_type, class_name) in enumerate(mapping.items(), 1):
        found.append(check(model_type, class_name, kernel="torch"))
        print(f"[{i}/{len(mapping)}] {class_name} ({model_type}): {found[-1].result}", flush=True)
    write_cache(found)
    print(counts(found))
