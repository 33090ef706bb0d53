"""bench/serve_refusals.py: every adversarial class it builds is refused by latq-serve's check
naming what was tampered with, and the intact checkpoint passes it (fast, in process); the bench
itself through latq-serve's own process (slow)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.serve_refusals import CLASSES, judge, tampered
from vllm_latq.commands import serve
from vllm_latq.format.manifest import DIGEST_ENV, digest_of

ROOT = Path(__file__).resolve().parents[2]


def test_every_class_is_refused_naming_what_was_tampered_with(tiny_checkpoints, tmp_path, monkeypatch):
    ck = tiny_checkpoints["ssqr"][0]
    digest = digest_of(ck)
    monkeypatch.setenv(DIGEST_ENV, digest)
    assert serve.preflight([str(tampered(ck, tmp_path, "intact"))]) is None
    for kind, (_, name, pinned) in CLASSES.items():
        if pinned:
            monkeypatch.setenv(DIGEST_ENV, digest)
        else:   # unset: an empty pin is refused as malformed
            monkeypatch.delenv(DIGEST_ENV, raising=False)
        refusal = serve.preflight([str(tampered(ck, tmp_path, kind))])
        assert refusal is not None and name in refusal and "\n" not in refusal, (kind, refusal)
        assert judge(kind, {"rc": 2, "lines": [f"latq-serve: {refusal}"]}), kind
    assert not judge("config_fifo", {"rc": 1, "lines": ["latq-serve: config.json"]})


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_bench_refuses_every_class_in_one_line():
    p = subprocess.run([sys.executable, "-m", "bench.serve_refusals"], cwd=ROOT, capture_output=True, text=True,
                       timeout=1700, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout + p.stderr[-4000:]
    head = dict(kv.split("=", 1) for kv in p.stdout.strip().splitlines()[-1].split()[1:])
    assert head["refused_one_line"] == head["classes"] and head["control_passes"] == "1", p.stdout
