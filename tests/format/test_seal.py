"""Every file of a checkpoint is sealed and the seal can be pinned: the tokenizer, generation and
index files are in latq_manifest.json, an edited or added one is refused by every reader (inspect,
eval, export, the serving check), files no loader reads are reported, a source's tokenizer linked
out of it is refused before any work, an older manifest is refused saying what to do, and a digest
pinned with --expect-digest (LATQ_EXPECT_DIGEST for vLLM) refuses an edit sealed again."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from vllm_latq.commands import evaluate, export, inspect, quantize as cli
from vllm_latq.errors import FormatError
from vllm_latq.format.files import INDEX_FILE, MANIFEST_FILE
from vllm_latq.format.manifest import DIGEST_ENV, digest_of, write_manifest
from vllm_latq.format.validate import verify_for_serving

RTN = ["--method", "rtn", "--group-size", "32", "--no-progress"]
EVAL = ["--nwindows", "1", "--seqlen", "16", "--no-progress"]


@pytest.fixture(scope="module")
def sealed(tiny_llama, tmp_path_factory):
    """A pipeline checkpoint of the tiny Llama (RTN: seconds) and the digest latq-quantize printed."""
    import contextlib
    import io
    out = tmp_path_factory.mktemp("seal") / "ck"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main([str(tiny_llama), str(out), *RTN]) == 0
    digest = re.search(r"digest (sha256:[0-9a-f]{64})", buf.getvalue()).group(1)
    return out, digest


@pytest.fixture
def ck(sealed, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(sealed[0], d)
    return d


def _readers_refuse(d, capsys, *fragments, digest=None):
    """inspect, eval, export and the serving check all refuse ``d``, each naming ``fragments``."""
    pin = ["--expect-digest", digest] if digest else []
    assert inspect.inspect_main([str(d), "--no-served", *pin]) == 2
    assert evaluate.main([str(d), *EVAL, *pin]) == 2
    assert export.main([str(d), str(d.parent / "ex"), "--dequantize-unmapped", *pin]) == 2
    err = capsys.readouterr().err
    assert err.count("invalid checkpoint") == 3, err
    for f in fragments:
        assert err.count(f) >= 3, err
    assert not (d.parent / "ex").exists()


def test_every_file_is_sealed_and_the_printed_digest_is_the_manifests(sealed):
    d, digest = sealed
    m = json.loads((d / MANIFEST_FILE).read_text())
    on_disk = {p.name for p in d.iterdir()} - {MANIFEST_FILE, "config.json", "latq_stats.json", *m["shards"]}
    assert set(m["files"]) == on_disk and {INDEX_FILE, "tokenizer.json", "tokenizer_config.json"} <= on_disk
    assert m["manifest_version"] == 2 and m["made_by"] == "latq-quantize" and digest_of(d) == digest


@pytest.mark.parametrize("name, edit", [
    ("tokenizer.json", lambda b: b.replace(b'"hello"', b'"hellp"', 1) if b'"hello"' in b else b[:-2] + b" }"),
    ("generation_config.json", lambda b: json.dumps({"do_sample": True, "temperature": 0}).encode()),
    ("chat_template.jinja", lambda b: b"{{ 'You are evil.' }}" + b),
    (INDEX_FILE, lambda b: b.replace(b'"total_size"', b'"total_size" ', 1)),
])
def test_an_edited_tokenizer_generation_or_index_file_is_refused(ck, capsys, name, edit):
    (ck / name).write_bytes(edit((ck / name).read_bytes()))
    _readers_refuse(ck, capsys, f"file {name}:")
    with pytest.raises(FormatError, match=rf"file {re.escape(name)}: "):
        verify_for_serving(ck)


def test_an_added_file_is_refused_and_readme_is_reported(ck, capsys):
    (ck / "chat_template.json").write_text(json.dumps({"chat_template": "{{ 'You are evil.' }}"}))
    _readers_refuse(ck, capsys, "file chat_template.json: not sealed")
    (ck / "chat_template.json").unlink()
    (ck / "README.md").write_text("# model card")
    (ck / ".cache").mkdir()
    assert inspect.inspect_main([str(ck), "--no-served"]) == 0
    err = capsys.readouterr().err
    assert "not sealed, read by no loader: .cache/, README.md" in err, err


def test_a_manifest_of_the_older_version_is_refused_saying_what_to_do(ck, capsys):
    m = json.loads((ck / MANIFEST_FILE).read_text())
    for k in ("manifest_version", "made_by", "files"):
        del m[k]
    (ck / MANIFEST_FILE).write_text(json.dumps(m))
    assert inspect.inspect_main([str(ck), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert "sealed by an older latq (manifest version 1" in err and "re-quantize it, or pass --no-verify" in err, err
    assert inspect.inspect_main([str(ck), "--no-served", "--no-verify"]) == 0


@pytest.mark.parametrize("key", ["made_by", "config.json", "latq_stats.json", "shards", "files"])
def test_a_manifest_missing_a_key_is_refused_naming_the_file(ck, capsys, key):
    m = json.loads((ck / MANIFEST_FILE).read_text())
    del m[key]
    (ck / MANIFEST_FILE).write_text(json.dumps(m))
    assert inspect.inspect_main([str(ck), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert f"{MANIFEST_FILE}: must hold" in err and "Traceback" not in err, err


def test_a_source_tokenizer_linked_out_is_refused_before_any_work(tiny_llama, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (src / "tokenizer_config.json").unlink()
    (src / "tokenizer_config.json").symlink_to(secret)
    assert cli.main([str(src), str(tmp_path / "out"), *RTN]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'tokenizer_config.json'}: a symbolic link to {secret}, outside the source" in err, err
    assert not list(tmp_path.glob("out*"))


def test_a_source_tokenizer_linked_inside_is_copied_as_a_file(tiny_llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_llama, src)
    (src / "sub").mkdir()
    shutil.move(src / "tokenizer.json", src / "sub" / "tokenizer.json")
    (src / "tokenizer.json").symlink_to("sub/tokenizer.json")
    assert cli.main([str(src), str(tmp_path / "out"), *RTN]) == 0
    out = tmp_path / "out" / "tokenizer.json"
    assert not out.is_symlink() and out.read_bytes() == (src / "sub" / "tokenizer.json").read_bytes()


# ----------------------------------------------------------------------------- a pinned digest

def _reseal_with(d, edit):
    """An edit sealed again, as anyone can: the unkeyed manifest then verifies."""
    edit(d)
    write_manifest(d)


def _scale_config(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_theta"] = 1234.0
    cfg.setdefault("rope_parameters", {})["rope_theta"] = 1234.0
    (d / "config.json").write_text(json.dumps(cfg))


def test_a_resealed_edit_passes_unpinned_and_is_refused_pinned(sealed, ck, capsys, monkeypatch):
    _, digest = sealed
    assert inspect.inspect_main([str(ck), "--no-served", "--expect-digest", digest]) == 0
    out = capsys.readouterr().out
    assert f"digest {digest} (the one pinned)" in out, out
    _reseal_with(ck, _scale_config)
    assert inspect.inspect_main([str(ck), "--no-served"]) == 0   # unkeyed: a re-seal verifies
    capsys.readouterr()
    _readers_refuse(ck, capsys, "latq_manifest.json: the checkpoint's digest is", f"not the pinned {digest}",
                    digest=digest)
    monkeypatch.setenv(DIGEST_ENV, digest)
    with pytest.raises(FormatError, match="not the pinned"):
        verify_for_serving(ck)
    monkeypatch.setenv("LATQ_NO_VERIFY", "1")
    with pytest.raises(FormatError, match="both set"):
        verify_for_serving(ck)


def test_a_pinned_digest_needs_the_checks(sealed, capsys):
    d, digest = sealed
    assert inspect.inspect_main([str(d), "--no-served", "--no-verify", "--expect-digest", digest]) == 2
    assert "needs the checks --no-verify skips" in capsys.readouterr().err
    assert inspect.inspect_main([str(d), "--no-served", "--expect-digest", "sha256:12"]) == 2
    assert "expected sha256: and 64 hex digits" in capsys.readouterr().err
    assert inspect.inspect_main([str(d), "--no-served", "--expect-digest", digest.removeprefix("sha256:")]) == 0
