"""Reads are bounded: a FIFO, a device or a directory where a file of the checkpoint belongs, a
file past its size cap, JSON nested past the limit or holding a number that is not finite, and a
loop of links are each refused with exit code 2 naming the file — never a hang, a traceback or
an out-of-memory. ``--calib /dev/zero`` and a FIFO as calibration text likewise."""
from __future__ import annotations

import json
import os

import pytest

from vllm_latq import bounded_io
from vllm_latq.commands import inspect, quantize as cli
from vllm_latq.errors import FormatError
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.files import INDEX_FILE, MANIFEST_FILE, STATS_FILE

GPTQ = ["--method", "gptq", "--nsamples", "2", "--seqlen", "16", "--no-progress"]
DEEP = "[" * 100_000 + "]" * 100_000


def _shard(d) -> str:
    return sorted(Checkpoint(d).shards)[0]


def _refused(d, capsys, name, *fragments, verify=True):
    assert inspect.inspect_main([str(d), "--no-served", *([] if verify else ["--no-verify"])]) == 2
    err = capsys.readouterr().err
    assert f"{name}: " in err and all(f in err for f in fragments), err
    assert "Traceback" not in err


FILES = ["config.json", MANIFEST_FILE, STATS_FILE, INDEX_FILE, "tokenizer.json", "shard"]


# func_only: the limit is the test's own; the shared checkpoints that a first test builds or
# waits for (another worker building them, on a loaded machine) are not in it
@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("name", FILES)
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(ck, capsys, name):
    name = _shard(ck) if name == "shard" else name
    (ck / name).unlink()
    os.mkfifo(ck / name)
    _refused(ck, capsys, name, "a FIFO, not a regular file")


@pytest.mark.parametrize("name", ["config.json", STATS_FILE, "shard"])
def test_a_device_or_directory_in_place_of_a_file_is_refused(ck, capsys, name):
    name = _shard(ck) if name == "shard" else name
    (ck / name).unlink()
    if name == STATS_FILE:
        (ck / name).mkdir()
        _refused(ck, capsys, name, "a directory, not a regular file")
    else:   # a device linked in: refused as a link leaving the checkpoint, before it is opened
        (ck / name).symlink_to("/dev/zero")
        _refused(ck, capsys, name, "a symbolic link to /dev/zero", "refused")


@pytest.mark.parametrize("name", ["config.json", MANIFEST_FILE, STATS_FILE, INDEX_FILE])
def test_deep_json_is_refused_naming_the_file(ck, capsys, name):
    (ck / name).write_text(DEEP)
    _refused(ck, capsys, name, "JSON nested 100000 levels deep, more than 64")


@pytest.mark.parametrize("key, literal", [("rms_norm_eps", "NaN"), ("rope_theta", "1e400"), ("x", "-Infinity")])
def test_json_numbers_must_be_finite(ck, capsys, key, literal):
    cfg = json.loads((ck / "config.json").read_text())
    cfg[key] = "__X__"
    (ck / "config.json").write_text(json.dumps(cfg).replace('"__X__"', literal))
    _refused(ck, capsys, "config.json", f"{literal} is not a finite number", verify=False)


def test_an_oversized_json_file_is_refused_before_it_is_read(ck, capsys):
    with open(ck / STATS_FILE, "r+b") as f:   # sparse: 128 MiB on paper, nothing written
        f.truncate(128 << 20)
    _refused(ck, capsys, STATS_FILE, "more than the 67108864 such a file may hold")


def test_a_deep_safetensors_header_is_refused(ck, capsys):
    shard = _shard(ck)
    body = ('{"__metadata__": {"x": ' + DEEP + "}}").encode()
    (ck / shard).write_bytes(len(body).to_bytes(8, "little") + body)
    _refused(ck, capsys, shard, "header: JSON nested")


def test_a_loop_of_links_is_refused(ck, capsys):
    (ck / "tokenizer.json").unlink()
    (ck / "tokenizer.json").symlink_to("tokenizer.json.loop")
    (ck / "tokenizer.json.loop").symlink_to("tokenizer.json")
    _refused(ck, capsys, "tokenizer.json", "a symbolic link loop")


@pytest.mark.timeout(120, func_only=True)
@pytest.mark.parametrize("calib", ["/dev/zero", "fifo.txt", "deep.jsonl"])
def test_calibration_text_is_read_within_bounds(tiny_llama, tmp_path, capsys, calib):
    if calib == "fifo.txt":
        calib = str(tmp_path / calib)
        os.mkfifo(calib)
    elif calib == "deep.jsonl":
        calib = str(tmp_path / calib)
        with open(calib, "w") as f:
            f.write('{"text": "fine"}\n' + DEEP + "\n")
    out = tmp_path / "out"
    assert cli.main([str(tiny_llama), str(out), *GPTQ, "--calib", calib]) == 2
    err = capsys.readouterr().err
    assert calib in err and ("not a regular file" in err or "nested" in err), err
    assert not list(tmp_path.glob("out*"))


def test_the_json_reader_counts_brackets_outside_strings_only():
    assert bounded_io.json_depth('{"a": "' + "[" * 500 + '"}') == 1
    assert bounded_io.json_depth("[" * 65 + "]" * 65) == 65
    with pytest.raises(FormatError, match="file x: JSON nested 65 levels deep"):
        bounded_io.parse_json("[" * 65 + "]" * 65, name="x")
    assert bounded_io.parse_json("[" * 64 + "]" * 64, name="x") == json.loads("[" * 64 + "]" * 64)
