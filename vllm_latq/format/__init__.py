"""The latq checkpoint format (versions 1 and 2): one package shared by the writer (the offline
pipeline), the readers (``latq-eval``, ``latq-inspect``) and the vLLM loader.
``docs/FORMAT.md`` is the prose version.

Per layer (exported here, ``from vllm_latq import format as fmt; fmt.pack(...)``):

    errors.py            FormatError, the one exception of every reader and validator
    packing.py           bit-packing of b-bit integers (pack, unpack, packed_words)
    csr.py               the outlier CSR helpers (csr_rows, csr_from_mask)
    huffman.py           the canonical Huffman codec of the huffman kind
    layer.py             one layer's tensors: encode, decode, dequantize, validate, size
    scale_codes.py       second-level scales: group scales as 4-bit codes on 16-row grids
    rotation.py          the input rotation of a rotated checkpoint: seeded random-sign block Hadamard
    spec.py              config.json's quantization_config: QuantSpec, parse, budget

Per directory (import the module, e.g. ``from vllm_latq.format import checkpoint``):

    files.py             the directory's file names
    safetensors_file.py  strict safetensors reader / deterministic writer with checksums
    writer.py            shard names, index, JSON and copied tokenizer files
    checkpoint.py        Checkpoint (reading) and load_dequantized_model
    validate.py          validate_checkpoint and its report (``latq-inspect`` is vllm_latq/inspect.py)

Nothing here imports ``vllm_latq.quantize``, ``vllm_latq.kernels`` or vLLM.
"""
from . import rotation, scale_codes
from .csr import csr_from_mask, csr_rows
from ..errors import FormatError
from .layer import (ALL_TENSORS, DENSE_TENSORS, HUFFMAN_TENSORS, LAYER_TENSORS, col_dtype, decode_integers,
                    dense_scales, dense_tensors, dequantize, dequantize_layer, has_coded_scales, encode_layer, expected_shapes, huffman_stream, layer_bits, layer_stats,
                    split_name, tensor_dtype, validate_layer)
from .packing import PACK_CHUNK_ELEMS, PACK_TILE, pack, packed_words, unpack, unpack_at
from .rotation import Rotation
from .spec import (BUDGET_SLACK, COLUMN_SCALE_FOLDS, DENSE_METHODS, FORMAT_VERSION, FORMAT_VERSIONS, HUFFMAN_METHODS,
                   METHODS, ORDERS, QUANT_METHOD, QuantSpec, check_budget, kind_of, parse_quantization_config,
                   quantization_config)

__all__ = [
    "ALL_TENSORS", "BUDGET_SLACK", "COLUMN_SCALE_FOLDS", "DENSE_METHODS", "DENSE_TENSORS", "FORMAT_VERSION", "FORMAT_VERSIONS", "FormatError", "HUFFMAN_METHODS",
    "HUFFMAN_TENSORS", "LAYER_TENSORS", "METHODS", "ORDERS", "PACK_CHUNK_ELEMS", "PACK_TILE", "QUANT_METHOD",
    "QuantSpec", "Rotation", "check_budget", "col_dtype", "csr_from_mask", "csr_rows", "decode_integers", "dense_scales", "dense_tensors", "dequantize",
    "dequantize_layer", "encode_layer", "expected_shapes", "tensor_dtype", "huffman_stream", "has_coded_scales", "kind_of", "layer_bits",
    "layer_stats", "pack", "packed_words", "parse_quantization_config", "quantization_config", "rotation", "scale_codes", "split_name",
    "unpack", "unpack_at", "validate_layer",
]
