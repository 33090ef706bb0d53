"""What the offline compile report (:mod:`tools.triton_compile`) compiles: every ``@triton.jit``
kernel the package launches, as the jobs of :func:`all_jobs` and the ``triton.compile`` source
of each job (:func:`source`: signature, constexprs, Triton's 16-divisibility of the arguments
as production launches see them). :func:`package_kernels` scans the package for its launched
kernels, so a kernel added without a report entry fails the report's test.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "vllm_latq"
TRITON_DIR = PACKAGE / "kernels" / "triton"
TARGETS = {80: 166912, 86: 101376, 89: 101376, 90: 232448}   # cc → max dynamic smem per block (bytes)
# report name → (file under kernels/triton, the @triton.jit kernel it launches)
KERNELS = {"gemv": ("device.py", "_gemv_kernel"), "mma": ("mma.py", "_mma_kernel"),
           "gemv_pipe": ("pipelined.py", "_gemv_pipelined_kernel"), "mma_pipe": ("pipelined.py", "_mma_pipelined_kernel"),
           "moe": ("grouped_moe.py", "_moe_gemv_kernel"), "dequant": ("dequant.py", "_dequant_kernel"),
           "outliers": ("dequant.py", "_outlier_kernel"), "hadamard": ("hadamard.py", "_hadamard_kernel"),
           "e8_gemv": ("codebook_device.py", "_e8_gemv_kernel"), "e8_mma": ("codebook_device.py", "_e8_mma_kernel"),
           "e8_dequant": ("codebook_device.py", "_e8_dequant_kernel")}
SCALES = ("fp16", "coded")      # the scales' layouts (triton_layout): the kernels' CODED flag
S_PTR = {"fp16": "*fp16", "coded": "*i32"}
DTYPES = ("bf16", "fp16")       # activations: the large-M path writes the weights in their dtype
DIV16 = [["tt.divisibility", 16]]


# ----------------------------------------------------------------------------- the package's kernels

def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, (ast.Attribute, ast.Name, ast.Call)) and "jit" in ast.dump(d) for d in fn.decorator_list)


def package_kernels(root: Path = PACKAGE) -> set[tuple[str, str]]:
    """{(file relative to ``root``, name)} of every ``@triton.jit`` function under ``root`` that no
    other jit function calls: the kernels host code launches (a called one is a device helper)."""
    jit: dict[str, list[str]] = {}
    called: set[str] = set()
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                jit.setdefault(node.name, []).append(str(f.relative_to(root)))
                called |= {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call)
                           and isinstance(c.func, ast.Name) and c.func.id != node.name}
    return {(path, name) for name, paths in jit.items() if name not in called for path in paths}


def reported_kernels() -> set[tuple[str, str]]:
    """:data:`KERNELS` as :func:`package_kernels` names them."""
    return {(str((TRITON_DIR / f).relative_to(PACKAGE)), fn) for f, fn in KERNELS.values()}


# ----------------------------------------------------------------------------- jobs

def all_jobs(targets=tuple(TARGETS), quick: bool = False) -> list[dict]:
    """Every (kernel, specialisation, config, target). ``quick``: per kernel and bit width the
    heaviest tile only (largest BM, then most accumulator elements per thread), CSR outliers,
    split-K; bf16 only for the large-M kernels — the default test; the full sweep is the slow
    test and the bench."""
    return (_tile_jobs(targets, quick) + _pipelined_jobs(targets, quick) + _moe_jobs(targets, quick)
            + _dequant_jobs(targets, quick) + _outlier_jobs(targets, quick) + _hadamard_jobs(targets, quick)
            + _codebook_jobs(targets, quick))


def _tile_jobs(targets, quick: bool) -> list[dict]:
    from vllm_latq.kernels.triton import configs as cfg
    from vllm_latq.kernels.triton import kernel as tk
    from vllm_latq.kernels.triton.layout import WIDTHS
    jobs = []
    for kernel, tiles, splits in (("gemv", tk.GEMV_TILES, lambda bm: (1, 8)),
                                  ("mma", tk.MMA_TILES, lambda bm: (1, max(tk.MMA_SPLITS[bm])))):
        for bits in WIDTHS:
            for bm, tl_ in tiles.items():
                if quick and bm != max(tiles):
                    continue
                for t in tl_:
                    if quick and t != max(tl_, key=lambda t: (t[0] / t[1], t[0])):
                        continue
                    cap = (tk.MMA_MAXNREG if kernel == "mma" else tk.GEMV_MAXNREG)[bits]
                    tile = dict(BN=t[0], num_warps=t[1], maxnreg=cap, **({"BR": t[2]} if kernel == "mma" else {}))
                    # pipeline stages as served (1 is the compiler's single-buffered default)
                    n_st = cfg.stages(kernel, bits, bm, t[0], t[1])
                    stages = {"num_stages": n_st} if n_st > 1 else {}
                    variants = [(max(splits(bm)), "csr")] if quick else \
                        [(sp, o) for sp in dict.fromkeys(splits(bm)) for o in ("none", "ell", "csr")]
                    for sp, outl in variants:
                        for scales in SCALES:
                            for cc in targets:
                                jobs.append(dict(kernel=kernel, bits=bits, BM=bm, SPLIT=sp, outl=outl, scales=scales,
                                                 cc=cc, **tile, **stages))
    return jobs


def _pipelined_jobs(targets, quick: bool) -> list[dict]:
    """The pipelined kernels: every tile of the unpipelined ones at its ``configs.PIPE_DEPTH``, on
    the targets of ``configs.PIPE_FAMILIES`` (quick: the heaviest tile per kernel and width)."""
    from vllm_latq.kernels.triton import configs as cfg
    ccs = [cc for cc in targets if f"sm_{cc}" in cfg.PIPE_FAMILIES]
    jobs = []
    for kernel, tiles, splits in (("gemv", cfg.GEMV_TILES, lambda bm: (1, 8)),
                                  ("mma", cfg.MMA_TILES, lambda bm: (1, max(cfg.MMA_SPLITS[bm])))):
        for (kern, bits, bm), depth in cfg.PIPE_DEPTH.items():
            heaviest = max(b for k, w, b in cfg.PIPE_DEPTH if (k, w) == (kern, bits))
            if kern != kernel or (quick and bm != heaviest):
                continue
            tl_ = tiles[bm]
            for t in tl_:
                if quick and t != max(tl_, key=lambda t: (t[0] / t[1], t[0])):
                    continue
                cap = (cfg.MMA_MAXNREG if kernel == "mma" else cfg.GEMV_MAXNREG)[bits]
                tile = dict(BN=t[0], num_warps=t[1], maxnreg=cap, DEPTH=depth, **({"BR": t[2]} if kernel == "mma" else {}))
                n_st = cfg.stages(kernel, bits, bm, t[0], t[1])
                stages = {"num_stages": n_st} if n_st > 1 else {}
                variants = [(max(splits(bm)), "csr")] if quick else \
                    [(sp, o) for sp in dict.fromkeys(splits(bm)) for o in ("none", "ell", "csr")]
                jobs += [dict(kernel=f"{kernel}_pipe", bits=bits, BM=bm, SPLIT=sp, outl=outl, scales=scales, cc=cc,
                              **tile, **stages) for sp, outl in variants for scales in SCALES for cc in ccs]
    return jobs


def _moe_jobs(targets, quick: bool) -> list[dict]:
    """The grouped MoE kernel: one fixed tile per BM, ELL or no outliers."""
    from vllm_latq.kernels.triton import grouped_moe as tm
    jobs = []
    for bits in (2, 3, 4):
        for bm, (bn, nw) in tm.MOE_TILES.items():
            if quick and bm != max(tm.MOE_TILES):
                continue
            for outl in ("ell",) if quick else ("none", "ell"):
                for scales in SCALES:
                    for cc in targets:
                        jobs.append(dict(kernel="moe", bits=bits, BM=bm, SPLIT=1, outl=outl, scales=scales, cc=cc,
                                         BN=bn, num_warps=nw, maxnreg=tm.moe_maxnreg(bits, bm)))
    return jobs


def _dequant_jobs(targets, quick: bool) -> list[dict]:
    """Dequantise-once: its one fixed tile, per weight dtype, bit width (a 3-bit layer's tail is
    the 4-bit variant) and scale layout; quick: bf16 at 3 and 5 bits (two word planes, the
    integer rounding), the heaviest."""
    from vllm_latq.kernels.triton import dequant as td
    from vllm_latq.kernels.triton.layout import WIDTHS
    c = td.DEQUANT_CONFIG
    return [dict(kernel="dequant", dtype=dt, bits=bits, scales=scales, cc=cc, BN=c["BN"], DS=c["DS"],
                 num_warps=c["num_warps"])
            for dt in (DTYPES[:1] if quick else DTYPES) for bits in ((3, 5) if quick else WIDTHS)
            for scales in SCALES for cc in targets]


def _outlier_jobs(targets, quick: bool) -> list[dict]:
    """The outlier stores of the large-M path, ELL and CSR, compact entries (int16 / fp16)."""
    from vllm_latq.kernels.triton import dequant as td
    c = td.OUTLIER_CONFIG
    return [dict(kernel="outliers", dtype=dt, outl=outl, cc=cc, BE=c["BE"], num_warps=c["num_warps"])
            for dt in (DTYPES[:1] if quick else DTYPES) for outl in ("ell", "csr") for cc in targets]


def _hadamard_jobs(targets, quick: bool) -> list[dict]:
    """A rotated layer's input transform, per activation dtype and block width (quick: bf16 at
    the widest block, the largest tile), the launch's rows per program and Triton's 4 warps."""
    from vllm_latq.format.rotation import MAX_BLOCK
    from vllm_latq.kernels.triton.hadamard import rows_per_program
    blocks = [MAX_BLOCK] if quick else [1 << i for i in range(MAX_BLOCK.bit_length())]
    return [dict(kernel="hadamard", dtype=dt, B=b, BM=rows_per_program(b), BN=b, cc=cc, num_warps=4)
            for dt in (DTYPES[:1] if quick else DTYPES) for b in blocks for cc in targets]


def _codebook_jobs(targets, quick: bool) -> list[dict]:
    """The codebook layers' kernels (``triton/codebook.py``) at their tiles: the GEMV at 1 and 8 rows
    of x (split-K's epilogue), the tensor-core kernel at 16 and 64; per code width, with fp16 scales of
    64 columns (one a K step) and coded ones of 16 (a scale per block, decoded). Quick: the most rows, 3 and 4 bits, coded scales
    of 16 columns (the heaviest decode). The GEMV at 1 row also with its table in shared memory and/or
    its codes a step ahead (``lds``, ``ahead``: the alternatives to codebook.GEMV_LDS_TABLE, GEMV_AHEAD)."""
    from vllm_latq.kernels.triton import codebook as tcb
    out = []
    for kernel, bms in (("e8_gemv", (1, 8)), ("e8_mma", (16, 64))):
        for bm in bms[-1:] if quick else bms:
            tile = tcb.GEMV_TILES[bm] if kernel == "e8_gemv" else tcb.MMA_TILE
            alts = [(ld, ah) for ld in (False, True) for ah in (False, True)] if kernel == "e8_gemv" and bm == 1 \
                else [(False, False)]
            for bits in (3, 4) if quick else tcb.BITS:
                for scales, group in [("coded", 16)] if quick else [("fp16", 64), ("coded", 16)]:
                    out += [dict(kernel=kernel, bits=bits, BM=bm, SPLIT=8 if kernel == "e8_gemv" else 1,
                                 scales=scales, group=group, cc=cc, **tile, **({"lds": True} if ld else {}),
                                 **({"ahead": True} if ah else {}))
                            for cc in targets for ld, ah in alts]
    for bits in (3,) if quick else tcb.BITS:          # the large-M route's decode into a bf16 scratch
        out += [dict(kernel="e8_dequant", bits=bits, scales="coded", group=16, cc=cc, **tcb.DEQUANT_TILE)
                for cc in targets]
    return out


# ----------------------------------------------------------------------------- sources

def source(j: dict):
    """The ``triton.compile`` source of one job (TRITON_INTERPRET must be unset)."""
    return {"gemv": _tile_source, "mma": _tile_source, "gemv_pipe": _pipelined_source, "mma_pipe": _pipelined_source,
            "moe": _moe_source, "dequant": _dequant_source, "outliers": _outlier_source,
            "hadamard": _hadamard_source, "e8_gemv": _codebook_source, "e8_mma": _codebook_source,
            "e8_dequant": _e8_dequant_source}[j["kernel"]](j)


def _ast_source(fn, sig: dict, const: dict, div16):
    from triton.compiler import ASTSource
    sig = {**sig, **{n: "constexpr" for n in const}}
    names = fn.arg_names
    return ASTSource(fn, sig, const, {(names.index(n),): DIV16 for n in div16})


def _tile_source(j: dict):
    """The SIMT GEMV or the tensor-core kernel: bf16 activations (fp16 differs only in convert
    opcodes), compact outliers as for an SSQR checkpoint with K ≤ 32768 (int16 columns, fp16
    values); sizes and pointers 16-divisible as for the Qwen3-8B shapes, M not (it is never
    specialised: ``do_not_specialize``)."""
    from vllm_latq.kernels.triton import device as td
    from vllm_latq.kernels.triton import mma as tmma
    from vllm_latq.kernels.triton import kernel as tk
    fn = td._gemv_kernel if j["kernel"] == "gemv" else tmma._mma_kernel
    optr = {"none": ["*fp16"] * 4, "ell": ["*i32", "*fp16", "*i16", "*fp16"],
            "csr": ["*i32", "*i32", "*i16", "*fp16"]}[j["outl"]]
    ptrs = ["*bf16", "*bf16", "*bf16", "*i32", "*i32", "*i32", S_PTR[j["scales"]], *optr, "*fp32", "*i32"]
    ints = ["M", "N", "K", "stride_xm", "stride_ym", "N_PAD", "NCH_A", "NCH_H", "NGP", "NSTEPS", "TSTEPS", "M_WS"]
    names = fn.arg_names
    sig = {**dict(zip(names, ptrs)), **{n: "i32" for n in ints}}
    const = dict(BITS=j["bits"], GROUP=128, SPG=tk.spg_of(j["bits"], 128), BM=j["BM"], BN=j["BN"],
                 SPLIT=j["SPLIT"], OUTL=tk.OUTL_CODE[j["outl"]], HAS_BIAS=True, ASM=True, CODED=j["scales"] == "coded")
    if j["kernel"] == "mma":
        const.update(BR=j["BR"], F32DOT=False)
        sig.update(xt_ptr="*bf16", stride_xt="i32")
    div16 = set(names[:len(ptrs)]) | {"N", "K", "stride_xm", "stride_ym", "N_PAD", "M_WS"}
    if j["kernel"] == "mma":        # xᵀ: whole row tiles of rows (kernel._padded_xt)
        div16 |= {"xt_ptr", "stride_xt"}
    return _ast_source(fn, sig, const, div16)


def _pipelined_source(j: dict):
    """A pipelined kernel (``triton/pipelined.py``): its unpipelined kernel's source (the same
    arguments and specialisation) with the pipelined function and its prefetch ``DEPTH``."""
    from triton.compiler import ASTSource
    from vllm_latq.kernels.triton import pipelined as tp
    base = _tile_source({k: v for k, v in j.items() if k != "DEPTH"} | {"kernel": j["kernel"].split("_")[0]})
    fn = tp._gemv_pipelined_kernel if j["kernel"] == "gemv_pipe" else tp._mma_pipelined_kernel
    names = base.fn.arg_names
    const = {names[i]: v for (i,), v in base.constants.items()} | {"DEPTH": j["DEPTH"]}
    return ASTSource(fn, {**base.signature, "DEPTH": "constexpr"}, const, base.attrs)


def _moe_source(j: dict):
    """The grouped MoE kernel: bf16 activations, compact ELL outliers (int16 / fp16)."""
    from vllm_latq.kernels.triton import kernel as tk
    from vllm_latq.kernels.triton.grouped_moe import _moe_gemv_kernel as fn
    optr = ["*i32", "*i16", "*fp16"] if j["outl"] == "ell" else ["*fp16"] * 3
    ptrs = ["*bf16", "*bf16", "*i32", "*i32", "*i32", S_PTR[j["scales"]], *optr, "*i32"]
    ints = ["N", "K", "stride_xm", "stride_ym", "N_PAD", "NCH_A", "NCH_H", "NGP", "NSTEPS", "TSTEPS",
            "EXP_A", "EXP_H", "EXP_T", "EXP_S", "EXP_O"]
    names = fn.arg_names
    sig = {**dict(zip(names, ptrs)), **{n: "i32" for n in ints}}
    const = dict(BITS=j["bits"], GROUP=128, SPG=tk.spg_of(j["bits"], 128), BM=j["BM"], BN=j["BN"],
                 OUTL=tk.OUTL_CODE[j["outl"]], ASM=True, CODED=j["scales"] == "coded")
    div16 = set(names[:len(ptrs)]) | {"N", "K", "stride_xm", "stride_ym", "N_PAD", "EXP_A", "EXP_S"}
    return _ast_source(fn, sig, const, div16)


def _dequant_source(j: dict):
    """Dequantise-once into a ``dtype`` scratch: rows from ROW0 (a multiple of 16) and K0 (0, or
    a 3-bit layer's first tail column, a multiple of 512) are 16-divisible by contract."""
    from vllm_latq.kernels.triton.dequant import _dequant_kernel as fn
    sig = dict(w_ptr="*" + j["dtype"], pa_ptr="*i32", ph_ptr="*i32", s_ptr=S_PTR[j["scales"]], ROW0="i32",
               ROW1="i32", K="i32", K0="i32", stride_wn="i32", N_PAD="i32", NCH_A="i32", NCH_H="i32", NGP="i32")
    const = dict(BITS=j["bits"], GROUP=128, BN=j["BN"], DS=j["DS"], CODED=j["scales"] == "coded")
    div16 = {"w_ptr", "pa_ptr", "ph_ptr", "s_ptr", "ROW0", "K", "K0", "stride_wn", "N_PAD"}
    return _ast_source(fn, sig, const, div16)


def _outlier_source(j: dict):
    """The outlier stores: ELL's missing row array is passed as its start array (int32), as the
    launch does."""
    from vllm_latq.kernels.triton import kernel as tk
    from vllm_latq.kernels.triton.dequant import _outlier_kernel as fn
    sig = dict(w_ptr="*" + j["dtype"], start_ptr="*i32", row_ptr="*i32", col_ptr="*i16", val_ptr="*fp16",
               ROW0="i32", ROW1="i32", stride_wn="i32")
    const = dict(OUTL=tk.OUTL_CODE[j["outl"]], BE=j["BE"])
    div16 = {"w_ptr", "start_ptr", "row_ptr", "col_ptr", "val_ptr", "ROW0", "stride_wn"}
    return _ast_source(fn, sig, const, div16)


def _hadamard_source(j: dict):
    """The input transform: activations in and out in ``dtype``, fp32 signs; rows contiguous and
    16-divisible as a layer's inputs are."""
    from vllm_latq.kernels.triton.hadamard import _hadamard_kernel as fn
    sig = dict(x_ptr="*" + j["dtype"], s_ptr="*fp32", y_ptr="*" + j["dtype"], M="i32", stride_xm="i32",
               stride_ym="i32", scale="fp32")
    const = dict(B=j["B"], LOG=j["B"].bit_length() - 1, BM=j["BM"])
    return _ast_source(fn, sig, const, {"x_ptr", "s_ptr", "y_ptr", "stride_xm", "stride_ym"})


def _table_sig() -> str:
    """The codebook kernels' shared table as a pointer type (its element type, from the host's table)."""
    from vllm_latq.kernels.triton import codebook as tcb
    return "*" + {"int64": "i64", "int32": "i32"}[str(tcb.table_words().dtype).removeprefix("torch.")]


def _e8_dequant_source(j: dict):
    """The codebook layers' decode into a bf16 scratch: rows from ROW0 (a multiple of 16) and the
    sizes 16-divisible as for the Qwen3-8B shapes (the block and group counts never specialised)."""
    from vllm_latq.kernels.triton.codebook_device import _e8_dequant_kernel as fn
    plane = "*i32" if j["bits"] == 4 else "*i16"
    sig = dict(w_ptr="*bf16", ca_ptr=plane, cb_ptr="*u8" if j["bits"] == 3 else plane, s_ptr=S_PTR[j["scales"]],
               tab_ptr=_table_sig(), ROW0="i32", ROW1="i32", K="i32", KB="i32", stride_wn="i32", N_PAD="i32", NGP="i32")
    const = dict(BITS=j["bits"], GROUP=j["group"], BN=j["BN"], BKB=j["BKB"], ASM=True, CODED=j["scales"] == "coded")
    div16 = {"w_ptr", "ca_ptr", "cb_ptr", "s_ptr", "tab_ptr", "ROW0", "K", "stride_wn", "N_PAD"}
    return _ast_source(fn, sig, const, div16)


def _codebook_source(j: dict):
    """A codebook kernel: bf16 activations, sizes and pointers 16-divisible as for the Qwen3-8B shapes
    (M and the per-layer block and group counts never specialised: ``do_not_specialize``)."""
    from vllm_latq.kernels.triton import codebook as tcb
    from vllm_latq.kernels.triton import codebook_device as tcd
    fn = tcd._e8_gemv_kernel if j["kernel"] == "e8_gemv" else tcd._e8_mma_kernel
    plane = "*i32" if j["bits"] == 4 else "*i16"
    ptrs = ["*bf16", "*bf16", "*bf16", plane, "*u8" if j["bits"] == 3 else plane, S_PTR[j["scales"]],
            _table_sig(), "*fp32", "*i32"]
    ints = ["M", "N", "K", "KB", "stride_xm", "stride_ym", "N_PAD", "NGP", "M_WS"]
    names = fn.arg_names
    sig = {**dict(zip(names, ptrs)), **{n: "i32" for n in ints}}
    const = dict(BITS=j["bits"], GROUP=j["group"], BM=j["BM"], BN=j["BN"], BKB=j["BKB"], SPLIT=j["SPLIT"],
                 HAS_BIAS=True, ASM=True, CODED=j["scales"] == "coded")
    if j["kernel"] == "e8_mma":
        const.update(GKB=tcb.dot_blocks(j["group"], j["BKB"]), F32DOT=False)
    else:
        const.update(LDS=j.get("lds", False), AHEAD=j.get("ahead", False))
    div16 = set(names[:len(ptrs)]) | {"N", "K", "stride_xm", "stride_ym", "N_PAD", "M_WS"}
    return _ast_source(fn, sig, const, div16)
