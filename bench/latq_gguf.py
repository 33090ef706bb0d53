"""A latq checkpoint as a GGUF llama.cpp runs: the same weights, value for value, in llama.cpp's
nearest block formats, so ``bench/decode.py --peer llamacpp`` can time llama.cpp on latq's own
precision beside the GGUF the reference model ships as.

latq's dense integers are signed b-bit ``z`` times an fp16 group scale. llama.cpp's ``Q4_0``
block is 32 weights ``d·(q − 8)`` with ``q`` in 0..15 and one fp16 ``d``; ``Q8_0`` is ``d·q`` with
``q`` an int8. So a layer of at most 4 bits is exactly ``Q4_0`` (``q = z + 8``) and one of 5 to 8
bits exactly ``Q8_0``, each 32-column block taking the scale of the latq group it lies in (a
group of 64 gives two blocks the same scale): 4.5 and 8.5 bits per weight where latq's kernels
stream 4.25 and 8.5 (two nibble planes) at group 64. Outliers, Huffman layers and groups that are
not whole blocks have no such form and are refused. The embedding (bf16 for the lookup, or the
tied head) and the norms are copied as the checkpoint holds them; the metadata (vocabulary,
hyper-parameters) comes from the reference GGUF of the same model. llama.cpp's converter orders
q/k rows for its rotary kernel (``permute`` below); written for the ``llama`` architecture.

    python -m bench.latq_gguf CKPT REFERENCE.gguf OUT.gguf
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

BLOCK = 32   # weights per Q4_0 / Q8_0 block


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection (``heads`` of them) in llama.cpp's order: each head's two
    rotary halves interleaved, as its HF converter writes them (any row-wise tensor: integers,
    scales)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def block_scales(scales: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """fp16 ``[out, in/32]``: each 32-column block's scale, the scale of the latq group holding it."""
    if in_features % BLOCK or group_size % BLOCK:
        raise ValueError(f"{in_features} columns in groups of {group_size}: llama.cpp's blocks need both to be "
                         f"multiples of {BLOCK}")
    idx = torch.arange(in_features // BLOCK) * BLOCK // group_size
    return scales.half()[:, idx]


def q4_0_bytes(z: torch.Tensor, d: torch.Tensor) -> np.ndarray:
    """Signed integers ``z`` (−8..7) ``[out, in]`` and block scales ``d`` → Q4_0 rows, uint8 ``[out, in/32·18]``:
    per block the fp16 scale, then 16 bytes whose low nibbles hold weights 0–15 and high ones 16–31."""
    if int(z.min()) < -8 or int(z.max()) > 7:
        raise ValueError("Q4_0 holds integers in -8..7")
    n, k = z.shape
    q = (z + 8).to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    qs = q[:, :, 0] | (q[:, :, 1] << 4)                                     # [n, blocks, 16]
    dd = d.contiguous().view(torch.uint8).reshape(n, k // BLOCK, 2)
    return torch.cat([dd, qs], -1).reshape(n, -1).numpy()


def q8_0_bytes(z: torch.Tensor, d: torch.Tensor) -> np.ndarray:
    """Signed integers ``z`` (−128..127) and block scales → Q8_0 rows, uint8 ``[out, in/32·34]``."""
    if int(z.min()) < -128 or int(z.max()) > 127:
        raise ValueError("Q8_0 holds integers in -128..127")
    n, k = z.shape
    qs = z.to(torch.int8).view(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    dd = d.contiguous().view(torch.uint8).reshape(n, k // BLOCK, 2)
    return torch.cat([dd, qs], -1).reshape(n, -1).numpy()


def layer_blocks(t: dict, bits: int, group_size: int, shape: tuple[int, int], heads: int | None = None):
    """One dense latq layer's tensors → (uint8 rows, GGML type): Q4_0 up to 4 bits, Q8_0 up to 8;
    ``heads``: a q/k projection, its rows in llama.cpp's order."""
    import gguf

    from vllm_latq import format as fmt
    n, k = shape
    if int(t["outlier_crow"][-1]) or bits > 8:
        raise ValueError("a layer with outliers (or over 8 bits) has no llama.cpp block form")
    z = fmt.unpack(t["qweight"], bits, k)
    d = block_scales(fmt.dense_scales(t, n), group_size, k)
    if heads:
        z, d = permute_rows(z, heads), permute_rows(d, heads)
    if bits <= 4:
        return q4_0_bytes(z, d), gguf.GGMLQuantizationType.Q4_0
    return q8_0_bytes(z, d), gguf.GGMLQuantizationType.Q8_0


def _plain(x: torch.Tensor):
    """A tensor kept as the checkpoint holds it: a bf16 matrix (the embedding) as BF16, norms as
    F32 (llama.cpp's norms are F32); both exact."""
    import gguf
    if x.dtype == torch.bfloat16 and x.dim() == 2:
        return x.contiguous().view(torch.uint8).numpy(), gguf.GGMLQuantizationType.BF16
    return x.float().numpy(), gguf.GGMLQuantizationType.F32


def write_gguf(ckpt: str | Path, reference: str | Path, out: str | Path) -> Path:
    """Write ``out``: the latq checkpoint ``ckpt`` as llama.cpp blocks, with the metadata of the
    reference GGUF ``reference`` (the same model's). Returns ``out``."""
    import gguf

    from vllm_latq.format.checkpoint import Checkpoint, linear_shape

    ck = Checkpoint(ckpt)
    if ck.spec.kind != "dense":
        raise ValueError(f"{ckpt}: a {ck.spec.method} checkpoint has no llama.cpp block form (dense methods only)")
    ref = gguf.GGUFReader(str(reference))
    arch = bytes(ref.fields["general.architecture"].parts[-1]).decode()
    if arch != "llama":
        raise ValueError(f"{reference}: architecture {arch!r}; the latq GGUF is written for llama only")
    cfg = ck.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg.get("num_key_value_heads")
             or cfg["num_attention_heads"]}
    model = ck.empty_model()
    ck_names = ck.checkpoint_names(model)
    tensors = {}
    for module in ck.layers():
        shape = linear_shape(model, module, ck.layer_file(module), ck_names)
        tensors[names.get_name(module)] = layer_blocks(ck.layer_tensors(module), ck.spec.bits_of(module),
                                                       ck.spec.group_size, shape, heads.get(module.split(".")[-1]))
    for name in ck.plain_names():
        base = name.removesuffix(".weight")
        gname = names.get_name(base)
        if gname is None or not name.endswith(".weight"):
            raise ValueError(f"{ckpt}: no llama.cpp tensor for {name}")
        tensors[gname] = _plain(ck.tensor(name))
    w = gguf.GGUFWriter(str(out), arch)
    copy_fields(ref, w)
    for gname, (data, qtype) in tensors.items():
        w.add_tensor(f"{gname}.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("reference", help="the GGUF the same model ships as (its metadata and vocabulary)")
    ap.add_argument("out")
    a = ap.parse_args(argv)
    try:
        write_gguf(a.checkpoint, a.reference, a.out)
    except ValueError as e:
        print(f"latq_gguf: {e}", file=sys.stderr)
        return 2
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def copy_fields(ref, w, replace: dict | None = None) -> None:
    """The metadata of GGUFReader ``ref`` into GGUFWriter ``w`` (its architecture and the file's own
    ``GGUF.*`` fields aside, which the writer sets), ``replace``'s values for the keys it names."""
    import gguf
    for field in ref.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = (replace or {}).get(field.name, None)
        w.add_key_value(field.name, field.contents() if value is None else value, vtype, sub_type=sub)
