"""The reports index's dashboard (kernels_workbench.dashboard) against the measured CSVs themselves.

Every expected number here is computed straight from ``data/measured/*.csv`` with pandas (the newest
run of the chart on its GPU, the median of each provider at the x), not through the dashboard's helpers;
the index page must show each number of the dashboard, formatted. Synthetic rows of two GPUs (an H100
80GB and an H200) check that each GPU's newest run is shown beside the other's, labelled, never paired
with it.
"""

from __future__ import annotations

import html
import json
import re

import nbformat
import pandas as pd
import pytest

from kernels_workbench import comparison, dashboard, data, report
from kernels_workbench.bench import get_spec

H200 = "NVIDIA H200"


@pytest.fixture(scope="module")
def board() -> pd.DataFrame:
    return dashboard.dashboard()


def _newest_run(kernel_name: str) -> pd.DataFrame:
    """The H200 CUDA rows of the commit of the newest kernels_lib row at the published workload's sizes
    (another workload's rows, such as the CCE paper's, are another chart), read from the CSV directly."""
    rows = pd.read_csv(data.MEASURED_DIR / f"{kernel_name}.csv", dtype={"kernels_lib_commit": str})
    rows = rows[(rows.gpu_name == H200) & (rows.device == "cuda")]
    sizes = get_spec(kernel_name).published["sizes"]
    config = rows.extra_benchmark_config_str.map(json.loads)
    rows = rows[config.map(lambda c: all(c.get(k) == v for k, v in sizes.items()))]
    ours = rows[rows.kernel_provider == "kernels_lib"].sort_values("timestamp")
    return rows[rows.kernels_lib_commit == ours.kernels_lib_commit.iloc[-1]]


def _full(run: pd.DataFrame, metric: str) -> pd.DataFrame:
    chosen = run[(run.metric_name == metric) & (run.kernel_operation_mode == "full")]
    return chosen.groupby(["x_value", "kernel_provider"]).y_value_50.mean().unstack()


def _published_max_x(kernel_name: str) -> float | None:
    published = pd.read_csv(data.PUBLISHED_ROWS)
    xs = published[published.kernel_name == kernel_name].x_value
    return float(xs.max()) if len(xs) else None


@pytest.mark.parametrize("kernel_name", ["kl_div", "kto_loss", "fused_linear_orpo_loss", "fused_linear_dpo_loss", "tvd"])
def test_headline_ratios_equal_the_csv(board, kernel_name):
    run = _newest_run(kernel_name)
    # one chart per file (the configuration differs only in the swept size), so the file's rows are the chart's
    configs = run.extra_benchmark_config_str.map(lambda s: tuple(sorted((k, str(v)) for k, v in json.loads(s).items()
                                                                       if k != run.x_name.iloc[0])))
    assert configs.nunique() == 1
    speed, memory = _full(run, "speed"), _full(run, "memory")
    published = _published_max_x(kernel_name)
    x = published if published in speed.index else float(speed["kernels_lib"].dropna().index.max())
    # A file may hold several charts (ORPO at T = 1024 and 4096): the one of this run.
    rows = board[(board.kernel_name == kernel_name) & (board.kind == "ratio") & (board.commit == run.kernels_lib_commit.iloc[0])
                 & (board.gpu == H200)]
    peers = sorted(p for p in speed.columns if p != "kernels_lib" and "[" not in p)
    assert sorted(rows.peer) == peers and len(peers) >= 2
    for _, row in rows.iterrows():
        assert row.x == x
        assert row.commit == run.kernels_lib_commit.iloc[0] and row.gpu == H200
        assert row["ours ms"] == pytest.approx(speed.loc[x, "kernels_lib"], rel=1e-12)
        assert row["time ratio"] == pytest.approx(speed.loc[x, "kernels_lib"] / speed.loc[x, row.peer], rel=1e-12, nan_ok=True)
        assert row["memory ratio"] == pytest.approx(memory.loc[x, "kernels_lib"] / memory.loc[x, row.peer], rel=1e-12, nan_ok=True)
        shown = round(row["time ratio"], 2)
        assert row["time tone"] == ("better" if shown < 1 else "worse" if shown > 1 else "even")
        assert row["gpu label"] == "H200"


