"""Helpers for the vLLM plugin tests: tiny models, latq checkpoints, HF reference greedy
decoding on the dequantized checkpoint, and vLLM runs in a subprocess (one engine per
process: vLLM keeps global distributed state)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm_latq import format as fmt
from vllm_latq.format.manifest import write_manifest
from vllm_latq.testing.checkpoints import write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")

# Fast, deterministic vLLM in one process (see DEVELOPERS notes in the plugin issue).
FAST_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1",
            "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"}

PROMPTS = ["The capital of France is", "Photosynthesis is the process by which",
           "In 1969, the first humans", "def fibonacci(n):"]


def smollm2_dir() -> Path:
    from vllm_latq.data import model_dir
    return model_dir("smollm2-135m")


def make_tiny_llama(out: Path, *, hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=160, layers=2,
                    seed=0, tokenizer_dir: Path | None = None, vocab_size: int | None = None) -> Path:
    """A random-weight Llama (fp32 safetensors) using SmolLM2's tokenizer. Defaults make TP=2
    cut down_proj's input (160 → 80 per rank) off the 32-column tiles and off 32-groups, and
    replicate the single k/v head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_dir = Path(tokenizer_dir or smollm2_dir())
    tok_cfg = json.loads((tokenizer_dir / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=vocab_size or tok_cfg["vocab_size"], hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=tok_cfg.get("bos_token_id"), eos_token_id=tok_cfg.get("eos_token_id"),
                      pad_token_id=tok_cfg.get("pad_token_id"), rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                # large enough that greedy output varies from token to token
                p.normal_(0, 2.0 / p.shape[1] ** 0.5 if p.shape[0] != cfg.vocab_size else 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists() and f != "generation_config.json":
            shutil.copy(tokenizer_dir / f, out / f)
    return out


def _hessian(W_in: int, mode: str, seed: int) -> torch.Tensor:
    if mode == "identity":
        return torch.eye(W_in)
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(4 * W_in, W_in, generator=g) * (0.2 + torch.rand(W_in, generator=g))
    return X.T @ X


def quantize_dir(src: Path, out: Path, method: str = "ssqr", *, bits: int = 4, group_size: int = 32,
                 outlier_rate: float = 0.01, target_bits: float = 3.25, hessian: str = "random",
                 skip: tuple[str, ...] = (), scale_bits: int | None = None) -> Path:
    """Quantize every decoder linear of an HF model directory (one safetensors file) and
    write a latq checkpoint (format version 1) as the pipeline does (checksums, stats,
    manifest). ``hessian``: ``random`` (a synthetic
    full-rank Hessian, exercises error propagation and outliers) or ``identity``;
    ``scale_bits``: rtn's group scales coded (format/scale_codes.py)."""
    from vllm_latq.algorithms import hptq, hrtn, rtn, ssqr

    files = sorted(src.glob("*.safetensors"))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    out.mkdir(parents=True, exist_ok=True)
    new: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, int]] = {}
    kind = fmt.kind_of(method)
    for i, (name, t) in enumerate(sorted(sd.items())):
        module = name[: -len(".weight")]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS and module not in skip:
            W = t.float()
            H = _hessian(W.shape[1], hessian, i)
            if method == "ssqr":
                res = ssqr(W, H, bits=bits, group_size=group_size, outlier_rate=outlier_rate, name=module)
            elif method == "rtn":
                res = rtn(W, bits=bits, group_size=group_size, scale_bits=scale_bits)
            elif method == "hptq":
                res = hptq(W, H, target_bits=target_bits, name=module)
            elif method == "hrtn":
                res = hrtn(W, target_bits=target_bits)
            else:
                raise ValueError(method)
            for k, v in fmt.encode_layer(res, kind).items():
                new[f"{module}.{k}"] = v.contiguous()
            shapes[module] = tuple(W.shape)
        else:
            new[name] = t.contiguous()
    cfg = json.loads((src / "config.json").read_text())
    qc = {"quant_method": "latq", "format_version": 1, "method": method,
          "bits": bits if kind == "dense" else None, "group_size": group_size if kind == "dense" else None,
          "order": "act", "damp": 0.01, "modules_not_converted": sorted(skip)}
    if method == "ssqr":
        qc["outlier_rate"] = outlier_rate
    if kind == "huffman":
        qc["target_bits"] = target_bits
    if scale_bits is not None:
        qc["scale_bits"] = scale_bits
    cfg["quantization_config"] = qc
    for f in TOKENIZER_FILES:   # before the seal: every file of a checkpoint is in its manifest
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    write_checkpoint(out, new, cfg, shapes, source=src.name)
    return out


def dequantized_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint with every latq layer replaced by its fp32 ``.weight`` (a rotated one's ``Q·Rᵀ``)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    qc = cfg["quantization_config"]
    kind = fmt.kind_of(qc["method"])
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update(load_file(f))
    names = fmt.dense_tensors(qc.get("scale_bits") is not None) if kind == "dense" else fmt.HUFFMAN_TENSORS
    modules = {k.rsplit(".", 1)[0] for k in sd if k.rsplit(".", 1)[1] == names[0]}
    out = {k: v for k, v in sd.items() if k.rsplit(".", 1)[0] not in modules}
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kvh = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * hd, hidden), "k_proj": (kvh * hd, hidden), "v_proj": (kvh * hd, hidden),
              "o_proj": (hidden, heads * hd), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    for m in modules:
        t = {n: sd[f"{m}.{n}"] for n in names}
        out[f"{m}.weight"] = fmt.dequantize_layer(t, kind, shapes[m.rsplit(".", 1)[1]], qc.get("bits"),
                                                  qc.get("group_size"))
        rotation = fmt.parse_quantization_config(qc).rotation
        if rotation is not None:   # a rotated layer serves Q·Rᵀ
            out[f"{m}.weight"] = fmt.rotation.unrotate(out[f"{m}.weight"], rotation.signs(out[f"{m}.weight"].shape[1]))
    return out


def hf_dequantized_model(ckpt: Path):
    """HF transformers model (fp32) with the checkpoint's dequantized weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ckpt)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = {k: v.float() for k, v in dequantized_state_dict(ckpt).items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "lm_head" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
    """Plain greedy argmax decoding (no EOS handling), one prompt at a time."""
    outs = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        o = model(input_ids=x, use_cache=True)
        past, toks = o.past_key_values, []
        for _ in range(n):
            t = int(o.logits[0, -1].argmax())
            toks.append(t)
            o = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = o.past_key_values
        outs.append(toks)
    return outs


@torch.no_grad()
def greedy_margins(model, prompt_ids: list[list[int]], generated: list[list[int]]) -> list[float]:
    """Teacher-forced check of a generation against ``model`` (or a tuple of models, each step
    judged by the one under which it is closest to greedy): per prompt, the largest
    (max logit − logit of the generated token) over its steps, divided by the logits' std.
    0 = exactly greedy under ``model``; a low-precision kernel can only flip near-ties."""
    models = model if isinstance(model, tuple) else (model,)
    worst = []
    for ids, gen in zip(prompt_ids, generated):
        x = torch.tensor([ids + gen[:-1]])
        gaps = []
        for m in models:
            logits = m(input_ids=x).logits[0, len(ids) - 1:].float()
            chosen = logits.gather(1, torch.tensor(gen)[:, None])[:, 0]
            gaps.append((logits.max(1).values - chosen) / logits.std(1))
        worst.append(float(torch.stack(gaps).min(0).values.max()))
    return worst


def agree_until_a_near_tie(model, prompt_ids: list[list[int]], a: list[list[int]], b: list[list[int]],
                           tie: float = 0.1) -> bool:
    """Two generations, each greedy under ``model`` up to near-ties, part only at a step where
    ``model``'s two best logits (along their common prefix) are within ``tie`` of the logits' std."""
    for ids, x, y in zip(prompt_ids, a, b):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if n is None:
            continue
        logits = model(input_ids=torch.tensor([ids + x[:n]])).logits[0, -1]
        top = logits.topk(2).values
        if float((top[0] - top[1]) / logits.std()) >= tie:
            return False
    return True


def tokenize(model_dir: Path, prompts=PROMPTS) -> list[list[int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p)["input_ids"] for p in prompts]


def run_vllm_jobs(jobs: list[dict], *, tp: int = 1, fast: bool = True, compiled: bool = False,
                  extra_env: dict | None = None, timeout: float = 1200, tmp: Path | None = None,
                  launcher: tuple[str, ...] = ()) -> list[dict]:
    """Run ``jobs`` (see tests/vllm_runner.py) in one fresh Python process, started through
    ``launcher`` (a command that execs its arguments) if given; returns one result per job
    ({"tokens": ...} or {"error": ...}), each with the process log under "log". Raises with the
    log if the process itself fails."""
    import tempfile

    tmpdir = Path(tempfile.mkdtemp(dir=tmp))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if fast:
        env.update(FAST_ENV)
    if tp > 1:
        env.update({"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(i) for i in range(tp)),
                    "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_HOST_IP": "127.0.0.1"})
    if compiled:
        env.pop("TORCH_COMPILE_DISABLE", None)
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    env.update(extra_env or {})
    jobs = [{"tp": tp, "compiled": compiled, **j, "model": str(j["model"])} for j in jobs]
    (tmpdir / "jobs.json").write_text(json.dumps(jobs))
    cmd = [*launcher, PY, "-m", "tests.vllm_runner", str(tmpdir / "jobs.json"), str(tmpdir / "out.json")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = p.stdout + p.stderr
    if p.returncode != 0 or not (tmpdir / "out.json").exists():
        raise RuntimeError(f"vLLM run failed (exit {p.returncode}):\n{log[-8000:]}")
    res = json.loads((tmpdir / "out.json").read_text())
    shutil.rmtree(tmpdir, ignore_errors=True)
    for r in res:
        r["log"] = log
    return res


def run_vllm(model: Path, prompt_ids: list[list[int]], n: int = 32, *, kernel: str | None = None,
             quantization: str | None = None, **kw) -> dict:
    """One job; raises RuntimeError with the traceback and log if it fails."""
    env = {"LATQ_KERNEL": kernel} if kernel else {}
    r = run_vllm_jobs([{"model": model, "prompt_ids": prompt_ids, "max_tokens": n, "env": env,
                        "quantization": quantization}], **kw)[0]
    if "error" in r:
        raise RuntimeError(f"{r['error']}\n{r['traceback']}\n{r['log'][-4000:]}")
    return r


# ----------------------------------------------------------------------------- real checkpoints

PIPELINE_CALIB = dict(nsamples=16, seqlen=256)  # small calibration: these test serving, not accuracy


def pipeline_checkpoint(model: str, method: str) -> Path:
    """A real checkpoint of a reference model made by the offline pipeline
    (``latq-quantize --method ssqr`` / ``hptq`` defaults: 4-bit g128 1 % with an 8-bit head, 3.125 bits), cached under
    ``cache_dir()/plugin_tests`` (built once, file-locked: quantizing a real model is slow)."""
    from filelock import FileLock

    from vllm_latq.data import cache_dir
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model

    root = cache_dir() / "plugin_tests"
    root.mkdir(parents=True, exist_ok=True)
    opts = QuantizeOptions(method=method, **PIPELINE_CALIB)
    # named by the head too: a checkpoint cached before the head was quantized by default is not this one
    name = f"{model}-{method}" + (f"-head{opts.lm_head_bits or opts.bits}" if opts.quantize_lm_head else "")
    out = root / name
    with FileLock(str(root / f".{name}.lock")):
        if not (out / "config.json").exists():
            quantize_model(model, out, opts, overwrite=True, progress=False)
        elif not _sealed(out):
            # a cached checkpoint without a current manifest: these test serving, not integrity, and
            # sealing it again is far cheaper than quantizing again
            write_manifest(out)
    return out


def _sealed(d: Path) -> bool:
    """Whether the checkpoint ``d`` carries a manifest of the current version."""
    from vllm_latq.errors import FormatError
    from vllm_latq.format.manifest import read_manifest
    try:
        read_manifest(d)
    except FormatError:
        return False
    return True


if __name__ == "__main__":  # build the cached real checkpoints: python -m tests.vllm_helpers
    for spec in sys.argv[1:] or ["smollm2-135m:ssqr", "smollm2-135m:hptq", "smollm2-135m:gptq", "gemma3-270m:ssqr"]:
        print(pipeline_checkpoint(*spec.split(":")), flush=True)
