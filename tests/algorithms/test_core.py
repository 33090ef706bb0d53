"""The paper's theorems as tests: GPTQ ≡ Babai, the no-clipping certificate, min-pivot,
and the SSQR/HPTQ targets. Random problems in fp64 check exact identities; real
SmolLM2 Hessians (real weights, real Wikipedia text) check what happens in fp32."""
import math
import warnings

import pytest
import torch

from vllm_latq.format import huffman
from vllm_latq.algorithms import babai, error_bound, gptq, hptq, hrtn, ldl_diag, min_pivot_order, rtn, ssqr
from vllm_latq.testing.gptq_loop import reference_gptq
from vllm_latq import native
from vllm_latq.algorithms.lattice import ORDERS, damped
from vllm_latq.algorithms.scales import absmax_scales, expand, grid, mse_scales

TIE_EPS = 1e-3   # fp32: a rounding argument this close to k + ½ may round either way


def random_problem(r=48, c=160, n=1024, seed=0, dtype=torch.float64, correlated=0.3):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, c, generator=g, dtype=dtype) @ (torch.randn(c, c, generator=g, dtype=dtype)
                                                      * correlated + torch.eye(c, dtype=dtype))
    W = torch.randn(r, c, generator=g, dtype=dtype) * 0.05
    return W, X.T @ X / n


# ----------------------------------------------------------------- GPTQ ≡ Babai

@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("order", [*ORDERS, "random"])
def test_gptq_reversed_equals_babai_fp64(clip, bits, order):
    W, H = random_problem(seed=bits)
    if order == "random":
        p = torch.randperm(H.shape[0], generator=torch.Generator().manual_seed(7))
    else:
        p = gptq(W, H, bits=bits, group_size=32, order=order, clip=clip).order
    g = gptq(W, H, bits=bits, group_size=32, order=p, clip=clip, block_size=32)
    b = babai(W, H, bits=bits, group_size=32, order=p.flip(0), clip=clip, block_size=48)
    assert torch.equal(g.z, b.z)
    assert torch.allclose(g.q, b.q, atol=0, rtol=0)
    if order in ("act", "min-pivot"):  # named heuristics mean the same processing in both frames
        assert torch.equal(babai(W, H, bits=bits, group_size=32, order=order, clip=clip).z, g.z)


def first_mismatch_is_tie(a, b):
    """Per row, the first differing column in processing order must be a rounding tie in
    both runs (after that the error feedback legitimately diverges). → (#rows differing)."""
    differing = 0
    za, zb = a.z[:, a.order], b.z[:, b.order]
    ra, rb = a.info["rho"][:, a.order], b.info["rho"][:, b.order]
    for i in torch.nonzero((za != zb).any(1)).flatten().tolist():
        j = int(torch.nonzero(za[i] != zb[i])[0])
        for rho in (ra[i, j], rb[i, j]):
            assert abs(abs(rho - torch.floor(rho)) - 0.5) < TIE_EPS, \
                f"row {i} col {j}: not a tie (rho={rho.item():.6f})"
        differing += 1
    return differing


@pytest.mark.parametrize("clip", [True, False])
def test_gptq_reversed_equals_babai_real(real_hessians, clip):
    for name, (W, H) in real_hessians.items():
        W = W[:96]
        for order in ("act", "min-pivot"):
            g = gptq(W, H, bits=3, group_size=64, order=order, clip=clip, keep_rho=True)
            b = babai(W, H, bits=3, group_size=64, order=g.order.flip(0), clip=clip, keep_rho=True)
            assert torch.equal(b.order, g.order)
            n = first_mismatch_is_tie(g, b)
            assert n <= 2, f"{name} {order}: {n} rows differ"


