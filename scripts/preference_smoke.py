"""Compile and check the ORPO and KTO kernels on CUDA against the float64-free fp32 reference (smoke test).

    python3 scripts/preference_smoke.py
"""

import torch

import kernels_lib
from kernels_lib import reference
from kernels_lib.workbench.check import relative_error

torch.manual_seed(0)
dev = "cuda"
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(4, 37, 72, device=dev, dtype=dtype, requires_grad=True)
    w = (torch.randn(1031, 72, device=dev) * 0.1).to(dtype).requires_grad_()
    b = torch.randn(1031, device=dev, dtype=dtype, requires_grad=True)
    y = torch.randint(0, 1031, (4, 37), device=dev)
    y[:, :3] = -100
    out = kernels_lib.fused_linear_orpo(x, w, y, b)
    out.loss.backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    ref = reference.fused_linear_orpo(*(t.detach().double().requires_grad_() for t in (x, w)), y, b.detach().double().requires_grad_())
    print("orpo", dtype, "loss err", relative_error(out.loss, ref.loss))
    labels = torch.tensor([True, False, True, False], device=dev)
    rx = torch.randn_like(x).detach()
    kto = kernels_lib.fused_linear_kto(x, w, y, labels, torch.tensor(0.1, device=dev), bias=b, ref_x=rx, ref_weight=w.detach(), ref_bias=b.detach())
    kto.loss.backward()
    kref = reference.fused_linear_kto(x.detach().double(), w.detach().double(), y, labels, torch.tensor(0.1, device=dev, dtype=torch.float64), bias=b.detach().double(), ref_x=rx.double(), ref_weight=w.detach().double(), ref_bias=b.detach().double())
    print("kto", dtype, "loss err", relative_error(kto.loss, kref.loss), "grad finite", bool(torch.isfinite(x.grad).all()))
