"""The data behind the charts: published rows, measured rows and their files."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kernels_workbench import data
from kernels_workbench.bench.sweep import MEASURED_COLUMNS, PUBLISHED_COLUMNS

KERNELS = {
    "fused_linear_cross_entropy", "kl_div", "fused_linear_orpo_loss", "kto_loss",
    "fused_linear_cpo_loss", "fused_linear_simpo_loss", "fused_linear_grpo_loss_token", "fused_linear_grpo_loss_sequence",
    "jsd", "tvd", "fused_linear_jsd", "distill_jsd_loss", "distill_cosine_loss", "cross_entropy", "megatron_cross_entropy",
}


# --------------------------------------------------------------------------- published


def test_published_has_every_published_loss():
    frame = data.load_published()
    assert set(frame.kernel_name) == KERNELS
    assert list(frame.columns) == PUBLISHED_COLUMNS
    for column in ("x_value", "y_value_50", "y_value_20", "y_value_80"):
        assert pd.api.types.is_numeric_dtype(frame[column]), column
    assert (frame.y_value_50 > 0).all()
    assert set(frame.metric_name) <= {"speed", "memory"}


def test_published_kl_rows():
    kl = data.load_published("kl_div")
    assert len(kl) > 0 and (kl.kernel_name == "kl_div").all()
    assert list(kl.index) == list(range(len(kl)))
    assert set(kl.gpu_name) == {"NVIDIA H100 PCIe"}
    assert sorted(set(kl.x_value)) == [4096, 8192, 16384, 32768, 65536, 131072]
    assert set(kl.kernel_provider) == {"torch", "liger"}
    assert (kl.x_name == "V").all()
    # Every (provider, mode, metric) has the full axis.
    for _, group in kl.groupby(["kernel_provider", "kernel_operation_mode", "metric_name"]):
        assert sorted(group.x_value) == [4096, 8192, 16384, 32768, 65536, 131072]


def test_published_preference_rows_are_the_a100_charts():
    """CPO, SimPO and GRPO (token and sequence level): Liger's A100 rows, B = 2 … 16 at T = 1024."""
    for name, baseline in (("fused_linear_cpo_loss", "huggingface"), ("fused_linear_simpo_loss", "huggingface"),
                           ("fused_linear_grpo_loss_token", "torch"), ("fused_linear_grpo_loss_sequence", "torch")):
        rows = data.load_published(name)
        assert set(rows.gpu_name) == {"NVIDIA A100-SXM4-80GB"}, name
        assert set(rows.kernel_provider) == {"liger", baseline}, name
        assert (rows.x_name == "B").all() and sorted(set(rows.x_value)) == [2, 4, 8, 16], name
        assert rows.extra_benchmark_config_str.map(lambda s: json.loads(s)["T"]).eq(1024).all(), name
        for _, group in rows.groupby(["kernel_provider", "kernel_operation_mode", "metric_name"]):
            assert sorted(group.x_value) == [2, 4, 8, 16], name
    assert len(data.load_published("fused_linear_grpo_loss_token")) == 32  # forward, backward, full; speed and memory of full


def test_published_distillation_and_cross_entropy_rows():
    """Issues 11 and 12: the distillation charts and the logits-level cross-entropy charts, unchanged."""
    jsd = data.load_published("jsd")
    assert set(jsd.gpu_name) == {"NVIDIA H100 PCIe", "NVIDIA B200"} and set(jsd.x_name) == {"V", "BT"}
    assert sorted(set(data.load_published("tvd").x_value)) == [4096, 8192, 16384, 32768, 65536, 131072]
    for name in ("fused_linear_jsd", "distill_jsd_loss", "distill_cosine_loss"):
        rows = data.load_published(name)
        assert len(rows) == 24 and (rows.x_name == "BT").all() and set(rows.kernel_provider) == {"liger", "torch"}, name
    megatron = data.load_published("megatron_cross_entropy")
    assert set(megatron.kernel_provider) == {"liger", "megatron-fused", "megatron-unfused"}
    assert set(data.load_published("cross_entropy").kernel_provider) == {"liger", "huggingface"}


def test_published_unknown_kernel_is_empty():
    assert len(data.load_published("no_such_loss")) == 0


# --------------------------------------------------------------------------- read_rows errors


