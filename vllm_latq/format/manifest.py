"""``latq_manifest.json``: the seal of a checkpoint directory, every file with its sha256; a pinned
:func:`manifest_digest` also refuses a re-sealed edit (docs/FORMAT.md, "Manifest")."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .. import env
from ..bounded_io import OpenedDir, file_sha256
from ..errors import FormatError
from ..hf_model import config_dict
from .files import CONFIG_FILE, MANIFEST_FILE, STATS_FILE, TEMP_MARK
from .safetensors_file import SafetensorsFile
from .writer import write_json

NO_VERIFY_ENV = "LATQ_NO_VERIFY"
DIGEST_ENV = "LATQ_EXPECT_DIGEST"
MANIFEST_VERSION = 2   # 1: config, stats and shard headers only (no "manifest_version" key)
# read by no loader (vLLM, transformers, latq): beside a checkpoint on a model hub, reported, not sealed
IGNORED = (".gitattributes", "README.md", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "NOTICE.txt")
SKIPPED = (f"the sha256 checks of the tensors (latq_sha256) and of every file of the checkpoint ({MANIFEST_FILE}: "
           "shard headers, config.json, latq_stats.json, tokenizer and generation files) are skipped: an edited "
           "checkpoint is read as it is")
_PARTS = {"quantization_config": "its quantization_config differs",
          "model": "the model's fields (everything but quantization_config) differ"}
_REDO = "re-quantize it, or pass --no-verify (LATQ_NO_VERIFY=1 for vLLM) to read it unchecked"


def json_sha256(obj) -> str:
    """sha256 of ``obj`` as canonical JSON: a value's digest, whatever the file's layout."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def manifest_digest(manifest: dict) -> str:
    """``sha256:<hex>`` of the manifest's value: what a user pins."""
    return "sha256:" + json_sha256(manifest)


def digest_of(path: str | os.PathLike) -> str:
    """The digest of the checkpoint directory ``path``'s manifest (read and its form checked)."""
    return manifest_digest(read_manifest(Path(path)))


def normalize_digest(text: str) -> str:
    """A digest given as ``sha256:<hex>`` or bare hex, in its ``sha256:<hex>`` form; else a ValueError."""
    hexpart = text.strip().lower().removeprefix("sha256:")
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"--expect-digest {text!r}: expected sha256: and 64 hex digits, as latq-quantize prints")
    return "sha256:" + hexpart


def config_digests(cfg: dict) -> dict[str, str]:
    """The digests of ``config.json``'s quantization_config and the rest, apart (a refusal says which)."""
    return {"quantization_config": json_sha256(cfg.get("quantization_config")),
            "model": json_sha256({k: v for k, v in cfg.items() if k != "quantization_config"})}


def opened(where: "str | os.PathLike | OpenedDir", hold_all: bool = True) -> OpenedDir:
    """``where`` if already open, else the directory it names opened (:class:`OpenedDir`)."""
    return where if isinstance(where, OpenedDir) else OpenedDir(where, hold_all=hold_all)


def _stats(d: OpenedDir):
    """``latq_stats.json``'s value, or None where the checkpoint has none."""
    try:
        return d.read_json(STATS_FILE)
    except FileNotFoundError:
        return None


def write_manifest(path: str | os.PathLike, shards: list[str] | None = None, files: list[str] | None = None,
                   made_by: str = "latq-quantize") -> str:
    """Seal the checkpoint directory ``path``, written last → its digest.
    ``made_by``: the command that wrote it, which alone may replace it."""
    path = Path(path)
    names = sorted(shards if shards is not None else (p.name for p in path.glob("*.safetensors")))
    special = {CONFIG_FILE, STATS_FILE, MANIFEST_FILE, TEMP_MARK, *names}
    other = sorted(files if files is not None else
                   (e.name for e in os.scandir(path) if e.is_file() and e.name not in special))
    stats = _stats(opened(path, hold_all=False))
    m = {"manifest_version": MANIFEST_VERSION, "made_by": made_by,
         CONFIG_FILE: config_digests(config_dict(path)),
         STATS_FILE: None if stats is None else json_sha256(stats),
         "shards": {n: SafetensorsFile(path / n).header_sha256 for n in names},
         "files": {n: file_sha256(path / n, name=n) for n in other}}
    write_json(path / MANIFEST_FILE, m)
    return manifest_digest(m)


def read_manifest(where: "str | os.PathLike | OpenedDir") -> dict:
    """The manifest of directory ``where``, its form checked; refused, saying what to do, if missing or too old."""
    try:
        m = opened(where, hold_all=False).read_json(MANIFEST_FILE)
    except FileNotFoundError:
        raise FormatError(f"missing: the checkpoint is not sealed (written by a latq older than the seal, or the file "
                          f"was removed): {_REDO}", file=MANIFEST_FILE) from None
    version = m.get("manifest_version", 1) if isinstance(m, dict) else None
    if version == 1 and type(version) is int:
        raise FormatError("sealed by an older latq (manifest version 1: its tokenizer, generation and index files are "
                          f"not covered): {_REDO}", file=MANIFEST_FILE)
    if version != MANIFEST_VERSION or type(version) is not int:   # 2.0 == 2 in Python: a JSON integer
        raise FormatError(f"manifest_version {version!r}: this reader knows version {MANIFEST_VERSION}, a JSON integer",
                          file=MANIFEST_FILE)
    if not _well_formed(m):
        raise FormatError(f'must hold "manifest_version", "made_by", "{CONFIG_FILE}": {{{", ".join(_PARTS)}}}, '
                          f'"{STATS_FILE}", "shards" and "files" digests', file=MANIFEST_FILE)
    return m


