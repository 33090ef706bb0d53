"""The study's command line (``python -m bench.accuracy [options]``): options → settings and
configurations, run them (or only read the cache), the ordering study, the report."""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from vllm_latq import data

from . import __doc__ as STUDY_DOC
from .configs import EXTRA_TAGS, MODELS, peer_group_size, run_priority, sweep_configs, tiny_configs
from .ordering import ordering_study
from .report import headline, write_report
from .runner import (ROOT, Settings, backfill_overloads, backfill_served, backfill_source_head, import_results,
                     run_config, run_configs, write_json)

log = logging.getLogger("latq.study")


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=STUDY_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="results and checkpoints (default $LATQ_CACHE/study)")
    ap.add_argument("--report", type=Path, default=None, help="markdown report (default docs/RESULTS.md)")
    ap.add_argument("--plot", type=Path, default=None, help="Pareto plot PNG (default beside the report)")
    ap.add_argument("--tiny", action="store_true", help="CI: smollm2-135m truncated to 2 decoder blocks, "
                    "3 configurations + bf16, 4 × 128 calibration tokens, 2 eval windows of 128, "
                    "ordering on block 1")
    ap.add_argument("--max-blocks", type=int, default=None, help="truncate the models to their first "
                    "N decoder blocks (testing only)")
    ap.add_argument("--models", nargs="+", default=None, choices=MODELS)
    ap.add_argument("--nsamples", type=int, default=None)
    ap.add_argument("--seqlen", type=int, default=None)
    ap.add_argument("--nwindows", type=int, default=None)
    ap.add_argument("--eval-seqlen", type=int, default=None)
    ap.add_argument("--ordering-blocks", type=int, nargs="+", default=None)
    ap.add_argument("--only", nargs="+", default=None, help="only these configuration labels (e.g. GPTQ-3b bf16)")
    ap.add_argument("--core", action="store_true", help="skip the extras (the peer gap's controls and the "
                    "quantized-head variants): the core study only")
    ap.add_argument("--jobs", type=int, default=2, help="configurations run side by side, each on "
                    "cores/jobs threads (default 2: on 2 cores ~1.2× the throughput of one 2-thread job, "
                    "as the single-threaded parts overlap); 1: one at a time with nested progress bars")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # see run_configs
    ap.add_argument("--skip-ordering", action="store_true")
    ap.add_argument("--keep-checkpoints", action="store_true")
    ap.add_argument("--import-results", type=Path, default=None, metavar="RESULTS.json",
                    help="seed the cache with the records of a report's JSON (e.g. docs/RESULTS.json from another "
                    "machine): a study continues where that one stopped; records of other settings are ignored")
    ap.add_argument("--requantize-served", action="store_true", help="quantize again (no evaluation) the "
                    "cached configurations whose results predate served bits and have neither an outlier-free "
                    "layout nor a kept checkpoint, to add their served bits")
    ap.add_argument("--report-only", action="store_true", help="write the report from the cached results only "
                    "(configurations not cached yet are listed as missing; nothing is computed)")
    return ap


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    term = signal.signal(signal.SIGTERM, _interrupted) if main_thread else None  # `kill` stops the workers too
    logging.basicConfig(level=logging.INFO, format="[study] %(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)
    quiet = {n: logging.getLogger(n).level for n in ("vllm_latq.quantize", "transformers")}
    for n in quiet:  # the pipeline's per-layer lines would drown the progress bars
        logging.getLogger(n).setLevel(logging.WARNING)
    try:
        return _run(a, argv)
    finally:
        for n, lvl in quiet.items():
            logging.getLogger(n).setLevel(lvl)
        if main_thread:
            signal.signal(signal.SIGTERM, term)


def _settings_argv(a) -> list[str]:
    """The options of ``a`` that set the study's Settings, as a worker's command line."""
    out = ["--tiny"] if a.tiny else []
    for k in ("max_blocks", "nsamples", "seqlen", "nwindows", "eval_seqlen"):
        if getattr(a, k) is not None:
            out += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    return out + (["--keep-checkpoints"] if a.keep_checkpoints else [])


def _settings(a) -> tuple[Settings, list[str]]:
    """The study's settings and models from the options ``a``."""
    if a.tiny:
        st = Settings(nsamples=4, seqlen=128, eval_seqlen=128, nwindows=2, ordering_blocks=(1,),
                      ordering_nsamples=4, ordering_seeds=2, peer_bits=(3,), max_blocks=2, tiny=True)
        models = a.models or ["smollm2-135m"]
    else:
        st = Settings()
        models = a.models or list(MODELS)
    for k in ("nsamples", "seqlen", "nwindows", "eval_seqlen"):
        if getattr(a, k) is not None:
            setattr(st, k, getattr(a, k))
    if a.max_blocks is not None:
        st.max_blocks = a.max_blocks
    if a.ordering_blocks:
        st.ordering_blocks = tuple(a.ordering_blocks)
    return st, models


def _run(a, argv) -> int:
    st, models = _settings(a)
    root = (a.out or data.cache_dir() / "study").resolve()
    report = a.report or (root / "RESULTS_tiny.md" if a.tiny else ROOT / "docs" / "RESULTS.md")
    plot = a.plot or report.with_name("pareto_tiny.png" if a.tiny else "pareto.png")

    configs = [c for m in models for c in (tiny_configs if a.tiny else sweep_configs)(
        m, st.group_size, peer_group_size(json.loads((data.model_dir(m) / "config.json").read_text()), st.group_size))]
    configs.sort(key=lambda c: run_priority(c, models))
    if a.only:
        configs = [c for c in configs if c.label in a.only]
    if a.core:
        configs = [c for c in configs if c.tag not in EXTRA_TAGS]
    t0 = time.time()
    if a.import_results:
        import_results(a.import_results, root)
    if a.worker:  # one configuration of a parallel study, run by run_configs: no report
        for cfg in configs:
            r = run_config(cfg, st, root, a.keep_checkpoints, progress=False)
            backfill_served(cfg, st, root, r, a.keep_checkpoints, a.requantize_served)
        return 0
    results = run_configs(configs, st, root, a.keep_checkpoints, compute=not a.report_only, jobs=a.jobs,
                          worker_argv=_settings_argv(a))
    # cached results without (current) served bits: what can be had without evaluating
    results = [r and backfill_served(c, st, root, r, a.keep_checkpoints, a.requantize_served and not a.report_only)
               for c, r in zip(configs, results)]
    results = [r and backfill_overloads(c, root, r) for c, r in zip(configs, results)]
    if not a.report_only:   # kept checkpoints that quantize the head: the same body with the source's head
        results = [r and backfill_source_head(c, st, root, r) for c, r in zip(configs, results)]
    by_model: dict[str, list[dict]] = {m: [] for m in models}
    missing = []
    for cfg, r in zip(configs, results):
        if r is None:
            missing.append(f"{cfg.model} {cfg.label}")
        else:
            by_model[cfg.model].append(r)
    ordering = {}
    for m in [] if a.skip_ordering else models:
        o = ordering_study(m, st, root, compute=not a.report_only)
        if o is None:
            missing.append(f"{m} ordering study")
        else:
            ordering[m] = o
    args = argv if argv is not None else sys.argv[1:]
    cmd = "python -m bench.accuracy" + (" " + " ".join(args) if args else "")
    write_report(by_model, ordering, st, report, plot, cmd, missing)
    # the report's numbers as data: every record as cached (settings, timings, certificates)
    write_json(report.with_suffix(".json"), {"command": cmd, "results": by_model, "ordering": ordering,
                                             "missing": missing})
    log.info("wrote %s (%s, %s) in %.0fs", report, report.with_suffix(".json").name, plot.name, time.time() - t0)
    print(headline(by_model, ordering), flush=True)
    return 0