GOOD_HEADER = ",".join(data._REQUIRED)


def test_read_rows_missing_file(tmp_path):
    path = tmp_path / "absent.csv"
    with pytest.raises(FileNotFoundError) as info:
        data.read_rows(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "content",
    [
        GOOD_HEADER + "\nkl_div,torch,forward,speed,1,2,H\nkl_div,torch,forward,speed,1,2,H,extra,more\n",
        "",
    ],
    ids=["ragged", "empty"],
)
def test_read_rows_corrupt_csv(tmp_path, content):
    path = tmp_path / "corrupt.csv"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        data.read_rows(path)
    assert str(path) in str(info.value)


def test_read_rows_undecodable_bytes(tmp_path):
    path = tmp_path / "binary.csv"
    path.write_bytes(GOOD_HEADER.encode() + b"\n\xff\xfe\x00\x81,\x90\n")
    with pytest.raises(ValueError) as info:
        data.read_rows(path)
    assert str(path) in str(info.value)


def test_read_rows_missing_columns(tmp_path):
    path = tmp_path / "short.csv"
    path.write_text("kernel_name,kernel_provider,x_value\nkl_div,torch,4096\n")
    with pytest.raises(ValueError) as info:
        data.read_rows(path)
    message = str(info.value)
    assert str(path) in message and "y_value_50" in message and "gpu_name" in message


def test_read_rows_non_numeric_median(tmp_path):
    path = tmp_path / "text.csv"
    path.write_text(GOOD_HEADER + "\nkl_div,torch,forward,speed,4096,1.5,H\nkl_div,torch,forward,speed,8192,fast,H\n")
    with pytest.raises(ValueError) as info:
        data.read_rows(path)
    message = str(info.value)
    assert str(path) in message and "y_value_50" in message and "fast" in message


def test_read_rows_all_empty_optional_column_is_allowed(tmp_path):
    path = tmp_path / "ok.csv"
    path.write_text(GOOD_HEADER + ",y_value_20\nkl_div,torch,forward,speed,4096,1.5,H,\n")
    frame = data.read_rows(path)
    assert frame.y_value_50.iloc[0] == 1.5 and frame.x_value.iloc[0] == 4096


# --------------------------------------------------------------------------- measured


def _row(provider="kernels_lib", x=64, y=1.0, timestamp="2026-01-01 00:00:00", mode="forward", metric="speed", config="{}"):
    row = {column: "" for column in MEASURED_COLUMNS}
    row.update(
        kernel_name="kl_div", kernel_provider=provider, kernel_operation_mode=mode, metric_name=metric,
        metric_unit="ms", x_name="V", x_label="vocab size", x_value=x, y_value_50=y, y_value_20=y, y_value_80=y,
        extra_benchmark_config_str=config, gpu_name="GPU A", timestamp=timestamp,
    )
    return row


@pytest.fixture
def measured_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    return tmp_path


def test_load_measured_missing_file_is_empty(measured_dir):
    frame = data.load_measured("kl_div")
    assert len(frame) == 0 and "y_value_50" in frame.columns


def test_load_measured_latest_keeps_newest_per_key(measured_dir):
    rows = pd.DataFrame(
        [
            _row(x=64, y=3.0, timestamp="2026-01-03 00:00:00"),  # newest of its key, written first
            _row(x=64, y=1.0, timestamp="2026-01-01 00:00:00"),
            _row(x=64, y=2.0, timestamp="2026-01-02 00:00:00"),
            _row(x=128, y=5.0, timestamp="2026-01-01 00:00:00"),
            _row(x=64, y=7.0, timestamp="2026-01-01 00:00:00", provider="torch"),
            _row(x=64, y=9.0, timestamp="2026-01-01 00:00:00", config='{"dtype": "torch.bfloat16"}'),
            _row(x=64, y=11.0, timestamp="2026-01-01 00:00:00", mode="full"),
            _row(x=64, y=13.0, timestamp="2026-01-01 00:00:00", metric="memory"),
        ],
        columns=MEASURED_COLUMNS,
    )
    data.append_measured(rows, "kl_div")
    everything = data.load_measured("kl_div", latest=False)
    assert len(everything) == 8
    latest = data.load_measured("kl_div")
    assert len(latest) == 6
    key = (latest.kernel_provider == "kernels_lib") & (latest.x_value == 64) & (latest.kernel_operation_mode == "forward")
    key &= (latest.metric_name == "speed") & (latest.extra_benchmark_config_str == "{}")
    assert latest[key].y_value_50.tolist() == [3.0]
    assert sorted(latest.y_value_50) == [3.0, 5.0, 7.0, 9.0, 11.0, 13.0]


