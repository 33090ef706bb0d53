"""The one exception of the format: every reader and validator raises it, so a caller can
tell a bad checkpoint (one line naming the file and tensor) from a bug."""
from __future__ import annotations


class FormatError(ValueError):
    """A checkpoint does not follow the format. The message names the file and tensor."""

    def __init__(self, what: str, *, file: str | None = None, tensor: str | None = None):
        what = " ".join(line.strip() for line in str(what).splitlines())  # always one line
        where = ", ".join(x for x in (f"file {file}" if file else "", f"tensor {tensor}" if tensor else "") if x)
        super().__init__(f"{where}: {what}" if where else what)
