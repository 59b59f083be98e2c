"""The profiling and A/B scripts of ``studies/`` at CPU size: each runs end to end and writes its tables."""

from __future__ import annotations


def test_small_vocab_profile_script_cpu_path(tmp_path):
    """The small-vocabulary profile at CPU size: every chart, provider and mode timed, host times
    positive, the profiled ops of kernels_lib's full step, each file with its provenance."""
    import importlib

    import pandas as pd

    script = importlib.import_module("studies.ce_small_vocab_profile")
    assert script.main(["--out", str(tmp_path), "--size", "small"]) == 0
    times = pd.read_csv(tmp_path / script.FILES["times"])
    assert set(times.chart) == set(script.CHARTS) and set(times["mode"]) == {"forward", "full"}
    assert set(times.provider) == {"kernels_lib", "kernels_lib[host_checks=False]", "torch"}
    assert (times[["host ms per call, back to back", "host ms of one call after a sync"]] > 0).all().all()
    ops = pd.read_csv(tmp_path / script.FILES["ops"])
    assert "_CrossEntropyFunction" in set(ops.op) and "kernels_lib_commit" in ops.columns
    stages = pd.read_csv(tmp_path / script.FILES["breakdown"])
    assert set(stages.chart) == set(script.CHARTS) and "kernels_lib_commit" in stages.columns
    assert {"target_totals + range check", "cross_entropy_rows launch (fused)", "bare Triton launch"} <= set(stages.stage)
    assert (stages["host us per call"] > 0).all()
    steps = pd.read_csv(tmp_path / script.FILES["step"])
    assert set(steps.chart) == set(script.CHARTS) and set(steps.provider) == set(script.providers())
    assert (steps["step ms"] > 0).all() and (steps["chain ms"] > 0).all() and "kernels_lib_commit" in steps.columns
    # The CSV rounds each column on its own: the difference holds to the last digit written.
    assert ((steps["loss in step ms"] - (steps["step ms"] - steps["chain ms"])).abs() < 1e-9 * steps["step ms"]).all()


def test_sequence_chunk_ab_script_small_path(tmp_path):
    """The sequence A/B script at CPU size: a row per B and chunk, times positive, appended with provenance."""
    import importlib

    import pandas as pd

    script = importlib.import_module("studies.sequence_chunk_ab")
    args = ["--out", str(tmp_path), "--route", "r", "--losses", "kto_loss", "--chunks", "default,16", "--size", "small"]
    assert script.main(args) == 0 and script.main(args) == 0
    rows = pd.read_csv(tmp_path / script.FILE)
    assert len(rows) == 2 * 3 * 2 and set(rows.chunk.astype(str)) == {"default", "16"}
    assert (rows[["full_ms", "forward_ms"]] > 0).all().all() and {"route", "kernels_lib_commit", "gpu_name"} <= set(rows.columns)


def test_distill_chunk_ab_script_small_path(tmp_path):
    """The two-head stage A/B at CPU size: a row per round, soft loss and arm with its errors against the library's
    stage; a row per round, loss, BT and arm of the losses with the arm in place; provenance on each; bad arms refused."""
    import importlib

    import pandas as pd
    import pytest

    script = importlib.import_module("studies.distill_chunk_ab")
    args = ["--out", str(tmp_path), "--size", "small", "--rounds", "2", "--stage-arms", "plain",
            "--loss-arms", "lanes+few_exp"]
    assert script.main(args) == 0
    stage = pd.read_csv(tmp_path / "distill_chunk_ab_stage.csv")
    assert len(stage) == 2 * 2 * 2 and set(stage.arm) == {"library", "plain"} and set(stage.soft) == {"jsd", "cosine"}
    assert (stage[["soft error", "hard error", "dz error"]] <= 1e-5).all().all(), stage
    assert (stage.ms > 0).all() and "kernels_lib_commit" in stage.columns
    loss = pd.read_csv(tmp_path / "distill_chunk_ab_loss.csv")
    assert set(loss.loss) == set(script.LOSSES) and set(loss.arm) == {"library", "lanes+few_exp"}
    assert len(loss) == 3 * 2 * 2 * 2 and (loss.full_ms > 0).all()  # 3 losses, 2 BT, 2 arms, 2 rounds
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path), "--stage-arms", "lanes+typo"])


def test_jsd_log_ab_script_small_path(tmp_path):
    """The logits JSD's log-dial A/B at CPU size: a row per chart, x, arm and round with the errors against the
    library's kernel (the few_exp arm computes the same loss and gradient), provenance on each; bad arms refused."""
    import importlib

    import pandas as pd
    import pytest

    script = importlib.import_module("studies.jsd_log_ab")
    assert script.main(["--out", str(tmp_path), "--size", "small", "--rounds", "2", "--points", "ends"]) == 0
    table = pd.read_csv(tmp_path / "jsd_log_ab.csv")
    assert set(table.arm) == {"library", *script.CPU_ARMS} and set(table.chart) == set(script.CHARTS)
    assert len(table) == 2 * 2 * (1 + len(script.CPU_ARMS)) * 2  # 2 charts, 2 ends, arms, 2 rounds
    assert (table[["loss error", "grad error"]] <= 1e-5).all().all(), table
    assert (table.full_ms > 0).all() and "kernels_lib_commit" in table.columns
    with pytest.raises(SystemExit):
        script.main(["--out", str(tmp_path), "--arms", "few_exp+typo"])


