"""End-to-end decode on a GPU without vLLM: a Llama-3-8B-shaped decoder (transformers'
``LlamaConfig`` shapes, random weights, ``bench/decode_model.py``), its projections in each latq
form on latq's Triton kernels (E8 codebook forms: random codes on ``triton-e8``, speed only),
against the same model in bf16 and on torch's int4 kernel (4-bit g128): a static KV cache and the
whole decode step captured in one CUDA graph, as gpt-fast runs it; per batch, ``--tokens`` new
tokens after a ``--prompt``-token prefix fed through the same graph, timed with CUDA events.

Reported per form and batch: tok/s, ms a step, and where a step's time goes — the projections
alone (every linear of every block replayed as one graph), the head (embedding, final norm, bf16
head, argmax) and the rest (attention, norms, rope, residuals). With ``--layers`` below the
model's 32 the figures are projected: step = head + 32 × (measured step − head) / layers, said
in the output and in the rows' ``model``. Each form's captured step is checked against the same
step run eagerly (its logits equal).

    python -m bench.decode_gpu [--layers 8] [--forms ssqr-1%-4b,ssqr-1%-3b,gptq-4b-g64,e8-3b-s4-g16]
                               [--batches 1,8,16] [--tokens 128] [--prompt 16] [--json FILE] [--budget-s S]
    python -m bench.decode_gpu --dry-run          # a tiny model on the CPU, eager, the reference's numbers

Ends with ``HEADLINE`` keys ``e2e_<form>_vs_bf16_b<B>`` and ``e2e_<form>_vs_int4_b<B>`` (tok/s
ratios), ``layers``, ``device``; ``--json`` writes the ``e2e`` rows of docs/gpu/latest.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from bench.decode_model import CODEBOOK_FORMS, FORMS, LLAMA3_8B, Decoder, Spec, random_decoder, random_weights

BASELINES = ("bf16", "int4")
ALL_FORMS = (*FORMS, *CODEBOOK_FORMS)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=512, num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, help="decoder blocks built (default: all 32; fewer are projected to 32)")
    ap.add_argument("--forms", default="ssqr-1%-4b,ssqr-1%-3b,gptq-4b-g64", help=f"latq forms, of {', '.join(ALL_FORMS)}")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens timed per sequence")
    ap.add_argument("--prompt", type=int, default=16, help="prefix tokens fed through the graph first (not timed)")
    ap.add_argument("--json", help="write the e2e rows (docs/gpu/latest.json's schema) here, after each form")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new form after this many seconds")
    ap.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU, eager, the reference's numbers (dequantized once)")
    a = ap.parse_args(argv)
    try:
        a.forms = [f for f in dict.fromkeys(t.strip() for t in a.forms.split(",") if t.strip())]
        if not a.forms or any(f not in ALL_FORMS for f in a.forms):
            raise ValueError(f"--forms: of {', '.join(ALL_FORMS)} (got {a.forms})")
        a.batches = sorted({int(b) for b in a.batches.split(",") if b.strip()})
        if not a.batches or min(a.batches) < 1 or a.tokens < 1 or a.prompt < 1:
            raise ValueError("--batches, --tokens and --prompt must be positive")
        if a.layers is not None and not 1 <= a.layers <= LLAMA3_8B["num_hidden_layers"]:
            raise ValueError(f"--layers must be in 1..{LLAMA3_8B['num_hidden_layers']}")
    except ValueError as e:
        ap.error(str(e))
    return a


# ----------------------------------------------------------------------------- timing

class Clock:
    """Seconds of ``reps`` calls of ``fn``: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"

    def __call__(self, fn, reps: int) -> float:
        if not self.cuda:
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            return time.perf_counter() - t
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def captured(fn, dev: torch.device):
    """``fn`` as a replayable callable: a CUDA graph of it on a GPU (after two eager runs on a
    side stream, which compile and warm up), ``fn`` itself on the CPU."""
    if dev.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def decode_step(dec: Decoder, tokens: torch.Tensor, out: dict):
    """One greedy step on the decoder's static buffers: logits, the next tokens, the position."""
    def step():
        out["logits"] = dec.step(tokens)
        tokens.copy_(out["logits"].argmax(-1))
        dec.pos.add_(1)
    return step


