"""An A/B arm: kernels_lib's default with some module constants set for the calls inside, put back after.

A route or a block size that is not yet the default lives behind a module constant (the fused CE's
``STORE_EXPONENTIALS`` and ``CLASS_MAJOR_ROWS_PER_HIDDEN``, ``chunks.matmuls.DX_BLOCK_ROWS``, the sequence
losses' ``STORE_EXPONENTIALS``), so that the measured arm runs exactly the code a user would get once the
constant's default changes. The A/B scripts (``studies/flce_frontier.py``'s arms,
:mod:`.sequence_exponentials_ab`) set them through :func:`constants_set`, as a test's monkeypatch would.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def constants_set(settings: dict[str, dict[str, object]]) -> Iterator[None]:
    """Set ``{module name: {constant: value}}`` for the calls inside the ``with``, then put every old value
    back (also when the calls raise). A name the module lacks raises, naming both, before anything is
    set: a misspelt constant would otherwise measure the default twice under two names."""
    modules = {name: importlib.import_module(name) for name in settings}
    for name, values in settings.items():
        missing = sorted(key for key in values if not hasattr(modules[name], key))
        if missing:
            raise AttributeError(f"{name} has no constant {', '.join(missing)} to set for an arm")
    saved = [(modules[name], key, getattr(modules[name], key)) for name, values in settings.items() for key in values]
    try:
        for name, values in settings.items():
            for key, value in values.items():
                setattr(modules[name], key, value)
        yield
    finally:
        for module, key, value in reversed(saved):
            setattr(module, key, value)


def within(make_context: Callable[[], contextlib.AbstractContextManager], fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` run inside a fresh ``make_context()`` at each call: an arm's timed callable."""

    def call():
        with make_context():
            fn()

    return call


def flat_outputs(fn: Callable[[], object], grad_inputs, make_context=contextlib.nullcontext):
    """The loss of ``fn()`` (a tensor, or a result with ``.loss``) and the gradients it leaves on ``grad_inputs``,
    run inside ``make_context()``, flattened into one float64 vector (an arm's outputs, to set against another's)."""
    import torch

    for t in grad_inputs:
        t.grad = None
    with make_context():
        out = fn()
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
    return torch.cat([loss.detach().double().reshape(-1)] + [t.grad.double().reshape(-1) for t in grad_inputs])
