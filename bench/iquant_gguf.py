"""llama.cpp's own quantizer, reached through the ``xllamacpp`` wheel (the ``bench`` extra), and the
i-quant GGUFs ``bench/iquant_peer.py`` makes with it.

No llama.cpp build: ``xllamacpp/xllamacpp.abi3.so`` exports ggml's C quantization API, called here
with ctypes (prototypes as in llama.cpp's ``ggml/include/ggml.h``)::

    void   ggml_quantize_init(enum ggml_type type);
    bool   ggml_quantize_requires_imatrix(enum ggml_type type);
    size_t ggml_row_size(enum ggml_type type, int64_t ne);
    size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start,
                               int64_t nrows, int64_t n_per_row, const float * imatrix);

and ggml-quants' ``dequantize_row_<type>(const block * x, float * y, int64_t k)``. Type ids are
taken from the installed ``gguf`` package's ``GGMLQuantizationType`` (IQ2_XS 17, IQ3_XXS 18,
IQ3_S 21, IQ4_NL 20, Q8_0 8), which the ggml enum matches.

The i-quants pack 256 weights a block (``QK_K``): a row whose length is not a multiple of 256 has
no such form. ``llama-quantize`` then writes that tensor in a fallback type — IQ4_NL (32-weight
blocks, 4.5 bits/weight) for every IQ2/IQ3 type (``llama-quant.cpp``, ``convert_incompatible_tensor``)
— and :func:`write_iquant_gguf` does the same. SmolLM2-135M's hidden size is 576 = 2·256 + 64, so
six of each block's seven linears (all but ``ffn_down``, 1536 columns) fall back: the file
llama.cpp makes of this model is mostly IQ4_NL. :func:`pad_quantize` is the emulation of the
i-quant on such rows (zero-padded to 768 columns, quantized, cut back) for a perplexity of the
type itself; no file llama.cpp loads holds it.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from bench.latq_gguf import copy_fields

QK_K = 256
FALLBACK = "IQ4_NL"    # llama-quantize's type for an IQ2/IQ3 tensor whose rows are not whole 256-blocks
# llama.cpp's tensor names of a decoder block's linears (GGUF names, ``blk.N.<name>.weight``)
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# llama_ftype of a file "mostly" in a type (llama.h): general.file_type
FILE_TYPES = {"IQ2_XS": "MOSTLY_IQ2_XS", "IQ3_XXS": "MOSTLY_IQ3_XXS", "IQ3_S": "MOSTLY_IQ3_S",
              "IQ4_NL": "MOSTLY_IQ4_NL", "Q8_0": "MOSTLY_Q8_0"}


def qtype(name: str) -> int:
    """The ggml type id of ``name`` (``IQ3_S`` …), from gguf's enum."""
    import gguf
    return int(gguf.GGMLQuantizationType[name])


def library_path() -> Path:
    """``xllamacpp.abi3.so``, the llama.cpp the wheel ships (raises ImportError without the wheel)."""
    import xllamacpp
    return Path(xllamacpp.__file__).with_name("xllamacpp.abi3.so")


