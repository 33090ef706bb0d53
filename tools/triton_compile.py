"""Offline compilation of every Triton kernel config for real GPUs, without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs the whole CUDA
pipeline (TTIR → TTGIR → LLVM → PTX → ptxas → cubin) on the CPU. For every job we record
ptxas' own verdict (registers, spill stores/loads, stack frame: Triton's ptxas log), the
shared memory Triton allocated, and SASS instruction counts from the ``nvdisasm`` that
Triton ships. The interpreter (``TRITON_INTERPRET=1``) cannot compile, so jobs run in worker
subprocesses with it unset; results are cached on disk, keyed by the kernel source and the
Triton version, so the tests and ``bench/kernels.py`` share them.

Columns: registers/thread, spill bytes (stores + loads), shared memory (bytes), SASS
instructions (total; memory / fp32 / integer / convert / MMA classes), the K loop's length
and its instructions per weight per thread (``i/w``: one trip = one K step (mma 2/4 bits), a
128-column quarter step (mma 3 bits) or one 16-bit half of a step (gemv), of BN rows;
at M = 1 the ALU-issue ceiling is ~19.5 T lane-instructions/s on an A100 / i/w weights/s).

Jobs (:mod:`tools.triton_sources`, every ``@triton.jit`` kernel the package launches): the
SIMT GEMV and tensor-core kernels as kernel × bits × BM × tile config (BN, warps, [BR],
register cap) × SPLIT ∈ {1, the largest} (other splits compile to the same code with another
constant) × outlier layout (none / ELL-16 / CSR, compact int16/fp16 entries) × scales (fp16 /
coded: ``CODED``) × target; the grouped MoE kernel per BM; the large-M path's dequantise and
outlier kernels per weight dtype. Activations of the first three are bf16 (fp16 differs only
in convert opcodes); sizes and pointers carry Triton's 16-divisibility specialisation, as for
the Qwen3-8B shapes.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tools import triton_sources as ts
from tools.compile_proxies import GLOBAL_LOADS, load_width, proxies
from tools.triton_sources import SCALES, S_PTR, TARGETS, all_jobs  # noqa: F401  (the report's job list)

CACHE = Path(os.environ.get("LATQ_CACHE", Path.home() / ".cache" / "vllm_latq")) / "triton_static"
REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "vllm_latq" / "kernels" / "triton"   # the device code compiled here
SOURCE_OF = {"gemv": "_tile_source", "mma": "_tile_source", "moe": "_moe_source", "dequant": "_dequant_source",
             "outliers": "_outlier_source", "hadamard": "_hadamard_source", "gemv_pipe": "_pipelined_source",
             "mma_pipe": "_pipelined_source", "e8_gemv": "_codebook_source", "e8_mma": "_codebook_source",
             "e8_dequant": "_e8_dequant_source"}


def _strip_docstrings(tree):
    import ast
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _code_fingerprint(src: str, kernel: str | None = None) -> str:
    """The AST without docstrings (comments are not in the AST) — of the whole source, or,
    with ``kernel``, of that ``@triton.jit`` function and the jit functions it calls
    (transitively): the device code its binaries depend on. Host-side tables (tiles, caps)
    are carried by the jobs themselves. Editing prose, host code or the other kernel does
    not invalidate a kernel's cache; editing its device code does."""
    import ast
    tree = _strip_docstrings(ast.parse(src))
    if kernel is None:
        return ast.dump(tree, include_attributes=False)
    jit = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)
           and any("jit" in ast.dump(d) for d in n.decorator_list)}
    seen, todo = [], [kernel]
    while todo:
        f = todo.pop()
        if f in seen or f not in jit:
            continue
        seen.append(f)
        todo += [n.id for n in ast.walk(jit[f]) if isinstance(n, ast.Name) and n.id in jit]
    return "\n".join(ast.dump(jit[f], include_attributes=False) for f in sorted(seen))


