"""The GPU timing harness of :mod:`bench.kernels`: one layer configuration measured on a
device — latq's ``TritonKernel.apply`` (the kernel it picks, and each forced), dense
``F.linear`` and a copy of latq's served bytes — and the sweep over a run's configurations.

Each time is the median of a timer (``triton.testing.do_bench_cudagraph``: calls captured in a
CUDA graph, no Python in the timed loop) over calls that cycle through enough copies of their
operands to span several L2 sizes, as a decode step reads every layer's weights from HBM.
Autotuning runs in a warm-up before any capture, its outputs checked against the fp32
reference. The harness takes the timer and the device as arguments, so the tests run it in
Triton's interpreter with a fake timer.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import torch

KERNELS = ("gemv", "mma", "dequant")
# --breakdown entries beyond a forced kernel: the picked kernel's table config pipelined, and the
# tensor-core kernel's pipelined (below 8 rows, the launch table's other route)
VARIANTS = ("pipelined", "mma_pipelined")
GROUP = 128
SCALES = f"fp16-g{GROUP}"       # the group-scale form timed by default (--scales)
ROTATE_L2 = 4          # timed operands span ≥ this many L2 sizes (copies cycled per call)
MAX_COPIES = 64
ERR_TOL = 3e-2         # max |y − ref| / max |ref| above this: wrong (bf16 rounding ≤ 2^-7 with the dequant path)


# ----------------------------------------------------------------------------- served bytes

def weight_bytes(st) -> int:
    """Bytes of a prepared Triton state's weight tensors (what every call streams): inlier
    planes, scales, outlier arrays with their ELL padding — all tensors of the state except
    the split-K tickets (a counter per 16 rows, scratch, not weights)."""
    from vllm_latq.kernels.triton.kernel import TritonKernel
    tensors, _ = TritonKernel.flatten(st)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None and t is not st.tickets)


def act_bytes(m: int, n: int, k: int, elem: int) -> int:
    """Activations in (M×K) + output (M×N) at ``elem`` bytes per value."""
    return m * (k + n) * elem


def copies(footprint: int, l2_bytes: int) -> int:
    """How many copies of a ``footprint``-byte operand set a timed function cycles through so
    that together they span ROTATE_L2 L2 sizes (1 when one already does)."""
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_L2 * l2_bytes / max(1, footprint))))


# ----------------------------------------------------------------------------- measurements

@dataclasses.dataclass
class Point:
    """One measured (layer, bits, rate, M); times in µs (nan: failed or not run)."""
    shape: str
    n: int
    k: int
    bits: int
    rate: float
    m: int
    kernel: str                 # the kernel TritonKernel.apply picks
    latq_us: float
    dense_us: float
    copy_us: float
    weight_bytes: int
    act_bytes: int
    kernels_us: dict            # kernel → µs, the picked one and the --breakdown ones
    err: float                  # worst max|y − ref| / max|ref| over the kernels run
    scales: str = SCALES        # the group-scale form (--scales)
    launches: dict = dataclasses.field(default_factory=dict)    # entry → (kernel, BM, config, error) it ran
    peers_us: dict = dataclasses.field(default_factory=dict)    # peer → µs (bench.kernel_peers; nan: failed)
    peer_bits: dict = dataclasses.field(default_factory=dict)   # peer → its served bits/weight

    @property
    def ratio(self) -> float:
        return self.dense_us / self.latq_us

    @property
    def served_bytes(self) -> int:
        return self.weight_bytes + self.act_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.weight_bytes / (self.n * self.k)

    @property
    def gbps(self) -> float:
        return self.served_bytes / self.latq_us / 1e3

    @property
    def pct_copy(self) -> float:
        return 100 * self.copy_us / self.latq_us

    @property
    def bad(self) -> bool:
        return not (self.err <= ERR_TOL)            # nan / inf count as wrong


def picked_kernel(st, x2: torch.Tensor) -> str:
    """The kernel ``TritonKernel.apply(st, x2)`` runs (its routing, the launch table's included)."""
    from vllm_latq.kernels.triton.kernel import pick_kernel
    return pick_kernel(st, x2)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y − ref| / max |ref| (inf when y has a nan or inf)."""
    e = float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    return e if math.isfinite(e) else math.inf


def _clone_state(st):
    from vllm_latq.kernels.triton.kernel import TritonKernel
    tensors, ints = TritonKernel.flatten(st)
    return TritonKernel.unflatten([t.clone() if t is not None else None for t in tensors], ints)


def time_cycled(timer, calls) -> float:
    """µs per call of ``calls`` (one per operand copy), timed as one function."""
    return timer(lambda: [c() for c in calls]) / len(calls)


def variant(st, x: torch.Tensor, name: str) -> tuple[str, dict | None] | None:
    """(kernel, config) a breakdown entry runs at x's rows: a kernel forced at its table config
    (``KERNELS``), the picked kernel's table config pipelined ("pipelined") or the tensor-core
    kernel's ("mma_pipelined"); None where that has no pipelined kernel."""
    if name in KERNELS:
        return name, None
    from vllm_latq.kernels.triton import configs as cfg
    from vllm_latq.kernels.triton.kernel import launch_config, pick_kernel
    kernel = "mma" if name == "mma_pipelined" else pick_kernel(st, x)
    if kernel not in ("gemv", "mma") or (kernel == "mma" and x.dtype == torch.float32):
        return None
    c = cfg.pipelined(launch_config(st, x.shape[0], kernel, x.device), kernel, st.bits)
    return None if c is None else (kernel, c)


def _run(st, x, name):
    """One call of breakdown entry ``name`` (None: the picked kernel through apply's routing)."""
    from vllm_latq.kernels.triton.kernel import TritonKernel
    kernel, config = (None, None) if name is None else variant(st, x, name)
    return TritonKernel.apply(st, x, kernel=kernel, config=config)


def _warm_up(states, w, ms, kernels, dtype, dev, log) -> dict:
    """Every M with the picked kernel (apply's routing), then every M with each breakdown
    entry, once — so the autotuners see the M the selector sends them first, and never run
    inside a capture — each output checked against the fp32 reference → {(m, entry or
    None): rel error} (inf: the call failed; nan: the entry has no kernel there)."""
    from vllm_latq.kernels.weight import dequantize
    from vllm_latq.kernels.triton.kernel import TritonKernel
    w_ref = dequantize(w)
    xs = {m: torch.randn(m, w.in_features, device=dev).to(dtype) for m in ms}
    refs = {m: xs[m].float() @ w_ref.T for m in ms}
    del w_ref
    errs = {}
    for kernel in (None, *kernels):
        for m in ms:
            if kernel is not None and variant(states[0], xs[m], kernel) is None:
                errs[m, kernel] = math.nan
                continue
            try:
                errs[m, kernel] = rel_err(_run(states[0], xs[m], kernel), refs[m])
            except Exception as e:  # noqa: BLE001 — reported and counted, the run goes on
                log(f"  FAILED M={m} {kernel or 'picked'}: {type(e).__name__}: {str(e).strip()[:200]}")
                errs[m, kernel] = math.inf
    return errs


def _time_or_nan(timer, calls, what: str, log) -> float:
    try:
        return time_cycled(timer, calls)
    except Exception as e:  # noqa: BLE001 — a failed capture costs one number, not the run
        log(f"  FAILED timing {what}: {type(e).__name__}: {str(e).strip()[:200]}")
        return math.nan


def scale_form(form: str) -> tuple[int, int | None]:
    """``fp16-g128`` → (128, None), ``s4-g64`` → (64, 4): the group and the scale code bits."""
    kind, g = form.split("-g")
    return int(g), (4 if kind == "s4" else None)


def bench_weight(n: int, k: int, bits: int, rate: float, scales: str = SCALES):
    """The layer timed (on the CPU): ``random_weight`` in the group-scale form
    ``scales``, with fp16-exact outlier values, as SSQR checkpoints store them, so the layout
    keeps compact 4-byte entries (int16 column + fp16 value) as in production rather than fp32
    values."""
    from vllm_latq.testing.weights import random_weight
    group, scale_bits = scale_form(scales)
    w = random_weight(n, k, bits, rate, group=group, seed=0, scale_bits=scale_bits)
    return dataclasses.replace(w, val=w.val.half().float())


def bench_layer(spec, bits, rate, ms, kernels, dtype, dev, l2_bytes, timer, dense_cache, log,
                scales: str = SCALES, peers=None) -> list[Point]:
    """All points of one (shape, bits, rate) in the group-scale form ``scales``: weights, warm-up
    + check, then per M the picked kernel, the forced ones, the dense baseline (cached per shape
    × M), the copy and the peers (``peers``: a ``kernel_peers.PeerBench``, which measures a shape
    once)."""
    from vllm_latq.kernels.triton.kernel import TritonKernel
    name, n, k = spec
    t0 = time.perf_counter()
    w = bench_weight(n, k, bits, rate, scales).to(dev)
    ok, why = TritonKernel.can_implement(w, dev, dtype)
    if not ok:
        log(f"SKIPPED {name} {bits}-bit {rate * 100:g}% {scales}: {why}")
        return []
    st = TritonKernel.prepare(w)
    TritonKernel.reserve(st, dtype)
    wb = weight_bytes(st)
    states = [st] + [_clone_state(st) for _ in range(copies(wb, l2_bytes) - 1)]
    t1 = time.perf_counter()
    errs = _warm_up(states, w, ms, kernels, dtype, dev, log)
    del w
    t2 = time.perf_counter()
    elem = torch.empty(0, dtype=dtype).element_size()
    points = []
    for m in ms:
        x = torch.randn(m, k, device=dev).to(dtype)
        pick = picked_kernel(st, x)
        us = {}
        for kern in dict.fromkeys((pick, *kernels)):
            kk = None if kern == pick else kern             # the picked one through apply's routing
            calls = [lambda s=s, kk=kk: _run(s, x, kk) for s in states]
            us[kern] = _time_or_nan(timer, calls, f"{name} M={m} {kern}", log) \
                if math.isfinite(errs[m, kk]) else math.nan
        if (n, k, m) not in dense_cache:
            dense_cache[n, k, m] = _time_dense(n, k, x, l2_bytes, timer)
        ab = act_bytes(m, n, k, elem)
        points.append(Point(name, n, k, bits, rate, m, pick, us[pick], dense_cache[n, k, m],
                            _time_copy(wb + ab, dev, l2_bytes, timer), wb, ab, us,
                            max([errs[m, None]] + [e for kk in kernels if math.isfinite(e := errs[m, kk])
                                                   or e == math.inf]), scales,
                            launches=_launches(st, x, pick, kernels, {e: errs[m, None if e == pick else e]
                                                                      for e in (pick, *kernels)})))
        if peers is not None and peers.present:
            points[-1].peers_us = peers.times(n, k, m)
            points[-1].peer_bits = {p: peers.bits.get((n, k, p), math.nan) for p in peers.present}
        log(format_point(points[-1]))
        if points[-1].peers_us:
            log(format_peers(points[-1]))
    log(f"  ({name} {bits}-bit {rate * 100:g}% {scales}: weights + prepare {t1 - t0:.1f} s, warm-up/autotune/check "
        f"{t2 - t1:.1f} s, timing {time.perf_counter() - t2:.1f} s; {len(states)} weight copies cycled)")
    return points


def _launches(st, x, pick, kernels, errs) -> dict:
    """{entry: (kernel, row tile, config, error)} of the picked kernel and each breakdown entry that
    runs a GEMV or tensor-core launch (what ``tools/launch_table`` takes as a timing)."""
    from vllm_latq.kernels.triton.kernel import launch_config
    out = {}
    for name in dict.fromkeys((pick, *kernels)):
        got = variant(st, x, name)
        if got is not None and got[0] in ("gemv", "mma"):
            c = got[1] or launch_config(st, x.shape[0], got[0], x.device)
            out[name] = (got[0], c["BM"], c, errs[name])
    return out


def family(dev) -> str:
    """The launch table's family of ``dev`` (``sm_90``), or its type off a GPU (``cpu``)."""
    if dev.type != "cuda":
        return dev.type
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm_{major}{minor}"


def timing_rows(points, family: str) -> list[dict]:
    """The points' launches as ``tools/launch_table`` timing records (``--add-timings``; a launch
    whose output was off as ``WRONG``)."""
    from tools.launch_table import TUNED, WRONG
    rows = []
    for p in points:
        for name, (kernel, bm, c, err) in p.launches.items():
            us = p.kernels_us.get(name, math.nan) if err <= ERR_TOL else WRONG
            if math.isfinite(us):
                rows.append(dict(family=family, kernel=kernel, bits=p.bits, bm=bm, n=p.n, k=p.k, m=p.m, rate=p.rate,
                                 config={t: c[t] for t in TUNED if t in c}, us=round(us, 2)))
    return rows


def _time_dense(n, k, x, l2_bytes, timer) -> float:
    """``F.linear`` with a dense weight of x's dtype (copies cycled past L2)."""
    ws = [torch.randn(n, k, device=x.device).to(x.dtype) for _ in range(copies(2 * n * k, l2_bytes))]
    t = time_cycled(timer, [lambda W=W: torch.nn.functional.linear(x, W) for W in ws])
    del ws
    return t


def _time_copy(nbytes: int, dev, l2_bytes, timer) -> float:
    """A device-to-device copy moving ``nbytes`` in all: nbytes/2 read, nbytes/2 written."""
    half = max(256, math.ceil(nbytes / 2 / 256) * 256)
    r = copies(2 * half, l2_bytes)
    src = torch.zeros(r, half, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return time_cycled(timer, [lambda i=i: dst[i].copy_(src[i]) for i in range(r)])


# ----------------------------------------------------------------------------- GPU driver

def cuda_timer(rep_ms: float):
    """µs per call of fn: the median of ``triton.testing.do_bench_cudagraph`` (fn captured
    in a CUDA graph, replayed). Older Tritons take ``quantiles`` instead of ``return_mode``."""
    import inspect

    from triton.testing import do_bench_cudagraph
    params = inspect.signature(do_bench_cudagraph).parameters
    kw = {"return_mode": "median"} if "return_mode" in params else {"quantiles": [0.5]}

    def timer(fn) -> float:
        ms = do_bench_cudagraph(fn, rep=rep_ms, **kw)
        return (ms[0] if isinstance(ms, (list, tuple)) else ms) * 1e3
    return timer


def gpu_bench(a, log=print) -> dict:
    """The GPU part on cuda:0 (see :func:`sweep`)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # as the offline report compiles
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 0) or (50 << 20)
    log(f"GPU {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB)")
    return sweep(a, dev, props.name, l2, cuda_timer(a.rep_ms), log)


def sweep(a, dev, device_name: str, l2: int, timer, log, big: int = 1 << 30) -> dict:
    """The copy bandwidth (``big`` bytes read + written), then every shape × bits × rate of
    ``a`` (no new one after ``a.budget_s`` seconds) → {device, l2, copy_gbps, points,
    skipped: the configurations not measured (budget spent, unsupported, or failed), seconds}."""
    t0 = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    copy_gbps = 2 * big / _time_copy(2 * big, dev, l2, timer) / 1e3
    log(f"device-to-device copy of {big >> 20} MiB: {copy_gbps:.0f} GB/s (read + write)")
    log(f"latq = TritonKernel.apply (picked kernel), {a.dtype} = F.linear; µs per call, medians of CUDA-graph "
        f"replays; ratio = {a.dtype} / latq; GB/s and % of copy over latq's served bytes")
    peers = None
    if getattr(a, "peers", None):
        from bench.kernel_peers import PeerBench
        peers = PeerBench(a.peers, dtype, dev, l2, timer, log, a.m)
        log(f"peers (4-bit g{GROUP}, no outliers): {', '.join(peers.present) or 'none present'}"
            + (f"; {peers.absent_line()}" if peers.absent or peers.notes else ""))
    log(table_header(a.dtype))
    points, skipped, dense_cache = [], [], {}
    # bit width and rate outermost: the first ones on every shape before the next (a budget or a
    # time limit cuts the later widths); a layer's forms side by side
    configs = [(spec, bits, rate, form) for bits in a.bits for rate in a.rates for spec in a.shapes for form in a.scales]
    for spec, bits, rate, form in configs:
        what = f"{spec[0]} {bits}-bit {rate * 100:g}% {form}"
        if time.perf_counter() - t0 > a.budget_s:
            skipped.append((spec[0], bits, rate, form))
            log(f"SKIPPED {what}: --budget-s {a.budget_s:g} spent")
            continue
        try:
            got = bench_layer(spec, bits, rate, a.m, a.breakdown, dtype, dev, l2, timer, dense_cache,
                              log, form, peers)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 — one configuration lost, not the run and its HEADLINE
            log(f"FAILED {what}: {type(e).__name__}: {str(e).strip()[:300]}")
            got = []
        points += got
        if not got:
            skipped.append((spec[0], bits, rate, form))
        if getattr(a, "json", None):       # after each configuration: a cut run keeps what it measured
            from bench.gpu_figures import write_points
            write_points(a.json, device_name, points)
        if getattr(a, "timings_json", None):
            from tools.launch_table import dumps_timings
            Path(a.timings_json).write_text(dumps_timings(timing_rows(points, family(dev))))
    return dict(device=device_name, l2=l2, copy_gbps=copy_gbps, points=points, skipped=skipped,
                seconds=time.perf_counter() - t0, peers_absent=dict(peers.absent) if peers else {})


# ----------------------------------------------------------------------------- table

def number_cell(v: float, fmt: str, width: int) -> str:
    return f"{v:{width}{fmt}}" if math.isfinite(v) else f"{'-':>{width}}"


def table_header(dense: str = "bf16") -> str:
    return (f"{'shape':16} {'N×K':>11} {'bits':>4} {'rate':>5} {'scales':>9} {'M':>4} {'kernel':>7} {'latq_us':>8} "
            f"{dense + '_us':>8} {'ratio':>6} {'gemv_us':>8} {'mma_us':>8} {'deq_us':>8} {'bits/w':>6} "
            f"{'GB/s':>6} {'%copy':>6} {'err':>8}")


def format_point(p: Point) -> str:
    ks = " ".join(number_cell(p.kernels_us.get(k, math.nan), ".1f", 8) for k in KERNELS)
    return (f"{p.shape:16} {f'{p.n}x{p.k}':>11} {p.bits:>4} {p.rate * 100:>4.1f}% {p.scales:>9} {p.m:>4} {p.kernel:>7} "
            f"{number_cell(p.latq_us, '.1f', 8)} {number_cell(p.dense_us, '.1f', 8)} {number_cell(p.ratio, '.2f', 5)}x {ks} "
            f"{p.bits_per_weight:>6.2f} {number_cell(p.gbps, '.0f', 6)} {number_cell(p.pct_copy, '.1f', 5)}% {p.err:>8.1e}"
            + ("  WRONG" if p.bad else ""))


def format_peers(p: Point) -> str:
    """The peers' line under a point: each peer's µs, served bits/weight and speed against latq."""
    cells = [f"{name} {number_cell(us, '.1f', 0)} us ({p.peer_bits.get(name, math.nan):.2f} b/w, latq "
             f"{number_cell(us / p.latq_us, '.2f', 0)}x)" for name, us in p.peers_us.items()]
    return f"  peers M={p.m}: " + "; ".join(cells)
