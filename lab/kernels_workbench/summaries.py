"""Summaries that keep a notebook's main flow to a page: the environment per GPU and software, the
ceilings per GPU, the measured times against their floors, and a check table's worst cases; the full
tables go to an appendix or a CSV."""

from __future__ import annotations

import math
import re

import pandas as pd

from . import data
from .narrative import span

#: The version columns of :func:`.overview.environment_table`, in the order a summary shows them.
VERSIONS = ["torch_version", "triton_version", "liger_version", "cce_version", "quack_version", "cutlass_dsl_version"]


def environment_summary(environment: pd.DataFrame) -> pd.DataFrame:
    """One row per GPU and software stack of :func:`.overview.environment_table` (its versions; "–" where a
    file records none): how many runs (commits) and measured files used it, their first and last
    timestamps and their rows."""
    versions = [c for c in VERSIONS if c in environment.columns]
    environment = environment.assign(**{c: environment[c].fillna("–") for c in versions})
    table = (environment.assign(GPU=environment.gpu_name.map(data.gpu_label))
             .groupby(["GPU", *versions], sort=True, dropna=False)
             .agg(runs=("kernels_lib_commit", "nunique"), files=("file", "nunique"), first=("first", "min"),
                  last=("last", "max"), rows=("rows", "sum")))
    return table.reset_index().rename(columns=lambda c: c.removesuffix("_version"))


def ceilings_summary(ceilings: pd.DataFrame) -> pd.DataFrame:
    """Per GPU and ceiling (copy GB/s, matmul TFLOP/s): how many runs measured it, and the lowest, median
    and highest value over them."""
    rows = ceilings.assign(GPU=ceilings.gpu_name.map(data.gpu_label))
    table = rows.groupby(["GPU", "kernel_name"]).agg(runs=("kernels_lib_commit", "nunique"), lowest=("y_value_50", "min"),
                                                    median=("y_value_50", "median"), highest=("y_value_50", "max"))
    return table.rename_axis(index=["GPU", "ceiling"])


def against_floor(workloads, floors) -> pd.DataFrame:
    """Every measured median time of ``workloads`` (:func:`.overview.workloads`) over its floor on its GPU
    (``floors``: per workload, GPU -> :class:`.overview.Floor`): chart, GPU, provider, mode, x, ms, floor
    ms, ``× floor`` and what bounds the floor there (``bytes`` or ``matmul``)."""
    rows = []
    for workload, by_gpu in zip(workloads, floors):
        for gpu, floor in by_gpu.items():
            speed = workload.on(gpu)
            speed = speed[speed.metric_name == "speed"]
            for row in speed.itertuples():
                if row.kernel_operation_mode not in floor.ms.columns or row.x_value not in floor.ms.index:
                    continue
                floor_ms = floor.ms.loc[row.x_value, row.kernel_operation_mode]
                if floor_ms == floor_ms and row.y_value_50 == row.y_value_50:
                    rows.append({"chart": workload.title, "GPU": data.gpu_label(gpu), "provider": row.kernel_provider,
                                 "mode": row.kernel_operation_mode, "x": row.x_value, "ms": row.y_value_50, "floor ms": floor_ms,
                                 "× floor": row.y_value_50 / floor_ms, "bound": floor.bound.get(row.x_value)})
    columns = ["chart", "GPU", "provider", "mode", "x", "ms", "floor ms", "× floor", "bound"]
    return pd.DataFrame(rows, columns=columns)


BOUND = {"bytes": "bandwidth-bound", "matmul": "matmul-bound"}


