"""The routes and stages of :func:`kernels_lib.fused_linear_cross_entropy`, one file each.

The public function, its options, the math and the choice of route are in
:mod:`kernels_lib.fused_linear_cross_entropy`; this package holds what it calls, in the order a call
meets it (each file's docstring says what it computes, what it costs and what measured it):

* ``validate.py``: the arguments' checks, each error naming its argument;
* ``options.py``: the non-tensor options after validation, as the kernels take them;
* ``reduction.py``: the denominator of ``mean``, each row's gradient factor, the reduction;
* ``chunk_size.py``: the rows per chunk (the default and the lean one);
* ``operands.py``: the inputs cast once to the matmul dtype, the chunks, the reused logits buffer;
* ``matmuls.py``: the GEMM helpers (in place, across dtypes, the stored exponentials' ``dx``);
* ``gradient_sums.py``: ``dx`` per chunk, ``dW`` and ``db`` over the chunks (``accurate``, float16's
  scaled ``dz``), and the hand-out of gradients formed in forward;
* ``epilogue.py``: the logits GEMM with each row's lse in its epilogue (the loss without a logits
  buffer, the stored shifted exponentials);
* ``chunked.py``: the chunked route, forward chunk by chunk and ``reduction="none"``'s recomputing
  backward;
* ``class_major.py``: the class-major route, the logits inside the weight gradient's buffer;
* ``vocab_parallel.py``: the per-chunk stage on one vocabulary shard (the merge over the ranks);
* ``triton_backend.py``: the Triton launchers the routes call (the kernels: :mod:`kernels_lib.kernels`).

The user never sees a launch grid: every file here takes tensors already checked and shaped.
"""
