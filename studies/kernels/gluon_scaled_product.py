r"""The stored exponentials' input gradient, :math:`\mathrm{diag}(r)\,(\tilde E W)`, in one Gluon GEMM for Hopper.

What it computes
----------------
For one chunk of :math:`C` rows of the fused linear cross-entropy that stored its shifted exponentials
:math:`\tilde E` (``C × V``, bf16/fp16; :mod:`~kernels_lib.kernels.shifted_exponentials`), the LM head
:math:`W` (``V × H``), float32 row factors :math:`u` (``C``) and a float32 scalar :math:`g` read on the
device (the reduction's scale), the chunk's input gradient

.. math::

    \mathrm{out}_{ij} = \mathrm{rnd}\Big(u_i\, g \sum_{k < V} \tilde E_{ik} W_{kj}\Big),
    \qquad i < C,\ j < H,

with the sum accumulated in float32 by the tensor cores (``wgmma``), the factor :math:`u_i g` applied to
the float32 accumulator, and :math:`\mathrm{rnd}` **one** rounding to ``out``'s dtype (bf16, fp16, or
none for float32). It is :func:`~kernels_lib.chunks.matmuls.scaled_product_into` in one kernel.

Why Gluon
---------
That function runs, per block of ``DX_BLOCK_ROWS`` rows, cuBLAS's product into a float32 temporary
(``torch.mm(..., out_dtype=torch.float32)``: 16 MiB at 1024 rows, H = 4096) and a second kernel that
reads it back, scales the rows and rounds: ``12 · rows · H`` bytes of traffic and a temporary alive at
the chunked route's memory peak, all to avoid rounding :math:`\tilde E W` to bf16 before the factors
(which would round each element twice). A GEMM whose epilogue holds the float32 accumulator can apply
the factors there for free. Triton's ``tl.dot`` could too, but here the reduction dimension is the
vocabulary (:math:`K = V = 128256`: 2004 steps of ``BLOCK_K = 64`` per output tile) and every cycle of
the main loop counts; Gluon (``triton.experimental.gluon``, part of Triton, no new dependency) lets the
kernel say which warps do what, as CUTLASS's Hopper GEMMs do:

- **one loader warp** issues the TMA copies of the ``E`` and ``W`` tiles into a ring of ``STAGES``
  shared-memory slots; each slot has a *ready* barrier (the copies' byte count) and an *empty*
  barrier (both consumers arrive once the ``wgmma`` reading it has retired). The loader runs ahead
  across tiles, so the next tile's first slots are full when a tile's epilogue ends.
- **two consumer warpgroups share each tile** (CUTLASS's "cooperative" schedule): a ``BLOCK_M ×
  BLOCK_N`` tile is two ``BLOCK_M/2 × BLOCK_N`` halves, one per warpgroup, both reading the same
  ``W`` slot. At ``128 × 256`` each warpgroup issues ``m64n256k16`` instructions and holds a ``64 ×
  256`` float32 accumulator (128 registers a thread); the shared-memory traffic per FLOP is that of a
  ``128 × 256`` tile, the largest that fits the register file.
- ``warpgroup_mma`` **asynchronous with one group in flight**: a consumer issues step :math:`k`'s MMA,
  waits until step :math:`k - 1`'s has retired and gives that slot back, so the tensor cores always
  have the next MMA queued.
- a **persistent grid** of one program per SM over the output tiles, grouped by ``GROUP_M`` row blocks
  (the tiles running at once read the same ``E`` rows and ``W`` columns from L2).
- **register budgets** per partition (``setmaxnreg``): the loader needs few, the consumers the most.

Why no ping-pong (the sibling :mod:`~studies.kernels.gluon_logits_logsumexp` has one): ping-pong
overlaps one tile's epilogue with another's MMAs, which pays when the epilogue is long against the
main loop. Here a tile's main loop is :math:`2 \cdot 128 \cdot 256 \cdot V` FLOPs (about 1.6 ms of one
SM at V = 128256) and its epilogue one multiply and one store per element (microseconds); ping-pong's
separate tiles per warpgroup would instead double the ``W`` traffic per FLOP. The variants below A/B
the dials that do move the main loop.

Shared memory: ``STAGES · (BLOCK_M + BLOCK_N) · BLOCK_K · 2`` bytes, 144 KiB at the default ``STAGES =
3``, ``128 × 256 × 64`` (a block gets up to 227 KiB on the H200). The epilogue stores from registers
(masked: rows beyond ``C``, columns beyond ``H``), so it needs no shared memory and ``out`` may be
any view with unit column stride (a row slice of ``dx``).

What it measured
----------------
On the H200 (triton 3.6.0, torch 2.11; ``data/measured/gpu_runs/gluon_scaled_product_ab.csv``, from
:func:`~studies.bench.gluon_scaled_product_ab.scaled_product_ab`: H = 4096, V = 128256, bf16,
three alternating rounds, ``DX_BLOCK_ROWS = 1024``), against the route's path (cuBLAS's float32 product
in blocks of 1024 rows, then the scaling kernel): 0.94× its time at C = 1024, 1.00× at 2048, 1.07× at
4096, the chunk the route takes at the published sizes, where 512 tiles make four waves over 132 SMs
and a tile runs slower than in the one wave of C = 1024 (cause not settled; of the variants,
``MAX_PROGRAMS=128`` comes closest there, 1.04×, and is the slowest at C = 1024). ``STAGES=4``,
``BLOCK_M=256 BLOCK_N=128`` and ``GROUP_M=32`` are within ±3% of the default. Its error against float64
is the route's (1.665e-3 at every C: the one bf16 rounding dominates). So it is not on a route: launched
1024 rows at a time it would save about 1% of ``dx`` at C = 4096, and ``dx`` is a third of ``full``.

What it costs
-------------
:math:`2\,C V H` FLOPs (4.3 TFLOP at C = 4096, V = 128256, H = 4096: about 5.5 ms at the H200's
~790 TFLOP/s measured bf16 rate). Bytes: ``E`` read once per column block of ``H`` and ``W`` once per
row block of ``C``, mostly from L2 (the tiles of one wave share them): from device memory about
``2 C V`` + ``2 V H · ceil(tiles / SMs)`` bytes (~5 GB at C = 4096, ~1 ms at 4.8 TB/s, under the
FLOPs' time), and ``C · H`` elements of ``out`` written once. Against the baseline it saves the float32
temporary (``4 · DX_BLOCK_ROWS · H`` bytes of memory) and its ``8 · C · H`` bytes of traffic.

Where it runs
-------------
Only compiled, on compute capability 9.x (``wgmma`` and ``setmaxnreg`` are ``sm_90a``'s), for bf16 or
fp16 ``E`` and ``W`` of the same dtype that TMA can read: unit column stride, 16-byte aligned data
pointers and row strides (so ``V`` a multiple of 8 for a contiguous ``E``, ``H`` a multiple of 8 for
``W``); :func:`gluon_unsupported_reason` says why not otherwise, and the caller keeps the cuBLAS path.
Gluon kernels do not run in Triton's interpreter ("0 active drivers"): CI compiles this one for
``sm_90a`` on its CPU (:func:`compile_for_sm90`, ``tests/test_gluon_scaled_product.py``), and the GPU
target checks its numbers against float64 and the baseline's own error. The A/B against the baseline
and cuBLAS is :func:`studies.bench.gluon_scaled_product_ab.scaled_product_ab`.
"""