def floor_sentences(times: pd.DataFrame, ceilings: pd.DataFrame, near: float = 0.95) -> str:
    """What :func:`against_floor`'s table says of the floor: how many times lie below it, by how much, and
    why that is possible (the ceilings are measurements, which vary from run to run; a provider that leaves
    work to another mode does less than the floor of its mode counts)."""
    below = times[times["× floor"] < 1]
    if not len(times):
        return "No measured time has a floor yet."
    if not len(below):
        return f"None of the {len(times)} measured times lies below its floor."
    text = [f"{len(below)} of the {len(times)} measured times lie below their run's floor ({span(below['× floor'])})."]
    close = below[below["× floor"] >= near]
    if len(close):
        spread = ceilings_summary(ceilings)
        ranges = "; ".join(f"{gpu} {ceiling} {r.lowest:.0f}–{r.highest:.0f} {'GB/s' if ceiling == 'copy' else 'TFLOP/s'}"
                           for (gpu, ceiling), r in spread.iterrows())
        text.append(f"{len(close)} of them are within {1 - near:.0%} of it ({span(close['× floor'])}, "
                    f"{', '.join(f'{n} {BOUND[b]}' for b, n in close.bound.value_counts().items())}): the floor divides the work by a ceiling measured once per run "
                    f"(a 2 GiB copy, an 8192³ matmul), and a kernel can run faster than that measurement, which varies "
                    f"from run to run ({ranges}).")
    far = below[below["× floor"] < near]
    for (chart, provider, mode), part in far.groupby(["chart", "provider", "mode"]):
        why = (" Its `forward` leaves the gradient to `backward`, while the floor of `forward` counts the gradient a fused "
               "kernel writes there." if mode == "forward" else " It does less work than the floor of its mode counts.")
        text.append(f"{provider} `{mode}` on `{chart}` sits at {span(part['× floor'])} ({len(part)} points, "
                    f"{', '.join(sorted(set(part.GPU)))}).{why}")
    return " ".join(text)


def worst_cases(checks: pd.DataFrame, by: list[str], error_columns: list[str], keep: list[str] | None = None) -> pd.DataFrame:
    """A check table's summary: per group of ``by``, the row with the largest of ``error_columns`` (each
    relative to the row's ``tolerance`` where the table has one), with its ``keep`` columns, and how many
    cases the group held and how many of them passed."""
    scale = checks["tolerance"] if "tolerance" in checks.columns else 1.0
    worst = checks[error_columns].div(scale, axis=0).max(axis=1)
    picked = checks.assign(_worst=worst).sort_values("_worst", ascending=False).groupby(by, sort=False, dropna=False).head(1)
    passed = checks["passed"] if "passed" in checks.columns else pd.Series(True, index=checks.index)
    counts = checks.assign(_passed=passed).groupby(by, dropna=False).agg(cases=("_passed", "size"), passed=("_passed", "sum"))
    shown = [c for c in (keep or []) if c not in by] + error_columns + (["tolerance"] if "tolerance" in checks.columns else [])
    table = picked.set_index(by)[shown].join(counts)
    return table.sort_index()


def floor_groups(times: pd.DataFrame) -> pd.DataFrame:
    """The times of :func:`against_floor` below their floor, one row per chart, provider and mode: how many
    points, their ``× floor`` span, GPUs and what bounds the floor."""
    below = times[times["× floor"] < 1]
    return (below.groupby(["chart", "provider", "mode"])
            .agg(points=("x", "size"), lowest=("× floor", "min"), highest=("× floor", "max"),
                 GPUs=("GPU", lambda g: ", ".join(sorted(set(g)))), bound=("bound", lambda b: ", ".join(sorted(set(b.dropna())))))
            .sort_values("lowest"))


