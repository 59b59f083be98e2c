"""Errors of the workbench itself that ``tests/test_data.py`` and ``tests/test_bench.py`` do not cover.

- The committed CSVs under ``data/`` gone missing or corrupt: every loader names the file
  (``read_rows`` alone is tested in test_data.py, on files it is handed; here the loaders the
  notebooks call, pointed at broken copies).
- A peer package that is not installed (simulated: its import fails, CUDA reported available):
  its provider is skipped with a note naming the ImportError, and the sweep runs the others.
- The command line: sizes the loss does not have, and devices that are not one of its choices.
"""

from __future__ import annotations

import sys

import pandas as pd
import pytest
import torch

from kernels_workbench import data
from kernels_workbench.bench import cli
from kernels_workbench.bench.registry import get_spec, registered_losses
from kernels_workbench.bench.sweep import available_providers, run_sweep

GOOD_HEADER = ",".join(data._REQUIRED)
CORRUPT = {
    "ragged": GOOD_HEADER + "\nkl_div,torch,forward,speed,1,2,H\nkl_div,torch,forward,speed,1,2,H,extra,more\n",
    "empty": "",
    "binary": b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe\x81",
}


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# --------------------------------------------------------------------------- data/ files


@pytest.mark.parametrize("loader, attribute", [(data.load_published, "PUBLISHED_ROWS")])
def test_missing_published_file_is_named(loader, attribute, tmp_path, monkeypatch):
    path = tmp_path / "published" / "gone.csv"
    monkeypatch.setattr(data, attribute, path)
    with pytest.raises(FileNotFoundError) as info:
        loader("kl_div")
    assert str(path) in str(info.value)


@pytest.mark.parametrize("kind", list(CORRUPT))
@pytest.mark.parametrize("loader, attribute", [(data.load_published, "PUBLISHED_ROWS")])
def test_corrupt_published_file_is_named(loader, attribute, kind, tmp_path, monkeypatch):
    path = _write(tmp_path / "published" / "broken.csv", CORRUPT[kind])
    monkeypatch.setattr(data, attribute, path)
    with pytest.raises(ValueError) as info:
        loader()
    assert str(path) in str(info.value)


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_corrupt_measured_file_is_named_by_load_and_append(kind, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    path = _write(tmp_path / "kl_div.csv", CORRUPT[kind])
    with pytest.raises(ValueError) as info:
        data.load_measured("kl_div")
    assert str(path) in str(info.value)
    with pytest.raises(ValueError) as info:
        data.append_measured(pd.DataFrame({c: [1] for c in data._REQUIRED}), "kl_div")
    assert str(path) in str(info.value)
    assert path.read_bytes() == (CORRUPT[kind] if isinstance(CORRUPT[kind], bytes) else CORRUPT[kind].encode())


# --------------------------------------------------------------------------- peers not installed

PEERS = ("liger_kernel", "cut_cross_entropy")


@pytest.fixture
def peers_not_installed(monkeypatch):
    """Every peer's import fails (None in sys.modules), while CUDA is reported available: the provider
    must then fall on the ImportError, not on the CUDA check that would hide it on this machine."""
    for name in list(sys.modules):
        if name.split(".")[0] in PEERS:
            monkeypatch.delitem(sys.modules, name)
    for name in PEERS:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("loss", registered_losses())
def test_peer_not_installed_is_skipped_with_a_note(loss, peers_not_installed):
    spec = get_spec(loss)
    loaded, skipped = available_providers(loss)
    assert "kernels_lib" in loaded and set(loaded) | set(skipped) == set(spec.providers)
    peers = [name for name in ("liger", "cce") if name in spec.providers]
    assert peers, f"{loss}: no peer provider to test"
    for name in peers:
        assert name in skipped and skipped[name].startswith(("ImportError", "ModuleNotFoundError")), skipped


def test_sweep_runs_without_the_peer_and_notes_it(peers_not_installed):
    rows = run_sweep(
        "kl_div", x_name="V", x_values=[8], sizes={"N": 2}, dtype=torch.float32, device="cpu",
        providers=["kernels_lib", "liger"], modes=("forward",),
    )
    assert set(rows.kernel_provider) == {"kernels_lib"}
    assert rows.note.str.contains("liger skipped (ModuleNotFoundError", regex=False).all()


# --------------------------------------------------------------------------- command line

BASE = ["kl_div", "--values", "4", "--size", "N=2", "--providers", "kernels_lib", "--modes", "forward", "--dry-run"]


@pytest.mark.parametrize("device", ["meta", "cuda:0", "CPU", ""])
def test_cli_rejects_devices_outside_its_choices(device, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(BASE + ["--device", device])
    assert info.value.code == 2
    assert "--device" in capsys.readouterr().err


def test_cli_rejects_an_empty_provider_name(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(BASE[:5] + ["--providers", "kernels_lib,,torch"] + BASE[7:])
    assert info.value.code == 2
    assert "providers must be among" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["Q=3", "V=3"], ids=["unknown-size", "size-of-the-swept-axis"])
def test_cli_rejects_sizes_the_loss_lacks(size, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(BASE + ["--size", size])
    assert info.value.code == 2
    assert size.split("=")[0] in capsys.readouterr().err
