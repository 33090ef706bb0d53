"""Lattice decoders beyond Babai (``algorithms/decoders.py``): K-best and Klein's randomized
nearest plane return, in every row, a point at least as close to W in the H-norm as Babai's (≡
GPTQ's), on clipped, unclipped and SSQR grids; K = 1 is Babai itself; a wider beam finds closer
points on ill-conditioned problems; SSQR and HPTQ search with them and keep their certificate."""
from __future__ import annotations

import pytest
import torch

from vllm_latq.algorithms import babai, gptq, hptq, ssqr
from vllm_latq.algorithms.decoders import lattice_distance
from vllm_latq.algorithms.lattice import layer_error


def problem(seed=0, out=24, c=96):
    """Correlated inputs (an ill-conditioned H: Babai's greedy choices leave room)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, c, generator=g)
    B = torch.randn(c, c, generator=g, dtype=torch.float64)
    X = torch.randn(400, c, generator=g, dtype=torch.float64) @ (torch.eye(c, dtype=torch.float64) + 0.6 * B / c ** 0.5)
    return W, X.T @ X / 400


def err(res, W, H):
    return layer_error(W, res.q, H, res.damp)


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("decoder,beam,gain", [("kbest", 4, 0.995), ("klein", 6, 1.0)])
def test_never_farther_than_babai_and_closer_overall(decoder, beam, gain, clip):
    """``gain``: the summed error's ratio to Babai's it must beat (a few random draws of 96
    coordinates rarely beat the greedy path by much: Klein only has to find some)."""
    W, H = problem()
    base = gptq(W, H, bits=3, group_size=32, clip=clip)
    other = gptq(W, H, bits=3, group_size=32, clip=clip, decoder=decoder, beam=beam)
    e0, e1 = err(base, W, H), err(other, W, H)
    assert (e1 <= e0 * (1 + 1e-9) + 1e-12).all()
    assert e1.sum() < gain * e0.sum()
    if clip:
        assert other.z.min() >= -4 and other.z.max() <= 3
    else:
        assert (e1 <= other.bound * (1 + 1e-6)).all()       # the certificate still holds
    assert torch.allclose(other.q, other.z.float() * other.scales.repeat_interleave(32, 1), atol=1e-6)


def test_beam_of_one_is_babai():
    W, H = problem(1)
    for clip in (True, False):
        base = babai(W, H, bits=3, group_size=32, clip=clip)
        one = babai(W, H, bits=3, group_size=32, clip=clip, decoder="kbest", beam=1)
        assert torch.equal(one.z.int(), base.z.int())
        draw0 = babai(W, H, bits=3, group_size=32, clip=clip, decoder="klein", beam=1)
        assert torch.equal(draw0.z.int(), base.z.int())


def test_wider_beams_find_closer_points():
    W, H = problem(2)
    errs = [err(gptq(W, H, bits=2, group_size=32, decoder="kbest", beam=k), W, H).sum().item() for k in (1, 2, 8)]
    assert errs[2] < errs[1] <= errs[0]


def test_lattice_distance_is_the_damped_error():
    from vllm_latq.algorithms import lattice
    W, H = problem(3)
    res = gptq(W, H, bits=3, group_size=32, clip=False)
    T = lattice.resolve_order("act", H, 0.01, babai=True)
    L, _ = lattice.cholesky(H, 0.01, T)
    assert torch.allclose(lattice_distance(L.T, T, W, res.q), err(res, W, H), rtol=1e-9)


def test_ssqr_and_hptq_search_with_a_decoder():
    W, H = problem(4)
    s0 = ssqr(W, H, bits=3, group_size=32, outlier_rate=0.02)
    s1 = ssqr(W, H, bits=3, group_size=32, outlier_rate=0.02, decoder="kbest", beam=4)
    assert s1.outlier_rate <= 0.02 + 1e-9 and (err(s1, W, H) <= s1.bound * (1 + 1e-6)).all()
    from vllm_latq import format as fmt
    fmt.validate_layer(fmt.encode_layer(s1, "dense"), "dense", tuple(W.shape), 3, 32, layer="x")   # 0 under outliers
    assert torch.allclose(s1.q, s1.z.float() * s1.scales.repeat_interleave(32, 1) + s1.outliers.to_dense())
    assert s1.info["alpha"] > 0 and s0.info["alpha"] > 0
    h1 = hptq(W, H, target_bits=3.0, decoder="klein", beam=4)
    assert h1.bits_per_weight <= 3.0 and (err(h1, W, H) <= h1.bound * (1 + 1e-6)).all()


def test_bad_decoder_is_refused():
    W, H = problem(5, c=32)
    with pytest.raises(ValueError, match="decoder must be one of"):
        gptq(W, H, decoder="sphere")
    with pytest.raises(ValueError, match="beam >= 1"):
        gptq(W, H, decoder="kbest", beam=0)


def test_pipeline_option():
    """``latq-quantize --decoder kbest --beam 2``: recorded (informational), passed to every
    solver, refused for the methods without a lattice."""
    from vllm_latq.quantize.pipeline import QuantizeOptions
    from vllm_latq.testing.tiny_models import TINY_OPTS
    opts = QuantizeOptions(method="gptq", bits=3, decoder="kbest", beam=2, **TINY_OPTS)
    assert opts.solver_kwargs()["decoder"] == "kbest" and opts.solver_kwargs()["beam"] == 2
    assert opts.quantization_config([])["decoder"] == {"name": "kbest", "beam": 2}
    assert "decoder" not in QuantizeOptions().solver_kwargs() and "decoder" not in QuantizeOptions().quantization_config([])
    with pytest.raises(ValueError, match="decoder kbest is for gptq, babai, ssqr and hptq, not rtn"):
        QuantizeOptions(method="rtn", decoder="kbest")
    for beam in (0, 100_000):
        with pytest.raises(ValueError, match=f"beam must be an integer in 1..4096, got {beam}"):
            QuantizeOptions(decoder="kbest", beam=beam)
    with pytest.raises(ValueError, match="decoder must be one of babai, kbest, klein, got 'beam'"):
        QuantizeOptions(decoder="beam")


@pytest.mark.slow
def test_pipeline_with_a_decoder(tiny_llama, tmp_path):
    """The checkpoint validates and block 0's first layer (the same problem in both runs) is no
    farther from W than the Babai run's."""
    from vllm_latq.format.validate import validate_checkpoint
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    from vllm_latq.testing.tiny_models import TINY_OPTS
    errs = {}
    for dec in ("babai", "kbest"):
        o = QuantizeOptions(method="gptq", bits=3, decoder=dec, beam=2, **TINY_OPTS)
        seen = errs.setdefault(dec, {})
        d = quantize_model(tiny_llama, tmp_path / dec, o, progress=False,
                           on_layer=lambda n, W, H, r, seen=seen: seen.__setitem__(n, r.error(W, H).sum().item()))
        validate_checkpoint(d)
    first = "model.layers.0.self_attn.q_proj"   # the same problem in both runs (later ones see other inputs)
    assert errs["kbest"][first] <= errs["babai"][first] * (1 + 1e-9)
