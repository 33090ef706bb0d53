"""``latq_manifest.json``: the checksums that make a checkpoint's JSON files as trustworthy as its
tensors. Each shard's ``latq_sha256`` table covers its tensors' bytes; the manifest covers what
gives them meaning — ``config.json`` (its ``quantization_config`` and the model's own fields,
apart), ``latq_stats.json`` and each shard's header (dtypes, shapes, offsets and those tables).

The JSON files are hashed by value (canonical JSON: sorted keys, no whitespace), so reformatting
one is not an edit, while any changed value is. The writer records it last
(:func:`write_manifest`); :func:`verify_manifest` is the validator's last check (the validator is
what inspect, eval, export and the vLLM plugin run). A checkpoint without one (unfinished, or
stripped) is refused: re-quantize it, or read it unchecked with ``--no-verify``
(``LATQ_NO_VERIFY=1`` for vLLM)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import FormatError
from ..hf_model import config_dict
from .files import CONFIG_FILE, MANIFEST_FILE, STATS_FILE
from .safetensors_file import SafetensorsFile
from .writer import write_json

NO_VERIFY_ENV = "LATQ_NO_VERIFY"
SKIPPED = (f"the sha256 checks of the tensors (latq_sha256), the shard headers, {CONFIG_FILE} and {STATS_FILE} "
           f"({MANIFEST_FILE}) are skipped: an edited checkpoint is read as it is")
_PARTS = {"quantization_config": "its quantization_config differs",
          "model": "the model's fields (everything but quantization_config) differ"}


def json_sha256(obj) -> str:
    """sha256 of ``obj`` as canonical JSON: a value's digest, whatever the file's layout."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_digests(cfg: dict) -> dict[str, str]:
    """The digests of ``config.json``: its quantization_config and the rest, apart (so a refusal
    says which was edited)."""
    return {"quantization_config": json_sha256(cfg.get("quantization_config")),
            "model": json_sha256({k: v for k, v in cfg.items() if k != "quantization_config"})}


def _stats(path: Path):
    """``latq_stats.json``'s value, or None where the checkpoint has none."""
    f = path / STATS_FILE
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"not valid JSON ({e})", file=STATS_FILE) from None


def write_manifest(path: str | os.PathLike, shards: list[str] | None = None) -> None:
    """Record the manifest of the checkpoint directory ``path`` (written last: it covers the
    other files as they are now). ``shards``: the shard files, by default every ``*.safetensors``."""
    path = Path(path)
    names = sorted(shards if shards is not None else (p.name for p in path.glob("*.safetensors")))
    stats = _stats(path)
    write_json(path / MANIFEST_FILE, {
        CONFIG_FILE: config_digests(config_dict(path)),
        STATS_FILE: None if stats is None else json_sha256(stats),
        "shards": {n: SafetensorsFile(path / n).header_sha256 for n in names}})


def read_manifest(path: Path) -> dict:
    """The manifest of ``path``, its form checked; refused, saying what to do, where it is missing."""
    f = path / MANIFEST_FILE
    try:
        m = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FormatError(f"missing: no checksums of {CONFIG_FILE}, {STATS_FILE} and the shard headers (the "
                          "checkpoint was written by a latq older than them, or the file was removed): re-quantize "
                          f"it, or pass --no-verify ({NO_VERIFY_ENV}=1 for vLLM) to read it unchecked",
                          file=MANIFEST_FILE) from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"not valid JSON ({e})", file=MANIFEST_FILE) from None
    ok = (isinstance(m, dict) and isinstance(m.get(CONFIG_FILE), dict)
          and all(isinstance(m[CONFIG_FILE].get(k), str) for k in _PARTS)
          and (m.get(STATS_FILE) is None or isinstance(m.get(STATS_FILE), str))
          and isinstance(m.get("shards"), dict) and all(isinstance(v, str) for v in m["shards"].values()))
    if not ok:
        raise FormatError(f'must hold "{CONFIG_FILE}": {{{", ".join(_PARTS)}}}, "{STATS_FILE}" and "shards" '
                          "digests", file=MANIFEST_FILE)
    return m


def verify_manifest(path: str | os.PathLike, config: dict, shards: dict[str, SafetensorsFile]) -> None:
    """Raise :class:`FormatError` naming the file unless ``config`` (``config.json`` as read), the
    stats file and the headers of ``shards`` (every shard the reader reads) are the ones written."""
    path = Path(path)
    m = read_manifest(path)
    got = config_digests(config)
    for part, what in _PARTS.items():
        if got[part] != m[CONFIG_FILE][part]:
            raise FormatError(f"{what} from what was written (sha256 in {MANIFEST_FILE}): edited after "
                              "quantization (--no-verify reads it unchecked)", file=CONFIG_FILE)
    stats = _stats(path)
    if (stats is None) != (m[STATS_FILE] is None):
        raise FormatError("missing, but recorded in " + MANIFEST_FILE if stats is None else
                          f"not written with this checkpoint ({MANIFEST_FILE} records none)", file=STATS_FILE)
    if stats is not None and json_sha256(stats) != m[STATS_FILE]:
        raise FormatError(f"differs from what was written (sha256 in {MANIFEST_FILE}): edited after quantization, "
                          "its figures are not the measured ones", file=STATS_FILE)
    for name in sorted(set(shards) | set(m["shards"])):
        if name not in m["shards"] or name not in shards:
            raise FormatError(f"{MANIFEST_FILE} lists shards {sorted(m['shards'])}, the checkpoint reads "
                              f"{sorted(shards)}", file=name)
        if shards[name].header_sha256 != m["shards"][name]:
            raise FormatError(f"the header (tensor names, dtypes, shapes, offsets, checksums) differs from the one "
                              f"written (sha256 in {MANIFEST_FILE}): edited", file=name)


def no_verify_requested() -> bool:
    return os.environ.get(NO_VERIFY_ENV, "") not in ("", "0")
