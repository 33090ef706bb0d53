"""Converting a GGUF causal LM into a plain Hugging Face directory (bf16 safetensors +
tokenizer), atomically, and the cache of conversions, keyed by the GGUF's sha256."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

import torch

from .. import progress as _progress
from ..bounded_io import file_sha256
from ..errors import in_units

# Bumped when the conversion changes, so stale cached directories are rebuilt.
CONVERTER_VERSION = 1
SOURCE_INFO = "latq_source.json"
KEY_HEX = 16   # hex digits of the GGUF's sha256 in a cached conversion's name


@contextlib.contextmanager
def hf_progress_bars(enabled: bool = True):
    """transformers' progress bars on within the block where ``enabled`` on a terminal, else off (its GGUF bar too)."""
    if enabled and _progress.terminal():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    bar = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_on:
            hf_logging.enable_progress_bar()


def _check_gguf(path: Path) -> None:
    """Fail early, naming the file, when it is missing or is not GGUF (magic b'GGUF')."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"not a GGUF file (magic {magic!r}, expected b'GGUF'): {path}")


def convert_gguf(
    gguf_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    add_bos_token: bool | None = None,
    progress: bool = True,
    sha256: str | None = None,
) -> Path:
    """Convert a GGUF causal LM into a plain HF directory (``dtype`` safetensors + tokenizer), atomically.
    ``add_bos_token=None``: True for Gemma models, else the GGUF default; ``sha256``: the GGUF's, recorded."""
    with hf_progress_bars(progress):
        return _convert(Path(gguf_file).resolve(), Path(out_dir), dtype, add_bos_token, sha256,
                        _progress.say if progress else _quiet)


def _quiet(line: str) -> None:
    pass


def cached_conversion(gguf_file: Path, root: Path, name: str, add_bos_token: bool | None = None,
                      progress: bool = True) -> Path:
    """The bf16 conversion of ``gguf_file``, cached as ``root/NAME-<sha256 of its bytes>`` (made under a lock)."""
    from filelock import FileLock  # dependency of transformers/huggingface_hub

    _check_gguf(gguf_file)
    digest = file_sha256(gguf_file)
    out = root / f"{name}-{digest[:KEY_HEX]}"
    if conversion_complete(out, digest):
        return out
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{out.name}.lock")):
        if conversion_complete(out, digest):  # another process finished it while we waited
            return out
        for stale in root.glob(f".{out.name}.*.tmp"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        if progress:   # said on stderr by every command, not only those that show the package's log
            _progress.say(f"converting {gguf_file} (sha256 {digest[:KEY_HEX]}…) to a Hugging Face directory in "
                          f"{out}, once")
        return convert_gguf(gguf_file, out, torch.bfloat16, add_bos_token, progress, sha256=digest)


def _convert(gguf_file: Path, out_dir: Path, dtype: torch.dtype, add_bos_token: bool | None,
             sha256: str | None = None, say: Callable[[str], None] = _quiet) -> Path:
    """:func:`convert_gguf`, each step ``say``-d first (transformers reads the GGUF's metadata without a bar)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_gguf(gguf_file)
    src, name = gguf_file.parent, gguf_file.name
    say(f"  reading {name} with transformers: its metadata ({in_units(gguf_file.stat().st_size)} file), "
        "then its tensors dequantized")
    try:
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    except Exception as e:
        raise ValueError(f"transformers could not load GGUF file {gguf_file}: {e}") from e

    config = loaded.config
    # The GGUF quantization_config would make save_pretrained/vLLM treat the dir as GGUF.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    model.to(dtype).eval()
    model.config.dtype = dtype
    if add_bos_token is None:
        add_bos_token = config.model_type.startswith("gemma")
    tok_kwargs = {"add_bos_token": True} if add_bos_token else {}
    say(f"  reading its tokenizer from {name}")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, **tok_kwargs)
    say(f"  writing {str(dtype).removeprefix('torch.')} safetensors and the tokenizer to {out_dir}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        info = {
            "gguf_file": name,
            "gguf_bytes": gguf_file.stat().st_size,
            "dtype": str(dtype).removeprefix("torch."),
            "add_bos_token": bool(add_bos_token),
            "converter_version": CONVERTER_VERSION,
        }
        if sha256 is not None:
            if file_sha256(gguf_file) != sha256:   # the conversion read other bytes than those keyed
                raise ValueError(f"{gguf_file} changed while it was converted: convert it again once it is complete")
            info["gguf_sha256"] = sha256
        (tmp / SOURCE_INFO).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():  # an incomplete or stale directory: replace it
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def conversion_complete(d: Path, sha256: str | None = None) -> bool:
    """True if ``d`` holds a finished conversion by the current converter (of the GGUF of this ``sha256``)."""
    try:
        info = json.loads((d / SOURCE_INFO).read_text())
    except (OSError, ValueError):
        return False
    has_tokenizer = (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file()
    return (
        info.get("converter_version") == CONVERTER_VERSION
        and (sha256 is None or info.get("gguf_sha256") == sha256)
        and (d / "config.json").is_file()
        and any(d.glob("*.safetensors"))
        and has_tokenizer
    )
