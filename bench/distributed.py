"""Quantization with several ranks against one: ``torchrun --nproc-per-node 2 -m vllm_latq.quantize``
vs the single process, side by side in one run.

For each method, three runs of ``latq-quantize`` on the same model and calibration, one after
the other (repeated ``--rounds`` times, the order rotated each round):

* ``1x1``: one rank, one thread (``OMP_NUM_THREADS=1``);
* ``2x1``: two ranks under torchrun (gloo), one thread each;
* ``1x2``: one rank, two threads: the same cores used by threads instead of ranks.

Printed per run: wall seconds, peak RSS of each rank, the seconds each phase of a block took on
rank 0 (Hessians = the calibration forwards and XᵀX; quantization = the solves and their
exchange; outputs = the quantized block's forwards), and whether the checkpoint equals the
``1x1`` one byte for byte (else the share of stored values that agree).

    python -m bench.distributed [--model smollm2-135m] [--methods gptq,ssqr] [--nsamples 32]

The last line is ``HEADLINE cpu=… speedup_2x1_<method>=<1x1 time / 2x1 time> …``; the target is
≥ 1.7 at one thread per rank, and 2x1 faster than 1x2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {"1x1": (1, 1), "2x1": (2, 1), "1x2": (1, 2)}   # name → (ranks, threads per rank)
BLOCK_LINE = re.compile(r"block (\d+)/\d+: Hessians ([\d.]+)s, quantization ([\d.]+)s, outputs ([\d.]+)s")


def worker(rss_dir: str, args: list[str]) -> int:
    """One rank: ``latq-quantize`` with ``args``, then its peak RSS into ``rss_dir``."""
    from vllm_latq.commands.quantize import main
    rc = main(args)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    Path(rss_dir, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"peak_rss_kib": peak_kib}))
    from vllm_latq.quantize.ranks import exit_rank, launched_ranks
    if launched_ranks() > 1:   # a torchrun rank ends as latq-quantize's do
        exit_rank(rc)
    return rc


def run(config: str, model: str, out: Path, args: list[str], rss_dir: Path) -> dict:
    world, threads = CONFIGS[config]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
        if world > 1 else [sys.executable]
    cmd = [*launcher, "-m", "bench.distributed", "--worker", str(rss_dir), "--", model, str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    wall, c1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime)   # every rank's, the launcher's too
    if p.returncode != 0:
        raise RuntimeError(f"{config} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    phases = [0.0, 0.0, 0.0]
    for line in p.stderr.splitlines():
        m = BLOCK_LINE.search(line)
        if m and ("[rank 0]" in line or world == 1):
            phases = [a + float(b) for a, b in zip(phases, m.groups()[1:])]
    rss = [json.loads((rss_dir / f"rank{r}.json").read_text())["peak_rss_kib"] / 2**20 for r in range(world)]
    return {"wall": wall, "cpu": cpu, "phases": phases, "rss_gib": rss}


def compare(a: Path, b: Path) -> str:
    """``identical`` or the share of stored quantized values that agree."""
    import torch
    from safetensors.torch import load_file
    names = sorted(p.name for p in a.glob("*.safetensors"))
    if all((a / n).read_bytes() == (b / n).read_bytes() for n in names):
        return "identical"
    equal = total = 0
    for n in names:
        ta, tb = load_file(a / n), load_file(b / n)
        for k, v in ta.items():
            if v.dtype == torch.bfloat16:
                continue
            total += max(v.numel(), tb[k].numel())
            if v.shape == tb[k].shape:   # outlier lists of other lengths agree nowhere
                equal += int((v == tb[k]).sum())
    return f"{100 * equal / total:.4f}% agree"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="gptq,ssqr")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        sys.exit(worker(a.worker, a.rest))
    from vllm_latq import cpu_features
    head = {"cpu": cpu_features.capability(), "model": a.model, "nsamples": a.nsamples, "seqlen": a.seqlen}
    with tempfile.TemporaryDirectory(prefix="latq-bench-dist-") as tmp:
        for method in a.methods.split(","):
            args = ["--method", method, "--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen), "--no-progress",
                    "--no-validate"]
            results = {c: [] for c in CONFIGS}
            names = list(CONFIGS)
            for k in range(a.rounds):
                for config in names[k % len(names):] + names[:k % len(names)]:
                    out, rss = Path(tmp, f"{method}-{config}-{k}"), Path(tmp, f"rss-{method}-{config}-{k}")
                    rss.mkdir()
                    results[config].append(run(config, a.model, out, args, rss))
                for config in names:   # the round's checkpoints against its one-rank one-thread one
                    r = results[config][-1]
                    r["equal"] = "reference" if config == "1x1" else \
                        compare(Path(tmp, f"{method}-1x1-{k}"), Path(tmp, f"{method}-{config}-{k}"))
                    print(f"{method} {config}: {r['wall']:.1f}s (Hessians {r['phases'][0]:.1f}s, quantization "
                          f"{r['phases'][1]:.1f}s, outputs {r['phases'][2]:.1f}s on rank 0), peak RSS "
                          f"{', '.join(f'{g:.2f}' for g in r['rss_gib'])} GiB, checkpoint vs 1x1: {r['equal']}",
                          flush=True)
            wall = {c: statistics.median(r["wall"] for r in rs) for c, rs in results.items()}
            head[f"speedup_2x1_{method}"] = round(wall["1x1"] / wall["2x1"], 3)
            head[f"speedup_1x2_{method}"] = round(wall["1x1"] / wall["1x2"], 3)
            head[f"wall_1x1_{method}_s"] = round(wall["1x1"], 1)
            head[f"equal_2x1_{method}"] = results["2x1"][-1]["equal"].split("%")[0].replace(" ", "")
    print("HEADLINE " + " ".join(f"{k}={v}" for k, v in head.items()))


if __name__ == "__main__":
    main()
