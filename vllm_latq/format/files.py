"""The files of a checkpoint directory, by name (docs/FORMAT.md, "Directory"): the writer,
the reader and the validator all refer to them through these constants.

    config.json                       the model's config + quantization_config (spec.py)
    model-00001-of-000NN.safetensors  one shard per decoder block, then one for the rest
    model.safetensors.index.json      {"metadata": {"total_size"}, "weight_map": {tensor: shard}}
    latq_stats.json                   per-layer bits, outlier rate, error, certificate
    tokenizer*, generation_config.json, ...   copied from the source model (AUX_PATTERNS)
"""
from __future__ import annotations

from ..hf_model import CONFIG_FILE

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
STATS_FILE = "latq_stats.json"
# Files copied verbatim from the source model (tokenizer, chat template, generation defaults).
AUX_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                "chat_template*", "generation_config.json")
