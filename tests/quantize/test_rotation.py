"""Incoherence processing (``--rotate hadamard``): the rotation's math and seed rule, the
certificate in the rotated frame, the format's ``rotation`` key and the pipeline end to end."""
from __future__ import annotations

import math

import pytest
import torch

from vllm_latq import format as fmt
from vllm_latq.algorithms import gptq, hptq, ssqr
from vllm_latq.algorithms.lattice import layer_error
from vllm_latq.algorithms.rotation import rotate_hessian, rotate_weight, served_weight
from vllm_latq.format.rotation import Rotation, fwht_, hadamard_signs, matrix, random_hadamard, rotate, unrotate


def sylvester(b: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < b:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


@pytest.mark.parametrize("n,block", [(576, 64), (1536, 256), (640, 128), (2048, 256), (96, 32), (45, 1), (256, 256)])
def test_block_is_the_largest_power_of_two_dividing_n_up_to_the_cap(n, block):
    assert Rotation(0).block_size(n) == block
    assert Rotation(0, max_block=16).block_size(n) == min(16, block)


@pytest.mark.parametrize("b", [1, 2, 8, 64, 256])
def test_fwht_is_the_sylvester_hadamard_product(b):
    x = torch.randn(5, 3 * b, dtype=torch.float64)
    want = x @ torch.block_diag(*[sylvester(b)] * 3)
    assert torch.allclose(fwht_(x.clone(), b), want, atol=1e-12 * b)


@pytest.mark.parametrize("b,seed", [(64, 0), (256, 7), (8, 123456789), (128, 3), (32, 1)])
def test_the_rotation_is_compressed_tensors_random_hadamard_of_the_seed(b, seed):
    """R_b = random_hadamard_matrix(b, gen=Generator().manual_seed(seed)) / √b exactly (its
    precision float32 draws the same signs), in every block of R — except at b = 32, where
    compressed-tensors takes a stored 32×32 Hadamard matrix that is not Sylvester's (the same
    signs, another matrix): the exports store R's matrix (``random_hadamard``), never the seed."""
    ct = pytest.importorskip("compressed_tensors.transform.utils.hadamard")
    M = ct.random_hadamard_matrix(b, torch.float32, gen=torch.Generator().manual_seed(seed)).double()
    signs = hadamard_signs(seed, b)
    R = matrix(signs, 2 * b)
    assert torch.equal(R[:b, :b], R[b:, b:]) and not R[:b, b:].any()
    assert torch.equal(random_hadamard(signs), R[:b, :b] * math.sqrt(b))
    assert torch.equal(R[:b, :b], M / math.sqrt(b)) == (b != 32)


def test_rotation_is_orthogonal_and_unrotate_its_exact_inverse():
    s = hadamard_signs(3, 64)
    R = matrix(s, 192)
    assert torch.allclose(R @ R.T, torch.eye(192, dtype=torch.float64), atol=1e-14)
    x = torch.randn(4, 7, 192, dtype=torch.float64)
    assert torch.allclose(rotate(x, s), x @ R, atol=1e-13)
    assert torch.allclose(unrotate(rotate(x, s), s), x, atol=1e-13)
    assert torch.allclose(unrotate(x, s), x @ R.T, atol=1e-13)
    xb = torch.randn(3, 192).bfloat16()
    assert rotate(xb, s).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="not a multiple"):
        rotate(torch.randn(2, 100), s)


def test_rotated_problem_is_the_dense_one():
    s = hadamard_signs(1, 32)
    R = matrix(s, 96)
    W = torch.randn(40, 96)
    X = torch.randn(300, 96, dtype=torch.float64)
    H = X.T @ X
    assert torch.allclose(rotate_weight(W, s).double(), W.double() @ R, atol=1e-5)
    Hr = rotate_hessian(H, s)
    assert torch.equal(Hr, Hr.T) and torch.allclose(Hr, R.T @ H @ R, rtol=1e-12, atol=1e-9)


def _outlier_problem(seed=0, out=48, c=128):
    """W with a few outlier input columns, H from correlated inputs with heavy columns."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, c, generator=g)
    W[:, [3, 70]] *= 12
    X = torch.randn(512, c, generator=g, dtype=torch.float64) @ (torch.eye(c, dtype=torch.float64)
                                                                 + 0.1 * torch.randn(c, c, generator=g,
                                                                                     dtype=torch.float64))
    X[:, 5] *= 20
    return W, X.T @ X / 512


@pytest.mark.parametrize("method", ["gptq", "ssqr", "hptq"])
def test_certificate_holds_in_the_rotated_frame_and_is_the_served_layers(method):
    """Solved on (W·R, RᵀHR): the bound holds there and is the bound of that very solve, and the
    served weight Q·Rᵀ has the same damped error against (W, H): λ = damp·tr(H)/n is
    rotation-invariant, so Rᵀ(H + λI)R is the rotated problem's damped Hessian."""
    W, H = _outlier_problem()
    s = Rotation(5).signs(W.shape[1])
    Wr, Hr = rotate_weight(W, s), rotate_hessian(H, s)
    solve = {"gptq": lambda W_, H_: gptq(W_, H_, bits=3, group_size=32, clip=False),
             "ssqr": lambda W_, H_: ssqr(W_, H_, bits=3, group_size=32, outlier_rate=0.01),
             "hptq": lambda W_, H_: hptq(W_, H_, target_bits=3.0)}[method]
    res = solve(Wr, Hr)
    err = res.error(Wr, Hr)
    assert (err <= res.bound * (1 + 1e-6)).all()
    again = solve(Wr.clone(), Hr.clone())
    assert torch.equal(again.z, res.z) and torch.equal(again.bound, res.bound)
    served = served_weight(res.q, s)
    err_orig = layer_error(W, served, H, res.damp)
    assert torch.allclose(err_orig, err, rtol=1e-4)


