"""E8 codebooks and block Babai against brute force: the lattice decoder, E8P's 2¹⁶ points and its
fast search, the metric search, the block LDL and the block sweep on small random problems."""
import itertools

import pytest
import torch

from vllm_latq.algorithms import e8
from vllm_latq.algorithms.lattice import damped, layer_error
from tests.helpers import random_layer_problem as problem


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def e8_points():
    """Every E8 point with coordinates in [-2, 2] (enough for targets of norm ≲ 1.5 a coordinate)."""
    ints = torch.tensor(list(itertools.product(range(-2, 3), repeat=8)), dtype=torch.float64)
    halves = torch.tensor(list(itertools.product((-1.5, -0.5, 0.5, 1.5), repeat=8)), dtype=torch.float64)
    pts = torch.cat([ints, halves])
    return pts[(pts.sum(1) % 2) == 0]


def brute(x, book, D=None):
    """The nearest row of ``book`` in the metric D (Euclidean when None), by one GEMM."""
    D = torch.eye(8, dtype=x.dtype) if D is None else D
    return book[((book @ D) * book).sum(1).sub(2 * (x @ D) @ book.T).argmin(1)]


def dist2(x, p, D=None):
    E = x - p
    return ((E if D is None else E @ D) * E).sum(-1)


def test_nearest_e8_is_the_nearest_lattice_point(e8_points):
    x = torch.randn(300, 8, generator=gen(0), dtype=torch.float64) * 0.6
    p = e8.nearest_e8(x)
    assert torch.equal(e8.nearest_e8(p), p)                          # a lattice point maps to itself
    assert torch.allclose(dist2(x, p), dist2(x, brute(x, e8_points)), atol=1e-12)


def test_e8p_codebook_is_2_to_16_distinct_points_of_e8_plus_quarter():
    C = e8.e8p_codebook()
    assert C.shape == (65536, 8) and len(torch.unique(C, dim=0)) == 65536
    assert torch.equal(e8.nearest_e8(C - 0.25), C - 0.25)
    assert e8.in_e8p(C).all()
    assert not e8.in_e8p(torch.full((1, 8), 3.75)).any()            # E8 + ¼, outside the ball
    assert len(e8.e8p_patterns()) == 256 and (e8.e8p_patterns().square().sum(1) <= 10).sum() == 227


@pytest.mark.parametrize("scale", [0.4, 1.0, 2.0])   # 2.0: nearly every block outside the ball
def test_nearest_e8p_matches_brute_force(scale):
    x = torch.randn(1500, 8, generator=gen(1), dtype=torch.float64) * scale
    p = e8.nearest_e8p(x)
    assert e8.in_e8p(p).all()
    assert torch.allclose(dist2(x, p), dist2(x, brute(x, e8.e8p_codebook())), atol=1e-10)


def random_metric(seed, skew=0.3):
    A = torch.eye(8, dtype=torch.float64) + skew * torch.triu(torch.randn(8, 8, generator=gen(seed),
                                                                           dtype=torch.float64), 1)
    return A.T @ A


def test_metric_search_never_farther_and_mostly_exact():
    x = torch.randn(1500, 8, generator=gen(2), dtype=torch.float64)
    D = random_metric(3)
    p0, p = e8.nearest_e8p(x), e8.nearest_e8p(x, D)
    assert e8.in_e8p(p).all()
    assert (dist2(x, p, D) <= dist2(x, p0, D) + 1e-12).all()
    exact = dist2(x, brute(x, e8.e8p_codebook(), D), D)
    assert (dist2(x, p, D) <= exact + 1e-9).float().mean() > 0.75
    assert torch.equal(e8.nearest_e8p(x, torch.eye(8, dtype=torch.float64)), p0)   # Euclidean: no move


def test_ball256_and_its_metric_search():
    B = e8.e8_ball256()
    assert len(torch.unique(B, dim=0)) == 256 and torch.equal(e8.nearest_e8(B), B)
    assert torch.equal(e8.e8_roots().square().sum(1), torch.full((240,), 2.0, dtype=torch.float64))
    x = torch.randn(500, 8, generator=gen(4), dtype=torch.float64)
    D = random_metric(5)
    assert torch.allclose(dist2(x, e8.nearest_ball256(x, D), D), dist2(x, brute(x, B, D), D), atol=1e-10)


