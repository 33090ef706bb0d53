"""The peers latq's GPU kernels are timed beside: torch's built-in int4 kernel (tinygemm, what
gpt-fast and torchao run: ``aten._convert_weight_to_int4pack`` / ``aten._weight_int4pack_mm``, in
every CUDA build of torch) and GemLite (pure Triton, imported where installed or on PYTHONPATH),
each at 4-bit groups of 128 without outliers, built from the integers and scales of one latq
layer, so each peer's exact weight is (u − 8)·s with u = z + 8.

A peer that cannot run here (no CUDA, an activation dtype it lacks, GemLite not importable) is
*absent* with its reason: the bench names it and goes on. :class:`PeerBench` times the present
ones per shape × M as :mod:`bench.kernel_timing` times latq (copies cycled past L2, CUDA-graph
medians, every output checked against the peer's own fp32 weight).
"""
from __future__ import annotations

import copy
import math

import torch

from vllm_latq import format as fmt
from vllm_latq.kernels.weight import LatqWeight

PEERS = ("torch_int4", "gemlite")
PEER_GROUP = 128
INNER_K_TILES = 8          # tinygemm's K tiling (gpt-fast's and torchao's choice)


def unsigned_ints(w: LatqWeight) -> torch.Tensor:
    """uint8 ``[N, K]``: the layer's 4-bit inliers as u = z + 8 (0..15)."""
    if w.bits != 4 or w.group_size != PEER_GROUP:
        raise ValueError(f"the peers take 4-bit groups of {PEER_GROUP} (got {w.bits}-bit, group {w.group_size})")
    return (fmt.unpack(w.qweight, 4, w.in_features) + 8).to(torch.uint8)


def exact_weight(w: LatqWeight, scale_dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``[N, K]``: what a peer holding the inliers with ``scale_dtype`` scales multiplies."""
    z = unsigned_ints(w).float() - 8
    s = w.scales.to(scale_dtype).float().repeat_interleave(PEER_GROUP, 1)[:, :w.in_features]
    return z * s


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class TorchInt4:
    """torch's int4 GEMM: on CUDA uint8 ``[N, K/2]`` (u of column 2i in the high nibble) packed by
    ``_convert_weight_to_int4pack``, on the CPU int32 ``[N, K]`` by its ``_for_cpu`` twin;
    ``scales_and_zeros`` ``[K/g, N, 2]`` in the activation dtype, w = (u − 8)·s + 0."""
    name = "torch_int4"

    @staticmethod
    def available(dev: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        suffix = "" if dev.type == "cuda" else "_for_cpu"
        if not hasattr(torch.ops.aten, f"_weight_int4pack_mm{suffix}"):
            return False, f"torch {torch.__version__} has no aten._weight_int4pack_mm{suffix}"
        if dev.type == "cuda" and dtype != torch.bfloat16:
            return False, f"tinygemm computes bf16 activations only (got {dtype})"
        return True, ""

    @staticmethod
    def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, K]`` of 0..15 → uint8 ``[N, K/2]``, column 2i in the high nibble (the CUDA
        packer's input since torch 2.5)."""
        return (u[:, ::2] << 4 | u[:, 1::2]).contiguous()

    @classmethod
    def prepare(cls, w: LatqWeight, dev: torch.device, dtype: torch.dtype) -> dict:
        n, k = w.out_features, w.in_features
        if n % 16 or k % (INNER_K_TILES * 16):
            raise ValueError(f"tinygemm needs N % 16 == 0 and K % {INNER_K_TILES * 16} == 0 (got {n}×{k})")
        from vllm_latq.kernels.cpu.layouts import op_scales_zeros
        u = unsigned_ints(w).to(dev)
        if dev.type == "cuda":
            packed = torch.ops.aten._convert_weight_to_int4pack(cls.pack_nibbles(u), INNER_K_TILES)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.int(), INNER_K_TILES)
        sz, _ = op_scales_zeros(w.scales.to(dev).T.to(dtype), PEER_GROUP, 1, k, (PEER_GROUP,))
        return {"packed": packed, "sz": sz, "cuda": dev.type == "cuda"}

    @staticmethod
    def apply(st: dict, x: torch.Tensor) -> torch.Tensor:
        mm = torch.ops.aten._weight_int4pack_mm if st["cuda"] else torch.ops.aten._weight_int4pack_mm_for_cpu
        return mm(x, st["packed"], PEER_GROUP, st["sz"])

    @staticmethod
    def clone(st: dict) -> dict:
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}

    @staticmethod
    def served_bytes(st: dict) -> int:
        return nbytes(st["packed"], st["sz"])