def test_gptq_factor_is_cholesky_of_inverse():
    """The GPTQ factor of H⁻¹ is Babai's inverted and reversed: with AᵀA = (H_d)_TT (A upper,
    T = p reversed), the sweep's ``M·diag`` is A⁻¹, and J A⁻ᵀ J is GPTQ's original
    chol(H_pp⁻¹, upper) — from one Cholesky of the reversed matrix."""
    from vllm_latq.algorithms.solvers import gptq_lattice
    W, H = random_problem(c=96)
    lat = gptq_lattice(H, "act", 0.01, dtype=torch.float64)
    A_inv = lat.M * lat.diag
    Hp = damped(H, 0.01)[lat.perm][:, lat.perm]
    U_ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hp)), upper=True)
    assert torch.equal(A_inv, A_inv.triu())
    assert torch.allclose(A_inv.T.flip(0, 1), U_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_blocked_gptq_equals_unblocked_reference(block_size):
    W, H = random_problem(c=200, seed=3)
    res = gptq(W, H, bits=3, group_size=64, order="act", block_size=block_size)
    S = expand(res.scales, 64, tuple(W.shape))
    assert torch.equal(res.z, reference_gptq(W, H, S, res.order, 3, 0.01))


# ----------------------------------------------------------------- the certificate

def assert_certified(res, W, H, name=""):
    err = res.error(W, H)
    ratio = err / res.bound
    assert (ratio <= 1 + 1e-4).all(), f"{name} {res.method}: bound violated, max ratio {ratio.max():.6f}"
    return ratio


def test_certificate_every_row_real(real_hessians):
    ratios = []
    for name, (W, H) in real_hessians.items():
        W = W[:128]
        b = babai(W, H, bits=3, group_size=64, order="act")
        g = gptq(W, H, bits=3, group_size=64, order="act", clip=False)
        # the standalone bound, in the matching Babai order, is the one the solvers report
        assert torch.allclose(error_bound(H, g.scales, g.order.flip(0), group_size=64), g.bound, rtol=1e-6)
        assert torch.allclose(error_bound(H, b.scales, "act", group_size=64), b.bound, rtol=1e-6)
        for res in (b, g, ssqr(W, H, bits=3, group_size=64, outlier_rate=0.02),
                    hptq(W, H, target_bits=3.125)):
            ratios.append(assert_certified(res, W, H, name))
    r = torch.cat(ratios)
    # tight but loose on average: the paper predicts ≈ 1/3 in expectation
    assert 0.15 < r.median() < 0.6, r.median()


def test_certificate_holds_with_dead_columns():
    W, H = random_problem(c=96, seed=5)
    dead = torch.tensor([3, 40, 77])
    H[dead, :] = 0
    H[:, dead] = 0
    res = babai(W, H, bits=3, group_size=32)
    assert_certified(res, W, H)
    # dead columns keep their weights (plainly rounded), they are not zeroed
    assert (res.q[:, dead].abs() > 0).any()
    S = expand(res.scales, 32, tuple(W.shape))
    assert torch.equal(res.z[:, dead], torch.round(W[:, dead] / S[:, dead]).to(torch.int32))


def test_clipped_gptq_can_exceed_the_bound():
    """A weight far outside the grid: clipping it costs more than the certificate allows."""
    W, H = random_problem(r=4, c=64, seed=6)
    W[0, 10] = 3.0
    S = absmax_scales(W, 3, 64) * 0.25   # fixed small scales: row 0's big weight overflows
    clipped = gptq(W, H, bits=3, group_size=64, scales=S, clip=True)
    bound = error_bound(H, S, clipped.order.flip(0), group_size=64)
    assert clipped.error(W, H)[0] > 2 * bound[0]
    unclipped = gptq(W, H, bits=3, group_size=64, scales=S, clip=False)
    assert_certified(unclipped, W, H)


# ----------------------------------------------------------------- orders

def test_min_pivot_equals_textbook_greedy():
    _, H = random_problem(c=150, seed=8)
    A = damped(H, 0.01)
    T, left = [], list(range(150))
    for _ in range(150):  # paper v1 Alg. 4, rank-1 Schur updates
        j = min(left, key=lambda i: A[i, i].item())
        A = A - torch.outer(A[:, j], A[j, :]) / A[j, j]
        T.append(j)
        left.remove(j)
    assert min_pivot_order(H, 0.01, block=16).tolist() == T


def test_trace_d_min_pivot_le_act_real(real_hessians, capsys):
    rows = []
    for name, (_, H) in real_hessians.items():
        tr = {o: ldl_diag(H, o).sum().item() for o in ORDERS}
        rows.append((name, tr))
        assert tr["min-pivot"] <= tr["act"] * (1 + 1e-9), (name, tr)
    with capsys.disabled():
        print("\n tr(D) on real SmolLM2 Hessians (paper Table 2 layout)")
        print(f" {'layer':40s} " + " ".join(f"{o:>10s}" for o in ORDERS))
        for name, tr in rows:
            print(f" {name:40s} " + " ".join(f"{v:10.4g}" for v in tr.values()))


def test_orders_validated():
    W, H = random_problem(c=32)
    with pytest.raises(ValueError, match="permutation"):
        gptq(W, H, order=torch.tensor([0, 0] + list(range(2, 32))))
    with pytest.raises(ValueError, match="unknown order"):
        gptq(W, H, order="fastest")


# ----------------------------------------------------------------- accuracy on real data

@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_beats_rtn_on_real_layers(real_hessians, bits):
    for name, (W, H) in real_hessians.items():
        g = gptq(W, H, bits=bits, group_size=64)
        r = rtn(W, bits=bits, group_size=64)
        assert torch.equal(g.scales, r.scales)  # same static MSE scales: only rounding differs
        eg, er = g.error(W, H).sum(), r.error(W, H).sum()
        assert eg < 0.9 * er, f"{name}: GPTQ {eg:.4g} vs RTN {er:.4g}"


# ----------------------------------------------------------------- scales

def test_scales_ragged_groups_and_mse():
    W = torch.randn(8, 200) * torch.rand(8, 200) ** 4
    s_abs, s_mse = absmax_scales(W, 3, 64), mse_scales(W, 3, 64)
    assert s_abs.shape == s_mse.shape == (8, 4)          # 200 = 3·64 + 8: ragged last group
    assert torch.equal(s_mse, s_mse.half().float())      # fp16-exact, as stored
    qmin, qmax = grid(3)

    def group_err(s):
        S = expand(s, 64, (8, 200))
        e = (torch.round(W / S).clamp(qmin, qmax) * S - W) ** 2
        return torch.nn.functional.pad(e, (0, 56)).reshape(8, 4, 64).sum(-1)
    assert (group_err(s_mse) <= group_err(s_abs.half().float()) + 1e-7).all()
    assert (group_err(s_mse) < group_err(s_abs.half().float()) - 1e-7).any()


# ----------------------------------------------------------------- SSQR

@pytest.mark.parametrize("rate", [0.0, 0.01, 0.02])
def test_ssqr_hits_target_rate(real_hessians, rate):
    W, H = real_hessians["model.layers.0.mlp.down_proj"]
    W = W[:192]
    res = ssqr(W, H, bits=4, group_size=128, outlier_rate=rate)
    assert rate - 0.001 <= res.outlier_rate <= rate
    qmin, qmax = grid(4)
    assert res.z.min() >= qmin and res.z.max() <= qmax
    # q = inliers·scales + outliers, exactly as a loader rebuilds it
    S = expand(res.scales, 128, tuple(W.shape))
    dense = res.outliers.to_dense()
    rebuilt = torch.where(dense != 0, dense, res.z.float() * S)
    assert torch.equal(rebuilt, res.q)
    assert (res.z[dense != 0] == 0).all()
    expected_bits = 4 + 16 / 128 * math.ceil(W.shape[1] / 128) * 128 / W.shape[1] \
        + 32 * res.outlier_rate + 32 * (W.shape[0] + 1) / W.numel()
    assert res.bits_per_weight == pytest.approx(expected_bits)
    assert_certified(res, W, H)


# ----------------------------------------------------------------- HPTQ / HRTN

@pytest.mark.parametrize("target", [2.125, 3.125, 4.125])
def test_hptq_and_hrtn_hit_target_bits(real_hessians, target):
    W, H = real_hessians["model.layers.1.self_attn.o_proj"]
    W = W[:256]
    for fn in (hptq, hrtn):
        res = fn(W, H, target_bits=target)
        assert target - 0.01 <= res.bits_per_weight <= target, (fn.__name__, res.bits_per_weight)
        stream = huffman.encode(res.z.numpy())
        assert (stream.total_bits + 32) / W.numel() == res.bits_per_weight
        assert torch.equal(torch.from_numpy(huffman.decode(stream)).reshape(W.shape), res.z)
        assert torch.equal(res.q, res.z.float() * res.scales)
    # the lattice solver is the better quantizer at the same budget
    e_h = hptq(W, H, target_bits=3.125).error(W, H).sum()
    e_r = hrtn(W, H, target_bits=3.125).error(W, H).sum()
    assert e_h < e_r


# ----------------------------------------------------------------- bad input

def test_bad_inputs_raise_clear_errors():
    W, H = random_problem(c=32)
    Wn = W.clone()
    Wn[1, 2] = float("nan")
    with pytest.raises(ValueError, match="layer l0: weight has 1 non-finite"):
        gptq(Wn, H, name="l0")
    Hi = H.clone()
    Hi[0, 0] = float("inf")
    with pytest.raises(ValueError, match="Hessian has 1 non-finite"):
        babai(W, Hi)
    with pytest.raises(ValueError, match=r"H must be \[in, in\]"):
        ssqr(W, H[:16, :16])
    with pytest.raises(ValueError, match="bits must be in 2..8"):
        rtn(W, bits=1)
    with pytest.raises(ValueError, match="outlier_rate"):
        ssqr(W, H, outlier_rate=1.5)
    with pytest.raises(ValueError, match="target_bits must exceed 1"):
        hptq(W, H, target_bits=0.5)


def test_indefinite_hessian_raises_damping_with_a_warning():
    W, H = random_problem(c=32)
    evals, evecs = torch.linalg.eigh(H)
    evals[:4] = -0.5 * evals.mean()         # not a Gram matrix: 1% damping is not enough
    H_bad = evecs @ torch.diag(evals) @ evecs.T
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = gptq(W, H_bad, clip=False, name="blk3.q_proj")
    msgs = [str(w.message) for w in caught]
    assert any("blk3.q_proj" in m and "damping raised to" in m for m in msgs), msgs
    assert res.damp > 0.01
    assert_certified(res, W, H_bad)


@pytest.mark.parametrize("method", ["gptq", "gptq-unclipped", "babai", "babai-clipped", "ssqr", "hptq"])
def test_native_column_step_equals_torch_step(method):
    """fp32 sweeps round through the C++ sub-block step (``algorithms/csrc/sweep.cpp``) when it
    builds: the same integers, values and outliers as the torch step (ω/s to ~1 ulp)."""
    if not native.available():
        pytest.skip(f"C++ ops unavailable: {native.load()}")
    W, H = random_problem(r=96, c=200, seed=11, dtype=torch.float32)
    run = {"gptq": lambda: gptq(W, H, bits=3, group_size=64),
           "gptq-unclipped": lambda: gptq(W, H, bits=3, group_size=64, clip=False, keep_rho=True),
           "babai": lambda: babai(W, H, bits=3, group_size=64, keep_rho=True),
           "babai-clipped": lambda: babai(W, H, bits=2, group_size=64, clip=True),
           "ssqr": lambda: ssqr(W, H, bits=2, group_size=64, outlier_rate=0.02),
           "hptq": lambda: hptq(W, H, target_bits=3.125)}[method]
    a = run()
    with native.disabled():
        b = run()
    assert a.z.dtype == b.z.dtype == torch.int32
    assert torch.equal(a.z, b.z) and torch.equal(a.q, b.q)
    if method == "ssqr":
        assert a.outliers.val.numel() > 0
        assert all(torch.equal(getattr(a.outliers, f), getattr(b.outliers, f)) for f in ("crow", "col", "val"))
    if "rho" in a.info:
        assert torch.allclose(a.info["rho"], b.info["rho"], rtol=1e-5, atol=1e-5)


def test_native_permuted_damped_hessian_equals_torch():
    """The C++ permute-and-damp gives bit-identical matrices to torch's copy + two gathers."""
    from vllm_latq.algorithms import lattice
    if not native.available():
        pytest.skip(f"C++ ops unavailable: {native.load()}")
    W, H = random_problem(c=200, seed=3)
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.float64):
        for h in (H, H.float()):
            a = lattice.damped(h, 0.01, dtype, perm)
            with native.disabled():
                b = lattice.damped(h, 0.01, dtype, perm)
            assert a.dtype == b.dtype == dtype and torch.equal(a, b)