class GGML:
    """ggml's quantization functions from the xllamacpp wheel."""

    def __init__(self):
        import xllamacpp  # noqa: F401 - loaded first: the .so resolves its Python symbols in this process
        lib = ctypes.CDLL(str(library_path()))
        lib.ggml_quantize_init.argtypes, lib.ggml_quantize_init.restype = [ctypes.c_int], None
        lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        lib.ggml_row_size.argtypes, lib.ggml_row_size.restype = [ctypes.c_int, ctypes.c_int64], ctypes.c_size_t
        lib.ggml_blck_size.argtypes, lib.ggml_blck_size.restype = [ctypes.c_int], ctypes.c_int64
        lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                            ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        self.lib = lib

    def row_size(self, name: str, n: int) -> int:
        """Bytes of one row of ``n`` weights in type ``name`` (``ggml_row_size``)."""
        return int(self.lib.ggml_row_size(qtype(name), n))

    def block_size(self, name: str) -> int:
        return int(self.lib.ggml_blck_size(qtype(name)))

    def requires_imatrix(self, name: str) -> bool:
        return bool(self.lib.ggml_quantize_requires_imatrix(qtype(name)))

    def bits(self, name: str) -> float:
        """Bits per weight of the type: one block's bytes × 8 / its weights."""
        b = self.block_size(name)
        return self.row_size(name, b) * 8 / b

    def quantize(self, name: str, w: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """Rows ``w`` [n, k] quantized to ``name`` by llama.cpp → uint8 [n, ggml_row_size(k)].
        ``imatrix`` [k]: the importance of each column (mean x² over calibration tokens)."""
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.ndim != 2:
            raise ValueError(f"rows to quantize must be a matrix, got shape {w.shape}")
        n, k = w.shape
        t, blk = qtype(name), self.block_size(name)
        if k % blk:   # ggml asserts (aborts the process) on a row that is not whole blocks
            raise ValueError(f"{name} packs {blk} weights a block: a row of {k} is not whole blocks")
        if imatrix is not None:
            imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
            if imatrix.shape != (k,):
                raise ValueError(f"imatrix of shape {imatrix.shape} for rows of {k}")
        elif self.requires_imatrix(name):
            raise ValueError(f"llama.cpp's {name} needs an importance matrix")
        self.lib.ggml_quantize_init(t)
        row = self.row_size(name, k)
        out = np.empty((n, row), dtype=np.uint8)
        done = self.lib.ggml_quantize_chunk(t, w.ctypes.data, out.ctypes.data, 0, n, k,
                                            None if imatrix is None else imatrix.ctypes.data)
        if done != n * row:
            raise RuntimeError(f"ggml_quantize_chunk wrote {done} bytes for {n} rows of {row}")
        return out

    def dequantize(self, name: str, data: np.ndarray, k: int) -> np.ndarray:
        """llama.cpp's own ``dequantize_row_<type>`` of rows ``data`` [n, row bytes] → float32 [n, k]."""
        fn = getattr(self.lib, f"dequantize_row_{name.lower()}")
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
        data = np.ascontiguousarray(data, dtype=np.uint8)
        out = np.empty((data.shape[0], k), dtype=np.float32)
        fn(data.ctypes.data, out.ctypes.data, data.shape[0] * k)
        return out


def pad_quantize(ggml: GGML, name: str, w: np.ndarray, imatrix: np.ndarray | None) -> np.ndarray:
    """The type itself on rows that are not whole blocks, emulated: columns zero-padded to the next
    block (an all-zero sub-block gets scale 0), quantized, dequantized, cut back → float32 [n, k].
    For perplexity only: the padded rows are no tensor llama.cpp loads."""
    n, k = w.shape
    blk = ggml.block_size(name)
    kp = -(-k // blk) * blk
    wp = np.zeros((n, kp), np.float32)
    wp[:, :k] = w
    ip = None
    if imatrix is not None:
        ip = np.ones(kp, np.float32)
        ip[:k] = imatrix
    return dequantize(name, ggml.quantize(name, wp, ip), kp)[:, :k]


def dequantize(name: str, data: np.ndarray, k: int) -> np.ndarray:
    """gguf's numpy dequantization of rows in type ``name`` → float32 [n, k] (what transformers' GGUF
    loader reads)."""
    import gguf
    return gguf.quants.dequantize(np.asarray(data), gguf.GGMLQuantizationType[name]).reshape(-1, k)


def layer_type(ggml: GGML, name: str, columns: int) -> str:
    """The type llama-quantize writes a linear of ``columns`` inputs in when asked for ``name``:
    ``name``, or its fallback where the rows are not whole blocks of it (then, as llama.cpp does,
    F16 if not even the fallback's blocks fit)."""
    if columns % ggml.block_size(name) == 0:
        return name
    if columns % ggml.block_size(FALLBACK) == 0:
        return FALLBACK
    return "F16"


def is_linear(tensor_name: str) -> bool:
    """A decoder block's linear (``blk.N.attn_q.weight`` …)."""
    parts = tensor_name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEARS and parts[3] == "weight"


def write_iquant_gguf(source: str | Path, out: str | Path, name: str, weights: dict[str, np.ndarray],
                      imatrix: dict[str, np.ndarray] | None, ggml: GGML | None = None) -> dict:
    """Write ``out``: the GGUF ``source`` with each decoder-block linear replaced by ``weights[tensor]``
    (float32 [rows, columns], llama.cpp's row order) quantized by llama.cpp to ``name`` with
    ``imatrix[tensor]`` (its fallback where the rows are not whole blocks: :func:`layer_type`); every
    other tensor (embedding, norms) copied as the source stores it, metadata copied with
    ``general.file_type`` set to the type's. Returns ``{tensor: (type, uint8 rows)}`` of the linears."""
    import gguf

    ggml = ggml or GGML()
    ref = gguf.GGUFReader(str(source))
    arch = bytes(ref.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(str(out), arch)
    copy_fields(ref, w, {gguf.Keys.General.FILE_TYPE: int(gguf.LlamaFileType[FILE_TYPES[name]])})
    linears = {}
    for t in ref.tensors:
        if is_linear(t.name):
            x = weights[t.name]
            kind = layer_type(ggml, name, x.shape[1])
            if kind == "F16":
                data = x.astype(np.float16)
            else:
                data = ggml.quantize(kind, x, None if imatrix is None else imatrix[t.name])
            linears[t.name] = (kind, data)
            w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
        else:   # as stored: the raw blocks of a quantized tensor, the values of a float one
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return linears
