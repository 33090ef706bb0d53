"""The package's shape: no import cycles among its modules, and no module so long that a reader
cannot see its one job (over ``MAX_LINES`` lines it must say why in its docstring)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_latq"
MAX_LINES = 450
SIZE_REASON = "Size:"  # the docstring paragraph that explains a long module


def _modules(root: Path = PACKAGE) -> dict[str, Path]:
    mods = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(root.parent).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level:
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([target] if target else []))
    return target or ""


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module → the package modules it imports, anywhere in its body (a lazy import inside a
    function still ties the two modules together). ``from P import n`` counts as importing the
    submodule ``P.n`` when one exists, else ``P``."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, is_pkg, node.level, node.module)
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            else:
                continue
            graph[mod].update(t for t in targets if t in mods and t != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "vllm_latq"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    g = import_graph(pkg)
    assert g["vllm_latq.a"] == {"vllm_latq.sub.b"} and g["vllm_latq.sub.b"] == {"vllm_latq.a"}
    assert cycles(g) == [["vllm_latq.a", "vllm_latq.sub.b"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles among the package's modules: " + "; ".join(" ↔ ".join(c) for c in found)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_long_modules_say_why(module):
    path = _modules()[module]
    lines = len(path.read_text().splitlines())
    if lines <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert SIZE_REASON in doc, (f"{path.relative_to(PACKAGE.parent)} has {lines} lines (> {MAX_LINES}): split it by "
                                f"job, or say why it is one file in a '{SIZE_REASON}' paragraph of its docstring")
