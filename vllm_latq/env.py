"""The ``LATQ_*`` switches read strictly, one function per kind of value: anything else is refused naming the
variable (docs/ENVIRONMENT.md). Empty is unset."""
from __future__ import annotations

import math
import os
import re

TRUE = ("1", "true")
FALSE = ("0", "false")
# the longest number a variable may spell: int() refuses over 4300 digits with its own error, and
# no switch needs more than a 64-bit value
MAX_NUMBER_CHARS = 40
# ASCII only: float() and int() also read Unicode digits ('３０', '٠.٥'), and float() '1_0' and 'inf'
INTEGER = re.compile(r"[+-]?[0-9]+")
DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class EnvError(ValueError):
    """An environment variable's value is not one its reader accepts (one line: name, value, accepted)."""

    def __init__(self, name: str, value: str, accepted: str):
        shown = repr(value) if len(value) <= 80 else f"{value[:60]!r}… ({len(value)} characters)"   # one short line
        super().__init__(f"environment variable {name}={shown}: expected {accepted}")
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
    if len(v) > MAX_NUMBER_CHARS or not INTEGER.fullmatch(v):
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
    x = float(v) if len(v) <= MAX_NUMBER_CHARS and DECIMAL.fullmatch(v) else math.nan
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


def directory(name: str) -> str | None:
    """:func:`path` naming a directory, or nothing yet (it is created where used): an existing file,
    device or FIFO (``/dev/null``) is refused here, not met as an OSError inside a command."""
    v = path(name)
    if v is not None and os.path.exists(v) and not os.path.isdir(v):
        raise EnvError(name, v, "a directory (this exists and is not one), or unset")
    return v


def existing_directory(name: str) -> str | None:
    """:func:`path` naming a directory that exists now."""
    v = path(name)
    if v is not None and not os.path.isdir(v):
        why = "this is not one" if os.path.exists(v) else "nothing is there"
        raise EnvError(name, v, f"an existing directory ({why}), or unset")
    return v


def regular_file(name: str) -> str | None:
    """:func:`path` naming a regular file, or none yet in an existing directory (where it is to be written)."""
    v = path(name)
    if v is None:
        return v
    if os.path.exists(v) and not os.path.isfile(v):
        raise EnvError(name, v, "a regular file (this exists and is not one), or unset")
    if not os.path.exists(v) and not os.path.isdir(os.path.dirname(os.path.abspath(v))):
        raise EnvError(name, v, "a regular file, or one to be written in an existing directory (its directory is "
                                "not there), or unset")
    return v
