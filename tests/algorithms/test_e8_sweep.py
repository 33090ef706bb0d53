"""Block Babai's fast paths against the readable ones on small random problems: the lazily fed sweep
against the block-by-block one, the C++ sweep (``algorithms/csrc/e8_sweep.cpp``) against the Python
loop, and the C++ scale search's errors against torch's — the same codes, scales, radii and bounds."""
import dataclasses

import pytest
import torch

from vllm_latq import native
from vllm_latq.algorithms import e8
from vllm_latq.algorithms.scales import to_fp16_grid
from vllm_latq.format import codebook
from tests.helpers import random_layer_problem as problem



def needs_cpp():
    if not native.available():
        pytest.skip(f"C++ ops unavailable: {native.load()}")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def sweep_inputs(bits, group_size, order, seed, r=24, c=64):
    W, H = problem(r=r, c=c, seed=seed)
    code = e8.CODES[bits]
    S = e8.code_scales(W, code, group_size)
    T = e8.block_order(H, order)
    ldl = e8.block_ldl(H, T)
    X = W.double().T[T].contiguous()
    grp = T[::8] // (group_size or c)
    return X, ldl, S.double().T.contiguous(), grp, code


CASES = [(bits, g, order) for bits in (2, 3, 4) for g, order in ((None, "act"), (16, "natural"), (16, "act"),
                                                                  (None, "min-pivot"))]


@pytest.mark.parametrize("bits,group_size,order", CASES)
@pytest.mark.parametrize("metric", [True, False])
def test_lazy_feed_gives_the_block_by_block_sweeps_codes(bits, group_size, order, metric):
    """chunk=1 feeds every earlier column after each block (the sweep as first written); the lazy
    feed sums the same updates in another order: the same points, radii, and q to rounding."""
    args = sweep_inputs(bits, group_size, order, seed=10 + bits)
    Q1, P1, R1 = e8.babai_sweep(*args, metric=metric, chunk=1)
    for chunk in (3, e8.SWEEP_CHUNK):
        Q, P, R = e8.babai_sweep(*args, metric=metric, chunk=chunk)
        assert torch.equal(P, P1) and torch.equal(R, R1), chunk
        assert torch.allclose(Q, Q1, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bits,group_size,order", CASES)
@pytest.mark.parametrize("metric", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, e8.SWEEP_CHUNK])
def test_cpp_sweep_is_the_python_sweep(bits, group_size, order, metric, chunk):
    needs_cpp()
    args = sweep_inputs(bits, group_size, order, seed=20 + bits)
    want = e8.babai_sweep(*args, metric=metric, chunk=chunk)
    got = e8.cpp_sweep(*args, metric=metric, chunk=chunk)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("bits,group_size", [(3, 16), (3, None), (2, 32), (4, 64)])
def test_the_method_with_the_cpp_sweep_is_the_method_with_the_loop(bits, group_size, monkeypatch):
    """Codes, scales, overloads and the certificate, exactly, on rows with and without overloads."""
    needs_cpp()
    W, H = problem(r=40, c=64, seed=40 + bits)
    W[:4] *= 6                                                     # rows far outside E8P's ball
    got = e8.e8(W, H, bits=bits, group_size=group_size, scale_bits=4 if group_size == 16 else None)
    monkeypatch.setattr(e8, "cpp_sweep", e8.babai_sweep)
    want = e8.e8(W, H, bits=bits, group_size=group_size, scale_bits=4 if group_size == 16 else None)
    assert torch.equal(got.q, want.q) and torch.equal(got.codes, want.codes)
    assert torch.equal(got.info["overloads"], want.info["overloads"]) and torch.equal(got.bound, want.bound)
    assert got.info["overloads"].sum() > 0 and (got.info["overloads"] == 0).any()


def scanned_scales(W, code, group_size=None):
    """code_scales as first written: one candidate factor at a time, kept where strictly better."""
    coarse, fine, lo, hi = dataclasses.astuple(e8.SCALE_SEARCH[code.book.bits])
    r, c = W.shape
    Wb = W.float().reshape(r, c // 8, 8)
    grp = codebook.groups_of_blocks(c, group_size, W.device)
    ng = int(grp[-1]) + 1

    def per_group(x):
        return x.new_zeros(r, ng).index_add_(1, grp, x)
    rms = (per_group(Wb.square().sum(-1)) / (torch.bincount(grp, minlength=ng) * 8)).sqrt().clamp(min=1e-12)
    ratio = (hi / lo) ** (1 / max(coarse - 1, 1))
    best = None

    def consider(f, best):
        s = to_fp16_grid(rms * f)
        sb = s[:, grp, None]
        e = per_group((sb * code.nearest((Wb / sb).reshape(-1, 8)).reshape(Wb.shape) - Wb).square().sum(-1))
        f = torch.as_tensor(f, dtype=rms.dtype).expand_as(rms)
        if best is None:
            return f, s, e
        better = e < best[2]
        return torch.where(better, f, best[0]), torch.where(better, s, best[1]), torch.minimum(e, best[2])
    for k in range(coarse):
        best = consider(lo * ratio ** k, best)
    center = best[0]
    for k in range(1, fine + 1):
        best = consider(center * ratio ** (2 * k / (fine + 1) - 1), best)
    return best[1]


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size,c", [(None, 64), (16, 64), (32, 72)])   # 72: a ragged last group
def test_scale_search_is_the_scan_of_candidates(bits, group_size, c):
    W = torch.randn(48, c, generator=gen(bits + c)) * 0.02
    W[:3] *= 20                                                    # scales far from the rest
    code = e8.CODES[bits]
    want = scanned_scales(W, code, group_size)
    assert torch.equal(e8.code_scales(W, code, group_size), want)
    with native.disabled():
        assert torch.equal(e8.code_scales(W, code, group_size), want)


def test_cpp_rounding_errors_are_torchs():
    needs_cpp()
    W = torch.randn(32, 72, generator=gen(50)) * 0.02
    code = e8.CODES[3]
    grp = codebook.groups_of_blocks(72, 16, W.device)
    S = torch.stack([(W.square().mean(1, keepdim=True).sqrt() * f).expand(32, 5).half().float()
                     for f in (0.5, 1.0, 1.7)])
    got = e8.rounding_errors(W, S, code, grp)
    with native.disabled():
        want = e8.rounding_errors(W, S, code, grp)
    assert got.shape == (3, 32, 5) and torch.allclose(got, want, rtol=1e-6, atol=0)
