"""A rotated layer served through latq's runtime form (``LatqWeight.rotation``): the input
transform on every path — torch's butterflies, the C++ op (AVX-512, AVX2, scalar), Triton's
kernel in the interpreter — and every kernel family (reference, fp32 and bf16 dequantized, CPU
in Python and as its native op, Triton) against the reference; mixture-of-experts layers too."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import op_setting
from vllm_latq import native
from vllm_latq.format.rotation import Rotation, hadamard_signs, matrix, rotate, unrotate
from vllm_latq.kernels import moe, ops, selector
from vllm_latq.kernels.cpu.kernel import CPUKernel
from vllm_latq.kernels.dequantized import DequantizedBf16Kernel, DequantizedFp32Kernel
from vllm_latq.kernels.reference import ReferenceKernel, latq_linear_ref
from vllm_latq.kernels.rotated import RotatedKernel, rotate_activations, rotated_kernel
from vllm_latq.kernels.weight import dequantize
from vllm_latq.testing.weights import random_weight

BLOCKS = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def hadamard_isa(name: str):
    return op_setting("hadamard_isa", name)


@pytest.fixture(params=["", "avx2", "avx512"])
def isa(request, native_ops):
    """Each instruction set of the C++ transform ("": the build's pick), skipped where this CPU or
    build lacks it; asked at the test, so collecting the tests builds nothing."""
    try:
        with hadamard_isa(request.param):
            pass
    except RuntimeError as e:
        pytest.skip(str(e))
    return request.param


@pytest.mark.parametrize("b", BLOCKS + [512])
def test_cpu_transform_is_the_torch_one(isa, b):
    """fp32: the same passes in the same order, bit for bit; bf16/fp16: the same fp32 values
    rounded once (a block past the format's 256 takes the scalar path on every instruction set)."""
    s = hadamard_signs(b, b)
    with hadamard_isa(isa):
        for rows in (1, 3, 17):
            x = torch.randn(rows, 3 * b * (1 if b > 32 else 4))
            assert torch.equal(torch.ops.latq_cpu.hadamard(x, s), rotate(x, s))
            for dt in (torch.bfloat16, torch.float16):
                assert torch.equal(torch.ops.latq_cpu.hadamard(x.to(dt), s), rotate(x.to(dt), s))
        x3 = torch.randn(2, 5, 2 * b)
        assert torch.equal(torch.ops.latq_cpu.hadamard(x3, s), rotate(x3, s))
        many = torch.randn(300, max(512, b)).bfloat16()   # rows split over the threads
        assert torch.equal(torch.ops.latq_cpu.hadamard(many, s), rotate(many, s))


def test_cpu_transform_refuses_bad_shapes():
    if not native.available():
        pytest.skip("no C++ ops")
    with pytest.raises(RuntimeError, match="not a multiple of the block"):
        torch.ops.latq_cpu.hadamard(torch.randn(2, 24), hadamard_signs(0, 16))
    with pytest.raises(RuntimeError, match="power of two"):
        torch.ops.latq_cpu.hadamard(torch.randn(2, 24), torch.ones(12))


@pytest.mark.parametrize("b", BLOCKS)
def test_triton_transform_in_the_interpreter(b):
    triton = pytest.importorskip("vllm_latq.kernels.triton.hadamard")
    s = hadamard_signs(3, b)
    for rows, dt in ((1, torch.float32), (5, torch.float32), (19, torch.bfloat16), (2, torch.float16)):
        x = torch.randn(rows, 2 * b).to(dt)
        y = triton.hadamard(x, s)
        assert y.dtype == dt
        torch.testing.assert_close(y.float(), rotate(x.float(), s).to(dt).float(), rtol=1e-2 if dt != torch.float32
                                   else 1e-6, atol=1e-5)
    x = torch.randn(3, 4, 2 * b)[:, 1]   # a strided view
    torch.testing.assert_close(triton.hadamard(x, s), rotate(x, s), rtol=1e-6, atol=1e-6)


def rotated_weight(out=48, cin=192, bits=4, rate=0.01, group=64, seed=0, **kw):
    w = random_weight(out, cin, bits, rate, group=group, seed=seed, scale_lo=0.002, scale_span=0.02, val_std=0.2,
                      fp16_values=True, **kw)
    return replace(w, rotation=Rotation(seed).signs(cin))


def test_reference_is_the_rotated_dense_layer():
    """(x·R)·Qᵀ = x·(Q·Rᵀ)ᵀ: the reference equals the served weight's plain product."""
    w = rotated_weight()
    x = torch.randn(5, w.in_features, dtype=torch.float64)
    R = matrix(w.rotation, w.in_features)
    served = dequantize(w).double() @ R.T
    torch.testing.assert_close(latq_linear_ref(x.float(), w).double(), x @ served.T, rtol=1e-4, atol=1e-4)
    assert torch.allclose(unrotate(dequantize(w).double(), w.rotation), served, atol=1e-12)


def _check(y, x, w, bias=None, compute=None):
    """``compute``: the dtype the kernel multiplies in (default x's)."""
    ref = latq_linear_ref(x, w, bias).float()
    eps = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 2.0 ** -18}[compute or x.dtype]
    torch.testing.assert_close(y.float(), ref, rtol=eps, atol=eps * ref.abs().max().item())


@pytest.mark.parametrize("kernel", [ReferenceKernel, DequantizedFp32Kernel, DequantizedBf16Kernel, CPUKernel])
@pytest.mark.parametrize("m", [1, 3, 700])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_kernel_family_serves_a_rotated_layer(kernel, m, dtype):
    """The selector's wrapper (or the bf16 fallback's fold) on a rotated layer matches the
    reference, through ``apply`` and through the op a vLLM layer calls (the CPU kernel's native
    op rotates by its 11th tensor; M = 700 takes its large-M path back to Python)."""
    w = rotated_weight(bits=4, rate=0.02)
    served = selector.for_weight(kernel, w)
    assert (served is kernel) == (kernel is DequantizedBf16Kernel)
    assert served is kernel or served.name == f"{kernel.name}+hadamard"
    state = served.prepare(w)
    x = torch.randn(m, w.in_features).to(dtype)
    bias = torch.randn(w.out_features).to(dtype)
    compute = torch.bfloat16 if kernel in (DequantizedBf16Kernel, CPUKernel) else None
    _check(served.apply(state, x, bias), x, w, bias, compute)
    tensors, ints = served.flatten(state)
    _check(ops.op_for(served)(x, tensors, ints, bias, w.out_features), x, w, bias, compute)
    if kernel is CPUKernel and native.available():
        assert ops.op_for(served) is torch.ops.latq_cpu.linear.default and len(tensors) == 11
    assert served.served_bytes(state).get("rotation", 0) == (0 if served is kernel else 4 * w.rotation.numel())


def test_layers_of_one_block_share_their_signs_and_the_report_counts_them_once():
    """R depends only on the seed and the block: two layers' prepared states hold one signs tensor,
    and the load report counts its bytes with the first layer only."""
    from vllm_latq.plugin.load_report import LoadReport
    a, b = rotated_weight(bits=4, rate=0.0), rotated_weight(bits=3, rate=0.0)
    served = selector.for_weight(CPUKernel, a)
    sa, sb = served.prepare(a), served.prepare(b)
    assert sa.signs is sb.signs
    report = LoadReport("gptq")
    for w, st in ((a, sa), (b, sb)):
        report.expect()
        report.add("model.layers.0.mlp.down_proj", w, served, st, 4.0)
    n = a.out_features * a.in_features
    plain = [8 * sum(v for k, v in served.served_bytes(st).items() if k != "rotation") / n for st in (sa, sb)]
    assert report.layers[0].served_bits == pytest.approx(plain[0] + 8 * 4 * a.rotation.numel() / n)
    assert report.layers[1].served_bits == pytest.approx(plain[1])


def test_cpu_rotated_layer_through_the_lean_op(isa):
    """A rotated CPU layer without outliers is served by ``latq_cpu::rotated_plain_linear`` (the
    lean op, the signs after ``out_features``: ``ops.plain_call``): bit for bit the list op with the
    signs as its 11th tensor, and torch's rotation (``format.rotation.rotate``) then the plain op,
    in bf16, fp16 and fp32, at M = 1, 3, 8, on 3-D x and past the large-M threshold, on each
    transform instruction set."""
    from vllm_latq.kernels.cpu.kernel import large_m
    w = rotated_weight(out=64, cin=384, rate=0.0, group=64)   # 128-column blocks
    served = rotated_kernel(CPUKernel)
    state = served.prepare(w)
    tensors, ints = served.flatten(state)
    lean, rest = ops.plain_call(served, state, tensors)
    assert lean is torch.ops.latq_cpu.rotated_plain_linear.default and rest == (len(tensors) - 1,)
    plain = torch.ops.latq_cpu.plain_linear.default
    inner_t, _ = CPUKernel.flatten(state.inner)
    listed = ops.op_for(served)
    g = torch.Generator().manual_seed(5)
    with hadamard_isa(isa):   # shapes in turn: the op's scratch grows, then takes smaller shapes in place
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            for shape in ((3, 384), (1, 384), (8, 384), (2, 3, 384), (1, 384), (large_m() + 1, 384)):
                x = torch.randn(*shape, generator=g).to(dt)
                got = lean(x, tensors[0], tensors[1], ints, 64, state.signs)
                assert got.dtype == dt and got.shape == (*shape[:-1], 64)
                assert torch.equal(got, listed(x, tensors, ints, None, 64)), (shape, dt)
                assert torch.equal(got, plain(rotate(x, w.rotation), inner_t[0], inner_t[1], ints, 64)), (shape, dt)
    outliers = served.prepare(rotated_weight(out=64, cin=384, rate=0.02, group=64))
    assert ops.plain_call(served, outliers, served.flatten(outliers)[0]) is None   # the list op's layer


def test_cpu_kernel_pure_torch_path_is_the_same():
    w = rotated_weight(bits=3, rate=0.01)
    served = rotated_kernel(CPUKernel)
    x = torch.randn(2, w.in_features).bfloat16()
    with native.disabled():
        state = served.prepare(w)
        y = served.apply(state, x)
    _check(y, x, w)


def test_selector_wraps_the_kernel_it_picks_for_a_rotated_layer():
    w = rotated_weight()
    k = selector.select(w, torch.device("cpu"), torch.bfloat16)
    assert issubclass(k, RotatedKernel) and k.inner is selector.select(replace(w, rotation=None),
                                                                       torch.device("cpu"), torch.bfloat16)
    for kern in selector.kernels():
        for wrapped in (kern, rotated_kernel(kern)):
            assert selector.kernel_at(selector.kernel_index(wrapped)) is wrapped
    assert rotated_kernel(CPUKernel) is rotated_kernel(CPUKernel)
    assert rotated_kernel(CPUKernel).label(rotated_kernel(CPUKernel).prepare(w)) == "cpu+hadamard"


def test_triton_kernel_serves_a_rotated_layer():
    tk = pytest.importorskip("vllm_latq.kernels.triton.kernel")
    if not tk.INTERPRET:
        pytest.skip("kernel tests run in Triton's interpreter")
    w = rotated_weight(out=40, cin=256, bits=3, rate=0.01)
    served = rotated_kernel(tk.TritonKernel)
    state = served.prepare(w)
    for m in (1, 9):
        x = torch.randn(m, w.in_features).half()
        _check(served.apply(state, x), x, w)


# ----------------------------------------------------------------------------- mixture of experts

def _experts(E=3, hidden=64, inter=32, rotated=True):
    experts = []
    for e in range(E):
        w13 = random_weight(2 * inter, hidden, 4, 0.0, group=32, seed=10 + e, scale_lo=0.01, scale_span=0.02)
        w2 = random_weight(hidden, inter, 4, 0.0, group=32, seed=20 + e, scale_lo=0.01, scale_span=0.02)
        if rotated:
            w13 = replace(w13, rotation=Rotation(0).signs(hidden))
            w2 = replace(w2, rotation=Rotation(0).signs(inter))
        experts.append((w13, w2))
    return experts


def _reference_moe(x, topk_weights, topk_ids, weights):
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            w13, w2 = weights[int(topk_ids[t, j])]
            h = latq_linear_ref(x[t:t + 1].float(), w13)
            out[t] += topk_weights[t, j] * latq_linear_ref(moe.activate(h, "silu"), w2)[0]
    return out


@pytest.mark.parametrize("path", ["host", "masked"])
def test_rotated_experts_through_the_latq_kernels(path):
    weights = _experts()
    experts = []
    for w13, w2 in weights:
        pair = []
        for w in (w13, w2):
            k = selector.select(w, torch.device("cpu"), torch.float32)
            pair.append((k, k.prepare(w)))
        experts.append(moe.Expert(*pair))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g)
    ids = torch.randint(0, 3, (6, 2), generator=g)
    p = torch.rand(6, 2, generator=g)
    want = _reference_moe(x, p, ids, weights)
    got = moe.experts_forward(x, p, ids, experts, "silu", path=path)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    tensors, ints = moe.flatten(experts)
    again, stacked = moe.unflatten(tensors, ints)
    assert stacked is None and [type(e.w13[1]) for e in again] == [type(e.w13[1]) for e in experts]
    torch.testing.assert_close(moe.experts_forward(x, p, ids, again, "silu", path=path), got)


