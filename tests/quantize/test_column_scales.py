"""Per-input-column scales folded into norms (quantize/column_scales.py, ``--column-scales norm``):
the fold is an exact identity of the block, the checkpoint computes the original model's
function up to quantization, the certificate holds on every folded layer, and the option
round-trips through ``quantization_config``."""
from __future__ import annotations

import json

import pytest
import torch

from vllm_latq.testing.tiny_models import TINY_OPTS, make_tiny_model
from tests.helpers import replay_blocks
from vllm_latq import format as fmt
from vllm_latq import hf_model
from vllm_latq.format.checkpoint import Checkpoint, load_dequantized_model
from vllm_latq.format.validate import validate_checkpoint
from vllm_latq.quantize import calibrate, capture
from vllm_latq.quantize import column_scales as cs
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

# which norm feeds which linears, per architecture (Gemma3: pre_feedforward_layernorm feeds the MLP;
# its post_* norms sit on the residual branch and its q/k norms after q/k_proj: none of them folds)
FEEDS = {"llama": {"input_layernorm": ("q_proj", "k_proj", "v_proj"), "post_attention_layernorm": ("gate_proj", "up_proj")},
         "gemma3": {"input_layernorm": ("q_proj", "k_proj", "v_proj"),
                    "pre_feedforward_layernorm": ("gate_proj", "up_proj")}}


def test_column_scales_equalise_d_s2():
    """c ∝ √D makes D_j (s/c_j)² equal over j (the one-scale certificate's optimum), geometric mean 1."""
    torch.manual_seed(0)
    X = torch.randn(400, 24, dtype=torch.float64) * torch.logspace(-1, 1, 24, dtype=torch.float64)
    H = X.T @ X
    c = cs.column_scales(H, max_ratio=1e6)
    T = torch.argsort(H.diagonal(), descending=True).flip(0)
    from vllm_latq.algorithms import lattice
    L, _ = lattice.cholesky(H, 0.01, T)
    D = lattice.d_by_column(L, T)
    per_col = D / c.double() ** 2
    assert torch.allclose(per_col, per_col.mean().expand_as(per_col), rtol=1e-5)
    assert abs(c.double().log().mean().item()) < 1e-5
    assert torch.equal(cs.column_scales(H, power=0.0), torch.ones(24))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fold_block_is_an_identity(arch, tmp_path):
    """Unquantized: folding leaves every block's output as it was (fp32), finds exactly the
    norm → linears pairs of the architecture, and Gemma's (1 + w) convention."""
    layers, kwargs, ref = replay_blocks(make_tiny_model(tmp_path / arch, arch, layers=2, dtype=torch.float32), 48)
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}"
        linears = hf_model.block_linears(layer, prefix)
        hs = calibrate.block_hessians(layer, linears, ref[i], kwargs[i], "", False)
        with torch.no_grad():
            before = capture.run_block(layer, ref[i], kwargs[i])  # (the last hidden state HF returns is normed)
        folding = cs.fold_block(layer, prefix, linears, hs.of, ref[i], kwargs[i])
        norms = {n.removeprefix(prefix + ".").removesuffix(".weight") for n in folding.norm_tensors}
        assert norms == set(FEEDS[arch])
        for norm, lins in FEEDS[arch].items():
            scales = [folding.scales[n] for n in linears if n.endswith(lins)]
            assert len(scales) == len(lins) and all(s is scales[0] for s in scales)   # one c per norm
            assert not torch.allclose(scales[0], torch.ones_like(scales[0]))
        with torch.no_grad():
            y = capture.run_block(layer, ref[i], kwargs[i])
        assert torch.allclose(y, before, rtol=1e-4, atol=1e-5)
        assert cs._unit_offset(layer.input_layernorm) == (arch == "gemma3")


