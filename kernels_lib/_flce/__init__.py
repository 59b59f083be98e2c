"""The routes and stages of :func:`kernels_lib.fused_linear_cross_entropy` that are the cross-entropy's own, one file each.

The public function, its options, the math and the choice of route are in
:mod:`kernels_lib.fused_linear_cross_entropy`; the stages every chunked loss shares (the chunk size,
the operands and logits buffer, the GEMM helpers, the gradient sums, the epilogue GEMM, the Triton
launchers) are the chunk core's, :mod:`kernels_lib.chunks`. This package holds the rest, in the order a
call meets it (each file's docstring says what it computes, what it costs and what measured it):

* ``validate.py``: the arguments' checks, each error naming its argument;
* ``options.py``: the non-tensor options after validation, as the kernels take them;
* ``rows.py``: the valid rows, gathered before the matmuls, the per-row outputs scattered back;
* ``reduction.py``: the denominator of ``mean``, each row's gradient factor, the reduction;
* ``chunked.py``: the chunked route, forward chunk by chunk and ``reduction="none"``'s recomputing
  backward;
* ``class_major.py``: the class-major route, the logits inside the weight gradient's buffer;
* ``vocab_parallel.py``: the per-chunk stage on one vocabulary shard (the merge over the ranks).

The user never sees a launch grid: every file here takes tensors already checked and shaped. Only
:mod:`kernels_lib.fused_linear_cross_entropy` imports this package.
"""
