"""``nn.Module`` forms of the loss functions, built from the functions' signatures: an option is written once.

:func:`loss_module` reads a function's parameters: its options (every parameter with a default that
takes no tensor, by its annotation; not ``process_group``) become the constructor's arguments, in
the function's order, with its defaults and its documentation; the tensors (and ``process_group``)
stay with ``forward``, which passes them on with the module's options. A few tensors can be held by the
module instead (``buffers``: ``class_weight``, as ``nn.CrossEntropyLoss`` holds its ``weight``), and a
module may hold ``process_group`` too (``held``).

The module checks its options when it is built (``check``: a function whose parameters are named
after some of the options, or that takes ``**options``), so a bad option is refused at construction
rather than at the first call. The options stay as given, in ``module.options`` (and readable as
attributes: ``module.reduction``), and ``repr`` shows them.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import torch

_P = inspect.Parameter


def _takes_tensor(parameter: inspect.Parameter) -> bool:
    """Whether the parameter's annotation names a tensor (``torch.Tensor | None``, ``torch.Tensor | float``)."""
    annotation = parameter.annotation
    return "Tensor" in (annotation if isinstance(annotation, str) else repr(annotation))


def option_names(function: Callable, held: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The function's options: the parameters with a default that take no tensor (and are not
    ``process_group``), plus those named in ``held``, in the function's order."""
    return tuple(
        p.name for p in inspect.signature(function).parameters.values()
        if p.name in held or (p.default is not _P.empty and not _takes_tensor(p) and p.name != "process_group")
    )


def _forward_signature(parameters: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """The function's other parameters as ``forward`` takes them: a keyword-only one becomes positional too
    where Python allows it (every keyword-only one before it did, and it has a default or none before it has)."""
    out, keyword_only, defaulted = [], False, False
    for p in parameters:
        if p.kind is _P.KEYWORD_ONLY and not keyword_only and (p.default is not _P.empty or not defaulted):
            p = p.replace(kind=_P.POSITIONAL_OR_KEYWORD)
        keyword_only = keyword_only or p.kind is _P.KEYWORD_ONLY
        defaulted = defaulted or (p.kind is _P.POSITIONAL_OR_KEYWORD and p.default is not _P.empty)
        out.append(p)
    return out


def _argument_docs(function: Callable, names: tuple[str, ...]) -> str:
    """The entries of the function's ``Args:`` section that document ``names`` (an entry may name several)."""
    doc = inspect.getdoc(function) or ""
    section = re.search(r"^Args:\n(.*?)(?:^\S|\Z)", doc, re.S | re.M)
    if section is None:
        return ""
    entries = re.findall(r"^( {4}\S.*\n(?: {8}.*\n?)*)", section.group(1) + "\n", re.M)
    kept = []
    for entry in entries:
        named = [n.strip() for n in entry.split(":", 1)[0].split(",")]
        if any(n in names for n in named):
            kept.append(entry.rstrip("\n"))
    return "\n".join(kept)


def loss_module(function: Callable, name: str, summary: str, *, check: Callable | None = None,
                fixed: dict | None = None, buffers: tuple[str, ...] = (), held: tuple[str, ...] = (),
                module: str | None = None) -> type:
    """The ``nn.Module`` class ``name`` of ``function``: ``name(**options)(*tensors)`` is ``function(*tensors, **options)``.

    Args:
        summary: the class docstring's first paragraph.
        check: the options' checks, run at construction with the options its parameters name (all of
            them if it takes ``**options``) and ``fixed``.
        fixed: values the checks (and ``repr``) show beside the options, where the function fixes an
            option of another (SimPO's ``loss_type``).
        buffers: tensor parameters the module holds (registered buffers, given to the constructor).
        held: other parameters the constructor takes as options (``CrossEntropyLoss``'s ``process_group``).
        module: the ``__module__`` of the class (where it is documented), default the function's.
    """
    signature = inspect.signature(function)
    names = option_names(function, buffers + held)
    options = [signature.parameters[n].replace(kind=_P.POSITIONAL_OR_KEYWORD) for n in names]
    init_signature = inspect.Signature([_P("self", _P.POSITIONAL_OR_KEYWORD), *options])
    rest = [p for p in signature.parameters.values() if p.name not in names]
    forward_signature = inspect.Signature([_P("self", _P.POSITIONAL_OR_KEYWORD), *_forward_signature(rest)],
                                          return_annotation=signature.return_annotation)
    fixed = dict(fixed or {})
    check_parameters = None if check is None else inspect.signature(check).parameters
    check_all = check_parameters is not None and any(p.kind is _P.VAR_KEYWORD for p in check_parameters.values())

    def __init__(self, *args, **kwargs):
        bound = init_signature.bind(self, *args, **kwargs)  # a TypeError names an unknown or missing option
        bound.apply_defaults()
        values = {k: val for k, val in bound.arguments.items() if k != "self"}
        torch.nn.Module.__init__(self)
        if check is not None:
            given = {**values, **fixed}
            check(**(given if check_all else {k: val for k, val in given.items() if k in check_parameters}))
        for buffer in buffers:
            self.register_buffer(buffer, values.pop(buffer))
        self.options = values

    def forward(self, *args, **kwargs):
        bound = forward_signature.bind(self, *args, **kwargs)
        arguments = {k: val for k, val in bound.arguments.items() if k != "self"}
        held = {buffer: getattr(self, buffer) for buffer in buffers}
        return function(**arguments, **held, **self.options)

    def __getattr__(self, attribute):
        options = self.__dict__.get("options")
        if options is not None and attribute in options:
            return options[attribute]
        return torch.nn.Module.__getattr__(self, attribute)

    def extra_repr(self) -> str:  # the options, then what the function fixes (SimPO's loss_type)
        return ", ".join(f"{k}={val!r}" for k, val in {**self.options, **fixed}.items())

    __init__.__signature__ = init_signature
    forward.__signature__ = forward_signature
    docs = _argument_docs(function, names)
    plain = inspect.Signature([p.replace(annotation=_P.empty) for p in list(forward_signature.parameters.values())[1:]])
    doc = (f"{summary}\n\nConstructor arguments: the options of :func:`{function.__name__}`, with its defaults"
           f"{':' if docs else '.'}\n\n{docs}\n\n``forward{plain}``:"
           f" the other arguments of :func:`{function.__name__}`.")
    namespace = {"__init__": __init__, "forward": forward, "__getattr__": __getattr__, "extra_repr": extra_repr,
                 "__doc__": doc, "__module__": module or function.__module__, "loss_function": staticmethod(function)}
    return type(name, (torch.nn.Module,), namespace)