from __future__ import annotations


import torch
import triton

from ._gluon import GLUON_IMPORT_ERROR, num_sms as _num_sms

if GLUON_IMPORT_ERROR is None:  # Triton >= 3.4 ships Gluon; without it the launcher takes its fallback
    from ._gluon import TensorDescriptor, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from ._gluon import tma_load as _tma_load

from kernels_lib._runtime import INTERPRETED

#: The launch's tiles and schedule: a ``BLOCK_M × BLOCK_N`` output tile per step of a program (each
#: consumer warpgroup ``BLOCK_M / 2`` of its rows), ``BLOCK_K`` vocabulary entries per ring slot,
#: ``STAGES`` slots, tiles grouped by ``GROUP_M`` row blocks; registers per thread of the second consumer
#: and of the loader (the first consumer, the launch's own warps, gets what is left); the persistent grid's
#: size at most (None: one program per SM).
DEFAULT_CONFIG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, STAGES=3, GROUP_M=8, CONSUMER_REGS=232, LOADER_REGS=40,
                      MAX_PROGRAMS=None)

#: Alternatives worth A/B-ing on the H200 against :data:`DEFAULT_CONFIG`, one dial moved each: a deeper
#: ring (four slots, 192 KiB: the first default, level or up to 4% slower in the first run); the tile
#: turned (``256 × 128``: each warpgroup ``128 × 128``, two ``m64n128`` per ``k16`` instead of one
#: ``m64n256``, same shared-memory bytes per FLOP); row groups covering all of C = 4096 (a wave then
#: reads all of ``E`` and a quarter of ``W``'s columns, against ``W`` whole and a quarter of ``E``); a
#: grid of 128 programs (C = 1024's, whose one wave ran its tiles ~8% faster than C = 4096's four waves
#: of 132). Two slots of ``BLOCK_K = 128`` lost 20% in the first run and are left out.
VARIANTS = [
    dict(STAGES=4),
    dict(BLOCK_M=256, BLOCK_N=128),
    dict(GROUP_M=32),
    dict(MAX_PROGRAMS=128),
]