def test_fold_refuses_a_norm_that_feeds_more_than_linears():
    """A block whose normed tensor also reaches the residual cannot fold: a clear error."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(8)
            self.proj = torch.nn.Linear(8, 8, bias=False)

        def forward(self, x):
            h = self.norm(x)
            return h + self.proj(h)

    torch.manual_seed(0)
    b = Block()
    with torch.no_grad():
        b.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 32, 8)
    h = calibrate.SharedHessians({"blk.proj": b.proj})
    b(x)
    h.end_forward()
    h.remove()
    with pytest.raises(ValueError, match="reaches more than its linears"):
        cs.fold_block(b, "blk", {"blk.proj": b.proj}, h.of, x, {})


def test_quantization_config_round_trip():
    qc = fmt.quantization_config("gptq", bits=4, group_size=128, order="act", damp=0.01,
                                 column_scales={"fold": "norm", "power": 0.5})
    spec = fmt.parse_quantization_config(json.loads(json.dumps(qc)))
    assert (spec.column_scale_fold, spec.column_scale_power) == ("norm", 0.5)
    old = fmt.quantization_config("gptq", bits=4, group_size=128, order="act", damp=0.01)
    assert "column_scales" not in old
    assert fmt.parse_quantization_config(old).column_scale_fold is None
    for bad, msg in (({"fold": "kernel", "power": 0.5}, "fold"), ({"fold": "norm", "power": -1}, "power"),
                     ({"fold": "norm"}, "column_scales must be")):
        with pytest.raises(fmt.FormatError, match=msg):
            fmt.parse_quantization_config({**old, "column_scales": bad})
    with pytest.raises(ValueError, match="calibrated method"):
        QuantizeOptions(method="rtn", column_scales="norm")
    with pytest.raises(ValueError, match="column_scales must be one of"):
        QuantizeOptions(column_scales="kernel")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_checkpoint_computes_the_model_and_keeps_the_certificate(arch, tmp_path):
    """8-bit GPTQ with column scales: the dequantized checkpoint's logits match the source
    model's about as closely as without them (the fold itself is exact: test above); HPTQ with column scales: every
    folded layer's error is within its certificate. The config records the option."""
    from transformers import AutoModelForCausalLM
    src = make_tiny_model(tmp_path / arch, arch, layers=2, dtype=torch.float32)
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(ids).logits
    err = {}
    for fold in ("none", "norm"):
        d = quantize_model(src, tmp_path / f"g8-{fold}", QuantizeOptions(method="gptq", bits=8, column_scales=fold,
                                                                         **TINY_OPTS), progress=False)
        validate_checkpoint(d)
        with torch.no_grad():
            got = load_dequantized_model(d, torch.float32).eval()(ids).logits
        err[fold] = ((got - ref).norm() / ref.norm()).item()
    assert err["none"] < 0.05 and err["norm"] < 1.5 * err["none"], err   # 8 bits: the fold adds no error of its own
    ck = Checkpoint(tmp_path / "g8-norm")
    assert ck.spec.column_scale_fold == "norm" and ck.spec.column_scale_power == 0.5
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(ck.tensor(norm), Checkpoint(tmp_path / "g8-none").tensor(norm))

    certs, hess = {}, {}

    def on_layer(n, W, H, r):
        certs[n], hess[n] = (r.error(W, H) / r.bound).max(), H

    quantize_model(src, tmp_path / "hptq", QuantizeOptions(method="hptq", column_scales="norm", **TINY_OPTS),
                   progress=False, on_layer=on_layer)
    assert len(certs) == 14 and max(certs.values()) <= 1.0
    assert all(torch.allclose(H, H.T, rtol=1e-12) for H in hess.values())   # the folded Hessians are whole, symmetric matrices


@pytest.mark.parametrize("unit_offset", [False, True])
def test_folded_norm_weight_is_exact_and_keeps_dead_channels(unit_offset):
    """γ′ = γ/c up to the dtype's rounding, and the returned scales are the ones γ′ really
    applies (γ/γ′); a channel with γ = 0 (Gemma3-270M has some) is kept, with c = 1."""
    one = 1.0 if unit_offset else 0.0
    w = torch.tensor([-one, 0.7, 1.3, 0.02], dtype=torch.bfloat16)
    c = torch.tensor([3.0, 1.7, 0.4, 2.5])
    new, c_eff = cs.folded_norm_weight(w, c, unit_offset)
    assert new.dtype == torch.bfloat16 and new[0] == w[0] and c_eff[0] == 1.0
    g, g_new = w.float() + one, new.float() + one
    assert torch.allclose(g_new * c_eff, g, rtol=1e-6)
    assert torch.allclose(c_eff[1:], c[1:], rtol=1e-2)


def test_folded_hessian_of_a_wide_panel_hessian_is_whole():
    """A PanelHessian wider than one panel sums only its upper triangle: the folded Hessian
    must be built from the symmetric ``.H`` (on Gemma3's 640-wide inputs it was not)."""
    from vllm_latq.quantize.hessian import PANEL, PanelHessian
    h = PanelHessian(PANEL + 88)
    h.add(torch.randn(700, PANEL + 88))
    c = torch.rand(PANEL + 88) + 0.5
    got = cs._scaled_hessian(h, c).H
    assert torch.allclose(got, cs.fold_hessian(h.H, c), rtol=1e-12) and torch.allclose(got, got.T, rtol=1e-12)
