"""No function of the package is over ``MAX_FUNCTION_LINES`` lines, from its ``def`` to its last
line, docstring included: a longer one is split into steps that each have a name. Measured with
``ast`` over ``vllm_latq/``."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_latq"
MAX_FUNCTION_LINES = 80


def function_lengths(root: Path = PACKAGE) -> dict[str, int]:
    """``"file:Class.function"`` → its length in lines, for every function and method under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()

        def visit(node, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{rel}:{prefix}{child.name}"] = child.end_lineno - child.lineno + 1
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)
        visit(ast.parse(path.read_text(), str(path)), "")
    return out


def test_no_function_over_the_limit():
    long = {name: n for name, n in function_lengths().items() if n > MAX_FUNCTION_LINES}
    assert long == {}, long


def test_the_measure_counts_nested_functions_and_methods(tmp_path):
    (tmp_path / "m.py").write_text("class A:\n    def f(self):\n        def g():\n            pass\n"
                                   "        return g\n\n\ndef h():\n" + "    x = 1\n" * 85)
    assert function_lengths(tmp_path) == {"m.py:A.f": 4, "m.py:A.f.g": 2, "m.py:h": 86}
