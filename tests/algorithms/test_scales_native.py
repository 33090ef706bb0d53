"""The MSE scale search's C++ op (``algorithms/csrc/scales.cpp``) against its definition, the
torch code of ``scales.mse_scales``: same arithmetic, only the error sums' order differs, so
the scales agree on (nearly) every group and, where a near-tie went the other way, both are
minimisers of the group's clipped-RTN error up to float rounding."""
from __future__ import annotations

import pytest
import torch

from vllm_latq import native
from vllm_latq.algorithms import scales
from vllm_latq.algorithms.scales import expand, grid, mse_scales

pytestmark = pytest.mark.usefixtures("native_ops")


def _both(W, bits, g, **kw):
    """(the torch definition, the C++ op) of ``mse_scales``."""
    with native.disabled():
        ref = mse_scales(W, bits, g, **kw)
    return ref, mse_scales(W, bits, g, **kw)


def _group_err(W, s, bits, g):
    """Per-group clipped-RTN squared error (fp64 sums) of W on group scales s."""
    qmin, qmax = grid(bits)
    r, c = W.shape
    S = expand(s, g, (r, c))
    e = (torch.round(W / S).clamp(qmin, qmax) * S - W).double() ** 2
    G = s.shape[1]
    return torch.nn.functional.pad(e, (0, G * g - c)).reshape(r, G, g).sum(-1)


def _heavy(r, c, seed):
    """Student-t (3 degrees of freedom) weights, with an all-zero and two constant groups."""
    g = torch.Generator().manual_seed(seed)
    chi2 = (torch.randn(3, r, c, generator=g) ** 2).sum(0)
    W = 0.02 * torch.randn(r, c, generator=g) / torch.sqrt(chi2 / 3)
    W[0, :128] = 0.0
    W[1, :128] = 0.0125
    W[2, :128] = -0.5
    return W


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape,g", [((256, 1024), 128), ((96, 200), 64)])  # 200 = 3·64 + 8: ragged
def test_native_matches_torch(bits, shape, g):
    W = _heavy(*shape, seed=bits)
    ref, got = _both(W, bits, g)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert torch.equal(got, got.half().float())                      # fp16-exact
    same = got == ref
    assert same.float().mean() >= 0.999, f"{(~same).sum()} of {same.numel()} groups differ"
    e_ref, e_got = _group_err(W, ref, bits, g), _group_err(W, got, bits, g)
    # where a near-tie resolved differently: both minimisers within float rounding
    assert (e_got <= e_ref * (1 + 1e-5) + 1e-30).all()
    assert (e_ref <= e_got * (1 + 1e-5) + 1e-30).all()
    assert got[0, 0] == scales.FP16_TINY                               # the zero group


def test_native_options_and_layouts():
    """The dispatch; non-default search parameters, a non-contiguous fp16 input, a group wider than W."""
    W = _heavy(64, 300, seed=7)
    assert torch.equal(mse_scales(W, 4, 128), torch.ops.latq_cpu.mse_scales(W, 4, 128, 10, 8, 0.2))
    for kw in (dict(coarse=4, fine=3, min_shrink=0.5), dict(coarse=2, fine=0), dict(fine=9)):
        ref, got = _both(W, 4, 128, **kw)
        assert (got == ref).float().mean() >= 0.99, kw
    Wh = W.half().t()                                                  # [300, 64], strided
    ref, got = _both(Wh, 3, 32)
    assert (got == ref).float().mean() >= 0.99
    ref, got = _both(W, 4, 512)                          # one ragged group per row
    assert got.shape == (64, 1) and (got == ref).float().mean() >= 0.99


@pytest.mark.parametrize("bad", [1e6, float("inf"), float("nan")])
def test_native_refuses_scales_beyond_fp16(bad):
    W = torch.randn(4, 256)
    W[2, 130] = bad                                     # 1e6 / 7 > 65504
    for off in (True, False):
        with native.disabled(off), pytest.raises(ValueError, match="exceeds the fp16 range"):
            mse_scales(W, 4, 128)