def time_form(dec: Decoder, batch: int, a, clock: Clock, dev) -> dict:
    """Decode ``a.tokens`` tokens at ``batch`` through the captured step → ms per step, the
    breakdown's parts, and whether the captured step's logits equal the eager step's."""
    dec.allocate(batch, a.prompt + a.tokens + 1)
    prompt = torch.randint(0, dec.spec.vocab, (batch, a.prompt), device=dev, generator=torch.Generator(
        device=dev).manual_seed(batch))
    tokens, out = prompt[:, 0].clone(), {}
    eager = dec.step(tokens).float()                              # compiles every kernel before a capture
    replay = captured(decode_step(dec, tokens, out), dev)
    dec.reset()
    tokens.copy_(prompt[:, 0])
    replay()
    graph_err = float((out["logits"].float() - eager).abs().max())
    dec.reset()
    for i in range(a.prompt):
        tokens.copy_(prompt[:, i])
        replay()
    step_s = clock(replay, a.tokens) / a.tokens
    parts = {"linears": clock(captured(_linears_only(dec, batch), dev), 10) / 10,
             "head": clock(captured(_head_only(dec, tokens), dev), 10) / 10}
    return {"step_s": step_s, **parts, "graph_err": graph_err}


def _linears_only(dec: Decoder, batch: int):
    """Every projection of every block once, on static inputs of its width."""
    shapes = dec.spec.shapes()
    xs = {p: torch.randn(batch, k, device=dec.device).to(dec.embed.dtype) for p, (_, k) in shapes.items()}

    def run():
        for blk in dec.blocks:
            for p in shapes:
                blk[p](xs[p])
    return run


def _head_only(dec: Decoder, tokens: torch.Tensor):
    from bench.decode_model import rms_norm

    def run():
        h = torch.nn.functional.embedding(tokens, dec.embed)
        dec.head(rms_norm(h, dec.norm, dec.spec.eps)).argmax(-1)
    return run


# ----------------------------------------------------------------------------- the run

def project(t: dict, layers: int, full: int) -> float:
    """Seconds a step of the ``full``-block model: the head plus ``full`` blocks at the measured
    per-block time."""
    return t["head"] + full * (t["step_s"] - t["head"]) / layers


def run(a, dev: torch.device, log=print) -> list[dict]:
    """Every form at every batch → one result per (form, batch), bf16 and int4 included."""
    from vllm_latq.kernels.dequantized import DequantizedFp32Kernel
    from vllm_latq.kernels.triton.kernel import TritonKernel
    config = dict(TINY if a.dry_run else LLAMA3_8B)
    full = config["num_hidden_layers"]
    layers = full if a.dry_run else (a.layers or full)
    spec = Spec.of(dict(config, num_hidden_layers=layers))
    act = torch.float32 if dev.type == "cpu" else torch.bfloat16
    kernel = DequantizedFp32Kernel if dev.type == "cpu" else TritonKernel
    clock, t0 = Clock(dev), time.perf_counter()
    weights = random_weights(spec, dev)
    base = random_decoder(spec, weights, "bf16", act)
    results = []
    for form in ("bf16", a.forms[0], "int4", *a.forms[1:]):
        if time.perf_counter() - t0 > a.budget_s:
            log(f"SKIPPED {form}: --budget-s {a.budget_s:g} spent")
            continue
        t1, dec = time.perf_counter(), None
        try:
            dec = base if form == "bf16" else random_decoder(spec, weights, form, act, kernel, like=base)
            built = time.perf_counter() - t1
            for b in a.batches:
                t = time_form(dec, b, a, clock, dev)
                step = project(t, layers, full)
                results.append(dict(form=form, batch=b, tok_s=b / step, step_ms=1e3 * step, **t,
                                    nbytes=sum(lin.nbytes for lin in dec.linears()) + dec.head.nbytes))
                log(format_row(results[-1], layers, full))
            log(f"  ({form}: built in {built:.1f} s, timed in {time.perf_counter() - t1 - built:.1f} s)")
        except Exception as e:  # noqa: BLE001 — one form lost, not the run
            log(f"FAILED {form}: {type(e).__name__}: {str(e).strip()[:300]}")
        del dec
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if a.json:
            Path(a.json).write_text(json.dumps({"e2e": e2e_rows(results, a, layers, full)}, indent=1) + "\n")
    return results