def test_tensor_parallel_ratios_equal_the_csv(board):
    rows = pd.read_csv(data.MEASURED_DIR / "tensor_parallel.csv")
    flce = rows[(rows.gpu_name == H200) & (rows.device == "cuda") & (rows.kernel_name == "fused_linear_cross_entropy")]
    flce = flce[flce.kernels_lib_commit == flce.sort_values("timestamp").kernels_lib_commit.iloc[-1]]
    full = flce[(flce.metric_name == "speed") & (flce.kernel_operation_mode == "full")]
    medians = full.groupby(["x_value", "kernel_provider", "tp"]).y_value_50.mean()
    x, tp2 = float(full.x_value.max()), int(full.tp.max())
    ours = medians.loc[(x, "kernels_lib", tp2)]
    shown = board[(board.kernel_name == dashboard.TENSOR_PARALLEL) & (board.kind == "ratio")]
    expected = {f"{p} TP={t}": ours / v for (px, p, t), v in medians.items()
                if px == x and (t == tp2 and p != "kernels_lib" or (p, t) == ("kernels_lib", 1)) and not pd.isna(v)}  # a failed provider has no ratio
    assert len(expected) >= 2
    assert dict(zip(shown.peer, shown["time ratio"])) == pytest.approx(expected, rel=1e-12)


def test_every_measured_loss_has_a_chart_with_peers_and_a_floor_and_no_target(board):
    """Each report's losses (REPORTS) measured on a GPU appear, each with ratios to at least one peer and,
    where the loss has a bench spec, its floor; no row, column or word of the index is a target of ours."""
    measured = {name for name in dashboard.REPORTS if (data.MEASURED_DIR / f"{name}.csv").exists()}
    assert set(board.kernel_name) == measured
    for name in measured:
        kinds = set(board[board.kernel_name == name].kind)
        assert "ratio" in kinds, name
        assert ("floor" in kinds) == (name not in (dashboard.TENSOR_PARALLEL, dashboard.TRAINING_STEP)), name
    assert set(board.kind) == {"ratio", "floor"}
    assert not {"target", "status", "bound", "worst ratio", "time status"} & set(board.columns)
    assert set(board[board.kind == "ratio"]["time tone"]) <= {"better", "worse", "even", "not measured"}


def _shown(value: float, bound: float) -> str:
    """A ratio as the index must print it: "not measured" without one; two decimals, or as many more (up to
    six) as it takes for the printed number to differ from the bound of the target that judges it."""
    if pd.isna(value):
        return "not measured"
    digits = 2
    while not pd.isna(bound) and value != bound and digits < 6 and float(f"{value:.{digits}f}") == float(bound):
        digits += 1
    return f"{value:.{digits}f}"


