"""The path TRL 1.16's own trainers take: per-token log-probs from TRL's fused LM head, then the trainer's loss.

``DPOTrainer``, ``GRPOTrainer`` (and ``KTOTrainer``, ``SFTTrainer``) call the model with
``fused_lm_head=True`` (``trl/trainer/utils.py``, ``add_fused_lm_head``, lines 1600–1660): the
valid positions' hidden states go through ``trl.kernels.ChunkedLogProbFunction`` (cuBLAS logits tiles
of 4096 tokens × ``_CHUNKED_LOGPROB_CHUNK_SIZE`` vocabulary columns folded into online log-sum-exp
statistics by a Triton kernel, torch ops off CUDA; the backward recomputes the tiles), the results
are scattered back with 0 at the ``-100`` labels, and the trainer's loss runs on those per-token
log-probs. :func:`trl_provider` is that: the reference of a loss (TRL's loss code, re-implemented in
:mod:`kernels_lib.reference`) run with :func:`trl_head_token_logps` as its head
(:func:`kernels_lib.reference.token_logps_from`). Same signature as the loss, so it is one more
provider of its spec.
"""

from __future__ import annotations

from kernels_lib import reference
from .spec import Provider


def trl_head_token_logps(hidden, weight, bias, target, ignore_index: int, temperature: float = 1.0, entropy: bool = False):
    """:func:`kernels_lib.reference.head_token_logps` through TRL's fused head, as ``add_fused_lm_head``
    calls it: the valid positions only (its compact path), no softcap, logit scale 1, then scattered
    back into the target's shape with 0 elsewhere."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    mask = target != ignore_index
    outputs = ("entropy",) if entropy else ()
    logps, token_entropy, *_ = ChunkedLogProbFunction.apply(
        hidden[mask], weight, bias, target[mask], temperature, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, outputs
    )

    def scatter(values):
        return None if values is None else values.new_zeros(mask.shape).masked_scatter(mask, values)

    return scatter(logps), scatter(token_entropy)


def trl_provider(reference_loss, loss_name: str) -> Provider:
    """The ``trl`` provider of a loss whose reference is ``reference_loss``: TRL's fused head, then
    TRL's loss on its per-token log-probs."""

    def load():
        import trl.kernels  # noqa: F401  (ImportError names the missing package)

        def trl_loss(*args, **kwargs):
            with reference.token_logps_from(trl_head_token_logps):
                return reference_loss(*args, **kwargs)

        return trl_loss

    return Provider("trl", load, f"TRL 1.16's fused head (ChunkedLogProbFunction), then its {loss_name} loss on the per-token log-probs")
