"""What a user waits for: ``latq-quantize`` of a whole model with E8-3b against GPTQ-4b (the default),
side by side in one run.

Each configuration is one ``latq-quantize`` process on one thread (``OMP_NUM_THREADS=1``), the same
model and calibration; ``--rounds`` rounds, the order rotated each round, medians reported. Per run:
wall seconds, CPU seconds (the child's user + system time: the figure a shared machine disturbs least),
the seconds each phase of a block took (Hessians = calibration forwards and XᵀX; quantization = the
solves; outputs = the quantized block's forwards), peak RSS, and the mean relative layer error
‖X(Q−W)ᵀ‖²/‖XWᵀ‖² from the checkpoint's stats.

    python -m bench.quantize_cost                          # SmolLM2-135M, the default calibration
    python -m bench.quantize_cost --nsamples 16 --seqlen 256 --rounds 2

The last line is ``HEADLINE cpu=… e8_3b_vs_gptq_cpu=<E8 CPU time / GPTQ's> e8_3b_vs_gptq_wall=… …``;
the target (issue: E8 at GPTQ's pace) is ≤ 2 in CPU time.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.distributed import run

# name → latq-quantize options: the default checkpoint, and the study's E8 point (rotated by the method)
CONFIGS = {
    "gptq_4b": [],
    "e8_3b": ["--method", "e8", "--bits", "3", "--group-size", "16", "--scale-bits", "4"],
}
BASE = "gptq_4b"


def rel_error(ckpt: Path) -> float:
    from vllm_latq.format.checkpoint import Checkpoint
    return float(Checkpoint(ckpt).stats()["totals"]["rel_error_mean"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a reference name or a Hugging Face directory")
    ap.add_argument("--nsamples", type=int, default=128, help="calibration sequences (latq-quantize's default)")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args(argv)
    from vllm_latq import cpu_features
    head = {"cpu": cpu_features.capability(), "model": Path(a.model).name, "nsamples": a.nsamples, "seqlen": a.seqlen}
    common = ["--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen), "--no-progress", "--no-validate"]
    results = {c: [] for c in CONFIGS}
    names = list(CONFIGS)
    with tempfile.TemporaryDirectory(prefix="latq-bench-qcost-") as tmp:
        for k in range(a.rounds):
            for name in names[k % len(names):] + names[:k % len(names)]:
                out, rss = Path(tmp, f"{name}-{k}"), Path(tmp, f"rss-{name}-{k}")
                rss.mkdir()
                r = run("1x1", a.model, out, [*CONFIGS[name], *common], rss)
                r["rel"] = rel_error(out)
                results[name].append(r)
                print(f"{name}: {r['wall']:.1f}s wall, {r['cpu']:.1f}s CPU (Hessians {r['phases'][0]:.1f}s, "
                      f"quantization {r['phases'][1]:.1f}s, outputs {r['phases'][2]:.1f}s), peak RSS "
                      f"{r['rss_gib'][0]:.2f} GiB, mean relative layer error {r['rel']:.6f}", flush=True)
    med = {n: {key: statistics.median(r[key] for r in rs) for key in ("wall", "cpu")} for n, rs in results.items()}
    for name in names:
        if name != BASE:
            head[f"{name}_vs_gptq_cpu"] = round(med[name]["cpu"] / med[BASE]["cpu"], 3)
            head[f"{name}_vs_gptq_wall"] = round(med[name]["wall"] / med[BASE]["wall"], 3)
    for name in names:
        head[f"{name}_cpu_s"] = round(med[name]["cpu"], 1)
        head[f"{name}_rel_error"] = round(results[name][-1]["rel"], 6)
    print("HEADLINE " + " ".join(f"{k}={v}" for k, v in head.items()))


if __name__ == "__main__":
    main()