def test_index_shows_every_number_of_the_dashboard(board, tmp_path):
    (tmp_path / "executed").mkdir()
    reports = []
    for stem in sorted(set(dashboard.REPORTS.values())):
        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(f"# Report {stem}")])
        nbformat.write(notebook, tmp_path / "executed" / f"{stem}.ipynb")
        reports.append((tmp_path / f"{stem}.html", 3.0, ""))
    page = report.write_index(tmp_path, reports, report.notebook_parameters("cpu")).read_text(encoding="utf-8")
    shown = {(html.unescape(k), c): html.unescape(t)
             for k, c, t in re.findall(r'<span class="num" data-key="([^"]*)" data-col="([^"]*)">([^<]*)</span>', page)}
    expected = {}
    for _, row in board.iterrows():
        for column in {"ratio": ("time ratio", "memory ratio"), "floor": ("time ratio",)}[row.kind]:
            expected[(row.key, column)] = _shown(row[column], float("nan"))
    first_ratio = board[board.kind == "ratio"].groupby(["chart", "gpu"], sort=False).key.first()
    for _, key in first_ratio.items():
        expected[(key, "x")] = f"{board[board.key == key].x.iloc[0]:g}"
    assert {k: v for k, v in shown.items() if k in expected} == expected
    assert set(shown) == set(expected)
    assert page.count('class="chart"') == board.chart.nunique()
    assert page.count('<div class="gpu-run" data-gpu=') == board.groupby(["chart", "gpu"]).ngroups + _grpo_gpus()
    assert page.count("<svg") == board.groupby(["chart", "gpu"]).ngroups
    assert 'data-card="gpu-test-runs"' not in page and "badge" not in page, "the index shows losses and GPUs only, not our test runs"
    for stem in comparison.HEADLINES:  # each card opens with its notebook's own headline sentence
        assert html.escape(comparison.report_headline(stem, data.load_measured("ceilings", latest=False))) in page, stem
    # the first screen: what the site is, the GPUs measured, the two commands, before any report's card
    first = page[: page.index('<ul class="cards">')]
    assert "Triton kernels for the LM-head losses" in first and "./workbench reports" in first and "./workbench test" in first
    assert "Measured on: <strong>" + ", ".join(sorted({data.gpu_label(g) for g in board.gpu})) + "</strong>" in first
    # per chart and GPU a headline row (× the fastest peer, × the leanest peer's memory, × the floor) linked to its report
    heads = dashboard.headlines(board)
    assert first.count("<tr data-chart=") == len(heads) == board.groupby(["chart", "gpu"]).ngroups
    for _, head in heads.iterrows():
        assert f'<a href="{head.report}.html">{html.escape(head.chart)}</a>' in first
    # no target of ours, no issue number, no commit hash in the page's prose (a commit only in a run's provenance line)
    prose = re.sub(r'<p class="run[^"]*">.*?</p>|<code>[0-9a-f]{7,12}</code>|<tr data-target.*?</tr>', "", page)
    ours = r"issue \d|(?<!test )target|≤|missed"  # "the GPU test target" is ./workbench test --gpu, not a target of ours
    assert not re.search(ours, prose, re.I), re.search(r".{40}(" + ours + r").{40}", prose, re.I)
    assert not re.search(r"\b[0-9a-f]{7}\b(?![^<]*</code>)", re.sub(r"<[^>]+>", " ", prose).replace("#", " ")), "a commit hash in prose"


@pytest.mark.parametrize("kernel_name", ["fused_linear_dpo_loss", "kto_loss", "kl_div"])
def test_floor_row_is_the_runs_own_floor(board, kernel_name):
    """Each chart's ratio to its floor, computed here from the CSVs: kernels_lib's ``full`` median at the
    headline x over the longer of the loss's matmul FLOPs at the matmul ceiling and its minimal bytes at
    the copy ceiling, both ceilings measured in the chart's own run (same commit, same GPU)."""
    import torch

    spec = get_spec(kernel_name)
    run = _newest_run(kernel_name)
    commit = str(run.kernels_lib_commit.iloc[0])
    row = board[(board.kernel_name == kernel_name) & (board.kind == "floor") & (board.gpu == H200)]  # the H200 run read below
    assert len(row) == 1
    row = row.iloc[0]
    x = row.x
    ours = _full(run, "speed").at[x, "kernels_lib"]
    ceilings = pd.read_csv(data.MEASURED_DIR / "ceilings.csv", dtype={"kernels_lib_commit": str})
    own = ceilings[(ceilings.gpu_name == H200) & (ceilings.kernels_lib_commit == commit)].sort_values("timestamp")
    rate = {name: part.y_value_50.iloc[-1] for name, part in own.groupby("kernel_name")}
    config = json.loads(run.extra_benchmark_config_str.iloc[0])
    sizes = {**{k: v for k, v in config.items() if k[:1].isupper()}, run.x_name.iloc[0]: int(x)}
    dtype = getattr(torch, config["dtype"].replace("torch.", ""))
    candidates = [spec.bytes_moved(sizes, dtype, "full") / (rate["copy"] * 1e9) * 1e3]
    flops = spec.flops(sizes, "full")
    if flops is not None:
        candidates.append(flops / (rate["matmul"] * 1e12) * 1e3)
    assert row["peer ms"] == pytest.approx(max(candidates), rel=1e-9)
    assert row["time ratio"] == pytest.approx(ours / max(candidates), rel=1e-9)
    assert ("its matmuls" in row.peer) == (flops is not None and candidates[-1] >= candidates[0])


