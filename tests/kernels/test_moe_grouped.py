"""The grouped MoE path (kernels/triton/grouped_moe.py): experts stacked into one Triton layout and one
launch per projection over the routed (token, slot) pairs, run by Triton's interpreter on CPU
tensors against the token-by-token fp32 definition (vllm_latq/testing/moe_models.py); the routing blocks,
the stacked bytes and views, the reasons it declines, and the eager cost-model choice.
GPU-only cases (CUDA-graph capture + replay with changing routing): tests/gpu/test_moe_cuda.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_latq.kernels import moe, ops
from vllm_latq.kernels.weight import dequantize
from vllm_latq.testing.weights import random_weight

from vllm_latq.testing.moe_models import moe_reference

triton_moe = pytest.importorskip("vllm_latq.kernels.triton.grouped_moe")
from vllm_latq.kernels.triton.kernel import ENV_INTERPRET_OK, INTERPRET, TritonKernel  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (set by conftest)")

E, H, INTER, TOPK = 5, 64, 48, 2
EMPTY = 3                    # the expert no token is routed to


@pytest.fixture(autouse=True)
def _interpreter_ok(monkeypatch):
    monkeypatch.setenv(ENV_INTERPRET_OK, "1")


def experts_of(bits: int, rate: float, seed: int = 0, scale_bits: int | None = None):
    """Triton experts (expert 1 without outliers, expert 2's outliers laid out as CSR; with
    ``scale_bits``, coded scales) and their fp32 dequantized weights."""
    experts, dense = [], []
    for e in range(E):
        r = 0.0 if e == 1 else rate
        w13 = random_weight(2 * INTER, H, bits, r, group=32, seed=seed + 2 * e, fp16_values=True, scale_bits=scale_bits)
        w2 = random_weight(H, INTER, bits, r, group=32, seed=seed + 2 * e + 1, fp16_values=True, scale_bits=scale_bits)
        mode = "csr" if e == 2 and r else None
        experts.append(moe.Expert((TritonKernel, TritonKernel.prepare(w13, outlier_mode=mode)),
                                  (TritonKernel, TritonKernel.prepare(w2))))
        dense.append((dequantize(w13), dequantize(w2)))
    return experts, dense


def routing(T: int, seed: int):
    """Random top-2 routing that never picks expert EMPTY; token 0 goes to the first and the
    last expert of the stack, and (T > 1) token 1's second slot is on another rank (−1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    logits[:, EMPTY] = -1e9
    w, ids = logits.softmax(-1).topk(TOPK, -1)
    ids[0] = torch.tensor([0, E - 1])
    if T > 1:
        ids[1, 1] = -1
    return x, w / w.sum(-1, keepdim=True), ids.int()


def _grid():
    """T × bits × outliers; 3 bits at T = 2, 7 marked slow (the interpreter's 512-column steps)."""
    return [pytest.param(T, bits, rate, id=f"T{T}-{bits}bit-{'outl' if rate else 'no-outl'}",
                         marks=[pytest.mark.slow] if bits == 3 and T in (2, 7) else [])
            for T in (1, 2, 7, 16) for bits in (2, 3, 4) for rate in (0.0, 0.03)]


@pytest.mark.parametrize("T,bits,rate", _grid())
def test_grouped_equals_token_by_token(T, bits, rate):
    experts, dense = experts_of(bits, rate, seed=bits)
    stacked, why = moe.stack_experts(experts)
    x, w, ids = routing(T, T + bits)
    want = moe_reference(x, w, ids, dense)
    assert why is None and stacked.w13.outl == (1 if rate else 0)
    y = moe.experts_forward(x, w, ids, experts, "silu", stacked=stacked, path="stacked")
    assert y.dtype == x.dtype and y.shape == (T, H)
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    if T == 7:   # the experts' own states are views of the stack now: the per-expert path still agrees
        host = moe.experts_forward(x, w, ids, experts, "silu", path="host")
        assert (host - want).abs().max() <= 1e-5 * want.abs().max()



@pytest.mark.parametrize("T", [1, 3])
def test_grouped_3bit_whole_chunks_and_a_tail(T):
    """3-bit experts whose K is one 512-column chunk plus a 128-column 4-bit tail (Qwen3-30B-A3B's
    w2 has K 768: one chunk and a 256-column tail): stacked, main steps and tail steps both run."""
    inter = 640
    experts, dense = [], []
    for e in range(3):
        w13 = random_weight(2 * inter, H, 3, 0.02, group=64, seed=40 + 2 * e, fp16_values=True)
        w2 = random_weight(H, inter, 3, 0.02, group=64, seed=41 + 2 * e, fp16_values=True)
        experts.append(moe.Expert((TritonKernel, TritonKernel.prepare(w13)), (TritonKernel, TritonKernel.prepare(w2))))
        dense.append((dequantize(w13), dequantize(w2)))
    stacked, why = moe.stack_experts(experts)
    assert why is None and stacked.w2.plane_a.shape[1] and stacked.w2.plane_t.shape[1]
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    w, ids = torch.randn(T, 3, generator=g).softmax(-1).topk(TOPK, -1)
    want = moe_reference(x, w / w.sum(-1, keepdim=True), ids.int(), dense)
    y = moe.experts_forward(x, w / w.sum(-1, keepdim=True), ids.int(), experts, "silu", stacked=stacked,
                            path="stacked")
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()

