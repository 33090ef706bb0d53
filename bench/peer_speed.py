"""latq's GPTQ against llm-compressor's, side by side: the whole command's time on the same model,
calibration sequences and settings, and the perplexity of both results.

Each round runs both commands once, one after the other (the order alternated), with the same
thread count: ``latq-quantize MODEL OUT --method gptq`` and llm-compressor's ``oneshot`` GPTQ
(``bench/peer_llmcompressor.py`` in its own environment, built on first use). The time is the
command's wall time, start-up, model load and writing included, as a user waits for it. latq's
block phases are read from its log (Hessians = calibration forwards and XᵀX; quantization = the
solves; outputs = the quantized block's forwards). After the rounds both results are evaluated
by ``latq-eval`` (the study's protocol), so the speed is read at the perplexity it comes with.

    python -m bench.peer_speed                       # SmolLM2-135M, 4 bits, group 64 (128 does not divide 576)
    python -m bench.peer_speed --model gemma3-270m --bits 3 --rounds 3 --threads 1

Last line: ``HEADLINE cpu=… speedup=<median over rounds of llmc time / latq time> latq_s=…
llmc_s=… latq_ppl=… llmc_ppl=…``. Our target: speedup ≥ 2 at a perplexity no higher than
llm-compressor's (beyond the study's noise floor).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import peer_llmcompressor
from bench.distributed import BLOCK_LINE

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], threads: int) -> tuple[float, str]:
    """Run ``cmd`` with ``threads`` torch/OpenMP threads → (wall seconds, its stderr)."""
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    return wall, p.stderr


def phases(log: str) -> list[float]:
    """Seconds of latq's block phases summed over its blocks: [Hessians, quantization, outputs]."""
    sums = [0.0, 0.0, 0.0]
    for m in BLOCK_LINE.finditer(log):
        for k in range(3):
            sums[k] += float(m.group(k + 2))
    return sums


def perplexity(ckpt: Path, threads: int) -> float:
    out = ckpt.with_name(ckpt.name + ".ppl.json")
    timed([sys.executable, "-m", "vllm_latq.commands.evaluate", str(ckpt), "--output", str(out), "--no-progress"], threads)
    return json.loads(out.read_text())["ppl"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-eval", action="store_true", help="time only")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer
    from vllm_latq import cpu_features, data
    from vllm_latq.quantize.source import resolve_model

    src = Path(resolve_model(a.model))
    peer_py = peer_llmcompressor.ensure_env(data.cache_dir())
    with tempfile.TemporaryDirectory(prefix="latq-peer-speed-") as tmp:
        tmp = Path(tmp)
        calib = tmp / "calib.pt"
        torch.save(data.calibration_batches(AutoTokenizer.from_pretrained(src), nsamples=a.nsamples,
                                            seqlen=a.seqlen), calib)
        commands = {
            "latq": [sys.executable, "-m", "vllm_latq.quantize", str(src), str(tmp / "latq"), "--method", "gptq",
                     "--bits", str(a.bits), "--group-size", str(a.group_size), "--nsamples", str(a.nsamples),
                     "--seqlen", str(a.seqlen), "--overwrite", "--no-progress"],
            "llmc": [str(peer_py), "-P", str(Path(peer_llmcompressor.__file__).resolve()), str(src), str(calib),
                     str(tmp / "llmc"), "--bits", str(a.bits), "--group-size", str(a.group_size)],
        }
        times = {"latq": [], "llmc": []}
        print(f"cpu={cpu_features.capability()} model={a.model} {a.bits}-bit g{a.group_size} "
              f"{a.nsamples}×{a.seqlen} tokens, {a.threads} thread(s)", flush=True)
        for r in range(a.rounds):
            for name in (("latq", "llmc") if r % 2 == 0 else ("llmc", "latq")):
                wall, log = timed(commands[name], a.threads)
                times[name].append(wall)
                split = phases(log) if name == "latq" else None
                print(f"round {r} {name}: {wall:.1f} s" + (
                    "" if split is None else " (blocks: Hessians {:.1f} s, quantization {:.1f} s, outputs {:.1f} s)"
                    .format(*split)), flush=True)
        ratios = [p / q for p, q in zip(times["llmc"], times["latq"])]
        head = {"cpu": cpu_features.capability(), "model": a.model, "bits": a.bits, "group_size": a.group_size,
                "threads": a.threads, "speedup": round(statistics.median(ratios), 2),
                "latq_s": round(statistics.median(times["latq"]), 1),
                "llmc_s": round(statistics.median(times["llmc"]), 1)}
        if not a.no_eval:
            for name in ("latq", "llmc"):
                head[f"{name}_ppl"] = round(perplexity(tmp / name, a.threads), 3)
    print("HEADLINE " + " ".join(f"{k}={v}" for k, v in head.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
