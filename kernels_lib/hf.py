r"""Hugging Face causal LMs on :func:`~kernels_lib.fused_linear_cross_entropy`: the loss without the logits.

Two patches of a loaded ``*ForCausalLM`` instance (the class is left alone), both on its ``forward``:

* :func:`patch`: ``model(..., labels=...)`` returns the loss of Transformers' ``ForCausalLMLoss``
  computed straight from the last hidden states and the LM head, never forming the ``B × T × V``
  logits. With hidden states :math:`h_t` (after ``logits_to_keep``), the head :math:`W, b` (tied
  embeddings included: the head's weight *is* the tied parameter) and the shifted labels
  :math:`y_t = \text{labels}_{t+1}` (the last position gets ``-100``; or ``shift_labels`` as given),

  .. math::

      z_t = c(W h_t + b), \qquad
      L = \frac{1}{D} \sum_{t:\ y_t \ne -100} \big(\log \textstyle\sum_v e^{z_{tv}} - z_{t y_t}\big),

  where :math:`c(z) = s\tanh(z/s)` is Gemma's final-logit softcap (``config.final_logit_softcapping``;
  the identity elsewhere) and :math:`D` is ``num_items_in_batch`` when given (what ``Trainer`` passes
  under gradient accumulation), else the number of valid labels. One difference from Transformers:
  a batch whose labels are all ``-100`` gives loss 0 (and zero gradients) where Transformers gives NaN.
* :func:`add_fused_lm_head`: TRL 1.16's fused-head protocol: ``model(..., labels=..., fused_lm_head=True)``
  returns a ``FusedCausalLMOutput`` of per-token log-probabilities, entropy, ``log Σ p²``, mean
  logit and top-1 flags computed by kernels_lib, so that TRL's trainers run on it unchanged (see :func:`use_in_trl`).

Without labels the model's original forward runs, unchanged (generation and inference give the same
logits as before). :func:`unpatch` restores the forward the model had before the first patch.

Supported: the ``*ForCausalLM`` classes in :data:`SUPPORTED` (Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3 text, Phi-3), whose forward is ``backbone -> lm_head (-> softcap) -> ForCausalLMLoss``;
anything else is refused with an error naming the model type. Checked with Transformers 5.17 and
5.24 (the backbone is reached through ``model.base_model``, the head through
``get_output_embeddings()``, and the output carries whatever cache field the installed version's
``CausalLMOutputWithPast`` has: ``past_key_values`` or ``cache``). The head's ``weight`` and ``bias``
are read directly, not through its ``forward``; at each call, whatever would change that forward's
output is either computed (peft's LoRA on the head, folded into the loss exactly: see :func:`patch`)
or refused with an error naming it (other adapters, forward hooks, a replaced ``forward``), never
bypassed. peft models are accepted as they are (the patch goes on the causal LM inside). Sharded heads are used whole, as their framework
would gather them for ``nn.Linear`` (:func:`_with_full_head`): under FSDP2 with the head a unit of its
own (``fully_shard(model.lm_head)``, tied or untied, patched before or after sharding) the loss runs as
the head's forward, so that FSDP2's hooks unshard it, reshard it and reduce-scatter its gradient;
under DeepSpeed ZeRO-3 it is gathered with ``deepspeed.zero.GatheredParameters`` for the loss.
Under ``torch.compile`` the kernel call is one graph break (the kernels_lib function is wrapped in
``torch.compiler.disable``); under ``torch.autocast`` it runs its matmuls in the autocast dtype, as
``nn.Linear`` would, and returns a float32 loss, as ``ForCausalLMLoss`` (which upcasts the logits) does.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput
from transformers.utils.generic import can_return_tuple

from .fused_linear_cross_entropy import CrossEntropyOutput, fused_linear_cross_entropy

try:  # recent Transformers 5.x; 5.17 inlines the same slicing (an int keeps the last k positions, else an index)
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # pragma: no cover - the installed Transformers decides

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


__all__ = ["SUPPORTED", "patch", "unpatch", "is_patched", "add_fused_lm_head", "use_in_trl", "FUSED_HEAD_OUTPUTS"]

#: The ``*ForCausalLM`` classes :func:`patch` accepts, and whether their forward softcaps the logits.
SUPPORTED = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": False,
    "Qwen3ForCausalLM": False,
    "Phi3ForCausalLM": False,
    "Gemma2ForCausalLM": True,
    "Gemma3ForCausalLM": True,
}
#: The per-token fields of TRL's ``FusedCausalLMOutput`` (all of them, computed by kernels_lib).
FUSED_HEAD_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
IGNORE_INDEX = -100
_STATE = "_kernels_lib_hf"
#: What the output carries from the backbone: ``cache`` or ``past_key_values`` (by version), hidden states, attentions.
_BACKBONE_FIELDS = tuple(f.name for f in dataclasses.fields(CausalLMOutputWithPast) if f.name not in ("loss", "logits"))


@dataclasses.dataclass
class _LossOptions:
    chunk_size: int | None
    accurate: bool
    keep_logits: bool | None  # None: the logits when inferring (eval mode, no grad), as Trainer.evaluate needs them
    softcaps: bool  # the family's forward applies config.final_logit_softcapping (read at each call, as it does)

    def softcap(self, model) -> float | None:
        return model.config.final_logit_softcapping if self.softcaps else None

    def keeps_logits(self, model) -> bool:
        if self.keep_logits is not None:
            return self.keep_logits
        return not model.training and not torch.is_grad_enabled()


@dataclasses.dataclass
class _HeadOptions:
    temperature: float
    cast_lm_head_to_fp32: bool
    outputs: tuple[str, ...]
    logit_scale: float
    softcap: float | None


@dataclasses.dataclass
class _State:
    """What is installed on a patched model: the forward it had before (None: its class's), the signature of
    its class's forward (to bind the call's arguments by name), and the options."""

    previous_forward: object
    signature: inspect.Signature
    loss: _LossOptions | None = None
    head: _HeadOptions | None = None


# --------------------------------------------------------------------------------------------- checks


def _supported_class(model) -> str:
    """The supported class ``model`` is (or derives from), or a ValueError naming the model type and what is missing."""
    name = next((cls.__name__ for cls in type(model).__mro__ if cls.__name__ in SUPPORTED), None)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    what = f"{type(model).__name__} (model_type={model_type!r})"
    if name is None:
        raise ValueError(f"kernels_lib.hf does not support {what}; supported: {', '.join(SUPPORTED)}")
    try:  # checked again at each call: an adapter or a hook may come after patching
        _resolve_head(model.get_output_embeddings(), at_call=False)
    except ValueError as error:
        reason = str(error).removeprefix("kernels_lib.hf: ")
        raise ValueError(f"kernels_lib.hf: {what} has no nn.Linear LM head kernels_lib can compute: {reason}") from None
    if model.base_model is model:
        raise ValueError(f"kernels_lib.hf: {what} has no backbone {model.base_model_prefix!r} (model.base_model)")
    if SUPPORTED[name] and not hasattr(model.config, "final_logit_softcapping"):
        raise ValueError(f"kernels_lib.hf: the config of {what} has no final_logit_softcapping (None or a float)")
    return name


# ------------------------------------------------------------------------------------ the installed forward


def _arguments(state: _State, model, args, kwargs) -> dict:
    """The call's arguments by name, bound to the class's ``forward`` (positional ones included)."""
    bound = state.signature.bind(model, *args, **kwargs)
    names = list(bound.signature.parameters.values())
    arguments = dict(bound.arguments)
    del arguments[names[0].name]  # self
    for parameter in names:
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(parameter.name, {}))
    return arguments


def _previous_forward(model, state: _State):
    return state.previous_forward if state.previous_forward is not None else type(model).forward.__get__(model)


def _install(model) -> _State:
    """Install the kernels_lib forward once (patching again reuses it) and return its state."""
    state = model.__dict__.get(_STATE)
    if state is None:
        state = _State(model.__dict__.get("forward"), inspect.signature(type(model).forward))

        @functools.wraps(type(model).forward)  # keeps the signature: generate and Trainer read it
        def forward(self, *args, fused_lm_head: bool = False, **kwargs):
            return _dispatch(self, fused_lm_head, args, kwargs)

        model.forward = types.MethodType(forward, model)
        setattr(model, _STATE, state)
    return state


def _dispatch(model, fused_lm_head: bool, args, kwargs):
    """``fused_lm_head=True`` -> TRL's protocol; labels under :func:`patch` -> the fused loss; else the previous forward."""
    state = getattr(model, _STATE)
    if fused_lm_head:
        if state.head is not None:
            return _fused_head_forward(model, state.head, _arguments(state, model, args, kwargs))
        kwargs["fused_lm_head"] = True  # another library's fused head, installed before ours
    elif state.loss is not None:
        arguments = _arguments(state, model, args, kwargs)
        if arguments.get("labels") is not None or arguments.get("shift_labels") is not None:
            return _loss_forward(model, **arguments)
    return _previous_forward(model, state)(*args, **kwargs)