def test_finite_check_survives_an_overflowing_sum():
    """The one-pass check sums in the input dtype: a sum overflowing on finite values must
    fall through to the exact count, not report a NaN that is not there."""
    from vllm_latq.algorithms.lattice import check_finite
    x = torch.full((4, 64), 3e38)
    assert not torch.isfinite(x.sum())
    check_finite(x, "weight", "L")
    x[1, 1] = float("nan")
    with pytest.raises(ValueError, match="layer L: weight has 1 non-finite"):
        check_finite(x, "weight", "L")


def test_a_group_wider_than_the_row_is_the_row():
    """One scale per row whatever the group size past the row: the same scales, integers and
    weights, and nothing allocated in proportion to the group (2^20 columns of fp32 per row)."""
    from vllm_latq.format import dequantize_layer, encode_layer
    torch.manual_seed(0)
    W, H = torch.randn(16, 80), torch.eye(80) + 0.1
    for scales in (absmax_scales, mse_scales):
        assert torch.equal(scales(W, 4, 1 << 20), scales(W, 4, 80))
    assert torch.equal(expand(torch.ones(16, 1), 1 << 20, (16, 80)), torch.ones(16, 80))
    row, wide = gptq(W, H, bits=4, group_size=80), gptq(W, H, bits=4, group_size=1 << 20)
    assert torch.equal(row.q, wide.q) and torch.equal(row.z, wide.z)
    t = encode_layer(row, "dense")
    assert torch.equal(dequantize_layer(t, "dense", (16, 80), 4, 1 << 20), row.q)