def agreement_conclusion(agreement: pd.DataFrame) -> str:
    """The agreement check of :func:`.overview.agreement_table` in two sentences: how many points agree,
    how many are slower or faster than the GPUs explain, and per provider."""
    if not len(agreement):
        return "No published provider has been re-measured yet: nothing to set against the published figures."
    counts = agreement.verdict.value_counts()
    agree = counts.get("agrees", 0)
    per_provider = agreement.assign(agrees=agreement.verdict.eq("agrees")).groupby("provider").agrees.agg(["sum", "size"])
    return (f"{agree} of the {len(agreement)} points measured both by the publishers and by us ({agree / len(agreement):.0%}) agree "
            f"once the GPUs' datasheets are accounted for; {counts.get('slower than the GPUs explain', 0)} are slower and "
            f"{counts.get('faster than the GPUs explain', 0)} faster than the datasheets explain (per provider: "
            + ", ".join(f"{p} {r['sum']} of {r['size']}" for p, r in per_provider.iterrows())
            + "). The published figures are therefore not reproduced closely enough to vouch for the harness, and the loss "
              "notebooks do not lean on them: each of their ratios compares providers measured together in one run on one GPU.")


def _display_pattern():
    """A regex of the provider keys :data:`.charts.DISPLAY_NAMES` renames, as whole words, not already renamed."""
    from .charts import DISPLAY_NAMES

    keys = sorted(DISPLAY_NAMES, key=len, reverse=True)
    guards = "".join(f"(?!{re.escape(value[len(key):])})" for key, value in DISPLAY_NAMES.items() if value.startswith(key) and value != key)
    return re.compile(r"(?<![\w\[])(" + "|".join(map(re.escape, keys)) + r")(?![\w\]])" + guards), DISPLAY_NAMES


def display_names(text: str) -> str:
    """``text`` with every provider key of :data:`.charts.DISPLAY_NAMES` (the baseline's "torch", "huggingface",
    "baseline") as a whole word replaced by its display name; ``torch_lce`` or an already renamed name stays."""
    pattern, names = _display_pattern()
    return pattern.sub(lambda m: names[m.group(1)], str(text))


