"""bench/serve_soak.py: the request mix it sends and how it judges each answer (fast); the soak
itself against a served tiny checkpoint (slow)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve_soak import MALFORMED, classify, malformed, requests, summary, well_formed

ROOT = Path(__file__).resolve().parents[2]


def _ok(tokens: int, finish: str = "length") -> bytes:
    return json.dumps({"choices": [{"text": "x", "finish_reason": finish}],
                       "usage": {"completion_tokens": tokens}}).encode()


def test_a_quarter_malformed_every_kind_twice():
    rs = requests(64)
    bad = [r for r in rs if r.malformed]
    assert len(rs) == 64 and len(bad) == 16
    assert sorted(r.kind for r in bad) == sorted(list(MALFORMED) * 2)
    good = [r for r in rs if not r.malformed]
    assert {r.kind for r in good} == {"chat", "completions"} and len({r.max_tokens for r in good}) == 3
    for r in bad:
        if r.kind in ("bad_json", "non_utf8"):
            continue
        body = json.loads(r.body)   # the other malformed bodies are JSON, wrong in one field
        assert body["model"] in ("soak", "no-such-model")


def test_classify_well_formed_answers():
    r = well_formed(1)   # 8 tokens
    assert classify(r, 200, _ok(r.max_tokens)) == "answered"
    assert classify(r, 200, _ok(r.max_tokens - 1)) == "truncated"
    assert classify(r, 200, _ok(r.max_tokens, "abort")) == "truncated"
    assert classify(r, 200, _ok(r.max_tokens)[:-5]) == "truncated"
    assert classify(r, None, b"") == "lost"
    assert classify(r, 503, b"") == "5xx" and classify(r, 400, b"{}") == "4xx"


def test_classify_malformed_answers():
    r = malformed("negative_max_tokens")
    named = json.dumps({"error": {"message": "max_tokens must be at least 1, got -5."}}).encode()
    assert classify(r, 400, named) == "refused_named"
    assert classify(r, 400, json.dumps({"error": {"message": "There was an error"}}).encode()) == "refused"
    assert classify(r, 200, _ok(4)) == "accepted" and classify(r, 500, b"") == "5xx"
    results = [(r, "refused_named", ""), (well_formed(0), "answered", ""), (well_formed(2), "lost", "")]
    s = summary(results, True, 1.0)
    assert (s["requests"], s["answered"], s["lost"], s["malformed_named"], s["healthy_after"]) == (3, 1, 1, 1, 1)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_soak_a_served_tiny_checkpoint():
    p = subprocess.run([sys.executable, "-m", "bench.serve_soak", "--requests", "16", "--concurrency", "4"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1700)
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    head = dict(kv.split("=", 1) for kv in p.stdout.strip().splitlines()[-1].split()[1:])
    assert (head["answered"], head["truncated"], head["lost"], head["status_5xx"]) == ("12", "0", "0", "0"), head
    assert head["malformed_4xx"] == "4" and head["healthy_after"] == "1", head
