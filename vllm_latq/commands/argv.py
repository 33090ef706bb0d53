"""Options read out of a command line that is handed on as it is (latq-serve's to ``vllm serve``)."""
from __future__ import annotations


def take_option(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """(the value of ``name`` in ``argv`` as ``NAME V`` or ``NAME=V``, argv without it)."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if a.startswith(name + "="):
            return a.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def take_last(argv: list[str], *names: str) -> tuple[str | None, list[str]]:
    """(the value any of ``names`` (or their ``_`` spellings) has last in ``argv``, as argparse takes it; argv
    without any of them)."""
    spellings = {n for name in names for n in (name, "--" + name[2:].replace("-", "_"))}
    value, rest, i = None, [], 0
    while i < len(argv):
        key, eq, v = argv[i].partition("=")
        if argv[i] in spellings and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif eq and key in spellings:
            value, i = v, i + 1
        else:
            rest.append(argv[i])
            i += 1
    return value, rest