def test_a_floor_without_the_runs_ceilings_is_not_measured(board):
    """A run that measured no ceilings has no floor ratio: never one from another run's ceilings."""
    chart = next(c for c in dashboard.charts() if c.kernel_name == "fused_linear_dpo_loss")
    ceilings = data.load_measured("ceilings", latest=False)
    other = ceilings[ceilings.kernels_lib_commit.astype(str) != chart.commit]
    row = dashboard.floor_row(chart, other, board[(board.kernel_name == chart.kernel_name) & (board.kind == "floor")].x.iloc[0])
    assert pd.isna(row["time ratio"]) and "not measured" in row["peer"]
    assert dashboard.ratio_text(row["time ratio"]) == "not measured"


def test_a_ratio_cell_is_toned_by_its_comparison(board):
    """Each ratio cell's class is its tone: better below 1, worse above, not measured without a ratio
    (Hugging Face's ORPO head at B = 16 did not fit): the comparison, not a target of ours."""
    by_chart: dict = {}
    for chart in dashboard.charts():
        by_chart.setdefault(chart.title, []).append(chart)
    for title, group in by_chart.items():
        rows = board[board.chart == title].reset_index(drop=True)
        section = dashboard.chart_section(group, rows)
        for _, row in rows[rows.kind == "ratio"].iterrows():
            for column in ("time", "memory"):
                cell = re.search(r'<td( class="([^"]*)")?><span class="num" data-key="' + re.escape(html.escape(row.key))
                                 + f'" data-col="{column} ratio">', section)
                assert cell, (row.key, column)
                value = row[f"{column} ratio"]
                shown = round(value, 2)  # the tone of the ratio as printed: 1.0002 prints as 1.00, even
                expected = "not-measured" if pd.isna(value) else "better" if shown < 1 else "worse" if shown > 1 else "even"
                assert cell.group(2) == expected, (row.key, column)
    orpo = board[(board.kernel_name == "fused_linear_orpo_loss") & (board.kind == "ratio") & (board.peer == "huggingface")]
    assert (orpo["time ratio"].isna() == (orpo["time tone"] == "not measured")).all()


def test_tone_is_the_comparison_as_printed():
    assert [dashboard.tone(r) for r in (0.5, 0.994, 0.996, 1.0002, 1.004, 1.006, 3.0)] == [
        "better", "better", "even", "even", "even", "worse", "worse"]
    assert dashboard.tone(float("nan")) == "not measured"


def test_ratio_text_shows_which_side_of_the_bound():
    assert dashboard.ratio_text(1.000418, 1.0) == "1.0004"
    assert dashboard.ratio_text(0.551077, 0.55) == "0.551"
    assert dashboard.ratio_text(0.8505, 0.6) == "0.85"
    assert dashboard.ratio_text(0.9999, None) == "1.00"
    assert dashboard.ratio_text(float("nan"), 1.0) == "not measured"


def _two_runs() -> pd.DataFrame:
    """Synthetic rows of two runs: run A (old commit) measured kernels_lib, liger and cce; run B (new commit)
    kernels_lib and liger only; and one row of the new commit on another GPU."""
    rows = []
    for commit, gpu, stamp, providers in (("aaaaaaa", H200, "2026-11-01 10:00:00", {"kernels_lib": 10.0, "liger": 20.0, "cce": 40.0}),
                                          ("bbbbbbb", H200, "2026-12-01 10:00:00", {"kernels_lib": 8.0, "liger": 16.0}),
                                          ("bbbbbbb", "NVIDIA H100", "2026-12-02 10:00:00", {"kernels_lib": 12.0, "cce": 13.0})):
        for provider, ms in providers.items():
            for x in (1024.0, 2048.0):
                rows.append({"kernel_name": "toy", "kernel_provider": provider, "kernel_operation_mode": "full", "metric_name": "speed",
                             "x_value": x, "y_value_50": ms * x / 1024, "gpu_name": gpu, "kernels_lib_commit": commit, "timestamp": stamp})
    return pd.DataFrame(rows)


