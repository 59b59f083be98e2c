"""The targets' checks of the distillation and sequence losses never make the GPU wait for the host.

Each loss counts its bad targets (and, for the sequence losses, its empty sequences) on the device and
reads the counts on the host (:class:`kernels_lib._validate.HostCounts`) only once every kernel of the
call is queued: a read at the start of the call would leave the GPU idle while the host launches the
rest. On the CPU (and on a GPU) the order of reads and launches is checked for every loss, on the
bench's own inputs, with every host read of a tensor the library makes (``.item()``, ``int(t)`` ...)
logged beside them; on CUDA the call also runs under ``torch.cuda.set_sync_debug_mode("error")``, so
any synchronizing operation (``.item()``, a blocking copy, boolean indexing ...) fails the test with
the operation named (KTO's outputs split by label included: their sizes come the same way).
"""

from __future__ import annotations

import sys

import pytest
import torch

import kernels_lib  # noqa: F401  (sets up the backend before the kernels are defined)
from kernels_lib import _distillation, _sequence_logprobs, _validate, default_device
from kernels_workbench.bench.registry import get_spec
from kernels_workbench.bench.timing import mode_callable

DEVICE = default_device()

DEFERRED = (
    "distill_jsd_loss", "distill_cosine_loss", "fused_linear_dpo_loss", "kto_loss", "fused_linear_orpo_loss",
    "fused_linear_cpo_loss", "fused_linear_simpo_loss", "fused_linear_grpo_loss_token",
    "fused_linear_grpo_loss_sequence",
)


def bench_inputs(name: str, **options):
    """The loss's kernels_lib call and its bench's CPU-sized inputs (``options`` over the bench's defaults)."""
    spec = get_spec(name)
    small = spec.small
    sizes = {**small["sizes"], small["x_name"]: small["x_values"][0]}
    inputs = spec.make_inputs(sizes, small.get("dtype", torch.float32), DEVICE, {**spec.default_options, **options})
    return spec.providers["kernels_lib"].load(), inputs


def bench_call(name: str, **options):
    """The loss's ``full`` call (forward and backward) on its bench's CPU-sized inputs."""
    fn, inputs = bench_inputs(name, **options)
    return mode_callable(lambda: fn(*inputs.args, **inputs.kwargs), inputs.grad_inputs, "full")


def logged(log: list, what: str, fn):
    def wrapper(*args, **kwargs):
        log.append(what)
        return fn(*args, **kwargs)
    return wrapper


#: Tensor methods that read a value on the host: each a sync on CUDA.
HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "nonzero")


def host_read_spy(log: list, what: str, fn):
    """``fn`` that also logs ``"<what> file:line"`` when the library calls it (its own frame in ``kernels_lib``,
    not the workbench), but for :class:`~kernels_lib._validate.HostCounts` reading CPU counts at once."""
    def wrapper(self, *args, **kwargs):
        frame = sys._getframe(1)
        path, func = frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name
        if "/kernels_lib/" in path and "/workbench/" not in path and not (path.endswith("/_validate.py") and func == "__init__"):
            log.append(f"{what} {path.split('/kernels_lib/')[-1]}:{frame.f_lineno}")
        return fn(self, *args, **kwargs)
    return wrapper


@pytest.mark.parametrize("skip_ignored", [False, True], ids=["every-row", "skip-ignored"])
@pytest.mark.parametrize("name", DEFERRED)
def test_the_targets_checks_are_read_after_every_kernel_of_the_call_is_queued(name, skip_ignored, monkeypatch):
    """On the CPU as on a GPU: the checks' counts are read (``HostCounts.read``) after the call's last launch,
    and the library reads no other tensor on the host before it (``.item()``, ``int(t)``, ``nonzero`` ...);
    with the sequence losses' ``skip_ignored`` (the default), but for the one read it documents per head
    run: the valid tokens per sequence, which size the chunks of kept rows."""
    if skip_ignored and name.startswith("distill"):
        pytest.skip("the distillation losses have no skip_ignored")
    full = bench_call(name, **({} if name.startswith("distill") else {"skip_ignored": skip_ignored}))
    log: list[str] = []
    monkeypatch.setattr(_validate.HostCounts, "read", logged(log, "read", _validate.HostCounts.read))
    for module, launcher in ((_distillation, "launch_distill_chunk"), (_sequence_logprobs, "launch_token_logprobs"),
                             (_sequence_logprobs, "launch_token_logprobs_grad")):
        monkeypatch.setattr(module, launcher, logged(log, "launch", getattr(module, launcher)))
    for method in HOST_READS:
        monkeypatch.setattr(torch.Tensor, method, host_read_spy(log, method, getattr(torch.Tensor, method)))
    full()
    assert "launch" in log, f"{name}: no kernel launch seen (the test patches the wrong launchers)"
    assert "read" in log, f"{name}: its targets' checks were never read on the host"
    last_launch = len(log) - 1 - log[::-1].index("launch")
    assert log.index("read") > last_launch, (
        f"{name}: the targets' checks were read on the host before the call's last kernel was queued: {log}")
    plan_reads = [entry for entry in log[:last_launch] if entry.startswith("tolist _sequence_logprobs.py")]
    assert len(plan_reads) <= (2 if skip_ignored else 0), f"{name}: {len(plan_reads)} row plans read on the host"
    early = sorted({entry for entry in log[:last_launch] if entry not in ("launch", "read", *plan_reads)})
    assert not early, f"{name}: tensors read on the host before the call's last kernel was queued (syncs on CUDA): {early}"