def test_rotated_experts_stacked_for_the_grouped_kernel():
    """The grouped Triton kernel (interpreter) runs the experts' own states; the rotation is
    applied once per projection around it."""
    tk = pytest.importorskip("vllm_latq.kernels.triton.kernel")
    if not tk.INTERPRET:
        pytest.skip("kernel tests run in Triton's interpreter")
    weights = _experts()
    experts = [moe.Expert((rotated_kernel(tk.TritonKernel), rotated_kernel(tk.TritonKernel).prepare(w13)),
                          (rotated_kernel(tk.TritonKernel), rotated_kernel(tk.TritonKernel).prepare(w2)))
               for w13, w2 in weights]
    stacked, why = moe.stack_experts(experts)
    assert why is None and stacked.w13_signs is not None and stacked.w2_signs is not None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g).half()
    ids = torch.randint(0, 3, (4, 2), generator=g)
    p = torch.rand(4, 2, generator=g)
    want = _reference_moe(x, p, ids, weights)
    got = moe.experts_forward(x, p, ids, experts, "silu", stacked=stacked, path="stacked")
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
    tensors, ints = moe.flatten(experts, stacked)
    _, again = moe.unflatten(tensors, ints)
    assert torch.equal(again.w13_signs, stacked.w13_signs) and torch.equal(again.w2_signs, stacked.w2_signs)
    mixed = [experts[0], moe.Expert((tk.TritonKernel, tk.TritonKernel.prepare(replace(weights[1][0], rotation=None))),
                                    experts[1].w2)]
    assert "rotated and some not" in moe.stack_experts(mixed)[1]


