"""The backend choice on a machine without CUDA: Triton's interpreter, which Triton reads when it is
first imported. Imported after triton without ``TRITON_INTERPRET``, kernels_lib refuses with a message
that says what to do (every kernel would otherwise fail when called); with the variable set, or
imported first, the kernels run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")

RUN_A_KERNEL = "x = torch.randn(3, 17).log_softmax(-1).requires_grad_(); kernels_lib.kl_div(x, torch.randn(3, 17).softmax(-1)).backward(); print('ran')"


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300)


def test_triton_imported_first_is_refused_with_the_fix():
    result = _python("import triton\nimport kernels_lib")
    assert result.returncode != 0
    assert "ImportError" in result.stderr and "import kernels_lib first" in result.stderr and "TRITON_INTERPRET=1" in result.stderr


@pytest.mark.parametrize("code,env", [
    ("import torch, kernels_lib, triton\n", {}),  # kernels_lib first: it sets the variable
    ("import triton, torch, kernels_lib\n", {"TRITON_INTERPRET": "1"}),  # the variable set beforehand
])
def test_the_kernels_run_when_the_interpreter_is_set_in_time(code, env):
    result = _python(code + RUN_A_KERNEL, **env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ran")