#: Every config the A/B runs: the default first.
CONFIGS = [dict(DEFAULT_CONFIG)] + [dict(DEFAULT_CONFIG, **variant) for variant in VARIANTS]

#: Shared memory a block may have on Hopper (227 KiB); a config whose ring needs more is refused.
MAX_SHARED_BYTES = 227 * 1024

if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _tile_coordinates(tile, n_rows, n_cols, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          GROUP_M: gl.constexpr):
        """Row block and column block of tile number ``tile``: ``GROUP_M`` row blocks sweep the columns
        together (column-major within the group), so the tiles that run at once share operands in L2."""
        n_row_blocks = gl.cdiv(n_rows, BLOCK_M)
        per_group = GROUP_M * gl.cdiv(n_cols, BLOCK_N)
        first_row_block = (tile // per_group) * GROUP_M
        group_rows = gl.minimum(n_row_blocks - first_row_block, GROUP_M)
        within = tile % per_group
        return first_row_block + within % group_rows, within // group_rows

    @gluon.jit
    def _loader(e_desc, w_desc, a_bufs, b_bufs, ready, empty, n_rows, n_cols, n_inner,
                NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
        """One warp: for every tile of this program and every step along ``V``, wait for a free slot,
        then TMA-copy the two halves of the ``E`` tile and the ``W`` tile into it (zero-filled beyond
        ``C``, ``V`` and ``H``), all completing on the slot's *ready* barrier."""
        HALF_M: gl.constexpr = e_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = e_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
        n_tiles = gl.cdiv(n_rows, 2 * HALF_M) * gl.cdiv(n_cols, BLOCK_N)
        k_steps = gl.cdiv(n_inner, BLOCK_K)
        count = 0  # ring steps so far, over all tiles: slot count % STAGES, phase (count // STAGES) & 1
        for tile in range(gl.program_id(0), n_tiles, NUM_PROGRAMS):
            pid_m, pid_n = _tile_coordinates(tile, n_rows, n_cols, 2 * HALF_M, BLOCK_N, GROUP_M)
            off_m = pid_m * (2 * HALF_M)
            off_n = pid_n * BLOCK_N
            for k in range(k_steps):
                slot = count % STAGES
                # A fresh barrier counts as having completed the phase before its first: the first
                # pass through the ring does not wait.
                mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), 2 * e_desc.block_type.nbytes + w_desc.block_type.nbytes)
                _tma_load(e_desc, [off_m, k * BLOCK_K], ready.index(slot), a_bufs.index(2 * slot))
                _tma_load(e_desc, [off_m + HALF_M, k * BLOCK_K], ready.index(slot), a_bufs.index(2 * slot + 1))
                _tma_load(w_desc, [k * BLOCK_K, off_n], ready.index(slot), b_bufs.index(slot))
                count += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, out_ptr, factors_ptr, scale_ptr, n_rows, n_cols, n_inner,
                  stride_out, NUM_PROGRAMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  WHICH: gl.constexpr):
        """One warpgroup: rows ``[WHICH · BLOCK_M/2, (WHICH + 1) · BLOCK_M/2)`` of every tile of this
        program. The ``wgmma`` of each step from the ring, one in flight; then the epilogue: the float32
        accumulator times :math:`u_i g`, rounded once to ``out``'s dtype, stored where it lies inside
        ``out``."""
        HALF_M: gl.constexpr = a_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
        # wgmma's instruction shape: m = 16 a warp (64 a warpgroup), n = the whole tile width (up to
        # 256), k = 256 bits of the inputs.
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 256 // a_bufs.dtype.primitive_bitwidth])
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, layout)
        n_tiles = gl.cdiv(n_rows, 2 * HALF_M) * gl.cdiv(n_cols, BLOCK_N)
        k_steps = gl.cdiv(n_inner, BLOCK_K)
        scale = gl.load(scale_ptr)
        count = 0
        for tile in range(gl.program_id(0), n_tiles, NUM_PROGRAMS):
            pid_m, pid_n = _tile_coordinates(tile, n_rows, n_cols, 2 * HALF_M, BLOCK_N, GROUP_M)
            acc = gl.zeros((HALF_M, BLOCK_N), gl.float32, layout)
            for k in range(k_steps):
                slot = count % STAGES
                mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(2 * slot + WHICH), b_bufs.index(slot), acc, is_async=True)
                # One wgmma in flight: the one before it has retired, so its slot goes back to the
                # loader once the other consumer is done with it too (the empty barrier counts two).
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=k > 0)
                count += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))

            # The epilogue: out[i, j] = rnd(acc[i, j] · (u_i · g)), the product's order of
            # kernels_lib.kernels.shifted_exponentials.scale_rows_kernel (the baseline's).
            rows = pid_m * (2 * HALF_M) + WHICH * HALF_M + gl.arange(0, HALF_M, layout=row_layout)
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            row_ok = rows < n_rows
            factor = gl.load(factors_ptr + rows, mask=row_ok, other=0.0) * scale
            value = (acc * gl.expand_dims(factor, 1)).to(out_ptr.dtype.element_ty)
            offsets = gl.expand_dims(rows.to(gl.int64) * stride_out, 1) + gl.expand_dims(cols, 0)
            mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < n_cols, 0)
            gl.store(out_ptr + offsets, value, mask=mask)

    @gluon.jit
    def scaled_product_gluon_kernel(
        e_desc,  # TMA descriptor of E [C, V], block [BLOCK_M / 2, BLOCK_K], zero-padded beyond C and V
        w_desc,  # TMA descriptor of W [V, H], block [BLOCK_K, BLOCK_N], zero-padded beyond V and H
        out_ptr,  # [C, H] the result (written, never read), unit column stride, row stride stride_out
        factors_ptr,  # float32 [C]: the row factors u_i
        scale_ptr,  # float32 [1]: the factor g of every row, read on the device (no host sync)
        n_rows,  # C
        n_cols,  # H
        n_inner,  # V: the reduction dimension
        stride_out,  # elements between rows of out
        NUM_PROGRAMS: gl.constexpr,  # the persistent grid's size: program p takes tiles p, p + NUM_PROGRAMS, ...
        GROUP_M: gl.constexpr,  # row blocks that sweep the columns together
        STAGES: gl.constexpr,  # shared-memory slots of the ring
        CONSUMER_REGS: gl.constexpr,  # registers per thread of the second consumer warpgroup
        LOADER_REGS: gl.constexpr,  # registers per thread of the loader warp
    ):
        HALF_M: gl.constexpr = e_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = e_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
        # Slot s holds E's two row halves in a_bufs[2 s] and a_bufs[2 s + 1], W's tile in b_bufs[s].
        a_bufs = gl.allocate_shared_memory(e_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], e_desc.layout)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the loader's expect; the TMA bytes complete it
            mbarrier.init(empty.index(i), count=2)  # one arrive per consumer
        # Partition 0 (the launch's 4 warps) and worker 0: the consumers; worker 1: the loader.
        gl.warp_specialize(
            [(_consumer, (a_bufs, b_bufs, ready, empty, out_ptr, factors_ptr, scale_ptr, n_rows, n_cols, n_inner,
                          stride_out, NUM_PROGRAMS, GROUP_M, STAGES, 0)),
             (_consumer, (a_bufs, b_bufs, ready, empty, out_ptr, factors_ptr, scale_ptr, n_rows, n_cols, n_inner,
                          stride_out, NUM_PROGRAMS, GROUP_M, STAGES, 1)),
             (_loader, (e_desc, w_desc, a_bufs, b_bufs, ready, empty, n_rows, n_cols, n_inner, NUM_PROGRAMS,
                        GROUP_M, STAGES))],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )


