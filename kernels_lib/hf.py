r"""Hugging Face causal LMs on :func:`~kernels_lib.fused_linear_cross_entropy`: the loss without the logits.

Two patches of a loaded causal LM instance (the class is left alone), both on its ``forward``:

* :func:`patch`: ``model(..., labels=...)`` returns the loss the model's own forward computes, from its
  last hidden states and its LM head, never forming the ``B × T × V`` logits. With hidden states
  :math:`h_t` (the head's input, after ``logits_to_keep``), the head :math:`W, b` (tied embeddings
  included: the head's weight *is* the tied parameter) and the targets :math:`y_t`,

  .. math::

      z_t = c(a\,(W h_t + b)) / T, \qquad
      L = \frac{1}{D} \sum_{t:\ y_t \ne -100} \big(\log \textstyle\sum_v e^{z_{tv}} - z_{t y_t}\big) \;(+\ \text{terms not of the logits}),

  where :math:`a` and :math:`T` are the logit scales the forward applies before and after the cap
  (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``, Falcon-H1's ``lm_head_multiplier``, ...),
  :math:`c(z) = s\tanh(z/s)` its softcap (Gemma's ``final_logit_softcapping``; the identity elsewhere), each
  read where and when the forward reads it. With Transformers' ``ForCausalLMLoss`` the targets are the
  labels shifted by one (the last position gets ``-100``; or ``shift_labels`` as given) and :math:`D` is
  ``num_items_in_batch`` when given (what ``Trainer`` passes under gradient accumulation), else the number
  of valid labels; with an unshifted ``CrossEntropyLoss`` (Bart-style decoders) the labels as given and
  the mean. Terms the forward adds to the loss from elsewhere (an MoE router's auxiliary loss,
  ``router_aux_loss_coef × aux_loss`` under ``output_router_logits``) are added by the forward's own
  statements. One difference from Transformers: a batch whose labels are all ``-100`` gives loss 0 (and
  zero gradients) where Transformers gives NaN.
* :func:`add_fused_lm_head`: TRL 1.16's fused-head protocol: ``model(..., labels=..., fused_lm_head=True)``
  returns a ``FusedCausalLMOutput`` of per-token log-probabilities, entropy, ``log Σ p²``, mean
  logit and top-1 flags computed by kernels_lib, so that TRL's trainers run on it unchanged (see :func:`use_in_trl`).

Without labels the model's original forward runs, unchanged (generation and inference give the same
logits as before). :func:`unpatch` restores the forward the model had before the first patch.

Which models: any class whose forward is backbone -> head -> logit transforms -> loss, found from the
model itself (:func:`forward_pattern`), not from a list. The forward's source is read
(``inspect.getsource``) and must be, at its top level: statements up to one that forms the logits as
``self.<head>(hidden)`` (optionally ``.float()``, times or over a scale), with ``self.<head>`` the model's
``get_output_embeddings()``; then only known transforms of the logits (``logits * E``, ``logits / E``,
Gemma's softcap block or ``tanh(logits / E) * E``) and statements that do not touch them; then
``if labels is not None:`` computing ``loss`` with ``self.loss_function`` (which must be Transformers'
``ForCausalLMLoss``) or an unshifted ``CrossEntropyLoss()``; after it, statements that use the logits
only to hand them on (``logits=logits``, a tuple) and may add to ``loss`` (the router's auxiliary loss).
The forward is then rewritten once per class: the statements up to the head run as written (the backbone
is called as the model calls it, ``model.model``, ``transformer``, ``model.decoder``, a multimodal
``*ForConditionalGeneration``'s language model alike), the head's call and the transforms run only when
the logits are kept, the loss comes from the head's input through kernels_lib with the transforms' values
(evaluated at each call, where the forward evaluates them), and everything after the loss runs as written
(the model's own output class, its auxiliary loss, its ``return_dict`` handling); its decorators are applied
again. Anything else is refused when patching, with a ValueError naming the class, its ``model_type`` and the
statement that departs (a z-loss or another term of the logits, an unknown transform, a head that is not the
output embeddings such as BERT's ``cls`` transform, a custom loss): never a silent difference. Every class of
the installed Transformers' ``AutoModelForCausalLM`` mapping is checked on a tiny random configuration against
its own loss and gradients (``kernels_workbench.hf_coverage``, ``tests/test_hf_coverage.py``, the table of
notebook 05).

The head's ``weight`` and ``bias`` are read directly, not through its ``forward``; at each call, whatever would change that forward's
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

import ast
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import types
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import ModelOutput

from .fused_linear_cross_entropy import CrossEntropyOutput, fused_linear_cross_entropy

__all__ = ["ForwardPattern", "forward_pattern", "patch", "unpatch", "is_patched", "add_fused_lm_head", "use_in_trl", "FUSED_HEAD_OUTPUTS"]

#: The per-token fields of TRL's ``FusedCausalLMOutput`` (all of them, computed by kernels_lib).
FUSED_HEAD_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
IGNORE_INDEX = -100
_STATE = "_kernels_lib_hf"


@dataclasses.dataclass
class _LossOptions:
    chunk_size: int | None
    accurate: bool
    keep_logits: bool | None  # None: the logits when inferring (eval mode, no grad), as Trainer.evaluate needs them
    pattern: ForwardPattern  # the class's forward, read and rewritten (forward_pattern)
    skip_ignored: bool = True  # ignored rows dropped before the matmuls (one host sync a step)

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


def _check_model(model, *, backbone: bool = False) -> ForwardPattern:
    """The model's :class:`ForwardPattern`, its head computable by kernels_lib (and, with ``backbone``, its
    ``base_model`` a backbone), or a ValueError naming the class and ``model_type`` and why."""
    pattern = forward_pattern(model)
    what = f"{type(model).__name__} (model_type={getattr(model.config, 'model_type', None)!r})"
    try:  # checked again at each call: an adapter or a hook may come after patching
        _resolve_head(model.get_output_embeddings(), at_call=False)
    except ValueError as error:
        reason = str(error).removeprefix("kernels_lib.hf: ")
        raise ValueError(f"kernels_lib.hf: {what} has no nn.Linear LM head kernels_lib can compute: {reason}") from None
    if backbone and model.base_model is model:
        raise ValueError(f"kernels_lib.hf: {what} has no backbone {model.base_model_prefix!r} (model.base_model)")
    return pattern


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
            return state.loss.pattern.forward(model, *args, **kwargs)
    return _previous_forward(model, state)(*args, **kwargs)


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


# ------------------------------------------------------------------------- the model's forward, read from its source


@dataclasses.dataclass(frozen=True)
class ForwardPattern:
    """What :func:`patch` reads from a class's ``forward`` (:func:`forward_pattern`): the attribute it calls as the
    head, the loss it computes, the transforms it applies to the logits (expressions evaluated at each call, where
    the forward evaluates them) and the statements after the loss it keeps as written (an MoE router's auxiliary
    loss, the output); ``forward`` is the rewritten forward that :func:`patch` runs when labels are given."""

    cls: str
    head: str
    loss: str  # "ForCausalLMLoss" (shifted labels, num_items_in_batch) or "CrossEntropyLoss" (unshifted, mean)
    transforms: tuple[str, ...]
    kept: tuple[str, ...]
    reads: tuple[str, ...] = dataclasses.field(repr=False, compare=False)  # the transforms' expressions of self alone
    forward: object = dataclasses.field(repr=False, compare=False)

    def describe(self) -> str:
        """One line: backbone -> head -> transforms -> loss (+ what is kept after it)."""
        steps = ["backbone", f"self.{self.head}", *self.transforms, self.loss]
        return " -> ".join(steps) + (f" (+ {'; '.join(self.kept)})" if self.kept else "")


class _Refused(ValueError):
    """A forward that departs from backbone -> head -> transforms -> loss; the message is the reason."""


_SKIPPED_DECORATORS = ("auto_docstring",)  # writes documentation only; every other decorator is re-applied
_SAME_VALUE_METHODS = ("float", "contiguous")  # on the head's output: the loss is formed in float32 anyway
_TANH = ("torch.tanh", "nn.functional.tanh", "F.tanh", "torch.nn.functional.tanh")


def _names(node) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _is_name(node, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _assigns(statement, name: str) -> bool:
    return isinstance(statement, ast.Assign) and len(statement.targets) == 1 and _is_name(statement.targets[0], name)


def _peel(node):
    """``x.float()`` / ``x.contiguous()`` -> ``x``."""
    while (isinstance(node, ast.Call) and not node.args and not node.keywords and isinstance(node.func, ast.Attribute)
           and node.func.attr in _SAME_VALUE_METHODS):
        node = node.func.value
    return node


def _is_none_test(test, left=None) -> bool:
    """``X is not None`` (``labels is not None`` when ``left`` is given)."""
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
            and (left is None or _is_name(test.left, left)))


def _scale_op(statement, logits: str):
    """``logits = logits * E`` or ``/ E`` (also ``*=``, ``/=``) -> ("mul" | "div", E); else None."""
    if isinstance(statement, ast.AugAssign) and _is_name(statement.target, logits):
        op, value = statement.op, statement.value
    elif _assigns(statement, logits) and isinstance(statement.value, ast.BinOp) and _is_name(_peel(statement.value.left), logits):
        op, value = statement.value.op, statement.value.right
    else:
        return None
    if isinstance(op, (ast.Mult, ast.Div)) and logits not in _names(value):
        return ("mul" if isinstance(op, ast.Mult) else "div", value)
    return None


def _softcap_op(statement, logits: str):
    """Gemma's cap, ``if E is not None: logits = logits / E; logits = tanh(logits); logits = logits * E`` (E may be
    a walrus), or ``logits = tanh(logits / E) * E`` -> ("softcap", E); else None."""
    same = lambda a, b: ast.dump(a) == ast.dump(b)  # noqa: E731
    tanh = lambda node: isinstance(node, ast.Call) and ast.unparse(node.func) in _TANH and len(node.args) == 1  # noqa: E731
    if isinstance(statement, ast.If) and not statement.orelse and len(statement.body) == 3 and _is_none_test(statement.test):
        cap = statement.test.left
        inner = ast.Name(cap.target.id, ast.Load()) if isinstance(cap, ast.NamedExpr) else cap
        first, middle, last = statement.body
        first, last = _scale_op(first, logits), _scale_op(last, logits)
        if (first and last and first[0] == "div" and last[0] == "mul" and same(first[1], inner) and same(last[1], inner)
                and _assigns(middle, logits) and tanh(middle.value) and _is_name(middle.value.args[0], logits)):
            return ("softcap", cap)
        return None
    if _assigns(statement, logits):
        value = statement.value
        if (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult) and tanh(value.left)
                and isinstance(value.left.args[0], ast.BinOp) and isinstance(value.left.args[0].op, ast.Div)
                and _is_name(_peel(value.left.args[0].left), logits) and same(value.left.args[0].right, value.right)
                and logits not in _names(value.right)):
            return ("softcap", value.right)
    return None


def _loss_logits_name(section) -> str | None:
    """The name the loss section takes the logits from: ``self.loss_function``'s first argument (or ``logits=``),
    or what ``CrossEntropyLoss`` gets ``.view``-ed."""
    for node in ast.walk(section):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.loss_function":
            given = node.args[:1] + [k.value for k in node.keywords if k.arg == "logits"]
            return given[0].id if given and isinstance(given[0], ast.Name) else None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "view"
                and isinstance(node.func.value, ast.Name) and node.func.value.id != "labels"):
            return node.func.value.id
    return None


def _loss_kind(section, logits: str):
    """The loss section ``if labels is not None: ...`` -> ("ForCausalLMLoss", the ``self.loss_function`` call) or
    ("CrossEntropyLoss", None) for ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))``; else None."""
    body = list(section.body)
    if body and _assigns(body[0], "labels") and ast.unparse(body[0].value) == f"labels.to({logits}.device)":
        body = body[1:]
    if len(body) == 1 and _assigns(body[0], "loss") and isinstance(body[0].value, ast.Call):
        call = body[0].value
        others = call.args[1:] + [k.value for k in call.keywords if k.arg != "logits"]
        if ast.unparse(call.func) == "self.loss_function" and not any(logits in _names(o) for o in others):
            return "ForCausalLMLoss", call
    if len(body) == 2 and all(isinstance(s, ast.Assign) and len(s.targets) == 1 for s in body):
        made, used = body
        call = used.value
        if (ast.unparse(made.value) == "CrossEntropyLoss()" and _assigns(used, "loss") and isinstance(call, ast.Call)
                and ast.unparse(call.func) == ast.unparse(made.targets[0]) and len(call.args) == 2 and not call.keywords
                and re.fullmatch(rf"{logits}\.view\(-1, [\w.()-]+\)", ast.unparse(call.args[0]))
                and ast.unparse(call.args[1]) == "labels.view(-1)"):
            return "CrossEntropyLoss", None
    return None


def _hands_logits_on(statement, logits: str) -> bool:
    """Whether ``statement`` uses ``logits`` only to hand it on (``logits=logits`` in a call, an element of a tuple),
    so that it means the same when the logits are not formed (None)."""
    parents = {child: node for node in ast.walk(statement) for child in ast.iter_child_nodes(node)}
    return all(
        isinstance(parents.get(node), (ast.keyword, ast.Tuple))
        for node in ast.walk(statement) if isinstance(node, ast.Name) and node.id == logits and isinstance(node.ctx, ast.Load)
    ) and not any(isinstance(node, ast.Name) and node.id == logits and not isinstance(node.ctx, ast.Load)
                  for node in ast.walk(statement))


def _short(node, limit: int = 110) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse(code: str):
    return ast.parse(code).body[0]


@functools.cache
def _pattern_of(cls) -> ForwardPattern:
    """Read ``cls.forward`` and rewrite it: the statements up to the head as written; the head's call and the logit
    transforms only when the logits are kept; the loss from the head's input by kernels_lib; the statements after the
    loss as written (they may hand the logits on, nothing else). Raises :class:`_Refused` with the reason."""
    raw = inspect.unwrap(cls.forward)
    try:
        definition = ast.parse(textwrap.dedent(inspect.getsource(raw))).body[0]
    except (OSError, TypeError, SyntaxError) as error:
        raise _Refused(f"the source of its forward cannot be read ({error})") from None
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if any(isinstance(n, ast.Call) and _is_name(n.func, "super") for n in ast.walk(definition)):
        raise _Refused("its forward calls super()")
    at = next((i for i, s in enumerate(body) if isinstance(s, ast.If) and _is_none_test(s.test, "labels")
               and any(_is_name(t, "loss") for n in ast.walk(s) for t in getattr(n, "targets", [getattr(n, "target", None)]))), None)
    if at is None:
        raise _Refused("its forward has no top-level `if labels is not None:` computing `loss`")
    section = body[at]
    logits = _loss_logits_name(section)
    kind = _loss_kind(section, logits) if logits else None
    if kind is None:
        raise _Refused(f"its loss is not Transformers' ForCausalLMLoss nor an unshifted CrossEntropyLoss: {_short(section, 300)}")
    loss, call = kind
    head_at = next((i for i in range(at) if _assigns(body[i], logits)), None)
    if head_at is None:
        raise _Refused(f"its forward forms `{logits}` in a branch or a loop, not as one statement")
    head_value = body[head_at].value
    ops, outer = [], _peel(head_value)
    if isinstance(outer, ast.BinOp) and isinstance(outer.op, (ast.Mult, ast.Div)) and isinstance(_peel(outer.left), ast.Call):
        ops.append(("mul" if isinstance(outer.op, ast.Mult) else "div", outer.right))
        outer = _peel(outer.left)
    if not (isinstance(outer, ast.Call) and isinstance(outer.func, ast.Attribute) and _is_name(outer.func.value, "self")
            and len(outer.args) == 1 and not outer.keywords and not isinstance(outer.args[0], ast.Starred)):
        raise _Refused(f"its forward forms the logits as `{_short(body[head_at])}`, not as self.<head>(hidden states)")
    head, hidden = outer.func.attr, outer.args[0]
    if any(logits in _names(s) for s in body[:head_at]):
        raise _Refused(f"its forward uses `{logits}` before the head")
    rewritten = list(body[:head_at])
    rewritten.append(_parse(f"_kl_h = {ast.unparse(hidden)}"))
    rewritten.append(_parse("_kl_ops = []"))
    rewritten.append(_parse(f"{logits} = ({ast.unparse(head_value)}) if _kl_.keeps_logits(self) else None"))
    for op in ops:
        rewritten.append(_parse(f"_kl_ops.append(({op[0]!r}, {ast.unparse(op[1])}))"))
    for statement in body[head_at + 1:at]:
        op = _softcap_op(statement, logits) or _scale_op(statement, logits)
        if op is not None:
            ops.append(op)
            rewritten.append(_parse(f"_kl_ops.append(({op[0]!r}, {ast.unparse(op[1])}))"))
            guard = _parse(f"if {logits} is not None:\n    pass")
            guard.body = [statement]
            rewritten.append(guard)
        elif logits in _names(statement) or ("loss" in _names(statement) and ast.unparse(statement) != "loss = None"):
            raise _Refused(f"its forward applies `{_short(statement)}` to the logits, a transform kernels_lib does not know")
        else:
            rewritten.append(statement)
    varkw = definition.args.kwarg.arg if definition.args.kwarg else None
    keep = "logits_to_keep" if any(a.arg == "logits_to_keep" for a in definition.args.args + definition.args.kwonlyargs) else "0"
    if loss == "ForCausalLMLoss":
        test = "labels is not None" + (f" or {varkw}.get('shift_labels') is not None" if varkw else "")
        args = ", ".join([ast.unparse(a) for a in call.args] + [ast.unparse(k) if k.arg is None else f"{k.arg}={ast.unparse(k.value)}" for k in call.keywords])
        args = args.replace("**", "**") if args else ""
        replacement = _parse(f"if {test}:\n    loss = _kl_.causal_loss(self, _kl_h, _kl_ops, {keep}, {args})")
    else:
        replacement = _parse(f"if labels is not None:\n    loss = _kl_.unshifted_loss(self, _kl_h, _kl_ops, {keep}, labels)")
    rewritten.append(replacement)
    kept = []
    for statement in body[at + 1:]:
        if not _hands_logits_on(statement, logits) or "loss_function" in ast.unparse(statement):
            raise _Refused(f"its forward uses the logits after the loss: `{_short(statement)}`")
        if any(isinstance(n, ast.AugAssign) and _is_name(n.target, "loss") or isinstance(n, ast.Assign)
               and any(_is_name(t, "loss") for t in n.targets) for n in ast.walk(statement)):
            kept.append(_short(statement, 80))  # a term added to the loss, as the model adds it (a router's aux loss)
    rewritten.extend(body[at + 1:])
    function = ast.FunctionDef(name=definition.name, args=definition.args, body=rewritten, decorator_list=[],
                               returns=None, type_params=[])
    maker = ast.FunctionDef(name="_kl_make", args=_parse("def f(_kl_): pass").args,
                            body=[function, ast.Return(ast.Name(definition.name, ast.Load()))],
                            decorator_list=[], returns=None, type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[maker], type_ignores=[]))
    namespace: dict = {}
    exec(compile(module, f"<kernels_lib.hf: {cls.__qualname__}.forward, rewritten>", "exec"), raw.__globals__, namespace)
    forward = namespace["_kl_make"](_REWRITE_HELPERS)
    for attribute in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(forward, attribute, getattr(raw, attribute))
    for decorator in reversed(definition.decorator_list):
        if ast.unparse(decorator).split("(")[0] not in _SKIPPED_DECORATORS:
            forward = eval(compile(ast.Expression(decorator), "<decorator>", "eval"), raw.__globals__)(forward)
    names = {"mul": "× {}", "div": "÷ {}", "softcap": "softcap({})"}
    transforms = tuple(names[k].format(_short(v.value if isinstance(v, ast.NamedExpr) else v, 60)) for k, v in ops)
    values = [v.value if isinstance(v, ast.NamedExpr) else v for _, v in ops]
    reads = tuple(ast.unparse(v) for v in values if _names(v) <= {"self"})
    return ForwardPattern(cls.__name__, head, loss, transforms, tuple(kept), reads, forward)


def _scalar(value, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            raise ValueError(f"kernels_lib.hf: the {what} is a tensor with a gradient (learnable); kernels_lib takes a constant")
        if value.numel() != 1:
            raise ValueError(f"kernels_lib.hf: the {what} has shape {tuple(value.shape)}; kernels_lib takes one number")
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"kernels_lib.hf: the {what} is {value!r}; kernels_lib takes a number")


def _logit_transform(ops) -> tuple[float, float | None, float]:
    """The forward's transforms, in order, as the kernel's ``c = softcap_s(a·z) / T``: (a, s, T)."""
    scale, cap, after = 1.0, None, 1.0
    for kind, value in ops:
        if kind == "softcap":
            if value is None:
                continue
            if cap is not None:
                raise ValueError("kernels_lib.hf: the forward softcaps the logits twice; kernels_lib applies one cap")
            cap = _scalar(value, "logit softcap")
            continue
        factor = _scalar(value, "logit scale")
        factor = factor if kind == "mul" else 1.0 / factor
        if cap is None:
            scale *= factor
        else:
            after *= factor
    return scale, cap, 1.0 / after


def _check_loss_function(model) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    if model.loss_function is not ForCausalLMLoss:
        raise ValueError(
            f"kernels_lib.hf: {type(model).__name__}.loss_function is {getattr(model.loss_function, '__qualname__', model.loss_function)!r}"
            f" (loss_type={getattr(model, 'loss_type', None)!r}), not Transformers' ForCausalLMLoss"
        )


def _head_loss(model, hidden, target, ops, num_items_in_batch, ignore_index, shift: bool):
    """The fused loss of the head's input against ``target`` (``shift``: labels, padded and shifted inside the loss's
    one graph break, so that a compiled forward stays one graph before it), with the forward's transforms."""
    options = getattr(model, _STATE).loss
    scale, cap, temperature = _logit_transform(ops)

    def loss_of(weight, bias, hidden, target):
        if shift:
            target = F.pad(target, (0, 1), value=ignore_index)[..., 1:]
        return fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]).to(weight.device),
            weight,
            target.reshape(-1).to(weight.device),
            bias,
            ignore_index=ignore_index,
            softcap=cap,
            logit_scale=scale,
            temperature=temperature,
            num_items_in_batch=num_items_in_batch,
            chunk_size=options.chunk_size,
            accurate=options.accurate,
            host_checks=False,  # a bad label is a device-side assert, as in torch
            skip_ignored=options.skip_ignored,
        )

    return _with_full_head(model.get_output_embeddings(), loss_of, hidden, target)


