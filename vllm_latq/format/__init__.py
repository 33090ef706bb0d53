"""The latq checkpoint format (versions 1–3: 2 marks a rotated checkpoint, 3 the codebook kind): one
definition for the writer, the readers and the vLLM loader. Per-layer helpers are exported here
(``fmt.pack``); docs/FORMAT.md lists every module."""
from . import codebook, rotation, scale_codes
from .csr import csr_from_mask, csr_rows
from ..errors import FormatError
from .layer import (ALL_TENSORS, DENSE_TENSORS, HUFFMAN_TENSORS, LAYER_TENSORS, col_dtype, decode_integers,
                    dense_scales, dense_tensors, layer_tensors, dequantize, dequantize_layer, has_coded_scales, encode_layer, expected_shapes, huffman_stream, layer_bits, layer_stats,
                    split_name, tensor_dtype, validate_layer)
from .packing import PACK_CHUNK_ELEMS, PACK_TILE, pack, packed_words, unpack, unpack_at
from .rotation import Rotation
from .spec import (BUDGET_SLACK, COLUMN_SCALE_FOLDS, DENSE_METHODS, FORMAT_VERSION, FORMAT_VERSIONS, HUFFMAN_METHODS,
                   METHODS, ORDERS, QUANT_METHOD, QuantSpec, check_budget, kind_of, parse_quantization_config,
                   quantization_config)

__all__ = [
    "ALL_TENSORS", "BUDGET_SLACK", "COLUMN_SCALE_FOLDS", "DENSE_METHODS", "DENSE_TENSORS", "FORMAT_VERSION", "FORMAT_VERSIONS", "FormatError", "HUFFMAN_METHODS",
    "HUFFMAN_TENSORS", "LAYER_TENSORS", "METHODS", "ORDERS", "PACK_CHUNK_ELEMS", "PACK_TILE", "QUANT_METHOD",
    "QuantSpec", "Rotation", "check_budget", "col_dtype", "csr_from_mask", "csr_rows", "decode_integers", "dense_scales", "dense_tensors", "layer_tensors", "dequantize",
    "dequantize_layer", "encode_layer", "expected_shapes", "tensor_dtype", "huffman_stream", "has_coded_scales", "kind_of", "layer_bits",
    "layer_stats", "pack", "packed_words", "parse_quantization_config", "quantization_config", "rotation", "scale_codes", "split_name",
    "unpack", "unpack_at", "validate_layer",
]
