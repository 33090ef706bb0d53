"""The kernel bench's peers and figures without a GPU: torch's int4 kernel through its CPU twin
(the same integers, scales and zeros as the CUDA op takes), the CUDA packer's nibble order, GemLite's
inputs against its documented format, an absent peer named, the peers timed beside latq in one
layer's pipeline (Triton's interpreter, a fake timer), and docs/gpu/latest.json's schema."""
import json
import math
import sys
import types

import pytest
import torch

from bench import gpu_figures as gf, kernel_peers as kp, kernel_timing as kt, kernels as bk
from tests.helpers import FakeTimer

CPU = torch.device("cpu")


def test_torch_int4_computes_the_layers_inliers_on_the_cpu():
    w = kt.bench_weight(64, 512, 4, 0.0)
    ok, why = kp.TorchInt4.available(CPU, torch.bfloat16)
    assert ok, why
    st = kp.TorchInt4.prepare(w, CPU, torch.bfloat16)
    x = torch.randn(3, 512).to(torch.bfloat16)
    ref = x.float() @ kp.exact_weight(w, torch.bfloat16).T
    assert kt.rel_err(kp.TorchInt4.apply(st, x), ref) < 2 ** -7             # one bf16 rounding of y
    z = kp.unsigned_ints(w).float() - 8                                      # the peer's weight is latq's inliers
    assert torch.equal(z, __import__("vllm_latq").format.unpack(w.qweight, 4, 512).float())
    assert 8 * kp.TorchInt4.served_bytes(st) / (64 * 512) == 4.25           # 4 bits + bf16 scale and zero per 128


def test_cuda_packer_input_puts_the_even_column_high():
    u = torch.randint(0, 16, (16, 256), dtype=torch.uint8)
    b = kp.TorchInt4.pack_nibbles(u)
    assert b.shape == (16, 128) and b.dtype == torch.uint8
    assert torch.equal(b >> 4, u[:, ::2]) and torch.equal(b & 15, u[:, 1::2])


def test_peers_refuse_what_they_cannot_serve():
    assert kp.TorchInt4.available(torch.device("cuda"), torch.float16)[1].startswith("tinygemm computes bf16")
    ok, why = kp.GemLite.available(CPU, torch.bfloat16)
    assert not ok and "CUDA" in why
    with pytest.raises(ValueError, match="4-bit groups of 128"):
        kp.unsigned_ints(kt.bench_weight(32, 256, 3, 0.0))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 128"):
        kp.TorchInt4.prepare(kt.bench_weight(24, 256, 4, 0.0), CPU, torch.bfloat16)
    assert kp.parse_peers("gemlite, torch_int4,gemlite") == ["gemlite", "torch_int4"] and kp.parse_peers("none") == []
    with pytest.raises(ValueError, match="peers must be of torch_int4, gemlite"):
        kp.parse_peers("marlin")
    with pytest.raises(SystemExit):
        bk.parse_args(["--peers", "marlin"])


def test_gemlite_gets_hqq_form_whose_weight_is_the_layers(monkeypatch):
    """What the adapter packs, read by GemLite's documented format (W_q − zeros)·scales, is the
    peer's exact weight."""
    packed = {}

    class FakeLinear:
        def __init__(self, nbits, group_size, in_features, out_features, input_dtype, output_dtype):
            packed.update(nbits=nbits, group=group_size, shape=(out_features, in_features), dtypes=(input_dtype, output_dtype))

        def pack(self, W_q, scales, zeros, bias):
            packed.update(W_q=W_q, scales=scales, zeros=zeros, bias=bias)
            return self
    fake = types.SimpleNamespace(GemLiteLinear=FakeLinear, DType=types.SimpleNamespace(BF16="bf16", FP16="fp16"))
    monkeypatch.setitem(sys.modules, "gemlite", fake)
    w = kt.bench_weight(32, 256, 4, 0.0)
    kp.GemLite.prepare(w, CPU, torch.bfloat16)
    assert (packed["nbits"], packed["group"], packed["shape"], packed["dtypes"]) == (4, 128, (32, 256), ("bf16", "bf16"))
    assert packed["W_q"].dtype == torch.uint8 and packed["bias"] is None
    wq = packed["W_q"].float().reshape(32, 2, 128)
    got = ((wq - packed["zeros"].float()[..., None]) * packed["scales"].float()[..., None]).reshape(32, 256)
    assert torch.equal(got, kp.exact_weight(w, torch.bfloat16))


def test_peers_timed_beside_latq_in_one_layers_pipeline(monkeypatch, tmp_path):
    from vllm_latq.kernels.triton import kernel as tk
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    a = bk.parse_args(["--no-static", "--shapes", "32x256", "--bits", "4", "--rates", "0.01", "--m", "1,8",
                       "--breakdown", "none", "--json", str(tmp_path / "points.json")])
    log = []
    res = kt.sweep(a, CPU, "Fake GPU", 1, FakeTimer(), log.append, big=1 << 12)
    assert res["peers_absent"] == {"gemlite": "GemLite runs on CUDA devices only"}
    assert any(s.startswith("peers (4-bit g128, no outliers): torch_int4; gemlite absent: GemLite runs on CUDA")
               for s in log)
    p1, p8 = res["points"]
    assert set(p1.peers_us) == {"torch_int4"} and p1.peer_bits == {"torch_int4": 4.25}
    assert all(math.isfinite(p.peers_us["torch_int4"]) for p in (p1, p8))
    assert sum(s.startswith("  peers M=") for s in log) == 2 and "FAILED" not in "\n".join(log)
    doc = json.loads((tmp_path / "points.json").read_text())
    assert doc["device"] == "Fake GPU" and [pt["m"] for pt in doc["points"]] == [1, 8]
    assert doc["points"][0]["peers"] == {"torch_int4": round(p1.peers_us["torch_int4"], 2), "gemlite": None}
    lines, head = bk.gpu_summary(res)
    assert head["peers_absent"] == "gemlite" and head["latq_vs_bf16_m1"] == "na"        # 32x256: no 8b shape
    assert any(line.startswith("latq beside bf16 and the peers") for line in lines)


