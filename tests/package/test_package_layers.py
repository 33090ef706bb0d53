"""The package's shape (docs/ARCHITECTURE.md): modules import downwards only — no cycles, no
arrow from a lower layer to a higher one —, benches and tests do not import each other, no
``sys.path`` edits outside tests/conftest.py, no module over ``MAX_LINES`` lines, and no
measurements or history in code comments."""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "vllm_latq"
MAX_LINES = 450


# The layers, lowest first: a module imports its own layer or lower ones. Within layer 3 the
# kernels and the algorithms are siblings that do not import each other.
LAYERS = (
    ("vllm_latq.errors", "vllm_latq.env", "vllm_latq.bounded_io", "vllm_latq.progress", "vllm_latq.native",
     "vllm_latq.cpu_features", "vllm_latq.threads", "vllm_latq.data"),
    ("vllm_latq.hf_model", "vllm_latq.model_config"),
    ("vllm_latq.format",),
    ("vllm_latq.kernels", "vllm_latq.algorithms"),
    ("vllm_latq.quantize",),
    ("vllm_latq.plugin",),
    ("vllm_latq", "vllm_latq.commands", "vllm_latq.quantize.__main__", "vllm_latq.testing"),
)


def room(mod: str) -> tuple[int, str]:
    """(layer, the layer entry holding ``mod``): the longest entry that is ``mod`` or a package of it."""
    best = None
    for i, entries in enumerate(LAYERS):
        for e in entries:
            if (mod == e or mod.startswith(e + ".")) and (best is None or len(e) > len(best[1])):
                best = (i, e)
    if best is None:
        raise AssertionError(f"{mod} is in no layer of LAYERS: place it")
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every arrow to a higher layer, or across siblings of one layer."""
    bad = []
    for mod, targets in sorted(graph.items()):
        (lm, em) = room(mod)
        for t in sorted(targets):
            (lt, et) = room(t)
            if lt > lm or (lt == lm and em != et and lm == 3):
                bad.append(f"{mod} (layer {lm}) → {t} (layer {lt})")
    return bad


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


def test_imports_run_downwards_only():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the layers of docs/ARCHITECTURE.md: " + "; ".join(bad)


def test_the_layer_check_finds_a_planted_upward_import(tmp_path):
    pkg = tmp_path / "vllm_latq"
    (pkg / "format").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "format" / "__init__.py").write_text("")
    (pkg / "format" / "x.py").write_text("def f():\n    from .. import quantize\n")
    (pkg / "quantize.py").write_text("from .format import x\n")
    assert upward_imports(import_graph(pkg)) == ["vllm_latq.format.x (layer 2) → vllm_latq.quantize (layer 4)"]


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("folder,forbidden", [("bench", "tests"), ("vllm_latq", "tests"), ("vllm_latq", "bench"),
                                              ("scripts", "tests"), ("tools", "tests"), ("tools", "bench")])
def test_nothing_leans_on_the_tests(folder, forbidden):
    """What benches and tests both need lives in the package (``vllm_latq.testing``). Tests
    import a bench only to test that bench."""
    bad = [str(p.relative_to(REPO)) for p in (REPO / folder).rglob("*.py") if forbidden in _imported_roots(p)]
    assert not bad, f"{folder} imports {forbidden}: {bad}"


def test_no_sys_path_edits_outside_conftest():
    hits = []
    for folder in ("vllm_latq", "bench", "tests", "scripts", "tools"):
        for p in (REPO / folder).rglob("*.py"):
            if p == REPO / "tests" / "conftest.py" or p == Path(__file__):
                continue
            if re.search(r"sys\.path\.(insert|append|extend)|sys\.path\s*=|sys\.path\s*\+=", p.read_text()):
                hits.append(str(p.relative_to(REPO)))
    assert not hits, f"sys.path edited in {hits}: run benches as python -m bench.NAME from the repository"


def test_no_loading_of_scripts_by_file_path():
    hits = [str(p.relative_to(REPO)) for folder in ("vllm_latq", "bench", "tests", "scripts", "tools")
            for p in (REPO / folder).rglob("*.py")
            if "spec_from_file_location" in p.read_text() and p != Path(__file__)]
    assert not hits, f"scripts loaded by file path in {hits}: import them as modules"


def _size_ruled() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for folder in ("vllm_latq", "tools", "bench")
                  for p in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _size_ruled())
def test_no_long_modules(path):
    lines = len((REPO / path).read_text().splitlines())
    assert lines <= MAX_LINES, f"{path} has {lines} lines (> {MAX_LINES}): split it by job"


def test_architecture_page_states_these_layers():
    """docs/ARCHITECTURE.md's layer table is LAYERS, top layer first: the rule the page states is
    the rule this file enforces."""
    page = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    table = page.split("<!-- layers -->")[1].split("<!-- /layers -->")[0].strip().strip("`").strip()
    stated = []
    for line in table.splitlines():
        number, names = re.match(r"(\d+)\s+(.*?)(?:\s{2,}.*)?$", line).groups()
        stated.append((int(number), {("vllm_latq" if n == "vllm_latq" else f"vllm_latq.{n}")
                                     for n in re.split(r",\s*|\s*\|\s*", names)}))
    assert stated == [(i + 1, set(entries)) for i, entries in reversed(list(enumerate(LAYERS)))]


# What code comments must not carry (docs/ and the git log hold measurements and history): an
# issue number, an ISO date, a number with a unit of time or of tokens per second.
HISTORY = {
    "an issue number": re.compile(r"\bissue #?\d+|(?<![\w&#])#\d+\b", re.I),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a timing": re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?(?:\s?[–-]\s?\d+(?:[.,]\d+)?)?\s?"
                           r"(?:ns|µs|us|ms|s|sec|seconds?|min|minutes?|hours?|tok/s)(?![\w/])"),
}


def comments_and_docstrings(source: str):
    """(line, text) of every comment and every string standing alone as a statement (docstrings,
    string comments); not the strings the code uses (log formats, names, messages)."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for k, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + k, line