def _code_digest(kernel: str):
    """One kernel's device code (+ the job → source code). A kernel outside device.py calls
    device.py's helpers: all of that file's device code counts for it."""
    import inspect
    file, fn = ts.KERNELS[kernel]
    h = hashlib.sha256(_code_fingerprint((KERNELS / file).read_text(), fn).encode())
    if file != "device.py":
        h.update(_code_fingerprint((KERNELS / "device.py").read_text()).encode())
    for f in (getattr(ts, SOURCE_OF[kernel]), ts._ast_source, _compile, sass_counts, load_width):
        h.update(_code_fingerprint(inspect.getsource(f)).encode())
    if file == "pipelined.py":       # it calls mma.py's helpers, and its source is _tile_source's
        h.update(_code_fingerprint((KERNELS / "mma.py").read_text()).encode())
        h.update(_code_fingerprint(inspect.getsource(ts._tile_source)).encode())
    return h


def code_hash(kernel: str) -> str:
    """What a kernel's binaries depend on in this repository (the record's key per kernel)."""
    return _code_digest(kernel).hexdigest()[:16]


def triton_version() -> str:
    import importlib.metadata as md
    return md.version("triton")


def source_hash(kernel: str) -> str:
    """The cache key of a kernel's results: its code and the Triton that compiled it."""
    h = _code_digest(kernel)
    h.update(triton_version().encode())
    return f"{kernel}-{h.hexdigest()[:16]}"


def job_key(j: dict) -> str:
    return json.dumps(j, sort_keys=True)


# ----------------------------------------------------------------------------- one compile (worker)

