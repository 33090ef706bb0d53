"""The CUDA boundary on CPU (``vllm_latq/testing/cuda_boundary.py``): vLLM's platform stubbed as
a CUDA GPU of capability sm_80/86/89/90, its CUDA ops replaced by CPU stand-ins.

First the stand-ins themselves, checked the way vLLM's own kernel tests check the real ops
(``tests/kernels/quantization/test_marlin_gemm.py``, ``test_machete_mm.py``, the Marlin MoE test):
a weight quantized and laid out by vLLM's pure-torch helpers, the op's product against
``a @ w_ref`` (a bias case included), and the contract checks a GPU would fail on. Then vLLM's real
linear and mixture-of-experts layers with latq's quant method, loaded from latq checkpoint tensors
through their weight loaders, processed and applied — fp16 and bf16, biases on and off, TP 1 and
2 (gloo, one process per rank), every capability — against latq's dequantized reference.
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

from vllm_latq.testing import boundary_layers as bl  # noqa: E402
from vllm_latq.testing.boundary_run import run_ranks  # noqa: E402
from vllm_latq.testing.cuda_boundary import cuda_boundary  # noqa: E402
from vllm_latq.testing.cuda_ops import OpContractError  # noqa: E402

WTYPES = [pytest.param(scalar_types.uint4b8, id="uint4b8"), pytest.param(scalar_types.uint8b128, id="uint8b128")]
DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


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
@pytest.mark.parametrize("group", [-1, 32, 64, 128])
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
@pytest.mark.parametrize("group", [-1, 64, 128])
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
@pytest.mark.parametrize("group", [-1, 64, 128])
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


# ============================================================================ vLLM's layers with latq's method

FORCED_VLLM = (("LATQ_KERNEL", "vllm"),)


def _vllm_cases() -> list[bl.Case]:
    """latq's standard form on vLLM's kernels: every linear type, fp16/bf16, biases on and off,
    every capability; coded scales (their fp16 decode handed over); one scale per row (vLLM's
    channelwise form, row-parallel at TP 2); the MoE layer at each."""
    return ([bl.Case(layer, dtype, cc, bias) for layer in ("qkv", "gate_up", "down", "column")
             for dtype in ("fp16", "bf16") for cc in bl.CCS for bias in (False, True)]
            + [bl.Case("qkv", "bf16", 80, True, scale_bits=4), bl.Case("down", "fp16", 90, scale_bits=4)]
            + [bl.Case("down", dtype, cc, True, group=bl.DOWN_K) for dtype, cc in (("fp16", 80), ("bf16", 90))]
            + [bl.Case("moe", dtype, cc) for dtype in ("fp16", "bf16") for cc in bl.CCS])


def _latq_cases(tp: int) -> list[bl.Case]:
    """Forms no vLLM kernel takes (CSR outliers, 3 bits) and 32-bit activations, which vLLM's
    kernels would be handed but cannot compute: latq's Triton kernels, in the interpreter,
    reached through the same layers (at TP 2 one of them: the interpreter's time); forcing
    ``vllm`` there; on the host, vLLM's CPU kernel where forced."""
    triton = ([bl.Case("qkv", "fp16", 80, True, outliers=0.01), bl.Case("qkv", "bf16", 90, True, outliers=0.01),
               bl.Case("down", "bf16", 86, True, bits=3), bl.Case("down", "fp32", 90),
               bl.Case("moe", "bf16", 89, outliers=0.01), bl.Case("moe", "fp32", 90),
               bl.Case("qkv", "fp16", 86, True, env=(("LATQ_KERNEL", "triton"),))] if tp == 1 else [])
    return (triton + [bl.Case("qkv", "fp32", 80, True)]
            + [bl.Case("qkv", "fp32", 80, env=FORCED_VLLM), bl.Case("moe", "fp32", 80, env=FORCED_VLLM)]
            + [bl.Case(layer, dtype, 0, True, env=FORCED_VLLM) for layer in ("qkv", "down")
               for dtype in ("fp16", "bf16")])


PLACEMENT = bl.Case("placement", "bf16", 90)
PLAN = {tp: _vllm_cases() + _latq_cases(tp) + [PLACEMENT] * (tp == 1) for tp in (1, 2)}


@pytest.fixture(scope="module")
def tp_results():
    """Every case on TP 1 (one process) and TP 2 (two gloo ranks), run once for the module."""
    return run_ranks(PLAN)


def _records(tp_results, tp, case):
    recs = tp_results[tp][case.id]
    assert len(recs) == tp
    return recs


def _vllm_kernel(case: bl.Case, tp: int) -> str:
    if case.layer == "moe":
        return "vllm:MarlinExperts"
    return "vllm:" + ("MacheteLinearKernel" if case.cc == 90 and _machete_takes(case, tp) else "MarlinLinearKernel")


def _machete_takes(case: bl.Case, tp: int) -> bool:
    """Machete (Hopper) takes groups of 64 and 128 (or one per row), K a multiple of 64 and N of
    128: down_proj's 288 columns a rank at TP 2 (groups of gcd(128, 288) = 32) and the column
    layer's 192 rows a rank are Marlin's."""
    return not (case.layer in ("down", "column") and tp == 2)


def _served_bits(case: bl.Case, tp: int) -> float:
    """4-bit words plus one 16-bit scale per group vLLM is told, gcd(g, this rank's K) (one per
    row for channelwise), on the N and K Marlin pads to (``marlin_padded_nk``: 288 → 320 at TP 2);
    the experts' g64 halved where this rank's intermediate size is the group
    (``marlin_scale_hazard``)."""
    import math

    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_padded_nk
    if case.layer == "moe":
        return 4 + 16 / (64 if tp == 1 else 32)
    n, k = {"qkv": ((bl.HEADS + 2 * bl.KV_HEADS) * bl.HEAD // tp, bl.HIDDEN),
            "gate_up": (2 * bl.INTER // tp, bl.HIDDEN), "column": (bl.COL_N // tp, bl.HIDDEN),
            "down": (bl.HIDDEN, bl.DOWN_K // tp)}[case.layer]
    g = math.gcd(case.group, k)
    channel = g == k                                # one scale per row: vLLM's channelwise form
    pn, pk = (n, k) if "Machete" in _vllm_kernel(case, tp) else marlin_padded_nk(n, k, -1 if channel else g)
    return (4 * pk + 16 * (1 if channel else pk // g)) * pn / (n * k)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", _vllm_cases(), ids=lambda c: c.id)
def test_standard_form_on_vllms_kernels(case, tp, tp_results):
    """vLLM's kernel class processes and applies latq's layer through vLLM's own scheme: within
    the kernel's rounding of latq's dequantized reference (a permuted bias or scale is not), the
    load report naming the class and the bits it streams."""
    for rank, rec in enumerate(_records(tp_results, tp, case)):
        assert rec["ok"], (f"rank {rank}", rec.get("error") or rec, rec.get("traceback", ""))
        assert rec["kernel"] == _vllm_kernel(case, tp), rec
        assert rec["served_bits"] == pytest.approx(_served_bits(case, tp)), rec


def test_scheme_parameters_are_made_on_the_layers_device(tp_results):
    """vLLM's scheme parameters, registered at ``process_weights_after_loading`` (outside vLLM's
    device context), are made where latq's tensors are — on a GPU the layer's device: from tensors
    on the meta device, every dense and expert parameter is on it."""
    rec, = tp_results[1][PLACEMENT.id]
    assert rec["ok"], rec


def _latq_expected(case: bl.Case) -> tuple[str | None, str]:
    """(the kernel serving the layer, the words of vLLM's refusal in the load report's table)."""
    if case.cc == 0:
        return "vllm:CPUWNA16LinearKernel", ""
    if case.env:                    # forced: the forced kernel, no refusals asked
        return dict(case.env)["LATQ_KERNEL"], ""
    if case.dtype == "fp32":
        experts = "MarlinExperts" if case.layer == "moe" else None
        return "triton", f"which computes no torch.float32 activations" if experts is None else \
            f"vLLM picks {experts}, which computes no torch.float32"
    return "triton", "CSR outliers" if case.outliers else f"vLLM has no kernel for uint{case.bits}b"


@pytest.mark.parametrize("case,tp", [(c, tp) for tp in (1, 2) for c in _latq_cases(tp)],
                         ids=lambda v: v.id if isinstance(v, bl.Case) else str(v))
def test_other_forms_and_dtypes_on_latqs_kernels(case, tp, tp_results):
    """What no vLLM kernel takes — or would take but not compute: 32-bit activations into Marlin or
    Machete (their ``can_implement`` never asks) — runs on latq's Triton kernels through the same
    layers, the refusal's reason in the load report's table; forcing ``vllm`` there fails at load
    with that reason. On the host, forced ``vllm`` runs vLLM's real CPU kernel on its scheme."""
    want, why = _latq_expected(case)
    for rank, rec in enumerate(_records(tp_results, tp, case)):
        if case.env == FORCED_VLLM and case.cc:
            assert not rec["ok"] and "LATQ_KERNEL=vllm" in rec["error"] and "torch.float32" in rec["error"], rec
            continue
        assert rec["ok"], (f"rank {rank}", rec.get("error") or rec, rec.get("traceback", ""))
        assert rec["kernel"] == want and why in rec.get("table", ""), rec


# ============================================================================ what vLLM would pick but cannot compute

ACTS = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
        pytest.param(torch.float32, id="fp32")]
FORMS = {"4bit-g32": (4, 32, 512), "4bit-g64": (4, 64, 512), "4bit-g128": (4, 128, 512),
         "4bit-channel": (4, 512, 512), "8bit-g64": (8, 64, 512), "4bit-g128-K576": (4, 128, 576)}


def _op_computes(kernel: str, act: torch.dtype) -> bool:
    """Whether the CUDA op the kernel class calls accepts ``act`` activations (the stand-ins carry
    the ops' own checks)."""
    from vllm_latq.testing import cuda_ops
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


@pytest.mark.parametrize("cc", bl.CCS, ids=[f"sm{c}" for c in bl.CCS])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("form", FORMS)
def test_what_vllm_would_pick_but_cannot_compute_is_refused(form, act, cc):
    """Every (activation dtype × form × capability): the kernel vLLM's ``choose_mp_linear_kernel``
    picks for it (what its scheme would use), whether that kernel's op computes the dtype, and
    latq's decision — latq takes vLLM's pick only where it computes, and otherwise says why."""
    from vllm.model_executor.kernels.linear import choose_mp_linear_kernel

    from vllm_latq.kernels import vllm_mp
    from vllm_latq.testing.weights import random_weight
    bits, group, k = FORMS[form]
    w = random_weight(256, k, bits, 0.0, group=group)
    with cuda_boundary(cc):
        picked = choose_mp_linear_kernel(vllm_mp.layer_config(w, act)).__name__
        kernel, why = vllm_mp.choose(w, torch.device("cuda"), act)
    if _op_computes(picked, act):
        assert kernel is not None and kernel.__name__ == picked, why
    else:
        assert kernel is None and why == (f"vLLM picks {picked}, which computes no {act} activations "
                                          "(only torch.float16, torch.bfloat16)")


@pytest.mark.parametrize("cc", [80, 90], ids=["sm80", "sm90"])
@pytest.mark.parametrize("act", ACTS)
def test_what_vllms_moe_backend_would_pick_but_cannot_compute_is_refused(act, cc):
    from vllm_latq.kernels import vllm_mp
    from vllm_latq.plugin import vllm_scheme
    from vllm_latq.testing.vllm_experts import fused_moe_config
    from vllm_latq.testing.weights import random_weight
    weights = {(e, s): random_weight(*shape, 4, 0.0, group=64, seed=e) for e in range(4)
               for s, shape in (("w13", (256, 256)), ("w2", (256, 128)))}
    config = fused_moe_config(4, 2, 256, 128, "cuda", act)
    with cuda_boundary(cc):
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.\
            compressed_tensors_moe_wna16 import CompressedTensorsWNA16MoEMethod
        picked = CompressedTensorsWNA16MoEMethod(vllm_scheme.quant_args(4, 64), None, config).experts_cls.__name__
        method, why = vllm_scheme.choose_experts(weights, config, torch.device("cuda"), "experts")
    if _op_computes(picked, act):
        assert method is not None and method.experts_cls.__name__ == picked, why
    else:
        assert method is None and why == vllm_mp.computes_refusal(picked, act) and "torch.float32" in why


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