def test_same_run_pairs_never_pairs_two_runs():
    rows = _two_runs()
    with pytest.raises(ValueError, match="one run expected.*aaaaaaa on NVIDIA H200.*bbbbbbb"):
        data.same_run_pairs(rows, "kernels_lib", ["cce"])
    newest = data.one_run(rows[rows.gpu_name == H200])
    assert set(newest.kernels_lib_commit) == {"bbbbbbb"}
    pairs = data.same_run_pairs(newest, "kernels_lib", ["liger", "cce"]).set_index(["peer", "x"])
    assert pairs.loc[("liger", 2048.0), "ratio"] == pytest.approx(0.5)
    assert pairs.loc[("cce", 2048.0), ["peer value", "ratio"]].isna().all()  # CCE was only in the old run: not measured
    assert set(pairs.run) == {"run of commit bbbbbbb on NVIDIA H200 (2026-12-01)"}
    old = data.same_run_pairs(data.one_run(rows, "aaaaaaa", H200), "kernels_lib", ["cce"])
    assert old.ratio.tolist() == pytest.approx([0.25, 0.25])
    # the same commit on another GPU is another run
    assert set(data.one_run(rows).gpu_name) == {"NVIDIA H100"}
    with pytest.raises(ValueError, match="one run expected"):
        data.run_label(rows[rows.kernels_lib_commit == "bbbbbbb"])


def test_a_chart_of_two_runs_is_refused():
    mixed = _two_runs()
    mixed = mixed[mixed.gpu_name == H200].assign(kernel_name="kl_div")
    chart = dashboard.Chart("kl_div", "toy", "V", mixed, "kernels_lib", None, "bbbbbbb", H200)
    with pytest.raises(ValueError, match="one run expected"):
        dashboard.chart_rows(chart, pd.DataFrame())


def test_a_peer_missing_from_the_run_is_not_measured(board):
    """CCE is in older FLCE runs; where the newest run lacks it, it has no ratio on the card, whatever an
    older run measured."""
    run = _newest_run("fused_linear_cross_entropy")
    flce = board[(board.kernel_name == "fused_linear_cross_entropy") & (board.gpu == H200)]
    in_run = "cce" in set(run[run.kernel_operation_mode == "full"].kernel_provider)
    cce = flce[(flce.kind == "ratio") & (flce.peer == "cce")]
    assert (len(cce) > 0 and cce["time ratio"].notna().any()) == in_run
    assert "cce" in set(pd.read_csv(data.MEASURED_DIR / "fused_linear_cross_entropy.csv").kernel_provider)
    assert set(flce.run) == {f"run of commit {run.kernels_lib_commit.iloc[0]} on {H200} ({run.timestamp.max()[:10]})"}


def test_every_chart_names_one_run_per_workload(board):
    for chart in dashboard.charts():
        for name, part in chart.rows.groupby("kernel_name"):
            assert part.groupby(["kernels_lib_commit", "gpu_name"]).ngroups == 1, (chart.key, name)
            assert data.run_label(part) in chart.run


def test_sparkline_names_its_axes_and_draws_ours_on_top():
    times = pd.DataFrame({"kernels_lib TP=2": [1.0, 2.0, 4.0], "kernels_lib TP=1": [2.0, 4.0, 8.0], "torch TP=2": [3.0, 6.0, 12.0]},
                         index=[4096.0, 8192.0, 16384.0])
    svg = dashboard.sparkline(times, "kernels_lib TP=2", "N")
    lines = re.findall(r'<polyline fill="none" stroke="([^"]*)"', svg)
    assert len(lines) == 3 and lines[-1] == "#d62728" and lines.count("#d62728") == 1  # one red line, drawn last
    assert svg.count("color:#d62728") == 1  # one red legend entry
    assert "over N (log₂ scale, 4096 to 16384)" in svg
    assert ">12 ms</text>" in svg and ">0</text>" in svg and ">4096</text>" in svg and ">16384</text>" in svg
    # a top of 1002 ms reads as people write it, with the axis moved right to make room for it
    wide = dashboard.sparkline(times * 83.5, "kernels_lib TP=2", "N")
    assert ">1002 ms</text>" in wide and "e+" not in wide
    assert ">1000 ms</text>" in dashboard.sparkline(times * 83.3, "kernels_lib TP=2", "N")  # 999.6: not 1e+03
    axis = float(re.search(r'<line x1="([\d.]+)"', wide).group(1))
    assert axis - 3 >= 6 * len("1002 ms")


