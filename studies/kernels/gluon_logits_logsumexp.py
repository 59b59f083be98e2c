r"""The logits-and-log-sum-exp stage of :mod:`~kernels_lib.kernels.logits_logsumexp` in Gluon, for Hopper.

What it computes
----------------
The same partials as :func:`~kernels_lib.kernels.logits_logsumexp.logits_lse_partials_tma_kernel`
without ``logits_out``: for hidden states :math:`x` (``N × H``), a head :math:`W` (``V × H``), an
optional bias :math:`b` and a scale :math:`\alpha`, per ``BLOCK_M × BLOCK_N`` tile of the logits
:math:`z = \alpha (x W^\top + b)` the row maxima :math:`m_{bi}` and shifted sums
:math:`s_{bi} = \sum_{j \in b} e^{z_{ij} - m_{bi}}` (float32 ``[n_blocks, N]``), and the target logits
:math:`z_{i, y_i}` from the tile that holds them. The merge kernel of that module turns them into the
log-sum-exp; nothing else changes, so the two stages are checked against the same float64 reference
(``tests/test_gluon_logits_logsumexp.py``).

Why Gluon
---------
Triton's ``tl.*`` kernel of the same stage runs at the time of cuBLAS's logits matmul on the H200
(``data/measured/gpu_runs/fused_linear_cross_entropy_frontier_forward.csv``), and no faster: its
persistent loop issues the next tile's loads during this tile's epilogue, but the warpgroups that run
the epilogue (a max, an FMA, an ``exp2`` and an add per logit) are the ones that would issue the next
tile's MMAs, so the tensor cores wait through it. Gluon (``triton.experimental.gluon``, part of
Triton, no new dependency) lets the kernel say which warps do what:

- **two consumer warpgroups, two tiles at a time** (the "ping-pong" of CUTLASS's Hopper GEMMs, that
  QuACK's linear cross-entropy also uses): each warpgroup owns every other tile of its program and a
  ``128 × 128`` float32 accumulator (128 registers a thread). While one runs its epilogue the other's
  ``wgmma`` keep the tensor cores busy; the warp scheduler interleaves them, and by default no barrier
  orders them. With ``PINGPONG`` a pair of *turn* barriers does, as CUTLASS's ping-pong schedule does:
  a consumer issues a tile's MMAs only after the other has issued its previous tile's, so the two
  epilogues never coincide with the tensor cores idle.
- **one loader warp per consumer**: TMA copies of the ``x`` and ``W`` tiles into that consumer's ring
  of ``STAGES`` shared-memory slots, each with a *ready* barrier (the TMA's byte count) and an *empty*
  barrier (the consumer's arrive once the ``wgmma`` reading that slot has retired). The loader runs
  ahead across tiles, so the next tile's first slots are full when the epilogue ends.
- **register budgets** per partition (``setmaxnreg``): the loaders need few, the consumers the most.

Shared memory: ``2 · STAGES · (BLOCK_M + BLOCK_N) · BLOCK_K · 2`` bytes, 192 KiB at the default
``STAGES = 3``, ``128 × 128 × 64`` (the H200 gives a block up to 227 KiB).

Where it runs
-------------
Only compiled, on compute capability 9.x (``wgmma`` is Hopper's), for bf16/fp16 inputs that TMA can
take (:func:`~kernels_lib.kernels.logits_logsumexp.tma_unsupported_reason`), and only for the
log-sum-exp and target logits (no ``logits_out``): :func:`gluon_unsupported_reason` says why not
otherwise, and the launcher then takes the ``tl.*`` kernels. Gluon kernels do not run in Triton's
interpreter ("0 active drivers"); CI compiles them for ``sm_90a`` on its CPU (:func:`compile_for_sm90`,
``tests/test_gluon_logits_logsumexp.py``) and the GPU target checks their numbers on the H200.

What it measured
----------------
Not yet faster than the ``tl.*`` stage on the H200 (H = 4096, V = 128256, bf16, N = 4096 / 8192 /
16384; ``data/measured/gpu_runs/fused_linear_cross_entropy_gluon_ab.csv``, notebook 01 §11b): at its
defaults it takes 1.13–1.22× the ``tl.*`` stage's time; the consumers taking turns (``PINGPONG``) with
``GROUP_M = 16`` is its best variant, at 1.02–1.08×; ``num_stages = 2``, ``BLOCK_K = 32`` and, with
``PINGPONG``, two stages are slower, and four stages need 256 KiB of shared memory, which a block does
not get. So it stays opt-in (``config={"GLUON": True}``) and the ``tl.*`` kernel stays the default. Its
errors are the ``tl.*`` stage's.

What it costs
-------------
As the ``tl.*`` stage: :math:`2 N H V` matmul FLOPs, ``x`` read once per vocabulary block and ``W``
once per row block (mostly from L2: tiles in groups of ``GROUP_M`` row blocks), ``8 · N · ceil(V /
BLOCK_N)`` bytes of partials written (twice the ``BLOCK_N = 256`` stage's: 1/16 of a bf16 logit).
"""

