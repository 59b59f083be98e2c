"""What serves the notebooks: measurement (``bench``), checks, charts, widgets, data, overview, reports.

A package of its own beside the library (``lab/`` in the repository): ``kernels_lib`` is the losses and
needs torch and triton only; this package needs pandas, plotly, ipywidgets, papermill, nbconvert, ...
(``lab/pyproject.toml``) and the repository's ``data/`` and ``notebooks/`` (:mod:`.paths`), so it is
installed from a clone: ``pip install -e . -e ./lab``, which ``./workbench`` does. Nothing in the
losses imports it.
"""

try:
    import pandas  # noqa: F401  (every module here reads or writes rows as DataFrames)
except ImportError as error:  # pragma: no cover - exercised in tests/test_lean_install.py
    raise ImportError(
        "kernels_workbench serves the notebooks and needs its own dependencies: from the clone, "
        "pip install -e ./lab (the losses themselves, kernels_lib, need only torch and triton)"
    ) from error
