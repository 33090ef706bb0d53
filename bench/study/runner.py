"""Running the study's configurations: the settings a result depends on, the JSON result cache,
quantizing and evaluating one configuration, and running many (side by side in worker processes)."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import peer_llmcompressor
from vllm_latq import data

from bench.study import peers, served
from . import head
from .configs import Config, slug

log = logging.getLogger("latq.study")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ("-m", "bench.accuracy")   # the study's command, from the repo root; a worker runs it with --worker
RESULT_VERSION = 1  # bump when a result's meaning changes: cached results are then recomputed
# bump when the calibrated pipeline's numerics change: only results that ran it are recomputed
# (2: calibration forwards in the model's dtype, bf16, instead of fp32)
PIPELINE_RESULTS = 2
JOBS_ENV = "LATQ_STUDY_JOBS"  # set in the workers of a parallel study


@dataclass
class Settings:
    nsamples: int = 128
    seqlen: int = 512
    eval_seqlen: int = 512
    nwindows: int = 64
    group_size: int = 128
    ordering_blocks: tuple = ()  # empty: quarter, half, three quarters of the depth
    ordering_nsamples: int = 32
    ordering_seeds: int = 3
    peer_bits: tuple = (3, 4)
    max_blocks: int = 0  # >0: the model truncated to its first decoder blocks (CI only)
    tiny: bool = False
    extra: dict = field(default_factory=dict)

    def key(self, cfg: Config | None = None) -> dict:
        """What a cached accuracy result of ``cfg`` must match to be reused. bf16 and the
        calibration-free RTN/HRTN never run the calibration forwards: their results stay valid
        across ``PIPELINE_RESULTS``."""
        k = {"v": RESULT_VERSION, "nsamples": self.nsamples, "seqlen": self.seqlen,
             "eval_seqlen": self.eval_seqlen, "nwindows": self.nwindows, "max_blocks": self.max_blocks}
        from vllm_latq.quantize.pipeline import UNCALIBRATED
        method = cfg.kwargs.get("method") if cfg is not None else None  # None: bf16
        if method is not None and method not in UNCALIBRATED:
            k["pipeline"] = PIPELINE_RESULTS
        if cfg is not None and cfg.tag in ("llmc", "llmc-scales"):
            k["peer"] = list(peer_llmcompressor.PEER_PACKAGES)
        return k

    def ordering_key(self, blocks) -> dict:
        return {"v": RESULT_VERSION, "max_blocks": self.max_blocks, "blocks": list(blocks),
                "nsamples": self.ordering_nsamples,
                "seqlen": self.seqlen, "seeds": self.ordering_seeds, "peer_bits": list(self.peer_bits),
                "llmc": list(peer_llmcompressor.PEER_PACKAGES)}


# ============================================================================ the cache

def write_json(path: Path, obj) -> None:
    """Write ``obj`` to ``path`` atomically (a killed study never leaves half a result)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def read_cached(path: Path, key: dict, what: str | None = None) -> dict | None:
    """The record at ``path`` if it was computed with the settings ``key``, else None; a found
    record of ``what`` (a study result) is logged as cached."""
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if r.get("settings") != key:
        return None
    if what is not None:
        log.info("cached: %s (%s)", what, path)
    return r


def import_results(path: Path, root: Path) -> int:
    """Write the records of a report's JSON into the cache under ``root`` where it has none →
    how many were written. Each keeps its settings key, so only matching ones are ever used."""
    try:
        doc = json.loads(Path(path).read_text())
        records = [(m, slug(r["label"]), r) for m, rs in doc["results"].items() for r in rs]
        records += [(m, "ordering", o) for m, o in doc.get("ordering", {}).items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SystemExit(f"--import-results {path}: not a study report's JSON ({type(e).__name__}: {e})")
    n = 0
    for model, name, rec in records:
        dest = root / "results" / model / f"{name}.json"
        if not dest.exists():
            write_json(dest, rec)
            n += 1
    log.info("imported %d of %d records from %s into %s", n, len(records), path, root / "results")
    return n


def source_dir(model: str, st: Settings, root: Path) -> Path:
    """The bf16 HF directory of ``model``; with ``st.max_blocks`` a copy truncated to its first
    decoder blocks (real weights, fewer layers: the CI run quantizes 2 blocks, not 30)."""
    src = data.model_dir(model)
    if not st.max_blocks:
        return src
    from safetensors import safe_open
    from safetensors.torch import save_file
    out = root / "models" / f"{src.name}-{st.max_blocks}blocks"   # src is named by its GGUF's sha256
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    n = st.max_blocks
    cfg["num_hidden_layers"] = n
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:n]
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                parts = k.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= n:
                    continue
                tensors[k] = h.get_tensor(k)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                  "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