def _passthrough(backbone_outputs) -> dict:
    """The fields of ``CausalLMOutputWithPast`` that come from the backbone (cache, hidden states, attentions)."""
    return {name: getattr(backbone_outputs, name, None) for name in _BACKBONE_FIELDS}


def _logits(model, hidden_states: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The logits exactly as the model's forward forms them (head, then Gemma's softcap)."""
    logits = model.get_output_embeddings()(hidden_states)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _check_labels(name: str, labels: torch.Tensor, hidden_states: torch.Tensor, logits_to_keep) -> None:
    """``labels``/``shift_labels`` must be ``(B, T)``: one per position of the model's input (after ``logits_to_keep``)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of token ids, (batch, sequence); got {type(labels).__name__}")
    wanted = tuple(hidden_states.shape[:-1])
    if tuple(labels.shape) != wanted:
        kept = f", the positions logits_to_keep={logits_to_keep!r} keeps" if not _keeps_all(logits_to_keep) else ""
        shift = " (unshifted: the model shifts them; pre-shifted ones go in shift_labels)" if name == "labels" else ""
        raise ValueError(
            f"{name} must have shape (batch, sequence) = {wanted}, one per position of input_ids{kept}{shift}; "
            f"got {tuple(labels.shape)}"
        )


def _keeps_all(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


@can_return_tuple
def _loss_forward(
    model, labels=None, shift_labels=None, num_items_in_batch=None, logits_to_keep=0, **backbone_kwargs
) -> CausalLMOutputWithPast:
    """The model's forward with ``ForCausalLMLoss`` from :func:`fused_linear_cross_entropy` (no logits unless kept)."""
    options = getattr(model, _STATE).loss
    softcap = options.softcap(model)
    outputs = model.base_model(**backbone_kwargs)
    hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    if shift_labels is None:
        _check_labels("labels", labels, hidden_states, logits_to_keep)
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    else:
        _check_labels("shift_labels", shift_labels, hidden_states, logits_to_keep)
    head = model.get_output_embeddings()

    def loss_of(weight, bias, hidden, target):
        return fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]).to(weight.device),
            weight,
            target.reshape(-1).to(weight.device),
            bias,
            ignore_index=IGNORE_INDEX,
            softcap=softcap,
            num_items_in_batch=num_items_in_batch,
            chunk_size=options.chunk_size,
            accurate=options.accurate,
            host_checks=False,  # a training step: no host sync (a bad label is a device-side assert, as in torch)
        )

    loss = _with_full_head(head, loss_of, hidden_states, shift_labels)
    logits = _logits(model, hidden_states, softcap) if options.keeps_logits(model) else None
    return CausalLMOutputWithPast(loss=loss, logits=logits, **_passthrough(outputs))