def history_in(source: str) -> list[tuple[int, str, str]]:
    """(line, what, the text) of each comment or docstring line carrying a ``HISTORY`` pattern."""
    return [(ln, what, m.group(0)) for ln, text in comments_and_docstrings(source)
            for what, pattern in HISTORY.items() if (m := pattern.search(text))]


def test_the_history_check_finds_planted_history_and_spares_code():
    planted = ('"""Twice as fast since issue 12 (2026-11-22)."""\n'
               'x = 1  # was 3.5 ms, see #14; 20–40 min on 2 cores, 1.2 tok/s\n'
               'def f():\n    """Waits 30 s."""\n')
    assert sorted((ln, what) for ln, what, _ in history_in(planted)) == [
        (1, "a date"), (1, "an issue number"), (2, "a timing"), (2, "an issue number"), (4, "a timing")]
    code = ('t_ms = 3  # the time in ms, per call of f(x) (units, not a measurement)\n'
            'log.info("took %.1f ms, %d tok/s on issue #%d", t, r, 5)\n'
            'name = "2026-11-22 issue 12 #12 3 ms"  # 16-row tiles, LOP3s, L40S, w4s, 4-bit\n')
    assert history_in(code) == []


@pytest.mark.parametrize("folder", ["vllm_latq", "bench", "tools"])
def test_no_measurements_or_history_in_code_comments(folder):
    hits = [f"{p.relative_to(REPO)}:{ln}: {what} ({text!r})" for p in sorted((REPO / folder).rglob("*.py"))
            for ln, what, text in history_in(p.read_text())]
    assert not hits, ("comments say why; measurements go to docs/ (KERNELS.md, BENCHMARKS.md), history to "
                      "the git log:\n" + "\n".join(hits))
