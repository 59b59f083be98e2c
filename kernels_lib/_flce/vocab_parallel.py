r"""The vocabulary-parallel stage of the fused linear cross-entropy: one chunk on one shard of the classes.

Vocabulary-parallel (``process_group``, or a DTensor ``weight`` sharded on dim 0): each rank holds
rows ``[o_r, o_r + V_r)`` of ``W`` and ``b``, of any sizes (:mod:`kernels_lib._vocab_parallel`). Per
chunk, pass 1 of the kernel writes this rank's partial sums (row max :math:`m_r`, :math:`\log s_r`,
the target's capped logit where this rank owns it, :math:`\sum_j w_j c_j`, and for the token stats
:math:`\sum_j c_j` and the entropy's sums); they are merged over the ranks
(:math:`\mathrm{lse} = M + \log \sum_r s_r e^{m_r - M}`, :math:`M = \max_r m_r`; the target's logit
from its owner; the smoothing term's sum of the logits, the z-loss of the merged lse: all exact);
the loss follows from the merged values, and pass 2 writes this rank's ``dz`` with the global lse.
``dW``/``db`` stay local; ``dx = Σ_r dz_r W_r`` is one all-reduce per call. On the wire per row and
chunk: 1 float (all-reduce MAX) and 2 (SUM), +1 with label smoothing, +3 with token stats; per call
``dx`` (``N × H``) and the 13-int64 check of :func:`~kernels_lib._vocab_parallel.establish`.

Without a process group nothing of this runs: the same kernel launches as on one process, no extra
pass. The group's layout, the one check over the ranks and the merge are :mod:`kernels_lib._vocab_parallel`'s.
"""

from __future__ import annotations

import torch

from .. import _vocab_parallel as vp
from ..chunks import triton_backend as backend


def _vocab_parallel_chunk(shard: vp.VocabShard):
    r"""The per-chunk stage on one vocabulary shard, with the arguments of
    :func:`~kernels_lib.kernels.cross_entropy_chunk.launch_cross_entropy_chunk`.

    Pass 1 writes this rank's partial sums (:data:`~kernels_lib.kernels.cross_entropy_chunk.PARTIAL_COLUMNS`);
    :meth:`~kernels_lib._vocab_parallel.VocabShard.merge_logsumexp` merges them into the global
    :math:`M` and :math:`\log S` (``lse = M + log S``) and sums, in the same all-reduce, the target's
    capped logit :math:`c_y` (from the rank that owns it, 0 elsewhere), with label smoothing
    :math:`\sum_j w_j c_j`, and with token stats :math:`\sum_j c_j`,
    :math:`D = \sum_r e^{m_r - M}(d_r + (M - m_r) s_r)` and :math:`Q = \sum_r e^{2(m_r - M)} q_r`
    (``d``, ``q`` rescaled from each rank's maximum to the global one). The loss terms are then the
    kernel's pass-1 formulas on the merged values,

    .. math::

        \ell = (1-\varepsilon)\,r\,((M - c_y) + \log S)
               + \tfrac{\varepsilon}{V}\big((W M - \textstyle\sum_j w_j c_j) + W \log S\big) + r\lambda\,\mathrm{lse}^2,
        \quad H = D/S + \log S, \quad \log\textstyle\sum_j p_j^2 = \log Q - 2\log S,

    top-1 is :math:`c_y \ge M`; and pass 2 writes this rank's ``dz`` with the global lse. Wire per
    row: 1 float (MAX) and 2 floats (SUM: :math:`S`, :math:`c_y`), +1 with label smoothing, +3 with
    token stats; float32.
    """

    def chunk(logits, target, *, lse, loss, z_loss, grad_scale, stats, top1, ignore_index, label_smoothing,
              z_loss_scale, softcap, class_weight, weight_sum, target_logit=None):
        partial = torch.empty((logits.shape[0], len(backend.PARTIAL_COLUMNS)), dtype=torch.float32,
                              device=logits.device)
        backend.launch_cross_entropy_partials(
            logits, target, partial, col_offset=shard.offset, ignore_index=ignore_index, softcap=softcap,
            class_weight=class_weight, with_stats=stats is not None,
        )
        m, log_s, c_y, sum_wc, sum_c, d, q = partial.unbind(1)

        def extra(shift):
            columns = [c_y] + ([sum_wc] if label_smoothing else [])
            if stats is not None:
                decay = torch.exp(shift)
                columns += [sum_c, decay * (d - shift * torch.exp(log_s)), decay.square() * q]
            return columns

        big_m, log_big_s, sums = shard.merge_logsumexp(m, log_s, extra)
        c_y, sums = sums[0], list(sums[1:])
        if target_logit is not None:  # the merged capped target logit (token scaling's p_y)
            target_logit.copy_(c_y)
        n_classes = shard.n_classes
        valid = target != ignore_index
        r = 1.0 if class_weight is None else class_weight[torch.where(valid, target, 0).long()]
        total = n_classes if class_weight is None else weight_sum
        lse.copy_(big_m + log_big_s)
        z_term = r * z_loss_scale * lse.square()
        ce = (1.0 - label_smoothing) * r * ((big_m - c_y) + log_big_s)
        if label_smoothing:
            ce = ce + (label_smoothing / n_classes) * ((total * big_m - sums.pop(0)) + total * log_big_s)
        loss.copy_(torch.where(valid, ce + z_term, 0.0))
        z_loss.copy_(torch.where(valid, z_term, 0.0))
        if stats is not None:
            sum_c, big_d, big_q = sums
            entropy = big_d * torch.exp(-log_big_s) + log_big_s
            columns = (entropy, sum_c / n_classes, torch.log(big_q) - 2.0 * log_big_s)
            stats.copy_(torch.where(valid.unsqueeze(1), torch.stack(columns, 1), 0.0))
            top1.copy_(valid & (c_y >= big_m))
        if grad_scale is not None:
            backend.launch_cross_entropy_chunk(
                logits, target, lse=lse, loss=None, z_loss=None, grad_scale=grad_scale, ignore_index=ignore_index,
                label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
                class_weight=class_weight, weight_sum=weight_sum, **shard.kernel_args(),
            )

    return chunk