def test_the_training_step_has_a_card(board):
    rows = pd.read_csv(data.MEASURED_DIR / "training_step.csv")
    lce_path = data.measured_file(dashboard.TRAINING_STEP_TORCH_LCE)
    lce = pd.read_csv(lce_path) if lce_path.exists() else rows.iloc[:0]
    every = board[board.kernel_name == "training_step"]
    assert set(every.report) == {"05_training_step"}
    beside = every.chart.str.startswith("training step, beside torch's F.linear_cross_entropy")
    shown = every[~beside]
    assert shown.chart.nunique() == rows.groupby(["model", "checkpointing"]).ngroups
    assert set(shown.commit) == set(rows.kernels_lib_commit)
    # torch's function's run (notebook 05 §4d) has its own charts, its ratios from its own file
    assert every[beside].chart.nunique() == lce.groupby(["model", "checkpointing"]).ngroups
    if len(lce):
        cell = every[beside & (every.kind == "ratio") & (every.peer == "torch_lce")].iloc[0]
        ckpt = "checkpointing on" in cell.chart
        ok = lce[(lce.checkpointing.astype(bool) == ckpt) & lce.note.isna() & lce.step_ms_50.notna()]
        at = ok[ok.tokens == cell.x].set_index("provider").step_ms_50
        assert cell["time ratio"] == pytest.approx(at["kernels_lib"] / at["torch_lce"], rel=1e-12)
        assert set(every[beside].commit) == set(lce.kernels_lib_commit)
    one = shown[(shown.kind == "ratio") & (shown.peer == "huggingface")].iloc[0]
    one_run = rows[(rows.kernels_lib_commit.astype(str).str[:7] == str(one.commit)[:7]) & (rows.gpu_name == one.gpu)]
    assert len(one_run), f"no rows of the card's run ({one.commit} on {one.gpu}) in training_step.csv"  # one run, one GPU
    ok = one_run[(one_run.model == "llama-3.2-1b") & (~one_run.checkpointing.astype(bool)) & one_run.note.isna()
                 & one_run.step_ms_50.notna()]
    at = ok[ok.tokens == one.x].set_index("provider").step_ms_50
    assert one["time ratio"] == pytest.approx(at["kernels_lib"] / at["huggingface"], rel=1e-12)




def test_grpo_family_card_is_one_run_of_the_loss_types_per_gpu(tmp_path):
    """The GRPO family card: per GPU a row per loss type of its newest run, kernels_lib's time over the floor and
    over each peer's from that run alone (another GPU's run in a block of its own); not measured without the file."""
    import re

    from kernels_workbench.bench import fused_linear_grpo as grpo_bench

    committed_path = data.measured_file(dashboard.GRPO_LOSS_TYPES)
    committed = pd.read_csv(committed_path) if committed_path.exists() else None
    assert "Not measured" in dashboard.grpo_family_card(tmp_path / "absent.csv")
    if committed is None or not (committed.gpu_name == "NVIDIA H200").any():
        pytest.skip("no H200 run of scripts/grpo_loss_types.py committed")
    # another run beside it, on another GPU and commit, three times slower: shown in its own block, never mixed in
    committed = committed[committed.gpu_name == H200]
    other = committed.assign(kernels_lib_commit="0000000", gpu_name="NVIDIA H100 80GB HBM3", y_value_50=committed.y_value_50 * 3)
    path = tmp_path / "loss_types.csv"
    pd.concat([committed, other]).to_csv(path, index=False)
    both = dashboard.grpo_family_card(path)
    assert both.count('<div class="gpu-run" data-gpu=') == 2 and "<h4>H100 80GB</h4>" in both and "<h4>H200</h4>" in both
    h100 = both[both.index('data-gpu="NVIDIA H100 80GB HBM3"'):both.index('data-gpu="NVIDIA H200"')]
    assert "0000000" in h100 and "run of commit 0000000 on NVIDIA H100 80GB HBM3" in h100
    card = dashboard.grpo_family_card(path, gpu_name=H200)
    table = grpo_bench.loss_type_table(data.one_run(committed))
    rows = re.findall(r'<tr data-loss-type="(\w+)">(.*?)</tr>', card)
    assert [name for name, _ in rows] == list(table.index)
    for name, cells in rows:
        values = re.findall(r"<td>(.*?)</td>", cells)
        assert values[1] == f"{table.loc[name, 'kernels_lib ms']:.1f}"
        assert values[2] == dashboard.ratio_text(table.loc[name, "kernels_lib / floor"])
        assert values[3:6] == [dashboard.ratio_text(table.loc[name, f"kernels_lib / {peer}"]) for peer in ("torch", "liger", "trl")]
        assert values[6] == dashboard.ratio_text(table.loc[name, "kernels_lib MB"] / table.loc[name, "liger MB"])
    assert card.count("× floor") == 1
    assert "0000000" not in card and "H100" not in card


