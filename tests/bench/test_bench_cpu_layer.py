"""bench/cpu_insitu.py's per-instruction-set wiring and keys (nothing timed): each impl runs on the
instruction set its name says, and the HEADLINE keys are the ratios their descriptions name; and the
e8 section's keys (bench/cpu_e8.py, tiny shapes, one round)."""
from __future__ import annotations

import pytest
import torch

from bench import cpu_insitu
from vllm_latq.kernels.cpu import layouts as cpu_layouts


def _recording_impls():
    """Impls that record the instruction set in force when their raw call runs."""
    state = {"isa": None}
    seen = {}

    def raw(name):
        def f(*args):
            seen.setdefault(name, []).append(state["isa"])
        return f

    names = ("op", "gemv", "gemv_s", "kernel_op", "kernel_gemv", "kernel_op_1pct", "kernel_gemv_1pct")
    return {n: raw(n) for n in names}, state, seen


@pytest.mark.parametrize("best", ["avx512", "avx2"])
def test_each_impl_runs_on_the_isa_its_name_says(best):
    impls, state, seen = _recording_impls()
    wrapped = cpu_insitu.isa_impls(impls, best, lambda isa: state.__setitem__("isa", isa))
    order = list(wrapped)
    for _ in range(2):   # interleaved as passes() runs them: the previous impl's ISA must not leak
        for k in order:
            state["isa"] = "stale"
            wrapped[k](None, None, None, None)
    assert set(wrapped) == set(impls) | ({"gemv_avx2", "kernel_gemv_avx2_1pct"} if best != "avx2" else set())
    if best != "avx2":
        # the AVX2 twins call the raw gemv / kernel_gemv_1pct under AVX2, the originals under the best
        assert seen["gemv"] == [best, "avx2"] * 2
        assert seen["kernel_gemv_1pct"] == [best, "avx2"] * 2
    for k in ("op", "gemv_s", "kernel_op", "kernel_gemv", "kernel_op_1pct"):
        assert seen[k] == [best] * 2


def test_isa_keys_are_the_ratios_they_name():
    ts = {"op": [3.0, 3.3, 2.7], "gemv": [1.0, 1.1, 0.9], "gemv_avx2": [1.5, 1.1, 1.8],
          "kernel_op_1pct": [4.0, 4.0, 4.0], "kernel_gemv_avx2_1pct": [2.0, 1.0, 4.0]}
    got = cpu_insitu.isa_keys(ts, "avx512", "_m8")
    assert got == pytest.approx({"gemv_isa_avx2_vs_op_m8": 2.0,              # median of 2.0, 3.0, 1.5
                                 "gemv_isa_avx512_vs_avx2_m8": 1.5,          # median of 1.5, 1.0, 2.0
                                 "gemv_isa_avx2_kernel_1pct_vs_op_m8": 2.0})  # median of 2, 4, 1
    del ts["kernel_op_1pct"]   # torch's op cannot read the GEMV's layout: no kernel key
    assert set(cpu_insitu.isa_keys(ts, "avx512")) == {"gemv_isa_avx2_vs_op", "gemv_isa_avx512_vs_avx2"}
    assert cpu_insitu.isa_keys({"op": [1.0], "gemv": [1.0]}, "avx2") == {}


@pytest.mark.parametrize("reads", [True, False])
def test_op_packed_is_torchs_layout(reads, monkeypatch):
    """torch's op gets its own packing of the bench's GEMV-layout weights, on every CPU."""
    monkeypatch.setattr(cpu_insitu, "op_reads_gemv_layout", lambda: reads)
    monkeypatch.setattr(cpu_insitu, "_OP_PACKED", {})
    g = torch.Generator().manual_seed(3)
    u = torch.randint(0, 16, (208, 128), generator=g, dtype=torch.int32)   # 3 full blocks + a 16-row tail
    p = cpu_layouts.pack_gemv(u)
    got = cpu_insitu.op_packed(p)
    if reads:
        assert got is p
    else:   # repacked through the GEMV layout's unpacker: torch's packer's bytes for the same u
        assert torch.equal(got, cpu_layouts.int4_ops()[0](u, 1))