# ============================================================================ one configuration

def _cert_record(name: str, W, H, res) -> dict:
    """Measured error / bound of one layer, over the rows the bound covers (E8: rows without an
    overloaded block, whose bound is inf; None where no row is covered)."""
    err = res.error(W, H)
    bound = res.bound.double().to(err.device)
    covered = torch.isfinite(bound)
    if not covered.any():
        return {"name": name, "layer_ratio": None, "row_max": None, "row_median": None}
    err, bound = err[covered], bound[covered]
    ratio = err / bound.clamp_min(1e-300)
    return {"name": name, "layer_ratio": float(err.sum() / bound.sum()), "row_max": float(ratio.max()),
            "row_median": float(ratio.median())}


def overload_record(stats: dict) -> dict | None:
    """A codebook checkpoint's overloads from its latq_stats.json: overloaded blocks of all blocks, and
    the layers with a row the certificate covers (None: not a codebook checkpoint)."""
    layers = [s for s in stats["layers"] if "overloads" in s]
    if not layers:
        return None
    return {"blocks": sum(s["overloads"] for s in layers),
            "of": sum(s["shape"][0] * s["shape"][1] // 8 for s in layers),
            "certified_layers": sum(s["cert"] is not None for s in layers), "layers": len(layers)}


def quantize_config(cfg: Config, st: Settings, src: Path, ck: Path, progress: bool = True) -> tuple[list[dict], float]:
    """Quantize one configuration into ``ck`` → (certificate records, seconds). An interrupted
    run continues from its last finished block; the records of the blocks done before the
    interruption come from the journal ``<slug>.certs.jsonl`` written as layers finish."""
    from vllm_latq.quantize.pipeline import TMP_SUFFIX, QuantizeOptions, quantize_model

    # the head stays in the model dtype unless a configuration quantizes it (latq-quantize's default may not)
    opts = QuantizeOptions(nsamples=st.nsamples, seqlen=st.seqlen, **{"quantize_lm_head": False, **cfg.kwargs})
    solve = peers.solve_for(cfg, src)
    journal = ck.with_name(cfg.slug + ".certs.jsonl")
    if not ck.with_name(ck.name + TMP_SUFFIX).exists():
        journal.unlink(missing_ok=True)
    journal.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def on_layer(name, W, H, res):
        if res.bound is not None:
            with journal.open("a") as f:
                f.write(json.dumps(_cert_record(name, W, H, res)) + "\n")
    try:
        quantize_model(src, ck, opts, overwrite=True, resume=True, on_layer=on_layer, progress=progress, solve=solve)
    except ValueError as e:
        if "--resume" not in str(e):
            raise
        log.warning("%s: cannot resume (%s): starting over", cfg.label, e)
        journal.unlink(missing_ok=True)
        quantize_model(src, ck, opts, overwrite=True, on_layer=on_layer, progress=progress, solve=solve)
    recs = {}
    if journal.is_file():
        for line in journal.read_text().splitlines():
            if line.strip():
                c = json.loads(line)
                recs[c["name"]] = c  # a block redone after an interruption: its last record
        journal.unlink()
    return list(recs.values()), round(time.time() - t0, 1)


def run_config(cfg: Config, st: Settings, root: Path, keep: bool, compute: bool = True,
               progress: bool = True) -> dict | None:
    """Quantize + evaluate one configuration, or return its cached result (``compute=False``:
    the cached result or None)."""
    from vllm_latq.commands.evaluate import evaluate

    path = root / "results" / cfg.model / f"{cfg.slug}.json"
    key = st.key(cfg)
    r = read_cached(path, key, f"{cfg.model} {cfg.label}")
    if r is not None:   # what it is compared with is the study's choice, not part of the measurement: today's
        return r if r.get("base", "") == cfg.base else {**r, "base": cfg.base}
    if not compute:
        return None
    log.info("running: %s %s", cfg.model, cfg.label)
    t0 = time.time()
    certs: list[dict] = []
    tq = 0.0
    src = source_dir(cfg.model, st, root)
    done = None  # quantized, not yet evaluated: an interrupted evaluation reuses the checkpoint
    if cfg.family == "bf16":
        target = str(src)
    else:
        ck = root / "checkpoints" / cfg.model / cfg.slug
        target = str(ck)
        done = ck.with_name(cfg.slug + ".quantized.json")
        q = read_cached(done, key)
        if q is not None and (ck / ("peer.json" if cfg.tag == "llmc" else "latq_stats.json")).is_file():
            certs, tq = q["certificate"], q["quantize_seconds"]
        else:
            certs, tq = (peers.quantize_llmc if cfg.tag == "llmc" else quantize_config)(cfg, st, src, ck, progress)
            write_json(done, {"certificate": certs, "quantize_seconds": tq, "settings": key})
    ev = evaluate(target, seqlen=st.eval_seqlen, nwindows=st.nwindows, progress=progress)
    r = {"model": cfg.model, "label": cfg.label, "family": cfg.family, "level": cfg.level, "tag": cfg.tag,
         "base": cfg.base, "options": cfg.kwargs, "bits": ev["bits"], "outlier_rate": ev.get("outlier_rate", 0.0),
         "ppl": ev["ppl"], "nll": ev["nll"], "windows": ev["windows"], "tokens": ev["tokens"],
         "quantize_seconds": round(tq, 1), "eval_seconds": ev["seconds"], "certificate": certs,
         "threads": torch.get_num_threads(),  # GEMM reductions, so the last bits, depend on it
         "jobs": int(os.environ.get(JOBS_ENV, "1")),  # configurations running side by side
         "settings": key}
    if cfg.tag == "llmc":   # a plain HF directory: its bits come from llm-compressor's format
        r["peer"] = json.loads((Path(target) / "peer.json").read_text())
        r["bits"] = r["peer"]["bits_per_weight"]
        r["served"] = served.outlier_free_served(served.linear_shapes(src), cfg.kwargs["bits"],
                                                 cfg.kwargs["group_size"])
    elif cfg.family != "bf16":
        stats = json.loads((Path(target) / "latq_stats.json").read_text())
        r["stats_cert_max"] = stats["totals"].get("cert_max")
        r["rel_error_mean"] = stats["totals"].get("rel_error_mean")
        if (over := overload_record(stats)) is not None:
            r["overloads"] = over
        r["served"] = served.checkpoint_record(Path(target))
    if head.quantizes_head(cfg):
        r["ppl_source_head"] = head.source_head_ppl(Path(target), src, st.eval_seqlen, st.nwindows)
    if cfg.family != "bf16":
        if not keep:
            shutil.rmtree(target, ignore_errors=True)
        done.unlink(missing_ok=True)
    write_json(path, r)
    log.info("done: %s %s: %.3f bits/w, ppl %.3f (%.0fs)", cfg.model, cfg.label, r["bits"], r["ppl"],
             time.time() - t0)
    return r


# ============================================================================ served bits of older results

def backfill_overloads(cfg: Config, root: Path, r: dict) -> dict:
    """A cached codebook result run before the study recorded overloads → with them, where its
    checkpoint was kept."""
    stats = root / "checkpoints" / cfg.model / cfg.slug / "latq_stats.json"
    if "overloads" in r or cfg.kwargs.get("method") != "e8" or not stats.is_file():
        return r
    r["overloads"] = overload_record(json.loads(stats.read_text()))
    write_json(root / "results" / cfg.model / f"{cfg.slug}.json", r)
    return r


def backfill_served(cfg: Config, st: Settings, root: Path, r: dict, keep: bool, requantize: bool) -> dict:
    """A cached result of ``cfg`` without served bits (run before the study recorded them), or with
    stale ones (computed under kernel cost models that changed since, or before its family had a
    codebook kernel) → with today's: from the layout for one without outliers or a codebook one
    (exact), else from its kept checkpoint, else (``requantize``)
    from the checkpoint quantized again with its settings (no evaluation: the perplexity stays the
    result's; the record keeps that checkpoint's stored bits, which must be the result's). Without
    a way, the result is returned without served bits (stale ones are never reported)."""
    if cfg.family == "bf16" or ("served" in r and not served.is_stale(r)):
        return r
    if "served" in r:
        log.info("served bits of %s %s predate a kernel layout change: recomputing", cfg.model, cfg.label)
        r = {k: v for k, v in r.items() if k != "served"}
    src = source_dir(cfg.model, st, root)
    ck = root / "checkpoints" / cfg.model / cfg.slug
    if served.is_outlier_free(r):
        o = cfg.kwargs
        r["served"] = served.outlier_free_served(served.linear_shapes(src), o["bits"], o["group_size"],
                                                 o.get("scale_bits"), o.get("rotate", "none") != "none",
                                                 "codebook" if served.is_codebook(r) else "dense")
    elif (ck / "latq_stats.json").is_file() or requantize:
        fresh = not (ck / "latq_stats.json").is_file()
        if fresh:
            log.info("re-quantizing for served bits: %s %s", cfg.model, cfg.label)
            quantize_config(cfg, st, src, ck, progress=False)
        r["served"] = served.checkpoint_record(ck)
        stored = json.loads((ck / "latq_stats.json").read_text())["totals"]["bits_per_weight"]
        r["served"].update(source="re-quantized" if fresh else "kept checkpoint", stored_bits=stored)
        if abs(stored - r["bits"]) > 1e-3:
            log.warning("%s %s: the checkpoint re-quantized for served bits stores %.4f bits/w, the result %.4f",
                        cfg.model, cfg.label, stored, r["bits"])
        if fresh and not keep:
            shutil.rmtree(ck, ignore_errors=True)
    else:
        return r
    write_json(root / "results" / cfg.model / f"{cfg.slug}.json", r)
    log.info("served bits of %s %s (%s): %s", cfg.model, cfg.label, r["served"]["source"],
             ", ".join(f"{f} {b:.3f}" for f, b in r["served"]["bits_per_weight"].items()))
    return r


def backfill_source_head(cfg: Config, st: Settings, root: Path, r: dict) -> dict:
    """A cached result of a configuration that quantizes the head, run before the study measured
    the same body with the source's head (``study/head.py``) → with it, where its checkpoint was kept."""
    ck = root / "checkpoints" / cfg.model / cfg.slug
    if not head.quantizes_head(cfg) or "ppl_source_head" in r or not (ck / "latq_stats.json").is_file():
        return r
    r["ppl_source_head"] = head.source_head_ppl(ck, source_dir(cfg.model, st, root), st.eval_seqlen, st.nwindows)
    write_json(root / "results" / cfg.model / f"{cfg.slug}.json", r)
    log.info("%s %s with the source's head: ppl %.3f", cfg.model, cfg.label, r["ppl_source_head"])
    return r


# ============================================================================ many configurations

def run_configs(configs: list[Config], st: Settings, root: Path, keep: bool, compute: bool = True,
                jobs: int = 1, worker_argv: list[str] = ()) -> list[dict | None]:
    """:func:`run_config` for every configuration, in order (cached ones first, at once). With
    ``jobs > 1`` the uncached ones run in priority order in that many worker processes at a
    time (the study's script with ``worker_argv + --worker --models M --only LABEL``, ``cores // jobs``
    threads each, output in ``<root>/logs``); the bar counts finished configurations. A failed
    configuration stops the study once the running ones finish (their results are cached)."""
    from tqdm.auto import tqdm
    results = [run_config(c, st, root, keep, compute=False) for c in configs]
    todo = [i for i, r in enumerate(results) if r is None]
    if not compute:   # --report-only: what is cached, nothing more
        log.info("%d of %d configurations cached", len(configs) - len(todo), len(configs))
        return results
    if any(configs[i].tag == "llmc" for i in todo):
        peer_llmcompressor.ensure_env(data.cache_dir(), log.info)  # once, here, not by racing workers
    bar = tqdm(total=len(configs), initial=len(configs) - len(todo), desc="study configurations", unit="cfg")
    if jobs <= 1 or len(todo) <= 1:
        for i in todo:
            results[i] = run_config(configs[i], st, root, keep)
            bar.update()
        bar.close()
        return results
    for m in dict.fromkeys(configs[i].model for i in todo):
        source_dir(m, st, root)  # a truncated copy is written once, here, not by racing workers
    threads = max(1, (os.cpu_count() or 1) // jobs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), JOBS_ENV: str(jobs)}
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log.info("%d configurations to run, %d at a time (%d threads each; logs in %s)", len(todo), jobs, threads, logs)
    queue, running, failed = list(todo), {}, []
    try:
        while queue or running:
            while queue and len(running) < jobs and not failed:
                i = queue.pop(0)
                c = configs[i]
                out = (logs / f"{c.model}-{c.slug}.log").open("w")
                cmd = [sys.executable, *WORKER, *worker_argv, "--worker", "--out", str(root),
                       "--models", c.model, "--only", c.label]
                running[i] = (subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env), out)
                log.info("running: %s %s", c.model, c.label)
            if not running:
                break
            time.sleep(0.5)
            for i, (proc, out) in list(running.items()):
                if proc.poll() is None:
                    continue
                out.close()
                del running[i]
                c = configs[i]
                results[i] = run_config(c, st, root, keep, compute=False)
                if proc.returncode != 0 or results[i] is None:
                    tail = "".join(Path(out.name).read_text().splitlines(True)[-15:])
                    log.error("%s %s failed (exit %s); the end of %s:\n%s", c.model, c.label, proc.returncode,
                              out.name, tail)
                    failed.append(f"{c.model} {c.label}")
                else:
                    log.info("done: %s %s (ppl %.3f)", c.model, c.label, results[i]["ppl"])
                    bar.update()
    finally:
        for proc, out in running.values():  # interrupted: stop the workers (their finished blocks are kept)
            proc.terminate()
            proc.wait()
            out.close()
    bar.close()
    if failed:
        raise RuntimeError(f"study configurations failed: {failed} (logs in {logs})")
    return results
