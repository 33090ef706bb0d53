"""Second-level scales (``format/scale_codes.py``): group scales as 4-bit codes on a
grid per 16 rows of a group — the codec, the solvers quantizing against the decoded scales, the
stored tensors, their validation and the pipeline option."""
from __future__ import annotations

import json

import pytest
import torch

from vllm_latq.testing.tiny_models import TINY_OPTS
from vllm_latq import format as fmt
from vllm_latq.format import scale_codes as sc
from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
from vllm_latq.format.validate import validate_checkpoint
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
from vllm_latq.algorithms.scales import mse_scales
from vllm_latq.algorithms.solvers import babai, gptq, rtn


def _scales(out=37, groups=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(out, groups, generator=g) * 0.05 + 1e-3).half().float()


def test_codes_decode_to_fp16_values_within_half_a_step():
    S = _scales()
    c = sc.code_scales(S)
    d = c.decode()
    assert torch.equal(d, d.half().float())                      # fp16 values: any fp16-scale kernel takes them
    rows = torch.arange(S.shape[0]) // sc.ROWS
    step = c.step.float()[rows]
    assert c.codes.max() <= 15 and (d > 0).all()
    # nearest code, up to the fp16 rounding of min, step and the decoded value
    assert ((d - S).abs() <= step / 2 + 2 * S * 2.0 ** -11 + 1e-7).all()
    # each block's smallest and largest scale are (nearly) on its grid: the grid spans them
    assert torch.allclose(c.min.float(), S.reshape(-1).new_tensor(
        [S[b * 16:(b + 1) * 16, j].min().item() for b in range(3) for j in range(5)]).reshape(3, 5), rtol=1e-3)


def test_decode_is_the_stated_formula():
    """s = fp16(fp32(min) + code·fp32(step)) element by element (the kernels' arithmetic)."""
    c = sc.code_scales(_scales(out=40, groups=3, seed=1))
    for n in (0, 15, 16, 39):
        for j in range(3):
            b = n // 16
            want = torch.tensor(c.min[b, j].float().item() + c.codes[n, j].item() * c.step[b, j].float().item(),
                                dtype=torch.float32).half().float()
            assert c.decode()[n, j] == want


