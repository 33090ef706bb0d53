"""Soak ``latq-serve`` on loopback: a bounded burst of well-formed and malformed requests, and
whether every one was answered in full or refused with a 4xx that names the problem.

    python -m bench.serve_soak                         # a tiny SSQR checkpoint, built in seconds
    python -m bench.serve_soak --ckpt ckpt/smollm2-ssqr --requests 64 --concurrency 16

The server runs ``python -m vllm_latq.commands.serve CKPT`` on 127.0.0.1 (eager, ``--max-model-len``
256, ``--max-num-seqs`` = the concurrency) and is stopped at the end. A quarter of the requests
are malformed, two of each kind: bad JSON, a non-UTF-8 body, negative and huge ``max_tokens``,
a prompt longer than the model length, a prompt and a ``max_tokens`` of the wrong type, an
unknown model. The rest mix /v1/completions and /v1/chat/completions, short to long prompts
and 1 to 32 new tokens with EOS ignored, so a complete answer has exactly ``max_tokens``
tokens and finish reason "length".

Counted: well-formed requests answered in full, truncated (cut short or unparseable), lost
(no HTTP answer), 4xx and 5xx; malformed ones refused with a 4xx and a message, with that
message naming the problem (a keyword of the kind: ``max_tokens``, ``model``, ``JSON``…),
answered 200, 5xx, lost; and the server's health afterwards (/health and one more complete
answer). The per-kind messages are printed; the last line is ``HEADLINE key=value ...``.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MODEL = "soak"
MAX_MODEL_LEN = 256
PROMPTS = ["The capital of France is",
           "Photosynthesis is the process by which plants " * 6,
           "Once upon a time, in a village by the sea, there lived " * 12]
NEW_TOKENS = (1, 8, 32)
# kind: (body, the keywords one of which the refusal's message must contain)
MALFORMED = {
    "bad_json": (b'{"model": "soak", "prompt": "hi", ', ("json", "pars", "decod", "expecting")),
    "non_utf8": (b'\xff\xfe{"model": "soak", "prompt": "\xe9t\xe9"}', ("utf", "decod", "pars")),
    "negative_max_tokens": ({"prompt": "hi", "max_tokens": -5}, ("max_tokens",)),
    "huge_max_tokens": ({"prompt": "hi", "max_tokens": 10**9}, ("max_tokens", "context", "maximum")),
    "over_long_prompt": ({"prompt": "hello " * (4 * MAX_MODEL_LEN), "max_tokens": 4}, ("context", "length", "token")),
    "wrong_type_prompt": ({"prompt": {"text": "hi"}, "max_tokens": 4}, ("prompt",)),
    "wrong_type_max_tokens": ({"prompt": "hi", "max_tokens": "ten"}, ("max_tokens",)),
    "unknown_model": ({"model": "no-such-model", "prompt": "hi", "max_tokens": 4}, ("model",)),
}


@dataclass(frozen=True)
class Request:
    kind: str             # "completions" / "chat" (well-formed) or a key of MALFORMED
    path: str
    body: bytes
    max_tokens: int | None = None

    @property
    def malformed(self) -> bool:
        return self.kind in MALFORMED


def well_formed(i: int) -> Request:
    """Request ``i`` of the well-formed ones: endpoints, prompt lengths and token counts mixed."""
    n, prompt = NEW_TOKENS[i % len(NEW_TOKENS)], PROMPTS[(i // 2) % len(PROMPTS)]
    common = {"model": MODEL, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
    if i % 2:
        return Request("chat", "/v1/chat/completions",
                       json.dumps({**common, "messages": [{"role": "user", "content": prompt}]}).encode(), n)
    return Request("completions", "/v1/completions", json.dumps({**common, "prompt": prompt}).encode(), n)


def malformed(kind: str) -> Request:
    body, _ = MALFORMED[kind]
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL, **body}).encode()
    return Request(kind, "/v1/completions", body)


def requests(n: int) -> list[Request]:
    """``n`` requests, a quarter malformed (the kinds in turn), every fourth one."""
    kinds = list(MALFORMED)
    bad = [malformed(kinds[j % len(kinds)]) for j in range(n // 4)]
    good = [well_formed(i) for i in range(n - len(bad))]
    return [bad.pop(0) if bad and i % 4 == 3 else good.pop(0) for i in range(n)]


def send(port: int, r: Request, timeout: float) -> tuple[int | None, bytes, str | None]:
    """(status, body, error): one request on its own connection; no answer gives status None."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", r.path, body=r.body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), None
    except (OSError, http.client.HTTPException) as e:
        return None, b"", f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def _message(body: bytes) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:200]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    msg = err.get("message", err.get("detail")) if isinstance(err, dict) else err
    return str(msg or "")[:300]


