"""The serving side refuses as the readers do, in one line: the vLLM plugin verifies a checkpoint
named by a hub id through its snapshot in the local cache (never downloading), honours a digest
pinned in LATQ_EXPECT_DIGEST, and raises a refusal vLLM prints as the first line of its error;
``latq-serve`` verifies before handing over and exits 2 with one line naming the file."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_latq.commands import serve
from vllm_latq.format.manifest import DIGEST_ENV, digest_of

ROOT = Path(__file__).resolve().parents[2]
REPO_ID = "someone/tiny-latq"


@pytest.fixture
def hub_cache(ck, tmp_path, monkeypatch):
    """``ck`` as the hub stores a downloaded repository: blobs named by hash, a snapshot of links
    to them, ``refs/main`` naming the snapshot; the library pointed at this cache."""
    import huggingface_hub.constants
    cache = tmp_path / "hub"
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(ck.iterdir())):
        blob = repo / "blobs" / f"{i:064x}"
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return snap


def _update(model: str, ck):
    from vllm_latq.plugin.config import LatqConfig
    qc = json.loads((ck / "config.json").read_text())["quantization_config"]
    hf = SimpleNamespace(quantization_config=dict(qc))
    LatqConfig.from_config(qc).maybe_update_config(model, hf_config=hf)
    return hf.quantization_config


def test_a_hub_id_is_verified_through_its_cached_snapshot(ck, hub_cache):
    from vllm_latq.plugin.config import LatqCheckpointRefused
    assert "_latq_fingerprint" in _update(REPO_ID, ck)
    blob = (hub_cache / "generation_config.json").resolve()
    blob.write_text(json.dumps({"temperature": 0, "do_sample": True}))
    with pytest.raises(LatqCheckpointRefused) as e:
        _update(REPO_ID, ck)
    msg = str(e.value)
    assert msg.startswith(f"latq: {REPO_ID} refused: file generation_config.json: differs") and "\n" not in msg
    assert "hf download" in msg and not isinstance(e.value, ValueError)   # pydantic would fold a ValueError
    with pytest.raises(LatqCheckpointRefused, match="not in the local Hugging Face cache"):
        _update("someone/not-downloaded", ck)


def test_a_digest_pinned_for_vllm_is_honoured(ck, monkeypatch):
    from vllm_latq.plugin.config import LatqCheckpointRefused
    monkeypatch.setenv(DIGEST_ENV, digest_of(ck))
    _update(str(ck), ck)
    monkeypatch.setenv(DIGEST_ENV, "sha256:" + "0" * 64)
    with pytest.raises(LatqCheckpointRefused, match="latq_manifest.json: the checkpoint's digest is"):
        _update(str(ck), ck)


def test_latq_serve_refuses_before_handing_over(ck, capsys, monkeypatch):
    def no_vllm(*a, **k):
        raise AssertionError("handed over to vLLM")
    monkeypatch.setattr(serve, "serve_in_process", no_vllm)
    monkeypatch.setattr(os, "execv", no_vllm)
    (ck / "generation_config.json").write_text("{}")
    for argv in ([str(ck)], ["serve", "--port", "9", "--model", str(ck)]):
        with pytest.raises(SystemExit) as e:
            serve.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"latq-serve: {ck} refused: file generation_config.json: differs from what was written "
                       "(sha256 in latq_manifest.json): edited after quantization"), err


def test_latq_serve_expect_digest(ck, capsys, monkeypatch):
    handed = []
    monkeypatch.setattr(serve, "serve_in_process", lambda cmd: handed.append((cmd, os.environ.get(DIGEST_ENV))))
    monkeypatch.setattr(serve, "vllm_cli", lambda: None)
    monkeypatch.delenv(DIGEST_ENV, raising=False)   # not the shell's pin (conftest undoes what latq-serve sets)
    with pytest.raises(SystemExit) as e:
        serve.main([str(ck), "--expect-digest", "sha256:" + "1" * 64])
    assert e.value.code == 2 and "not the pinned sha256:111" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        serve.main([str(ck), "--expect-digest=abc"])
    assert e.value.code == 2 and "expected sha256: and 64 hex digits" in capsys.readouterr().err
    digest = digest_of(ck)
    serve.main([str(ck), "--expect-digest", digest.removeprefix("sha256:"), "--port", "9"])
    (cmd, env), = handed
    assert env == digest and "--expect-digest" not in cmd and cmd[:2] == ["serve", str(ck)]


def test_the_model_vllm_would_load():
    assert serve.model_of(["ck", "--port", "1"]) == "ck"
    assert serve.model_of(["serve", "ck"]) == "ck"
    assert serve.model_of(["--port", "1", "--model", "x/y"]) == "x/y"
    assert serve.model_of(["--model=x/y"]) == "x/y"
    assert serve.model_of(["--port", "1"]) is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllm_prints_the_refusal_as_the_first_line_of_its_error(ck):
    """``vllm serve`` itself (no latq-serve check before it): the error it ends with is the
    plugin's one line, not pydantic's ValidationError."""
    (ck / "chat_template.json").write_text("{}")
    code = ("from vllm_latq.commands.serve import serve_in_process; "
            f"serve_in_process(['serve', {str(ck)!r}, '--enforce-eager', '--max-model-len', '128', '--port', '1'])")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "TORCH_COMPILE_DISABLE": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=540, env=env)
    assert p.returncode != 0
    error = [ln for ln in p.stderr.splitlines() if ln and not ln.startswith((" ", "Traceback", "INFO", "WARNING",
                                                                               "DEBUG", "("))]
    assert error[-1] == (f"vllm_latq.plugin.config.LatqCheckpointRefused: latq: {ck} refused: file "
                         "chat_template.json: not sealed in latq_manifest.json: added after the checkpoint was "
                         "written (a loader may read it); remove it, or pass --no-verify to read the checkpoint "
                         "unchecked"), p.stderr[-3000:]
    assert "ValidationError" not in p.stderr