_GLUON_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _tma_reason(name: str, t: torch.Tensor) -> str | None:
    """Why TMA cannot read the 2-D tensor ``t`` (unit column stride, 16-byte aligned pointer and row
    stride: :func:`~kernels_lib.kernels.logits_logsumexp.tma_unsupported_reason`'s rules, strides
    allowed), or None."""
    if t.stride(1) != 1 and t.shape[1] > 1:
        return f"{name} needs unit stride along its columns for TMA; its strides are {tuple(t.stride())}"
    if t.data_ptr() % 16:
        return f"{name}'s data pointer ({t.data_ptr():#x}) is not 16-byte aligned"
    row_bytes = t.stride(0) * t.element_size()
    if row_bytes % 16:
        return (f"{name}'s rows are {row_bytes} bytes apart, not a multiple of 16 (a contiguous {name} needs "
                f"{t.shape[1]} columns to be a multiple of {16 // t.element_size()} for {t.dtype})")
    return None


def gluon_unsupported_reason(e: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> str | None:
    """Why the Gluon kernel cannot compute ``out = diag(r) (e @ w)`` here, or None when it can: Gluon
    importable, compiled (not the interpreter), CUDA with compute capability 9.x, ``e`` and ``w`` bf16 or
    fp16 of one dtype that TMA can read (:func:`_tma_reason`), ``out`` (when given) bf16/fp16/float32
    with unit column stride. Shapes are the launcher's to check (:func:`launch_scaled_product`)."""
    if GLUON_IMPORT_ERROR is not None:
        return GLUON_IMPORT_ERROR
    if INTERPRETED:
        return "Gluon kernels do not run in Triton's interpreter"
    if e.device.type != "cuda":
        return f"the Gluon kernel needs a CUDA device; e is on {e.device}"
    major, minor = torch.cuda.get_device_capability(e.device)
    if major != 9:
        return (f"the Gluon kernel uses Hopper's wgmma (compute capability 9.x); "
                f"{torch.cuda.get_device_name(e.device)} has {major}.{minor}")
    if e.dtype not in _GLUON_DTYPES:
        return f"the Gluon kernel takes bfloat16 or float16 e and w; e is {e.dtype}"
    if w.dtype != e.dtype:
        return f"the Gluon kernel takes e and w of one dtype; e is {e.dtype}, w is {w.dtype}"
    if e.dim() != 2 or w.dim() != 2:
        return f"e and w must be 2-D; got e {tuple(e.shape)}, w {tuple(w.shape)}"
    for name, t in (("e", e), ("w", w)):
        reason = _tma_reason(name, t)
        if reason is not None:
            return reason
    if out is not None:
        if out.dtype not in _OUT_DTYPES:
            return f"out must be bfloat16, float16 or float32; got {out.dtype}"
        if out.dim() == 2 and out.stride(1) != 1 and out.shape[1] > 1:
            return f"out needs unit stride along its columns; its strides are {tuple(out.stride())}"
    return None


def _config(config: dict | None) -> dict:
    """:data:`DEFAULT_CONFIG` updated by ``config``, checked: known keys, sizes the kernel can take, a
    ring that fits in shared memory."""
    unknown = set(config or {}) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"config: unknown keys {sorted(unknown)}; the keys are {sorted(DEFAULT_CONFIG)}")
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        if not isinstance(cfg[key], int) or cfg[key] < 16 or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"config['{key}'] must be a power of two >= 16; got {cfg[key]!r}")
    if cfg["BLOCK_M"] not in (128, 256):
        raise ValueError(f"config['BLOCK_M'] must be 128 or 256 (two warpgroups of 64 or 128 rows); got {cfg['BLOCK_M']}")
    if cfg["BLOCK_N"] > 256:
        raise ValueError(f"config['BLOCK_N'] must be at most 256 (wgmma's widest n); got {cfg['BLOCK_N']}")
    for key in ("STAGES", "GROUP_M", "MAX_PROGRAMS"):
        if key == "MAX_PROGRAMS" and cfg[key] is None:
            continue
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"config['{key}'] must be a positive int; got {cfg[key]!r}")
    ring = shared_bytes(cfg)
    if ring > MAX_SHARED_BYTES:
        raise ValueError(f"config: the ring needs {ring} bytes of shared memory, more than a block's "
                         f"{MAX_SHARED_BYTES}; lower STAGES or the block sizes")
    return cfg


