"""Notebooks 03 (ORPO) and 04 (KTO) as papermill runs them in CI: CPU parameters, checks asserted, figures exported,
and per GPU of the committed rows (and per sequence length T) the newest run's comparison with the peers and the floor;
then the helpers of :mod:`kernels_workbench.preference` the two notebooks use, on synthetic rows."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import nbformat
import pandas as pd

import pytest
import torch

import notebook_runs  # each notebook executed once, shared with the browser tests
from kernels_workbench import comparison, data, overview, preference, report
from kernels_workbench import floor as one_floor
from kernels_workbench.bench.analysis import medians

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
ORPO, KTO = NOTEBOOKS / "03_orpo.ipynb", NOTEBOOKS / "04_kto.ipynb"
FALLBACK = "not able to be represented"  # nbconvert's text for an output it cannot render
TARGET_WORDS = ("hold ourselves", "missed", "verdict", "≤ 0.8×", "≤ 0.6×", "≤ 0.85×", "short of")


def _run(notebook: Path) -> tuple[Path, str]:
    html_path, results, executed_path = notebook_runs.executed(notebook)
    executed = nbformat.read(executed_path, as_version=4)
    outputs = [o for c in executed.cells for o in c.get("outputs", [])]
    assert [o for o in outputs if o.get("output_type") == "error"] == []
    assert not any("ipywidgets" in str(o.get("data", {})) for o in outputs)
    html = html_path.read_text(encoding="utf-8")
    assert html.count("Plotly.newPlot(") >= 3  # the sweep, the published chart, speed vs memory
    assert FALLBACK not in html
    assert "GPU rows have not been measured yet" not in html or "scripts/published_sweeps.py" in html
    return results, html


@pytest.mark.notebook
@notebook_runs.GROUP
def test_orpo_notebook_runs_checks_and_exports_figures():
    results, html = _run(ORPO)
    trl = pd.read_csv(results / "orpo_trl_checks.csv")
    assert len(trl) == 6 and trl["passed"].all()
    assert set(trl["dtype"]) == {"float32", "bfloat16", "float16"}
    assert (trl.loc[trl.dtype == "float32", "kernels_lib vs TRL (loss)"] < 1e-5).all()
    checks = pd.read_csv(results / "orpo_checks.csv")
    assert len(checks) == 2 * 3 * 3 and checks["passed"].all()
    assert "log1mexp" in html and "The naive form is infinite" in html
    _says_headline_and_conclusion(html, "10. Conclusion")
    by_t = _compared_per_gpu("fused_linear_orpo_loss", "orpo", results, html)
    assert 4096 in by_t, "the committed rows hold a T = 4096 run: its table is printed beside T = 1024's"


@pytest.mark.notebook
@notebook_runs.GROUP
def test_kto_notebook_runs_checks_and_exports_figures():
    results, html = _run(KTO)
    checks = pd.read_csv(results / "kto_checks.csv")
    assert len(checks) == 2 * 3 * 3 and checks["passed"].all()
    assert (checks.loc[checks.dtype == "float32", "kernels_lib loss err"] < 1e-5).all()
    labels = pd.read_csv(results / "kto_label_checks.csv")
    assert len(labels) == 12 and labels["passed"].all()
    assert set(labels["labels"]) == {"mixed", "all desirable", "all undesirable"}
    assert "Published H100" in html
    _says_headline_and_conclusion(html, "10. Conclusion")
    by_t = _compared_per_gpu("kto_loss", "kto", results, html)
    for gpu, run in by_t[512].items():  # the floor against the fastest time, at the largest B of each GPU's run
        assert f"On the {data.gpu_label(gpu)} at B = {int(run.x_value.max())}, the floor is " in html


def _compared_per_gpu(kernel_name: str, stem: str, results: Path, html: str) -> dict:
    """Per T and GPU of the committed rows, the newest run's comparison: written to ``results``, its ratios the run's
    own medians, printed under the run's label; the conclusion's floor multiples at B = 8 per GPU; no target said."""
    by_t = _newest_runs(data.load_measured(kernel_name, latest=False))
    ceilings = data.load_measured("ceilings", latest=False)
    compared = {data.gpu_label(gpu) for runs in by_t.values() for gpu in runs}
    assert {"H100 80GB", "H200"} <= compared, "the committed rows hold runs of both GPUs: each is compared"
    time_goes = html[html.index("9. Where the time goes"):html.index("10. Conclusion")]
    for t, runs in by_t.items():
        for gpu, run in runs.items():
            label = data.gpu_label(gpu)
            table = pd.read_csv(results / f"comparison_{stem}_T{t}_{label.replace(' ', '_')}.csv", index_col=0)
            full = medians(run, "speed", "full")
            assert table["kernels_lib ms"].tolist() == pytest.approx(full["kernels_lib"].tolist())
            for peer in ("liger", "huggingface"):
                assert table[f"× {peer}"].tolist() == pytest.approx((full["kernels_lib"] / full[peer]).tolist(), nan_ok=True)
            if {"copy", "matmul"} <= set(comparison.run_rates(run, ceilings)):
                assert table["× floor"].notna().all() and (table["× floor"] > 1).all(), (t, label)
            assert f"<strong>{label}, T = {t}</strong>: the {data.run_label(run)}" in html
            assert f"<strong>{label}</strong> (B = " in html  # its summary bullet
            for clause in preference.not_measured(run):  # e.g. the baseline out of memory at T = 4096
                assert clause.replace("`full`", "<code>full</code>") in html
    for gpu in by_t[min(by_t)] if stem == "orpo" else by_t[512]:
        assert f"At B = 8 on the {data.gpu_label(gpu)}, <code>full</code> against the floor: kernels_lib " in time_goes
    main = html[:html.index("Appendix")]
    assert not [word for word in TARGET_WORDS if word in main], "the report states our targets, not a comparison"
    return by_t


def _newest_runs(rows: pd.DataFrame) -> dict:
    """Per sequence length T, the newest run of each GPU (T -> GPU -> run), as the notebooks take them."""
    return {t: data.newest_run_per_gpu(part) for t, part in preference.by_config(rows, "T").items()}


def _says_headline_and_conclusion(html: str, conclusion: str) -> None:
    """The generated headline (from the newest GPU run, or why there is none) and the conclusion before any appendix."""
    assert re.search(r"In one sentence\.</strong> .{0,200}?: on the ", html) or "In one sentence.</strong> Not measured on a GPU yet" in html
    assert conclusion in html and html.index(conclusion) < html.index("Appendix")


# -- the helpers, on synthetic ORPO rows ----------------------------------------------------------------------------

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
SIZES = {"H": 4096, "V": 128256}


def _floor(b: int, t: int, matmul: float = 700.0, copy: float = 3000.0) -> float:
    """The floor of ORPO's ``full`` at B = b, T = t (the one floor's formula at those rates, not the code under test)."""
    return one_floor.floor_at("fused_linear_orpo_loss", {"B": b, "T": t, **SIZES}, torch.bfloat16, "full",
                              {"copy": copy, "matmul": matmul})[0]


def _rows(provider, ms, *, commit, gpu, t=1024, xs=(8, 16), when="2026-01-01", mb=100.0, notes=None, device="cuda"):
    """ORPO rows of one provider in one run: ``ms`` a value or {B: value} (NaN: failed there, ``notes`` saying why)."""
    at = lambda value, x: value.get(x, math.nan) if isinstance(value, dict) else value  # noqa: E731
    return pd.DataFrame([
        {"kernel_name": "fused_linear_orpo_loss", "kernel_provider": provider, "kernel_operation_mode": mode, "metric_name": metric,
         "x_name": "B", "x_value": x, "y_value_50": at(value, x), "gpu_name": gpu, "device": device, "kernels_lib_commit": commit,
         "timestamp": when, "note": (notes or {}).get(x, "") if math.isnan(at(value, x)) else "",
         "extra_benchmark_config_str": json.dumps({"T": t, **SIZES, "B": x, "dtype": "torch.bfloat16"})}
        for mode in ("forward", "full") for x in xs for metric, value in (("speed", ms), ("memory", mb))])


def _ceilings(commit, gpu, matmul=700.0, copy=3000.0):
    return pd.DataFrame([{"kernel_name": name, "gpu_name": gpu, "kernels_lib_commit": commit, "timestamp": "2026-01-01",
                          "y_value_50": value} for name, value in (("copy", copy), ("matmul", matmul))])


def _h100_run(commit="c", when="2026-01-03"):
    """kernels_lib at 1.5× the floor, Liger at 3× it, the baseline out of memory at B = 16."""
    return pd.concat([_rows("kernels_lib", {b: 1.5 * _floor(b, 1024) for b in (8, 16)}, commit=commit, gpu=H100, when=when),
                      _rows("liger", {b: 3.0 * _floor(b, 1024) for b in (8, 16)}, commit=commit, gpu=H100, when=when, mb=200.0),
                      _rows("huggingface", {8: 4.0 * _floor(8, 1024)}, commit=commit, gpu=H100, when=when, mb=800.0,
                            notes={16: "OutOfMemoryError: CUDA out of memory. Tried to allocate 15.66 GiB"})], ignore_index=True)


def _every_run():
    old_h200 = pd.concat([_rows(p, ms, commit="a", gpu=H200, when="2026-01-01") for p, ms in (("kernels_lib", 50.0), ("liger", 60.0))])
    new_h200 = pd.concat([_rows(p, ms, commit="b", gpu=H200, when="2026-01-02") for p, ms in (("kernels_lib", 40.0), ("liger", 80.0))])
    long_h200 = pd.concat([_rows(p, ms, commit="a", gpu=H200, t=4096, when="2026-01-01")
                           for p, ms in (("kernels_lib", 150.0), ("liger", 200.0))])
    cpu = _rows("kernels_lib", 900.0, commit="z", gpu="CPU (Triton interpreter)", when="2026-01-09", device="cpu")
    return pd.concat([old_h200, new_h200, long_h200, _h100_run(), cpu], ignore_index=True)


def test_by_config_splits_by_the_sequence_length_so_each_gpus_newest_run_is_per_t():
    assert {t: len(part) for t, part in preference.by_config(_every_run()).items()} == {1024: 7 * 8, 4096: 2 * 8}, "CUDA rows only"
    by_t = _newest_runs(_every_run())
    assert list(by_t) == [1024, 4096] and all(type(t) is int for t in by_t)
    assert {t: {gpu: set(run.kernels_lib_commit) for gpu, run in runs.items()} for t, runs in by_t.items()} == {
        1024: {H100: {"c"}, H200: {"b"}}, 4096: {H200: {"a"}}}, "per T, each GPU's newest run; no CPU row"
    assert preference.by_config(_every_run().iloc[:0]) == {}


def test_floor_multiples_per_gpu_from_each_runs_own_ceilings():
    runs = _newest_runs(_every_run())[1024]
    said = preference.floor_multiples_by_gpu(runs, _ceilings("c", H100), 8).splitlines()
    assert said == ["- At B = 8 on the H100 80GB, `full` against the floor: kernels_lib 1.50×, Liger 3.00×.",
                    "- On the H200: no floor at B = 8, its newest run measured no ceilings."]  # the H200's run measured no ceilings
    with_baseline = preference.floor_multiples_by_gpu({H100: _h100_run()}, _ceilings("c", H100), 16, ("kernels_lib", "huggingface"))
    assert with_baseline == "- At B = 16 on the H100 80GB, `full` against the floor: kernels_lib 1.50×, the baseline not measured."
    unmeasured = preference.floor_multiples_by_gpu({H100: _h100_run()}, _ceilings("c", H100), 4)
    assert unmeasured == "- On the H100 80GB: B = 4 not measured in its newest run."
    assert preference.floor_multiples_by_gpu({}, _ceilings("c", H100), 8).startswith("Not measured on a GPU yet")
    assert preference.floor_share(_h100_run(), _ceilings("c", H100), 8) == (
        f"On the H100 80GB at B = 8, the floor is {_floor(8, 1024):.1f} ms, 67% of the fastest `full` measured there "
        f"(kernels_lib, {1.5 * _floor(8, 1024):.1f} ms).")
    assert preference.ceilings_note(_h100_run(), _ceilings("c", H100)) == "matmul 700 TFLOP/s and copy 3000 GB/s measured in the same run"
    assert preference.ceilings_note(_h100_run(), _ceilings("other", H100)).startswith("no ceilings measured in this run")


def test_not_measured_says_which_provider_did_not_fit_and_where():
    assert preference.not_measured(_h100_run()) == ["the baseline's `full` did not fit in memory at B = 16"]
    broken = _rows("liger", {8: 1.0}, commit="c", gpu=H100, notes={16: "RuntimeError: torch.compile failed"})
    assert preference.not_measured(broken, "forward") == ["Liger's `forward` failed (RuntimeError) at B = 16"]
    assert preference.not_measured(_rows("kernels_lib", 1.0, commit="c", gpu=H100)) == []


def test_per_run_table_compares_every_run_at_one_batch():
    rows = _every_run()
    ceilings = pd.concat([_ceilings("c", H100), _ceilings("a", H200, matmul=350.0)], ignore_index=True)
    table = preference.per_run_table(rows, ceilings, 8)
    assert list(zip(table.GPU, table["T"], table.run.str.split().str[3])) == [
        ("H100 80GB", 1024, "c"), ("H200", 1024, "a"), ("H200", 1024, "b"), ("H200", 4096, "a")]
    assert table["× fastest peer"].tolist() == pytest.approx([0.5, 50 / 60, 0.5, 0.75])
    assert table.loc[0, "× floor"] == pytest.approx(1.5)
    assert table.loc[3, "× floor"] == pytest.approx(150.0 / _floor(8, 4096, matmul=350.0))
    assert table.loc[1, "× floor"] == pytest.approx(50.0 / _floor(8, 1024, matmul=350.0))
    assert math.isnan(table.loc[2, "× floor"]), "run b measured no ceilings: no floor, never run a's"
    assert preference.per_run_table(rows, ceilings, 4).empty
    assert preference.per_run_table(rows.iloc[:0], ceilings, 8).empty
