"""llama.cpp's i-quants on the same weights as latq: "why not llama.cpp's IQ3?".

The source is what latq quantizes: SmolLM2-135M's shipped GGUF dequantized (its linears are Q4_1,
asymmetric 4-bit g32, so the "full-precision" weights are themselves a dequantized Q4_1) and
rounded to bf16 — value for value the study's bf16 reference directory (checked here). Each
decoder-block linear is quantized by llama.cpp's own quantizer (``ggml_quantize_chunk`` from the
``xllamacpp`` wheel, ``bench/iquant_gguf.py``) to each ``--types`` type, with an importance
matrix computed on latq's calibration text: per linear and input column, the mean of x² over the
protocol's calibration tokens (128 × 512 of the Wikipedia calibration split, seed 0; what
llama.cpp's ``imatrix`` tool collects, the diagonal of latq's Hessian XᵀX / n), the source model
run in fp32. The embedding (Q8_0, tied to the head) and the norms are copied from the shipped
GGUF as it stores them.

Two rows per type:

* ``<type>`` — the GGUF as ``llama-quantize --pure`` writes it: i-quants pack 256 weights a block,
  and a tensor whose rows are not whole blocks falls back to IQ4_NL (4.5 bits/weight). SmolLM2's
  hidden size is 576, so only ``ffn_down`` (1536 columns) is in the type; q/k/v/o/gate/up are
  IQ4_NL. This is the file a llama.cpp user gets; llama.cpp runs it (tok/s).
* ``<type>-pure`` — perplexity of the type on every linear, emulated: the 576-column rows
  zero-padded to 768, quantized, cut back (``iquant_gguf.pad_quantize``). No file llama.cpp
  loads; its bits/weight are the type's own.

Perplexity: the study's protocol and code (``vllm_latq.data``: the first 64 non-overlapping
512-token windows of the eval split, the reference directory's tokenizer, fp32), the model the
study's bf16 reference directory with each linear's weight replaced by the dequantized i-quant
(gguf's numpy dequantization of the written file's blocks, the same values as llama.cpp's
``dequantize_row_*``) — as ``latq-eval`` reads a latq checkpoint (its embedding and norms the bf16
source's). Decode: llama.cpp (``bench/decode_peer.py``'s worker, through ``bench/decode_engines``)
on the shipped Q4_1 and on each i-quant file, 1 thread by default, batch 1, interleaved rounds;
the ratio is the median over rounds of the paired time ratio Q4_1 / the file (above 1: faster).

    python -m bench.iquant_peer                                    # IQ3_S, IQ3_XXS, IQ2_XS
    python -m bench.iquant_peer --types IQ3_S --repeats 5 --threads 1
    python -m bench.iquant_peer --types IQ3_S --no-pure --no-baseline   # the llama.cpp file only
    python -m bench.iquant_peer --no-ppl --reuse-files             # decode only, on the files made before

HEADLINE keys: ``cpu`` (torch's capability), ``cpu_hw`` (the hardware's), ``llamacpp_isa`` (the
widest instruction set the wheel's llama.cpp was built for: it runs that code on any CPU), then per type
``<type>_bits`` (bits/weight over the block linears, as stored), ``<type>_ppl``,
``<type>_pure_bits``, ``<type>_pure_ppl``, ``<type>_tok_s``, ``<type>_vs_q4_1`` (paired speed ratio),
and ``q4_1_tok_s``, ``q4_1_bits``, ``source_ppl`` (the bf16 source), ``windows``, ``tokens``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.iquant_gguf import GGML, LINEARS, dequantize, is_linear, layer_type, pad_quantize, write_iquant_gguf

MODEL = "smollm2-135m"
HF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def hf_name(tensor: str) -> str:
    """``blk.N.attn_q.weight`` → ``model.layers.N.self_attn.q_proj``."""
    _, n, kind, _ = tensor.split(".")
    return f"model.layers.{n}.{HF_LINEARS[kind]}"


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q/k projection in llama.cpp's order (each head's rotary halves interleaved) back in
    Hugging Face's: the inverse of ``bench.latq_gguf.permute_rows``."""
    n = w.shape[0]
    return w.reshape(heads, n // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def heads_of(tensor: str, config) -> int | None:
    kind = tensor.split(".")[2]
    return {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(kind)


# ----------------------------------------------------------------------------- source and imatrix

def source_weights(gguf_path: Path) -> dict[str, np.ndarray]:
    """Each block linear of the shipped GGUF dequantized (gguf's numpy, fp32) and rounded to bf16 —
    latq's source values — in llama.cpp's row order, fp32 arrays."""
    import gguf
    r = gguf.GGUFReader(str(gguf_path))
    out = {}
    for t in r.tensors:
        if is_linear(t.name):
            x = gguf.quants.dequantize(t.data, t.tensor_type)
            out[t.name] = torch.from_numpy(np.ascontiguousarray(x)).bfloat16().float().numpy()
    return out


def check_source(weights: dict[str, np.ndarray], model) -> None:
    """The source is the study's: each linear, back in HF's row order, equals the bf16 reference
    directory's weight exactly (fails on another source or a wrong row order)."""
    sd = model.state_dict()
    for t, x in weights.items():
        h = heads_of(t, model.config)
        y = unpermute_rows(x, h) if h else x
        ref = sd[hf_name(t) + ".weight"].float().numpy()
        if ref.shape != y.shape or not np.array_equal(ref, y):
            raise SystemExit(f"iquant bench: {t} is not the reference directory's {hf_name(t)} "
                             f"(max |Δ| {np.abs(ref - y).max() if ref.shape == y.shape else 'shape'})")


@torch.no_grad()
def imatrix(model, tokenizer, nsamples: int, seqlen: int, seed: int, cache: Path) -> dict[str, np.ndarray]:
    """Per block linear (GGUF name): the mean of x² over the calibration tokens of each input column,
    as llama.cpp's ``imatrix`` collects it, the model run in fp32 on latq's calibration batches
    (``vllm_latq.data.calibration_batches``). Cached in ``cache`` (an .npz)."""
    from vllm_latq.data import calibration_batches

    if cache.is_file():
        with np.load(cache) as z:
            return {k: z[k] for k in z.files}
    batches = calibration_batches(tokenizer, nsamples=nsamples, seqlen=seqlen, seed=seed)
    sums, counts, handles = {}, {}, []
    for i, layer in enumerate(model.model.layers):
        for kind, path in HF_LINEARS.items():
            mod = layer.get_submodule(path)
            key = f"blk.{i}.{kind}.weight"
            sums[key], counts[key] = torch.zeros(mod.in_features, dtype=torch.float64), 0

            def hook(m, args, key=key):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sums[key].add_((x * x).sum(0))
                counts[key] += x.shape[0]
            handles.append(mod.register_forward_pre_hook(hook))

    class Stop(Exception):
        pass

    def stop(*_):
        raise Stop
    handles.append(model.model.norm.register_forward_hook(stop))   # the head adds nothing to the imatrix
    t0 = time.time()
    try:
        for j, seq in enumerate(batches):
            try:
                model(input_ids=seq[None])
            except Stop:
                pass
            if (j + 1) % 16 == 0:
                print(f"[iquant] imatrix {j + 1}/{len(batches)} sequences, {time.time() - t0:.0f} s",
                      file=sys.stderr, flush=True)
    finally:
        for h in handles:
            h.remove()
    out = {k: (sums[k] / counts[k]).float().numpy() for k in sums}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.stem + f".{os.getpid()}.tmp.npz")
    np.savez(tmp, **out)
    os.replace(tmp, cache)
    return out


# ----------------------------------------------------------------------------- the variants

def linear_bits(path: Path) -> tuple[float, dict[str, int]]:
    """(bits/weight over the block linears as stored, {type: weights in it}) of a GGUF."""
    import gguf
    r = gguf.GGUFReader(str(path))
    nbytes, n, kinds = 0, 0, {}
    for t in r.tensors:
        if is_linear(t.name):
            nbytes, n = nbytes + int(t.n_bytes), n + int(t.n_elements)
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + int(t.n_elements)
    return nbytes * 8 / n, kinds


def file_weights(path: Path) -> dict[str, np.ndarray]:
    """Each block linear of a GGUF dequantized by gguf's numpy code (fp32, llama.cpp's row order)."""
    import gguf
    r = gguf.GGUFReader(str(path))
    return {t.name: np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type))
            for t in r.tensors if is_linear(t.name)}