def test_the_cards_read_the_measured_folder_when_called(monkeypatch, tmp_path):
    """The index's cards resolve their files under data.MEASURED_DIR at call time, not at import: moved to an
    empty folder, each reads "not measured"."""
    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    assert "Not measured" in dashboard.grpo_family_card()
    assert dashboard.charts() == [] and len(dashboard.dashboard()) == 0
    assert not [c for c in dashboard.charts() if "training step" in c.title]  # neither training-step file is there


# --------------------------------------------------------------------------- two GPUs, synthetic


def _kl_rows(gpu: str, commit: str, stamp: str, providers: dict[str, float]) -> pd.DataFrame:
    """KL rows at the published sizes (N = 16384 rows, as the committed rows name them), ``full`` time and memory per
    provider at V = 65536 and 131072: ``ms`` at the largest V, half of it at the other; memory 10 × ms."""
    rows = []
    for provider, ms in providers.items():
        for v, scale in ((65536.0, 0.5), (131072.0, 1.0)):
            for metric, value in (("speed", ms * scale), ("memory", 10 * ms * scale)):
                rows.append({"kernel_name": "kl_div", "kernel_provider": provider, "kernel_operation_mode": "full", "metric_name": metric,
                             "metric_unit": "ms", "x_name": "V", "x_label": "vocab size", "x_value": v, "y_value_50": value,
                             "y_value_20": value, "y_value_80": value,
                             "extra_benchmark_config_str": json.dumps({"N": 16384, "V": int(v), "dtype": "torch.float32",
                                                                       "reduction": "batchmean", "log_target": False}),
                             "gpu_name": gpu, "timestamp": stamp, "kernels_lib_commit": commit, "torch_version": "2.11.0",
                             "triton_version": "3.6.0", "device": "cuda", "timer": "cuda_events_do_bench"})
    return pd.DataFrame(rows)


H100 = "NVIDIA H100 80GB HBM3"


