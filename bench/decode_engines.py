"""The driver side of bench/decode.py: each engine in a worker process of its own (``python -m
bench.decode --serve``), placed on its threads as vLLM would place it, and the interleaved rounds
that time them (:func:`run_mode`).

Threads: llama.cpp runs on the asked cores itself. A vLLM engine gets :func:`omp_env`, the OpenMP
environment vLLM's multiprocess executor gives a CPU worker for ``VLLM_CPU_OMP_THREADS_BIND``:
the bench's engines run in-process, where vLLM binds nothing (its CPU platform says so) and torch
would take every core. Each worker reports the threads it ran; a vLLM engine on another count
than asked is an error, not a row."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import decode_peer

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@decode-bench "   # prefix of the worker's replies on stdout (vLLM logs there too)


def omp_env(cores: list[int]) -> dict:
    """The OpenMP environment vLLM's multiprocess executor sets for a CPU worker bound to
    ``cores`` (vllm/utils/ompmultiprocessing.py, without a preloaded OpenMP): one thread per core,
    pinned to them. Given to an in-process engine's worker process before torch starts, where
    vLLM itself binds nothing."""
    return {"OMP_NUM_THREADS": str(len(cores)), "OMP_PLACES": "{" + ",".join(map(str, cores)) + "}",
            "OMP_PROC_BIND": "true"}


def thread_binds(threads: str | None, bind: str | None) -> dict[int, str]:
    """Thread count → the ``VLLM_CPU_OMP_THREADS_BIND`` list its engines run on: for each count of
    ``threads`` (a comma list) the first that many cores this process may run on; without it one
    count, ``bind`` (the caller's list) or every allowed core."""
    allowed = sorted(os.sched_getaffinity(0))
    if not threads:
        bind = bind or ",".join(map(str, allowed))
        return {len(bind_cores(bind)): bind}
    binds = {}
    for t in map(int, threads.split(",")):
        if not 1 <= t <= len(allowed):
            raise ValueError(f"--threads {t}: this process may run on {len(allowed)} cores ({allowed})")
        binds[t] = ",".join(map(str, allowed[:t]))
    return binds


def bind_cores(bind: str) -> list[int]:
    """The cores of a ``VLLM_CPU_OMP_THREADS_BIND`` list such as ``0-3`` or ``0,2``: one thread each."""
    cores = []
    for p in bind.split(","):
        a, _, b = p.partition("-")
        cores += range(int(a), int(b or a) + 1)
    return cores


class Engine:
    """The driver's handle on one worker process."""

    def __init__(self, job: dict, env: dict, logdir: str):
        self.job, self.lines = job, []
        self.err = open(Path(logdir, f"engine{id(self)}.err"), "w+")
        self.p = subprocess.Popen([sys.executable, "-m", "bench.decode", "--serve", json.dumps(job)], env=env, cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)

    def read(self) -> dict:
        for line in self.p.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self.lines.append(line.rstrip())
        self.err.seek(0)
        last = [ln for ln in self.err.read().splitlines() if ln.strip()][-4:]   # where a crash says why
        return {"error": f"worker exited ({self.p.wait()}): " + " | ".join(last)}

    def call(self, **req) -> dict:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.p.stdin.close()
                self.p.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
        self.err.seek(0)
        self.lines += self.err.read().splitlines()
        self.err.close()


def run_mode(jobs: list[dict], env: dict, repeats: int) -> list[dict]:
    """Load every engine, then interleaved rounds; per engine: runs (median) and, for all but
    the first (bf16), the median over rounds of the paired ratio bf16 time / its time."""
    results = []
    with tempfile.TemporaryDirectory() as td:
        engines = []
        try:
            for j in jobs:                      # one at a time: loading (compiling) is CPU-bound
                e = Engine(j, env if j.get("peer") else {**env, **omp_env(j["cores"])}, td)
                r = e.read()
                if "omp_threads" in r and r["omp_threads"] != j["threads"]:
                    r["error"] = (f"the engine ran {r['omp_threads']} OpenMP threads, not {j['threads']} "
                                  f"(on cores {r.get('cpus')})")
                engines.append(e)
                results.append({**j, **r})
                print(f"[decode bench] {j['label']} {j['mode']} loaded", file=sys.stderr, flush=True)
            live = [(e, r) for e, r in zip(engines, results) if "error" not in r]
            times = {id(r): {b: [] for b in jobs[0]["batches"]} for _, r in live}
            for rnd in range(max(j["repeats"] for j in jobs)):
                order = live[rnd % len(live):] + live[:rnd % len(live)] if live else []
                for b in jobs[0]["batches"]:
                    for e, r in order:
                        if len(times[id(r)][b]) >= r["repeats"] or (r["kernel"] in decode_peer.PEERS and b != 1):
                            continue
                        got = e.call(op="run", batch=b)
                        if "error" in got:
                            r["error"] = got["error"]
                            continue
                        times[id(r)][b].append(got["s"])
                        time.sleep(0.3)         # let the other engine's OpenMP threads go idle
            ref = id(results[0]) if "error" not in results[0] else None
            for e, r in live:
                if "error" in r:
                    continue
                r["runs"] = {}
                for b, ts in times[id(r)].items():
                    if not ts:      # a peer at a batch it does not run
                        continue
                    med = statistics.median(ts)
                    run = {"times": [round(x, 3) for x in ts], "median_s": med,
                           "tok_s": b * r["tokens"] / med, "ms_per_step": 1000 * med / r["tokens"]}
                    if ref is not None and r["tokens"] == results[0]["tokens"]:
                        pairs = list(zip(times[ref][b], ts))
                        rs = [t0 / t1 for t0, t1 in pairs]
                        run["paired_ratio"], run["paired_range"] = statistics.median(rs), (min(rs), max(rs))
                    r["runs"][str(b)] = run
                if r.get("profile"):
                    r["profile"] = e.call(op="profile")
        finally:
            for e, r in zip(engines, results):
                e.close()
                r["load_line"] = next((ln.split("] ", 1)[-1] for ln in e.lines if "linears loaded" in ln), None)
    return results
