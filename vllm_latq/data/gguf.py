"""Converting a GGUF causal LM into a plain Hugging Face directory (bf16 safetensors +
tokenizer), atomically, and recognising a finished conversion."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import uuid
from pathlib import Path

import torch

# Bumped when the conversion changes, so stale cached directories are rebuilt.
CONVERTER_VERSION = 1
SOURCE_INFO = "latq_source.json"


@contextlib.contextmanager
def hf_progress_bars(enabled: bool = True):
    """transformers' progress bars on or off within the block (off also silences its GGUF tqdm bar)."""
    if enabled:
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
) -> Path:
    """Convert a GGUF causal LM into a plain HF directory (``dtype`` safetensors + tokenizer), atomically.
    ``add_bos_token=None``: True for Gemma models (they need BOS), else the GGUF default."""
    with hf_progress_bars(progress):
        return _convert(Path(gguf_file).resolve(), Path(out_dir), dtype, add_bos_token)


def _convert(gguf_file: Path, out_dir: Path, dtype: torch.dtype, add_bos_token: bool | None) -> Path:
    """:func:`convert_gguf` without the progress switch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_gguf(gguf_file)
    src, name = gguf_file.parent, gguf_file.name
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
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, **tok_kwargs)

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
        (tmp / SOURCE_INFO).write_text(json.dumps(info, indent=2) + "\n")
        if out_dir.exists():  # an incomplete or stale directory: replace it
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def conversion_complete(d: Path) -> bool:
    """True if ``d`` holds a finished conversion by the current converter."""
    try:
        info = json.loads((d / SOURCE_INFO).read_text())
    except (OSError, ValueError):
        return False
    has_tokenizer = (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file()
    return (
        info.get("converter_version") == CONVERTER_VERSION
        and (d / "config.json").is_file()
        and any(d.glob("*.safetensors"))
        and has_tokenizer
    )