def pure_weights(ggml: GGML, name: str, weights: dict, imat: dict, from_file: dict) -> dict[str, np.ndarray]:
    """Every block linear in ``name`` itself, dequantized: the file's values where its rows are whole
    blocks (the same quantization), else :func:`iquant_gguf.pad_quantize`'s emulation."""
    return {t: from_file[t] if layer_type(ggml, name, w.shape[1]) == name else pad_quantize(ggml, name, w, imat[t])
            for t, w in weights.items()}


def set_linears(model, values: dict[str, np.ndarray]) -> None:
    """Put dequantized linears (GGUF names, llama.cpp's row order) into the HF model, in HF's order."""
    with torch.no_grad():
        for t, x in values.items():
            h = heads_of(t, model.config)
            w = model.get_submodule(hf_name(t)).weight
            w.copy_(torch.from_numpy(unpermute_rows(x, h) if h else x))


def ppl(model, windows) -> dict:
    from vllm_latq.data import perplexity
    t0 = time.time()
    r = perplexity(model, windows, batch_size=4, progress=False)
    r["seconds"] = round(time.time() - t0, 1)
    return r


# ----------------------------------------------------------------------------- decode

def llamacpp_features(info: str) -> list[str]:
    """The instruction sets and features a llama.cpp build reports (``llama_print_system_info``:
    ``CPU : SSE3 = 1 | AVX2 = 1 | …``) that are on."""
    out = []
    for part in info.split("|"):
        key, _, val = part.rpartition("=")
        if val.strip() == "1":
            out.append(key.split(":")[-1].strip())
    return out