@pytest.mark.parametrize("scale", [0.1, 0.6, 1.5, 4.0])
def test_ball256_euclidean_closed_form_is_the_exhaustive_search(scale):
    """The ball's nearest point in closed form (its four kinds of point) is the table's first nearest
    row, at every scale (inside the ball and beyond) and on the ball's own points."""
    B = e8.e8_ball256()
    x = torch.randn(4000, 8, generator=gen(41), dtype=torch.float64) * scale
    x[:256] = B
    assert torch.equal(e8.nearest_ball256(x), e8.nearest_in(x, B))


@pytest.mark.parametrize("order", e8.BLOCK_ORDERS)
def test_block_ldl_factors_the_damped_hessian(order):
    _, H = problem()
    T = e8.block_order(H, order)
    assert torch.equal(T.sort().values, torch.arange(64))
    f = e8.block_ldl(H, T)
    Dfull = torch.block_diag(*f.D)
    assert torch.allclose(f.U.T @ Dfull @ f.U, damped(H, 0.01)[T][:, T], rtol=1e-10, atol=1e-12)
    assert torch.allclose(f.U.reshape(8, 8, 8, 8).diagonal(dim1=0, dim2=2).permute(2, 0, 1),
                          torch.eye(8, dtype=torch.float64).expand(8, 8, 8), atol=1e-12)


def test_block_min_pivot_takes_the_smallest_diagonals_first():
    _, H = problem(seed=1)
    T = e8.block_min_pivot(H)
    assert torch.equal(T[:8], damped(H, 0.01).diagonal().topk(8, largest=False).indices.sort().values)


