"""Why a small training step was slower with kernels_lib than without (issue 10): one profiled step.

Qwen2.5-0.5B shape at 4 × 2048 tokens, gradient checkpointing on then off, Hugging Face unpatched
then ``kernels_lib.hf.patch``: the median of 5 steps after 3 warm-up steps, then one step under
``torch.profiler`` (CPU and CUDA), printing the step time, the summed self CUDA time of the kernels
and the 12 kernels that took longest. A step whose GPU kernels take less time yet whose wall time is
longer is launch-bound: the GPU waits for the CPU (host syncs stop the CPU running ahead). Any CUDA
GPU; the H200 output at commit 2870cba is ``data/measured/gpu_runs/training_step_small_profile.txt``:

    PYTHONPATH=$PWD python -m studies.training_step_profile
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from kernels_workbench import training_step as ts

dev = torch.device("cuda")
for ckpt in (True, False):
    for provider in ("huggingface", "kernels_lib"):
        model = ts.build_model("qwen2.5-0.5b", dev, 0, ckpt)
        loss_of = ts.prepare(provider, model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, model.config.vocab_size, (4, 2048), device=dev)

        def step():
            loss = loss_of(ids, ids)
            loss.backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t) / 5 * 1e3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        gpu_total = sum(e.self_device_time_total for e in ka) / 1e3
        print(f"=== qwen B=4 ckpt={ckpt} {provider}: step {ms:.1f} ms, GPU busy {gpu_total:.1f} ms", flush=True)
        print(ka.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60), flush=True)
        model = opt = loss_of = None  # free them before the next model is built
        ts.free_memory(dev)
