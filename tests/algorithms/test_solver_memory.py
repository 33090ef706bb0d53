"""What keeps one block's solve within about twice its weights and Hessians (bench/memory.py):
H formed in place of its fp64 sum, each Hessian released once its last linear is solved, the
damped H of the error stats and the triangular inverse formed without a second c×c matrix —
each giving exactly the values of the copying form."""
from __future__ import annotations

import weakref

import pytest
import torch

from vllm_latq.testing.tiny_models import TINY_OPTS
from vllm_latq.format.safetensors_file import SafetensorsFile
from vllm_latq.quantize import calibrate, steps
from vllm_latq.quantize.hessian import Hessian, PanelHessian
from vllm_latq.algorithms.lattice import damped, damped_in_place, layer_error, relative_error, tri_inv_upper
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
from vllm_latq.quantize.solve_layers import solve as default_solve


@pytest.mark.parametrize("kind", [Hessian, PanelHessian])
def test_h_is_formed_in_place_of_the_sum_with_the_division_values(kind):
    x = torch.randn(2, 700, 600, generator=torch.Generator().manual_seed(0)).bfloat16()
    h = kind(600)
    for part in x:
        h.add(part)
    S = h.sum
    expected = S.clone() / h.n
    if kind is PanelHessian:  # only its upper panels are summed: H is their mirror
        expected = expected.triu() + expected.triu(1).T
    H = h.H
    assert torch.equal(H, expected) and H.data_ptr() == S.data_ptr()
    assert h.H is H and h.sum is None and h.n == 1400
    with pytest.raises(RuntimeError, match="already formed"):
        h.add(x[0])
    with pytest.raises(ValueError, match="no calibration rows"):
        kind(4).H


@pytest.mark.parametrize("panel", [64, 2048])
def test_relative_error_is_the_fp64_ratio_to_fp32_precision(panel):
    """A layer record's relative error (fp32 products over panels of H) agrees with the ratio of
    two fp64 layer errors, whatever the panel width (200 columns: 4 panels of 64, or one)."""
    g = torch.Generator().manual_seed(4)
    X = torch.randn(400, 200, generator=g, dtype=torch.float64)
    X[:, :5] *= 40   # a few large channels, as real activations have
    H = X.T @ X / 400
    W = torch.randn(60, 200, generator=g)
    Q = W + 0.03 * torch.randn(60, 200, generator=g)
    expected = (layer_error(W, Q, H).sum() / layer_error(W, torch.zeros_like(W), H).sum()).item()
    assert relative_error(W, Q, H, panel) == pytest.approx(expected, rel=1e-5)
    assert relative_error(W, W, H, panel) == 0.0 and relative_error(W, torch.zeros_like(W), H, panel) == 1.0


def test_layer_error_damps_h_in_place_and_restores_it():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(300, 200, generator=g, dtype=torch.float64)
    H = X.T @ X / 300
    W, Q = torch.randn(50, 200, generator=g), torch.randn(50, 200, generator=g)
    H0 = H.clone()
    E = Q.double() - W.double()
    for Hx in (H, H.float()):   # fp32: damped into a copy, H untouched
        for damp in (0.0, 0.01):
            expected = ((E @ (damped(Hx, damp) if damp else Hx.double())) * E).sum(1)
            assert torch.equal(layer_error(W, Q, Hx, damp), expected)
    assert torch.equal(H, H0)
    with pytest.raises(KeyError):
        with damped_in_place(H, 0.01) as Hd:
            assert torch.equal(Hd, damped(H0, 0.01))
            raise KeyError("interrupted")
    assert torch.equal(H, H0)
    with pytest.raises(ValueError, match="fp64"):
        with damped_in_place(H.float(), 0.01):
            pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [200, 1100])
def test_triangular_inverse_in_the_factors_memory(n, dtype):
    X = torch.randn(n + 50, n, generator=torch.Generator().manual_seed(n), dtype=dtype)
    L = torch.linalg.cholesky_ex(X.T @ X / n + 0.01 * torch.eye(n, dtype=dtype))[0]
    fresh = tri_inv_upper(L.T)
    ptr = L.data_ptr()
    inv = tri_inv_upper(L.T, overwrite=True)
    assert torch.equal(inv, fresh)
    assert (inv.data_ptr() == ptr) == (n > 256)   # a leaf-sized matrix is solved directly
    torch.testing.assert_close(inv @ L.T if n <= 256 else inv @ torch.linalg.cholesky_ex(
        X.T @ X / n + 0.01 * torch.eye(n, dtype=dtype))[0].T, torch.eye(n, dtype=dtype),
        atol=1e-3 if dtype == torch.float32 else 1e-9, rtol=0)