class GemLite:
    """GemLite's ``GemLiteLinear``, 4-bit groups of 128 as HQQ feeds it (uint8 u, scales and
    zeros 8 in the activation dtype, W ≈ (u − zero)·s): the form of its published 4-bit charts."""
    name = "gemlite"

    @staticmethod
    def available(dev: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
        if dev.type != "cuda":
            return False, "GemLite runs on CUDA devices only"
        try:
            import gemlite  # noqa: F401  (its import reads the device's properties)
        except Exception as e:  # noqa: BLE001 — any failure makes the peer absent, named
            return False, f"gemlite not importable ({type(e).__name__}: {str(e).strip()[:120]})"
        return True, ""

    @staticmethod
    def note(dev: torch.device) -> str:
        """Which of GemLite's shipped autotune tables it runs with: the device's own, else on an
        sm_90 part without one (H200) the H100's, so that no autotuning spends the GPU's minutes."""
        import os

        import gemlite
        from gemlite import core
        version = getattr(gemlite, "__version__", "?")
        if core.selected_tag:
            return f"gemlite {version}: its {os.path.basename(core.selected_tag)} autotune table"
        h100 = os.path.join(os.path.dirname(core.__file__), "configs", "h100.json")
        if torch.cuda.get_device_capability(dev) == (9, 0) and os.path.exists(h100):
            core.GemLiteLinear.load_config(h100)
            return f"gemlite {version}: no table for {torch.cuda.get_device_name(dev)}, the H100's loaded (sm_90)"
        return f"gemlite {version}: no autotune table for this device, autotuned at first call (fast mode)"

    @staticmethod
    def prepare(w: LatqWeight, dev: torch.device, dtype: torch.dtype):
        from gemlite import DType, GemLiteLinear
        gdt = {torch.bfloat16: DType.BF16, torch.float16: DType.FP16}[dtype]
        n, k = w.out_features, w.in_features
        layer = GemLiteLinear(4, group_size=PEER_GROUP, in_features=k, out_features=n, input_dtype=gdt,
                              output_dtype=gdt)
        s = w.scales.to(dev, dtype)
        return layer.pack(unsigned_ints(w).to(dev), s, torch.full_like(s, 8), None)

    @staticmethod
    def apply(layer, x: torch.Tensor) -> torch.Tensor:
        return layer(x)

    @staticmethod
    def clone(layer):
        return copy.deepcopy(layer)

    @staticmethod
    def served_bytes(layer) -> int:
        return nbytes(layer.W_q, layer.scales, layer.zeros)


PEER_CLASSES = {c.name: c for c in (TorchInt4, GemLite)}


def parse_peers(spec: str) -> list[str]:
    """``torch_int4,gemlite`` / ``none`` → the peer names, order kept (ValueError naming an unknown one)."""
    if spec.strip() == "none":
        return []
    names = list(dict.fromkeys(t.strip() for t in spec.split(",") if t.strip()))
    bad = [n for n in names if n not in PEER_CLASSES]
    if bad or not names:
        raise ValueError(f"peers must be of {', '.join(PEERS)} or none (got {spec!r})")
    return names


class PeerBench:
    """The peers' µs per shape × M and their served bits per weight, each shape measured once
    (its first request), with ``bench.kernel_timing``'s timer, copies and check."""

    def __init__(self, names, dtype, dev, l2_bytes: int, timer, log, ms):
        self.dtype, self.dev, self.l2, self.timer, self.log, self.ms = dtype, dev, l2_bytes, timer, log, list(ms)
        self.absent: dict[str, str] = {}
        self.present = []
        self.notes = []
        for name in names:
            ok, why = PEER_CLASSES[name].available(dev, dtype)
            (self.present.append(name) if ok else self.absent.setdefault(name, why))
            if ok and hasattr(PEER_CLASSES[name], "note"):
                self.notes.append(PEER_CLASSES[name].note(dev))
        self._us: dict = {}          # (n, k, m, peer) → µs (nan: failed)
        self.bits: dict = {}         # (n, k, peer) → served bits/weight
        self.err: dict = {}          # (n, k, m, peer) → rel error

    def absent_line(self) -> str:
        return "; ".join([f"{n} absent: {why}" for n, why in self.absent.items()] + self.notes)

    def times(self, n: int, k: int, m: int) -> dict[str, float]:
        """{peer: µs} at this shape and M (nan where the peer failed); absent peers left out."""
        if self.present and (n, k, m, self.present[0]) not in self._us:
            self._measure(n, k)
        return {p: self._us.get((n, k, m, p), math.nan) for p in self.present}

    def _measure(self, n: int, k: int) -> None:
        from bench.kernel_timing import bench_weight
        w = bench_weight(n, k, 4, 0.0).to(self.dev)         # unpacked where the peers are built
        for name in self.present:
            try:
                self._measure_peer(PEER_CLASSES[name], w, n, k)
            except Exception as e:  # noqa: BLE001 — a failed peer costs its numbers, not the run
                self.log(f"  FAILED peer {name} {n}x{k}: {type(e).__name__}: {str(e).strip()[:200]}")
                for m in self.ms:
                    self._us[n, k, m, name] = math.nan

    def _measure_peer(self, peer, w: LatqWeight, n: int, k: int) -> None:
        from bench.kernel_timing import ERR_TOL, copies, rel_err, time_cycled
        st = peer.prepare(w, self.dev, self.dtype)
        wb = peer.served_bytes(st)
        self.bits[n, k, peer.name] = 8 * wb / (n * k)
        states = [st] + [peer.clone(st) for _ in range(copies(wb, self.l2) - 1)]
        ref_w = exact_weight(w, self.dtype).to(self.dev)      # scales in the activation dtype
        xs = {m: torch.randn(m, k, device=self.dev).to(self.dtype) for m in self.ms}
        for m in self.ms:                    # warm-up (autotuning) before any capture, each output checked
            err = rel_err(peer.apply(st, xs[m]), xs[m].float() @ ref_w.T)
            self.err[n, k, m, peer.name] = err
            if not err <= ERR_TOL:
                self.log(f"  WRONG peer {peer.name} {n}x{k} M={m}: error {err:.1e}")
        del ref_w
        for m in self.ms:
            ok = self.err[n, k, m, peer.name] <= ERR_TOL
            self._us[n, k, m, peer.name] = time_cycled(
                self.timer, [lambda s=s, x=xs[m]: peer.apply(s, x) for s in states]) if ok else math.nan
        del states
