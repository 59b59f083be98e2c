"""What serves the notebooks: measurement (``bench``), checks, charts, widgets, data, overview, reports.

The losses themselves (``kernels_lib.fused_linear_cross_entropy`` and the others) need torch and
triton only; this half needs the ``workbench`` extra (``pip install kernels_lib[workbench]``:
pandas, plotly, ipywidgets, papermill, nbconvert, ...). Nothing in the losses imports it.
"""

try:
    import pandas  # noqa: F401  (every module here reads or writes rows as DataFrames)
except ImportError as error:  # pragma: no cover - exercised in tests/test_lean_install.py
    raise ImportError(
        "kernels_lib.workbench serves the notebooks and needs the workbench extra: "
        "pip install 'kernels_lib[workbench]' (the losses themselves need only torch and triton)"
    ) from error
