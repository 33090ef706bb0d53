"""bench/iquant_peer.py and bench/iquant_gguf.py: llama.cpp's quantizer called through the xllamacpp
wheel (ctypes), the i-quant GGUF written from a tiny random tensor set (bytes per row, values back,
the fallback type, copied tensors), the q/k row order, and the imatrix against latq's Hessian."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")

from bench import iquant_gguf, iquant_peer, latq_gguf  # noqa: E402

# relative RMS error of a Gaussian row set the type must stay below (measured ≈ 0.31 / 0.19 / 0.14 / 0.08)
BOUND = {"IQ2_XS": 0.40, "IQ3_XXS": 0.25, "IQ3_S": 0.20, "IQ4_NL": 0.11}


@pytest.fixture(scope="module")
def ggml():
    return iquant_gguf.GGML()


def rel_err(a, b):
    return float(np.sqrt(((a - b) ** 2).mean() / (b ** 2).mean()))


def test_type_ids_and_sizes_are_llamas(ggml):
    assert [iquant_gguf.qtype(n) for n in ("Q8_0", "IQ2_XS", "IQ3_XXS", "IQ4_NL", "IQ3_S")] == [8, 17, 18, 20, 21]
    # bytes of a 256-weight block: block_iq2_xs 74, block_iq3_xxs 98, block_iq3_s 110; iq4_nl 18 per 32
    assert [ggml.row_size(n, 256) for n in ("IQ2_XS", "IQ3_XXS", "IQ3_S", "IQ4_NL")] == [74, 98, 110, 144]
    assert ggml.bits("IQ3_S") == 3.4375 and ggml.requires_imatrix("IQ2_XS") and not ggml.requires_imatrix("IQ3_S")


def test_rows_that_are_not_whole_blocks_are_refused_not_aborted(ggml):
    w = np.ones((2, 576), np.float32)
    with pytest.raises(ValueError, match="not whole blocks"):
        ggml.quantize("IQ3_S", w, np.ones(576, np.float32))
    with pytest.raises(ValueError, match="importance matrix"):
        ggml.quantize("IQ2_XS", np.ones((2, 256), np.float32))
    assert iquant_gguf.layer_type(ggml, "IQ3_S", 576) == "IQ4_NL"
    assert iquant_gguf.layer_type(ggml, "IQ3_S", 1536) == "IQ3_S"
    assert iquant_gguf.layer_type(ggml, "IQ3_S", 48) == "F16"


def write_source(path, tensors):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_block_count(1)
    for name, x in tensors.items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["IQ3_S", "IQ3_XXS", "IQ2_XS"])
def test_iquant_gguf_of_random_tensors(tmp_path, ggml, name):
    rng = np.random.default_rng(0)
    linears = {"blk.0.attn_q.weight": (16, 512), "blk.0.ffn_down.weight": (8, 768),
               "blk.0.attn_k.weight": (8, 96)}          # 96 columns: not whole 256-blocks → IQ4_NL
    weights = {t: rng.standard_normal(s).astype(np.float32) for t, s in linears.items()}
    imat = {t: (rng.random(s[1]) + 0.1).astype(np.float32) for t, s in linears.items()}
    plain = {"token_embd.weight": rng.standard_normal((32, 64)).astype(np.float32),
             "blk.0.attn_norm.weight": rng.standard_normal(64).astype(np.float32)}
    write_source(tmp_path / "src.gguf", {**plain, **{t: np.zeros(s, np.float32) for t, s in linears.items()}})
    out = tmp_path / f"{name}.gguf"
    written = iquant_gguf.write_iquant_gguf(tmp_path / "src.gguf", out, name, weights, imat, ggml)

    r = gguf.GGUFReader(str(out))
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType[f"MOSTLY_{name}"])
    got = {t.name: t for t in r.tensors}
    assert set(got) == set(linears) | set(plain)
    for t, (rows, cols) in linears.items():
        kind = name if cols % 256 == 0 else "IQ4_NL"
        assert got[t].tensor_type.name == kind and written[t][0] == kind
        data = np.asarray(got[t].data)
        assert data.shape == (rows, ggml.row_size(kind, cols))          # bytes per row = ggml_row_size
        assert int(got[t].n_bytes) == rows * ggml.row_size(kind, cols)
        back = iquant_gguf.dequantize(kind, data, cols)
        assert back.shape == (rows, cols)
        assert np.array_equal(back, ggml.dequantize(kind, data, cols))    # gguf's numpy = llama.cpp's own
        assert rel_err(back, weights[t]) < BOUND[kind]
        assert rel_err(back, weights[t]) > 1e-3                           # quantized, not copied
    for t, x in plain.items():
        assert np.array_equal(np.asarray(got[t].data), x)


def test_imatrix_steers_the_quantizer(ggml):
    """Columns weighted up by the imatrix come back closer than without it (it reaches the C code)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    imat = np.full(256, 1e-3, np.float32)
    imat[:32] = 100.0
    err = lambda im: float(((iquant_gguf.dequantize("IQ3_S", ggml.quantize("IQ3_S", w, im), 256) - w)[:, :32] ** 2).mean())
    assert err(imat) < 0.8 * err(None)


def test_pad_quantize_keeps_the_rows_and_their_values(ggml):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 576)).astype(np.float32)
    back = iquant_gguf.pad_quantize(ggml, "IQ3_S", w, np.ones(576, np.float32))
    assert back.shape == w.shape and 1e-3 < rel_err(back, w) < BOUND["IQ3_S"]


def test_unpermute_inverts_llamacpp_row_order():
    x = torch.arange(24 * 5, dtype=torch.float32).reshape(24, 5)
    for heads in (1, 3):
        p = latq_gguf.permute_rows(x, heads).numpy()
        assert not np.array_equal(p, x.numpy())
        assert np.array_equal(iquant_peer.unpermute_rows(p, heads), x.numpy())


def test_imatrix_is_the_diagonal_of_latqs_hessian(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    import vllm_latq.data as data
    from vllm_latq.quantize.hessian import linear_hessians

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (3, 16))
    monkeypatch.setattr(data, "calibration_batches", lambda tok, nsamples, seqlen, seed: ids)
    im = iquant_peer.imatrix(model, None, 3, 16, 0, tmp_path / "im.npz")
    assert len(im) == 2 * len(iquant_peer.HF_LINEARS)
    mods = {t: model.get_submodule(iquant_peer.hf_name(t)) for t in im}
    hs = linear_hessians(model, mods, ids)
    for t, (_, H) in hs.items():
        np.testing.assert_allclose(im[t], torch.diagonal(H).float().numpy(), rtol=1e-5)
    assert not np.allclose(im["blk.1.ffn_down.weight"][:8], im["blk.1.ffn_down.weight"][8:16])
    cached = iquant_peer.imatrix(model, None, 3, 16, 0, tmp_path / "im.npz")   # read back, same values
    assert all(np.array_equal(cached[t], im[t]) for t in im)


def test_llamacpp_features_reads_the_system_info_line():
    info = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | F16C = 1 | OPENMP = 1 | "
    assert iquant_peer.llamacpp_features(info) == ["SSE3", "SSSE3", "AVX", "AVX2", "F16C", "OPENMP"]