def test_streaming_candidates_are_what_their_keys_name(monkeypatch):
    """``--sections streaming`` (one block, one round): L1 runs with the L2 prefetch off, the others
    with it on; only the arena candidate's states are placed; every key is a positive ratio; the
    switch is back on afterwards."""
    from types import SimpleNamespace

    from vllm_latq import native
    from vllm_latq.kernels.cpu import kernel as cpu
    if not (native.available() and cpu._gemv_here()):
        pytest.skip("the C++ GEMV is not available here")
    placed, switch = [], []
    real_place, real_switch = cpu.CPUKernel.place.__func__, torch.ops.latq_cpu.set_prefetch_l2

    def place(cls, state):
        placed.append(state)
        real_place(cls, state)
    monkeypatch.setattr(cpu.CPUKernel, "place", classmethod(place))
    monkeypatch.setattr(torch.ops.latq_cpu, "set_prefetch_l2", lambda on: (switch.append(on), real_switch(on)))
    results = {}
    cpu_insitu.streaming(SimpleNamespace(blocks=1, gemv_rounds=1), results)
    assert len(placed) == len(cpu_insitu.SMOL_VLLM) + 1          # the arena copies: 4 layers, then the head
    assert switch[-1] is True and set(switch) == {False, True}
    keys = {f"stream_{k}_{w}_m{m}" for k in ("prefetch", "arena") for w in ("blocks", "head") for m in (1, 2, 8)}
    assert set(results) == keys and all(v > 0 for v in results.values())


def test_e8_section_keys_every_ratio_it_prints(monkeypatch, capsys):
    """``--sections e8`` on small shapes, one round, one block in situ: every E8 width against the integer
    kernel and bf16 at each M, one row of fp32 x, the large-M paths (bf16 and fp32 x) and the in-situ ratios,
    as HEADLINE keys (positive, finite)."""
    from argparse import Namespace

    from bench import cpu_e8
    from vllm_latq import native
    from vllm_latq.kernels.cpu.codebook import CPUCodebookA8Kernel, CPUCodebookKernel
    if native.load() is not None:
        pytest.skip("the C++ ops are not built here")
    monkeypatch.setattr(cpu_e8, "E8_SHAPES", {"tiny": (128, 256), "8b.qo": (128, 256)})
    results = {}
    cpu_e8.e8(Namespace(e8_shapes=["tiny"], rounds=1, sample_us=50.0, blocks=1), results)
    want = {f"e8_tiny_m{m}_e8_{b}b_over_{ref}" for m in cpu_e8.E8_M for b in (2, 3, 4) for ref in ("int_4b", "bf16")}
    want |= {f"e8_large_m{m}_small_over_tiles" for m in (8, 16, 32, 64, 128, 256, 512, 1024, 2048)}
    want |= {f"e8_large_f32_m{m}_small_over_tiles" for m in (64, 128, 256, 512)}
    if CPUCodebookKernel.tile_rows(64) == 64:   # one row of fp32 x: the tiles' fp32 dots against the row path
        want |= {f"e8_tiny_f32_e8_{b}b_over_{ref}" for b in (2, 3, 4) for ref in ("rows", "int_4b", "fp32")}
    want |= {"e8_insitu_ms", "e8_insitu_heap_over_placed", "e8_insitu_rot_over_plain", "e8_insitu_over_int_4b"}
    if CPUCodebookA8Kernel.unavailable_here() is None:   # the opt-in int8-activation kernel beside each
        want |= {f"e8_tiny_m{m}_e8_{b}b_a8_over_{ref}" for m in cpu_e8.E8_M for b in (2, 3, 4)
                 for ref in ("int_4b", "exact")} | {"e8_insitu_a8_rot_over_rot"}
    assert want <= set(results), sorted(want - set(results))
    assert all(0 < results[k] < float("inf") for k in want)
    assert "time / int_4b" in capsys.readouterr().out