@pytest.mark.parametrize("T,bits,rate", [(1, 2, 0.03), (4, 4, 0.0), (9, 4, 0.03), (17, 2, 0.0)])
def test_grouped_coded_scales_equal_token_by_token(T, bits, rate):
    """Experts with coded scales: the stack keeps the codes (12 bytes per 16 scales) and the
    grouped kernel decodes them; a stack of fp16 and coded experts is refused."""
    experts, dense = experts_of(bits, rate, seed=bits, scale_bits=4)
    stacked, why = moe.stack_experts(experts)
    assert why is None and stacked.w13.coded_scales and stacked.w2.coded_scales
    assert stacked.w2.nbytes()["scales"] == E * (H // 16) * -(-stacked.w2.k_pad // 32) * 12
    x, w, ids = routing(T, T + bits)
    want = moe_reference(x, w, ids, dense)
    y = moe.experts_forward(x, w, ids, experts, "silu", stacked=stacked, path="stacked")
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    fp16 = experts_of(bits, rate, seed=bits)[0]
    assert "scales' form" in triton_moe.stack_reason([fp16[0].w2[1], experts[1].w2[1]])


def test_grouped_fp16_weights_on_input_and_through_the_op():
    """fp16 activations, the routing weight on the input (top-1), and the custom op on the
    flattened experts + stacks (which must round-trip)."""
    experts, dense = experts_of(4, 0.02)
    stacked, _ = moe.stack_experts(experts)
    x, w, ids = routing(3, 1)
    top1 = ids[:, :1].clone()
    want1 = moe_reference(x, w[:, :1], top1, dense, "gelu", on_input=True)
    got1 = moe.experts_forward(x.half(), w[:, :1].contiguous(), top1, experts, "gelu", weights_on_input=True,
                               stacked=stacked, path="stacked")
    assert got1.dtype == torch.float16 and (got1.float() - want1).abs().max() <= 1e-2 * want1.abs().max()
    tensors, ints = moe.flatten(experts, stacked)
    back, back_stacked = moe.unflatten(tensors, ints)
    assert len(back) == E and back_stacked.w13.flatten()[1] == stacked.w13.flatten()[1]
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(back_stacked.w2.flatten()[0],
                                                                   stacked.w2.flatten()[0]))
    want = moe_reference(x, w, ids, dense)
    y = ops.moe_op()(x.half(), w, ids, tensors, ints, "silu", False)   # eager choice: stacked at 3 tokens
    assert (y.float() - want).abs().max() <= 1e-2 * want.abs().max()
    torch.library.opcheck(ops.moe_op(), (x.half(), w, ids, tensors, ints, "silu", False),
                          test_utils=("test_schema", "test_faketensor"))
    empty = moe.experts_forward(x[:0], w[:0], ids[:0], experts, "silu", stacked=stacked, path="stacked")
    assert empty.shape == (0, H)


@pytest.mark.parametrize("P,bm", [(1, 1), (8, 1), (14, 4), (32, 8), (200, 8)])
def test_route_blocks_cover_each_routed_pair_once(P, bm):
    """Every routed pair lies in exactly one block, of its own expert, of ≤ BM rows; the
    unused blocks (expert −1) are empty; the block count bound holds for this routing."""
    g = torch.Generator().manual_seed(P)
    ids = torch.randint(0, E, (P,), generator=g)
    ids[ids == EMPTY] = -1
    order, blocks = triton_moe.route(ids, E, bm)
    assert blocks.shape == (triton_moe.max_blocks(P, E, bm), 3) and blocks.dtype == torch.int32
    sorted_ids = ids[order]
    seen = torch.zeros(P, dtype=torch.int64)
    for e, r0, r1 in blocks.tolist():
        assert 0 <= r1 - r0 <= bm
        if e < 0:
            assert r1 == r0
            continue
        assert (sorted_ids[r0:r1] == e).all()
        seen[r0:r1] += 1
    assert torch.equal(seen, (sorted_ids >= 0).long())


