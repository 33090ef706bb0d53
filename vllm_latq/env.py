"""The ``LATQ_*`` switches read strictly, one function per kind of value: anything else is refused naming the
variable (docs/ENVIRONMENT.md). Empty is unset."""
from __future__ import annotations

import math
import os
import re

TRUE = ("1", "true")
FALSE = ("0", "false")


class EnvError(ValueError):
    """An environment variable's value is not one its reader accepts (one line: name, value, accepted)."""

    def __init__(self, name: str, value: str, accepted: str):
        super().__init__(f"environment variable {name}={value!r}: expected {accepted}")
        self.name = name


def value(name: str) -> str | None:
    v = os.environ.get(name)
    return v if v else None


def flag(name: str, default: bool | None = False) -> bool | None:
    """``1``/``true`` → True, ``0``/``false`` → False (any case); unset or empty → ``default``."""
    v = value(name)
    if v is None:
        return default
    if v.lower() in TRUE:
        return True
    if v.lower() in FALSE:
        return False
    raise EnvError(name, v, f"{' or '.join(TRUE)} (on), {' or '.join(FALSE)} (off), or unset")


def integer(name: str, default: int | None, *, minimum: int, maximum: int | None = None) -> int | None:
    """A decimal integer in ``[minimum, maximum]``; unset or empty → ``default``."""
    v = value(name)
    if v is None:
        return default
    accepted = f"an integer ≥ {minimum}" + (f" and ≤ {maximum}" if maximum is not None else "") + ", or unset"
    if not re.fullmatch(r"[+-]?[0-9]+", v.strip()) or v != v.strip():
        raise EnvError(name, v, accepted)
    n = int(v)
    if n < minimum or (maximum is not None and n > maximum):
        raise EnvError(name, v, accepted)
    return n


def number(name: str, default: float | None, *, minimum: float, above: bool = False,
           maximum: float | None = None) -> float | None:
    """A finite decimal number ``≥ minimum`` (``> minimum`` with ``above``) and ``≤ maximum``; unset → ``default``."""
    v = value(name)
    if v is None:
        return default
    accepted = (f"a number {'>' if above else '≥'} {minimum:g}" + (f" and ≤ {maximum:g}" if maximum is not None else "")
                + ", or unset")
    try:
        x = float(v) if v == v.strip() else math.nan
    except ValueError:
        x = math.nan
    if not math.isfinite(x) or x < minimum or (above and x == minimum) or (maximum is not None and x > maximum):
        raise EnvError(name, v, accepted)
    return x


def choice(name: str, choices, default: str | None = None) -> str | None:
    """One of ``choices`` exactly; unset or empty → ``default``."""
    v = value(name)
    if v is None:
        return default
    if v not in choices:
        raise EnvError(name, v, f"one of {', '.join(choices)}, or unset")
    return v


def text(name: str, pattern: str, accepted: str) -> str | None:
    """A value that matches the regular expression ``pattern`` whole (``accepted`` says it in words); None if unset."""
    v = value(name)
    if v is not None and not re.fullmatch(pattern, v):
        raise EnvError(name, v, accepted + ", or unset")
    return v


def path(name: str) -> str | None:
    """A file or directory name (no newline or NUL, no surrounding spaces); None if unset or empty."""
    return text(name, r"[^\s\x00](?:[^\n\x00]*[^\s\x00])?", "a path without surrounding spaces or newlines")
