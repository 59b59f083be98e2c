r"""The logits-level JSD kernel with the mixture-log dials the two-head stage took: a variant of
``kernels_lib.kernels.jsd.jsd_kernel`` under study.

What it computes
----------------
Exactly :func:`kernels_lib.kernels.jsd.jsd_kernel`'s loss and gradient (the library module has the formulas), with
:func:`~kernels_lib.kernels.jsd.jsd_pointwise`'s two dials set per arm: ``FEW_EXP`` (the mixture's ``log m`` from
one ``exp(-|x - y|)``: 3 ``exp`` per element instead of 4) and ``FAST_LOG`` (that log as the GPU's ``lg2.approx``,
CUDA only, where ``tl.log`` compiles to a polynomial of about 20 instructions).

Why
---
The kernel moves 12 bytes per fp32 element with the gradient; at an H200's copy bandwidth (about 4.3 TB/s) that is
some 360 G elements/s, where the SMs issue about 33 T simple instructions/s: under 100 per element for the whole
formula (2 loads, 4 ``exp``, the polynomial log, the guards, the store). The JSD's charts sat 1.13–1.14× their
floor on the H200; the KL kernel, with one ``exp`` and one log-free formula, sits at it.

What it costs
-------------
The library kernel's bytes; only the instructions per element change. ``studies/jsd_log_ab.py`` times the loss
with each arm at the published sizes in one run, beside the copy ceiling.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels_lib.kernels.jsd import jsd_pointwise
from kernels_lib.kernels.row_blocks import row_block, store_row_block


@triton.jit
def jsd_log_dials_kernel(
    student_ptr, teacher_ptr, label_ptr, upstream_ptr, scale_ptr, partial_ptr, loss_ptr, grad_ptr,
    n_cols, blocks_per_row, ignore_index, beta,
    HAS_LABEL: tl.constexpr, REDUCE: tl.constexpr, WRITE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr,
    UPSTREAM: tl.constexpr, BLOCK: tl.constexpr, BETA_MODE: tl.constexpr,
    FEW_EXP: tl.constexpr, FAST_LOG: tl.constexpr,
):
    pid, offsets, in_row, mask = row_block(label_ptr, ignore_index, n_cols, blocks_per_row, HAS_LABEL, BLOCK)
    x = tl.load(student_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(teacher_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    loss, dx = jsd_pointwise(x, y, beta, BETA_MODE, FEW_EXP, FAST_LOG)
    store_row_block(pid, offsets, in_row, mask, loss, dx, partial_ptr, loss_ptr, grad_ptr, scale_ptr, upstream_ptr,
                    REDUCE, WRITE_LOSS, WRITE_GRAD, UPSTREAM)


class WithDials:
    """Stands in for ``kernels_lib.kernels.jsd.jsd_kernel`` (``kernel[grid](*args, **constexprs)``), launching the
    study kernel with the dials added: set it as an arm through ``studies.bench.arms.constants_set``, so the arm
    runs the library's launcher, autograd function and reduction around the variant."""

    def __init__(self, few_exp: bool, fast_log: bool):
        self.dials = {"FEW_EXP": bool(few_exp), "FAST_LOG": bool(fast_log)}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            return jsd_log_dials_kernel[grid](*args, **kwargs, **self.dials)

        return launch
