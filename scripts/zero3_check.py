"""kernels_lib.hf under DeepSpeed ZeRO-3, for real: a training step of a patched model against the same
model unpatched, under the same engine.

For each model (a Llama-shaped one with its own head, a Qwen2-shaped one whose head is tied to the
embedding), two engines are built from identical weights with ZeRO stage 3 (the parameters become
partitioned placeholders that the engine gathers module by module; on one rank too): one runs the
model as Transformers has it, the other after ``kernels_lib.hf.patch``. Each takes the same batch
(a right-padded row, ignored prompt labels), ``engine.backward(loss)``, and every parameter's full
gradient is read back with ``deepspeed.utils.safe_get_full_grad``. The rows give the loss of each,
the relative error of ours against the unpatched one, and the largest relative error over every
gradient (with its parameter). One rank on one GPU (NCCL); float32 weights, so both sides round alike.

    python3 scripts/zero3_check.py --out OUT        # writes OUT/zero3_check.csv; exit 1 when a row fails

``tests/test_hf_deepspeed.py`` runs it where deepspeed is installed and a GPU is present, and asserts
the bounds below. The recorded rows: ``data/measured/zero3_check.csv``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime as _dt
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

#: The bounds: the loss and every gradient of the patched model within these relative errors of the
#: unpatched model's (float32 in both; the fused head sums the loss in another order).
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
MODELS = {"llama (own head)": ("llama", False), "qwen2 (tied head)": ("qwen2", True)}
COLUMNS = ["timestamp", "kernels_lib_commit", "gpu_name", "torch_version", "triton_version", "transformers_version", "deepspeed_version",
           "model", "zero_stage", "world_size", "parameters", "loss_hf", "loss_kernels_lib", "loss_rel_err",
           "worst_grad_rel_err", "worst_grad_parameter", "head_partitioned", "fused_head_calls", "logits_formed", "passed"]


def _engine(model, deepspeed, torch):
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _step(engine, deepspeed, inputs) -> tuple[float, dict, bool]:
    out = engine(**inputs)
    loss = out.loss
    engine.backward(loss)
    grads = {name: deepspeed.utils.safe_get_full_grad(p).detach().double().cpu().clone()
             for name, p in engine.module.named_parameters()}
    return loss.detach().double().item(), grads, out.logits is not None


def check(name: str) -> dict:
    """One model's row (see the module's docstring)."""
    import deepspeed
    import torch
    import transformers

    from hf_models import batch, tiny_model
    from kernels_lib import hf
    from kernels_workbench.bench.environment import git_commit, package_version

    family, tied = MODELS[name]
    base = tiny_model(family, tied=tied, layers=2).train()
    twin = copy.deepcopy(base)
    hf.patch(twin)
    input_ids, attention_mask, labels = batch(batch_size=2, seq_len=24)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    reference, ours = _engine(base, deepspeed, torch), _engine(twin, deepspeed, torch)
    partitioned = getattr(ours.module.lm_head.weight, "ds_id", None) is not None and ours.module.lm_head.weight.numel() == 0
    calls = []
    kernel = hf.fused_linear_cross_entropy

    def counted(*args, **kwargs):  # the fused head's loss is what the patched model ran
        calls.append(args[1].shape)
        return kernel(*args, **kwargs)

    loss_hf, grads_hf, _ = _step(reference, deepspeed, inputs)
    hf.fused_linear_cross_entropy = counted
    try:
        loss_ours, grads_ours, logits_formed = _step(ours, deepspeed, inputs)
    finally:
        hf.fused_linear_cross_entropy = kernel
    assert grads_hf.keys() == grads_ours.keys(), sorted(set(grads_hf) ^ set(grads_ours))
    errors = {k: ((grads_ours[k] - grads_hf[k]).norm() / grads_hf[k].norm().clamp_min(1e-30)).item() for k in grads_hf}
    worst = max(errors, key=errors.get)
    loss_err = abs(loss_ours - loss_hf) / abs(loss_hf)
    return {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "kernels_lib_commit": git_commit(), "gpu_name": torch.cuda.get_device_name(),
        "torch_version": torch.__version__, "triton_version": package_version("triton"),
        "transformers_version": transformers.__version__,
        "deepspeed_version": package_version("deepspeed"), "model": name, "zero_stage": 3,
        "world_size": torch.distributed.get_world_size(), "parameters": sum(p.ds_numel for p in ours.module.parameters()),
        "loss_hf": f"{loss_hf:.8g}", "loss_kernels_lib": f"{loss_ours:.8g}", "loss_rel_err": f"{loss_err:.3g}",
        "worst_grad_rel_err": f"{errors[worst]:.3g}", "worst_grad_parameter": worst, "head_partitioned": partitioned,
        "fused_head_calls": len(calls), "logits_formed": logits_formed,
        "passed": bool(loss_err < LOSS_TOL and errors[worst] < GRAD_TOL and partitioned and len(calls) == 1
                       and not logits_formed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for zero3_check.csv")
    args = parser.parse_args(argv)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    import deepspeed
    import torch

    if not torch.cuda.is_available():
        parser.error("ZeRO-3 runs on a CUDA GPU here (NCCL, one rank); torch sees none")
    deepspeed.init_distributed(dist_backend="nccl")
    rows = [check(name) for name in MODELS]
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "zero3_check.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(f"{row['model']}: loss {row['loss_kernels_lib']} vs {row['loss_hf']} (rel {row['loss_rel_err']}), "
              f"worst gradient rel {row['worst_grad_rel_err']} ({row['worst_grad_parameter']}), head partitioned: "
              f"{row['head_partitioned']}, fused head calls: {row['fused_head_calls']}, logits formed: "
              f"{row['logits_formed']}, passed: {row['passed']}")
    return 0 if all(row["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