def classify(r: Request, status: int | None, body: bytes) -> str:
    """The outcome of one request: answered / truncated / lost / 4xx / 5xx for a well-formed one;
    refused_named / refused / accepted / lost / 5xx for a malformed one."""
    if status is None:
        return "lost"
    if status >= 500:
        return "5xx"
    if r.malformed:
        if status == 200:
            return "accepted"
        msg = _message(body).lower()
        if not msg:
            return "refused"
        return "refused_named" if any(k in msg for k in MALFORMED[r.kind][1]) else "refused"
    if status != 200:
        return "4xx"
    try:
        obj = json.loads(body)
        choice, tokens = obj["choices"][0], obj["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError):
        return "truncated"
    return "answered" if choice.get("finish_reason") == "length" and tokens == r.max_tokens else "truncated"


# ----------------------------------------------------------------------------- the server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def start_server(ckpt: Path, port: int, concurrency: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "vllm_latq.commands.serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-seqs", str(concurrency), "--kv-cache-memory-bytes", str(256 << 20)]
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1"}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if healthy(port):
            return
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server's own process group (started here), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def tiny_checkpoint(root: Path) -> Path:
    """A tiny random Llama (head_dim 32, as vLLM's CPU attention wants) quantized with SSQR."""
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    from vllm_latq.testing.tiny_models import TINY_OPTS, make_tiny_model
    src = make_tiny_model(root / "tiny-llama", "llama", hidden_size=64, num_attention_heads=2, head_dim=32)
    return quantize_model(src, root / "tiny-ssqr", QuantizeOptions(method="ssqr", **TINY_OPTS), progress=False)


# ----------------------------------------------------------------------------- the run

def soak(port: int, reqs: list[Request], concurrency: int, timeout: float) -> list[tuple[Request, str, str]]:
    """(request, outcome, message) of every request, ``concurrency`` in flight."""
    def one(r: Request):
        status, body, err = send(port, r, timeout)
        return r, classify(r, status, body), err or (_message(body) if r.malformed or status != 200 else "")
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, reqs))


def summary(results, healthy_after: bool, seconds: float) -> dict:
    good = [o for r, o, _ in results if not r.malformed]
    bad = [o for r, o, _ in results if r.malformed]
    return {"requests": len(results), "wellformed": len(good), "answered": good.count("answered"),
            "truncated": good.count("truncated"), "lost": good.count("lost") + bad.count("lost"),
            "status_4xx": good.count("4xx"), "status_5xx": good.count("5xx") + bad.count("5xx"),
            "malformed": len(bad), "malformed_4xx": bad.count("refused_named") + bad.count("refused"),
            "malformed_named": bad.count("refused_named"), "malformed_accepted": bad.count("accepted"),
            "healthy_after": int(healthy_after), "seconds": round(seconds, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, help="latq checkpoint to serve (default: a tiny SSQR one, built here)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--server-log", type=Path, help="keep the server's log here (default: its tail is printed "
                                                    "when a request was lost or got a 5xx)")
    a = ap.parse_args(argv)
    if a.requests < 4 or a.concurrency < 1:
        ap.error("--requests must be at least 4 and --concurrency at least 1")
    with tempfile.TemporaryDirectory(prefix="latq-soak-") as tmp:
        ckpt = a.ckpt or tiny_checkpoint(Path(tmp))
        port, log = free_port(), a.server_log or Path(tmp) / "server.log"
        proc = start_server(ckpt, port, a.concurrency, log)
        try:
            wait_healthy(proc, port, log, a.start_timeout)
            t0 = time.time()
            results = soak(port, requests(a.requests), a.concurrency, a.request_timeout)
            seconds = time.time() - t0
            after = healthy(port) and soak(port, [well_formed(0)], 1, a.request_timeout)[0][1] == "answered"
            alive = proc.poll() is None
        finally:
            stop_server(proc)
        s = summary(results, after and alive, seconds)
        if s["lost"] or s["status_5xx"]:
            print(f"--- the server's log, last lines ---\n{log.read_text()[-6000:]}\n---")
    for kind in MALFORMED:
        outs = [(o, m) for r, o, m in results if r.kind == kind]
        for o, m in outs[:1]:
            print(f"{kind:22s} {o:14s} {' '.join(m.split())[:110]}")
    print(json.dumps(s))
    print("HEADLINE " + " ".join(f"{k}={v}" for k, v in s.items()) + f" ckpt={ckpt.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