def _bin(name: str) -> str:
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass_counts(cubin: bytes) -> tuple[dict, int, dict, list]:
    """Opcode counts of the whole kernel, the length and opcode counts of its K loop (a
    backward branch to an earlier label; the loop richest in LOP3/HMMA), its global store
    opcodes with their widths (``STG.E.128``) and the global loads of the loop around its K loop
    (a K step) by width in bytes."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([_bin("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    ops = Counter()
    seq, widths, labels, loops, stores = [], [], {}, [], set()
    for line in out.splitlines():
        lab = re.match(r"^(\.L_x_\d+):", line)
        if lab:
            labels[lab.group(1)] = len(seq)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)", line)
        if m:
            ops[m.group(1)] += 1
            if m.group(1) == "STG":
                stores.add(m.group(1) + m.group(2))
            seq.append(m.group(1))
            widths.append(load_width(m.group(2)) if m.group(1) in GLOBAL_LOADS else 0)
            br = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
            if br and br.group(1) in labels and labels[br.group(1)] < len(seq) - 1:
                loops.append((labels[br.group(1)], len(seq)))
    # the K loop: the loop with the most dequantisation (LOP3) and MMA instructions
    best = max(loops, key=lambda ab: sum(1 for o in seq[ab[0]:ab[1]] if o in ("LOP3", "HMMA")), default=(0, 0))
    loop = Counter(seq[best[0]:best[1]])
    # the K-step loop: the outermost loop around the K loop (the GEMV's word tiles load a step
    # ahead, outside its inner loop over 16-bit halves)
    step = max((ab for ab in loops if ab[0] <= best[0] and best[1] <= ab[1]), key=lambda ab: ab[1] - ab[0],
               default=best)
    loads = Counter(w for w in widths[step[0]:step[1]] if w)
    return dict(ops), best[1] - best[0], dict(loop), sorted(stores), {str(w): n for w, n in sorted(loads.items())}


def compile_job(j: dict) -> dict:
    """Compile one job (TRITON_INTERPRET must be unset in this process)."""
    from vllm_latq.kernels.triton import kernel as tk
    assert not tk.INTERPRET, "compile jobs need TRITON_INTERPRET unset"
    return _compile(ts.source(j), j)


def _compile(src, j: dict) -> dict:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    knobs.nvidia.dump_ptxas_log = True
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        c = triton.compile(src, target=GPUTarget("cuda", j["cc"], 32),
                           options=dict(num_warps=j["num_warps"], num_stages=j.get("num_stages", 1),
                                        **({"maxnreg": j["maxnreg"]} if j.get("maxnreg") else {})))
    log = buf.getvalue()
    regs = re.search(r"Used (\d+) registers", log)
    st = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    ops, loop_len, loop_ops, stores, loop_loads = sass_counts(c.asm["cubin"])
    return dict(loop_len=loop_len, loop_ops=loop_ops, loop_loads=loop_loads, stores=stores,
                regs=int(regs.group(1)) if regs else None,
                spill_stores=int(st.group(1)) if st else None, spill_loads=int(st.group(2)) if st else None,
                stack=int(stack.group(1)) if stack else None, smem=int(c.metadata.shared),
                smem_limit=TARGETS[j["cc"]], sass=ops, sass_total=sum(ops.values()))


def _worker(jobs_path: str, out_path: str) -> None:
    # a private Triton cache: a cache hit would skip ptxas, and its log is what we read
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="latq_triton_")
    jobs = json.loads(Path(jobs_path).read_text())
    with open(out_path, "a") as out:          # one JSON line per job: progress survives a kill
        for j in jobs:
            try:
                r = compile_job(j)
            except Exception as e:  # noqa: BLE001 — reported, never hidden
                import traceback
                r = {"error": f"{type(e).__name__}: {str(e)[-1500:]}\n{traceback.format_exc()[-1500:]}"}
            out.write(json.dumps([job_key(j), r]) + "\n")
            out.flush()


# ----------------------------------------------------------------------------- driver

def run(jobs: list[dict], workers: int | None = None, cache: bool = True) -> dict:
    """Compile ``jobs`` (cached per kernel) in worker subprocesses → {job_key: result}."""
    CACHE.mkdir(parents=True, exist_ok=True)
    cpaths = {k: CACHE / f"{source_hash(k)}.json" for k in {j["kernel"] for j in jobs}}
    done = {}
    if cache:
        for cp in cpaths.values():
            if cp.exists():
                done.update(json.loads(cp.read_text()))
    todo = [j for j in jobs if job_key(j) not in done]
    if todo:
        workers = workers or max(1, min(len(todo), os.cpu_count() or 1))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        root = str(REPO)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        with tempfile.TemporaryDirectory() as td:
            procs = []
            for w in range(workers):
                part = todo[w::workers]
                jp, op = Path(td) / f"jobs{w}.json", Path(td) / f"out{w}.json"
                jp.write_text(json.dumps(part))
                procs.append((subprocess.Popen([sys.executable, "-m", "tools.triton_compile",
                                                "--worker", str(jp), str(op)], env=env, cwd=root,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), op))
            failed = []
            try:
                for p, op in procs:
                    _, err = p.communicate()
                    if p.returncode != 0:
                        failed.append(err.decode()[-3000:])
            finally:
                for p, op in procs:
                    if p.poll() is None:
                        p.kill()
                new = {}
                for p, op in procs:
                    if op.exists():
                        for line in op.read_text().splitlines():
                            k, r = json.loads(line)
                            new[k] = r
                done.update(new)
                if cache and new:
                    for kern, cp in cpaths.items():
                        mine = {k: r for k, r in new.items() if json.loads(k)["kernel"] == kern}
                        if mine:
                            cur = json.loads(cp.read_text()) if cp.exists() else {}
                            cur.update(mine)
                            cp.write_text(json.dumps(cur))
            if failed:
                raise RuntimeError("compile worker failed: " + failed[0])
    return {job_key(j): done[job_key(j)] for j in jobs}


SASS_GROUPS = {
    "mem": ("LDG", "STG", "LDS", "STS", "LDSM", "LDGSTS", "ATOM", "ATOMG", "RED", "LDL", "STL"),
    "fp32": ("FFMA", "FADD", "FMUL", "FMNMX", "FSEL", "FSETP"),
    "int": ("LOP3", "SHF", "IADD3", "IMAD", "LEA", "ISETP", "SEL", "PRMT", "IMNMX"),
    "cvt": ("F2F", "F2FP", "I2F", "F2I", "I2FP"),
    "mma": ("HMMA", "IMMA", "HGMMA"),
}


def summarize(jobs: list[dict], res: dict) -> list[dict]:
    rows = []
    for j in jobs:
        r = res[job_key(j)]
        row = dict(j)
        if "error" in r:
            row.update(error=r["error"])
        else:
            row.update({k: r[k] for k in ("regs", "spill_stores", "spill_loads", "stack", "smem", "smem_limit",
                                          "sass_total", "stores")})
            for g, names in SASS_GROUPS.items():
                row[g] = sum(v for k, v in r["sass"].items() if k.split(".")[0] in names)
            # K-loop SASS instructions per weight per thread: one trip of the innermost K
            # loop = one K step (mma, the pipelined kernels) or one 16-bit half of a step (gemv:
            # 16·SPH columns, SPH = 16 / plane-A slot bits) of BN rows over 32·warps threads
            from vllm_latq.kernels.triton.layout import step_of
            row["loop"], row["ipw"] = r["loop_len"], None
            row.update(proxies(j, r["loop_loads"], r["loop_ops"], r["regs"], r["smem"]))
            if j["kernel"] in ("dequant", "outliers", "hadamard", "e8_dequant"):   # no K loop of weights × rows
                rows.append(row)
                continue
            if j["kernel"] in ("e8_gemv", "e8_mma"):                        # one trip: a K step of blocks
                cols = 8 * j["BKB"]
            elif j["kernel"] in ("mma", "mma_pipe", "gemv_pipe"):
                cols = 128 if j["bits"] == 3 else step_of(j["bits"])      # 3 bits: quarter-step loop
            else:                                                           # gemv, moe
                cols = 16 * (16 // {3: 2, 5: 4}.get(j["bits"], j["bits"]))
            wpt = cols * j["BN"] / (32 * j["num_warps"])
            row["ipw"] = r["loop_len"] / wpt
        rows.append(row)
    return rows


def report(rows: list[dict]) -> str:
    """Human-readable table: one line per job."""
    hdr = (f"{'kernel':8} {'dt':4} {'b':>1} {'BM':>3} {'BN':>4} {'w':>2} {'BR':>2} {'cap':>3} {'spl':>3} {'outl':4} {'scal':5} {'sm':>3} "
           f"{'regs':>4} {'spill':>5} {'smem':>6} {'sass':>5} {'mem':>4} {'fp32':>4} {'int':>4} {'cvt':>4} {'mma':>4} "
           f"{'loop':>5} {'i/w':>5} {'ldgB':>5} {'ctas':>4} {'inflight':>8}")
    lines = [hdr]
    for r in rows:
        g = {k: "-" if r.get(k) is None else r[k] for k in ("bits", "BM", "BR", "maxnreg", "SPLIT", "outl", "scales")}
        head = (f"{r['kernel']:8} {r.get('dtype', 'bf16'):4} {g['bits']:>1} {g['BM']:>3} {r.get('BN', r.get('BE')):>4} "
                f"{r['num_warps']:>2} {g['BR']:>2} {g['maxnreg']:>3} {g['SPLIT']:>3} {g['outl']:4} {g['scales']:5} "
                f"{r['cc']:>3} ")
        if "error" in r:
            lines.append(head + "ERROR " + r["error"].splitlines()[-1][:120])
            continue
        sp = (r["spill_stores"] or 0) + (r["spill_loads"] or 0)
        lines.append(head + f"{r['regs']:>4} {sp:>5} {r['smem']:>6} {r['sass_total']:>5} {r['mem']:>4} "
                     f"{r['fp32']:>4} {r['int']:>4} {r['cvt']:>4} {r['mma']:>4} {r['loop']:>5} "
                     + ("    -" if r["ipw"] is None else f"{r['ipw']:>5.2f}")
                     + ("     -" if r.get("ldg_width") is None else f" {r['ldg_width']:>5.2f}")
                     + f" {r.get('ctas_sm', '-'):>4} " + f"{r.get('inflight_sm') or '-':>8}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("JOBS", "OUT"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--record", action="store_true",
                    help="write compile_record.json: the jobs of kernels whose device code changed compiled (the "
                         "cache's results reused), the others' rows kept from the record")
    ap.add_argument("--record-all", action="store_true", help="the same, every job compiled")
    a = ap.parse_args(argv)
    if a.worker:
        _worker(*a.worker)
        return
    from tools.triton_record import RECORD_FILE, current_rows, dumps_record
    a.record |= a.record_all
    jobs = all_jobs(quick=a.quick and not a.record)
    kept = {} if a.record_all or not a.record else current_rows(jobs)
    todo = [j for j in jobs if job_key(j) not in kept]
    fresh = dict(zip(map(job_key, todo), summarize(todo, run(todo)))) if todo else {}
    rows = [kept.get(job_key(j)) or fresh[job_key(j)] for j in jobs]
    if a.record:
        try:
            RECORD_FILE.write_text(dumps_record(jobs, rows))
        except ValueError as e:
            print(f"triton_compile: {e}", file=sys.stderr)
            return 2
        print(f"HEADLINE record={RECORD_FILE} jobs={len(jobs)} triton={triton_version()}")
        return
    print(report(rows))


if __name__ == "__main__":
    sys.exit(main())
