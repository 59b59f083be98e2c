r"""Formulas in the HTML reports, typeset offline: TeX in markdown converted to MathML at export.

nbconvert's templates load MathJax from a CDN, which typesets ``$...$`` and ``$$...$$`` in the
browser; offline, a reader would see the TeX source. Browsers render MathML themselves (Chromium
since version 109, Firefox, Safari), so before export the runner replaces each formula of the
markdown cells and of the markdown outputs by its MathML (``latex2mathml``). Code (fenced blocks
and backtick spans) is left alone, as is ``\$``. A formula that ``latex2mathml`` cannot convert stays
TeX (MathJax typesets it when online) and is counted, so a report can say so.
"""

from __future__ import annotations

import re

from latex2mathml.converter import convert
from nbconvert.preprocessors import Preprocessor

#: Fenced code blocks and inline code spans: never searched for formulas.
_CODE = re.compile(r"(```.*?```|`[^`\n]*`)", re.S)
#: ``$$display$$`` (may span lines), or ``$inline$``: not ``\$``, no space just inside; an inline formula
#: may go on past a line break, as Markdown's paragraphs do, but not past a blank line (a new paragraph).
_MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$(?![\s$])((?:[^$\n]|\n(?![ \t]*\n))+?)(?<![\s\\])\$(?!\$)", re.S)


def markdown_math_to_mathml(text: str) -> tuple[str, int, int]:
    """``text`` with every formula outside code replaced by MathML; returns ``(text, converted,
    left as TeX)``."""
    converted = failed = 0

    def replace(match: re.Match) -> str:
        nonlocal converted, failed
        block = match.group(1) is not None
        tex = (match.group(1) if block else match.group(2)).strip()
        try:
            mathml = convert(tex, display="block" if block else "inline")
        except Exception:  # latex2mathml raises its own errors and plain ones on unknown TeX
            failed += 1
            return match.group(0)
        converted += 1
        # HTML5 knows <math> without a namespace; with one, nbconvert's heading anchors (an XML
        # round trip) would write it back as <ns0:math>, which browsers do not render
        return mathml.replace(' xmlns="http://www.w3.org/1998/Math/MathML"', "")

    parts = _CODE.split(text)
    for index in range(0, len(parts), 2):  # even indices lie outside code
        parts[index] = _MATH.sub(replace, parts[index])
    return "".join(parts), converted, failed


class MathMLPreprocessor(Preprocessor):
    """Converts the formulas of markdown cells and of ``text/markdown`` outputs to MathML; counts
    them in ``converted`` and ``failed``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.converted = self.failed = 0

    def _convert(self, text: str) -> str:
        text, converted, failed = markdown_math_to_mathml(text)
        self.converted += converted
        self.failed += failed
        return text

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "markdown":
            cell.source = self._convert(cell.source)
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "text/markdown" in data:
                data["text/markdown"] = self._convert(data["text/markdown"])
        return cell, resources