# ------------------------------------------------------------------- the head at call time (plain, LoRA, refused)


def _peft():
    """peft's classes the head and model checks need, or None when peft is not imported (then no model carries them)."""
    if "peft" not in sys.modules:
        return None
    import peft
    from peft.tuners import lora
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    return types.SimpleNamespace(
        PeftModel=peft.PeftModel, BaseTuner=BaseTuner, BaseTunerLayer=BaseTunerLayer, LoraLinear=lora.Linear,
        ModulesToSaveWrapper=ModulesToSaveWrapper,
    )


def _causal_lm(model):
    """The ``*ForCausalLM`` inside a peft wrapper (``PeftModel`` and its task classes, or a tuner such as ``LoraModel``);
    ``model`` itself otherwise. Its forward is the one peft's forward ends in, so the patch goes there."""
    peft = _peft()
    if peft is not None:
        if isinstance(model, peft.PeftModel):
            return model.get_base_model()
        if isinstance(model, peft.BaseTuner):
            return model.model
    return model


@dataclasses.dataclass
class _LoraTerm:
    """One active, unmerged LoRA adapter of the head: its logits are ``scaling · B(A(dropout(h)))`` (+ ``scaling · b_B``)."""

    name: str
    lora_A: torch.nn.Linear
    lora_B: torch.nn.Linear
    dropout: torch.nn.Module
    scaling: float


#: Origins of forward hooks that gather or place the head's parameters and leave its output alone: FSDP2's
#: (which run, the loss being the head's forward there) and DeepSpeed ZeRO-3's (whose gather the loss does itself).
_PARAMETER_HOOK_ORIGINS = ("torch.distributed.", "deepspeed.")