def test_jsd_log_ab_arm_runs_the_study_kernel():
    """An arm's stand-in is what ``kernels_lib.jsd`` launches (a stand-in that refuses to launch makes the loss raise),
    and the library's kernel is back after the arm."""
    import pytest
    import torch

    import kernels_lib
    from kernels_lib.kernels import jsd as module
    from studies.bench.arms import constants_set

    class Refuses:
        def __getitem__(self, grid):
            raise RuntimeError("the arm's kernel was launched")

    library = module.jsd_kernel
    x = torch.randn(4, 33).log_softmax(-1).requires_grad_()
    y = torch.randn(4, 33).log_softmax(-1)
    with constants_set({"kernels_lib.kernels.jsd": {"jsd_kernel": Refuses()}}), pytest.raises(RuntimeError, match="arm's kernel"):
        kernels_lib.jsd(x, y, beta=0.5)
    assert module.jsd_kernel is library


def test_host_sync_ab_script_runs_both_libraries_interleaved(tmp_path):
    """The old/new A/B at CPU size, with this tree as the "old" copy: the old arm calls the package
    imported as ``kernels_lib_old``, and each loss has a new and an old row with its ratio quantiles."""
    import importlib
    from pathlib import Path

    import pandas as pd

    import kernels_lib

    script = importlib.import_module("studies.host_sync_ab")
    root = Path(kernels_lib.__file__).parent.parent
    args = ["--old", str(root), "--old-commit", "same", "--out", str(tmp_path), "--losses", "kto_loss,distill_jsd_loss",
            "--samples", "2"]
    assert script.main(args) == 0
    new = importlib.import_module("kernels_lib.fused_linear_kto").fused_linear_kto
    assert script.counterpart(new).__module__ == "kernels_lib_old.fused_linear_kto"
    rows = pd.read_csv(tmp_path / script.FILE)
    assert len(rows) == 4 and set(rows.kernel_provider) == {"new", "old"}
    assert set(rows[rows.kernel_provider == "old"].arm_commit) == {"same"}
    assert (rows[["ms_50", "ratio_50"]] > 0).all().all() and (rows[rows.kernel_provider == "old"].ratio_50 == 1).all()


def test_ce_resident_ab_script_small_path(tmp_path):
    """The resident-row A/B at CPU size: each chart and V has a row per limit, the limit restored after,
    and a longer resident row gives the same loss and gradient (rel_diff at float32 rounding)."""
    import importlib

    import pandas as pd

    from kernels_lib.kernels import cross_entropy_rows

    script = importlib.import_module("studies.ce_resident_ab")
    before = cross_entropy_rows.RESIDENT_MAX_COLS
    args = ["--out", str(tmp_path), "--size", "small", "--vocab", "2048", "--limits", "1024,4096", "--samples", "2"]
    assert script.main(args) == 0
    assert cross_entropy_rows.RESIDENT_MAX_COLS == before, "the A/B must leave the library's limit as it found it"
    rows = pd.read_csv(tmp_path / script.FILE)
    assert len(rows) == 4 and set(rows.chart) == set(script.CHARTS)
    assert list(rows.resident) == [False, True, False, True]
    assert (rows.rel_diff < 1e-5).all()
    assert (rows.ms_50 > 0).all() and "kernels_lib_commit" in rows.columns


def test_sustained_matmul_script_cpu_path(tmp_path):
    """The sustained-rate study at CPU size: a row per product, starts increasing, at least two products a burst
    (how many more depends on the machine's speed: not asserted), and an unknown shape refused by name."""
    import importlib

    import pandas as pd
    import pytest

    script = importlib.import_module("studies.sustained_matmul")
    assert script.main(["--out", str(tmp_path), "--bursts", "1,3", "--shapes", "8192^3"]) == 0
    rows = pd.read_csv(tmp_path / script.FILE)
    assert set(rows.burst_ms) == {1.0, 3.0} and (rows.ms > 0).all() and (rows.tflops > 0).all()
    for _, burst in rows.groupby("burst_ms"):
        assert burst.start_ms.is_monotonic_increasing and list(burst["product"]) == list(range(len(burst)))
        assert len(burst) >= 2, "a burst is at least two products (its count comes from one product's time)"
    with pytest.raises(ValueError, match="--shapes"):
        script.main(["--out", str(tmp_path), "--shapes", "4096^3"])