def _causal_loss(model, hidden, ops, logits_to_keep, logits, labels, vocab_size=None, num_items_in_batch=None,
                 ignore_index=IGNORE_INDEX, shift_labels=None, **_):
    """``ForCausalLMLoss`` (its signature) from the head's input: labels padded and shifted, or ``shift_labels``."""
    _check_loss_function(model)
    if shift_labels is None:
        _check_labels("labels", labels, hidden, logits_to_keep)
        return _head_loss(model, hidden, labels, ops, num_items_in_batch, ignore_index, shift=True)
    _check_labels("shift_labels", shift_labels, hidden, logits_to_keep)
    return _head_loss(model, hidden, shift_labels, ops, num_items_in_batch, ignore_index, shift=False)


def _unshifted_loss(model, hidden, ops, logits_to_keep, labels):
    """``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))``: no shift, the mean over labels other than -100."""
    _check_labels("labels", labels, hidden, logits_to_keep)
    return _head_loss(model, hidden, labels, ops, None, IGNORE_INDEX, shift=False)


_REWRITE_HELPERS = types.SimpleNamespace(
    keeps_logits=lambda model: getattr(model, _STATE).loss.keeps_logits(model),
    causal_loss=_causal_loss,
    unshifted_loss=_unshifted_loss,
)


