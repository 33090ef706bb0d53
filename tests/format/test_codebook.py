"""The codebook kind (method e8): its codes ↔ points, a layer's tensors from the solver to the exact
dequantized weight, the validator's refusals, and format version 3 in ``quantization_config``."""
from __future__ import annotations

import pytest
import torch

from vllm_latq import format as fmt
from vllm_latq.algorithms.e8 import e8
from vllm_latq.errors import FormatError
from vllm_latq.format import codebook as cb
from vllm_latq.format import spec as spec_module
from tests.helpers import random_layer_problem as random_problem


def test_every_e8p_code_decodes_to_a_distinct_point_that_encodes_back():
    codes = torch.arange(2 ** 16)
    p = cb.decode_e8p(codes)
    assert len(torch.unique(p, dim=0)) == 2 ** 16
    assert torch.equal(cb.encode_e8p(p), codes)
    ball = torch.arange(256)
    assert torch.equal(cb.table_index(cb.BALL, cb.e8_ball256()[ball])[0], ball)


@pytest.fixture(scope="module")
def layer():
    """A random 3-bit e8 layer with coded scales: (its QuantResult, its tensors, its shape)."""
    W, H = random_problem(24, 64, seed=3)
    res = e8(W, H, bits=3, group_size=32, scale_bits=4)
    return res, fmt.encode_layer(res, "codebook"), tuple(W.shape)


@pytest.mark.parametrize("bits, group, coded", [(2, 64, False), (3, 32, True), (4, 16, False)])
def test_layer_tensors_dequantize_to_the_solution_and_count_every_bit(bits, group, coded):
    W, H = random_problem(20, 64, seed=bits)
    res = e8(W, H, bits=bits, group_size=group, scale_bits=4 if coded else None)
    t = fmt.encode_layer(res, "codebook")
    assert set(t) == ({"codes", "scale_codes", "scale_min", "scale_step"} if coded else {"codes", "scales"})
    fmt.validate_layer(t, "codebook", (20, 64), bits, group, layer="L")
    assert torch.equal(fmt.dequantize_layer(t, "codebook", (20, 64), bits, group), res.q)
    assert fmt.layer_stats(t, "codebook", (20, 64))["bits"] == pytest.approx(res.bits_per_weight, abs=1e-12)
    assert t["codes"].shape == (20, 8, bits)   # bytes a block: 2 bits a weight x 8 = 2 bytes per E8P stage


@pytest.mark.parametrize("edit, says", [
    (lambda t: t.update(codes=t["codes"].to(torch.int16)), "L.codes: dtype torch.int16, expected torch.uint8"),
    (lambda t: t.update(codes=t["codes"][:, :-1]), "L.codes: shape (24, 7, 3), expected (24, 8, 3)"),
    (lambda t: t.update(qweight=torch.zeros(1, dtype=torch.int32)), "unexpected tensors ['qweight']"),
    (lambda t: t.pop("scale_min"), "L.scale_min: missing"),
    (lambda t: t.update(scale_min=t["scale_min"] * 0), "L.scale_min: must be > 0"),
    (lambda t: t.update(scale_step=t["scale_step"].fill_(2000)), "exceeds 65504"),
])
def test_validator_refuses_naming_the_tensor(layer, edit, says):
    _, t, shape = layer
    t = {k: v.clone() for k, v in t.items()}
    edit(t)
    with pytest.raises(FormatError) as e:
        fmt.validate_layer(t, "codebook", shape, 3, 32, layer="L")
    assert says in str(e.value)


def test_a_layer_of_ragged_blocks_is_refused():
    with pytest.raises(FormatError, match="L: 60 input columns: a codebook layer needs a multiple of 8"):
        fmt.validate_layer({}, "codebook", (4, 60), 2, 32, layer="L")


def _qc(**kw):
    return {**fmt.quantization_config("e8", bits=3, group_size=64, order="act", damp=0.01,
                                      rotation=fmt.Rotation(0), scale_bits=4), **kw}


def test_config_is_version_3_and_parses():
    qc = _qc()
    s = fmt.parse_quantization_config(qc)
    assert qc["format_version"] == 3 == s.version and (s.kind, s.bits, s.group_size, s.scale_bits) == (
        "codebook", 3, 64, 4)
    assert fmt.quantization_config("gptq", bits=4, group_size=64, order="act", damp=0.01)["format_version"] == 1


@pytest.mark.parametrize("change, says", [
    ({"format_version": 2}, "quantization_config.method e8 needs format_version 3, got 2"),
    ({"bits": 5}, "quantization_config.bits must be one of 2, 3, 4, got 5"),
    ({"group_size": 60}, "quantization_config.group_size must be a multiple of 8 (whole codebook blocks), got 60"),
    ({"scale_bits": 3}, "quantization_config.scale_bits must be absent or one of (4,)"),
])
def test_config_refusals(change, says):
    with pytest.raises(FormatError) as e:
        fmt.parse_quantization_config(_qc(**change))
    assert says in str(e.value)


@pytest.mark.parametrize("qc, says", [
    (_qc(rotation=None), "quantization_config.rotation is missing: the codebook kind (method e8) is written only "
                         "with a rotation"),
    (_qc(format_version=3.0), "quantization_config.format_version must be an integer, got 3.0"),
    ({**fmt.quantization_config("gptq", bits=4, group_size=64, order="act", damp=0.01), "format_version": 3},
     "quantization_config.format_version 3 marks the codebook kind (method e8), not gptq"),
    ({**fmt.quantization_config("gptq", bits=4, group_size=64, order="act", damp=0.01), "format_version": 2},
     "quantization_config.format_version 2 marks a rotated checkpoint, but it has no rotation"),
])
def test_each_version_means_what_it_marks(qc, says):
    """The format's versions name what they mark (3: the codebook kind, always rotated; 2: rotated),
    and are JSON integers: any other combination is refused by the one parser every reader runs."""
    qc = {k: v for k, v in qc.items() if v is not None or k != "rotation"}
    with pytest.raises(FormatError) as e:
        fmt.parse_quantization_config(qc)
    assert says in str(e.value)


def test_a_version_2_reader_refuses_it_by_its_version(monkeypatch):
    monkeypatch.setattr(spec_module, "FORMAT_VERSIONS", (1, 2))
    with pytest.raises(FormatError, match="unsupported latq format_version 3: this reader knows versions 1, 2"):
        fmt.parse_quantization_config(_qc())
