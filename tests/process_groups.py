"""Spawning a CPU process group for the vocab-parallel tests: each rank runs ``worker(rank, world,
init_file, out_dir)`` and saves its results to ``out_dir/rank{rank}.pt``; a group that does not
finish in time fails the test (a hang), as does a rank that raises."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels_lib._runtime import INTERPRETED

#: The vocab-parallel gloo tests' marks: gloo present, and kernels that take the ranks' CPU tensors
#: (the interpreter's; on a CUDA machine scripts/tensor_parallel_check.py runs the checks over NCCL).
GLOO_CPU_MARKS = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo"),
    pytest.mark.skipif(not INTERPRETED, reason="gloo ranks hold CPU tensors; on CUDA see scripts/tensor_parallel_check.py"),
]

#: Seconds a spawned group may take before the test calls it a hang.
GROUP_DEADLINE_S = 240


def spawn_group(worker, world: int) -> list:
    """Spawn ``world`` ranks running ``worker``; their saved results, rank by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            worker, args=(world, str(Path(out_dir) / "init"), out_dir), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + GROUP_DEADLINE_S
        try:
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    pytest.fail(f"the {world}-process group did not finish within {GROUP_DEADLINE_S} s (a hang?)")
        except mp.ProcessRaisedException as error:
            pytest.fail(f"a rank of the {world}-process group raised:\n{error}")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def outcomes(calls: dict) -> dict:
    """Run each ``name -> call`` on this rank: ``(exception type name or None, message, seconds)`` per name
    (the error tests read which error each rank raised, and how soon)."""
    results = {}
    for name, call in calls.items():
        start = time.monotonic()
        try:
            call()
            results[name] = (None, "no error", time.monotonic() - start)
        except Exception as error:  # noqa: BLE001 (the test reads which, and its message)
            results[name] = (type(error).__name__, str(error), time.monotonic() - start)
    return results