def test_each_gpu_shows_its_newest_run_beside_the_others_labelled(monkeypatch, tmp_path):
    """KL measured on an H200 (an old run with torch and liger, a newer one with liger only) and on an H100
    80GB (older than both, with torch and liger): a chart per GPU, each from its own newest run; the headline
    per GPU (× the fastest peer, × the leanest peer's memory, × the floor from that run's ceilings); the index
    shows both GPUs, labelled, and never pairs a number of one with one of the other."""
    monkeypatch.setattr(data, "MEASURED_DIR", tmp_path)
    pd.concat([_kl_rows(H200, "h200old", "2026-12-01 10:00:00", {"kernels_lib": 2.0, "torch": 8.0, "liger": 4.0}),
               _kl_rows(H200, "h200new", "2026-12-03 10:00:00", {"kernels_lib": 1.0, "liger": 4.0}),
               _kl_rows(H100, "h100run", "2026-11-20 10:00:00", {"kernels_lib": 3.0, "torch": 12.0, "liger": 5.0})]
              ).to_csv(tmp_path / "kl_div.csv", index=False)
    ceilings = [{"kernel_name": name, "kernel_provider": "torch", "kernel_operation_mode": "forward", "metric_name": "rate",
                 "x_value": 0, "y_value_50": rate, "gpu_name": gpu, "kernels_lib_commit": commit, "timestamp": stamp, "device": "cuda",
                 "extra_benchmark_config_str": "{}"}
                for gpu, commit, stamp, copy in ((H200, "h200new", "2026-12-03 10:00:00", 4000.0), (H100, "h100run", "2026-11-20 10:00:00", 3000.0))
                for name, rate in (("copy", copy), ("matmul", 700.0))]
    pd.DataFrame(ceilings).to_csv(tmp_path / "ceilings.csv", index=False)
    chart_list = [c for c in dashboard.charts() if c.kernel_name == "kl_div"]
    assert [(c.gpu_label, c.commit) for c in chart_list] == [("H100 80GB", "h100run"), ("H200", "h200new")]
    assert len({c.key for c in chart_list}) == 2 and len({c.title for c in chart_list}) == 1
    board = dashboard.dashboard(chart_list)
    ratios = board[board.kind == "ratio"].set_index(["gpu label", "peer"])
    assert ratios.loc[("H200", "liger"), "time ratio"] == pytest.approx(1.0 / 4.0)
    assert ("H200", "torch") not in ratios.index  # torch was only in the older H200 run: not borrowed from it
    assert ratios.loc[("H100 80GB", "torch"), "time ratio"] == pytest.approx(3.0 / 12.0)
    assert ratios.loc[("H100 80GB", "liger"), "memory ratio"] == pytest.approx(30.0 / 50.0)
    assert set(board.run) == {"run of commit h100run on NVIDIA H100 80GB HBM3 (2026-11-20)", "run of commit h200new on NVIDIA H200 (2026-12-03)"}
    heads = dashboard.headlines(board).set_index("gpu label")
    assert heads.loc["H100 80GB", "fastest peer"] == "liger" and heads.loc["H100 80GB", "time ratio"] == pytest.approx(3.0 / 5.0)
    assert heads.loc["H200", "leanest peer"] == "liger" and heads.loc["H200", "memory ratio"] == pytest.approx(10.0 / 40.0)
    floor_ms = {gpu: 12 * 16384 * 131072 / (copy * 1e9) * 1e3 for gpu, copy in (("H200", 4000.0), ("H100 80GB", 3000.0))}
    for gpu, ours in (("H200", 1.0), ("H100 80GB", 3.0)):
        assert heads.loc[gpu, "floor ratio"] == pytest.approx(ours / floor_ms[gpu], rel=1e-9)
    # the index: one section for the chart, a block per GPU, a headline row per GPU
    (tmp_path / "out" / "executed").mkdir(parents=True)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# KL")]), tmp_path / "out" / "executed" / "02_kl_divergence.ipynb")
    page = report.write_index(tmp_path / "out", [(tmp_path / "out" / "02_kl_divergence.html", 1.0, "")],
                              report.notebook_parameters("cpu")).read_text(encoding="utf-8")
    assert "Measured on: <strong>H100 80GB, H200</strong>" in page
    section = page[page.index('<section class="chart"'):page.index("</section>")]
    assert section.count('<div class="gpu-run"') == 2 and section.index("<h4>H100 80GB</h4>") < section.index("<h4>H200</h4>")
    assert "run of commit h100run on NVIDIA H100 80GB HBM3 (2026-11-20)" in section
    headline_rows = re.findall(r'<tr data-chart="[^"]*" data-gpu="([^"]*)">', page)
    assert headline_rows == [H100, H200]
    assert "H200: runs of 2026-12-03" in page and "H100 80GB: runs of 2026-11-20" in page  # the generated provenance line
    # only one GPU asked for: the other is not shown
    assert [c.gpu for c in dashboard.charts(H100) if c.kernel_name == "kl_div"] == [H100]


def _grpo_gpus() -> int:
    """How many GPUs the committed GRPO loss-type file has a run of (each a block of the GRPO family card)."""
    path = data.measured_file(dashboard.GRPO_LOSS_TYPES)
    return len(data.gpus_measured(pd.read_csv(path))) if path.exists() else 0