def _pt(shape, m, latq, dense, peer, bits=4):
    p = kt.Point(shape, 4096, 4096, bits, 0.01, m, "gemv", latq, dense, 1.0, 100, 10, {}, 0.0)
    p.peers_us = {"torch_int4": peer, "gemlite": math.nan}
    return p


def test_targets_and_headline_per_m():
    pts = [_pt(s, 1, 10.0, 25.0, 12.0) for s in gf.SHAPES] + [_pt("8b.o", 8, 10.0, 12.0, 9.0)]
    head = gf.headline_keys(pts, {})
    assert (head["latq_vs_bf16_m1"], head["latq_vs_peer_m1"]) == ("2.50", "1.20")
    assert (head["latq_vs_bf16_m8"], head["latq_vs_peer_m8"], head["latq_vs_bf16_m2"]) == ("1.20", "0.90", "na")
    lines = gf.target_lines(pts)
    assert "  M=1 every shape ≥ 1.0× peer: worst 1.20× (8b.down M=1) met" in lines
    assert "  M=1 8b.down/8b.gate_up ≥ 2.0× bf16: worst 2.50× (8b.down M=1) met" in lines
    assert "  M=8,16 every shape ≥ 1.3× bf16: worst 1.20× (8b.o M=8) NOT met" in lines
    assert "  M=32,64 every shape ≥ 1.0× bf16: NOT measured" in lines


def test_the_pipelined_ab_lines_and_headline():
    """The A/B summary: per M the worst 8b shape's table / pipelined time and bf16 / the fastest
    of the pick and its variants; at M ≥ 8 the ``mma`` entry is the pick itself, not a variant."""
    pts = []
    for s in gf.SHAPES:
        p = _pt(s, 1, 10.0, 30.0, 12.0)
        p.kernels_us = {"gemv": 10.0, "pipelined": 8.0 if s != "8b.o" else 12.5, "mma": 6.0, "mma_pipelined": math.nan}
        pts.append(p)
    big = _pt("8b.down", 16, 20.0, 24.0, 18.0)
    big.kernels_us = {"mma": 1.0, "pipelined": 16.0}
    lines, head = gf.variant_lines(pts + [big])
    assert (head["pipelined_vs_table_m1"], head["best_vs_bf16_m1"]) == ("0.80", "5.00")
    assert (head["pipelined_vs_table_m16"], head["best_vs_bf16_m16"]) == ("1.25", "1.50")
    assert head["pipelined_vs_table_m2"] == head["best_vs_bf16_m2"] == "na" and len(lines) == 2 + 5
    assert gf.variant_lines([_pt("8b.o", 1, 10.0, 30.0, 12.0)]) == ([], {})          # no A/B timed


def test_the_committed_record_is_the_schema():
    """docs/gpu/latest.json, the GPU figures of record, as ``gpu_figures check`` reads it."""
    from pathlib import Path
    doc = json.loads((Path(__file__).resolve().parents[2] / "docs" / "gpu" / "latest.json").read_text())
    assert not gf.check(doc) and doc["points"] and doc["e2e"] and doc["e8_points"]


def test_latest_json_schema(tmp_path):
    pts = [gf.point_record(_pt("8b.down", 1, 10.0, 25.0, 12.0))]
    e2e = [{"model": "llama3-8b-shapes", "form": "ssqr-1%-4b", "batch": 1, "tokens": 128, "latq_tok_s": 150.0,
            "bf16_tok_s": 80.0, "int4_tok_s": None}]
    e8 = [{"form": "e8-3b-s4-g16", "shape": "8b.down", "m": 1, "served_bits": 3.375, "e8_us": 39.5, "lds_us": 30.1, "mma_us": None,
           "int_us": 59.0, "bf16_us": 31.4, "e8_err": 0.0027}]
    (tmp_path / "p.json").write_text(json.dumps({"device": "X", "points": pts}))
    (tmp_path / "e.json").write_text(json.dumps({"e2e": e2e}))
    (tmp_path / "e8.json").write_text(json.dumps({"e8_points": e8}))
    out = tmp_path / "docs" / "latest.json"
    assert gf.main(["merge", "--points", str(tmp_path / "p.json"), "--e2e", str(tmp_path / "e.json"),
                    "--e8", str(tmp_path / "e8.json"), "--device", "NVIDIA H100", "--commit", "ab65128",
                    "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc) == list(gf.TOP_KEYS) and doc["points"] == pts and doc["e2e"] == e2e and not gf.check(doc)
    assert doc["e8_points"] == e8
    assert doc["points"][0]["peers"] == {"torch_int4": 12.0, "gemlite": None}
    assert gf.main(["check", str(out)]) == 0
    bad = dict(doc, commit="HEAD", points=[dict(pts[0], shape="8b.mlp")], e2e=[dict(e2e[0], batch="1")],
               e8_points=[dict(e8[0], e8_us=-1.0)])
    why = "\n".join(gf.check(bad))
    assert "commit: a git commit id" in why and "points[0]: shape of" in why and "e2e[0]: model and form" in why
    assert "e8_points[0]: form string" in why
    assert gf.check({"device": "x"})[0].startswith("top-level keys must be")
    out.write_text(json.dumps(bad))
    assert gf.main(["check", str(out)]) == 2