from __future__ import annotations


import torch
import triton

from ._gluon import GLUON_IMPORT_ERROR, num_sms as _num_sms

if GLUON_IMPORT_ERROR is None:  # Triton >= 3.4 ships Gluon; without it the launcher takes its fallback
    from ._gluon import TensorDescriptor, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from ._gluon import tma_load as _tma_load

from kernels_lib._runtime import INTERPRETED

#: The launch's tiles and schedule. ``BLOCK_N = 128`` keeps a consumer's accumulator at 128 registers
#: a thread (a ``128 × 256`` one would need all 255, with nothing left for the epilogue); ``STAGES``
#: slots per consumer; registers per thread of the second consumer and of each loader.
DEFAULT_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, STAGES=3, CONSUMER_REGS=232, LOADER_REGS=40,
                      PINGPONG=False)
#: :math:`\log_2 e`, as in the ``tl.*`` epilogue.
LOG2E = 1.4426950408889634

if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _tile_coordinates(tile, n_rows, n_cols, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          GROUP_M: gl.constexpr):
        """Row and vocabulary block of tile number ``tile``, grouped as in the ``tl.*`` kernels."""
        n_row_blocks = gl.cdiv(n_rows, BLOCK_M)
        per_group = GROUP_M * gl.cdiv(n_cols, BLOCK_N)
        first_row_block = (tile // per_group) * GROUP_M
        group_rows = gl.minimum(n_row_blocks - first_row_block, GROUP_M)
        return first_row_block + (tile % per_group) % group_rows, (tile % per_group) // group_rows

    @gluon.jit
    def _loader(x_desc, w_desc, a_bufs, b_bufs, ready, empty, n_rows, n_cols, hidden,
                NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, WHICH: gl.constexpr):
        """One warp: TMA copies of every tile consumer ``WHICH`` takes, into its ring of slots."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        n_tiles = gl.cdiv(n_rows, BLOCK_M) * gl.cdiv(n_cols, BLOCK_N)
        k_steps = gl.cdiv(hidden, BLOCK_K)
        count = 0
        for tile in range(gl.program_id(0) + WHICH * NUM_SMS, n_tiles, 2 * NUM_SMS):
            pid_m, pid_n = _tile_coordinates(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            for k in range(k_steps):
                slot = WHICH * STAGES + count % STAGES
                # A fresh barrier counts as having completed the phase before its first: the first
                # pass through the ring does not wait.
                mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                _tma_load(x_desc, [off_m, k * BLOCK_K], ready.index(slot), a_bufs.index(slot))
                _tma_load(w_desc, [off_n, k * BLOCK_K], ready.index(slot), b_bufs.index(slot))
                count += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, ready, empty, turn, b_ptr, target_ptr, m_ptr, s_ptr, target_logit_ptr, n_rows,
                  n_cols, hidden, alpha, ignore_index, HAS_BIAS: gl.constexpr, HAS_TARGET: gl.constexpr,
                  EVEN_N: gl.constexpr, ALPHA_POSITIVE: gl.constexpr, NUM_SMS: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, PINGPONG: gl.constexpr, WHICH: gl.constexpr):
        """One warpgroup: the ``wgmma`` of its tiles from the ring, then each tile's epilogue. With
        ``PINGPONG`` the two consumers take turns at the tensor cores: consumer ``WHICH`` issues a tile's
        MMAs only once the other has issued its previous tile's (``turn[WHICH]``), and passes the turn on
        (``turn[1 - WHICH]``) when its own are issued, so one's epilogue runs while the other's MMAs do,
        never both epilogues at once."""
        BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
        # wgmma's instruction shape: m = 16, n = the whole tile width, k = 256 bits of the inputs.
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 256 // a_bufs.dtype.primitive_bitwidth])
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, layout)
        n_tiles = gl.cdiv(n_rows, BLOCK_M) * gl.cdiv(n_cols, BLOCK_N)
        k_steps = gl.cdiv(hidden, BLOCK_K)
        count = 0
        taken = 0  # tiles this consumer has taken
        for tile in range(gl.program_id(0) + WHICH * NUM_SMS, n_tiles, 2 * NUM_SMS):
            pid_m, pid_n = _tile_coordinates(tile, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
            acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, layout)
            if PINGPONG:
                # Consumer 0's first tile does not wait (a fresh barrier has completed the phase before its
                # first); consumer 1's waits for consumer 0's first turn. Neither gets a phase ahead: each
                # turn passed on needs the other's before it.
                mbarrier.wait(turn.index(WHICH), (taken & 1) ^ (1 - WHICH))
            for k in range(k_steps):
                slot = WHICH * STAGES + count % STAGES
                mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                # One wgmma in flight: the one before it has retired, so its slot goes back to the loader.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                previous = WHICH * STAGES + (count + STAGES - 1) % STAGES
                mbarrier.arrive(empty.index(previous), pred=k > 0)
                count += 1
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - WHICH))  # this tile's MMAs are issued: the other's turn
            taken += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(WHICH * STAGES + (count + STAGES - 1) % STAGES))

            # The epilogue of the tl.* kernel (kernels_lib.kernels.logits_logsumexp._tile_epilogue).
            rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            row_ok = rows < n_rows
            col_ok = cols < n_cols
            if HAS_BIAS:
                acc += gl.expand_dims(gl.load(b_ptr + cols, mask=col_ok, other=0.0).to(gl.float32), 0)
            # t · k is the logit in base-2 units: the raw accumulator (alpha > 0) or the logit itself.
            if ALPHA_POSITIVE:
                t = acc
                k2 = alpha * 1.4426950408889634
            else:
                t = acc * alpha
                k2 = 1.4426950408889634
            if not EVEN_N:
                t = gl.where(gl.expand_dims(col_ok, 0), t, -float("inf"))
            m = gl.max(t, axis=1)
            if ALPHA_POSITIVE:
                m = m * alpha
            s = gl.sum(gl.exp2(t * k2 - gl.expand_dims(m * 1.4426950408889634, 1)), axis=1)
            partial = pid_n.to(gl.int64) * n_rows + rows
            gl.store(m_ptr + partial, m, mask=row_ok)
            gl.store(s_ptr + partial, s, mask=row_ok)
            if HAS_TARGET:
                y = gl.load(target_ptr + rows, mask=row_ok, other=ignore_index).to(gl.int64)
                first = pid_n * BLOCK_N
                mine = row_ok & (y != ignore_index) & (y >= first) & (y < first + BLOCK_N) & (y < n_cols)
                hit = gl.expand_dims(cols.to(gl.int64), 0) == gl.expand_dims(y, 1)
                z_y = gl.sum(gl.where(hit, t, 0.0), axis=1)
                if ALPHA_POSITIVE:
                    z_y = z_y * alpha
                gl.store(target_logit_ptr + rows, z_y, mask=mine)

    @gluon.jit
    def logits_lse_partials_gluon_kernel(
        x_desc,  # TMA descriptor of x [N, H], block [BLOCK_M, BLOCK_K], zero-padded beyond N and H
        w_desc,  # TMA descriptor of W [V, H], block [BLOCK_N, BLOCK_K], zero-padded beyond V and H
        b_ptr,  # [V] bias (read only when HAS_BIAS)
        target_ptr,  # [N] int32/int64 targets (read only when HAS_TARGET)
        m_ptr,  # float32 [n_blocks, N]: per tile row maxima (written)
        s_ptr,  # float32 [n_blocks, N]: per tile shifted row sums (written)
        target_logit_ptr,  # float32 [N]: z_{i, y_i}, by the tile holding column y_i (HAS_TARGET)
        n_rows,  # N
        n_cols,  # V
        hidden,  # H
        alpha,  # the logits' scale
        ignore_index,  # target value of rows without a target logit
        HAS_BIAS: gl.constexpr,
        HAS_TARGET: gl.constexpr,
        EVEN_N: gl.constexpr,  # V a multiple of BLOCK_N: no column beyond V to mask
        ALPHA_POSITIVE: gl.constexpr,  # alpha > 0: the scale rides in the exponent's FMA
        NUM_SMS: gl.constexpr,  # the persistent grid's size: program p takes tiles p, p + NUM_SMS, ...
        GROUP_M: gl.constexpr,  # row blocks that sweep the vocabulary together
        STAGES: gl.constexpr,  # shared-memory slots per consumer
        CONSUMER_REGS: gl.constexpr,  # registers per thread of the second consumer warpgroup
        LOADER_REGS: gl.constexpr,  # registers per thread of each loader warp
        PINGPONG: gl.constexpr,  # the consumers take turns at the tensor cores (ordered MMA phases)
    ):
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        # Slots [0, STAGES) feed consumer 0, [STAGES, 2 STAGES) consumer 1.
        a_bufs = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        b_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG's turns
        for i in gl.static_range(2 * STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        # Partition 0 (the launch's 4 warps) and worker 0: the consumers; workers 1 and 2: their loaders.
        gl.warp_specialize(
            [(_consumer, (a_bufs, b_bufs, ready, empty, turn, b_ptr, target_ptr, m_ptr, s_ptr, target_logit_ptr, n_rows,
                          n_cols, hidden, alpha, ignore_index, HAS_BIAS, HAS_TARGET, EVEN_N, ALPHA_POSITIVE, NUM_SMS,
                          GROUP_M, STAGES, PINGPONG, 0)),
             (_consumer, (a_bufs, b_bufs, ready, empty, turn, b_ptr, target_ptr, m_ptr, s_ptr, target_logit_ptr, n_rows,
                          n_cols, hidden, alpha, ignore_index, HAS_BIAS, HAS_TARGET, EVEN_N, ALPHA_POSITIVE, NUM_SMS,
                          GROUP_M, STAGES, PINGPONG, 1)),
             (_loader, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, n_rows, n_cols, hidden, NUM_SMS, GROUP_M, STAGES,
                        0)),
             (_loader, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, n_rows, n_cols, hidden, NUM_SMS, GROUP_M, STAGES,
                        1))],
            [4, 1, 1],
            [CONSUMER_REGS, LOADER_REGS, LOADER_REGS],
        )


def gluon_unsupported_reason(x: torch.Tensor, weight: torch.Tensor, *, logits_out: bool = False) -> str | None:
    """Why the Gluon stage cannot take ``x`` and ``weight`` (contiguous, as the launcher passes them), or
    None when it can: Gluon importable, no logits to store, compiled (not the interpreter), compute
    capability 9.x, bf16/fp16, TMA-able operands."""
    if GLUON_IMPORT_ERROR is not None:
        return GLUON_IMPORT_ERROR
    if logits_out:
        return "the Gluon kernel forms the log-sum-exp only; logits_out takes the tl.* kernels"
    if INTERPRETED:
        return "Gluon kernels do not run in Triton's interpreter"
    if x.device.type != "cuda":
        return f"the Gluon kernel needs a CUDA device; the inputs are on {x.device}"
    major, minor = torch.cuda.get_device_capability(x.device)
    if major != 9:
        return f"the Gluon kernel uses Hopper's wgmma (compute capability 9.x); {torch.cuda.get_device_name(x.device)} has {major}.{minor}"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"the Gluon kernel takes bfloat16 or float16 inputs; got {x.dtype}"
    from kernels_lib.kernels.logits_logsumexp import tma_unsupported_reason

    return tma_unsupported_reason(x, weight)



def _layouts(dtype, cfg: dict):
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    x_layout = gl.NVMMASharedLayout.get_default_for([cfg["BLOCK_M"], cfg["BLOCK_K"]], gl_dtype)
    w_layout = gl.NVMMASharedLayout.get_default_for([cfg["BLOCK_N"], cfg["BLOCK_K"]], gl_dtype)
    return x_layout, w_layout


def _constexprs(cfg: dict, *, has_bias: bool, has_target: bool, even_n: bool, alpha_positive: bool,
                num_sms: int) -> dict:
    return dict(HAS_BIAS=has_bias, HAS_TARGET=has_target, EVEN_N=even_n, ALPHA_POSITIVE=alpha_positive,
                NUM_SMS=num_sms, GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"], CONSUMER_REGS=cfg["CONSUMER_REGS"],
                LOADER_REGS=cfg["LOADER_REGS"], PINGPONG=cfg["PINGPONG"])


def launch_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor | None,
                    m: torch.Tensor, s: torch.Tensor, target_logit: torch.Tensor | None, *, alpha: float,
                    ignore_index: int, config: dict | None = None) -> None:
    """Write the partials ``m``, ``s`` (float32 ``[ceil(V / BLOCK_N), N]``) and the target logits; the
    caller checked :func:`gluon_unsupported_reason` and merges them
    (:func:`~kernels_lib.kernels.logits_logsumexp.launch_logits_logsumexp` does both)."""
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    n_rows, hidden = x.shape
    n_cols = weight.shape[0]
    x_layout, w_layout = _layouts(x.dtype, cfg)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [cfg["BLOCK_M"], cfg["BLOCK_K"]], x_layout)
    w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [cfg["BLOCK_N"], cfg["BLOCK_K"]],
                              w_layout)
    n_tiles = triton.cdiv(n_rows, cfg["BLOCK_M"]) * triton.cdiv(n_cols, cfg["BLOCK_N"])
    num_sms = _num_sms(x.device.index)
    grid = (min(num_sms, triton.cdiv(n_tiles, 2)),)
    unused = m  # a tensor for the pointers the constexpr flags keep unread
    logits_lse_partials_gluon_kernel[grid](
        x_desc, w_desc, bias if bias is not None else unused, target if target is not None else unused, m, s,
        target_logit if target_logit is not None else unused, n_rows, n_cols, hidden, float(alpha), int(ignore_index),
        num_warps=4,
        **_constexprs(cfg, has_bias=bias is not None, has_target=target is not None,
                      even_n=n_cols % cfg["BLOCK_N"] == 0, alpha_positive=float(alpha) > 0, num_sms=grid[0]),
    )


def compile_for_sm90(dtype: torch.dtype = torch.bfloat16, *, has_bias: bool = True, has_target: bool = True,
                     even_n: bool = False, alpha_positive: bool = True, config: dict | None = None,
                     target_dtype: torch.dtype = torch.int64):
    """Compile :func:`logits_lse_partials_gluon_kernel` for ``sm_90a`` without a GPU (what CI checks):
    returns Triton's compiled kernel, whose ``asm["ptx"]`` holds the ``wgmma`` and TMA instructions."""
    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(GLUON_IMPORT_ERROR)
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32"}
    x_layout, w_layout = _layouts(dtype, cfg)
    e = short[dtype]
    signature = {
        "x_desc": f"tensordesc<{e}[{cfg['BLOCK_M']}, {cfg['BLOCK_K']}],{x_layout!r}>",
        "w_desc": f"tensordesc<{e}[{cfg['BLOCK_N']}, {cfg['BLOCK_K']}],{w_layout!r}>",
        "b_ptr": f"*{e}", "target_ptr": f"*{short[target_dtype]}", "m_ptr": "*fp32", "s_ptr": "*fp32",
        "target_logit_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "hidden": "i32", "alpha": "fp32",
        "ignore_index": "i32",
    }
    constexprs = _constexprs(cfg, has_bias=has_bias, has_target=has_target, even_n=even_n,
                             alpha_positive=alpha_positive, num_sms=132)
    for name in constexprs:
        signature[name] = "constexpr"
    source = GluonASTSource(logits_lse_partials_gluon_kernel, signature,
                            constexprs={(list(signature).index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


class GluonFallbackWarning(UserWarning):
    """A config asked for the Gluon kernel and the inputs, the machine or the call cannot take it: the
    library's ``tl.*`` kernel, launched without a config, ran."""


#: The config keys that set the Gluon kernel's tiles (``num_stages`` sets its ``STAGES``).
GLUON_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")


def gluon_config(config: dict) -> dict:
    """The Gluon kernel's launch config from a study's ``{"GLUON": True, ...}``: :data:`DEFAULT_CONFIG`, its
    tiles and ``GROUP_M`` replaced by those ``config`` gives, ``num_stages`` as ``STAGES``, and ``PINGPONG``.
    Any other key, or ``GLUON`` not True, raises naming it."""
    if not isinstance(config, dict) or config.get("GLUON") is not True:
        raise ValueError(f"a Gluon config has GLUON=True; got {config!r}")
    unknown = sorted(set(config) - {"GLUON", "PINGPONG", "num_stages", *GLUON_TILE_KEYS})
    if unknown:
        raise ValueError(f"config keys {unknown} do not apply to the Gluon kernel (its keys: GLUON, PINGPONG, "
                         f"num_stages, {', '.join(GLUON_TILE_KEYS)})")
    if not isinstance(config.get("PINGPONG", False), bool):
        raise ValueError(f"config['PINGPONG'] must be a bool; got {config['PINGPONG']!r}")
    for key in (*GLUON_TILE_KEYS, "num_stages"):
        value = config.get(key, 16)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (key.startswith("BLOCK_") and (value < 16 or value & (value - 1))):
            raise ValueError(f"config[{key!r}] must be a positive int (BLOCK_*: a power of two >= 16); got {value!r}")
    chosen = dict(DEFAULT_CONFIG, **{key: config[key] for key in GLUON_TILE_KEYS if key in config})
    if "num_stages" in config:
        chosen["STAGES"] = config["num_stages"]
    chosen["PINGPONG"] = bool(config.get("PINGPONG", False))
    return chosen


def logits_logsumexp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     target: torch.Tensor | None = None, *, alpha: float = 1.0, ignore_index: int = -100,
                     config: dict | None = None):
    """:func:`kernels_lib.kernels.logits_logsumexp.logits_logsumexp` with one more choice of ``config``:
    ``{"GLUON": True, ...}`` (:func:`gluon_config`) runs this module's Gluon partials and the library's
    merge kernel; where the Gluon kernel cannot run a :class:`GluonFallbackWarning` says why and the
    library's launch without a config runs. Any other ``config`` goes to the library unchanged."""
    import warnings

    from kernels_lib.kernels import logits_logsumexp as library

    if config is None or config.get("GLUON") is not True:
        return library.logits_logsumexp(x, weight, bias, target, alpha=alpha, ignore_index=ignore_index, config=config)
    cfg = gluon_config(config)
    x, weight = x.contiguous(), weight.contiguous()
    why_not = gluon_unsupported_reason(x, weight)
    if why_not is not None:
        warnings.warn(f"logits_logsumexp: config {config!r} asks for the Gluon kernel, but {why_not}; "
                      "running the tl.* kernel instead", GluonFallbackWarning, stacklevel=2)
        return library.logits_logsumexp(x, weight, bias, target, alpha=alpha, ignore_index=ignore_index)
    n_rows, n_cols = x.shape[0], weight.shape[0]
    n_blocks = triton.cdiv(n_cols, cfg["BLOCK_N"])
    m = torch.empty((n_blocks, n_rows), dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    lse = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    target_logit = torch.empty_like(lse) if target is not None else None
    target = target.contiguous() if target is not None else None
    launch_partials(x, weight, bias, target, m, s, target_logit, alpha=alpha, ignore_index=ignore_index, config=cfg)
    library.merge_lse_partials_kernel[(triton.cdiv(n_rows, library.BLOCK_R),)](
        m, s, target if target is not None else lse, lse, target_logit if target is not None else lse, n_rows, n_cols,
        n_blocks, int(ignore_index), lse, 0, 0, lse, lse, lse, HAS_TARGET=target is not None, SHIFTED=False,
        BLOCK_R=library.BLOCK_R, BLOCK_B=library.BLOCK_B, num_warps=4,
    )
    return lse, target_logit
