"""The files of a checkpoint directory, by name (docs/FORMAT.md, "Directory"): the writer,
the reader and the validator all refer to them through these constants.

    config.json                       the model's config + quantization_config (spec.py)
    model-00001-of-000NN.safetensors  one shard per decoder block, then one for the rest
    model.safetensors.index.json      {"metadata": {"total_size"}, "weight_map": {tensor: shard}}
    latq_stats.json                   per-layer bits, outlier rate, error, certificate
    latq_manifest.json                sha256 of config.json, latq_stats.json and each shard's header
    tokenizer*, generation_config.json, ...   copied from the source model (AUX_PATTERNS)
"""
from __future__ import annotations

from pathlib import Path

from ..errors import FormatError
from ..hf_model import CONFIG_FILE

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
STATS_FILE = "latq_stats.json"
MANIFEST_FILE = "latq_manifest.json"
# Files copied verbatim from the source model (tokenizer, chat template, generation defaults).
AUX_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                "chat_template*", "generation_config.json")


def check_no_links_out(root: Path) -> None:
    """Refuse a file of the directory ``root`` that is a symbolic link resolving outside it, naming
    it: a checkpoint is what its directory holds. A Hugging Face cache snapshot's links into its own
    ``blobs`` folder are how the hub stores files, and are read."""
    here = root.resolve()
    blobs = here.parent.parent / "blobs" if here.parent.name == "snapshots" else None
    for entry in sorted(root.iterdir()):
        if not entry.is_symlink() or entry.is_dir():
            continue
        target = entry.resolve()
        if not (target.is_relative_to(here) or (blobs is not None and target.is_relative_to(blobs))):
            raise FormatError(f"a symbolic link to {target}, outside the checkpoint directory: refused (copy the "
                              "file into the checkpoint if you mean to use it)", file=entry.name)
