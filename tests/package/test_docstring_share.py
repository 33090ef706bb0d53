"""Docstrings say what and why in a few lines: their share of the package's lines stays at or
under ``MAX_SHARE``. Longer prose belongs in docs/ (ARCHITECTURE.md, FORMAT.md, KERNELS.md).
Measured with ``ast`` over ``vllm_latq/``: module, class and function docstrings, not comments."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_latq"
MAX_SHARE = 0.10
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def docstring_lines(source: str) -> int:
    """Lines the docstrings of one module span, its own and every class's and function's."""
    n = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, _DOCUMENTED) and ast.get_docstring(node, clean=False) is not None:
            n += node.body[0].end_lineno - node.body[0].lineno + 1
    return n


def docstring_share(root: Path = PACKAGE) -> tuple[int, int, list[tuple[int, int, str]]]:
    """(docstring lines, all lines, per file ``(docstring lines, lines, path)``) under ``root``."""
    per_file = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        per_file.append((docstring_lines(source), len(source.splitlines()), path.relative_to(root).as_posix()))
    return sum(d for d, _, _ in per_file), sum(n for _, n, _ in per_file), per_file


def test_docstrings_are_at_most_a_tenth_of_the_package():
    doc, total, per_file = docstring_share()
    top = "\n".join(f"  {d:4d} of {n:4d} lines  {p}" for d, n, p in sorted(per_file, reverse=True)[:12])
    assert doc <= MAX_SHARE * total, (f"docstrings are {doc}/{total} = {doc / total:.1%} of vllm_latq's lines "
                                      f"(limit {MAX_SHARE:.0%}); the most:\n{top}")


def test_the_measure_counts_docstrings_not_comments_or_strings(tmp_path):
    (tmp_path / "m.py").write_text('"""Module,\ntwo lines."""\n# a comment\nX = """not a docstring"""\n\n\n'
                                   'class A:\n    """One."""\n\n    def f(self):\n        """Three\n\n'
                                   '        lines."""\n        return "f"\n')
    assert docstring_share(tmp_path) == (6, 14, [(6, 14, "m.py")])