def test_rotation_spreads_outlier_columns():
    """The point of it: GPTQ's error on a layer with outlier columns falls once rotated."""
    W, H = _outlier_problem(1)
    s = Rotation(0).signs(W.shape[1])
    plain = gptq(W, H, bits=3, group_size=32)
    rot = gptq(rotate_weight(W, s), rotate_hessian(H, s), bits=3, group_size=32)
    e_plain = layer_error(W, plain.q, H).sum()
    e_rot = layer_error(W, served_weight(rot.q, s), H).sum()
    assert e_rot < 0.7 * e_plain


# ----------------------------------------------------------------------------- the format

def test_quantization_config_writes_version_2_with_the_rotation():
    qc = fmt.quantization_config("gptq", bits=3, group_size=64, order="act", damp=0.01, rotation=Rotation(9))
    assert qc["format_version"] == 2 and qc["rotation"] == {"kind": "hadamard", "seed": 9, "max_block": 256}
    spec = fmt.parse_quantization_config(qc)
    assert spec.rotation == Rotation(9) and spec.version == 2
    plain = fmt.quantization_config("gptq", bits=3, group_size=64, order="act", damp=0.01)
    assert plain["format_version"] == 1 and "rotation" not in plain
    assert fmt.parse_quantization_config(plain).rotation is None


@pytest.mark.parametrize("change,msg", [
    ({"format_version": 1}, "rotation needs format_version 2"),
    ({"rotation": {"kind": "walsh", "seed": 0, "max_block": 64}}, "rotation.kind is 'walsh'"),
    ({"rotation": {"kind": "hadamard", "seed": -1, "max_block": 64}}, "rotation.seed must be"),
    ({"rotation": {"kind": "hadamard", "seed": 0, "max_block": 48}}, "max_block must be a power of two"),
    ({"rotation": {"kind": "hadamard", "seed": 0, "max_block": 512}}, "max_block must be a power of two"),
    ({"rotation": {"kind": "hadamard", "seed": 0}}, "rotation must be null or"),
    ({"rotation": "hadamard"}, "rotation must be null or"),
])
def test_bad_rotation_configs_are_refused(change, msg):
    qc = fmt.quantization_config("gptq", bits=3, group_size=64, order="act", damp=0.01, rotation=Rotation(0))
    qc.update(change)
    with pytest.raises(fmt.FormatError, match=msg):
        fmt.parse_quantization_config(qc)


# ----------------------------------------------------------------------------- the pipeline

ROTATED_RUNS = {
    "rtn": dict(method="rtn", bits=3),
    "gptq": dict(method="gptq", bits=3),
    "gptq-coded": dict(method="gptq", bits=3, scale_bits=4),
    "ssqr": dict(method="ssqr", bits=3),
    "hptq": dict(method="hptq", target_bits=3.0),
    "gptq-target": dict(method="gptq", bits=3, target_correction=True),
    "gptq-head": dict(method="gptq", bits=3, quantize_lm_head=True),
}