def shared_bytes(cfg: dict, element_size: int = 2) -> int:
    """Shared memory of the ring of ``cfg`` (the barriers aside): ``STAGES · (BLOCK_M + BLOCK_N) · BLOCK_K``
    elements."""
    return cfg["STAGES"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * element_size



def _layouts(dtype: torch.dtype, cfg: dict):
    """The swizzled shared layouts of the ``E`` half-tile and the ``W`` tile (what TMA writes and wgmma reads)."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    e_layout = gl.NVMMASharedLayout.get_default_for([cfg["BLOCK_M"] // 2, cfg["BLOCK_K"]], gl_dtype)
    w_layout = gl.NVMMASharedLayout.get_default_for([cfg["BLOCK_K"], cfg["BLOCK_N"]], gl_dtype)
    return e_layout, w_layout


def _constexprs(cfg: dict, num_programs: int) -> dict:
    return dict(NUM_PROGRAMS=num_programs, GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"],
                CONSUMER_REGS=cfg["CONSUMER_REGS"], LOADER_REGS=cfg["LOADER_REGS"])


def _check_inputs(out: torch.Tensor, e: torch.Tensor, w: torch.Tensor, factors: torch.Tensor,
                  scale: torch.Tensor) -> None:
    """Shapes, dtypes and devices, each error naming its argument."""
    for name, t in (("out", out), ("e", e), ("w", w), ("factors", factors), ("scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"launch_scaled_product: {name} must be a torch.Tensor; got {type(t).__name__}")
    if e.dim() != 2:
        raise ValueError(f"launch_scaled_product: e must be 2-D (C × V); got shape {tuple(e.shape)}")
    if w.dim() != 2:
        raise ValueError(f"launch_scaled_product: w must be 2-D (V × H); got shape {tuple(w.shape)}")
    n_rows, n_inner = e.shape
    if w.shape[0] != n_inner:
        raise ValueError(f"launch_scaled_product: w must have e's {n_inner} columns as rows (V × H); "
                         f"got shape {tuple(w.shape)} for e {tuple(e.shape)}")
    if tuple(out.shape) != (n_rows, w.shape[1]):
        raise ValueError(f"launch_scaled_product: out must have shape {(n_rows, w.shape[1])} (C × H); "
                         f"got {tuple(out.shape)}")
    if factors.shape != (n_rows,):
        raise ValueError(f"launch_scaled_product: factors must have shape ({n_rows},) (one per row of e); "
                         f"got {tuple(factors.shape)}")
    if scale.numel() != 1:
        raise ValueError(f"launch_scaled_product: scale must hold one element; got shape {tuple(scale.shape)}")
    if e.dtype not in _GLUON_DTYPES:
        raise ValueError(f"launch_scaled_product: e must be bfloat16 or float16; got {e.dtype}")
    if w.dtype != e.dtype:
        raise ValueError(f"launch_scaled_product: w must have e's dtype {e.dtype}; got {w.dtype}")
    if out.dtype not in _OUT_DTYPES:
        raise ValueError(f"launch_scaled_product: out must be bfloat16, float16 or float32; got {out.dtype}")
    for name, t in (("factors", factors), ("scale", scale)):
        if t.dtype != torch.float32:
            raise ValueError(f"launch_scaled_product: {name} must be float32; got {t.dtype}")
    for name, t in (("out", out), ("w", w), ("factors", factors), ("scale", scale)):
        if t.device != e.device:
            raise ValueError(f"launch_scaled_product: {name} is on {t.device}, e on {e.device}")


def launch_scaled_product(out: torch.Tensor, e: torch.Tensor, w: torch.Tensor, factors: torch.Tensor,
                          scale: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    r"""``out = diag(factors · scale) (e @ w)`` in one Gluon kernel, rounded once to ``out``'s dtype;
    returns ``out``.

    ``e`` (``C × V``) and ``w`` (``V × H``) bf16 or fp16 of one dtype, readable by TMA; ``factors``
    float32 ``(C,)``; ``scale`` a one-element float32 tensor on the device (read there: no host sync);
    ``out`` (``C × H``, bf16/fp16/float32, unit column stride, any row stride: a row slice of a larger
    tensor is fine) is written and never read. ``config`` updates :data:`DEFAULT_CONFIG`. Bad shapes,
    dtypes or devices raise a ValueError naming the argument; inputs the kernel cannot take here raise
    one with :func:`gluon_unsupported_reason`'s reason (check it first to choose another path)."""
    _check_inputs(out, e, w, factors, scale)
    cfg = _config(config)
    reason = gluon_unsupported_reason(e, w, out)
    if reason is not None:
        raise ValueError(f"launch_scaled_product: {reason}")
    factors = factors.contiguous()
    scale = scale.reshape(1)
    n_rows, n_inner = e.shape
    n_cols = w.shape[1]
    if n_rows == 0 or n_cols == 0:
        return out
    if n_inner == 0:  # an empty sum
        return out.zero_()
    e_layout, w_layout = _layouts(e.dtype, cfg)
    e_desc = TensorDescriptor(e, list(e.shape), list(e.stride()), [cfg["BLOCK_M"] // 2, cfg["BLOCK_K"]], e_layout)
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [cfg["BLOCK_K"], cfg["BLOCK_N"]], w_layout)
    n_tiles = triton.cdiv(n_rows, cfg["BLOCK_M"]) * triton.cdiv(n_cols, cfg["BLOCK_N"])
    grid = (min(cfg["MAX_PROGRAMS"] or _num_sms(e.device.index), n_tiles),)
    scaled_product_gluon_kernel[grid](
        e_desc, w_desc, out, factors, scale, n_rows, n_cols, n_inner, out.stride(0),
        num_warps=4, **_constexprs(cfg, grid[0]),
    )
    return out


def compile_for_sm90(dtype: torch.dtype = torch.bfloat16, out_dtype: torch.dtype | None = None, **config):
    """Compile :func:`scaled_product_gluon_kernel` for ``sm_90a`` without a GPU (what CI checks), for
    ``e``/``w`` of ``dtype``, ``out`` of ``out_dtype`` (``dtype`` by default) and ``config`` (keys of
    :data:`DEFAULT_CONFIG`): returns Triton's compiled kernel, whose ``asm["ptx"]`` holds the ``wgmma``
    and TMA instructions."""
    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(GLUON_IMPORT_ERROR)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = _config(config)
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    e_layout, w_layout = _layouts(dtype, cfg)
    d = short[dtype]
    signature = {
        "e_desc": f"tensordesc<{d}[{cfg['BLOCK_M'] // 2}, {cfg['BLOCK_K']}],{e_layout!r}>",
        "w_desc": f"tensordesc<{d}[{cfg['BLOCK_K']}, {cfg['BLOCK_N']}],{w_layout!r}>",
        "out_ptr": f"*{short[out_dtype or dtype]}", "factors_ptr": "*fp32", "scale_ptr": "*fp32",
        "n_rows": "i32", "n_cols": "i32", "n_inner": "i32", "stride_out": "i32",
    }
    constexprs = _constexprs(cfg, num_programs=cfg["MAX_PROGRAMS"] or 132)
    for name in constexprs:
        signature[name] = "constexpr"
    source = GluonASTSource(scaled_product_gluon_kernel, signature,
                            constexprs={(list(signature).index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
