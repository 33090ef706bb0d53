"""``latq-serve`` against tampered checkpoints: each adversarial class must be refused before vLLM
starts — exit code 2 and one line naming the file and why — and the time the refusal takes is
measured (the whole checkpoint's sha256 is read before any answer). With ``--vllm`` each class is
also handed to vLLM's own ``serve`` (in process, no latq-serve check before it): the error it
ends with must be the plugin's one line.

    python -m bench.serve_refusals                          # a tiny checkpoint, built in seconds
    python -m bench.serve_refusals --ckpt ckpt/smollm2-ssqr --vllm

The classes (:data:`CLASSES`): a generation config edited, a chat template added, tokenizer ids
swapped, group scales ×1.25 and a rotary base sealed again (caught by the pinned digest), a NaN
embedding row sealed again, ``architectures`` edited and sealed again, ``config.json`` a FIFO,
``latq_stats.json`` nested 100 000 deep, a loop of links. The intact checkpoint, pinned, is the
control: it must pass the check (the server is not started). The last line is
``HEADLINE key=value ...``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from vllm_latq import cpu_features
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.manifest import digest_of, write_manifest
from vllm_latq.format.safetensors_file import SafetensorsFile, write_safetensors

ROOT = Path(__file__).resolve().parents[1]


def _json(d: Path, name: str, fn) -> None:
    obj = json.loads((d / name).read_text())
    fn(obj)
    (d / name).write_text(json.dumps(obj))


def _resealed_tensor(d: Path, pick, fn) -> None:
    """The first tensor ``pick`` accepts replaced by ``fn(tensor)``, checksums and seal recomputed."""
    ck = Checkpoint(d)
    name = next(n for n in ck.where if pick(n))
    f = SafetensorsFile(d / ck.where[name])
    t = {n: f.get(n) for n in f.names()}
    t[name] = fn(t[name].clone())
    write_safetensors(d / ck.where[name], t)
    write_manifest(d)


def _swap_tokens(d: Path) -> None:
    _json(d, "tokenizer.json", lambda t: t["model"]["vocab"].update(
        {k: v for k, v in zip(list(t["model"]["vocab"])[200:210], list(t["model"]["vocab"].values())[210:220])}))


def _rope(d: Path) -> None:
    _json(d, "config.json", lambda c: c.update(rope_theta=1.5e4) if "rope_parameters" not in c
          else c["rope_parameters"].update(rope_theta=1.5e4))
    write_manifest(d)


def _loop(d: Path) -> None:
    (d / "tokenizer_config.json").unlink()
    (d / "tokenizer_config.json").symlink_to("loop.json")
    (d / "loop.json").symlink_to("tokenizer_config.json")


def _fifo(d: Path) -> None:
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")


# class: (the tampering, what the refusal must name (a file), whether the run pins the original digest)
CLASSES = {
    "generation_config_edited": (lambda d: _json(d, "generation_config.json", lambda g: g.update(temperature=0.0,
                                                                                                do_sample=True)),
                                 "generation_config.json", False),
    "chat_template_added": (lambda d: (d / "chat_template.json").write_text('{"chat_template": "You obey."}'),
                            "chat_template.json", False),
    "tokenizer_ids_swapped": (_swap_tokens, "tokenizer.json", False),
    "scales_x1.25_resealed": (lambda d: _resealed_tensor(d, lambda n: n.endswith(".scales"), lambda t: t * 1.25),
                              "latq_manifest.json", True),
    "rope_theta_resealed": (_rope, "latq_manifest.json", True),
    "nan_embedding_resealed": (lambda d: _resealed_tensor(d, lambda n: "embed" in n,
                                                          lambda t: t.index_fill(0, torch.tensor([5]), float("nan"))),
                               "embed", False),
    "architectures_resealed": (lambda d: (_json(d, "config.json", lambda c: c.update(
        architectures=["MistralForCausalLM"])), write_manifest(d)), "config.json", False),
    "config_fifo": (_fifo, "config.json", False),
    "stats_deep_json": (lambda d: (d / "latq_stats.json").write_text("[" * 100_000 + "]" * 100_000),
                        "latq_stats.json", False),
    "link_loop": (_loop, "a symbolic link loop", False),
}


def tampered(ckpt: Path, root: Path, kind: str) -> Path:
    """A copy of ``ckpt`` under ``root`` with class ``kind``'s tampering applied (None: intact)."""
    d = root / kind
    shutil.copytree(ckpt, d, symlinks=True)
    if kind != "intact":
        CLASSES[kind][0](d)
    return d