def decode_rounds(ggufs: dict[str, Path], threads: int, tokens: int, repeats: int) -> dict[str, dict]:
    """llama.cpp on each GGUF (the first the reference), ``threads`` threads on the first cores this
    process may use, batch 1, interleaved rounds (``bench/decode_engines.run_mode``) → label → run record."""
    from bench.decode_engines import run_mode
    cores = sorted(os.sched_getaffinity(0))[:threads]
    jobs = [{"label": label, "model": str(p), "gguf": str(p), "kernel": "llamacpp", "dtype": "gguf", "peer": True,
             "mode": "eager", "batches": [1], "threads": threads, "cores": cores, "tokens": tokens,
             "repeats": repeats} for label, p in ggufs.items()]
    return {r["label"]: r for r in run_mode(jobs, dict(os.environ), repeats)}


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="IQ3_S,IQ3_XXS,IQ2_XS", help="llama.cpp types, comma list (IQ3_S first: "
                    "the main peer)")
    ap.add_argument("--no-pure", action="store_true", help="skip the emulated all-linears rows")
    ap.add_argument("--no-baseline", action="store_true", help="skip the bf16 source's perplexity")
    ap.add_argument("--no-decode", action="store_true", help="skip llama.cpp's decode timing")
    ap.add_argument("--no-ppl", action="store_true", help="skip every perplexity")
    ap.add_argument("--nsamples", type=int, default=128, help="calibration sequences for the imatrix")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--nwindows", type=int, default=64, help="perplexity windows (the protocol: 64)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's threads (and torch's)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens a decode run")
    ap.add_argument("--repeats", type=int, default=5, help="decode rounds")
    ap.add_argument("--reuse-files", action="store_true", help="use a GGUF this bench wrote before in --workdir "
                    "(same type, imatrix and source) instead of quantizing again")
    ap.add_argument("--workdir", default=None, help="where the GGUFs and the imatrix go (default: the cache)")
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from vllm_latq.data import MODELS, cache_dir, eval_windows, load_tokenizer, model_dir

    torch.set_num_threads(a.threads)
    types = [t.strip().upper() for t in a.types.split(",") if t.strip()]
    work = Path(a.workdir) if a.workdir else cache_dir() / "iquant"
    work.mkdir(parents=True, exist_ok=True)
    ggml = GGML()
    import xllamacpp
    from vllm_latq import cpu_features
    llfeat = llamacpp_features(xllamacpp.get_system_info())
    llisa = "AVX512" if any(f.startswith("AVX512") for f in llfeat) else "AVX2" if "AVX2" in llfeat else "none"
    cpu, cpu_hw = cpu_features.capability(), cpu_features.hardware_capability()
    load0 = os.getloadavg()[0]
    print(f"[iquant] {cpu_features.describe()}; llama.cpp (xllamacpp {getattr(xllamacpp, '__version__', '?')}) "
          f"built for {' '.join(llfeat)}; load average {load0:.1f}", file=sys.stderr)
    shipped = MODELS[MODEL].gguf()
    d = model_dir(MODEL, progress=False)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = load_tokenizer(d)
    weights = source_weights(shipped)
    check_source(weights, model)
    imat_file = work / f"imatrix-{MODEL}-{a.nsamples}x{a.seqlen}-s0.npz"
    imat = imatrix(model, tok, a.nsamples, a.seqlen, 0, imat_file)
    windows = None if a.no_ppl else eval_windows(tok, seqlen=a.seqlen, nwindows=a.nwindows)

    rows, head = [], {"cpu": cpu, "cpu_hw": cpu_hw, "llamacpp_isa": llisa}
    q41_bits, _ = linear_bits(shipped)
    head["q4_1_bits"] = f"{q41_bits:.3f}"
    if windows is not None and not a.no_baseline:
        r = ppl(model, windows)     # the source untouched: the study's bf16 row
        rows.append({"row": "source (bf16 of the shipped Q4_1)", "bits": 16.0, "ppl": r["ppl"], "r": r})
        head["source_ppl"] = f"{r['ppl']:.2f}"
    rows.append({"row": "Q4_1 (shipped; its linears)", "bits": q41_bits, "ppl": None, "file": shipped})
    files = {"Q4_1": shipped}
    for name in types:
        out = work / f"{MODEL}-{name}.gguf"
        made = {"type": name, "imatrix": imat_file.name, "source": str(shipped)}
        side = out.with_suffix(".json")
        t0 = time.time()
        if a.reuse_files and out.is_file() and side.is_file() and json.loads(side.read_text()) == made:
            what = "reused"
        else:
            side.unlink(missing_ok=True)
            write_iquant_gguf(shipped, out, name, weights, imat, ggml)
            side.write_text(json.dumps(made) + "\n")
            what = "wrote"
        bits, kinds = linear_bits(out)
        mix = ", ".join(f"{k} {100 * v / sum(kinds.values()):.0f} %" for k, v in sorted(kinds.items()))
        print(f"[iquant] {what} {out} in {time.time() - t0:.0f} s: linears {mix}, {bits:.3f} bits/weight",
              file=sys.stderr, flush=True)
        files[name] = out
        row = {"row": f"{name} (llama.cpp file: {mix})", "bits": bits, "ppl": None, "file": out, "type": name}
        head[f"{name}_bits"] = f"{bits:.3f}"
        vals = file_weights(out) if windows is not None else None
        if vals is not None:
            set_linears(model, vals)
            row["r"] = ppl(model, windows)
            row["ppl"] = row["r"]["ppl"]
            head[f"{name}_ppl"] = f"{row['ppl']:.2f}"
            print(f"[iquant] {name}: ppl {row['ppl']:.3f} ({row['r']['seconds']} s)", file=sys.stderr, flush=True)
        rows.append(row)
        if vals is not None and not a.no_pure:
            set_linears(model, pure_weights(ggml, name, weights, imat, vals))
            r = ppl(model, windows)
            pb = ggml.bits(name)
            rows.append({"row": f"{name}-pure (every linear {name}; emulated, no llama.cpp file)", "bits": pb,
                         "ppl": r["ppl"], "r": r})
            head[f"{name}_pure_bits"], head[f"{name}_pure_ppl"] = f"{pb:.3f}", f"{r['ppl']:.2f}"
            print(f"[iquant] {name}-pure: ppl {r['ppl']:.3f} ({r['seconds']} s)", file=sys.stderr, flush=True)
    if windows is not None:
        head["windows"], head["tokens"] = len(windows), len(windows) * (windows.shape[1] - 1)

    dec = {}
    if not a.no_decode:
        dec = decode_rounds(files, a.threads, a.tokens, a.repeats)
        for label, r in dec.items():
            if "error" in r:
                print(f"[iquant] llama.cpp on {label}: {r['error']}", file=sys.stderr)
                continue
            run = r["runs"]["1"]
            key = label.lower()
            head[f"{key}_tok_s"] = f"{run['tok_s']:.1f}"
            if "paired_ratio" in run and label != "Q4_1":
                head[f"{key}_vs_q4_1"] = f"{run['paired_ratio']:.2f}"

    print(f"\nSmolLM2-135M, llama.cpp's quantizer on the bf16 of the shipped Q4_1 (imatrix: {a.nsamples} x {a.seqlen} "
          f"calibration tokens of latq's split); torch on {cpu_features.describe()}, llama.cpp's build {llisa} "
          f"({' '.join(llfeat)}), {a.threads} thread(s); load average {load0:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    if windows is not None:
        print(f"perplexity: {len(windows)} windows x {windows.shape[1]} tokens, {head['tokens']} predicted\n")
    print("| row | bits/w (linears) | ppl | tok/s median (llama.cpp, batch 1) | tok/s best run | vs Q4_1 (paired) "
          "| MB/token |")
    print("|---|---|---|---|---|---|---|")
    from bench.decode_peer import gguf_bytes
    for row in rows:
        label = next((k for k, p in files.items() if row.get("file") == p), None)
        r = dec.get(label, {}) if label else {}
        run = r.get("runs", {}).get("1", {})
        tok_s = f"{run['tok_s']:.1f}" if run else ""
        best = f"{a.tokens / min(run['times']):.1f}" if run else ""
        ratio = (f"{run['paired_ratio']:.2f}× ({run['paired_range'][0]:.2f}–{run['paired_range'][1]:.2f})"
                 if run.get("paired_ratio") is not None and label != "Q4_1" else "")
        mb = f"{gguf_bytes(row['file'])[0] / 1e6:.1f}" if row.get("file") else ""
        p = f"{row['ppl']:.2f}" if row.get("ppl") is not None else ""
        print(f"| {row['row']} | {row['bits']:.3f} | {p} | {tok_s} | {best} | {ratio} | {mb} |")
    print("\nHEADLINE " + " ".join(f"{k}={v}" for k, v in head.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
