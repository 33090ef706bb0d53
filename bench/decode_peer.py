"""llama.cpp as a peer engine of ``bench/decode.py --peer llamacpp``: its worker (the same
request protocol as the vLLM engines: load, warm up, answer ``run`` with the seconds of one
timed generation), the GGUFs it runs, and the bytes each engine streams per decoded token.

llama.cpp runs through ``xllamacpp`` (PyPI's prebuilt CPU wheel, the ``bench`` extra): its
server object in process, one slot, greedy, EOS ignored, the same prompts and new tokens as
the vLLM engines, ``threads`` threads for prompt and decode, pinned to the vLLM engines' cores
(``cores``, one thread each, as vLLM binds its OpenMP threads). A run is the wall time of one
completion request (prompt included), as a vLLM run is one ``generate``. Batch 1 only: the
server batches concurrent requests, which the bench does not drive.

The GGUFs: the one the reference model ships as (SmolLM2: Q4_1, i.e. asymmetric 4-bit g32 —
5 bits/weight — with a Q8_0 head tied to the embedding), and ``latq``: the latq checkpoint
written value for value in llama.cpp's blocks (``bench/latq_gguf.py``: Q4_0 for ≤ 4 bits, 4.5
bits/weight; Q8_0 for the 8-bit head, 8.5). llama.cpp multiplies those blocks with activations
it rounds to 8-bit blocks (``Q8_0``/``Q8_1``); latq's kernels keep bf16 activations.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

PEERS = ("llamacpp",)


def serve(job: dict, reply, requests, prompts: list[str]) -> None:
    """Worker: load the GGUF ``job["gguf"]`` on ``job["threads"]`` threads, warm up, reply
    ``{"load_s", ...}``, then answer each request of ``requests`` (``{"op": "run", "batch": 1}``
    → ``{"s": seconds}``) until ``quit``."""
    try:
        import xllamacpp as xl
    except ImportError:
        return reply({"error": "xllamacpp is not installed: pip install xllamacpp (the bench extra)"})
    t0 = time.time()
    try:
        p = xl.CommonParams()
        p.model.path = job["gguf"]
        p.n_ctx, p.n_parallel, p.n_predict = 512, 1, job["tokens"]
        for cpu in (p.cpuparams, p.cpuparams_batch):   # the vLLM engines' cores, a thread pinned to each
            cpu.n_threads = job["threads"]
            if job.get("cores"):
                cpu.cpumask = [i in job["cores"] for i in range(len(cpu.cpumask))]
                cpu.mask_valid = cpu.strict_cpu = True
        p.sampling.temp = 0.0
        server = xl.Server(p)
        _complete(server, prompts[0], 16)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return reply({"error": f"{type(e).__name__}: {e}"})
    reply({"load_s": round(time.time() - t0, 1), "gemv_isa": "", "vllm_ops": "",
           "llamacpp_cpu": xl.get_system_info().strip()})
    for req in requests:
        if req["op"] != "run":
            break
        if req["batch"] != 1:
            reply({"error": "the llama.cpp peer runs batch 1 only"})
            continue
        t = time.perf_counter()
        n = _complete(server, prompts[0], job["tokens"])
        dt = time.perf_counter() - t
        if n != job["tokens"]:
            reply({"error": f"llama.cpp generated {n} tokens, not {job['tokens']}"})
            continue
        reply({"s": dt})


def _complete(server, prompt: str, tokens: int) -> int:
    """One greedy completion of ``tokens`` new tokens (EOS ignored, no prompt cache) → tokens generated."""
    r = server.handle_completions({"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "temperature": 0.0,
                                   "cache_prompt": False})
    if "error" in r:
        raise RuntimeError(f"llama.cpp: {r['error']}")
    return int(r["usage"]["completion_tokens"])


# ----------------------------------------------------------------------------- bytes per token

def gguf_bytes(path: str | Path) -> tuple[int, int]:
    """(bytes, weights) a llama.cpp decode step streams for the GGUF at ``path``: every matrix of
    the blocks and the head (``output``, or the tied ``token_embd``), as stored; the embedding's
    one-row lookup and the norms are not counted."""
    import gguf
    r = gguf.GGUFReader(str(path))
    mats = {t.name: t for t in r.tensors if len(t.shape) == 2}
    head = "output.weight" if "output.weight" in mats else "token_embd.weight"
    used = [t for n, t in mats.items() if n.startswith("blk.") or n == head]
    return sum(int(t.n_bytes) for t in used), sum(int(t.n_elements) for t in used)


def hf_bytes(model_dir: str | Path, dtype_bytes: int) -> tuple[int, int]:
    """(bytes, weights) of an unquantized HF model's decode step in a dtype of ``dtype_bytes``:
    the matrices of its decoder blocks and its head (``lm_head``, or the tied embedding)."""
    from safetensors import safe_open
    n, head, embed = 0, 0, 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                shape = h.get_slice(k).get_shape()
                size = shape[0] * shape[1] if len(shape) == 2 else 0
                if ".layers." in k:
                    n += size
                elif k.startswith("lm_head"):
                    head = size
                elif "embed_tokens" in k:
                    embed = size
    n += head or embed
    return n * dtype_bytes, n


def latq_bytes(ckpt: str | Path, dtype_bytes: int) -> tuple[int, int]:
    """(bytes, weights) of a latq checkpoint's decode step on this CPU's kernel family: each
    quantized layer's served bytes (``latq-inspect``'s CPU figure, the head's too when it is
    quantized), plus an unquantized head (the tied embedding) in a dtype of ``dtype_bytes``."""
    from vllm_latq.format.checkpoint import Checkpoint
    from vllm_latq.format.validate import validate_checkpoint
    from vllm_latq.kernels.served_report import checkpoint_served

    report = validate_checkpoint(ckpt, decode=False, verify_checksums=False)
    rows = report["layers"]
    checkpoint_served(ckpt, rows)
    served = sum(r["served"]["cpu"]["bytes"] for r in rows)
    weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    ck = Checkpoint(ckpt)
    if "lm_head" not in ck.layers():
        head = next((n for n in ck.plain_names() if n.startswith("lm_head")), None) or next(
            n for n in ck.plain_names() if "embed_tokens" in n)
        shape = ck.tensor(head).shape
        served += shape[0] * shape[1] * dtype_bytes
        weights += shape[0] * shape[1]
    return served, weights


def peer_jobs(peers: str, ggufs: str, model: str, ckpt: str, workdir: str) -> list[dict]:
    """The peer engines (``decode_peer``) on each GGUF asked for: the one ``model`` ships as, and
    ``ckpt`` written in llama.cpp's blocks (``bench/latq_gguf.py``, into ``workdir``); a GGUF that
    cannot be had is said and skipped."""
    from bench.latq_gguf import write_gguf
    from vllm_latq.data import MODELS

    jobs = []
    for peer in filter(None, peers.split(",")):
        if peer not in PEERS:
            raise SystemExit(f"--peer {peer}: not one of {', '.join(PEERS)}")
        shipped = MODELS[model].gguf() if model in MODELS else None
        for which in ggufs.split(","):
            if which.endswith(".gguf"):   # a GGUF of the same weights made elsewhere (bench/iquant_peer.py's)
                if not Path(which).is_file():
                    raise SystemExit(f"--peer-ggufs {which}: no such file")
                jobs.append({"label": f"llama.cpp:{Path(which).stem.rsplit('-', 1)[-1]}", "model": which,
                             "gguf": which, "kernel": peer, "dtype": "gguf", "peer": True})
                continue
            try:
                if shipped is None:
                    raise ValueError(f"{model} is not a reference model: no GGUF it ships as")
                path = shipped if which == "shipped" else write_gguf(ckpt, shipped, Path(workdir, "latq.gguf"))
            except ValueError as e:
                print(f"decode bench: no {which} GGUF for llama.cpp: {e}", file=sys.stderr)
                continue
            name = Path(path).stem.rsplit(".", 1)[-1] if which == "shipped" else "latq"
            jobs.append({"label": f"llama.cpp:{name}", "model": str(path), "gguf": str(path), "kernel": peer,
                         "dtype": "gguf", "peer": True})
    return jobs