#: The sequence losses without ``skip_ignored``, whose one documented read per head run is a sync.
NO_SYNC_CASES = [(name, {} if name.startswith("distill") else {"skip_ignored": False}) for name in DEFERRED] + [
    ("fused_linear_grpo_loss_token", {"loss_type": "dr_grpo", "skip_ignored": False}),
    ("fused_linear_grpo_loss_sequence", {"loss_type": "dapo", "num_items_in_batch": 7, "skip_ignored": False}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name, options", NO_SYNC_CASES, ids=[f"{n}-{'-'.join(map(str, o.values())) or 'default'}" for n, o in NO_SYNC_CASES])
def test_the_call_makes_no_host_sync(name, options):
    full = bench_call(name, **options)
    full()  # compile first: the launchers' own first-call work is not the call's
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        full()
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["distill_jsd_loss", "fused_linear_dpo_loss", "fused_linear_grpo_loss_token"])
def test_a_far_out_of_range_target_is_refused_after_kernels_that_read_nothing_for_it(name):
    """The kernels run before the check is read: a target of 10**9 must reach no memory (an illegal
    address would surface at the synchronize) and still be refused, named."""
    fn, inputs = bench_inputs(name)
    target = next(a for a in inputs.args if isinstance(a, torch.Tensor) and not a.is_floating_point())
    target.view(-1)[1] = 10**9
    with pytest.raises(ValueError, match=r"target holds 1 value\(s\) outside"):
        fn(*inputs.args, **inputs.kwargs)
    torch.cuda.synchronize()


def test_host_counts_read_once_and_keep_their_values():
    counts = torch.tensor([3, 0], device=DEVICE)
    host = _validate.HostCounts(counts)
    counts.zero_()  # the counts were taken when the check was made, not when it is read
    first = host.read()
    assert first == [3, 0] and all(type(c) is int for c in first), first
    assert host.read() is first, "a second read must return the first one's values, not wait again"


def test_kto_reads_its_checks_and_its_label_count_through_one_host_copy(monkeypatch):
    """KTO's desirable count (which sizes its split outputs) rides in the targets' check's one pinned copy:
    one ``HostCounts`` per call, so one event to wait on, not two."""
    full = bench_call("kto_loss")
    made: list[int] = []
    original = _validate.HostCounts.__init__

    def counting(self, counts):
        made.append(counts.numel())
        original(self, counts)

    monkeypatch.setattr(_validate.HostCounts, "__init__", counting)
    full()
    assert len(made) == 1, f"kto_loss made {len(made)} host copies of counts per call (sizes {made}); expected one"
    assert made[0] == 3, f"kto_loss's one copy holds {made[0]} counts; expected 3 (bad targets, empty sequences, desirable)"


def test_range_check_of_keeps_the_valid_mask_and_names_the_target():
    target = torch.tensor([[0, -100, 4], [7, 2, -100]], device=DEVICE)
    check = _validate.check_targets(target, 5, -100, name="labels")
    assert torch.equal(check.valid, target != -100), "check_targets must keep the not-ignore_index mask"
    with pytest.raises(ValueError, match=r"labels holds 1 value\(s\) outside \[0, 5\) .* \(e\.g\. 7\)"):
        check.raise_if_bad()
    _validate.check_targets(target.clamp(max=4), 5, -100).raise_if_bad()  # in range: no error


#: Where the package may copy a host value onto the device with ``torch.tensor``/``torch.as_tensor``:
#: the float64 reference (not a hot path) and the vocab-parallel handshake (which reads its facts
#: on the host anyway, once per call, by design).
HOST_COPY_ALLOWED = ("reference.py", "_vocab_parallel.py")


def test_the_package_makes_no_device_tensor_from_a_host_value():
    """``torch.tensor(number, device=cuda)`` is a blocking copy from pageable memory: a host sync on every
    call. The library makes device scalars with a fill (``torch.full``) instead; this scan of the package's
    source finds any new ``torch.tensor``/``torch.as_tensor`` given a ``device`` (the GPU no-sync test finds
    only the calls it runs)."""
    import ast
    from pathlib import Path

    root = Path(kernels_lib.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("workbench/") or rel in HOST_COPY_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("tensor", "as_tensor") and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch" and any(k.arg == "device" for k in node.keywords)):
                found.append(f"{rel}:{node.lineno}")
    assert not found, f"device tensors made from host values (a blocking copy per call; use torch.full): {found}"
