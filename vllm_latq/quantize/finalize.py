"""Finishing a run: the last shard (everything outside the blocks, and a quantized head),
the index, ``config.json`` with its ``quantization_config``, the tokenizer files,
``latq_stats.json`` and ``latq_manifest.json`` (their checksums, last); then validation and
the atomic rename of the run directory to ``OUT``.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..format.files import CONFIG_FILE, STATS_FILE
from ..format.manifest import write_manifest
from ..format.safetensors_file import write_safetensors
from ..format.validate import validate_checkpoint
from ..format import writer
from .output import check_output
from .resume import RunDir


def stats_file(stats: list[dict], method: str, src: Path, version: int = 1) -> dict:
    """``latq_stats.json``: the per-layer records and their parameter-weighted totals (``version``:
    the checkpoint's format version)."""
    n = sum(s["shape"][0] * s["shape"][1] for s in stats)
    wavg = lambda k: sum(s[k] * s["shape"][0] * s["shape"][1] for s in stats) / n if n else 0.0  # noqa: E731
    certs = [s["cert"] for s in stats if s["cert"] is not None]
    rels = [s["rel_error"] for s in stats if s["rel_error"] is not None]
    return {"format_version": version, "method": method, "source": src.name,
            "layers": stats,
            "totals": {"layers": len(stats), "quantized_params": n, "bits_per_weight": wavg("bits"),
                       "outlier_rate": wavg("outlier_rate"), "rel_error_mean": sum(rels) / len(rels)
                       if rels else None, "cert_max": max(certs) if certs else None}}


def checkpoint_config(source_config: dict, quantization_config: dict, untie_head: bool) -> dict:
    """The checkpoint's ``config.json``: the source's with its ``quantization_config``
    (``untie_head``: a tied head quantized, stored apart from the embedding, which stays)."""
    cfg = dict(source_config)
    cfg["quantization_config"] = quantization_config
    if untie_head:
        cfg["tie_word_embeddings"] = False
    return cfg


def finalize(run: RunDir, out: Path, source: Path, nblocks: int, rest: dict, config: dict, method: str,
             validate: bool) -> dict:
    """Write the rest of the checkpoint into ``run`` after its ``nblocks`` block shards — the
    last shard (``rest``: the tensors outside the blocks), ``config``, the tokenizer files of
    ``source``, the stats of ``method`` and the manifest —, validate it (unless not ``validate``)
    and move it to ``out`` (replacing it) → the stats file's totals."""
    nshards = nblocks + 1
    write_safetensors(run.path / writer.shard_name(nblocks, nshards), rest)
    writer.write_index(run.path, [writer.shard_name(i, nshards) for i in range(nshards)])
    writer.write_json(run.path / CONFIG_FILE, config)
    writer.copy_aux_files(source, run.path)
    stats = stats_file(run.stats, method, source, config["quantization_config"]["format_version"])
    writer.write_json(run.path / STATS_FILE, stats)
    write_manifest(run.path, [writer.shard_name(i, nshards) for i in range(nshards)])
    run.clear_progress()
    if validate:
        validate_checkpoint(run.path, decode=True, verify_checksums=False)
    if out.exists():
        check_output(out, source, overwrite=True)   # what it holds now, hours after the run began
        shutil.rmtree(out)
    os.replace(run.path, out)
    return stats["totals"]