def _hook_name(hook) -> tuple[str, str]:
    """A hook's origin module and name (through ``functools.partial``)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    function = getattr(hook, "__func__", hook)
    return getattr(function, "__module__", "") or "", getattr(function, "__qualname__", None) or repr(hook)


def _check_forward_unwrapped(module, where: str) -> None:
    """Refuse, naming it, whatever would make ``module(x)`` differ from the operation kernels_lib computes from its
    parameters: a forward hook or pre-hook (other than FSDP2's or ZeRO-3's parameter gathering), or a replaced
    ``forward`` (other than Accelerate's device placement of parameters that are in memory)."""
    for kind, hooks in (("forward pre-hook", module._forward_pre_hooks), ("forward hook", module._forward_hooks)):
        for hook in hooks.values():
            origin, name = _hook_name(hook)
            if not origin.startswith(_PARAMETER_HOOK_ORIGINS):
                raise ValueError(
                    f"kernels_lib.hf: {where} has a {kind} {origin}.{name}, which may change what it computes; the "
                    f"fused loss reads its parameters without running its forward, so it cannot honour the hook. "
                    f"Remove the hook or call kernels_lib.hf.unpatch(model)"
                )
    if "forward" in module.__dict__:
        accelerate = getattr(module, "_hf_hook", None)
        hooks = getattr(accelerate, "hooks", None) or ([accelerate] if accelerate is not None else [])
        placing = all(type(hook).__name__ == "AlignDevicesHook" and not getattr(hook, "offload", False) for hook in hooks)
        if not (hooks and placing):
            replaced = accelerate if accelerate is not None else module.__dict__["forward"]
            raise ValueError(
                f"kernels_lib.hf: {where}'s forward is replaced ({replaced!r}); the fused loss reads its parameters "
                f"without running its forward, so it cannot honour that (Accelerate's device placement without "
                f"offloading is the one replacement accepted)"
            )


def _check_linear(module, where: str) -> None:
    if not isinstance(module, torch.nn.Linear) or type(module).forward is not torch.nn.Linear.forward:
        raise ValueError(
            f"kernels_lib.hf: {where} is {type(module).__module__}.{type(module).__qualname__}, not an nn.Linear "
            f"(or a peft LoRA layer on one); kernels_lib cannot compute its forward from its parameters"
        )
    _check_forward_unwrapped(module, where)


def _resolve_head(head, *, at_call: bool = True) -> tuple[torch.nn.Linear, list[_LoraTerm]]:
    """The ``nn.Linear`` whose ``weight``/``bias`` the head's forward multiplies by and the LoRA terms it adds, read
    now (adapters enabled, disabled, merged, switched: the state of this call), or a ValueError naming what kernels_lib
    cannot compute without running the head's forward. ``at_call``: a disabled LoRA layer holding merged adapters is
    unmerged first, as its own forward does."""
    where = f"the LM head ({type(head).__name__})"
    peft = _peft()
    if peft is None or not isinstance(head, (peft.BaseTunerLayer, peft.ModulesToSaveWrapper)):
        _check_linear(head, where)
        return head, []
    _check_forward_unwrapped(head, where)
    if isinstance(head, peft.ModulesToSaveWrapper):  # modules_to_save=["lm_head"]: a trainable copy per adapter
        active = head.active_adapters
        if len(active) > 1:
            raise ValueError(f"kernels_lib.hf: {where} has several active adapters {active}; set one")
        copies = head.modules_to_save
        if head.disable_adapters or not active or active[0] not in copies:
            return _resolve_head(head.original_module, at_call=at_call)
        return _resolve_head(copies[active[0]], at_call=at_call)
    if type(head) is not peft.LoraLinear:
        raise ValueError(
            f"kernels_lib.hf: {where} carries a peft adapter of type {type(head).__module__}.{type(head).__qualname__}; "
            f"kernels_lib handles LoRA on an nn.Linear head (peft.tuners.lora.Linear) only: leave lm_head out of "
            f"the adapter's target_modules, or call kernels_lib.hf.unpatch(model)"
        )
    base = head.base_layer
    _check_linear(base, f"{where}'s base_layer")
    if head.disable_adapters:
        if head.merged and at_call:
            head.unmerge()
        return base, []
    if head.merged:  # merged adapters are in base.weight; peft's forward then adds no other
        return base, []
    if getattr(head, "fan_in_fan_out", False):
        raise ValueError(f"kernels_lib.hf: {where} has fan_in_fan_out=True, which an nn.Linear base never has")
    terms = []
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        variant = getattr(head, "lora_variant", {}).get(name)
        if variant is not None or head.use_dora.get(name, False):
            kind = "DoRA (use_dora=True)" if head.use_dora.get(name, False) else type(variant).__name__
            raise ValueError(
                f"kernels_lib.hf: adapter {name!r} on {where} is a LoRA variant, {kind}, which kernels_lib does not "
                f"compute; plain LoRA only on the head (or leave lm_head out of target_modules)"
            )
        lora_A, lora_B, dropout = head.lora_A[name], head.lora_B[name], head.lora_dropout[name]
        _check_linear(lora_A, f"lora_A[{name!r}] of {where}")
        _check_linear(lora_B, f"lora_B[{name!r}] of {where}")
        if type(dropout) not in (torch.nn.Dropout, torch.nn.Identity):
            raise ValueError(f"kernels_lib.hf: lora_dropout[{name!r}] of {where} is {type(dropout).__name__}")
        _check_forward_unwrapped(dropout, f"lora_dropout[{name!r}] of {where}")
        scaling = head.scaling[name]
        if isinstance(scaling, torch.Tensor):
            scaling = scaling.item()
        terms.append(_LoraTerm(name, lora_A, lora_B, dropout, scaling))
    return base, terms


def _with_lora(terms: list[_LoraTerm], weight, bias, hidden):
    r"""The loss's operands with the LoRA terms folded in exactly: ``[h, s·A·drop(h), …]`` against ``[W, B, …]``.

    ``W h + Σ s B A drop(h)`` is the product of the head's weight concatenated with each ``B`` (``V × (H + Σ r)``) and
    the hidden states concatenated with each ``s · A · drop(h)`` (``N × (H + Σ r)``), so the fused loss's gradients
    reach ``W`` (when trainable) and, through autograd, every ``A`` and ``B``, with each adapter's own dropout mask.
    """
    if not terms:
        return weight, bias, hidden
    weights, hiddens = [weight], [hidden]
    for term in terms:
        a = term.lora_A.weight
        low = F.linear(term.dropout(hidden.to(a.device, a.dtype)), a, term.lora_A.bias) * term.scaling
        hiddens.append(low.to(hidden.device, hidden.dtype))
        weights.append(term.lora_B.weight.to(weight.device, weight.dtype))
        if term.lora_B.bias is not None:  # lora_bias=True
            extra = (term.lora_B.bias * term.scaling).to(weight.device, weight.dtype)
            bias = extra if bias is None else bias + extra
    return torch.cat(weights, dim=1), bias, torch.cat(hiddens, dim=-1)


# ------------------------------------------------------------------- the head's full parameters (FSDP2, ZeRO-3)


def _fsdp_module_class():
    """FSDP2's ``FSDPModule`` (the class ``fully_shard`` mixes into a module), or None in a torch without it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - the installed torch decides
        return None
    return FSDPModule


def _zero3_partitioned(head) -> list:
    """The head's parameters DeepSpeed ZeRO-3 holds partitioned now (``ds_id``, not available), each once (tied)."""
    found = {}
    for parameter in (head.weight, head.bias):
        if parameter is not None and hasattr(parameter, "ds_id"):
            if getattr(getattr(parameter, "ds_status", None), "name", None) != "AVAILABLE":
                found[id(parameter)] = parameter
    return list(found.values())


class _GatheredCopy(torch.autograd.Function):
    """A copy of a gathered ZeRO-3 parameter that outlives the gather (saved for backward where the loss saves
    its weight), its gradient handed to the parameter itself: DeepSpeed's hooks then reduce it as a
    ``nn.Linear``'s."""

    @staticmethod
    def forward(ctx, parameter):
        return parameter.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


# Not traced by torch.compile: the loss is one graph break (its kernels are not traceable), and the FSDP2 /
# ZeRO-3 gathering around it stays out of the backbone's graph.
@torch.compiler.disable
def _with_full_head(head, compute, *inputs):
    r"""``compute(weight, bias, *inputs)`` with the head's whole ``weight`` and ``bias``, however the model is sharded.

    The head is first resolved as it stands at this call (:func:`_resolve_head`: a plain ``nn.Linear``, or a
    peft LoRA layer whose active adapters :func:`_with_lora` folds into the operands, ``inputs[0]`` being the
    hidden states; anything else refused). LoRA on a head sharded as below is refused.

    * **FSDP2, the head a unit of its own** (``fully_shard(model.lm_head)``, or in a group with the tied
      embedding, ``fully_shard([embed_tokens, lm_head])``): outside its forward the head's ``weight`` is a
      ``DTensor`` sharded ``Shard(0)`` over the data-parallel ranks. That is storage, not a
      vocabulary-parallel head (each rank has its own tokens), so the loss is run *as the head's forward*:
      ``head.forward`` is set to ``compute`` for one call of ``head(*inputs)``, and FSDP2's own hooks do what
      they do for ``nn.Linear``: the pre-forward hook all-gathers the weight (``head.weight`` is then the
      unsharded parameter) and wraps the hidden states so that the post-backward hook reduce-scatters the
      gradient; the post-forward hook reshards (with ``reshard_after_forward``) and registers the
      pre-backward unshard on the loss. The full head so lives only during the loss and its backward, as the
      unpatched model's does; the gradients reach FSDP's reduce-scatter as ``nn.Linear``'s. Chosen over
      calling ``unshard()``/``reshard()`` by hand, which would have to re-register the gradient hooks FSDP2
      keeps private. With ``mean``/``sum`` the loss forms ``dW`` in forward, so a rank holds one unsharded
      ``dW`` from the loss to backward (the unpatched model holds the ``B × T × V`` logits instead). A
      head inside a larger unit (the root) is already unsharded when the model's forward runs and needs
      none of this.
    * **DeepSpeed ZeRO-3** (parameters with ``ds_id``, partitioned): gathered for the loss as TRL's
      ``maybe_gather_lm_head_ctx`` does, ``deepspeed.zero.GatheredParameters(params, modifier_rank=None)``
      (read-only: no rank's edits are broadcast), each parameter once. The loss takes a copy that outlives
      the gather (:class:`_GatheredCopy`), since it may save the weight for backward (``reduction="none"``,
      the class-major route), when ZeRO-3 has partitioned the parameter again; its gradient goes to the
      parameter, whole, for ZeRO-3's hooks to reduce. Cost: one more copy of the head during the loss.
      Only the gather's interface is tested (a fake, ``tests/test_hf_zero3.py``); ZeRO-3 itself was not
      run, so how DeepSpeed's gradient hooks take a whole gradient arriving on a parameter it has
      partitioned again (TRL's head relies on the same) is unchecked here.
    * Anything else: ``head.weight`` and ``head.bias`` as they are (a ``DTensor`` head not under FSDP2, such
      as a tensor-parallel ``ColwiseParallel`` one, is vocabulary-parallel for
      :func:`~kernels_lib.fused_linear_cross_entropy`).
    """
    linear, terms = _resolve_head(head)
    fsdp_module = _fsdp_module_class()
    if terms:
        fsdp = fsdp_module is not None and (isinstance(head, fsdp_module) or isinstance(linear, fsdp_module))
        if fsdp or any(hasattr(parameter, "ds_id") for parameter in head.parameters()):
            raise ValueError(
                "kernels_lib.hf: LoRA on an LM head that FSDP2 shards as a unit of its own, or that DeepSpeed ZeRO-3 "
                "partitions, is not supported; shard the head with its parent module, or leave lm_head out of the "
                "adapter's target_modules"
            )
        return compute(*_with_lora(terms, linear.weight, linear.bias, inputs[0]), *inputs[1:])
    head = linear
    if fsdp_module is not None and isinstance(head, fsdp_module):
        had_own = "forward" in head.__dict__
        own = head.__dict__.get("forward")
        head.forward = lambda *args: compute(head.weight, head.bias, *args)
        try:
            return head(*inputs)
        finally:
            if had_own:
                head.forward = own
            else:
                del head.forward
    partitioned = _zero3_partitioned(head)
    if partitioned:
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
            weight = _GatheredCopy.apply(head.weight)
            bias = None if head.bias is None else _GatheredCopy.apply(head.bias)
            return compute(weight, bias, *inputs)
    return compute(head.weight, head.bias, *inputs)


# ------------------------------------------------------------------------------------------ public: patch


def patch(model, *, chunk_size: int | None = None, accurate: bool = False, keep_logits: bool | None = None):
    r"""Make ``model``'s loss come from :func:`~kernels_lib.fused_linear_cross_entropy`; returns ``model``.

    With ``labels`` (or pre-shifted ``shift_labels``) the forward runs the backbone, slices its last
    hidden states by ``logits_to_keep`` as Transformers does, and computes ``ForCausalLMLoss`` on them
    and the LM head without forming the logits: labels padded with ``-100`` and shifted by one
    (``shift_labels`` used as given), ``ignore_index=-100``, the mean over valid labels or the sum
    divided by ``num_items_in_batch`` (``Trainer``'s gradient accumulation), Gemma's final-logit
    softcap. It returns a ``CausalLMOutputWithPast`` (loss, logits, cache, hidden_states, attentions)
    like the original, or its tuple under ``return_dict=False``. Labels (and the other arguments)
    may be positional, as the class's forward allows.

    With labels, the logits are formed too (exactly as the original forward forms them, with a
    gradient if one is on, at the ``B × T × V`` memory the patch exists to save) when ``keep_logits``
    is True, or when it is None (the default) and the model is inferring: ``model.training`` False
    and no gradient recorded, which is how ``Trainer.evaluate``/``predict`` call it, so that
    ``compute_metrics`` gets its predictions (with None it got ``predictions=()`` and failed, e.g. on
    ``.argmax``). Like Liger's ``skip_logits``, which keeps the logits outside training; narrower, in
    that an eval-mode model under autograd (no dropout, still training) stays lean. Otherwise
    ``logits`` is None. ``keep_logits=False`` never forms them (an evaluation of the loss alone,
    ``prediction_loss_only``, then costs no logits; ``compute_metrics`` would get nothing). Without
    labels the original forward runs, unchanged.

    Patching again only updates the options (no double wrapping); :func:`unpatch` undoes it.

    **peft.** ``model`` may be a peft model (``PeftModel``, ``PeftModelForCausalLM``, or its tuner such as
    ``LoraModel``): the patch goes on the causal LM inside (``get_base_model()``), whose forward peft's
    ends in, and ``model`` is returned; patching before peft wraps the model works the same. Adapters on
    the backbone need nothing (they run in the backbone). The LM head is resolved at every call, from
    ``get_output_embeddings()``, so adapters added, switched, merged or disabled after patching are honoured:

    * a plain ``nn.Linear``: its ``weight`` and ``bias``;
    * a peft LoRA layer (``peft.tuners.lora.Linear``) with active, unmerged adapters: its logits are
      :math:`W h + b + \sum_a s_a (B_a A_a\,\mathrm{drop}_a(h) + b_{B_a})`, computed exactly as one
      product: the fused loss runs on the hidden states extended by each :math:`s_a A_a\,\mathrm{drop}_a(h)`
      (``N × (H + Σr)``) against the head's weight extended by each :math:`B_a` (``V × (H + Σr)``), so
      ``lora_A``, ``lora_B`` and the base weight (where trainable) get the unpatched model's gradients.
      ``lora_dropout`` is applied exactly (the layer's own dropout module on the hidden states, the mask
      peft would draw), in training mode too. Memory: one copy of the head's weight (``V × (H + Σr)``,
      the concatenation) and of the hidden states during the loss; and the loss forms that weight's
      gradient (``V × (H + Σr)``, one GEMM of the head's size) even when the base weight is frozen,
      which the unpatched model skips;
    * merged adapters: the base weight, which holds them (as peft's forward does); adapters disabled
      (``with model.disable_adapter():``): the base weight, unmerging first as peft's forward does;
    * ``modules_to_save=["lm_head"]``: the active adapter's trainable copy (the original when disabled).

    Refused, with an error naming what: DoRA and other LoRA variants on the head (naming the adapter),
    other peft adapter types (LoHa, LoKr, IA³, ..., naming the class), a head class whose ``forward``
    is not ``nn.Linear``'s, a forward hook or pre-hook on the head, its ``base_layer`` or its LoRA
    modules (naming the hook; FSDP2's and ZeRO-3's parameter hooks excepted), a replaced ``forward``
    (Accelerate's device placement without offloading excepted), and LoRA on a head that FSDP2 shards as
    a unit of its own or that ZeRO-3 partitions. Checked when patching and again at every call.

    Args:
        model: a loaded instance of a class in :data:`SUPPORTED` (the class itself is not modified), or a
            peft model wrapping one.
        chunk_size, accurate: passed to :func:`~kernels_lib.fused_linear_cross_entropy`; ``chunk_size``
            None means the function's default (:func:`~kernels_lib.fused_linear_cross_entropy.default_chunk_size`:
            ``H`` rows, at least 2048, ``N / 32`` for long batches). The loss makes no host sync (``host_checks=False``): a label outside
            the vocabulary is a device-side assert, as with Transformers' own loss on CUDA.
        keep_logits: also return the logits when labels are given: True always, False never, None
            (default) when inferring (eval mode and ``torch.is_grad_enabled()`` False).

    Raises:
        ValueError: an unsupported model, naming its class and ``model_type`` and the supported classes,
            or a supported class missing what the patch needs (an ``nn.Linear`` head, a backbone,
            ``final_logit_softcapping`` on Gemma configs), or a head it cannot compute (above). At the
            call: ``labels`` (or ``shift_labels``) not of the ``(batch, sequence)`` shape of ``input_ids``
            (after ``logits_to_keep``), naming the argument and both shapes; a head it cannot compute.
    """
    if keep_logits is not None and not isinstance(keep_logits, bool):
        raise TypeError(f"keep_logits must be True, False or None; got {keep_logits!r}")
    causal_lm = _causal_lm(model)
    softcaps = SUPPORTED[_supported_class(causal_lm)]
    _install(causal_lm).loss = _LossOptions(chunk_size, accurate, keep_logits, softcaps)
    return model


def unpatch(model):
    """Restore the forward ``model`` had before :func:`patch` / :func:`add_fused_lm_head`; returns ``model``.

    A model that is not patched is returned as is.
    """
    causal_lm = _causal_lm(model)
    state = causal_lm.__dict__.pop(_STATE, None)
    if state is not None:
        if state.previous_forward is None:
            del causal_lm.forward
        else:
            causal_lm.forward = state.previous_forward
    return model


def is_patched(model) -> bool:
    """Whether :func:`patch` or :func:`add_fused_lm_head` of this module is installed on ``model``."""
    return _STATE in _causal_lm(model).__dict__


# ------------------------------------------------------------------------- public: TRL's fused-head protocol


@functools.cache
def _fused_output_class():
    """TRL's ``FusedCausalLMOutput`` when TRL is installed, else a ``ModelOutput`` with the same fields."""
    try:
        from trl.trainer.utils import FusedCausalLMOutput
    except ImportError:

        @dataclasses.dataclass
        class FusedCausalLMOutput(ModelOutput):
            loss: torch.Tensor | None = None
            log_probs: torch.Tensor | None = None
            entropy: torch.Tensor | None = None
            log_sum_sq_probs: torch.Tensor | None = None
            mean_logits: torch.Tensor | None = None
            is_top1: torch.Tensor | None = None
            label_mask: torch.Tensor | None = None
            aux_loss: torch.Tensor | None = None

    return FusedCausalLMOutput


def _trl_logit_scale(text_config) -> float:
    """The pre-softcap logit multiplier, read from the config exactly as TRL 1.16's ``add_fused_lm_head`` does."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else scale


def _fused_head_forward(model, options: _HeadOptions, arguments: dict):
    """TRL's ``fused_lm_head=True`` forward, the per-token values from :func:`fused_linear_cross_entropy`."""
    labels, shift_labels = arguments.pop("labels", None), arguments.pop("shift_labels", None)
    num_items_in_batch = arguments.pop("num_items_in_batch", None)
    arguments["use_cache"] = False
    hidden_states = model.base_model(**arguments).last_hidden_state
    if shift_labels is None:
        _check_labels("labels", labels, hidden_states, 0)
        hidden_states, labels = hidden_states[:, :-1], labels[:, 1:]
    else:
        _check_labels("shift_labels", shift_labels, hidden_states, 0)
        labels = shift_labels
    head = model.get_output_embeddings()

    def stats_of(weight, bias, hidden, target):
        hidden, target = hidden.to(weight.device), target.to(weight.device)
        autocast = nullcontext()
        if options.cast_lm_head_to_fp32:
            hidden, weight = hidden.float(), weight.float()
            bias = None if bias is None else bias.float()
            autocast = torch.autocast(hidden.device.type, enabled=False)
        with autocast:
            return tuple(fused_linear_cross_entropy(
                hidden, weight, target, bias, ignore_index=IGNORE_INDEX, reduction="none",
                softcap=options.softcap, logit_scale=options.logit_scale, temperature=options.temperature,
                return_token_stats=True, host_checks=False,
            ))  # a tuple: what FSDP2's post-forward hook walks for the tensors to hook

    stats = CrossEntropyOutput(*_with_full_head(head, stats_of, hidden_states, labels))
    labels = labels.to(stats.loss.device)
    mask = labels != IGNORE_INDEX
    denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    computed = {
        "entropy": stats.entropy,
        "log_sum_sq_probs": stats.log_sum_sq_prob,
        "mean_logits": stats.mean_logit,
        "is_top1": stats.is_top1,
    }
    return _fused_output_class()(
        loss=stats.loss.sum() / denominator,
        log_probs=-stats.loss,
        label_mask=mask,
        **{name: value for name, value in computed.items() if name in options.outputs},
    )


def add_fused_lm_head(
    model,
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    outputs: tuple[str, ...] = ("log_probs",),
) -> None:
    r"""TRL 1.16's ``add_fused_lm_head`` (same signature, same protocol), computed by kernels_lib.

    ``model(..., labels=labels, fused_lm_head=True)`` runs the backbone (``use_cache=False``), takes
    the hidden states of positions ``0..T-2`` against ``labels[:, 1:]`` (or all positions against
    pre-shifted ``shift_labels``) and returns a ``FusedCausalLMOutput`` (TRL's class when TRL is
    installed) with, per token, zero where the label is ``-100``:

    * ``log_probs`` :math:`= \log \mathrm{softmax}(c(a z)/T)_y`, with a gradient (minus the per-token
      loss of ``reduction="none"``), where :math:`a` is the config's logit scale (read as TRL reads it:
      ``logit_scale``, ``output_multiplier``, ``lm_head_multiplier``, ``1/logits_scaling``), :math:`c`
      the softcap ``final_logit_softcapping`` and :math:`T` the temperature;
    * ``entropy`` (if in ``outputs``) of that distribution, with its gradient (as TRL's: an entropy
      bonus such as GRPO's trains through it);
    * ``log_sum_sq_probs`` and ``mean_logits`` (if in ``outputs``): :math:`\log \sum_v p_v^2` and the
      mean of the scaled logits, without gradient;
    * ``is_top1`` (if in ``outputs``): whether the label is the most likely token;
    * ``label_mask``: ``labels != -100``; ``loss`` :math:`= -\sum \text{log\_probs} / D`, :math:`D` =
      ``num_items_in_batch`` or the number of valid labels (at least 1); ``aux_loss`` None (no MoE
      family is supported).

    All five come from the one pass over each logits chunk that forms the log-sum-exp. Without ``fused_lm_head=True`` the forward is the previous one (under :func:`patch` too).

    To have TRL's trainers use this head, build the trainer inside :func:`use_in_trl`; or, after
    building it, call this function on ``trainer.model`` with the arguments the trainer used
    (``SFTTrainer``: ``outputs=("log_probs", "entropy", "is_top1")``), which takes over from TRL's head.

    Raises:
        ValueError: ``outputs`` naming a field kernels_lib does not compute, or an unsupported model
            (as :func:`patch`).
    """
    unknown = [name for name in outputs if name not in FUSED_HEAD_OUTPUTS]
    if unknown:
        raise ValueError(f"outputs must be among {', '.join(FUSED_HEAD_OUTPUTS)}; got {', '.join(unknown)}")
    model = _causal_lm(model)
    _supported_class(model)
    text_config = model.config.get_text_config()
    _install(model).head = _HeadOptions(
        temperature=temperature,
        cast_lm_head_to_fp32=cast_lm_head_to_fp32,
        outputs=tuple(outputs),
        logit_scale=_trl_logit_scale(text_config),
        softcap=getattr(text_config, "final_logit_softcapping", None),
    )


@contextmanager
def use_in_trl():
    """Within the block, TRL's ``add_fused_lm_head`` is kernels_lib's :func:`add_fused_lm_head`.

    TRL's trainers add their fused LM head in ``__init__`` (``SFTTrainer`` always does, with
    ``outputs=("log_probs", "entropy", "is_top1")``), so constructing one here gives it kernels_lib's
    head, with the trainer's own arguments; training then runs unchanged::

        with kernels_lib.hf.use_in_trl():
            trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()

    Every loaded ``trl`` module's ``add_fused_lm_head`` name (``trl.trainer.utils`` and the trainer
    modules that imported it) is replaced on entry and put back on exit.

    TRL 1.16's trainers, with this head: ``SFTTrainer`` runs as with TRL's (loss, ``mean_token_accuracy``
    and ``entropy`` checked in the tests); every field the others ask for (``DPOTrainer`` and
    ``KTOTrainer``: ``mean_logits``; ``GRPOTrainer``: the entropy with its gradient) is computed, and
    checked field by field against TRL's head, but those trainers are not run in the tests.
    """
    from trl.trainer import utils as trl_utils

    theirs = trl_utils.add_fused_lm_head
    _rebind_trl(theirs, add_fused_lm_head)
    try:
        yield
    finally:
        _rebind_trl(add_fused_lm_head, theirs)


def _rebind_trl(old, new) -> None:
    """Point every loaded ``trl`` module's ``add_fused_lm_head`` that is ``old`` at ``new``."""
    for name, module in list(sys.modules.items()):
        if (name == "trl" or name.startswith("trl.")) and getattr(module, "__dict__", {}).get("add_fused_lm_head") is old:
            module.add_fused_lm_head = new
