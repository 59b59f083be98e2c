"""The Liger-GRPO study's summary (the script itself needs CUDA and Liger: it runs on a GPU)."""

import pandas as pd
import pytest

from studies import liger_grpo_own_config as study


def _rows(arms):
    return pd.DataFrame([{"arm": arm, "importance_sampling_level": "token", "B": b, "ms_p50": ms * (3 if arm == "bench_adapter" else 1)}
                         for arm in arms for b, ms in ((2, 40.0), (16, 320.0))])


def test_summary_is_the_adapter_over_liger_own_per_point():
    table = study.summary(_rows(study.ARMS))
    assert table["bench_adapter × liger_own"].tolist() == pytest.approx([3.0, 3.0])
    assert list(table.index) == [("token", 2), ("token", 16)]


def test_summary_names_a_missing_arm():
    with pytest.raises(ValueError, match="liger_own"):
        study.summary(_rows(["bench_adapter"]))


def test_the_script_refuses_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(study.torch.cuda, "is_available", lambda: False)  # on a GPU too: never run the study here
    assert study.main(["--out", str(tmp_path)]) == 2
    assert "CUDA only" in capsys.readouterr().err
