"""Peak memory and time of ``latq-quantize`` at the size people run: a synthetic model with
Llama-3-8B shapes (hidden 4096, intermediate 14336, 32 layers, 32 query / 8 KV heads, vocab
128256, bf16, random weights) quantized with RTN end to end and with SSQR for its first
blocks (``stop_after_block``); ``--shape moe``: mixture-of-experts blocks with Qwen3-30B-A3B's
shapes (hidden 2048, 128 experts × intermediate 768, top-8, 32 query / 4 KV heads of 128,
vocab 151936), two of them by default.

    python -m bench.memory                                   # the 8B shapes (writes ~16 GB once)
    python -m bench.memory --nsamples 16 --seqlen 2048 --ssqr-blocks 2
    python -m bench.memory --shape moe --nsamples 8 --seqlen 2048 --ssqr-blocks 1
    python -m bench.memory --shape small --layers 4          # a quick run (seconds)
    python -m bench.memory --max-activation-memory 0         # calibration activations spilled to disk

The model is written once under ``cache_dir()/bench`` (``--model-dir`` elsewhere) and reused
(:func:`write_model`); each quantization runs in its own process, which reports its peak RSS
(``VmHWM``) after the last block and at the end, and the seconds of every block (:func:`child`).
Printed next to them: the model's size, one block's working set and the target (:func:`sizes`).
The last line is ``HEADLINE key=value ...``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
SHARD_BYTES = 2 * GiB  # source shards of at most this size (HF writes ~5 GB ones)
POOL = 1 << 24  # random values the weights are tiled from
SHAPES = {  # the 8B's, Llama-3.2-1B's (the decode bench's --synthetic), a tiny one (tests), a small one whose
    # block dwarfs the RSS noise, and a Qwen3-30B-A3B-like MoE
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
               rms_norm_eps=1e-5),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
               max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "moe": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=2,
                num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                rope_theta=1000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                     num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=49152,
                     max_position_embeddings=4096, rms_norm_eps=1e-6),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
COMPLETE = "latq_bench_model.json"  # written last: the directory is complete


def model_config(shape: str, layers: int | None) -> dict:
    cfg = {"tie_word_embeddings": False, **SHAPES[shape], "torch_dtype": "bfloat16", "hidden_act": "silu"}
    cfg.setdefault("model_type", "llama")
    cfg["architectures"] = [ARCHITECTURES[cfg["model_type"]]]
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def checkpoint_shapes(cfg: dict) -> dict:
    """Tensor name → shape as a Hugging Face checkpoint of config ``cfg`` stores it, in the
    model's order: where the model fuses its experts, one tensor per expert and projection."""
    import torch

    from vllm_latq import hf_model
    model = hf_model.empty_model(hf_model.hf_config(cfg), torch.bfloat16)
    names = hf_model.checkpoint_names(model)
    shapes = {}
    for n, t in model.state_dict().items():
        experts = names.of_param(n)
        if not experts:
            shapes[names.original.get(n, n)] = t.shape
        for name, x in sorted(experts.items(), key=lambda kv: (kv[1].expert, kv[1].rows.start)):
            shapes[f"{name}.weight"] = torch.Size([x.rows.stop - x.rows.start, t.shape[2]])
    if cfg.get("tie_word_embeddings"):   # the head is the embedding: not stored twice, as HF saves it
        shapes.pop("lm_head.weight", None)
    return shapes