def test_append_measured_writes_one_header(measured_dir):
    first = pd.DataFrame([_row(x=64)], columns=MEASURED_COLUMNS)
    second = pd.DataFrame([_row(x=128), _row(x=256)], columns=MEASURED_COLUMNS)
    path = data.append_measured(first, "kl_div")
    assert path == measured_dir / "kl_div.csv"
    data.append_measured(second, "kl_div")
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and lines.count(",".join(MEASURED_COLUMNS)) == 1
    assert data.read_rows(path).x_value.tolist() == [64, 128, 256]


def test_append_measured_into_a_runs_own_folder(measured_dir, tmp_path):
    """``directory``: the rows go to ``<directory>/<name>.csv`` (created with its folder), ``data/measured/`` untouched,
    and the same column rules hold there."""
    out = tmp_path / "run" / "out"
    first = pd.DataFrame([_row(x=64)], columns=MEASURED_COLUMNS)
    path = data.append_measured(first, "tensor_parallel", directory=out)
    assert path == out / "tensor_parallel.csv" and not (measured_dir / "tensor_parallel.csv").exists()
    data.append_measured(pd.DataFrame([_row(x=128)], columns=MEASURED_COLUMNS), "tensor_parallel", directory=str(out))
    assert data.read_rows(path).x_value.tolist() == [64, 128]
    with pytest.raises(ValueError, match="other columns"):
        data.append_measured(pd.DataFrame([{"kernel_name": "kl_div", "note": "x"}]), "tensor_parallel", directory=out)


def test_append_measured_refuses_other_columns(measured_dir):
    path = measured_dir / "kl_div.csv"
    other = GOOD_HEADER + ",something_else\nkl_div,torch,forward,speed,4096,1.5,H,1\n"
    path.write_text(other)
    rows = pd.DataFrame([_row()], columns=MEASURED_COLUMNS)
    with pytest.raises(ValueError) as info:
        data.append_measured(rows, "kl_div")
    assert str(path) in str(info.value)
    assert path.read_text() == other  # nothing appended


def test_committed_measured_files_read():
    for name in ("kl_div", "ceilings"):
        frame = data.read_rows(data.DATA_DIR / "measured" / f"{name}.csv")
        assert list(frame.columns) == MEASURED_COLUMNS, name
        assert len(frame) > 0 and (frame.y_value_50 > 0).all(), name


@pytest.mark.parametrize("path", sorted(data.MEASURED_DIR.rglob("*.csv")), ids=lambda p: str(p.relative_to(data.MEASURED_DIR)))
def test_every_measured_row_names_its_gpu_versions_and_commit(path):
    """The project's convention: each measured row carries the GPU, the torch and triton versions and the commit."""
    frame = pd.read_csv(path)
    required = ["gpu_name", "torch_version", "triton_version", "kernels_lib_commit"]
    assert [c for c in required if c not in frame.columns] == [], path
    assert frame[required].notna().all().all(), path


def test_append_measured_extends_an_older_layout(measured_dir):
    """A file written before the peer-version columns were added gets them, empty in its old rows."""
    old_columns = MEASURED_COLUMNS[:-2]
    path = measured_dir / "kl_div.csv"
    pd.DataFrame([_row(x=64)], columns=MEASURED_COLUMNS)[old_columns].to_csv(path, index=False)
    new = pd.DataFrame([_row(x=128)], columns=MEASURED_COLUMNS).assign(quack_version="0.6.4")
    data.append_measured(new, "kl_div")
    rows = data.read_rows(path)
    assert list(rows.columns) == MEASURED_COLUMNS
    assert rows.x_value.tolist() == [64, 128]
    assert rows.quack_version.isna().tolist() == [True, False]