def forward_pattern(model_or_class) -> ForwardPattern:
    """How :func:`patch` reads the forward of a model (or of its class), or a ValueError naming the class and why it
    is refused. For an instance, the head the forward calls must be ``get_output_embeddings()``, the loss function
    Transformers' ``ForCausalLMLoss``, and every config value the transforms read present."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    model_type = getattr(getattr(model_or_class, "config", None), "model_type", None) or getattr(
        getattr(cls, "config_class", None), "model_type", None)
    what = f"{cls.__name__} (model_type={model_type!r})"
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ValueError(f"kernels_lib.hf: {what} is not a torch module")
    try:
        pattern = _pattern_of(cls)
    except _Refused as refusal:
        raise ValueError(f"kernels_lib.hf does not support {what}: {refusal}") from None
    if isinstance(model_or_class, type):
        return pattern
    model = model_or_class
    head = model.get_output_embeddings()
    called = getattr(model, pattern.head, None)
    if called is not head:
        raise ValueError(
            f"kernels_lib.hf does not support {what}: its forward calls self.{pattern.head} "
            f"({type(called).__name__}) on the hidden states, which is not its output embeddings "
            f"(get_output_embeddings() is {type(head).__name__}): the forward computes more than the head"
        )
    for expression in pattern.reads:  # evaluated again at each call, where the forward evaluates it
        try:
            eval(expression, {}, {"self": model})
        except AttributeError as error:
            raise ValueError(f"kernels_lib.hf: {what}'s forward reads {expression}, which fails: {error}") from None
    if pattern.loss == "ForCausalLMLoss":
        try:
            _check_loss_function(model)
        except ValueError as error:
            raise ValueError(f"kernels_lib.hf does not support {what}: {str(error).removeprefix('kernels_lib.hf: ')}") from None
    return pattern


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


def patch(model, *, chunk_size: int | None = None, accurate: bool = False, keep_logits: bool | None = None,
          skip_ignored: bool = True):
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
        model: a loaded causal LM whose forward :func:`forward_pattern` reads (the class itself is not
            modified), or a peft model wrapping one.
        chunk_size, accurate: passed to :func:`~kernels_lib.fused_linear_cross_entropy`; ``chunk_size``
            None means the function's default (:func:`~kernels_lib.fused_linear_cross_entropy.default_chunk_size`:
            ``H`` rows, at least 2048, ``N / 32`` for long batches). The labels are not checked on the host
            (``host_checks=False``): a label outside the vocabulary is a device-side assert, as with Transformers'
            own loss on CUDA.
        skip_ignored: drop the positions whose label is ``-100`` (the prompt in SFT, the padding) before the
            head's matmuls, so that the loss costs what its valid tokens cost; exact (the loss and every gradient
            are unchanged). The trade: one host sync per step (the count of valid rows sets the size of the
            gathered rows). False keeps the step free of host syncs, for small launch-bound steps.
        keep_logits: also return the logits when labels are given: True always, False never, None
            (default) when inferring (eval mode and ``torch.is_grad_enabled()`` False).

    Raises:
        ValueError: an unsupported model, naming its class and ``model_type`` and the statement of its
            forward that departs from the pattern (:func:`forward_pattern`), or one missing what the patch needs
            (an ``nn.Linear`` head, a config value its transforms read), or a head it cannot compute (above). At the
            call: ``labels`` (or ``shift_labels``) not of the ``(batch, sequence)`` shape of ``input_ids``
            (after ``logits_to_keep``), naming the argument and both shapes; a head it cannot compute.
    """
    if keep_logits is not None and not isinstance(keep_logits, bool):
        raise TypeError(f"keep_logits must be True, False or None; got {keep_logits!r}")
    causal_lm = _causal_lm(model)
    pattern = _check_model(causal_lm)
    _install(causal_lm).loss = _LossOptions(chunk_size, accurate, keep_logits, pattern, skip_ignored)
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
      ``num_items_in_batch`` or the number of valid labels (at least 1); ``aux_loss`` None (a model whose forward adds a
      router's auxiliary loss is refused).

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
    pattern = _check_model(model, backbone=True)
    if pattern.loss != "ForCausalLMLoss" or pattern.kept:
        what = "adds to its loss (" + "; ".join(pattern.kept) + ")" if pattern.kept else "does not use ForCausalLMLoss"
        raise ValueError(
            f"kernels_lib.hf: {type(model).__name__}'s forward {what}, which TRL's fused-head protocol (shifted labels, "
            f"no auxiliary loss here) would drop; use kernels_lib.hf.patch for this model"
        )
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
