"""The backend choice on a machine without CUDA: Triton's interpreter. kernels_lib sets
``TRITON_INTERPRET`` before its kernels are defined; when Triton was imported first (``from
transformers import LlamaForCausalLM`` imports it), Triton's own ``triton.language`` helpers are
switched to the interpreter at kernels_lib's import, so the order of the imports does not matter.
Where that switch cannot be made, the import fails saying what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")

ROOT = Path(__file__).resolve().parents[1]
RUN_A_KERNEL = "x = torch.randn(3, 17).log_softmax(-1).requires_grad_(); kernels_lib.kl_div(x, torch.randn(3, 17).softmax(-1)).backward(); print('ran')"
#: A loss whose kernels call Triton's helpers (tl.max, tl.sum, ...), with and without a gradient, against torch.
RUN_A_LOSS = """
import torch.nn.functional as F
torch.manual_seed(0)
x, w, t = torch.randn(6, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True), torch.randint(0, 40, (6,))
loss = kernels_lib.fused_linear_cross_entropy(x, w, t, label_smoothing=0.1)
loss.backward()
ref = F.cross_entropy(x.detach().double() @ w.detach().double().T, t, label_smoothing=0.1)
with torch.no_grad():
    plain = kernels_lib.fused_linear_cross_entropy(x, w, t)
plain_ref = F.cross_entropy(x.detach().double() @ w.detach().double().T, t)
print('errors', abs(loss.item() - ref.item()) / ref.item(), abs(plain.item() - plain_ref.item()) / plain_ref.item())
"""


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300,
                          cwd=ROOT)


def test_transformers_imported_first_then_a_loss_runs():
    """The order of the issue: a Transformers model class (which imports Triton) before kernels_lib; the
    fused loss then runs in the interpreter, with and without a gradient, within 1e-5 of float64 torch."""
    code = ("import sys\nfrom transformers import LlamaForCausalLM\nassert 'triton' in sys.modules\n"
            "import torch, kernels_lib\n" + RUN_A_LOSS)
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = [float(e) for e in result.stdout.split("errors")[-1].split()]
    assert len(errors) == 2 and all(e < 1e-5 for e in errors), result.stdout


def test_a_triton_that_cannot_be_switched_is_refused_with_the_fix():
    """Where Triton's helpers cannot be re-wrapped (here: its interpreter's InterpretedFunction removed), the
    import fails naming both fixes, and leaves TRITON_INTERPRET unset."""
    code = ("import os, triton.runtime.interpreter as interpreter\ndel interpreter.InterpretedFunction\n"
            "try:\n    import kernels_lib\nexcept ImportError as error:\n"
            "    print(error)\n    print('unset' if 'TRITON_INTERPRET' not in os.environ else 'set')\n")
    result = _python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "import kernels_lib first" in result.stdout and "TRITON_INTERPRET=1" in result.stdout, result.stdout
    assert result.stdout.strip().endswith("unset")


@pytest.mark.parametrize("code,env", [
    ("import torch, kernels_lib, triton\n", {}),  # kernels_lib first: it sets the variable
    ("import triton, torch, kernels_lib\n", {"TRITON_INTERPRET": "1"}),  # the variable set beforehand
    ("import triton, torch, kernels_lib\n", {}),  # triton first: its helpers are switched
])
def test_the_kernels_run_whatever_the_order(code, env):
    result = _python(code + RUN_A_KERNEL, **env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ran")
