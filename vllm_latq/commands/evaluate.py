"""``latq-eval MODEL_OR_CKPT``: perplexity by the shared protocol, as a table (``--json``: one JSON object).

The Wikipedia eval split, or ``--text FILE`` read as ``latq-quantize --calib`` reads it; a
checkpoint is validated and dequantized by the format's reference (no kernels), in fp32.
``--compare SOURCE`` measures a second model on the same windows, side by side."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

EXAMPLES = """examples:
  latq-eval gemma3-270m                 # the bf16 reference model
  latq-eval OUT --compare smollm2-135m  # a checkpoint beside the model it was made from
  latq-eval ckpt/gemma-ssqr --output ssqr.json
  latq-eval ckpt/gemma-ssqr --text my_docs.jsonl --nwindows 16
"""


def load_for_eval(model: str, device: str = "cpu", verify: bool = True, expect_digest: str | None = None,
                  progress: bool = True):
    """(model, tokenizer, info) of a checkpoint (verified unless not ``verify``) or any model source."""
    from transformers import AutoModelForCausalLM

    from .. import data, hf_model
    from ..format.checkpoint import is_latq_checkpoint, load_dequantized_model
    from ..format.validate import validate_checkpoint
    from ..progress import step
    from ..quantize.source import resolve_model

    if is_latq_checkpoint(model):
        report = validate_checkpoint(model, decode=False, verify_checksums=verify, expect_digest=expect_digest,
                                     progress=progress)
        if report["unsealed"]:
            print(f"latq-eval: {model}: not sealed, read by no loader: {', '.join(report['unsealed'])}",
                  file=sys.stderr)
        spec, ck = report["spec"], report["checkpoint"]   # read what was verified, from the files it opened
        m = load_dequantized_model(ck, torch.float32, device, progress=progress)
        tok = verified_tokenizer(ck, model)
        info = {"method": spec.method, "bits": report["totals"]["bits_per_weight"],
                "outlier_rate": report["totals"]["outlier_rate"],
                "budget": spec.outlier_rate if spec.method == "ssqr" else spec.target_bits,
                "quantized_params": report["totals"]["quantized_params"]}
        return m, tok, info
    if expect_digest is not None:
        raise ValueError(f"{model} is not a latq checkpoint: --expect-digest pins a latq checkpoint's manifest")
    d = resolve_model(model, progress)
    dtype = hf_model.model_dtype(hf_model.config_dict(d))
    with step(f"loading {d} in float32", progress, bar=False):   # transformers draws the terminal's bar
        m, loading = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    tied = getattr(m, "_tied_weights_keys", None) or ()   # a tied head is filled from the embedding
    missing = [k for k in loading["missing_keys"] if k not in tied]
    if missing:   # transformers would initialise them at random: a perplexity of nothing
        raise ValueError(f"{d}: {len(missing)} weights of the model are not in its files ({missing[:3]}...); a latq "
                         "checkpoint needs its config.json quantization_config")
    m = m.to(device).eval()
    tok = data.load_tokenizer(d)
    bits = {"bfloat16": 16, "float16": 16, "float32": 32}.get(dtype)
    return m, tok, {"method": {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype),
                    "bits": bits}


def verified_tokenizer(ck, model: str):
    """The tokenizer of checkpoint ``ck``, from the bytes it verified (in a private directory)."""
    import tempfile

    from .. import data
    with tempfile.TemporaryDirectory(prefix="latq-eval-tokenizer-") as tmp:
        ck.write_aux_files(Path(tmp))
        (Path(tmp) / "config.json").write_text(json.dumps(ck.config))   # its model type picks the tokenizer class
        try:
            return data.load_tokenizer(tmp)
        except ValueError as e:
            raise ValueError(str(e).replace(tmp, str(model))) from None


def evaluate(model: str, *, text: str = "wiki", seqlen: int = 512, nwindows: int = 64, batch_size: int = 4,
             device: str = "cpu", progress: bool = True, verify: bool = True,
             expect_digest: str | None = None) -> dict:
    """Perplexity of ``model`` on ``text`` ("wiki" or a .txt / .jsonl file) → result dict."""
    from .. import cpu_features, data
    from ..model_config import check_positions

    t0 = time.time()
    device = str(cpu_features.compute_device(device))
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    docs = data.read_documents(text, "eval")  # a bad file fails before the model loads
    source = data.source_record(text, "eval")
    with data.hf_progress_bars(progress):  # loading, and converting a .gguf source
        m, tok, info = load_for_eval(model, device, verify, expect_digest, progress)
    check_positions(m.config, seqlen, "--seqlen", model)
    windows = data.eval_windows(tok, seqlen=seqlen, nwindows=nwindows, docs=docs)
    data.check_vocabulary(windows, m.get_input_embeddings().num_embeddings, tok)
    r = data.perplexity(m, windows, batch_size=batch_size, progress=progress)
    return {"model": str(model), **info, "text": source, "ppl": r["ppl"], "nll": r["nll"],
            "windows": r["windows"], "tokens": r["tokens"], "seqlen": seqlen, "compute_dtype": "float32",
            "seconds": round(time.time() - t0, 1)}


def table(r: dict) -> str:
    """The result (and its ``compare`` row) as the lines a person reads: each model's method, bits a
    weight (a checkpoint's quantized linears, as stored) and perplexity, the change against the second."""
    rows = [r] + ([r["compare"]] if "compare" in r else [])
    width = max(len(x["model"]) for x in rows)
    lines = [f"{'model':<{width}}  {'method':<6}  {'bits/w':>7}  {'perplexity':>10}"]
    for x in rows:
        bits = x["bits"] if isinstance(x["bits"], int) or x["bits"] is None else f"{x['bits']:.4f}"
        lines.append(f"{x['model']:<{width}}  {x['method']:<6}  {bits if bits is not None else '—':>7}  {x['ppl']:>10.3f}")
    if "compare" in r:
        lines.append(f"perplexity {100 * (r['ppl'] / r['compare']['ppl'] - 1):+.2f} % against {r['compare']['model']}")
    text = r["text"].get("source") or r["text"].get("path")
    lines.append(f"{r['windows']} windows of {r['seqlen']} tokens of {text} ({r['tokens']} predicted), fp32, "
                 f"{r['seconds'] + r.get('compare', {}).get('seconds', 0):.0f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    from ..errors import COMMAND_HEADROOM, limits
    from ..format import FormatError, writer
    from .environment import bad_environment

    ap = argparse.ArgumentParser(prog="latq-eval", description=__doc__, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="latq checkpoint, HF directory, .gguf file, or gemma3-270m / smollm2-135m")
    ap.add_argument("--text", default="wiki", metavar="FILE",
                    help="'wiki' (default: the Wikipedia eval split) or a .txt / .jsonl file, read as --calib reads it")
    ap.add_argument("--seqlen", type=int, default=512, help="tokens per window (default 512)")
    ap.add_argument("--nwindows", type=int, default=64, help="at most this many consecutive windows (default 64)")
    ap.add_argument("--compare", metavar="MODEL",
                    help="also measure MODEL (e.g. the source the checkpoint was made from) on the same windows and "
                         "print the change in perplexity")
    ap.add_argument("--batch-size", type=int, default=4, help="windows a forward pass (default 4; memory, not the result)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object instead of a table")
    ap.add_argument("--output", help="also write the result's JSON here")
    ap.add_argument("--no-progress", action="store_true",
                    help="say nothing while verifying, loading and measuring (else bars on a terminal, a line per "
                         "step on stderr otherwise)")
    ap.add_argument("--expect-digest", metavar="SHA256",
                    help="refuse the checkpoint unless its manifest has this digest (what latq-quantize printed)")
    ap.add_argument("--no-verify", action="store_true",
                    help="skip a latq checkpoint's sha256 checks (tensors, every file against latq_manifest.json): "
                         "for a checkpoint edited on purpose; shapes and values are checked all the same")
    a = ap.parse_args(argv)
    if bad_environment("latq-eval"):
        return 2
    if a.no_verify:
        from ..format.manifest import SKIPPED
        print(f"latq-eval: --no-verify: {SKIPPED}", file=sys.stderr)
    if not a.device.startswith("cuda"):
        from ..threads import fit_to_idle_cores
        fit_to_idle_cores("latq-eval: evaluating", say=lambda line: print(line, file=sys.stderr))
    try:
        if a.output:   # a folder missing, read-only or full is refused now, not after the evaluation
            writer.check_writable(a.output, "--output")
        with limits(f"evaluating {a.model}", need=COMMAND_HEADROOM):
            kw = dict(text=a.text, seqlen=a.seqlen, nwindows=a.nwindows, batch_size=a.batch_size, device=a.device,
                      progress=not a.no_progress, verify=not a.no_verify)
            r = evaluate(a.model, expect_digest=a.expect_digest, **kw)
            if a.compare:
                r["compare"] = evaluate(a.compare, **kw)
    except FormatError as e:
        print(f"latq-eval: invalid checkpoint {a.model}: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError, ModuleNotFoundError) as e:
        print(f"latq-eval: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(r, indent=2)
    print(text if a.json else table(r), flush=True)
    if a.output:
        try:
            writer.write_text(a.output, text + "\n")
        except OSError as e:
            print(f"latq-eval: error: {e}; the result is printed above", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
