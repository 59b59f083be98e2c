"""Why KTO's time per sequence is 1.35 ms at B <= 4 and 1.0 ms from B = 8 on (published workload; measured on an H200, runs on any CUDA GPU).

    KERNELS_LIB_COMMIT=<commit> PYTHONPATH=$PWD python -m studies.kto_small_batch_profile --out OUT

For B in {2, 4, 8, 16} and chunk_size in {default, 1024, 2048} (the default, ``chunk_rows``'s, labelled with its rows and
measured once where it equals a given size): the median of
``forward`` (with grad, where all of KTO's work happens) by do_bench; and, for B = 4 and 8 at the
default chunk, the CUDA time per kernel name from torch.profiler over 5 calls. Writes
``kto_small_batch.csv`` and ``kto_small_batch_profile.csv``.
"""

import argparse
from pathlib import Path

import pandas as pd
import torch
import triton

from kernels_lib._sequence_logprobs import chunk_rows
from kernels_workbench.bench import get_spec
from kernels_workbench.bench.environment import provenance


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = get_spec("kto_loss")
    fn = spec.providers["kernels_lib"].load()
    rows, profile = [], []
    for b in (2, 4, 8, 16):
        sizes = {"B": b, **spec.published["sizes"]}
        inputs = spec.make_inputs(sizes, torch.bfloat16, "cuda", spec.default_options, 0)
        default = chunk_rows(None, sizes["T"], b * sizes["T"], sizes["H"])
        for chunk in sorted({default, 1024, 2048}):
            call = lambda: fn(*inputs.args, **inputs.kwargs, chunk_size=chunk).loss  # noqa: E731
            ms = triton.testing.do_bench(call, quantiles=[0.2, 0.5, 0.8])
            rows.append({"B": b, "chunk_size": chunk, "ms_20": ms[0], "ms_50": ms[1], "ms_80": ms[2],
                         "ms_per_sequence": ms[1] / b, **provenance("cuda")})
            print(rows[-1]["B"], rows[-1]["chunk_size"], round(ms[1], 3), flush=True)
        if b in (4, 8):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    fn(*inputs.args, **inputs.kwargs).loss
                torch.cuda.synchronize()
            for event in prof.key_averages():
                if event.device_time_total > 0 or event.cpu_time_total > 0:
                    profile.append({"B": b, "name": event.key[:120], "calls": event.count,
                                    "cuda_ms_per_call": event.device_time_total / 1e3 / 5, "cpu_ms_per_call": event.cpu_time_total / 1e3 / 5,
                                    **provenance("cuda")})
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=14), flush=True)
    pd.DataFrame(rows).to_csv(args.out / "kto_small_batch.csv", index=False)
    pd.DataFrame(profile).to_csv(args.out / "kto_small_batch_profile.csv", index=False)
    print(pd.DataFrame(rows)[["B", "chunk_size", "ms_50", "ms_per_sequence"]].to_string(index=False))


if __name__ == "__main__":
    main()
