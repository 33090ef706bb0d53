"""Finishing a run: last shard, index, config, tokenizer files, stats and manifest; then validation
(so nothing a resumed run kept is sealed unread) and the atomic rename to ``OUT``."""
from __future__ import annotations

from pathlib import Path

from ..format import output_dir
from ..format.files import CONFIG_FILE, INDEX_FILE, MANIFEST_FILE, STATS_FILE
from ..format.manifest import read_manifest, unsealed_entries, write_manifest
from ..format.safetensors_file import write_safetensors
from ..format.validate import validate_checkpoint
from ..format import writer
from .output import COMMAND, replace_output
from .resume import RunDir


def stats_file(stats: list[dict], method: str, src: Path, group_size: int | None = None,
               version: int = 1) -> dict:
    """``latq_stats.json``: the per-layer records and their parameter-weighted totals (``version``: the
    checkpoint's format version)."""
    if group_size is not None:
        stats = [{**s, "group_size": group_size} for s in stats]
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
    """The checkpoint's ``config.json``: the source's with its ``quantization_config``."""
    cfg = dict(source_config)
    cfg["quantization_config"] = quantization_config
    if untie_head:
        cfg["tie_word_embeddings"] = False
    return cfg


def finalize(run: RunDir, out: Path, source: Path, nblocks: int, rest: dict, config: dict, method: str,
             validate: bool, progress: bool = False) -> dict:
    """Write the rest of the checkpoint into ``run``, validate it and move it to ``out`` → the stats totals."""
    nshards = nblocks + 1
    shards = [writer.shard_name(i, nshards) for i in range(nshards)]
    write_safetensors(run.path / shards[-1], rest)
    writer.write_index(run.path, shards)
    writer.write_json(run.path / CONFIG_FILE, config)
    aux = writer.copy_aux_files(source, run.path)
    qc = config["quantization_config"]
    stats = stats_file(run.stats, method, source, qc.get("group_size"), qc["format_version"])
    writer.write_json(run.path / STATS_FILE, stats)
    run.clear_progress()
    digest = write_manifest(run.path, shards, [INDEX_FILE, *aux], made_by=COMMAND)
    output_dir.unmark_temporary(run.path)
    if validate:
        validate_checkpoint(run.path, decode=True, verify_checksums=True, progress=progress)
    stray = unsealed_entries(run.path, read_manifest(run.path))
    if stray:
        raise ValueError(f"{run.path} holds {stray}, which this run did not write: not sealed into {out}; remove "
                         f"them and check who writes into the run directory (its checkpoint is sealed in "
                         f"{MANIFEST_FILE}: moving it to {out} yourself is safe once they are gone)")
    run.claim.note_sealed(digest, run.fingerprint)   # a rerun after a kill moves it, not computing it again
    replace_output(run.claim, source)
    return stats["totals"]


def place_sealed(run: RunDir, out: Path, source: Path, validate: bool, progress: bool = False) -> None:
    """The checkpoint a killed run of this command sealed (:attr:`RunDir.sealed`), moved to ``out`` unless there."""
    if validate:
        validate_checkpoint(run.sealed, decode=True, verify_checksums=True, progress=progress)
    if run.sealed != out:
        run.claim.note_sealed(run.claim.journal["digest"], run.fingerprint)
        replace_output(run.claim, source)
    else:
        run.claim.forget_journal()
