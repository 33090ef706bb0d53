"""Load-time layout of the Triton kernels (pure torch: no Triton needed, runs on any device).

The checkpoint / runtime form (:class:`~vllm_latq.kernels.weight.LatqWeight`) stores b-bit
offset-binary integers row-major, each tile of 32 columns as one 32·b-bit little-endian number.
Both Triton kernels (SIMT GEMV for M ≤ 7, tensor-core GEMM for M ≥ 8) read ONE repacked copy
of the weights, built once here (weights are never stored twice).

Inliers — "16×16 word blocks"
-----------------------------
A *plane* holds p-bit values (p ∈ {1, 2, 4}), ``V = 32/p`` per int32 word. Rows are grouped by
16; columns by chunks of ``16·V`` (the kernel's K step: 128 columns at 4 bits, 256 at 2 bits).
Within one (16-row group, chunk) the 16 rows × 16 words form one contiguous 1 KiB block,
stored word-major with the row fastest::

    word(g, c, w, r) = Σ_j  value(row 16g + r, column c·16V + 16j + w) << (p·j)
    address          = ((g · nchunks + c) · 16 + w) · 16 + r                  (int32 units)

so a [16 words × BN rows] tile is BN/16 contiguous 1 KiB runs (perfectly coalesced 16-byte
vector loads), and *slot j of all 16 words is 16 consecutive columns* ``c·16V + 16j + [0, 16)``:
one shift/mask of a word tile yields a dense [16 × BN] slab of W^T, which is exactly the
``K = 16`` B-operand of one tensor-core MMA (``tl.dot``) and a 16-column slab of the SIMT GEMV.
No reshape/transposition is ever needed in the kernel; slabs of one word tile share its load.

3-bit inliers — two planes (2 + 1 bits) and a 4-bit tail
---------------------------------------------------------
3 bits are stored as a 2-bit plane (``u & 3``, the 2-bit layout above, chunks of 256) plus a
1-bit plane (``u >> 2``, V = 32, chunks of 512): still exactly 32 values in 3 words, no wasted
bit, so 3-bit weights stream 3/32 bytes per weight like the checkpoint. Alternatives rejected:
10 values per int32 wastes 2 bits in 32 (+6.7 % bytes on a memory-bound kernel) and makes the
values per word a non-power of two, which Triton tiles cannot express; the checkpoint's own
96-bit tiles make values 10 and 21 straddle two words (a funnel shift + word select per value).
With planes, a 3-bit value is one shift of the 1-bit word plus two LOP3s: ``(lo & 3<<s) |
(hi' & 4<<s) | magic`` (see the kernel). The kernel's K step is 512 columns at 3 bits.

Padding K to that step cost up to 511 columns × 3 bits per row (Gemma3-270M's 640-column
layers were served at 5 bits/weight, SmolLM2's 576-column ones at 5.6). So the planes cover
only the whole 512-column chunks, ``K_main = 512·⌊K_pad/512⌋`` with K_pad = K rounded up to
128, and the rest (the *tail*: 128, 256 or 384 columns) is stored as a 4-bit layer stores the
same integers (``z + 8`` in the 4-bit layout, chunks of 128): after its main steps the kernel
runs the tail's 128-column steps with its 4-bit code. Cost: one bit more per tail column, at
most 384 bits per row — one 128-column step at 3 bits. A narrower 3-bit last chunk was
rejected: its 2-bit words would be half used (a chunk is 16 words of 16 values), and a third
word shape would need its own code; padding the tail to 512 instead costs as much only when
the tail is 384 columns.

5-bit inliers — two planes (4 + 1 bits)
---------------------------------------
A 4-bit plane (``u & 15``, the 4-bit layout) plus a 1-bit plane (``u >> 4``, chunks of 512,
padded to whole chunks: at most 384 padding bits per row): 5/32 bytes per weight. The K step
is the 4-bit plane's 128 columns; step s takes bits 8·(s mod 4) + [0, 8) of the 1-bit tile of
chunk ⌊s/4⌋, so the four steps of a chunk load its 1-bit tile four times (from L1/L2 after
the first, expected; not yet measured on a GPU) instead of holding a 512-column step's five
word tiles in registers. A value is ``(lo & 15<<s) | (hi' & 16<<s) | magic``, as at 3 bits.

Rows are padded to a multiple of 16 (zero words, zero scales) and columns to the K step
(2/4 bits) or to 128 (3/5 bits); the activations are masked there, and their scales are
zero. :func:`plane_columns` lists each plane's bits and columns.

Scales — fp16, ``[ngroups_padded, 16]`` per 16-row group (row fastest, so the BN scales of a
group are contiguous), ``ngroups_padded = ceil(K_pad / g)``; one group for a per-tensor scale.

Coded scales (``w.coded``, :mod:`~vllm_latq.format.scale_codes`: 4-bit codes on a min/step
grid per 16 rows of a group) are laid out instead of the fp16 ones: the format's 16-row blocks
are the slabs here (both start at row 0), so per (slab g, group) three int32 words,
``[N_pad/16, ngroups_padded, 3]``::

    word 0: codes of rows 16g + 0..7   (row 16g + r at bits 4r)
    word 1: codes of rows 16g + 8..15  (row 16g + 8 + r at bits 4r)
    word 2: fp16 bits of min | fp16 bits of step << 16

12 bytes per 16 scales (6 bits a scale, the format's own cost; fp16: 32 bytes). A kernel lane
of row r loads word ``r >> 3`` and word 2 (a broadcast within the slab) and decodes with the
format's arithmetic, ``fp16(fp32(min) + code · fp32(step))`` (``triton_device._group_scale``),
the same fp16 values as :func:`~vllm_latq.format.scale_codes.decode_scales`. Padding groups
have zero words (scale 0); padding rows of the last slab decode to its min, harmlessly: their
outputs are never stored (fp16 padding rows are 0, equally unused). Three words, not four
(16-byte aligned): the fourth would cost 2 bits per scale for loads that are already
per-lane gathers.

Outliers — ELL-16 (the paper's layout) or CSR, chosen per layer by :func:`outlier_model`
-------------------------------------------------------------------------------------------
ELL-16: rows grouped by 16 (the tensor-core N tile), column-major within the group (entry r of
the 16 rows is 16 consecutive slots), padded to the group's largest row count ``R_g``;
``off[g] = 16·Σ_{h<g} R_h``. A program reads a [BR × BN] tile per step with unit-stride
16-lane runs and adds ``val · x[:, col]`` straight into its own output rows — no scatter, no
row lookup, no per-entry control flow.

CSR (plain, as in the checkpoint, plus a COO row index per entry): a program's rows own the
contiguous entry range ``crow[n0] .. crow[n0+BN]``; each entry must be routed to its row inside
the program by a one-hot compare over the BN rows (BN lanes of work per entry).

Entries are compact: int16 columns when K ≤ 32768, fp16 values when all are fp16-exact
(SSQR checkpoints store fp16; an HPTQ transcode may need fp32) — 4 bytes per entry.

The model (:func:`outlier_model`) compares, per layer, the time of the outlier phase of one
GEMV on an A100-class part ``max(bytes / 1.5 TB/s, lane-ops / 9.7 T/s)``:
  ELL: e bytes (e = 4 compact) and ``1 + M`` lane-ops per padded slot (``Σ_g 16·R_g`` slots);
  CSR: e + 4 bytes (the row index) per entry and ``BN·(2 + M)`` lane-ops per entry (one-hot
  routing of each entry to its row among the program's BN rows).
ELL wins whenever the padding ratio ``16·ΣR_g / nnz`` stays below ~2 in bytes and far
beyond that in ALU time (random outliers at 0.5–5 % pad by 1.07–1.25× for 16 rows of 4096
columns), so ELL is the default; CSR is kept for layers whose outliers crowd into a few
rows (padding ratio ≫ 2), where ELL would stream mostly zeros.
"""
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


def step_of(bits: int) -> int:
    """Columns per K step of the main loop: 16 words × values per word of the plane that sets
    it (3 bits: the 1-bit plane's 512; 5 bits: the 4-bit plane's 128, the 1-bit tile of a
    512-column chunk serving four steps)."""
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
    """What the kernels index: word chunks per row group of plane A and of the 1-bit plane
    (``nch_a``, ``nch_h``), main K steps (``nsteps``), 4-bit tail steps of 128 columns
    (``tsteps``: 3 bits only; also the tail plane's chunks per row group) and the first tail
    column (``k_main``)."""
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
    """Model time (seconds, A100-class) of the outlier phase for ELL-16 and CSR; see the
    module docstring. ``entry_bytes``: column + value bytes (4: int16 + fp16, 8: int32 +
    fp32). Returns the numbers and the choice with its reason."""
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