def test_an_all_digit_or_float_looking_commit_stays_text(tmp_path):
    """Short hashes such as ``4375441`` (all digits) or ``2950e31`` (a float to pandas) are read as the
    text they are, so the newest run is found and a run label names the commit the run was given."""
    path = tmp_path / "rows.csv"
    rows = pd.DataFrame({"kernel_name": "k", "kernel_provider": "kernels_lib", "kernel_operation_mode": "full",
                         "metric_name": "speed", "x_value": [1, 2, 1], "y_value_50": [1.0, 2.0, 3.0], "gpu_name": "G",
                         "kernels_lib_commit": ["2950e31", "0012345", "4375441"],
                         "timestamp": ["2026-12-01", "2026-12-01", "2026-12-02"]})
    rows.to_csv(path, index=False)
    read = data.read_rows(path)
    assert list(read.kernels_lib_commit) == ["2950e31", "0012345", "4375441"]
    newest = data.newest_run(read)
    assert len(newest) == 1 and newest.y_value_50.item() == 3.0
    assert "4375441" in data.run_label(newest)


# --------------------------------------------------------------------------- the GPU as a dimension

H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"


def _runs_of_two_gpus() -> pd.DataFrame:
    """Synthetic rows: two H200 runs (old: kernels_lib, liger; new: kernels_lib only), one H100 80GB run
    (kernels_lib, liger) older than both, and a CPU row that names no GPU of ours."""
    rows = []
    for commit, gpu, device, stamp, providers in (
        ("h200old", H200, "cuda", "2026-12-01 10:00:00", {"kernels_lib": 2.0, "liger": 4.0}),
        ("h200new", H200, "cuda", "2026-12-03 10:00:00", {"kernels_lib": 1.0}),
        ("h100run", H100, "cuda", "2026-11-20 10:00:00", {"kernels_lib": 3.0, "liger": 5.0}),
        ("cpurun", "CPU (Triton interpreter)", "cpu", "2026-12-04 10:00:00", {"kernels_lib": 900.0}),
    ):
        for provider, ms in providers.items():
            rows.append({"kernel_name": "toy", "kernel_provider": provider, "kernel_operation_mode": "full", "metric_name": "speed",
                         "x_value": 1024.0, "y_value_50": ms, "gpu_name": gpu, "device": device, "kernels_lib_commit": commit,
                         "timestamp": stamp})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("name, label", [(H100, "H100 80GB"), (H200, "H200"), ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
                                         ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA B200", "B200"),
                                         ("CPU (Triton interpreter)", "CPU (Triton interpreter)")])
def test_gpu_label_is_the_short_name(name, label):
    assert data.gpu_label(name) == label


def test_gpus_measured_are_every_cuda_gpu_none_preferred():
    rows = _runs_of_two_gpus()
    assert data.gpus_measured(rows) == [H100, H200]  # by label; the CPU rows measured on no GPU
    assert data.gpus_measured(rows[rows.gpu_name == H200]) == [H200]
    assert data.gpus_measured(rows.iloc[:0]) == []
    with pytest.raises(ValueError, match="gpu_name"):
        data.gpus_measured(rows.drop(columns="gpu_name"))


def test_newest_run_per_gpu_is_one_run_of_each_gpu():
    runs = data.newest_run_per_gpu(_runs_of_two_gpus())
    assert list(runs) == [H100, H200]
    assert set(runs[H200].kernels_lib_commit) == {"h200new"}  # the newest H200 run, not the older one with liger
    assert set(runs[H100].kernels_lib_commit) == {"h100run"}  # older than both H200 runs, still shown for its GPU
    for gpu, run in runs.items():
        assert data.run_label(run).startswith(f"run of commit {run.kernels_lib_commit.iloc[0]} on {gpu}")
    # a ratio is taken inside one run on one GPU: the H200's liger was not in its newest run, the H100's was
    h200 = data.same_run_pairs(runs[H200], "kernels_lib", ["liger"])
    assert h200.ratio.isna().all()
    assert data.same_run_pairs(runs[H100], "kernels_lib", ["liger"]).ratio.tolist() == pytest.approx([3.0 / 5.0])
    with pytest.raises(ValueError, match="one run expected"):
        data.same_run_pairs(pd.concat(runs.values()), "kernels_lib", ["liger"])
    assert data.newest_run_per_gpu(_runs_of_two_gpus().iloc[:0]) == {}
