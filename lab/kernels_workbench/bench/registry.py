"""Every loss the workbench measures, by the published CSV's ``kernel_name``: the one list of specs.

A new loss adds its bench module (which defines ``SPEC``, a :class:`~.spec.LossSpec`, or ``SPECS``,
a tuple of them for a loss with several published charts) to :data:`LOSS_MODULES`; nothing imports
this module back.
"""

from __future__ import annotations

from . import fused_linear_cross_entropy, fused_linear_kto, fused_linear_orpo, kl_div
from . import fused_linear_grpo
from . import fused_linear_cpo, fused_linear_dpo, fused_linear_simpo
from . import jsd, tvd
from . import distillation, fused_linear_jsd
from . import cross_entropy, megatron_cross_entropy
from .spec import LossSpec

#: The per-loss bench modules, in display order.
LOSS_MODULES = (fused_linear_cross_entropy, fused_linear_orpo, fused_linear_kto, kl_div, fused_linear_grpo)
LOSS_MODULES += (fused_linear_dpo, fused_linear_cpo, fused_linear_simpo)
LOSS_MODULES += (jsd, tvd)
LOSS_MODULES += (fused_linear_jsd, distillation)
LOSS_MODULES += (cross_entropy, megatron_cross_entropy)

SPECS: dict[str, LossSpec] = {
    spec.kernel_name: spec for module in LOSS_MODULES for spec in getattr(module, "SPECS", (module.SPEC,))
}


def registered_losses() -> list[str]:
    """The ``kernel_name`` of every loss the workbench measures."""
    return list(SPECS)


def get_spec(kernel_name: str) -> LossSpec:
    """The spec of ``kernel_name`` (as in the published CSV, e.g. ``kl_div``)."""
    if kernel_name not in SPECS:
        raise ValueError(f"loss must be one of {', '.join(SPECS)}; got {kernel_name!r}")
    return SPECS[kernel_name]
