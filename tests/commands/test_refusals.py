"""The commands' refusals a user meets first: ``latq-eval --output`` checked writable before the
evaluation (and a write that fails after it names the path, the result printed), ``--device``
values no machine or not this one computes on — each one line, exit 2, before any work."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from vllm_latq.commands import evaluate
from vllm_latq.commands import quantize as cli
from vllm_latq.format import writer

EVAL = ["--nwindows", "1", "--seqlen", "16", "--no-progress"]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("The tiny model reads this. " * 40)
    return path


def _run(capfd, main, *args) -> tuple[int, str, str]:
    capfd.readouterr()
    rc = main([*map(str, args)])
    out, err = capfd.readouterr()
    return rc, out, err


def _no_evaluation(*a, **k):
    raise AssertionError("evaluated before the output was checked")


@pytest.mark.parametrize("case", ["missing", "directory", "fifo", "read-only", "full", "file-size"])
def test_eval_output_is_checked_before_the_evaluation(tiny_checkpoints, tmp_path, text, capfd, monkeypatch, case):
    """A folder missing or no folder, a pipe or device (never replaced by the result's file), read-only
    (EROFS), full (ENOSPC) or past ``ulimit -f``: one line naming --output and why, exit 2, the model
    never loaded. Root writes anywhere a mode forbids, so EROFS and ENOSPC come from a stand-in
    ``open`` (ENOSPC for real: tests/format/test_resource_limits.py)."""
    out = {"missing": tmp_path / "nodir" / "r.json", "directory": tmp_path}.get(case, tmp_path / "r.json")
    fails = {"read-only": OSError(errno.EROFS, "Read-only file system"),
             "full": OSError(errno.ENOSPC, "No space left on device"),
             "file-size": OSError(errno.EFBIG, "File too large")}.get(case)
    if fails is not None:
        def refused(*a, **k):
            raise fails
        monkeypatch.setattr(writer, "open", refused, raising=False)
    if case == "fifo":
        os.mkfifo(out)
    monkeypatch.setattr(evaluate, "evaluate", _no_evaluation)
    rc, stdout, err = _run(capfd, evaluate.main, tiny_checkpoints["ssqr"][0], "--text", text, "--output", out, *EVAL)
    assert (rc, stdout) == (2, "") and err.count("\n") == 1, err
    why = {"missing": f"its folder {tmp_path / 'nodir'} does not exist", "directory": "is a directory: name a file",
           "fifo": "is not a regular file (a device, pipe or socket): name a file",
           "read-only": "cannot be written: Read-only file system",
           "full": f"cannot be written: no space left on the device (", "file-size": "cannot be written: the file is "
                                                                                    "too large ("}[case]
    assert err.startswith(f"latq-eval: error: --output {out}") and why in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"] * (case == "fifo") + ["t.txt"]   # no probe left
    assert case != "fifo" or out.is_fifo()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_eval_output_that_fails_after_the_evaluation_keeps_the_result(tiny_checkpoints, tmp_path, text, capfd):
    """The disk fills between the check and the write (here: the write lands on /dev/full): the
    result is printed, the line names the path, exit 2, and no part file is left."""
    out = tmp_path / "r.json"
    (tmp_path / "r.json.part").symlink_to("/dev/full")
    rc, stdout, err = _run(capfd, evaluate.main, tiny_checkpoints["ssqr"][0], "--text", text, "--output", out, *EVAL,
                           "--json")
    assert rc == 2 and json.loads(stdout)["windows"] == 1
    assert err == (f"latq-eval: error: no space left on the device while writing {out} ({err.split(' (', 1)[1]}"), err
    assert "the result is printed above" in err and err.count("\n") == 1
    assert not out.exists() and not os.path.lexists(tmp_path / "r.json.part")


@pytest.mark.parametrize("device,why", [("bogus", "'bogus' is not a device: cpu, cuda or cuda:N"),
                                        ("meta", "meta: latq computes on cpu or cuda, not meta"),
                                        ("cuda", "cuda: CUDA is not available here"),
                                        ("cuda:7", "cuda:7: ")])
def test_a_device_this_machine_lacks_is_one_line(tiny_llama, tmp_path, text, capfd, device, why):
    if (device == "cuda" and torch.cuda.is_available()) or (device == "cuda:7" and torch.cuda.device_count() > 7):
        pytest.skip("this machine has the GPU")
    rc, out, err = _run(capfd, cli.main, tiny_llama, tmp_path / "out", "--device", device, "--no-progress")
    assert rc == 2 and err.startswith(f"latq-quantize: error: device {why}"), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists() and not (tmp_path / "out.tmp-latq").exists()
    rc, out, err = _run(capfd, evaluate.main, tiny_llama, "--text", text, "--device", device, *EVAL)
    assert rc == 2 and err.startswith(f"latq-eval: error: --device {why}") and err.count("\n") == 1, err


def test_eval_refuses_a_window_past_the_model_positions(tiny_llama, text, capfd, monkeypatch):
    """Before the text is tokenized that far (a huge --seqlen once tokenized the whole file)."""
    from vllm_latq.data import text as text_module

    def no_tokenizing(*a, **k):
        raise AssertionError("tokenized")
    monkeypatch.setattr(text_module, "_encode", no_tokenizing)
    rc, out, err = _run(capfd, evaluate.main, tiny_llama, "--text", text, "--seqlen", 2 ** 63, "--no-progress")
    assert rc == 2 and err == (f"latq-eval: error: --seqlen {2 ** 63} is longer than the model's 2048 positions "
                               f"(max_position_embeddings of {tiny_llama})\n"), err


def test_inspect_names_a_missing_checkpoint_and_a_file_for_what_they_are(tmp_path, capfd):
    """``latq-inspect`` on a path that does not exist says so, and on a file that it is not a directory."""
    from vllm_latq.commands.inspect import inspect_main
    f = tmp_path / "ckpt.txt"
    f.write_text("x")
    for path, why in ((tmp_path / "missing", "no such directory"), (f, "not a directory")):
        rc, out, err = _run(capfd, inspect_main, path)
        assert rc == 2 and err.strip().endswith(f"file {path}: {why}"), err
