"""Load-time layout of the Triton kernels (pure torch, any device): one copy of the weights for
every Triton kernel, repacked once into 16×16-word blocks whose slots are 16-column slabs of Wᵀ,
3/5 bits as two planes, coded scales as words, outliers ELL-16 or CSR (:func:`outlier_model`).
Specification: docs/KERNELS.md, "Triton layout reference"."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ... import format as fmt

ROWS = 16            # row group: tensor-core N tile, ELL group, word-block height
WORDS = 16           # words per row per chunk (a slab = 16 columns = one MMA K step)
BW_BYTES = 1.555e12  # A100-40GB HBM2e (model constants; the ratio is what matters)
LANE_OPS = 108 * 64 * 1.41e9
UNPACK_ROWS = 1024   # rows of the checkpoint's packing unpacked at a time at load


WIDTHS = (2, 3, 4, 5)
CHUNK = 128          # K granularity of 3/5-bit layers (one 4-bit chunk); 2/4 bits: the step
H_CHUNK = 512        # columns of one 1-bit-plane chunk (16 words × 32 values)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ of host integers (``triton.cdiv`` is a constexpr function in recent Triton: µs a call)."""
    return -(-a // b)


def step_of(bits: int) -> int:
    """Columns per K step of the main loop (3 bits: 512; 5 bits: 128, four steps per 1-bit tile)."""
    return {2: 256, 3: H_CHUNK, 4: 128, 5: 128}[bits]


def planes_of(bits: int) -> list[int]:
    """Bit widths of the stored main planes, low bits first (3 bits: plus the 4-bit tail)."""
    return {2: [2], 3: [2, 1], 4: [4], 5: [4, 1]}[bits]


def pad_k(k: int, bits: int) -> int:
    """K as laid out: a multiple of the step (2/4 bits), of 128 columns (3/5 bits)."""
    unit = CHUNK if bits in (3, 5) else step_of(bits)
    return max(unit, -(-k // unit) * unit)


def main_columns(bits: int, k_pad: int) -> int:
    """Columns in whole main K steps: 3 bits: the full 512-column chunks (the rest, < 512
    columns, is the 4-bit tail); other widths: all of K_pad."""
    return k_pad // H_CHUNK * H_CHUNK if bits == 3 else k_pad


def plane_columns(bits: int, k_pad: int) -> list[tuple[int, int]]:
    """(plane bits, columns) of each stored plane in :class:`TritonLayout` order — main planes,
    then (3 bits) the tail. 5 bits: the 1-bit plane is padded to whole 512-column chunks."""
    km = main_columns(bits, k_pad)
    if bits == 3:
        return [(2, km), (1, km), (4, k_pad - km)]
    if bits == 5:
        return [(4, k_pad), (1, -(-k_pad // H_CHUNK) * H_CHUNK)]
    return [(bits, k_pad)]


def inlier_bytes(n_pad: int, bits: int, k_pad: int) -> int:
    """Bytes of the planes of an ``n_pad``-row layer (what :func:`build` allocates)."""
    return sum(n_pad * pb * cols // 8 for pb, cols in plane_columns(bits, k_pad))


def k_steps(bits: int, k_pad: int) -> dict[str, int]:
    """What the kernels index: plane A's and the 1-bit plane's chunks per row group (``nch_a``,
    ``nch_h``), main steps, 128-column tail steps (3 bits) and the first tail column (``k_main``)."""
    planes = plane_columns(bits, k_pad)
    nch = [cols // (WORDS * 32 // pb) for pb, cols in planes]
    km = main_columns(bits, k_pad)
    return {"nch_a": nch[0], "nch_h": nch[1] if len(nch) > 1 else 0, "nsteps": km // step_of(bits),
            "tsteps": (k_pad - km) // CHUNK, "k_main": km}


@dataclass
class TritonLayout:
    """Everything the kernels read, on the weight's device."""
    planes: list[torch.Tensor]     # int32 [N_pad/16 · nchunks_p · 16 · 16] per plane_columns() entry
    scales: torch.Tensor           # fp16 [N_pad/16, ngroups_pad, 16], or coded: int32 [N_pad/16, ngroups_pad, 3]
    bits: int
    group: int                     # scale group as the kernel sees it (≥ K_pad: one group)
    n: int
    k: int
    n_pad: int
    k_pad: int
    outlier_mode: str              # "none" | "ell" | "csr"
    outlier_reason: str
    nnz: int
    # ELL: off int32 [G+1], col int16/32 [S], val fp16/32 [S];  CSR: crow int32 [N_pad+1], row, col, val
    outliers: dict[str, torch.Tensor] = field(default_factory=dict)
    max_row_outliers: int = 0

    def nbytes(self) -> dict[str, int]:
        b = {"inliers": sum(p.numel() * 4 for p in self.planes), "scales": self.scales.numel() * self.scales.element_size()}
        b["outliers"] = sum(t.numel() * t.element_size() for t in self.outliers.values())
        return b


# ----------------------------------------------------------------------------- inliers

def pack_plane(v: torch.Tensor, pbits: int) -> torch.Tensor:
    """p-bit values ``[N_pad, K_pad]`` (uint8, N_pad % 16 == 0, K_pad % (16·32/p) == 0) →
    int32 word blocks, flat (see the module docstring)."""
    V = 32 // pbits
    n_pad, k_pad = v.shape
    G, C = n_pad // ROWS, k_pad // (WORDS * V)
    out = torch.empty(G, C, WORDS, ROWS, dtype=torch.int32, device=v.device)
    if out.numel() == 0:                  # a 3-bit layer of < 512 columns: all of it is tail
        return out.reshape(-1)
    sh = (pbits * torch.arange(V, device=v.device, dtype=torch.int64))
    for g0 in range(0, G, 64):
        blk = v[g0 * ROWS:(g0 + 64) * ROWS].to(torch.int64).reshape(-1, ROWS, C, V, WORDS)
        w = (blk.permute(0, 2, 4, 1, 3) << sh).sum(-1)                 # [g, C, w, r]
        out[g0:g0 + 64] = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)
    return out.reshape(-1)


def unpack_plane(words: torch.Tensor, pbits: int, n_pad: int, k_pad: int) -> torch.Tensor:
    """Inverse of :func:`pack_plane` (tests)."""
    V = 32 // pbits
    G, C = n_pad // ROWS, k_pad // (WORDS * V)
    w = words.to(torch.int64).reshape(G, C, WORDS, ROWS, 1) & 0xFFFFFFFF
    vals = (w >> (pbits * torch.arange(V, device=words.device))) & ((1 << pbits) - 1)   # [G,C,w,r,j]
    return vals.permute(0, 3, 1, 4, 2).reshape(n_pad, k_pad).to(torch.uint8)


# ----------------------------------------------------------------------------- scales

CODED_WORDS = 3      # int32 words per (16-row slab, group) of coded scales


def scale_bytes(n_pad: int, ngroups_pad: int, coded: bool) -> int:
    """Bytes of the laid-out scales (fp16, or coded: 12 per 16 scales)."""
    return n_pad // ROWS * ngroups_pad * (4 * CODED_WORDS if coded else 2 * ROWS)


def fp16_scales(S: torch.Tensor, n_pad: int, ngroups_pad: int) -> torch.Tensor:
    """fp16 scales ``[N, G]`` → ``[N_pad/16, ngroups_pad, 16]`` (padding: 0)."""
    sc = torch.zeros(n_pad, ngroups_pad, dtype=torch.float16, device=S.device)
    sc[:S.shape[0], :S.shape[1]] = S.half()
    return sc.reshape(n_pad // ROWS, ROWS, ngroups_pad).transpose(1, 2).contiguous()


def coded_scales(cs: fmt.scale_codes.CodedScales, n_pad: int, ngroups_pad: int) -> torch.Tensor:
    """Coded scales → int32 ``[N_pad/16, ngroups_pad, 3]`` (module docstring; padding: 0)."""
    n, G = cs.codes.shape
    if cs.bits != 4 or cs.min.shape != (-(-n // ROWS), G) or cs.step.shape != cs.min.shape:
        raise ValueError(f"coded scales: {cs.bits}-bit codes {tuple(cs.codes.shape)} with grids "
                         f"{tuple(cs.min.shape)}/{tuple(cs.step.shape)} (expected 4-bit codes, one grid per 16 rows)")
    dev = cs.codes.device
    codes = torch.zeros(n_pad, ngroups_pad, dtype=torch.int64, device=dev)
    codes[:n, :G] = cs.codes.long()
    halves = codes.reshape(n_pad // ROWS, 2, ROWS // 2, ngroups_pad)          # [slab, half, row, group]
    shifts = 4 * torch.arange(ROWS // 2, device=dev)[:, None]
    grid = torch.zeros(n_pad // ROWS, ngroups_pad, dtype=torch.int64, device=dev)
    bits16 = [t.half().view(torch.int16).long() & 0xFFFF for t in (cs.min, cs.step)]
    grid[:cs.min.shape[0], :G] = bits16[0] | (bits16[1] << 16)
    words = torch.stack([(halves[:, 0] << shifts).sum(1), (halves[:, 1] << shifts).sum(1), grid], -1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


# ----------------------------------------------------------------------------- outliers


def compact_dtypes(k: int, val: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """Outlier column / value dtypes: int16 columns when K ≤ 32768, fp16 values when every
    value is fp16-exact (SSQR checkpoints store fp16; HPTQ transcodes may need fp32)."""
    cdt = torch.int16 if k <= 32768 else torch.int32
    v = val.float()
    vdt = torch.float16 if torch.equal(v.half().float(), v) else torch.float32
    return cdt, vdt


def build_ell(crow, col, val, n_pad, k):
    """CSR → ELL-16 (off [G+1], col, val; padding slots: col 0, val 0)."""
    dev = crow.device
    n = crow.numel() - 1
    G = n_pad // ROWS
    cdt, vdt = compact_dtypes(k, val)
    counts = torch.zeros(n_pad, dtype=torch.int64, device=dev)
    counts[:n] = (crow[1:] - crow[:-1]).long()
    R = counts.reshape(G, ROWS).max(1).values
    off = torch.zeros(G + 1, dtype=torch.int64, device=dev)
    off[1:] = torch.cumsum(R * ROWS, 0)
    S = int(off[-1])
    ecol = torch.zeros(S, dtype=cdt, device=dev)
    evalv = torch.zeros(S, dtype=vdt, device=dev)
    if col.numel():
        rows = fmt.csr_rows(crow)
        rank = torch.arange(col.numel(), device=dev) - crow.long()[rows]
        idx = off[rows // ROWS] + ROWS * rank + rows % ROWS
        ecol[idx] = col.to(cdt)
        evalv[idx] = val.to(vdt)
    return {"off": off.to(torch.int32), "col": ecol, "val": evalv}, int(R.max()) if G else 0


def build_csr(crow, col, val, n_pad, k):
    dev = crow.device
    n = crow.numel() - 1
    cdt, vdt = compact_dtypes(k, val)
    crow_p = torch.empty(n_pad + 1, dtype=torch.int32, device=dev)
    crow_p[: n + 1] = crow.to(torch.int32)
    crow_p[n + 1:] = crow[-1].to(torch.int32)
    return {"crow": crow_p, "row": fmt.csr_rows(crow).to(torch.int32), "col": col.to(cdt).contiguous(),
            "val": val.to(vdt).contiguous()}


def outlier_model(crow: torch.Tensor, n_pad: int, m: int = 1, bn: int = 64, entry_bytes: int = 4) -> dict:
    """Model time (A100-class) of the outlier phase for ELL-16 and CSR (docs/KERNELS.md), per
    ``entry_bytes`` (4 compact, 8 wide) → the numbers and the choice with its reason."""
    n = crow.numel() - 1
    nnz = int(crow[-1])
    counts = torch.zeros(n_pad, dtype=torch.int64, device=crow.device)
    counts[:n] = (crow[1:] - crow[:-1]).long()
    slots = int(counts.reshape(-1, ROWS).max(1).values.sum()) * ROWS
    ell_b, ell_ops = entry_bytes * slots + 4 * (n_pad // ROWS + 1), slots * (1 + m)
    csr_b, csr_ops = (4 + entry_bytes) * nnz + 4 * (n_pad + 1), nnz * bn * (2 + m)
    t_ell = max(ell_b / BW_BYTES, ell_ops / LANE_OPS)
    t_csr = max(csr_b / BW_BYTES, csr_ops / LANE_OPS)
    mode = "ell" if t_ell <= t_csr else "csr"
    pad = slots / nnz if nnz else 1.0
    reason = (f"{mode}: ELL-16 {slots} slots (padding {pad:.2f}x nnz={nnz}) ~{t_ell * 1e9:.0f} ns vs "
              f"CSR ~{t_csr * 1e9:.0f} ns (model: max(bytes/1.5TB/s, lane-ops/9.7T/s), M={m}, BN={bn})")
    return {"mode": mode, "reason": reason, "t_ell": t_ell, "t_csr": t_csr, "slots": slots, "nnz": nnz,
            "padding": pad}


# ----------------------------------------------------------------------------- whole layer

def build(w, outlier_mode: str | None = None) -> TritonLayout:
    """Runtime form :class:`LatqWeight` → :class:`TritonLayout` (``outlier_mode``: force
    ``"ell"``/``"csr"``; default: the model's choice)."""
    bits, K, N = w.bits, w.in_features, w.out_features
    if bits not in WIDTHS:
        raise ValueError(f"Triton kernels support {'/'.join(map(str, WIDTHS))}-bit inliers, got {bits}")
    n_pad = math.ceil(N / ROWS) * ROWS
    k_pad = pad_k(K, bits)
    spans = plane_columns(bits, k_pad)
    dev = w.qweight.device
    u = torch.zeros(n_pad, max([k_pad] + [c for _, c in spans]), dtype=torch.uint8, device=dev)   # z + 2^(b-1)
    for r0 in range(0, N, UNPACK_ROWS):   # row blocks bound the int32 temporary
        z = fmt.unpack(w.qweight[r0:r0 + UNPACK_ROWS], bits, K)
        u[r0:r0 + z.shape[0], :K] = (z + 2 ** (bits - 1)).to(torch.uint8)
    planes = []
    shift = 0
    for pb, cols in spans[:len(planes_of(bits))]:          # bit planes of the main columns
        planes.append(pack_plane((u[:, :cols] >> shift) & ((1 << pb) - 1), pb))
        shift += pb
    if bits == 3:       # the tail: the same integers z, as a 4-bit layer stores them (u + 2^3 − 2^2)
        planes.append(pack_plane(u[:, main_columns(bits, k_pad):k_pad] + 4, 4))
    del u
    ng = w.scales.shape[1]
    group = w.group_size
    if ng == 1:
        group = k_pad                      # one group: the kernel's group index is always 0
    ngp = math.ceil(k_pad / group)
    if w.coded is None:
        scales = fp16_scales(w.scales, n_pad, ngp)
    else:
        if tuple(w.coded.codes.shape) != tuple(w.scales.shape):
            raise ValueError(f"coded scales of shape {tuple(w.coded.codes.shape)} for scales {tuple(w.scales.shape)}")
        scales = coded_scales(w.coded.to(dev), n_pad, ngp)

    nnz = w.nnz
    crow = w.crow.to(dev)
    if nnz == 0:
        mode, reason, outl, rmax = "none", "no outliers", {}, 0
    else:
        cdt, vdt = compact_dtypes(K, w.val)
        eb = cdt.itemsize + vdt.itemsize
        model = outlier_model(crow, n_pad, entry_bytes=eb)
        mode = outlier_mode or model["mode"]
        reason = model["reason"] + ("" if outlier_mode is None else f" [forced {outlier_mode}]")
        if mode == "ell":
            outl, rmax = build_ell(crow, w.col.to(dev), w.val.to(dev), n_pad, K)
        elif mode == "csr":
            outl = build_csr(crow, w.col.to(dev), w.val.to(dev), n_pad, K)
            rmax = int((crow[1:] - crow[:-1]).max())
        else:
            raise ValueError(f"outlier_mode must be 'ell' or 'csr', got {outlier_mode!r}")
    return TritonLayout(planes, scales, bits, group, N, K, n_pad, k_pad, mode, reason, nnz, outl, rmax)