def _well_formed(m: dict) -> bool:
    strings = lambda d: isinstance(d, dict) and all(isinstance(v, str) for v in d.values())  # noqa: E731
    return (isinstance(m.get("made_by"), str) and isinstance(m.get(CONFIG_FILE), dict)
            and all(isinstance(m[CONFIG_FILE].get(k), str) for k in _PARTS)
            and STATS_FILE in m and (m[STATS_FILE] is None or isinstance(m[STATS_FILE], str))
            and strings(m.get("shards")) and strings(m.get("files")))


def verify_manifest(where: "str | os.PathLike | OpenedDir", config: dict, shards: dict[str, SafetensorsFile],
                    expect_digest: str | None = None, manifest: dict | None = None) -> list[str]:
    """Raise :class:`FormatError` naming the file unless every file of ``where`` is the one sealed (and pinned).
    → the unsealed entries no loader reads (:data:`IGNORED` names, subdirectories), to report."""
    d = opened(where)
    m = read_manifest(d) if manifest is None else manifest
    check_digest(m, expect_digest)
    got = config_digests(config)
    for part, what in _PARTS.items():
        if got[part] != m[CONFIG_FILE][part]:
            raise FormatError(f"{what} from what was written (sha256 in {MANIFEST_FILE}): edited after "
                              "quantization (--no-verify reads it unchecked)", file=CONFIG_FILE)
    stats = _stats(d)
    if (stats is None) != (m[STATS_FILE] is None):
        raise FormatError("missing, but recorded in " + MANIFEST_FILE if stats is None else
                          f"not written with this checkpoint ({MANIFEST_FILE} records none)", file=STATS_FILE)
    if stats is not None and json_sha256(stats) != m[STATS_FILE]:
        raise FormatError(f"differs from what was written (sha256 in {MANIFEST_FILE}): edited after quantization, "
                          "its figures are not the measured ones", file=STATS_FILE)
    for name in sorted(set(shards) | set(m["shards"])):
        if name not in m["shards"] or name not in shards:
            raise FormatError(f"{MANIFEST_FILE} lists shards {sorted(m['shards'])}, the checkpoint reads "
                              f"{sorted(shards)}", file=name if name in shards else MANIFEST_FILE)
        if shards[name].header_sha256 != m["shards"][name]:
            raise FormatError(f"the header (tensor names, dtypes, shapes, offsets, checksums) differs from the one "
                              f"written (sha256 in {MANIFEST_FILE}): edited", file=name)
    for name, digest in sorted(m["files"].items()):
        try:
            ok = d.sha256(name) == digest
        except FileNotFoundError:
            raise FormatError(f"seals {name}, which the checkpoint does not hold (removed or renamed)",
                              file=MANIFEST_FILE) from None
        if not ok:
            raise FormatError(f"differs from what was written (sha256 in {MANIFEST_FILE}): edited after quantization",
                              file=name)
    loose = unsealed_entries(d, m)
    added = [n for n in loose if not (n.endswith("/") or n in IGNORED)]
    if added:
        raise FormatError(f"not sealed in {MANIFEST_FILE}: added after the checkpoint was written (a loader may read "
                          "it); remove it, or pass --no-verify to read the checkpoint unchecked", file=added[0])
    return loose


def check_digest(manifest: dict, expect_digest: str | None) -> None:
    """Refuse a manifest that is not the one pinned by ``expect_digest`` (None: nothing pinned)."""
    if expect_digest is None:
        return
    want, got = normalize_digest(expect_digest), manifest_digest(manifest)
    if got != want:
        raise FormatError(f"the checkpoint's digest is {got}, not the pinned {want}: it is not the checkpoint you "
                          "pinned (edited and sealed again, or another one)", file=MANIFEST_FILE)


def sealed_names(manifest: dict) -> set[str]:
    """Every file name the manifest seals, itself included."""
    return {CONFIG_FILE, MANIFEST_FILE, *([STATS_FILE] if manifest.get(STATS_FILE) else []),
            *manifest.get("shards", {}), *manifest.get("files", {})}


def unsealed_entries(where: "str | os.PathLike | OpenedDir", manifest: dict) -> list[str]:
    """The entries of directory ``where`` the manifest does not seal, by name (a directory's with a ``/``)."""
    sealed = sealed_names(manifest)
    return sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "")
                  for e in opened(where, hold_all=False).entries() if e.name not in sealed)


def no_verify_requested() -> bool:
    """Whether ``LATQ_NO_VERIFY`` asks the vLLM loader to skip the sha256 checks (a flag: 1/true, 0/false)."""
    return env.flag(NO_VERIFY_ENV)


def expected_digest_from_env() -> str | None:
    """The digest ``LATQ_EXPECT_DIGEST`` pins for the vLLM loader, or None; set but empty is refused."""
    v = os.environ.get(DIGEST_ENV)
    if v is None:
        return None
    try:
        return normalize_digest(v)
    except ValueError:
        raise env.EnvError(DIGEST_ENV, v, "sha256: and 64 hex digits, as latq-quantize prints, or unset") from None
