"""The Jupyter server configuration of ``./workbench lab`` (passed with ``--config``).

The notebooks are committed without outputs (tests/test_project.py checks it), yet running one in
JupyterLab autosaves its outputs into it. Here every notebook the server saves is stripped first: its
outputs, execution counts and what a run or the browser adds (widget state, the kernel's full
``language_info``, timing and scroll metadata) are dropped, so that a notebook run, edited or not, is
written as it would be committed: unchanged bytes when only run, a clean diff when edited. The browser
keeps showing the outputs until the notebook is closed; reopened, it shows none.

``KERNELS_LIB_KEEP_OUTPUTS=1`` in the environment of ``./workbench lab`` turns the stripping off.
"""

from __future__ import annotations

import os
import warnings

#: Cell metadata that running or viewing a cell adds: JupyterLab's timing (``execution``, when
#: ``recordTiming`` is on), scroll and collapse states, papermill's per-cell record, trust, ExecuteTime.
TRANSIENT_CELL_METADATA = ("execution", "collapsed", "scrolled", "papermill", "trusted", "ExecuteTime")
#: Notebook metadata that a run adds: the widgets' saved state, papermill's record.
TRANSIENT_NOTEBOOK_METADATA = ("widgets", "papermill")


def strip_notebook(notebook: dict) -> dict:
    """Strip a notebook (an nbformat 4 dict, changed in place and returned) to its committed form: no outputs,
    no execution counts, no transient metadata, ``language_info`` reduced to the language's name."""
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        metadata = cell.get("metadata")
        if not isinstance(metadata, dict):
            continue
        for key in TRANSIENT_CELL_METADATA:
            metadata.pop(key, None)
        jupyter = metadata.get("jupyter")
        if isinstance(jupyter, dict):
            jupyter.pop("outputs_hidden", None)  # the outputs are gone
            if not jupyter:
                del metadata["jupyter"]
    metadata = notebook.get("metadata")
    if isinstance(metadata, dict):
        for key in TRANSIENT_NOTEBOOK_METADATA:
            metadata.pop(key, None)
        language = metadata.get("language_info")
        if isinstance(language, dict) and "name" in language:
            # the kernel adds its version, lexer and mimetype: they change with the environment
            metadata["language_info"] = {"name": language["name"]}
    return notebook


def strip_before_save(model: dict, path: str = "", contents_manager=None, **kwargs) -> None:
    """The contents manager's pre-save hook: a notebook's model is stripped before it is written."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    if os.environ.get("KERNELS_LIB_KEEP_OUTPUTS", "") not in ("", "0"):
        return
    strip_notebook(model["content"])


# The server and JupyterLab both apply this file: the second time the hook replaces itself, which is no news.
warnings.filterwarnings("ignore", message=r"Overriding existing pre_save_hook \(strip_before_save\) with a new one \(strip_before_save\)")
c = get_config()  # noqa: F821 (provided by Jupyter's config loader)
c.ContentsManager.pre_save_hook = strip_before_save
