"""The files of a checkpoint directory, by name (the tree in docs/FORMAT.md)."""
from __future__ import annotations

from pathlib import Path

from ..errors import FormatError
from ..hf_model import CONFIG_FILE

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
STATS_FILE = "latq_stats.json"
MANIFEST_FILE = "latq_manifest.json"
TEMP_MARK = "latq_temporary.json"   # in a temporary directory latq made, never sealed into a checkpoint
# Files copied verbatim from the source model (tokenizer, chat template, generation defaults).
AUX_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                "chat_template*", "generation_config.json")


def check_no_links_out(root: Path, what: str = "the checkpoint directory") -> None:
    """Refuse a file of ``root`` that links outside it (a hub snapshot's ``blobs`` links are read)."""
    for entry in sorted(root.iterdir()):
        if entry.is_symlink() and not entry.is_dir():
            check_inside(root, entry, what)


def check_inside(root: Path, entry: Path, what: str, *, name: str | None = None) -> None:
    """Refuse ``entry`` where it links outside ``root`` (or its snapshot's ``blobs``) or loops, naming it."""
    name = name or entry.name
    here = root.resolve()
    blobs = here.parent.parent / "blobs" if here.parent.name == "snapshots" else None
    try:
        target = entry.resolve()
    except (RuntimeError, OSError):   # a loop of links
        raise FormatError("a symbolic link loop: refused", file=name) from None
    if not (target.is_relative_to(here) or (blobs is not None and target.is_relative_to(blobs))):
        raise FormatError(f"a symbolic link to {target}, outside {what}: refused (copy the file into it if you mean "
                          "to use it)", file=name)