def format_row(r: dict, layers: int, full: int) -> str:
    scale = full / layers
    return (f"{r['form']:12} batch {r['batch']:3}: {r['tok_s']:9.1f} tok/s  {r['step_ms']:7.3f} ms/step  "
            f"(projections {1e3 * r['linears'] * scale:7.3f} ms, head {1e3 * r['head']:6.3f} ms, rest "
            f"{r['step_ms'] - 1e3 * (r['linears'] * scale + r['head']):6.3f} ms; weights "
            f"{r['nbytes'] / 1e9:.3f} GB as built; graph vs eager max |Δlogit| {r['graph_err']:.1e})")


def model_label(layers: int, full: int, dry_run: bool = False) -> str:
    if dry_run:
        return "tiny-llama (dry run on the CPU: no speed)"
    return "llama3-8b-shapes" + ("" if layers == full else f" ({layers} of {full} blocks timed, projected)")


def e2e_rows(results: list[dict], a, layers: int, full: int) -> list[dict]:
    """One row per latq form and batch in latest.json's schema, bf16's and int4's tok/s beside."""
    tok = {(r["form"], r["batch"]): r["tok_s"] for r in results}

    def num(key):
        v = tok.get(key)
        return round(v, 1) if v is not None and math.isfinite(v) else None
    return [{"model": model_label(layers, full, a.dry_run), "form": f, "batch": b, "tokens": a.tokens,
             "latq_tok_s": num((f, b)), "bf16_tok_s": num(("bf16", b)), "int4_tok_s": num(("int4", b))}
            for f in a.forms for b in a.batches if (f, b) in tok]


def headline(results: list[dict], a, layers: int, dev_name: str) -> str:
    tok = {(r["form"], r["batch"]): r["tok_s"] for r in results}
    head = {}
    for f in a.forms:
        for b in a.batches:
            for base in BASELINES:
                if (f, b) in tok and (base, b) in tok:
                    head[f"e2e_{f}_vs_{base}_b{b}"] = f"{tok[f, b] / tok[base, b]:.2f}"
    head.update(layers=layers, device=dev_name.replace(" ", "_"))
    return "HEADLINE " + " ".join(f"{k}={v}" for k, v in head.items())


def main(argv=None) -> int:
    a = parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        print("no CUDA device: nothing timed (--dry-run runs a tiny model on the CPU)")
        print("HEADLINE device=none")
        return 0
    dev = torch.device("cpu") if a.dry_run else torch.device("cuda", 0)
    name = "cpu (dry run)" if a.dry_run else torch.cuda.get_device_name(dev)
    print(f"{name}: Llama-3-8B shapes{' (tiny: dry run)' if a.dry_run else ''}, forms bf16, int4, "
          f"{', '.join(a.forms)}; batches {a.batches}; {a.tokens} tokens after a {a.prompt}-token prefix", flush=True)
    with torch.no_grad():
        results = run(a, dev, log=lambda s: print(s, flush=True))
    full = (TINY if a.dry_run else LLAMA3_8B)["num_hidden_layers"]
    print(headline(results, a, full if a.dry_run else (a.layers or full), name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