@pytest.mark.parametrize("run", list(ROTATED_RUNS))
def test_pipeline_solves_every_linear_in_its_rotated_frame(run, tiny_llama, tmp_path):
    """``--rotate hadamard`` for every method: the checkpoint records the rotation (format v2),
    validates, and its dequantized model serves Q·Rᵀ — exactly the solver's result rotated back;
    each layer's integers are those of the solver on (W·R, RᵀHR), its record carries the block,
    and the certificate holds in that frame."""
    from vllm_latq.format.checkpoint import Checkpoint
    from vllm_latq.format.validate import validate_checkpoint
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    from vllm_latq.quantize.solve_layers import SOLVERS
    from vllm_latq.testing.tiny_models import TINY_OPTS
    opts = QuantizeOptions(**{**TINY_OPTS, **ROTATED_RUNS[run]}, rotate="hadamard", rotate_seed=11)
    seen = {}
    d = quantize_model(tiny_llama, tmp_path / run, opts, progress=False,
                       on_layer=lambda n, W, H, r: seen.__setitem__(n, (W, H, r, r.z.clone(), r.q.clone())))
    report = validate_checkpoint(d)
    ck = Checkpoint(d)
    assert ck.spec.rotation == Rotation(11) and ck.config["quantization_config"]["format_version"] == 2
    assert report["totals"]["layers"] == len(seen) == 14 + ("head" in run)
    deq = dict(ck.dequantized_tensors(torch.float32))
    stats = {s["name"]: s for s in ck.stats()["layers"]}
    kw = opts.solver_kwargs()
    for name, (Wr, Hr, res, z, q_rot) in seen.items():
        s = Rotation(11).signs(Wr.shape[1])
        assert stats[name]["rotation_block"] == s.numel()
        assert torch.equal(deq[f"{name}.weight"], res.q) and torch.equal(res.q, unrotate(q_rot, s)), name
        if run in ("gptq", "ssqr") and name.endswith(("q_proj", "down_proj")):   # the same solve, run directly
            again = SOLVERS[opts.method](Wr, Hr, name=name, **kw)
            assert torch.equal(again.z, z), name
        if run in ("ssqr", "hptq"):
            assert stats[name]["cert"] <= 1.0 + 1e-6, name
    if run == "gptq":   # latq-inspect's served bits count the signs the kernels read
        from vllm_latq.kernels.served_report import checkpoint_served
        rows = [dict(r) for r in report["layers"]]
        checkpoint_served(d, rows)
        served = [(r, f) for r in rows for f in r["served"].values()]
        assert any(f["kernel"] != "bf16" for _, f in served)
        counted = {}   # block → layers whose served bytes include its signs: the first of the block only
        for r, f in served:   # the bf16 fallback folds the rotation into its weights
            block = Rotation(11).block_size(r["shape"][1])
            if f["kernel"] != "bf16" and "rotation" in f["parts"]:
                assert f["parts"]["rotation"] == 4 * block
                counted.setdefault(block, set()).add(r["name"])
        assert counted and all(len(names) == 1 for names in counted.values()), counted
    if run == "rtn":   # uncalibrated: its rotated weight is the source's, rotated
        from safetensors.torch import load_file
        src = load_file(str(next(tiny_llama.glob("*.safetensors"))))
        name = "model.layers.0.self_attn.q_proj"
        W = src[f"{name}.weight"]
        assert torch.equal(seen[name][0], rotate_weight(W, Rotation(11).signs(W.shape[1])))


def test_rotated_mixture_of_experts(tmp_path):
    """A Qwen3-MoE block's experts are rotated like every linear (gate/up on the hidden size, down
    on the expert's width): the checkpoint validates and latq-eval's model holds Q·Rᵀ."""
    from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
    from vllm_latq.format.validate import validate_checkpoint
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    from vllm_latq.testing.tiny_models import TINY_OPTS, make_tiny_model
    src = make_tiny_model(tmp_path / "src", "qwen3_moe", layers=1)
    seen = {}
    d = quantize_model(src, tmp_path / "out", QuantizeOptions(method="gptq", bits=3, rotate="hadamard", **TINY_OPTS),
                       progress=False, on_layer=lambda n, W, H, r: seen.__setitem__(n, r))
    validate_checkpoint(d)
    ck = Checkpoint(d)
    stats = {s["name"]: s for s in ck.stats()["layers"]}
    e0 = "model.layers.0.mlp.experts.0"
    assert stats[f"{e0}.gate_proj"]["rotation_block"] == 16 and stats[f"{e0}.down_proj"]["rotation_block"] == 8
    model = load_dequantized_model(d)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(gate_up[0, :40], seen[f"{e0}.gate_proj"].q)
    assert torch.equal(model.model.layers[0].mlp.experts.down_proj[0], seen[f"{e0}.down_proj"].q)


def test_rotation_options_are_checked_and_recorded():
    from vllm_latq.quantize.pipeline import QuantizeOptions
    qc = QuantizeOptions(method="ssqr", rotate="hadamard", rotate_seed=4).quantization_config([])
    assert qc["rotation"] == {"kind": "hadamard", "seed": 4, "max_block": 256} and qc["format_version"] == 2
    assert "rotation" not in QuantizeOptions().quantization_config([])
    with pytest.raises(ValueError, match="rotate must be one of none, hadamard"):
        QuantizeOptions(rotate="givens")
    with pytest.raises(ValueError, match="rotate_seed"):
        QuantizeOptions(rotate="hadamard", rotate_seed=-1)


@pytest.mark.slow
def test_rotated_under_torchrun_equals_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 -m vllm_latq.quantize … --rotate hadamard``: every rank
    rotates the linears it solves, the shared weights are the served Q·Rᵀ, so the checkpoint is one
    process's byte for byte (the ranks' Hessian sums are exact)."""
    from tests.quantize.test_distributed import ok, quantize, same_bytes
    from vllm_latq.format.checkpoint import Checkpoint
    from vllm_latq.format.validate import validate_checkpoint
    from vllm_latq.testing.tiny_models import make_tiny_model
    src = make_tiny_model(tmp_path / "src", "llama")
    for w in (1, 2):
        ok(quantize(src, tmp_path / f"w{w}", w, "--bits", "3", "--rotate", "hadamard", "--rotate-seed", "5"))
        validate_checkpoint(tmp_path / f"w{w}")
        assert Checkpoint(tmp_path / f"w{w}").spec.rotation == Rotation(5)
    assert same_bytes(tmp_path / "w1", tmp_path / "w2")
