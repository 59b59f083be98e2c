"""The Hopper and pointer-kernel candidates of the log-sum-exp stage that the frontier study times
(``python -m studies.flce_frontier --parts forward``), beside the two the library's default routes launch
(:data:`kernels_lib.kernels.logits_logsumexp.CONFIGS`). Shared memory per stage:
``(BLOCK_M + BLOCK_N) · BLOCK_K · 2`` bytes, 48 KiB at 128 × 256 × 64. ``TMA``: tiles loaded by TMA from
tensor descriptors; ``PERSISTENT``: one program per SM looping over the tiles; ``WARP_SPECIALIZE``:
producer/consumer warps, a separate key so that a Triton that cannot compile it on Hopper only loses that
config (the least tried in Triton 3.6, last).
"""

from __future__ import annotations

_TILE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64)

CANDIDATE_CONFIGS = [
    dict(_TILE, GROUP_M=8, num_warps=8, num_stages=3, TMA=True, PERSISTENT=True),
    dict(_TILE, GROUP_M=8, num_warps=8, num_stages=4, TMA=True, PERSISTENT=True),
    dict(_TILE, GROUP_M=16, num_warps=8, num_stages=3, TMA=True, PERSISTENT=True),
    dict(_TILE, GROUP_M=8, num_warps=8, num_stages=3, TMA=True),
    dict(_TILE, GROUP_M=8, num_warps=8, num_stages=4, TMA=True),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(_TILE, GROUP_M=8, num_warps=8, num_stages=3, TMA=True, PERSISTENT=True, WARP_SPECIALIZE=True),
    dict(_TILE, GROUP_M=8, num_warps=8, num_stages=3, TMA=True, WARP_SPECIALIZE=True),
]
