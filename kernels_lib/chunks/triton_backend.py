"""The Triton backend of the fused linear cross-entropy: the launchers every route calls, by stage.

The routes (:mod:`kernels_lib._flce.chunked`, :mod:`~kernels_lib._flce.class_major`,
:mod:`~kernels_lib.chunks.epilogue`, :mod:`~kernels_lib._flce.vocab_parallel`) and the shared stages
(:mod:`~kernels_lib.chunks.matmuls`, :mod:`~kernels_lib.chunks.gradient_sums`) launch no kernel by
itself: each calls ``backend.<launcher>`` of this module, read at the call. The kernels live one per
stage in :mod:`kernels_lib.kernels`, each file with its launcher, what it computes and what it costs;
this module only names the ones the cross-entropy takes:

* :func:`launch_cross_entropy_chunk` (:mod:`kernels_lib.kernels.cross_entropy_chunk`): a chunk's lse,
  loss and token statistics (pass 1) and, in place over the logits, ``dz`` (pass 2);
  :func:`launch_cross_entropy_partials` and :data:`PARTIAL_COLUMNS`: pass 1's per-rank partial sums
  for the vocabulary-parallel merge;
* :func:`launch_logits_logsumexp`, :func:`logits_logsumexp` and :func:`tma_unsupported_reason`
  (:mod:`kernels_lib.kernels.logits_logsumexp`): the logits GEMM with each row's lse and target logit
  in its epilogue (Hopper's TMA kernel where it runs), storing the logits or not;
* :func:`launch_target_logit_shift` and :func:`launch_scale_rows`
  (:mod:`kernels_lib.kernels.shifted_exponentials`): the shift of the stored exponentials, and the
  row factors put on an ``N × H`` operand;
* :func:`launch_class_major_gradient` (:mod:`kernels_lib.kernels.class_major_gradient`): ``dz^T`` in
  place over the class-major logits;
* :func:`launch_scale_gradient` (:mod:`kernels_lib.kernels.scale_gradient`): the gradients formed in
  forward times ``grad_output``, read on the device.

A second backend (Gluon) would be a file beside this one with the same names, and the routes would
take it by the one import. The tests spy on a stage by patching its name here.
"""

from __future__ import annotations

from ..kernels.class_major_gradient import launch_class_major_gradient
from ..kernels.cross_entropy_chunk import PARTIAL_COLUMNS, launch_cross_entropy_chunk, launch_cross_entropy_partials
from ..kernels.logits_logsumexp import launch_logits_logsumexp, logits_logsumexp, tma_unsupported_reason
from ..kernels.scale_gradient import launch_scale_gradient
from ..kernels.shifted_exponentials import launch_scale_rows, launch_target_logit_shift

__all__ = [
    "PARTIAL_COLUMNS",
    "launch_class_major_gradient",
    "launch_cross_entropy_chunk",
    "launch_cross_entropy_partials",
    "launch_logits_logsumexp",
    "launch_scale_gradient",
    "launch_scale_rows",
    "launch_target_logit_shift",
    "logits_logsumexp",
    "tma_unsupported_reason",
]