def reference_block_babai(W, H, code, s, T, metric):
    """The sweep written from its definition: the upper Cholesky factor A, blocks last to first."""
    A = torch.linalg.cholesky(damped(H, 0.01)[T][:, T]).T
    Wt, Q = W[:, T], torch.zeros_like(W)
    for k in reversed(range(W.shape[1] // 8)):
        b, later = slice(8 * k, 8 * k + 8), slice(8 * k + 8, None)
        Akk = A[b, b]
        t = Wt[:, b] - torch.linalg.solve_triangular(Akk, A[b, later] @ (Q[:, later] - Wt[:, later]).T, upper=True).T
        Q[:, b] = s * code.nearest(t / s, Akk.T @ Akk if metric else None)
    out = torch.empty_like(Q)
    out[:, T] = Q
    return out


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("metric", [False, True])
def test_block_babai_matches_its_definition(bits, metric):
    W, H = problem(seed=bits)
    code = e8.CODES[bits]
    res = e8.block_babai(W, H, code, order="act", metric=metric)
    s = res.scales.double()
    ref = reference_block_babai(W, H, code, s, res.T, metric)
    assert torch.allclose(res.q, ref, atol=1e-9)
    assert res.bits_per_weight == bits + 16 / 64
    if bits == 2:   # every block is s·(an E8P point)
        assert e8.in_e8p((res.q[:, res.T] / s).reshape(-1, 8)).all()


def test_block_babai_beats_blockwise_rounding_in_layer_error():
    W, H = problem(r=64, seed=7)
    code = e8.CODES[3]
    s = e8.code_scales(W, code).double()
    rtn = s * code.nearest((W / s).reshape(-1, 8)).reshape(W.shape)   # one scale a row
    res = e8.block_babai(W, H, code, scales=s, order="min-pivot")
    assert layer_error(W, res.q, H).sum() < 0.8 * layer_error(W, rtn, H).sum()


def test_block_babai_refuses_what_it_cannot_solve():
    W, H = problem()
    with pytest.raises(ValueError, match="multiples of 8"):
        e8.block_babai(W[:, :60], H[:60, :60], e8.CODES[2])
    with pytest.raises(ValueError, match="inside one group"):
        e8.block_babai(W, H, e8.CODES[2], group_size=16, order=torch.arange(64).flip(0).roll(4))
    with pytest.raises(ValueError, match="unknown block order"):
        e8.block_order(H, "random")


def test_code_scales_are_fp16_and_no_worse_than_the_search_ends():
    W = torch.randn(16, 64, generator=gen(8)) * 0.02
    code = e8.CODES[2]
    s = e8.code_scales(W, code)
    assert torch.equal(s, s.half().float())

    def err(scale):
        Wb = W.reshape(16, 8, 8) / scale[:, :, None]
        return ((scale[:, :, None] * code.nearest(Wb.reshape(-1, 8)).reshape(16, 8, 8)) - W.reshape(16, 8, 8)
                ).square().sum((1, 2))
    rms = W.square().mean(1, keepdim=True).sqrt()
    for f in (e8.SCALE_SEARCH[2].lo, e8.SCALE_SEARCH[2].hi):
        assert (err(s) <= err((rms * f).half().float()) + 1e-9).all()


# ----------------------------------------------------------------------------- the certificate

def test_certified_radius_per_block():
    """A block inside E8P's ball is certified at E8's covering radius (1); at 3 bits the ball stage
    refines it to ½, and where only the ball stage misses the block keeps 1 (that stage holds the
    origin); at 4 bits a miss of the second E8P stage leaves it uncertified (inf)."""
    x = torch.randn(4000, 8, generator=gen(11), dtype=torch.float64) * 0.7
    for bits in (2, 3, 4):
        pts, r = e8.CODES[bits].points(x)
        assert set(r.unique().tolist()) <= {1.0, 0.5, 0.25, float("inf")}
        err = (x - e8.CODES[bits].nearest(x)).square().sum(-1).sqrt()
        assert (err[r.isfinite()] <= r[r.isfinite()] + 1e-12).all(), bits
    assert {1.0, 0.5} <= set(e8.CODES[3].points(x)[1].unique().tolist())
    far = torch.full((1, 8), 9.0, dtype=torch.float64)   # beyond E8P's ball: overloaded at every width
    assert all(torch.isinf(e8.CODES[b].points(far)[1]).all() for b in (2, 3, 4))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("metric", [False, True])
def test_certificate_holds_on_every_row_without_overload(bits, metric):
    W, H = problem(r=48, c=32, seed=20 + bits)
    res = e8.block_babai(W, H, e8.CODES[bits], group_size=16, order="act", metric=metric)
    free = res.overloads == 0
    assert free.sum() >= 3 and res.overloads.sum() > 0          # both kinds of row occur
    err = layer_error(W, res.q, H, res.damp)
    assert (err[free] <= res.bound[free] * (1 + 1e-9)).all()
    assert torch.isinf(res.bound[~free]).all()


def test_certificate_on_real_layers_at_scales_that_never_overload(real_hessians):
    """Real SmolLM2 layers, rotated, 3 bits at twice the MSE scales: no block overloads on any
    layer, and every row's measured error is within its bound."""
    from vllm_latq.algorithms.rotation import rotate_hessian, rotate_weight
    from vllm_latq.format.rotation import Rotation
    for name, (W, H) in real_hessians.items():
        signs = Rotation(0).signs(W.shape[1])
        W, H = rotate_weight(W[:32], signs), rotate_hessian(H, signs)
        code = e8.CODES[3]
        S = (2 * e8.code_scales(W, code, 64)).half().float()
        res = e8.block_babai(W, H, code, group_size=64, scales=S, order="act")
        assert res.overloads.sum() == 0, name
        ratio = layer_error(W, res.q, H, res.damp) / res.bound
        assert (ratio <= 1 + 1e-9).all() and ratio.max() > 0.1, name


def test_the_method_reports_overloads_and_codes_its_solution():
    from vllm_latq.format import codebook
    W, H = problem(r=32, seed=30)
    res = e8.e8(W, H, bits=3, group_size=32, scale_bits=4)
    assert res.info["overloads"].shape == (32,) and res.bound.shape == (32,)
    deq = codebook.dequantize(res.codes, res.coded_scales.decode(), 3, 32)
    assert torch.equal(deq, res.q)
    assert res.bits_per_weight == 3 + (4 * 32 * 2 + 2 * 16 * 2 * 2) / (32 * 64)   # 4-bit codes, a grid per 16 rows
    with pytest.raises(ValueError, match="order act or natural, not min-pivot"):
        e8.e8(W, H, bits=3, order="min-pivot")


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_every_tensor_lands_on_the_inputs_device(bits):
    """Run with the default device set to meta, the method and block min-pivot give the CPU run's
    results: no tensor is made on the default device, so on a GPU (W and H on cuda) none is left on
    the CPU. The codebook tables are cached per process, so they are made afresh inside."""
    from vllm_latq.format import codebook
    W, H = problem(r=16, seed=31)
    want = e8.e8(W, H, bits=bits, group_size=16, scale_bits=4)
    want_T = e8.block_min_pivot(H)
    caches = (codebook.e8p_patterns, codebook.e8_ball256, codebook._table_keys, e8.e8_roots)
    for c in caches:
        c.cache_clear()
    try:
        with torch.device("meta"):
            got = e8.e8(W, H, bits=bits, group_size=16, scale_bits=4)
            got_T = e8.block_min_pivot(H)
    finally:
        for c in caches:
            c.cache_clear()
    assert torch.equal(got.q, want.q) and torch.equal(got.codes, want.codes) and torch.equal(got_T, want_T)
    assert got.q.device.type == "cpu" and torch.equal(got.bound, want.bound)


def test_a_whole_matrix_search_in_chunks_is_the_search_at_once(monkeypatch):
    """``VectorCode.nearest`` takes NEAREST_CHUNK rows at a time (bounding its temporaries on big
    layers): any chunk size gives the points of one search over every row."""
    x = torch.randn(1000, 8, generator=gen(40), dtype=torch.float64) * 1.3
    for bits in (2, 3, 4):
        code = e8.CODES[bits]
        whole, _ = code.points(x)
        want = sum(p / s.gain for p, s in zip(whole, code.book.stages))
        monkeypatch.setattr(e8, "NEAREST_CHUNK", 97)
        assert torch.equal(code.nearest(x), want)


# ----------------------------------------------------------------------------- the C++ searches

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [0.4, 1.0, 1.6, 3.0])   # 3.0: nearly every block outside the ball
def test_native_searches_are_the_torch_searches(dtype, scale):
    """``algorithms/csrc/e8.cpp`` (E8P's nearest point, the ball's closed form, the descent in D, a
    code's stages, the ball in D) gives the torch path's points, on blocks inside and far outside the
    ball; only a near-tie may go the other way (sums in another order), to a point as near."""
    from vllm_latq import native
    if not native.available():
        pytest.skip(f"C++ ops unavailable: {native.load()}")
    x = (torch.randn(3000, 8, generator=gen(50), dtype=torch.float64) * scale).to(dtype)
    x[:8] = 0.0                                                       # ties: the origin, half-way points
    x[8:16] = 0.5
    D = random_metric(51).to(dtype)

    def searches():
        return (e8.nearest_e8p(x), e8.nearest_ball256(x), e8.nearest_e8p(x, D), e8.nearest_ball256(x, D),
                *(e8.CODES[b].nearest(x) for b in (2, 3, 4)))
    with native.disabled():
        want = searches()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for i, (w, g) in enumerate(zip(want, searches())):
        differ = (w != g).any(1)   # the first 16 rows are exact ties: the sums' rounding picks either point
        assert g.dtype == dtype and differ[16:].sum() <= 2
        if i < 4:   # one search: as near (a code's later stages start from the other point)
            M = D if i in (2, 3) else None
            assert torch.allclose(dist2(x[differ], g[differ], M), dist2(x[differ], w[differ], M), rtol=tol, atol=tol)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_native_method_is_the_torch_method(bits):
    from vllm_latq import native
    if not native.available():
        pytest.skip(f"C++ ops unavailable: {native.load()}")
    W, H = problem(r=32, seed=60 + bits)
    with native.disabled():
        want = e8.e8(W, H, bits=bits, group_size=16, scale_bits=4)
    got = e8.e8(W, H, bits=bits, group_size=16, scale_bits=4)
    assert torch.equal(got.q, want.q) and torch.equal(got.codes, want.codes)