def write_model(out: Path, cfg: dict) -> Path:
    """Random bf16 weights for config ``cfg`` as an HF directory (reused when complete):
    matrices tiled from one pool of N(0, 0.02²) values at a random offset each (drawing 8·10⁹
    fresh normals would take this 2-core machine longer than quantizing them; the values do
    not matter to memory and time), norms at one.

    Written as sharded bf16 safetensors (HF layout — experts one tensor per expert and
    projection, as the hub's MoE checkpoints —, config.json, SmolLM2's tokenizer: its ids fit
    the larger vocabulary)."""
    import torch
    from safetensors.torch import save_file

    from vllm_latq import data
    from vllm_latq.format import writer

    if (out / COMPLETE).is_file() and json.loads((out / COMPLETE).read_text()) == cfg:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tok_dir = data.model_dir("smollm2-135m")
    tok = json.loads((tok_dir / "config.json").read_text())
    writer.write_json(out / "config.json", dict(cfg, bos_token_id=tok["bos_token_id"], eos_token_id=tok["eos_token_id"]))
    writer.copy_aux_files(tok_dir, out)
    shapes = checkpoint_shapes(cfg)
    groups, size = [[]], 0
    for n, s in shapes.items():
        if groups[-1] and size + 2 * s.numel() > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += 2 * s.numel()
    names = [writer.shard_name(i, len(groups)) for i in range(len(groups))]
    g = torch.Generator().manual_seed(0)
    pool = torch.empty(POOL, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    t0 = time.time()
    for name, group in zip(names, groups):
        tensors = {}
        for n in group:
            if len(shapes[n]) == 1:
                tensors[n] = torch.ones(shapes[n], dtype=torch.bfloat16)
                continue
            flat = pool.roll(int(torch.randint(POOL, (1,), generator=g))).repeat(-(-shapes[n].numel() // POOL))
            tensors[n] = flat[:shapes[n].numel()].reshape(shapes[n])
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        print(f"wrote {out / name} ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    writer.write_index(out, names)
    writer.write_json(out / COMPLETE, cfg)
    return out


def sizes(cfg: dict, nsamples: int, seqlen: int) -> dict:
    """Bytes of the model and of one block's weights (bf16), of its Hessians (fp64; q/k/v and
    gate/up share one; of a mixture, one expert's two and the all-token two a blend reads,
    experts being solved one at a time) and of the calibration activations (bf16; a mixture
    also keeps its experts' inputs: two copies).

    The target printed beside the measurements: twice the block's weights and Hessians, plus
    the activations held in memory."""
    shapes = checkpoint_shapes(cfg)
    block0 = sum(s.numel() for n, s in shapes.items() if ".layers.0." in n)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    q = heads * cfg.get("head_dim", h // heads)
    mlp = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    hessians = 2 * h * h + q * q + mlp * mlp
    copies = 1
    if cfg.get("num_experts"):
        hessians += h * h + mlp * mlp
        copies = 2
    return {"model": 2 * sum(s.numel() for s in shapes.values()), "block_weights": 2 * block0,
            "block_hessians": 8 * hessians, "activations": 2 * copies * nsamples * seqlen * h}


def vm_hwm() -> int:
    """Peak resident set of this process (bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(spec: dict) -> dict:
    """One quantization (in a fresh process) → its peak RSS and seconds per block.

    The peak RSS is ``VmHWM`` of ``/proc/self/status`` (resident memory, memory-mapped file
    pages included), read after the last block and at the end (the tail writes embeddings and
    head and validates the checkpoint)."""
    from vllm_latq.commands.quantize import setup_logging
    from vllm_latq.quantize.pipeline import QuantizeOptions, SimulatedInterruption, quantize_model

    if spec["verbose"]:
        setup_logging()
    spill = _SpillSeen()
    logging.getLogger("vllm_latq").addHandler(spill)
    logging.getLogger("vllm_latq").setLevel(logging.INFO)
    blocks, peak_blocks = [], 0

    def on_block(i, seconds):
        nonlocal peak_blocks
        blocks.append(seconds)
        peak_blocks = vm_hwm()
        print(f"{spec['method']}: block {i} in {seconds:.1f}s, peak RSS so far {peak_blocks / GiB:.2f} GiB",
              file=sys.stderr, flush=True)

    opts = QuantizeOptions(method=spec["method"], nsamples=spec["nsamples"], seqlen=spec["seqlen"],
                           max_activation_memory=spec["max_activation_memory"],
                           target_correction=spec.get("target_correction", False))
    t0 = time.time()
    try:
        quantize_model(spec["model"], spec["out"], opts, progress=False, on_block=on_block,
                       stop_after_block=spec["stop_after_block"])
    except SimulatedInterruption:
        pass
    return {"peak_rss": vm_hwm(), "peak_rss_blocks": peak_blocks, "block_seconds": blocks,
            "seconds": time.time() - t0, "spilled": spill.seen}


class _SpillSeen(logging.Handler):
    """Notes the pipeline's log line that says the activations are spilled to disk."""
    seen = False

    def emit(self, record):
        self.seen = self.seen or "spilling" in record.getMessage()


def run(spec: dict) -> dict:
    """:func:`child` in a subprocess (its own peak RSS)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "bench.memory", "--child", json.dumps(spec)], cwd=ROOT, env=env,
                       stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{spec['method']} run failed (exit {p.returncode})")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--layers", type=int, default=None, help="decoder blocks (default: the shape's)")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--ssqr-blocks", type=int, default=2, help="SSQR stops after this many blocks (0: no SSQR run)")
    ap.add_argument("--no-rtn", action="store_true", help="skip the RTN run")
    ap.add_argument("--target-correction", action="store_true",
                    help="the SSQR run with --target-correction (a full-precision activation stream and a "
                         "cross-covariance per Hessian besides: both count twice in its target)")
    ap.add_argument("--max-activation-memory", default="auto", help="as latq-quantize's (e.g. 0: always spill)")
    ap.add_argument("--model-dir", type=Path, default=None, help="where the synthetic model is (written once)")
    ap.add_argument("-v", "--verbose", action="store_true", help="the pipeline's log")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    from vllm_latq import data
    from vllm_latq.commands.quantize import _size

    cfg = model_config(a.shape, a.layers)
    L = cfg["num_hidden_layers"]
    model = write_model(a.model_dir or data.cache_dir() / "bench" / f"{cfg['model_type']}-{a.shape}-{L}L", cfg)
    sz = sizes(cfg, a.nsamples, a.seqlen)
    budget = _size(a.max_activation_memory)
    print(f"model {model}: {L} blocks, {sz['model'] / GiB:.2f} GiB; one block: weights "
          f"{sz['block_weights'] / GiB:.3f} GiB, Hessians {sz['block_hessians'] / GiB:.3f} GiB, activations "
          f"{a.nsamples}x{a.seqlen} {sz['activations'] / GiB:.3f} GiB")
    head = {"shape": a.shape, "layers": L, "target_correction": int(a.target_correction), "model_gib": sz["model"] / GiB,
            "block_ws_gib": (sz["block_weights"] + sz["block_hessians"] + sz["activations"]) / GiB,
            "acts_gib": sz["activations"] / GiB, "nsamples": a.nsamples, "seqlen": a.seqlen}
    runs = [("rtn", None)] * (not a.no_rtn) + [("ssqr", a.ssqr_blocks - 1)] * (a.ssqr_blocks > 0)
    with tempfile.TemporaryDirectory(dir=model.parent, prefix="out-") as tmp:
        for method, stop in runs:
            spec = {"model": str(model), "out": f"{tmp}/{method}", "method": method, "nsamples": a.nsamples,
                    "seqlen": a.seqlen, "max_activation_memory": budget, "stop_after_block": stop,
                    "verbose": a.verbose, "target_correction": a.target_correction and method != "rtn"}
            r = run(spec)
            shutil.rmtree(spec["out"], ignore_errors=True)
            shutil.rmtree(spec["out"] + ".tmp-latq", ignore_errors=True)
            streams = 1 + spec["target_correction"]   # target correction: X̃ and X, H̃ and X̃ᵀX
            acts_in_ram = streams * sz["activations"] if method != "rtn" and not r["spilled"] else 0
            target = 2 * (sz["block_weights"] + streams * sz["block_hessians"] * (method != "rtn")) + acts_in_ram
            per_block = sorted(r["block_seconds"])[len(r["block_seconds"]) // 2]
            print(f"{method}: {len(r['block_seconds'])} blocks, {per_block:.1f} s/block (median), peak RSS "
                  f"{r['peak_rss'] / GiB:.2f} GiB ({r['peak_rss_blocks'] / GiB:.2f} GiB up to the last block), "
                  f"target {target / GiB:.2f} GiB, activations {'on disk' if r['spilled'] else 'in memory'}, "
                  f"{r['seconds']:.0f} s in all")
            head.update({f"{method}_peak_rss_gib": r["peak_rss"] / GiB,
                         f"{method}_peak_rss_blocks_gib": r["peak_rss_blocks"] / GiB,
                         f"{method}_s_per_block": per_block, f"{method}_blocks": len(r["block_seconds"]),
                         f"{method}_target_gib": target / GiB, f"{method}_spilled": int(r["spilled"])})
    print("HEADLINE " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in head.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
