"""latq-serve hands vLLM the files its check verified: config.json, the tokenizer, chat template and generation
defaults are written from the verified bytes into a private directory named by the manifest's digest, and vLLM is
pointed at it (--hf-config-path, --tokenizer; the generation defaults come from the former's directory), so a
checkpoint swapped in after the check does not configure the server; the plugin's config-time check refuses a checkpoint other than the one latq-serve checked.
The copy is verified again when reused, each of its files yours with one link; the folder holding served/ and
every folder above it are yours or root's and writable by no one else (a sticky /tmp aside), or latq-serve refuses
naming the folder and LATQ_CACHE; a user's own option is kept, or refused beside a pin."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_latq.commands import serve
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.manifest import DIGEST_ENV, digest_of, write_manifest
from vllm_latq.format.served_copy import DIGEST_KEY, SERVED_DIR
from vllm_latq.format.swap_hook import SWAP_ENV
from bench.serve_soak import stop_server

OPTIONS = ("--hf-config-path", "--tokenizer")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(DIGEST_ENV, raising=False)   # not the shell's pin (conftest undoes what latq-serve sets)
    monkeypatch.setattr(serve, "vllm_cli", lambda: "/opt/venv/bin/vllm")
    return tmp_path / "cache" / SERVED_DIR


def _command(capsys, argv: list[str]) -> list[str]:
    serve.main(["--print-command", *argv])
    return capsys.readouterr().out.split()


def _value(cmd: list[str], opt: str) -> str:
    assert cmd.count(opt) == 1, cmd
    return cmd[cmd.index(opt) + 1]


def _expected(ck: Path) -> dict[str, bytes]:
    """What the copy of checkpoint ``ck`` holds: its tokenizer, template and generation files as they are, and
    its config.json's value with the digest latq-serve checked."""
    names = [n for n in Checkpoint(ck).aux_files()]
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"][DIGEST_KEY] = digest_of(ck)
    return {"config.json": cfg, **{n: (ck / n).read_bytes() for n in names}}


def _held(d: Path) -> dict[str, bytes]:
    return {p.name: json.loads(p.read_text()) if p.name == "config.json" else p.read_bytes() for p in d.iterdir()}


def test_the_command_points_vllm_at_a_private_copy_of_the_verified_files(ck, cache, capsys):
    cmd = _command(capsys, [str(ck), "--port", "9"])
    copy = Path(_value(cmd, "--tokenizer"))
    assert cmd[:3] == ["/opt/venv/bin/vllm", "serve", str(ck)]   # the served model (and its name) stays the path
    assert all(_value(cmd, o) == str(copy) for o in OPTIONS) and _value(cmd, "--load-format") == "latq"
    assert "--generation-config" not in cmd   # vLLM's default reads the copy: a directory named would cap max_tokens
    assert copy == cache / digest_of(ck).removeprefix("sha256:")
    want = _expected(ck)
    assert {"tokenizer.json", "generation_config.json", "chat_template.jinja"} <= want.keys()
    assert _held(copy) == want
    assert os.listdir(cache) == [copy.name]   # nothing half-written left beside it
    assert os.stat(cache).st_mode & 0o077 == 0 and os.stat(copy).st_mode & 0o077 == 0


OTHER_UID = 12345   # a user who is not the caller (root may chown to it)
AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="another user's file needs root to chown")


@pytest.mark.parametrize("damage", ["edit", "extra", "missing", "open", "file",
                                    pytest.param("hardlink", marks=AS_ROOT), pytest.param("foreign", marks=AS_ROOT)])
