"""A first ``vllm serve`` with latq's Triton kernels, replayed on CPU by the serving code's own
launch planning (``tools/cold_start.py``: load, profile run, CUDA-graph memory profile,
warm-ups and captures of vLLM's default capture sizes; an 8B model's layers, meta tensors):
the kernel variants it compiles stay within a bound, none differs from another only in how
Triton specialised a runtime integer, and the scratch buffers are all allocated at load —
before vLLM profiles memory and sizes the KV cache — and never after."""
import pytest
import torch

pytest.importorskip("triton")
from tools import cold_start as cs  # noqa: E402
from vllm_latq.kernels.triton import dequant as td  # noqa: E402
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402
from vllm_latq.kernels.triton.layout import WIDTHS  # noqa: E402

# Kernel variants one rank compiles, at most, over every width, outlier layout, GPU family
# and TP 1/2/4/8 (docs/KERNELS.md, "First start under vLLM"): a change that adds variants
# must raise it knowingly.
MAX_VARIANTS = 24


@pytest.mark.parametrize("tp", (1, 2, 4, 8))
def test_serve_start_variants_are_bounded(tp):
    for bits in WIDTHS:
        for outliers in ("none", "ell"):
            for family in cs.FAMILY_CC:
                found = cs.variants(bits, outliers, family, tp)
                what = {(name, repr(sorted(kw.items()))) for name, kw in found.values()}
                assert len(what) == len(found), (
                    f"{bits}-bit {outliers} {family} TP {tp}: variants that differ only in a runtime integer's "
                    "specialisation (mark it do_not_specialize)")
                assert {name for name, _ in found.values()} >= {"gemv", "mma", "dequant"}
                assert len(found) <= MAX_VARIANTS, (bits, outliers, family, tp, len(found))


def test_specialised_batch_would_double_the_tensor_core_variants(monkeypatch):
    """What the bound guards: with M specialised (Triton's default), M = 8 and M = 16 of one
    tile compile twice."""
    now = cs.variants(4, "ell", "sm_80")
    monkeypatch.setattr(cs, "unspecialized", lambda fn: frozenset())
    every = cs.variants(4, "ell", "sm_80")
    mma = [sum(name == "mma" for name, _ in f.values()) for f in (now, every)]
    assert mma[1] == 2 * mma[0] and len(every) > len(now)


@pytest.mark.parametrize("aux", (False, True))
def test_scratch_is_allocated_at_load_only(aux):
    """The large-M buffer (the largest layer, under the 256 MiB cap) and the split-K partials
    (largest split layer) per lane: the main lane, and the shared-experts stream's with ``aux``.
    Nothing is allocated by the profile run, the memory profiler's capture stream or the
    capture stream."""
    run = cs.serve_start(4, "ell", "sm_80", aux=aux)
    biggest = max(n * k for n, k in cs.MODEL_8B.values()) * 2
    splitk = max(tk.splitk_floats(-(-n // 16) * 16) for n, _ in cs.MODEL_8B.values()) * 4
    lanes = 2 if aux else 1
    assert run.scratch["load"] == lanes * (min(biggest, td.DEFAULT_MAX_BYTES) + splitk)
    assert set(run.scratch.values()) == {run.scratch["load"]}, run.scratch


def test_scratch_cap_holds_for_a_wider_model():
    """A 128k × 4096 head is dequantised in row chunks: the buffer stays at the cap."""
    run = cs.serve_start(4, "none", "sm_90", shapes={"head": (131072, 4096)}, sizes=[1, 8])
    assert run.scratch["load"] == td.DEFAULT_MAX_BYTES + 4        # and one float: it never splits K
    assert set(run.scratch.values()) == {run.scratch["load"]}


def test_fp32_activations_reserve_no_large_m_buffer():
    run = cs.serve_start(4, "none", "sm_80", sizes=[1, 8], act_dtype=torch.float32)
    assert run.scratch["load"] == max(tk.splitk_floats(-(-n // 16) * 16) for n, _ in cs.MODEL_8B.values()) * 4


def test_grouped_moe_projections_share_their_variants(monkeypatch):
    """The grouped MoE kernel compiles at load one variant per row tile (``compile_all``), and a
    layer's two projections share them: their K steps (16 and 6 here) no longer split a tile in
    two by divisibility."""
    from vllm_latq.kernels.triton import grouped_moe as tm
    from vllm_latq.kernels.triton.kernel import TritonKernel
    from vllm_latq.testing.capture import compile_key, unspecialized
    from vllm_latq.testing.weights import random_weight
    projections = [tm.stack([TritonKernel.prepare(random_weight(64, k, 4, 0.0, seed=e)) for e in range(2)])[0]
                   for k in (2048, 768)]

    def count(skip):
        keys = set()

        class Record:
            def __getitem__(self, grid):
                return lambda *args, **kw: keys.add(compile_key("moe", args, kw, skip))
        monkeypatch.setattr(tm, "_moe_gemv_kernel", Record())
        for st in projections:
            tm.compile_all(st, torch.bfloat16)
        return len(keys)

    fn = tm._moe_gemv_kernel
    assert count(unspecialized(fn)) == len(tm.MOE_TILES)
    assert count(frozenset()) == 2 * len(tm.MOE_TILES)