def refuse(d: Path, digest: str | None, timeout: float) -> dict:
    """``latq-serve D`` (``--expect-digest`` if given): its exit code, stderr lines and seconds. A
    check that passes hands over to vLLM, which ``--print-command`` keeps from starting."""
    cmd = [sys.executable, "-m", "vllm_latq.commands.serve", str(d), "--port", "1", "--print-command"]
    if digest:
        cmd += ["--expect-digest", digest]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    return {"rc": p.returncode, "lines": lines, "seconds": time.time() - t0}


def vllm_error(d: Path, digest: str | None, timeout: float) -> str:
    """The last line of the error vLLM's own ``serve`` ends with on ``d`` (no latq-serve check)."""
    code = ("from vllm_latq.commands.serve import serve_in_process; "
            f"serve_in_process(['serve', {str(d)!r}, '--enforce-eager', '--max-model-len', '128', '--port', '1'])")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1",
           **({"LATQ_EXPECT_DIGEST": digest} if digest else {})}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    errs = [ln for ln in p.stderr.splitlines() if ln and not ln.startswith((" ", "Traceback", "INFO", "WARNING",
                                                                              "DEBUG", "("))]
    return errs[-1] if errs else ""


def judge(kind: str, r: dict) -> bool:
    """Refused as it must be: exit code 2, one line, naming what the class tampered with."""
    name = CLASSES[kind][1]
    return r["rc"] == 2 and len(r["lines"]) == 1 and r["lines"][0].startswith("latq-serve: ") and name in r["lines"][0]


def tiny_checkpoint(root: Path) -> Path:
    """A tiny random Llama quantized with GPTQ (RTN-fast options): tokenizer, generation config,
    chat template and shards, all sealed."""
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    from vllm_latq.testing.tiny_models import TINY_OPTS, make_tiny_model
    src = make_tiny_model(root / "tiny-llama", "llama", hidden_size=64, num_attention_heads=2, head_dim=32)
    return quantize_model(src, root / "tiny-gptq", QuantizeOptions(method="gptq", **TINY_OPTS), progress=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, help="latq checkpoint to tamper with (copied; default: a tiny one)")
    ap.add_argument("--vllm", action="store_true", help="also hand every class to vLLM's own serve")
    ap.add_argument("--timeout", type=float, default=600.0)
    a = ap.parse_args(argv)
    print(f"cpu: {cpu_features.capability()}")
    rows, ok, seconds = [], 0, []
    with tempfile.TemporaryDirectory(prefix="latq-refusals-") as tmp:
        ckpt = a.ckpt or tiny_checkpoint(Path(tmp))
        digest = digest_of(ckpt)
        size = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
        control = refuse(tampered(ckpt, Path(tmp), "intact"), digest, a.timeout)
        for kind, (_, _, pinned) in CLASSES.items():
            d = tampered(ckpt, Path(tmp), kind)
            r = refuse(d, digest if pinned else None, a.timeout)
            good = judge(kind, r)
            ok += good
            seconds.append(r["seconds"])
            first = r["lines"][0] if r["lines"] else ""
            extra = f" | vllm: {vllm_error(d, digest if pinned else None, a.timeout)[:160]}" if a.vllm else ""
            rows.append(f"{kind:26s} rc={r['rc']} {'ok ' if good else 'BAD'} {r['seconds']:5.1f}s  {first[:150]}{extra}")
    print("\n".join(rows))
    print(f"control (intact, pinned): rc={control['rc']} {control['seconds']:.1f}s")
    print("HEADLINE " + " ".join(f"{k}={v}" for k, v in {
        "classes": len(CLASSES), "refused_one_line": ok, "control_passes": int(control["rc"] == 0),
        "refusal_seconds_max": round(max(seconds), 1), "control_seconds": round(control["seconds"], 1),
        "ckpt_mib": round(size / 2**20, 1)}.items()))
    return 0 if ok == len(CLASSES) and control["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
