"""Source shown in the notebooks: one function's core, at most a page, with the file it comes from.

A notebook shows the kernel it explains, not the whole file: :func:`excerpt` takes one function (a
``@triton.jit`` kernel or a plain one), drops its docstring, keeps the lines from the first one matching
``start`` to the last one matching ``stop`` (the signature always stays), and cuts what is left to
``max_lines`` with a marker that says how many lines were left out. The markdown it returns names the
file and the lines, so a reader knows where the rest is.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path

from .paths import REPO_ROOT

#: The most lines a notebook cell shows of one function.
MAX_LINES = 60


def _function(obj):
    """The Python function behind ``obj``: a Triton kernel's ``fn``, else ``obj`` itself."""
    return getattr(obj, "fn", obj)


def _shown_path(path: str) -> str:
    """``path`` relative to the repository where it lies inside it."""
    try:
        return Path(path).resolve().relative_to(REPO_ROOT.resolve()).as_posix()
    except ValueError:
        return Path(path).name


def _parts(lines: list[str]) -> tuple[int, int, set[int]]:
    """``(index of the def line, index of the body's first line, indices of the docstring)`` in ``lines``."""
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    body = node.body
    doc = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        doc = set(range(body[0].lineno - 1, body[0].end_lineno))
    def_line = next(i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "async def ")))
    return def_line, body[0].lineno - 1, doc


def _compact_signature(lines: list[str], def_line: int, width: int = 110) -> list[str]:
    """The ``def`` line with the arguments on as few lines as fit ``width`` (their comments dropped)."""
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    indent = re.match(r"\s*", lines[def_line]).group(0)
    text = f"def {node.name}({ast.unparse(node.args)}):"
    wrapped = textwrap.wrap(text, width - len(indent), subsequent_indent="        ", break_on_hyphens=False)
    return [indent + line + "\n" for line in wrapped]


def excerpt_lines(obj, start: str | None = None, stop: str | None = None, max_lines: int = MAX_LINES,
                  compact: bool = False) -> tuple[list[str], str, int, int, bool]:
    """``(shown lines, file, first line, last line, shortened)`` of :func:`excerpt`."""
    function = _function(obj)
    lines, first = inspect.getsourcelines(function)
    def_line, body_start, doc = _parts(lines)
    head = lines[:def_line] + (_compact_signature(lines, def_line) if compact else lines[def_line:body_start])
    body = [(first + i, lines[i]) for i in range(body_start, len(lines)) if i not in doc]
    shortened = compact or bool(doc)
    if start is not None:
        hits = [i for i, (_, line) in enumerate(body) if re.search(start, line)]
        if not hits:
            raise ValueError(f"no line of {function.__name__} matches {start!r}")
        shortened |= hits[0] > 0
        body = body[hits[0]:]
    if stop is not None:
        hits = [i for i, (_, line) in enumerate(body) if re.search(stop, line)]
        if not hits:
            raise ValueError(f"no line of {function.__name__} matches {stop!r}")
        shortened |= hits[-1] + 1 < len(body)
        body = body[: hits[-1] + 1]
    indent = re.match(r"\s*", body[0][1]).group(0) if body else "    "
    shown = list(head)
    if start is not None and body and body[0][0] > first + body_start:
        shown.append(f"{indent}...\n")
    room = max_lines - len(shown)
    if len(body) > room:
        left = len(body) - (room - 1)
        body = body[: room - 1]
        shown += [line for _, line in body] + [f"{indent}# ... {left} more lines in the file\n"]
        shortened = True
    else:
        shown += [line for _, line in body]
    last = body[-1][0] if body else first + len(lines) - 1
    return shown, _shown_path(inspect.getsourcefile(function)), first, last, shortened


def excerpt(obj, start: str | None = None, stop: str | None = None, max_lines: int = MAX_LINES,
            compact: bool = False) -> str:
    """Markdown: the source of ``obj`` (a function or a Triton kernel) without its docstring, from the first
    line matching the regex ``start`` to the last matching ``stop`` (the signature always shown; with
    ``compact`` on as few lines as fit, its comments dropped), at most ``max_lines`` lines, under a line
    naming the file and the lines shown."""
    shown, path, first, last, shortened = excerpt_lines(obj, start, stop, max_lines, compact)
    name = _function(obj).__name__
    where = f"`{name}`, `{path}` lines {first}–{last}" + (" (shortened: the whole function is in the file)" if shortened else "")
    return f"{where}:\n\n```python\n{textwrap.dedent(''.join(shown))}```"