def display_columns(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its column and index names in :func:`display_names` (its values unchanged)."""
    table = table.rename(columns=lambda c: display_names(c) if isinstance(c, str) else c)
    return table.rename_axis(index=[display_names(n) if isinstance(n, str) else n for n in table.index.names])


#: The columns of :func:`.check.check_against_reference` that are not a case's options.
CHECK_COLUMNS = {"loss", "shape", "dtype", "baseline", "tolerance", "passed", "kernels_lib loss err", "kernels_lib grad err",
                 "baseline loss err", "baseline grad err"}


def options_text(checks: pd.DataFrame, exclude: tuple[str, ...] = ()) -> pd.Series:
    """Per case of a check table, its options (the columns that are not errors, dtype, shape, loss or baseline) as
    ``name=value`` joined by commas, only those the case sets; "defaults" where it sets none."""
    columns = [c for c in checks.columns if c not in CHECK_COLUMNS and c not in exclude and not c.endswith(" err")]
    def text(row):
        set_ = [f"{c}={int(row[c]) if isinstance(row[c], float) and row[c].is_integer() else row[c]}" for c in columns
                if not (isinstance(row[c], float) and math.isnan(row[c])) and row[c] is not None]
        return ", ".join(set_) or "defaults"
    return checks.apply(text, axis=1) if len(checks) else pd.Series(dtype=object)


def check_summary(checks: pd.DataFrame, by: list[str], keep: list[str] | None = None) -> pd.DataFrame:
    """A check table of :func:`.check.check_against_reference` in one row per group of ``by`` (``"options"``: the
    case's options, :func:`options_text`): its worst case relative to the tolerance (:func:`worst_cases` over
    kernels_lib's loss and gradient errors) with its ``keep`` columns (by default the shape and the options) and the
    baseline's errors, how many cases the group held and how many passed. The spec's baseline is named by its
    display name; where the table has a ``baseline`` column (a suite of several baselines), that column is shown
    as "checked against" and the errors stay the baseline's."""
    errors = ["kernels_lib loss err", "kernels_lib grad err"]
    table = checks.assign(options=options_text(checks, exclude=tuple(by)))
    keep = [c for c in (keep if keep is not None else ["shape", "options"]) if c not in by and c in table.columns]
    theirs = [c for c in ("baseline loss err", "baseline grad err") if c in table.columns]
    summary = worst_cases(table, by, errors, keep=keep + theirs)
    summary = summary[keep + errors + theirs + [c for c in ("tolerance", "cases", "passed") if c in summary.columns]]
    if "baseline" in checks.columns:
        return summary.rename_axis(index=["checked against" if n == "baseline" else n for n in summary.index.names])
    return display_columns(summary)


def coverage_summary(coverage: pd.DataFrame) -> pd.DataFrame:
    """:func:`.overview.coverage_rows` (one row per published chart and GPU) in one row per chart: the published
    GPU and providers, the GPUs measured, how many of them, and the providers some GPU's run left out; the
    providers under their display names."""
    def joined(values):
        names = sorted({display_names(p.strip()) for v in values for p in str(v).split(",") if p.strip() not in ("", "–")})
        return ", ".join(names) or "–"
    measured = coverage[coverage["measured on"] != "none yet"]
    table = coverage.groupby("workload", sort=False).agg(**{"published on": ("published on", "first"),
                                                            "published providers": ("published providers", joined)})
    table["measured on"] = measured.groupby("workload", sort=False)["measured on"].agg(lambda g: ", ".join(g)).reindex(table.index).fillna("none yet")
    table["GPUs"] = measured.groupby("workload", sort=False).size().reindex(table.index).fillna(0).astype(int)
    table["not in some run"] = measured.groupby("workload", sort=False)["not in this run"].agg(joined).reindex(table.index).fillna("–")
    return table


def agreement_summary(agreement: pd.DataFrame) -> pd.DataFrame:
    """:func:`.overview.agreement_table` (one row per chart, GPU, provider, mode and x) in one row per GPU, provider
    (display name) and mode: how many points, how many agree, are slower or faster than the GPUs explain, and
    the span of ratio / expected."""
    rows = agreement.assign(provider=agreement.provider.map(display_names))
    verdicts = {"agree": "agrees", "slower": "slower than the GPUs explain", "faster": "faster than the GPUs explain"}
    table = rows.groupby(["gpu", "provider", "mode"]).agg(
        charts=("workload", "nunique"), points=("verdict", "size"),
        **{name: ("verdict", lambda v, said=said: int((v == said).sum())) for name, said in verdicts.items()},
        lowest=("ratio / expected", "min"), highest=("ratio / expected", "max"))
    return table.rename(columns={"lowest": "ratio / expected, lowest", "highest": "ratio / expected, highest"}).rename_axis(index=["GPU", "provider", "mode"])


def comparison_sentences(tables: dict, subject: str = "kernels_lib's `full`") -> str:
    """Two sentences over comparison tables (:func:`.comparison.comparison`; ``tables``: keys whose last item is
    a GPU name, e.g. ``(loss, gpu)`` or ``gpu``): how far ``subject`` is from the fastest peer (named by display
    name), the floor and the leanest peer's memory over every point, and at how many points it is the fastest."""
    tables = {k: t for k, t in tables.items() if len(t)}
    if not tables:
        return "No GPU run is compared yet: the figures wait for one."
    rows = pd.concat(tables.values(), ignore_index=True)
    gpus = sorted({data.gpu_label(k[-1] if isinstance(k, tuple) else k) for k in tables})
    peers = sorted({display_names(p) for p in rows.get("fastest peer", pd.Series(dtype=object)).dropna()})
    timed = rows["× fastest peer"].dropna() if "× fastest peer" in rows else pd.Series(dtype=float)
    first = (f"Over the {len(tables)} comparison tables ({', '.join(gpus)}; {len(rows)} points), {subject} takes "
             f"{span(timed)} the fastest peer's time ({', '.join(peers) or 'no peer measured'}), "
             f"{span(rows.get('× floor', []))} the floor and {span(rows.get('memory × leanest', []))} the leanest peer's memory.")
    return first + (f" It is the fastest at {int((timed < 1).sum())} of the {len(timed)} points with a peer's time." if len(timed) else "")
