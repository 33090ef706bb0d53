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


def take_last(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """(the value ``name`` (or its ``_`` spelling) has last in ``argv``, as argparse takes it; argv without any)."""
    value = None
    for spelling in (name, "--" + name[2:].replace("-", "_")):
        while True:
            v, rest = take_option(argv, spelling)
            if v is None:
                break
            value, argv = v, rest
    return value, argv
