"""The chunk core: what every loss over a linear head takes to run ``chunk_size`` rows at a time.

The fused cross-entropy (:mod:`kernels_lib._flce`), the sequence losses
(:mod:`kernels_lib._sequence_logprobs`, :mod:`kernels_lib._paired_logprobs`) and the two-head losses
(:mod:`kernels_lib._distillation`) share these stages and import them by their public names; what is
one loss's own (its options, checks, routes, kernels' arguments) stays in that loss's modules. One file
per stage, in the order a call meets it:

* ``chunk_size.py``: the rows per chunk (:func:`~.chunk_size.default_chunk_size`, time first, and
  :func:`~.chunk_size.lean_chunk_size`, memory first), the device's free memory;
* ``operands.py``: :class:`~.operands.Operands`, the inputs cast once to the matmul dtype, the chunks,
  the one reused logits buffer;
* ``matmuls.py``: the GEMM helpers (:func:`~.matmuls.logits_chunk`, :func:`~.matmuls.matmul_into`,
  :func:`~.matmuls.addmm_into`, :func:`~.matmuls.scaled_product_into`, :func:`~.matmuls.matmul_dtype`);
* ``gradient_sums.py``: :class:`~.gradient_sums.GradientSums`, ``dx`` per chunk and ``dW``, ``db`` over
  the chunks (``accurate``, float16's scaled ``dz``), and :func:`~.gradient_sums.scaled_to_dtypes`, the
  hand-out of gradients formed in forward;
* ``epilogue.py``: the logits GEMM with each row's lse in its epilogue (the loss without a logits
  buffer, the stored shifted exponentials);
* ``triton_backend.py``: the Triton launchers the stages and the cross-entropy's routes call (the
  kernels: :mod:`kernels_lib.kernels`); a spy on a stage patches its name there.

The package's ``__init__`` imports nothing: a caller imports the stage's module, so importing the
core costs no more than the stages a loss uses, and a call pays nothing for the package's layout (the
names are bound at import, as before the split).
"""
