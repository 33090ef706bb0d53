"""docs/BENCHMARKS.md stays a reference to the benches that exist: a section per bench that
prints a ``HEADLINE``, run lines that name real modules and real flags, and no diary (dated
headings, issue numbers). Text checks only: nothing here imports or runs a bench."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
DOC = REPO / "docs" / "BENCHMARKS.md"
HEADLINE_PRINT = re.compile(r"""["']HEADLINE """)
RUN_MODULE = re.compile(r"python -m ([\w.]+)")
RUN_PATH = re.compile(r"\b(bench/[\w/]+\.py)\b")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
BENCH_IMPORT = re.compile(r"^\s*(?:from|import) (bench(?:\.\w+)+)", re.M)


def sections(text: str) -> dict[str, str]:
    """``## `` heading → the body under it (to the next ``## ``)."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def run_lines(body: str) -> list[str]:
    """The indented command lines of a section, comments stripped."""
    return [ln.split(" # ")[0].strip() for ln in body.splitlines()
            if ln.startswith("    ") and ("python" in ln or "bench/" in ln)]


def module_file(mod: str) -> Path | None:
    """The source file of a dotted module under the repository, or None."""
    base = REPO.joinpath(*mod.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def source_with_bench_imports(path: Path, seen: set[Path] | None = None) -> str:
    """A script's text plus that of the bench modules it imports (where its options live)."""
    seen = set() if seen is None else seen
    if path in seen:
        return ""
    seen.add(path)
    text = path.read_text()
    for mod in BENCH_IMPORT.findall(text):
        f = module_file(mod)
        if f is not None:
            text += source_with_bench_imports(f, seen)
    return text


def headline_scripts() -> list[str]:
    """bench/*.py scripts whose own source prints a HEADLINE line."""
    return sorted(p.name for p in BENCH.glob("*.py") if HEADLINE_PRINT.search(p.read_text()))


def test_every_headline_bench_has_a_section():
    scripts = headline_scripts()
    assert len(scripts) >= 5, scripts          # the scan itself found the benches
    heads = list(sections(DOC.read_text()))
    missing = [s for s in scripts if not any(s in h for h in heads)]
    assert not missing, f"docs/BENCHMARKS.md has no section for {missing}"


def test_every_bench_section_has_run_lines_naming_existing_modules():
    bench_sections = {h: b for h, b in sections(DOC.read_text()).items() if re.search(r"\w+\.py", h)}
    assert len(bench_sections) >= len(headline_scripts())
    for head, body in bench_sections.items():
        lines = run_lines(body)
        assert lines, f"section {head!r} has no run line"
        for ln in lines:
            mods = RUN_MODULE.findall(ln)
            paths = RUN_PATH.findall(ln)
            assert mods or paths, f"{head!r}: {ln!r} names no module"
            files = [module_file(m) for m in mods] + [REPO / p if (REPO / p).is_file() else None for p in paths]
            assert all(files), f"{head!r}: {ln!r} names a module that does not exist"
            src = "".join(source_with_bench_imports(f) for f in files)
            unknown = [f for f in FLAG.findall(ln) if f'"{f}"' not in src]
            assert not unknown, f"{head!r}: {ln!r} uses flags its script does not define: {unknown}"


@pytest.mark.parametrize("pattern, what", [
    (re.compile(r"^#+ .*20\d\d-", re.M), "a dated heading"),
    (re.compile(r"\bissue \d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w&])#\d+"), "an issue number"),
])
def test_benchmarks_is_no_diary(pattern, what):
    hits = pattern.findall(DOC.read_text())
    assert not hits, f"docs/BENCHMARKS.md has {what}: {hits[:3]}"


def test_kernels_reference_has_no_dates_or_issue_numbers():
    """docs/KERNELS.md is present-tense reference: the history lives in git."""
    text = (REPO / "docs" / "KERNELS.md").read_text()
    for pattern in (r"\b20\d\d-\d\d-\d\d\b", r"\bissue \d+", r"(?<![\w&])#\d+"):
        hits = re.findall(pattern, text, re.I)
        assert not hits, f"docs/KERNELS.md has {hits[:3]}"


def test_checks_catch_a_diary():
    """The patterns above do fire on what they are meant to reject."""
    diary = "## Measured on the VM (2026-11-22)\nsee issue 19 and #21\n"
    assert re.search(r"^#+ .*20\d\d-", diary, re.M)
    assert re.search(r"\bissue \d+", diary, re.I)
    assert re.search(r"(?<![\w&])#\d+", diary)
    assert "x.py" in " ".join(sections("## x.py — a bench\n    python -m bench.x\n"))
