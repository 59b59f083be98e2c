"""The non-tensor options of the fused linear cross-entropy, after validation, as the kernels take them.

:class:`_Options` is what the autograd Function and every route read: the user's values as given
(floats made floats), the factor the logits are formed with (``logit_scale / temperature``, riding on
the matmul's alpha, so that no pass over the ``N × V`` logits applies it) and the kernel's keyword
arguments (the softcap divided by the temperature). It costs nothing at run time.
"""

from __future__ import annotations

from dataclasses import dataclass


REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class _Options:
    """The non-tensor arguments, as given by the user after validation."""

    ignore_index: int
    reduction: str
    label_smoothing: float
    z_loss_scale: float
    softcap: float | None
    chunk_size: int | None
    accurate: bool
    logit_scale: float = 1.0
    temperature: float = 1.0
    with_stats: bool = False
    host_checks: bool = True
    token_weighted: bool = False
    token_scaling: bool = False
    with_predicted: bool = False
    with_lse: bool = False

    @property
    def split_passes(self) -> bool:
        """Whether the chunk's kernel runs its two passes as two launches, to read the logits between them
        (the row factors, the predicted classes)."""
        return self.row_weighted or self.with_predicted

    @property
    def row_weighted(self) -> bool:
        """Whether each row's loss and gradient take a factor of their own (``token_weight``, the
        target's probability of ``token_scaling``): the chunk's kernel then runs its two passes as two
        launches, the factor formed between them."""
        return self.token_weighted or self.token_scaling

    @property
    def pre_scale(self) -> float:
        """The factor ``logit_scale / temperature`` the raw logits are multiplied by as they are formed:
        ``softcap_s(a·z) / T = softcap_{s/T}((a/T)·z)``, so the kernel sees the scaled logits and the
        cap ``s / T``, and the gradient with respect to the raw logits takes this factor once more."""
        return self.logit_scale / self.temperature

    def kernel_args(self, class_weight=None, weight_sum=None) -> dict:
        return dict(
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            z_loss_scale=self.z_loss_scale,
            softcap=None if self.softcap is None else self.softcap / self.temperature,
            class_weight=class_weight,
            weight_sum=weight_sum,
        )