def test_rotate_activations_dispatch():
    s = hadamard_signs(0, 32)
    x = torch.randn(2, 64)
    torch.testing.assert_close(rotate_activations(x, s), rotate(x, s))
    with native.disabled():
        assert torch.equal(rotate_activations(x, s), rotate(x, s))
    xd = x.double()
    assert torch.equal(rotate_activations(xd, s), rotate(xd, s))


# ----------------------------------------------------------------------------- custom ops

@pytest.mark.parametrize("kernel", [ReferenceKernel, DequantizedFp32Kernel, CPUKernel])
def test_opcheck_rotated_ops(kernel):
    """``torch.library.opcheck`` (schema, fake against real, dynamic shapes) on a rotated
    kernel's op, the CPU kernel's native op with its 11th tensor (large M too) and the C++
    transform — what vLLM's compiled mode relies on."""
    served = rotated_kernel(kernel)
    w = rotated_weight(out=32, cin=256, rate=0.03, group=128)
    tensors, ints = served.flatten(served.prepare(w))
    x, bias = torch.randn(3, 256).bfloat16(), torch.randn(32).bfloat16()
    torch.library.opcheck(ops.python_op_for(served), (x, tensors, ints, bias, 32))
    op = ops.op_for(served)
    if kernel is CPUKernel and native.available():
        from vllm_latq.kernels.cpu.kernel import large_m
        torch.library.opcheck(op, (x, tensors, ints, bias, 32))
        torch.library.opcheck(op, (torch.randn(large_m() + 1, 256).bfloat16(), tensors, ints, None, 32))
        torch.library.opcheck(torch.ops.latq_cpu.hadamard.default, (x, w.rotation))
        lean = served.prepare(rotated_weight(out=32, cin=256, rate=0.0, group=128))
        t, i = served.flatten(lean)
        for m in (3, large_m() + 1):   # the lean op with the signs, small and large M
            torch.library.opcheck(served.plain_op(lean), (torch.randn(m, 256).bfloat16(), t[0], t[1], i, 32, t[-1]))


def test_vllms_kernels_get_the_transform_from_the_plugin():
    """vLLM's layer code (``delegated``) is not wrapped: the plugin puts the transform in front of
    vLLM's scheme (tests/plugin/test_cuda_boundary.py, rotated layers); latq's kernels are wrapped, the
    bf16 fallback folds R. vLLM's MoE method has no input transform: rotated experts stay latq's."""
    from vllm_latq.kernels import vllm_moe
    from vllm_latq.kernels.rotated import for_weight
    from vllm_latq.kernels.vllm_mp import VllmMPKernel
    w = replace(random_weight(64, 256, 4, 0.0, group=64), rotation=Rotation(2).signs(256))
    assert for_weight(VllmMPKernel, w) is VllmMPKernel and for_weight(DequantizedBf16Kernel, w) is DequantizedBf16Kernel
    assert for_weight(CPUKernel, w).name == "cpu+hadamard"
    assert vllm_moe.form_refusal({(0, "w13"): w}) == "experts: rotated inputs (vLLM's MoE method has no input transform)"
    assert vllm_moe.form_refusal({(0, "w13"): replace(w, rotation=None)}) is None