def test_each_hessian_released_once_its_last_linear_is_solved(tiny_llama, tmp_path, monkeypatch):
    """q/k/v share one Hessian, kept until v_proj is solved; gate/up theirs until up_proj; at
    every solve only the Hessians of linears still to be solved are held."""
    spies, seen = [], []

    def spy(*a, **k):
        spies.append(calibrate.block_hessians(*a, **k))
        return spies[-1]

    def solve(method, W, H, name, **kw):
        seen.append((name, {n.rsplit(".", 2)[-1] for n in spies[-1].of}))
        return default_solve(method, W, H, name, **kw)

    monkeypatch.setattr(steps, "block_hessians", spy)
    quantize_model(tiny_llama, tmp_path / "out", QuantizeOptions(method="ssqr", **TINY_OPTS), progress=False,
                   solve=solve)
    attn, mlp = {"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}
    held = {name.rsplit(".", 1)[-1]: of for name, of in seen if ".layers.1." in name}
    assert held == {"q_proj": attn | {"o_proj"} | mlp | {"down_proj"}, "k_proj": attn | {"o_proj"} | mlp | {"down_proj"},
                    "v_proj": attn | {"o_proj"} | mlp | {"down_proj"}, "o_proj": {"o_proj"} | mlp | {"down_proj"},
                    "gate_proj": mlp | {"down_proj"}, "up_proj": mlp | {"down_proj"}, "down_proj": {"down_proj"}}
    assert len(spies) == 2 and all(not s.of for s in spies)


@pytest.mark.parametrize("method", ["rtn", "ssqr"])
def test_a_linears_weight_and_solution_are_freed_before_the_next_solve(tiny_llama, tmp_path, method):
    """solve_block drops a linear's weight and solution once it is written into the block:
    held through the next solve, up_proj's cost ~0.7 GiB at down_proj's at Llama-3-8B shapes.
    A calibrated solve gets the fp32 weight; RTN its stored bf16 one, and stores no fp32 ``q``."""
    alive, checked = [], 0

    def solve(method, W, H, name, **kw):
        nonlocal checked
        assert [n for n, *refs in alive if any(r() is not None for r in refs)] == [], name
        assert W.dtype == (torch.bfloat16 if method == "rtn" else torch.float32), (name, W.dtype)
        res = default_solve(method, W, H, name, **kw)
        assert (res.stored_q is None) == (method == "rtn")
        alive.append((name, *(weakref.ref(t) for t in (W, res.z, res.stored_q) if t is not None)))
        checked += 1
        return res

    quantize_model(tiny_llama, tmp_path / "out", QuantizeOptions(method=method, **TINY_OPTS), progress=False,
                   solve=solve)
    assert checked == 14


def test_rtn_rounds_row_chunks_as_the_whole_matrix():
    """RTN rounds a few MiB of rows at a time (no fp32 copies of the whole matrix): the integers
    and dequantized weights of one whole-matrix rounding, a ragged last chunk included."""
    from vllm_latq.algorithms.scales import expand, grid
    from vllm_latq.algorithms.solvers import rtn
    W = torch.randn(2053, 2100, generator=torch.Generator().manual_seed(3)).bfloat16()   # 3 chunks of 1997 rows
    res = rtn(W, bits=3, group_size=64)
    S = expand(res.scales, 64, tuple(W.shape))
    z = (W.float() / S).round().clamp(*grid(3))
    assert torch.equal(res.z, z.to(torch.int32)) and torch.equal(res.q, z * S)
    assert res.z.dtype == torch.int8 and res.stored_q is None   # one byte a weight held, q computed when read
    assert torch.equal(rtn(W, bits=3, clip=False, scales=res.scales[0, 0]).z,
                       (W.float() / res.scales[0, 0]).round().to(torch.int32))


def test_a_result_without_stored_q_computes_the_solvers_q():
    """``q`` computed from the integers, the scales and the outliers (as RTN's results hold it)
    is the dequantized matrix a solver stores: checked on SSQR, whose q has outliers."""
    import dataclasses
    from vllm_latq.algorithms.ssqr import ssqr
    g = torch.Generator().manual_seed(5)
    X = torch.randn(400, 96, generator=g)
    W = torch.randn(40, 96, generator=g) * torch.linspace(0.2, 3, 96)
    res = ssqr(W, X.T @ X, bits=3, group_size=32, outlier_rate=0.05)
    assert res.outliers is not None and res.outliers.nnz > 0
    assert torch.equal(dataclasses.replace(res, stored_q=None).q, res.q)


def test_mse_scales_of_row_chunks_and_of_a_narrow_weight_are_the_whole_matrix_ones():
    """MSE scales are searched a few MiB of fp32 rows at a time, from the stored bf16 weight:
    the scales of one search over the whole fp32 matrix (a ragged last chunk included)."""
    from vllm_latq.algorithms.scales import mse_scales
    W = torch.randn(1100, 8192, generator=torch.Generator().manual_seed(4)).bfloat16()   # chunks of 512 rows
    whole = mse_scales(W.float(), 4, 128, row_chunk=W.shape[0])
    assert torch.equal(mse_scales(W, 4, 128), whole)


def test_an_uncalibrated_run_never_loads_a_block(tiny_llama, tmp_path, monkeypatch):
    """RTN runs no forwards: each linear is read alone for its solve, the block's bf16 weights
    (0.41 GiB at Llama-3-8B shapes) are never loaded into the model, and the checkpoint is the
    one a run that loads them writes."""
    from vllm_latq.quantize.source import Source
    loaded, load = [], Source.load
    monkeypatch.setattr(Source, "load", lambda self, names, device: (loaded.extend(names), load(self, names, device)))
    ref = quantize_model(tiny_llama, tmp_path / "calibrated-style", QuantizeOptions(method="rtn", **TINY_OPTS),
                         progress=False)
    assert loaded == []
    monkeypatch.setattr(QuantizeOptions, "calibrated", property(lambda self: True))   # the loading path
    out = quantize_model(tiny_llama, tmp_path / "loading", QuantizeOptions(method="rtn", **TINY_OPTS), progress=False)
    assert any(".layers.0." in n for n in loaded)
    for f in sorted(p.name for p in ref.glob("*.safetensors")):
        a, b = SafetensorsFile(ref / f), SafetensorsFile(out / f)
        assert a.names() == b.names() and all(torch.equal(a.get(k), b.get(k)) for k in a.names()), f
