"""The library a training user installs: torch and triton only.

``pip install kernels_lib`` declares torch and triton (numpy only for Triton's interpreter on a
machine without a GPU, the ``interpreter`` extra); the workbench is another package beside it
(``lab/``, ``kernels_workbench``), with its own dependencies, and its wheel holds none of it. In a fresh interpreter where the workbench's modules are refused at import, ``import
kernels_lib`` and every loss (DPO/CPO/SimPO from their modules), forward and backward, still run, and ``kernels_workbench`` says
how to install what it needs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What the workbench needs and a training user's environment may lack.
WORKBENCH_ONLY = (
    "pandas", "plotly", "ipywidgets", "anywidget", "IPython", "ipykernel", "jupyter", "jupyterlab",
    "jupyter_client", "jupyter_core", "papermill", "nbconvert", "nbformat", "latex2mathml",
)

SCRIPT = textwrap.dedent(
    f"""
    import sys
    REFUSED = {WORKBENCH_ONLY!r}
    # As if not installed: None in sys.modules makes `import name` raise ImportError and
    # importlib.util.find_spec(name) answer None, as for a missing package.
    for name in REFUSED:
        sys.modules[name] = None
    import torch
    import kernels_lib

    dev = kernels_lib.default_device()
    g = torch.Generator().manual_seed(0)
    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(dev).requires_grad_()

    # KL divergence
    inp = torch.randn(6, 33, generator=g).log_softmax(-1).to(dev).requires_grad_()
    kernels_lib.kl_div(inp, torch.randn(6, 33, generator=g).softmax(-1).to(dev)).backward()
    # the distillation losses
    teacher = torch.randn(6, 33, generator=g).log_softmax(-1).to(dev)
    kernels_lib.jsd(inp, teacher, beta=0.3).backward()
    probs = inp.detach().exp().requires_grad_()
    kernels_lib.tvd(probs, teacher.exp()).backward()
    # fused linear cross-entropy, with the training options
    x, w = leaf(2, 5, 16), leaf(67, 16)
    y = torch.randint(0, 67, (2, 5), generator=g).to(dev)
    out = kernels_lib.fused_linear_cross_entropy(x, w, y, num_items_in_batch=7, return_token_stats=True)
    out.loss.backward()
    # ORPO (2 pairs) and KTO
    x, w = leaf(4, 5, 16), leaf(67, 16)
    y = torch.randint(0, 67, (4, 5), generator=g).to(dev)
    kernels_lib.fused_linear_orpo(x, w, y).loss.backward()
    ref_x, ref_w = torch.randn(4, 5, 16, generator=g).to(dev), torch.randn(67, 16, generator=g).to(dev)
    labels = torch.tensor([True, False, True, False], device=dev)
    kernels_lib.fused_linear_kto(x, w, y, labels, 0.0, ref_x=ref_x, ref_weight=ref_w).loss.backward()
    # DPO, CPO, SimPO (2 pairs)
    from kernels_lib.fused_linear_cpo import fused_linear_cpo, fused_linear_simpo
    from kernels_lib.fused_linear_dpo import fused_linear_dpo
    fused_linear_dpo(x, w, y, ref_x=ref_x, ref_weight=ref_w).loss.backward()
    fused_linear_cpo(x, w, y).loss.backward()
    fused_linear_simpo(x, w, y).loss.backward()
    # GRPO, cross-entropy on logits, the fused student-teacher losses
    kernels_lib.fused_linear_grpo(x, w, y, advantages=torch.randn(4, generator=g).to(dev)).loss.backward()
    logits = leaf(6, 67)
    kernels_lib.cross_entropy(logits, torch.randint(0, 67, (6,), generator=g).to(dev)).backward()
    sx, sw, tx, tw = leaf(6, 16), leaf(67, 16), torch.randn(6, 24, generator=g).to(dev), torch.randn(67, 24, generator=g).to(dev)
    tgt = torch.randint(0, 67, (6,), generator=g).to(dev)
    kernels_lib.fused_linear_jsd(sx, sw, tx, tw, tgt).backward()
    kernels_lib.distill_jsd_loss(sx, sw, tx, tw, tgt).loss.backward()
    kernels_lib.distill_cosine_loss(sx, sw, tx, tw, tgt).loss.backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (logits, sx, sw))
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (x, w, inp))
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in REFUSED and sys.modules[m] is not None)
    assert not loaded, loaded
    try:
        import kernels_workbench
    except ImportError as error:
        assert "pip install -e ./lab" in str(error), error
    else:
        raise AssertionError("kernels_workbench imported without pandas")
    print("lean ok")
    """
)


def test_pyproject_declares_torch_and_triton_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = sorted(dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"])
    assert names == ["torch", "triton"], names
    listed = " ".join(dep for extra in project["optional-dependencies"].values() for dep in extra)
    assert not any(name in listed for name in ("pandas", "plotly", "papermill", "nbconvert")), listed
    lab = tomllib.loads((ROOT / "lab" / "pyproject.toml").read_text())["project"]
    names = {dep.split(">")[0].split("=")[0].strip() for dep in lab["dependencies"]}
    assert {"kernels_lib", "pandas", "plotly", "ipywidgets", "papermill", "nbconvert"} <= names, names


def test_losses_run_without_the_workbench_modules():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lean ok" in result.stdout


def _readme_install_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Install for training"):]
    block = section[section.index("```bash") + len("```bash"):]
    block = block[:block.index("```")]
    return [line.split("#")[0].strip() for line in block.strip().splitlines() if line.strip()]


def test_readme_install_lines_install_from_a_clone():
    """The README installs from the clone ('.'), never by a name a package index would have to know."""
    lines = _readme_install_lines()
    assert lines and all(line.startswith("pip ") for line in lines), lines
    for line in lines:
        target = line.split()[-1].strip("'\"")
        assert target == "." or target.startswith(".[") or target == ".", f"{line!r} does not install the clone"
    assert "pip install ." in lines and "pip install '.[interpreter]'" in lines


def test_installed_as_the_readme_says_the_package_is_complete(tmp_path):
    """``pip install .`` (here into a folder, without its dependencies, which this environment has): the
    installed package, not the clone, imports, holds every module of the clone's package, and runs a loss
    forward and backward."""
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(target), str(ROOT)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    check = textwrap.dedent(f"""
        import pathlib, sys, torch
        sys.path.insert(0, {str(target)!r})
        import kernels_lib
        here = pathlib.Path(kernels_lib.__file__).resolve()
        assert here.is_relative_to(pathlib.Path({str(target)!r}).resolve()), here
        source = pathlib.Path({str(ROOT / "kernels_lib")!r})
        want = sorted(str(p.relative_to(source)) for p in source.rglob("*.py"))
        got = sorted(str(p.relative_to(here.parent)) for p in here.parent.rglob("*.py"))
        missing = sorted(set(want) - set(got))
        assert not missing, missing
        extra = sorted(p.name for p in pathlib.Path({str(target)!r}).iterdir()
                       if not p.name.startswith("kernels_lib"))
        assert not extra, f"the library's install holds more than kernels_lib: {{extra}}"
        assert not any("workbench" in p for p in got), [p for p in got if "workbench" in p]

        dev = kernels_lib.default_device()
        x = torch.randn(6, 16, device=dev, requires_grad=True)
        w = torch.randn(37, 16, device=dev, requires_grad=True)
        kernels_lib.fused_linear_cross_entropy(x, w, torch.randint(0, 37, (6,), device=dev)).backward()
        assert torch.isfinite(w.grad).all()
        print("installed ok")
        """)
    run = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 0 and "installed ok" in run.stdout, run.stderr[-3000:]


def test_without_numpy_the_interpreter_asks_for_its_extra():
    """No GPU and no numpy: the error names Triton's interpreter and the ``interpreter`` extra, at import,
    before any kernel is reached."""
    script = textwrap.dedent("""
        import os, sys
        os.environ["TRITON_INTERPRET"] = "1"  # as on a machine without a GPU
        sys.modules["numpy"] = None  # as if not installed
        try:
            import kernels_lib
        except ImportError as error:
            print("refused:", error)
        else:
            raise SystemExit("imported without numpy")
        """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Triton's interpreter" in run.stdout and "[interpreter]" in run.stdout, run.stdout