def test_the_copy_is_verified_again_when_reused(ck, cache, capsys, damage):
    copy = Path(_value(_command(capsys, [str(ck)]), "--tokenizer"))
    if damage == "edit":
        (copy / "generation_config.json").write_text('{"max_new_tokens": 1}')
    elif damage == "extra":
        (copy / "chat_template.json").write_text('{"chat_template": "x"}')
    elif damage == "missing":
        (copy / "tokenizer.json").unlink()
    elif damage == "open":
        os.chmod(copy, 0o777)
    elif damage == "hardlink":   # the same bytes, in a file another user may change after the comparison
        theirs = cache.parent.parent / "theirs.json"
        os.link(copy / "tokenizer.json", theirs)
        os.chown(theirs, OTHER_UID, OTHER_UID)
    elif damage == "foreign":
        os.chown(copy / "config.json", OTHER_UID, OTHER_UID)
    else:
        shutil.rmtree(copy)
        copy.write_text("not a directory")
    assert Path(_value(_command(capsys, [str(ck)]), "--tokenizer")) == copy
    assert _held(copy) == _expected(ck) and os.listdir(cache) == [copy.name]
    assert all(os.stat(f).st_nlink == 1 and os.stat(f).st_uid == os.geteuid() for f in copy.iterdir())
    if damage == "hardlink":   # theirs is kept, as it was
        assert theirs.read_bytes() == (ck / "tokenizer.json").read_bytes() and os.stat(theirs).st_uid == OTHER_UID


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        serve.main(["--print-command", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def _folder_refusal(folder: Path, why: str) -> str:
    return (f"latq-serve: folder {folder}: {why}: whoever can write it can replace the verified files latq-serve hands "
            "vLLM; set LATQ_CACHE to a folder of yours that only you or root can write, in folders that only you or "
            "root can write\n")


@pytest.mark.parametrize("where", ["cache", "above"])
def test_a_folder_others_can_write_is_refused_up_to_the_root(ck, cache, capsys, where):
    """LATQ_CACHE (or a folder above it) that others can write: they could rename served/ away and plant the
    config.json vLLM reads; refused naming the folder and LATQ_CACHE, nothing made in it."""
    folder = cache.parent if where == "cache" else cache.parent.parent
    cache.parent.mkdir(mode=0o700)
    shared_group = [0o775] if os.geteuid() == 0 else []   # group-writable, the group another's (root may chgrp)
    for mode in (0o777, 0o757, *shared_group):
        if mode == 0o775:
            os.chown(folder, -1, OTHER_UID)
        os.chmod(folder, mode)
        assert _refused(capsys, [str(ck)]) == _folder_refusal(folder, f"writable by others (mode {mode:04o})")
        assert not cache.exists()
    os.chmod(folder, 0o1777)   # sticky, as /tmp: what it holds on the way down is the caller's, so it stays put
    assert Path(_value(_command(capsys, [str(ck)]), "--tokenizer")).parent == cache


def test_a_group_writable_folder_of_the_callers_private_group_is_the_callers(ck, cache, capsys):
    """A user-private-group system (umask 002) makes ~/.cache 0775 with the caller's own group, which no one
    else is in: writable by the caller alone, so accepted."""
    import grp
    import pwd
    if set(grp.getgrgid(os.getegid()).gr_mem) - {pwd.getpwuid(os.geteuid()).pw_name}:
        pytest.skip("the caller's group has other members here")
    cache.parent.mkdir(mode=0o700)
    os.chown(cache.parent, -1, os.getegid())
    os.chmod(cache.parent, 0o775)
    assert Path(_value(_command(capsys, [str(ck)]), "--tokenizer")).parent == cache


@AS_ROOT
@pytest.mark.parametrize("where", ["cache", "above"])
def test_a_folder_of_another_user_is_refused(ck, cache, capsys, where):
    """LATQ_CACHE owned by another user, mode 0777 (or a folder above owned by them, even 0755), also sticky:
    the owner may rename what it holds; refused naming the folder and LATQ_CACHE."""
    folder = cache.parent if where == "cache" else cache.parent.parent
    cache.parent.mkdir(mode=0o700)
    for mode in (0o777, 0o755, 0o1777):
        os.chown(folder, OTHER_UID, OTHER_UID)
        os.chmod(folder, mode)
        assert _refused(capsys, [str(ck)]) == _folder_refusal(
            folder, f"owned by uid {OTHER_UID}, not by you (uid {os.geteuid()}) or root")
        assert not cache.exists()


def test_the_folders_checked_are_those_a_link_names(ck, cache, capsys, monkeypatch, tmp_path):
    """LATQ_CACHE through a link: the folders checked are the real ones, and vLLM is handed the real path (a link
    in a folder others can write could be pointed elsewhere once checked)."""
    open_folder, real = tmp_path / "open", tmp_path / "real"
    open_folder.mkdir(mode=0o777)
    os.chmod(open_folder, 0o777)
    real.mkdir(mode=0o700)
    (open_folder / "cache").symlink_to(real)
    monkeypatch.setenv("LATQ_CACHE", str(open_folder / "cache"))
    copy = Path(_value(_command(capsys, [str(ck)]), "--tokenizer"))
    assert copy.parent == real / SERVED_DIR and os.path.realpath(copy) == str(copy)
    os.chmod(real, 0o777)
    assert _refused(capsys, [str(ck)]) == _folder_refusal(real, "writable by others (mode 0777)")


def test_a_users_own_option_is_kept_unpinned_and_refused_beside_a_pin(ck, cache, capsys, tmp_path):
    mine = str(tmp_path / "mine")
    cmd = _command(capsys, [str(ck), "--tokenizer", mine, "--generation-config=vllm"])
    assert _value(cmd, "--tokenizer") == mine and "--generation-config=vllm" in cmd
    copy = str(cache / digest_of(ck).removeprefix("sha256:"))
    assert "--generation-config" not in cmd and _value(cmd, "--hf-config-path") == copy
    cmd = _command(capsys, [str(ck), "--tokenizer", str(ck), "--generation-config", "auto"])   # the checkpoint's own
    assert _value(cmd, "--tokenizer") == copy and _value(cmd, "--generation-config") == "auto"
    cmd = _command(capsys, [str(ck), "--generation-config", str(ck) + "/"])
    assert _value(cmd, "--generation-config") == copy
    digest = digest_of(ck)
    cmd = _command(capsys, [str(ck), "--expect-digest", digest, "--generation-config", "vllm"])   # no file read
    assert _value(cmd, "--generation-config") == "vllm"
    for opt in ("--tokenizer", "--hf_config_path", "--generation-config"):
        with pytest.raises(SystemExit) as e:
            serve.main([str(ck), "--expect-digest", digest, opt, mine])
        assert e.value.code == 2
        name = "--" + opt[2:].replace("_", "-")
        assert capsys.readouterr().err == (
            f"latq-serve: {name} {mine}: vLLM would read the {serve.SERVED_OPTIONS[name]} from {mine}, which the "
            f"pinned digest (--expect-digest, {DIGEST_ENV}) does not cover; leave {name} out (vLLM then reads the "
            "checkpoint's own, from the bytes latq-serve verified)\n")


def test_no_descriptor_or_temporary_outlives_the_hand_over(ck, cache, monkeypatch):
    handed = []

    def execv(exe, cmd):
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")]
        handed.append((cmd, [f for f in fds if f.startswith(str(ck))], os.listdir(cache)))
        raise SystemExit(0)
    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(SystemExit):
        serve.main([str(ck), "--port", "9"])
    (cmd, open_in_ck, entries), = handed
    assert open_in_ck == [] and entries == [digest_of(ck).removeprefix("sha256:")] and "--tokenizer" in cmd


def _reseal_with(ck: Path, generation: dict) -> str:
    (ck / "generation_config.json").write_text(json.dumps(generation))
    return write_manifest(ck)


@pytest.mark.parametrize("pinned", [True, False])
def test_a_swap_right_after_latq_serves_check(pair, cache, capsys, monkeypatch, pinned):
    """B renamed over A once latq-serve verified A: vLLM is handed A's files, and the plugin's config-time check
    (reading the path again) refuses B, naming the manifest."""
    pytest.importorskip("vllm")
    from vllm_latq.plugin.config import LatqCheckpointRefused, LatqConfig

    a, b, da, _ = pair
    db = _reseal_with(b, {"max_new_tokens": 5})
    want = _expected(a)
    monkeypatch.setenv(SWAP_ENV, str(b))
    copy = Path(_value(_command(capsys, [str(a), *(["--expect-digest", da] if pinned else [])]), "--tokenizer"))
    assert digest_of(a) == db and not b.exists()   # swapped, right after latq-serve's check
    assert _held(copy) == want and json.loads((a / "generation_config.json").read_text()) == {"max_new_tokens": 5}
    qc = json.loads((copy / "config.json").read_text())["quantization_config"]
    with pytest.raises(LatqCheckpointRefused) as e:
        LatqConfig.from_config(qc).maybe_update_config(str(a), hf_config=SimpleNamespace(quantization_config=qc))
    why = (f"not the pinned {da}" if pinned else
           f"not {da}, the one latq-serve checked and configured vLLM from: it was replaced after that check")
    assert str(e.value).startswith(f"latq: {a} refused: file latq_manifest.json: the checkpoint's digest is {db}, "
                                   f"{why}"), str(e.value)


def test_vllm_reads_its_config_tokenizer_and_generation_defaults_from_the_copy(ck, cache, capsys):
    """vLLM's own parser and ModelConfig on the command latq-serve builds: the config (its latq quantization config,
    which the plugin's check accepts), the tokenizer and the generation defaults come from the copy; the model and
    the name it is served under stay the checkpoint's path."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_latq.plugin.config import LatqConfig

    _reseal_with(ck, {"max_new_tokens": 3, "temperature": 0.25})
    cmd = _command(capsys, [str(ck), "--max-model-len", "64"])
    copy = _value(cmd, "--tokenizer")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", *cmd[2:]])
    mc = EngineArgs.from_cli_args(args).create_model_config()
    assert (mc.model, mc.served_model_name, mc.tokenizer, mc.hf_config_path) == (str(ck), str(ck), copy, copy)
    assert mc.quantization == "latq" and mc.hf_config.quantization_config[DIGEST_KEY] == digest_of(ck)
    assert mc.get_diff_sampling_param() == {"max_tokens": 3, "temperature": 0.25}
    qc = mc.hf_config.quantization_config
    LatqConfig.from_config(qc).maybe_update_config(mc.model, hf_config=mc.hf_config)   # the plugin's check passes
    assert qc[DIGEST_KEY] == digest_of(ck) and "_latq_fingerprint" in qc


# latq-serve with the readers' swap hook off in its own checks: the swap comes once vLLM's worker has opened and
# verified the pinned checkpoint, the last check, before the API process reads its generation defaults
SWAP_IN_THE_WORKER = ("import sys; from vllm_latq.format import validate; validate.swap_if_asked = lambda path: None; "
                      "from vllm_latq.commands.serve import main; main(sys.argv[1:])")
PROMPT = "The capital of the world is the"


def _variant(src: Path, out: Path, method: str, mark: str, max_new_tokens: int, swap_tokens: bool) -> Path:
    """A checkpoint of ``src``'s weights with its own generation defaults, chat template and (``swap_tokens``) a
    tokenizer whose ids of " the" and " of" are exchanged."""
    from tests import vllm_helpers as h
    s = out.with_name(out.name + "-src")
    shutil.copytree(src, s)
    (s / "generation_config.json").write_text(json.dumps({"max_new_tokens": max_new_tokens}))
    (s / "chat_template.jinja").write_text(mark + "{% for m in messages %} {{ m['content'] }}{% endfor %}")
    if swap_tokens:
        tj = json.loads((s / "tokenizer.json").read_text())
        v = tj["model"]["vocab"]
        v["Ġthe"], v["Ġof"] = v["Ġof"], v["Ġthe"]
        (s / "tokenizer.json").write_text(json.dumps(tj))
    return h.quantize_dir(s, out, method)


def _post(port: int, route: str, body: dict) -> dict:
    import urllib.request
    req = urllib.request.Request(f"http://127.0.0.1:{port}{route}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_pinned_server_answers_with_the_verified_files_through_a_swap(tmp_path):
    """latq-serve --expect-digest A, vLLM's server on 127.0.0.1: B (other generation defaults, chat template and
    token ids) is renamed over A once the worker verified A, before vLLM reads the generation defaults; the server
    answers with A's weights, tokenizer, chat template and generation defaults (max_new_tokens 3, not B's 5) under
    A's path as the model's name."""
    import subprocess
    import sys
    import urllib.request

    from transformers import AutoTokenizer

    from tests import vllm_helpers as h
    from tests.commands.test_serve import _free_port, _wait_healthy

    src = h.make_tiny_llama(tmp_path / "model")
    a = _variant(src, tmp_path / "a", "ssqr", "A-TEMPLATE", 3, False)
    b = _variant(src, tmp_path / "b", "rtn", "B-TEMPLATE", 5, True)
    tok_a, tok_b = AutoTokenizer.from_pretrained(a), AutoTokenizer.from_pretrained(b)
    assert tok_a(PROMPT)["input_ids"] != tok_b(PROMPT)["input_ids"]
    da, db = digest_of(a), digest_of(b)
    want = h.hf_greedy(h.hf_dequantized_model(a), [tok_a(PROMPT)["input_ids"]], 3)[0]
    port, log = _free_port(), tmp_path / "server.log"
    env = {**os.environ, **h.FAST_ENV, "PYTHONPATH": str(h.ROOT), SWAP_ENV: str(b), "LATQ_CACHE": str(tmp_path / "c"),
           "LATQ_KERNEL": "reference"}
    cmd = [sys.executable, "-c", SWAP_IN_THE_WORKER, str(a), "--expect-digest", da, "--host", "127.0.0.1", "--port",
           str(port), "--enforce-eager", "--max-model-len", "128", "--max-num-seqs", "2", "--kv-cache-memory-bytes",
           str(64 << 20), "--dtype", "float32"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_healthy(proc, port, log)
        assert digest_of(a) == db and not b.exists(), log.read_text()[-3000:]   # B is at A's path now
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == [str(a)]
        got = _post(port, "/v1/completions", {"model": str(a), "prompt": PROMPT, "temperature": 0, "max_tokens": 3,
                                              "ignore_eos": True, "return_token_ids": True})
        chat = _post(port, "/v1/chat/completions", {"model": str(a), "messages": [{"role": "user", "content": "hi"}],
                                                    "ignore_eos": True, "return_prompt_text": True})   # no max_tokens
    finally:
        stop_server(proc)
    choice = got["choices"][0]
    assert chat["usage"]["completion_tokens"] == 3, chat   # A's max_new_tokens, the default of a request without one
    assert choice["prompt_token_ids"] == tok_a(PROMPT)["input_ids"], got
    assert choice["text"] == tok_a.decode(choice["token_ids"]), got
    assert choice["token_ids"] == want, got   # A's weights
    assert chat["prompt_text"] == "A-TEMPLATE hi", chat
    assert "linears loaded (ssqr checkpoint)" in log.read_text()
