"""kernels_workbench.source: a function's core for a notebook cell, at most a page, naming its file."""

from __future__ import annotations

from kernels_workbench.source import MAX_LINES, excerpt, excerpt_lines


def long_function(a, b,  # a comment on the arguments
                  c=3):
    """A docstring
    over two lines."""
    total = a + b
    for i in range(c):
        total += i
    # the part a reader wants
    total *= 2
    total -= 1
    return total


def many_lines():
    x = 0
    x += 1
    x += 1
    x += 1
    x += 1
    x += 1
    return x


def test_docstring_dropped_and_file_named():
    text = excerpt(long_function)
    assert "A docstring" not in text and "total *= 2" in text and "return total" in text
    assert text.startswith("`long_function`, `tests/test_source.py` lines ")
    assert "shortened" in text  # the docstring is left out


def test_start_and_stop_select_lines_the_signature_stays():
    shown, path, first, last, shortened = excerpt_lines(long_function, start="the part", stop="total -= 1")
    body = "".join(shown)
    assert body.startswith("def long_function(a, b,") and "    ...\n" in body
    assert "for i in range" not in body and "return total" not in body and "total -= 1" in body
    assert shortened and path == "tests/test_source.py" and first < last


def test_compact_signature_drops_argument_comments():
    shown, *_ = excerpt_lines(long_function, compact=True)
    assert shown[0] == "def long_function(a, b, c=3):\n" and "a comment" not in "".join(shown)


def test_cut_to_max_lines_with_a_marker():
    shown, *_ , shortened = excerpt_lines(many_lines, max_lines=5)
    assert len(shown) == 5 and shown[-1].strip() == "# ... 4 more lines in the file" and shortened
    assert len(excerpt_lines(many_lines)[0]) <= MAX_LINES and not excerpt_lines(many_lines)[-1]


def test_triton_kernel_core_fits_a_page():
    from kernels_lib.kernels import token_logprobs

    shown, path, *_ = excerpt_lines(token_logprobs.token_logprobs_kernel, compact=True)
    assert len(shown) <= MAX_LINES and path == "kernels_lib/kernels/token_logprobs.py"
    assert shown[0].startswith("@triton.jit")