def test_stacked_bytes_and_views():
    """The stack holds each byte once: its bytes by part are the sum of the experts' served
    bytes (the experts' states are views of it, outliers as ELL), and the bulk is not copied."""
    experts, _ = experts_of(3, 0.03)   # 3 bits at these widths: all of K the 4-bit tail
    before = [[TritonKernel.served_bytes(getattr(ex, s)[1]) for ex in experts] for s in ("w13", "w2")]
    stacked, _ = moe.stack_experts(experts)
    for i, (stem, st) in enumerate((("w13", stacked.w13), ("w2", stacked.w2))):
        views = [getattr(ex, stem)[1] for ex in experts]
        got = st.nbytes()
        for part in ("inliers", "scales"):
            assert got[part] == sum(b[part] for b in before[i])
            assert got[part] == sum(TritonKernel.served_bytes(v)[part] for v in views)
        # outliers: the views' (ELL) entries are the stack's slices; the offsets are per expert
        entries = sum(v.outl_col.numel() * v.outl_col.element_size() + v.outl_val.numel() * v.outl_val.element_size()
                      for v in views if v.outl_col is not None)
        assert got["outliers"] == entries + st.off.numel() * 4
        for e, v in enumerate(views):
            assert v.plane_t.data_ptr() == st.plane_t[e].data_ptr() and v.plane_t.numel()
            assert v.scales.untyped_storage().data_ptr() == st.scales.untyped_storage().data_ptr()
            if v.outl_col is not None:
                assert v.outl_col.untyped_storage().data_ptr() == st.col.untyped_storage().data_ptr()


def test_stack_declines_with_a_reason():
    experts, _ = experts_of(2, 0.0)
    cpu = dataclasses.replace(experts[0])
    cpu.w2 = (object, object())
    assert "not every expert runs the Triton kernel" in moe.stack_experts([cpu, *experts[1:]])[1]
    st = experts[0].w13[1]
    assert "differ in shape" in triton_moe.stack_reason([st, dataclasses.replace(st, n=st.n - 1)])
    # a layout the kernel does not read (e.g. planes with an extra tail chunk)
    longer = dataclasses.replace(st, plane_a=torch.cat([st.plane_a, st.plane_a[:256]]))
    assert "planes of" in triton_moe.stack_reason([longer])
    assert "5-bit" in triton_moe.stack_reason([dataclasses.replace(st, bits=5)])
    with pytest.raises(ValueError, match="cannot stack"):
        triton_moe.stack([longer])


def test_stack_declines_a_layout_with_unknown_parts(monkeypatch):
    """A field added to TritonState (another layout part) must be taught to the grouped kernel
    before experts are stacked: until then they keep the per-expert and masked paths."""
    experts, _ = experts_of(4, 0.0)
    monkeypatch.setattr(triton_moe, "READ_FIELDS", triton_moe.READ_FIELDS - {"nnz"})
    stacked, why = moe.stack_experts(experts)
    assert stacked is None and "does not read: ['nnz']" in why


def _meta_stack(n, k, experts):
    return triton_moe.StackedTriton(*(torch.empty(0),) * 7, experts, 4, 128, 8, n, k, n, k, 0)


def test_path_choice_by_cost_model():
    """Qwen3-30B-A3B's experts (128, top-8, 2048 → 2·768 → 2048): the stacked path for every
    batch vLLM captures (≤ 512) and for eager decode batches, the host path (tensor cores)
    for prefill-sized eager ones; Mixtral's few huge experts (8, top-2): masked from batch 8
    on in a graph (SIMT issue of re-dequantised 176 M-weight experts), host eagerly."""
    qwen = (_meta_stack(2 * 768, 2048, 128), _meta_stack(2048, 768, 128))
    for T in (1, 16, 64, 512):
        t = triton_moe.path_times(T, 8, *qwen)
        assert t["stacked"] < t["masked"], (T, t)
    assert all(triton_moe.path_times(T, 8, *qwen)["stacked"] < triton_moe.path_times(T, 8, *qwen)["host"]
               for T in (1, 16))
    t = triton_moe.path_times(8192, 8, *qwen)
    assert t["host"] < t["stacked"]
    mixtral = (_meta_stack(2 * 14336, 4096, 8), _meta_stack(4096, 14336, 8))
    t = triton_moe.path_times(512, 2, *mixtral)
    assert t["masked"] < t["stacked"] and t["host"] < t["stacked"]
    x = torch.zeros(1, 2048)
    assert moe.choose_path(x, 8, moe.Stacked(*qwen)) == "stacked" and moe.choose_path(x, 8, None) == "host"


def test_idle_blocks_and_the_load_time_compile():
    """A block of expert −1 runs nothing and leaves the blocks after it right (the load-time
    compile launches every row block's kernel over one such block)."""
    experts, dense = experts_of(4, 0.02)
    stacked, _ = moe.stack_experts(experts)
    moe.compile_stacked(stacked, torch.float32)
    xs = torch.randn(3, INTER, generator=torch.Generator().manual_seed(3))
    blocks = torch.tensor([[-1, 0, 0], [4, 1, 3]], dtype=torch.int32)
    y = triton_moe.launch(stacked.w2, xs, blocks, 2)
    want = xs[1:] @ dense[4][1].T
    assert (y[1:] - want).abs().max() <= 1e-5 * want.abs().max()
