"""The size budget of the statistics core: ``lightning_ext/stats`` in at most 700 code lines (a newcomer
reads it in one sitting), counted as lines holding a token that is neither a comment nor a docstring."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import lightning_ext

_SKIPPED = {  # tokens that are no code
    tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER
}


def code_lines(source: str) -> int:
    """Lines of ``source`` holding code: not blank, not only a comment, not in a module's, class's or
    function's docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _SKIPPED:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_code_lines_skip_docstrings_comments_and_blank_lines():
    source = (
        '"""Module."""\n\n# a comment\ndef f(x):\n    """Doc\n    string."""\n'
        "    y = (x +\n         1)  # why\n    return y\n"
    )
    assert code_lines(source) == 4  # def, the two lines of y, return


def test_the_statistics_core_fits_its_budget():
    root = Path(lightning_ext.__file__).parent / "stats"
    sizes = {path.name: code_lines(path.read_text()) for path in sorted(root.glob("*.py"))}
    assert sum(sizes.values()) <= 700, f"lightning_ext/stats holds {sum(sizes.values())} code lines: {sizes}"
