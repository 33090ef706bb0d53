"""Reference models, reference text and the evaluation protocol, all offline (see shared/data.md)."""
from .gguf import cached_conversion, convert_gguf, hf_progress_bars
from .models import MODELS, ModelSpec, model_dir
from .paths import cache_dir
from .perplexity import perplexity
from .text import (Documents, calibration_batches, check_vocabulary, eval_windows, load_tokenizer, read_documents,
                   source_record, text_file, wiki_articles, wiki_split)

__all__ = [
    "Documents",
    "MODELS",
    "ModelSpec",
    "cache_dir",
    "cached_conversion",
    "calibration_batches",
    "check_vocabulary",
    "convert_gguf",
    "eval_windows",
    "hf_progress_bars",
    "load_tokenizer",
    "model_dir",
    "perplexity",
    "read_documents",
    "source_record",
    "text_file",
    "wiki_articles",
    "wiki_split",
]