@pytest.mark.parametrize("out", [1, 2, 15, 16, 33])
def test_pack_unpack_round_trip(out):
    codes = torch.randint(0, 16, (out, 7), dtype=torch.uint8, generator=torch.Generator().manual_seed(out))
    p = sc.pack_codes(codes)
    assert p.shape == (-(-out // 2), 7) and p.dtype == torch.uint8
    assert torch.equal(sc.unpack_codes(p, out), codes)
    if out % 2:
        assert not (p[-1] >> 4).any()


def test_equal_scales_code_to_zero_steps():
    c = sc.code_scales(torch.full((20, 2), 0.01).half().float())
    assert (c.step == 0).all() and (c.codes == 0).all()
    assert torch.equal(c.decode(), torch.full((20, 2), 0.01).half().float())


def test_unsupported_code_bits_are_refused():
    with pytest.raises(ValueError, match="scale code bits 3 not supported"):
        sc.code_scales(_scales(), 3)


@pytest.mark.parametrize("solver", [gptq, rtn, babai])
def test_solvers_quantize_against_the_decoded_scales(solver):
    """z is chosen for the decoded scales (q = z·s exactly), the stored tensors hold them, and
    ``bits_per_weight`` counts the codes and grids instead of fp16 scales."""
    g = torch.Generator().manual_seed(0)
    W, X = torch.randn(48, 256, generator=g), torch.randn(600, 256, generator=g)
    H = X.T @ X
    kw = dict(bits=3, group_size=64) | ({"clip": True} if solver is babai else {})
    r = solver(W, H, scale_bits=4, **kw)
    assert r.coded_scales is not None and torch.equal(r.scales, r.coded_scales.decode())
    assert torch.equal(r.q, r.z.float() * r.scales.repeat_interleave(64, 1))
    t = fmt.encode_layer(r, "dense")
    assert set(t) == set(fmt.dense_tensors(True)) and "scales" not in t
    fmt.validate_layer(t, "dense", tuple(W.shape), 3, 64, layer="L")
    assert torch.equal(fmt.dequantize_layer(t, "dense", tuple(W.shape), 3, 64), r.q)
    scale_bits = sum(8 * t[k].numel() * t[k].element_size() for k in sc.TENSORS)
    assert r.bits_per_weight == pytest.approx(3 + scale_bits / W.numel())
    assert r.bits_per_weight == pytest.approx(3 + 4 * 6 / 256)   # 48 rows: 6 bits per scale exactly


def test_coded_group_64_beats_fp16_group_128_at_fewer_bits():
    """The lever's point, on a layer with row-varying magnitudes: g64 with coded scales costs
    fewer bits than g128 with fp16 scales and has the lower output error."""
    g = torch.Generator().manual_seed(3)
    W = torch.randn(256, 512, generator=g) * torch.rand(256, 1, generator=g) * torch.rand(1, 512, generator=g)
    X = torch.randn(2048, 512, generator=g)
    H = X.T @ X
    coded = gptq(W, H, bits=3, group_size=64, scale_bits=4)
    plain = gptq(W, H, bits=3, group_size=128)
    err = lambda r: float(((r.q - W) @ X.T).norm())   # noqa: E731
    assert coded.bits_per_weight < plain.bits_per_weight
    assert err(coded) < err(plain)


def _layer(out=40, cin=128):
    g = torch.Generator().manual_seed(5)
    W = torch.randn(out, cin, generator=g)
    return fmt.encode_layer(rtn(W, bits=4, group_size=64, scale_bits=4), "dense"), (out, cin)


@pytest.mark.parametrize("bad, match", [
    (lambda t: t["scale_min"].__setitem__((0, 0), 0.0), "scale_min.*must be > 0"),
    (lambda t: t["scale_step"].__setitem__((0, 0), -1.0), "scale_step.*must be >= 0"),
    (lambda t: t.__setitem__("scale_codes", t["scale_codes"][:-1]), "scale_codes.*shape"),
    (lambda t: t.__setitem__("scale_min", t["scale_min"].float()), "scale_min.*dtype"),
    (lambda t: t.__setitem__("scales", t["scale_min"]), "unexpected tensors \\['scales'\\]"),
])
def test_validation_names_the_bad_tensor(bad, match):
    t, shape = _layer()
    bad(t)
    with pytest.raises(fmt.FormatError, match=match):
        fmt.validate_layer(t, "dense", shape, 4, 64, layer="L")


def test_an_odd_last_row_has_no_high_nibble():
    t, shape = _layer(out=33)
    fmt.validate_layer(t, "dense", shape, 4, 64, layer="L")
    t["scale_codes"][-1, 0] |= 0x30
    with pytest.raises(fmt.FormatError, match="high nibbles of the last byte row"):
        fmt.validate_layer(t, "dense", shape, 4, 64, layer="L")


def test_quantization_config_scale_bits():
    qc = fmt.quantization_config("gptq", bits=4, group_size=64, order="act", damp=0.01, scale_bits=4)
    assert qc["scale_bits"] == 4 and fmt.parse_quantization_config(qc).scale_bits == 4
    assert "scale_bits" not in fmt.quantization_config("gptq", bits=4, group_size=64, order="act", damp=0.01)
    for bad in (3, "4", True):
        with pytest.raises(fmt.FormatError, match="scale_bits must be absent or one of"):
            fmt.parse_quantization_config({**qc, "scale_bits": bad})
    hq = fmt.quantization_config("hptq", target_bits=3.125, order="act", damp=0.01)
    with pytest.raises(fmt.FormatError, match="scale_bits.*hptq"):
        fmt.parse_quantization_config({**hq, "scale_bits": 4})
    for method in ("ssqr", "hptq", "hrtn"):
        with pytest.raises(ValueError, match="scale_bits is for gptq, rtn, babai and e8"):
            QuantizeOptions(method=method, scale_bits=4)


def test_pipeline_writes_coded_scales_that_every_reader_decodes(tiny_llama, tmp_path, capsys):
    """``--scale-bits 4`` end to end: recorded in the config, every layer coded, the checkpoint
    valid (``latq-inspect`` saying so in its header, with served bits per family), the
    dequantized model holding exactly the solver's weights; a config that does not say so is
    refused."""
    from vllm_latq.commands.inspect import inspect_main
    solved = {}
    d = quantize_model(tiny_llama, tmp_path / "q", QuantizeOptions(method="gptq", bits=3, scale_bits=4, **TINY_OPTS),
                       progress=False, on_layer=lambda n, W, H, r: solved.__setitem__(n, r.q))
    ck = Checkpoint(d)
    assert ck.spec.scale_bits == 4
    assert all(fmt.has_coded_scales({s: None for s in names}) for names in ck.layers().values())
    validate_checkpoint(d)
    assert inspect_main([str(d), "--no-checksums"]) == 0
    printed = capsys.readouterr().out
    assert "method gptq (dense) · 3-bit g64, scales as 4-bit codes on 16-row grids" in printed, printed
    assert "served (what a decode step streams, per kernel family): cpu" in printed
    model = load_dequantized_model(d)
    for n, q in solved.items():
        assert torch.equal(model.get_submodule(n).weight.float(), q), n
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]["scale_bits"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(fmt.FormatError, match="scales stored as codes, but quantization_config has no scale_bits"):
        validate_checkpoint(d)
