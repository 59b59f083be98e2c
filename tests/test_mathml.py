"""kernels_workbench.mathml: TeX formulas in markdown become MathML; code and escaped dollars stay."""

from __future__ import annotations

import nbformat

from kernels_workbench.mathml import MathMLPreprocessor, markdown_math_to_mathml


def test_inline_and_display_formulas_become_mathml():
    text, converted, failed = markdown_math_to_mathml("Loss $\\ell = -\\log p_y$ and\n$$\\frac{\\partial \\ell}{\\partial z_j} = p_j - \\delta_{jy}$$ done.")
    assert (converted, failed) == (2, 0)
    assert "$" not in text and text.count("<math") == 2
    assert 'display="inline"' in text and 'display="block"' in text
    assert "<mfrac>" in text and "<msub>" in text


def test_code_escaped_dollars_and_prices_are_left_alone():
    source = "Run `echo $OUT` and\n```bash\nexport A=$B; echo $C\n```\nit costs \\$5 or \\$6, and $x$."
    text, converted, failed = markdown_math_to_mathml(source)
    assert (converted, failed) == (1, 0)
    assert "`echo $OUT`" in text and "export A=$B; echo $C" in text and "\\$5 or \\$6" in text
    assert text.endswith(".") and text.count("<math") == 1


def test_unconvertible_tex_stays_tex_and_is_counted():
    text, converted, failed = markdown_math_to_mathml("bad $\\frac{1}{$ and good $a^2$")
    assert failed == 1 and converted == 1
    assert "$\\frac{1}{$" in text


def test_preprocessor_converts_markdown_cells_and_markdown_outputs():
    notebook = nbformat.v4.new_notebook()
    code = nbformat.v4.new_code_cell("display(Markdown('$a$'))")
    code.outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": "value $\\beta = 0.1$", "text/plain": "<Markdown>"})]
    notebook.cells = [nbformat.v4.new_markdown_cell("# Title\n$x_1$ and `$not$`"), code]
    processor = MathMLPreprocessor()
    processed, _ = processor.preprocess(notebook, {})
    assert "<math" in processed.cells[0].source and "`$not$`" in processed.cells[0].source
    assert "<math" in processed.cells[1].outputs[0]["data"]["text/markdown"]
    assert processed.cells[1].source == "display(Markdown('$a$'))"  # code is not touched
    assert (processor.converted, processor.failed) == (2, 0)


def test_formulas_in_headings_survive_nbconvert():
    """nbconvert builds heading anchors through an XML round trip: namespaced MathML came back as
    <ns0:math>, which no browser renders."""
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    text, converted, _ = markdown_math_to_mathml("## Precision of $dx$ and $dW$\n\nbody $a$")
    html = markdown2html_mistune(text)
    assert converted == 3 and html.count("<math") == 3 and "ns0:" not in html


def test_an_inline_formula_may_span_a_line_break_not_a_paragraph():
    """A formula wrapped onto the next line of its paragraph is one formula; a lone dollar at the end of a
    paragraph does not reach into the next."""
    text, converted, failed = markdown_math_to_mathml("Through it, $\\partial x_k / \\partial z_j =\n(\\delta_{kj} - q_j)/T$, so $g$.")
    assert (converted, failed) == (2, 0) and "$" not in text and "<mfrac>" not in text and "<mo>&#x02202;</mo>" in text
    text, converted, _ = markdown_math_to_mathml("costs $5\n\nand $6 later")
    assert converted == 0 and text == "costs $5\n\nand $6 later"
