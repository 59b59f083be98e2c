"""What the benchmark and the checks need to know about one loss, behind one interface.

This module only defines the interface; each per-loss module (``fused_linear_cross_entropy``, ``kl_div``,
...) builds its ``SPEC`` from it, and :mod:`.registry` collects them: imports flow one way,
``spec`` <- per-loss modules <- ``registry`` <- sweep, CLI, checks, widgets, overview.

A :class:`LossSpec` names the loss as the published CSV does, lists its providers (each a thin
adapter with the signature of ``kernels_lib.<loss>``), makes inputs for a size, and says how many
bytes and FLOPs a call must at least move or do (for the floors on the charts).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Inputs:
    """Positional and keyword arguments of one call, and the tensors that take gradients."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    grad_inputs: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class Provider:
    """An implementation under one name. ``load`` returns the callable, or raises ImportError /
    RuntimeError with the reason it cannot run here (a peer not installed, no CUDA)."""

    name: str
    load: Callable[[], Callable]
    description: str = ""


@dataclass(frozen=True)
class LossSpec:
    """One loss as the workbench measures it.

    Attributes:
        kernel_name: the published CSV's ``kernel_name``.
        providers: name -> Provider, in display order.
        make_inputs: ``(sizes: dict, dtype, device, options: dict, seed) -> Inputs``.
        published: the published workload: ``x_name``, ``x_label``, ``x_values``, ``sizes``, ``dtype``.
        small: a CPU-sized version of the same workload (the interpreter is slow).
        bytes_moved: ``(sizes, dtype, mode) -> bytes`` at least read and written by a fused kernel
            (:meth:`min_bytes`).
        matmul_flops: ``(sizes, mode[, input_grad]) -> FLOPs`` of the matmuls a call cannot avoid
            (:meth:`flops`); None for a loss on logits, which runs none.
        own_matmuls: the provider that times the loss's own matmuls and nothing else (fused linear
            cross-entropy's ``three_matmuls``): where a run timed it, the floor takes its time.
        baseline: the provider that is the published baseline (and, on float64 inputs, the reference).
        default_options: the loss's options as the published workload sets them.
        presets: the loss's other published workloads by name, each a dict like ``published`` (a
            second chart on another axis: JSD's B200 token sweep); the CLI runs them with ``--preset NAME``.
        extra_options: options the CLI's ``--option`` may set beyond ``default_options`` (GRPO's
            ``delta``, the cispo/sapo/vespo constants), by name, with what each is.
        published_modes: a published mode whose harness measured what another mode of ours does, mapped
            to ours (Megatron's ``backward``: a fresh forward and backward per repeat, our ``full``), so that
            the overview's agreement table pairs like with like.
    """

    kernel_name: str
    providers: dict[str, Provider]
    make_inputs: Callable[..., Inputs]
    published: dict
    small: dict
    bytes_moved: Callable[[dict, torch.dtype, str], int]
    baseline: str
    default_options: dict = field(default_factory=dict)
    presets: dict[str, dict] = field(default_factory=dict)
    extra_options: dict[str, str] = field(default_factory=dict)
    published_modes: dict[str, str] = field(default_factory=dict)
    matmul_flops: Callable[..., float] | None = None
    own_matmuls: str | None = None

    def flops(self, sizes: dict, mode: str, options: dict | None = None) -> float | None:
        """The matmul FLOPs of one call of ``mode`` at ``sizes``, with :attr:`default_options` (``options``
        over them: KTO's published harness gives ``x`` no gradient, ``input_grad=False``); None without matmuls."""
        if self.matmul_flops is None:
            return None
        chosen = {**self.default_options, **(options or {})}
        if "input_grad" in inspect.signature(self.matmul_flops).parameters and "input_grad" in chosen:
            return float(self.matmul_flops(sizes, mode, input_grad=bool(chosen["input_grad"])))
        return float(self.matmul_flops(sizes, mode))

    def min_bytes(self, sizes: dict, dtype: torch.dtype, mode: str) -> int:
        """The bytes one call of ``mode`` at ``sizes`` must at least read and write."""
        return int(self.bytes_moved(sizes, dtype, mode))

    def preset(self, name: str) -> dict:
        """The workload named ``name``: ``published``, ``small`` or one of :attr:`presets`."""
        named = {"published": self.published, "small": self.small, **self.presets}
        if name not in named:
            raise ValueError(f"{self.kernel_name} has the presets {', '.join(named)}; got {name!r}")
        return named[name]

    def published_preset(self, x_name: str) -> dict | None:
        """The published workload (``published`` or one of :attr:`presets`) that sweeps ``x_name``, or None."""
        return next((p for p in (self.published, *self.presets.values()) if p["x_name"] == x_name), None)


def vocab_sweep(n_rows: int) -> dict:
    """``published`` and ``small`` of a row-divergence chart (KL, JSD, TVD): ``V`` = 4096 … 131072 at
    ``n_rows`` rows in float32 as published, ``V`` = 512 … 4096 at 16 rows for the CPU."""
    axis = {"x_name": "V", "x_label": "vocab size", "dtype": torch.float32}
    return {
        "published": {**axis, "x_values": [4096, 8192, 16384, 32768, 65536, 131072], "sizes": {"N": n_rows}},
        "small": {**axis, "x_values": [512, 1024, 2048, 4096], "sizes": {"N": 16}},
    }


def preference_sweep() -> dict:
    """``published`` and ``small`` of the A100 preference charts (ORPO at T = 1024, CPO, SimPO, GRPO;
    our DPO): ``B`` = 2 … 16 sequences of ``T`` = 1024 tokens, ``H`` = 4096, ``V`` = 128256, bf16;
    ``B`` = 2, 4, 8 of 8 tokens, ``H`` = 32, ``V`` = 257 for the CPU."""
    axis = {"x_name": "B", "x_label": "B", "dtype": torch.bfloat16}
    return {
        "published": {**axis, "x_values": [2, 4, 8, 16], "sizes": {"T": 1024, "H": 4096, "V": 128256}},
        "small": {**axis, "x_values": [2, 4, 8], "sizes": {"T": 8, "H": 32, "V": 257}},
    }


def require_cuda(peer: str) -> None:
    """Refuse to load a peer whose kernels cannot run here (they are not written for Triton's interpreter)."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{peer}'s kernels need CUDA (they do not run in Triton's interpreter)")


def policy_and_reference(sizes: dict, dtype: torch.dtype, device, options: dict, generator: torch.Generator):
    """The inputs of a preference/RL loss with a reference model, drawn in this order from ``generator``:
    the policy's ``x`` ``(B, T, H)``, head ``(V, H)`` (and bias ``(V,)`` with ``options["bias"]``), the
    reference model's same three, and int64 targets ``(B, T)`` in ``[0, V)``. ``x ~ N(0, 1)``, heads
    ``~ N(0, 1/H)`` (logits of unit scale), biases ``~ N(0, 0.01)``; nothing requires grad yet.
    Returns ``(x, weight, bias), (ref_x, ref_weight, ref_bias), target``."""
    b, t, h, v = (int(sizes[k]) for k in ("B", "T", "H", "V"))

    def model():
        hidden = torch.randn(b, t, h, generator=generator, device=device).to(dtype)
        head = (torch.randn(v, h, generator=generator, device=device) * h**-0.5).to(dtype)
        bias = (torch.randn(v, generator=generator, device=device) * 0.1).to(dtype) if options.get("bias") else None
        return hidden, head, bias

    policy, ref = model(), model()
    return policy, ref, torch.randint(0, v, (b, t), generator=generator, device=device)
