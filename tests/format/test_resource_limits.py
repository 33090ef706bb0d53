"""A limit of the machine reached while a file is written or read is one line naming the path and
the limit — a full disk (``/dev/full``: a real ENOSPC without root), a file-size limit (a real
``RLIMIT_FSIZE``, as ``ulimit -f`` sets it), an address-space limit (``ulimit -v``) — never a
traceback, and never "invalid checkpoint" for a valid one; a failed write leaves no part file."""
from __future__ import annotations

import errno
import os
import re
import resource
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from vllm_latq import errors
from vllm_latq.bounded_io import copy_regular
from vllm_latq.errors import ResourceLimit
from vllm_latq.format import writer
from vllm_latq.format.safetensors_file import write_safetensors
from vllm_latq.quantize.activations import Activations

ROOT = Path(__file__).resolve().parents[2]
TENSORS = {"w": torch.arange(64 * 1024, dtype=torch.float32)}   # 256 KiB


def _onto_dev_full(path: Path) -> None:
    """Make the next write of ``path`` (through its ``.part``) land on ``/dev/full``: ENOSPC."""
    path.with_name(path.name + ".part").symlink_to("/dev/full")


@contextmanager
def file_size_limit(n: int):
    """``ulimit -f`` for this process within the block (Python ignores SIGXFSZ: writes fail EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("what", ["shard", "json", "copy"])
def test_a_full_disk_names_the_file_being_written(tmp_path, what):
    path = tmp_path / f"out.{what}"
    src = tmp_path / "aux.json"
    src.write_text("{}" * 1000)
    write = {"shard": lambda: write_safetensors(path, TENSORS),
             "json": lambda: writer.write_json(path, {"a": list(range(1000))}),
             "copy": lambda: copy_regular(src, Path("/dev/full"))}[what]
    if what != "copy":
        _onto_dev_full(path)
    with pytest.raises(ResourceLimit) as e:
        write()
    target = "/dev/full" if what == "copy" else str(path)
    assert e.value.errno == errno.ENOSPC
    assert str(e.value).startswith(f"no space left on the device while writing {target} (")
    assert not path.with_name(path.name + ".part").exists() and not path.exists()


@pytest.mark.parametrize("what", ["shard", "json", "activations"])
def test_a_file_size_limit_names_the_file_and_the_limit(tmp_path, what):
    path = tmp_path / f"out.{what}"
    if what == "activations":
        acts = Activations.create(tmp_path, (4, 64, 256), torch.float32, "cpu", budget=0, block=0)
        write, path = (lambda: acts.write(0, torch.ones(64, 256))), acts._part(1)
    else:
        write = {"shard": lambda: write_safetensors(path, TENSORS),
                 "json": lambda: writer.write_json(path, {"a": "x" * 100_000})}[what]
    with file_size_limit(16 << 10), pytest.raises(ResourceLimit) as e:
        write()
    assert e.value.errno == errno.EFBIG
    assert str(e.value) == (f"the file is too large while writing {path} (the file-size limit, ulimit -f, is "
                            "16.00 KiB)")
    assert not Path(f"{path}.part").exists()


def test_a_full_disk_at_the_run_directory_names_it(tmp_path, monkeypatch):
    from vllm_latq.format import output_dir
    from vllm_latq.quantize.resume import RunDir, held_output

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")   # as a write() raises it: no file named
    (tmp_path / "src").mkdir()
    with held_output(tmp_path / "out", tmp_path / "src", overwrite=False) as claim:
        monkeypatch.setattr(output_dir, "mark_temporary", full)
        with pytest.raises(ResourceLimit, match=rf"^no space left on the device while writing {tmp_path}/out\.tmp-latq \("):
            RunDir.open(claim, "fingerprint", resume=False)


def test_other_write_errors_name_the_path(tmp_path):
    with pytest.raises(OSError) as e, errors.writing(tmp_path / "x"):
        raise OSError(errno.EIO, "Input/output error")   # what a failed write() raises: no file named
    assert e.value.errno == errno.EIO and e.value.filename == str(tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="somewhere"), errors.writing(tmp_path / "x"):
        open(tmp_path / "somewhere" / "x", "w")   # names its own file: kept


@pytest.mark.parametrize("raised", [MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. "
                                                                 "DefaultCPUAllocator: can't allocate memory: you "
                                                                 "tried to allocate 40000000000 bytes.")])
def test_out_of_memory_is_a_resource_limit_naming_what_was_read(raised):
    with pytest.raises(ResourceLimit, match=r"^out of memory while reading X \(.*(ulimit -v|available)") as e:
        with errors.limits("reading X"):
            raise raised
    assert "DefaultCPUAllocator" not in str(e.value)
    with pytest.raises(ValueError, match="not mine"), errors.limits("reading X"):
        raise ValueError("not mine")   # the rest passes through


def test_a_command_is_not_begun_without_its_headroom(monkeypatch):
    """Too little memory available (no ``ulimit -v``): refused before the body, saying how much."""
    monkeypatch.setattr(errors, "address_space_left", lambda: None)
    monkeypatch.setattr(errors, "available_memory", lambda: 100 << 20)
    entered = []
    with pytest.raises(ResourceLimit) as e, errors.limits("evaluating M", need=errors.COMMAND_HEADROOM):
        entered.append(True)
    assert str(e.value) == ("out of memory before evaluating M: it takes about 256.00 MiB, and this machine has "
                            "100.00 MiB available") and not entered


def test_a_limit_left_unsaid_when_saying_it_runs_out_of_memory(monkeypatch):
    def no_memory():
        raise MemoryError()
    monkeypatch.setattr(errors, "memory_limit", no_memory)
    with pytest.raises(ResourceLimit) as e, errors.limits("reading X"):
        raise MemoryError()
    assert str(e.value) == "out of memory while reading X" and e.value.errno == errno.ENOMEM


def test_out_of_memory_in_a_valid_checkpoint_is_no_invalid_checkpoint(tiny_checkpoints, tmp_path, monkeypatch,
                                                                      capsys):
    """Building the model (transformers, where many errors mean a bad config) runs out of memory:
    latq-eval and latq-export say so, not that the checkpoint is invalid."""
    from vllm_latq import hf_model
    from vllm_latq.commands import evaluate, export

    def no_memory(*a, **k):
        raise MemoryError()
    monkeypatch.setattr(hf_model, "empty_model", no_memory)
    text = tmp_path / "t.txt"
    text.write_text("The tiny model reads this. " * 40)
    ck = str(tiny_checkpoints["ssqr"][0])
    runs = {"latq-eval": lambda: evaluate.main([ck, "--text", str(text), "--nwindows", "1", "--seqlen", "16",
                                                "--no-progress"]),
            "latq-export": lambda: export.main([ck, str(tmp_path / "x"), "--dequantize-unmapped"])}
    for name, run in runs.items():
        assert run() == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "invalid" not in err, err
        assert re.match(rf"{name}: error: out of memory while .*{re.escape(ck)}", err), err


def _limited(code: str, headroom: int) -> subprocess.CompletedProcess:
    """``code`` run in a process whose address space is limited to what it holds after importing
    the commands plus ``headroom`` bytes (``ulimit -v``, set once the imports are done)."""
    prologue = ("import resource, re, sys\n"
                "import transformers, vllm_latq.commands.evaluate, vllm_latq.commands.export, "
                "vllm_latq.commands.quantize\n"
                "used = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024\n"
                f"resource.setrlimit(resource.RLIMIT_AS, (used + {headroom}, resource.RLIM_INFINITY))\n")
    return subprocess.run([sys.executable, "-c", prologue + code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def test_eval_under_an_address_space_limit_says_out_of_memory(tiny_checkpoints, tmp_path):
    """With almost no room left the tokenizer (Rust: it aborts on a failed allocation) is not
    entered: one line naming the limit, exit 2."""
    text = tmp_path / "t.txt"
    text.write_text("The tiny model reads this. " * 40)
    ck = tiny_checkpoints["ssqr"][0]
    p = _limited(f"sys.exit(vllm_latq.commands.evaluate.main([{str(ck)!r}, '--text', {str(text)!r}, '--nwindows', "
                 "'1', '--seqlen', '16', '--no-progress']))", 16 << 20)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    assert re.match(r"latq-eval: error: out of memory (before|while) .*ulimit -v", p.stderr), p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", ["evaluate", "export", "quantize"])
@pytest.mark.parametrize("headroom_mib", [192, 288, 320, 384, 512, 768])
def test_every_address_space_limit_ends_in_a_result_or_one_line(tiny_llama, tiny_checkpoints, tmp_path, command,
                                                                headroom_mib):
    """Wherever the limit falls, the command ends with its result or one line saying out of memory:
    no abort, no traceback, no "invalid checkpoint"."""
    text = tmp_path / "t.txt"
    text.write_text("The tiny model reads this. " * 40)
    ck = str(tiny_checkpoints["ssqr"][0])
    args = {"evaluate": [ck, "--text", str(text), "--nwindows", "1", "--seqlen", "16", "--no-progress"],
            "export": [ck, str(tmp_path / "x"), "--dequantize-unmapped"],
            "quantize": [str(tiny_llama), str(tmp_path / "q"), "--nsamples", "4", "--seqlen", "64", "--no-progress",
                         "-q"]}[command]
    p = _limited(f"sys.exit(vllm_latq.commands.{command}.main({args!r}))", headroom_mib << 20)
    assert p.returncode in (0, 2), p.stderr[-3000:]
    if p.returncode == 2:
        assert p.stderr.count("\n") == 1 and "out of memory" in p.stderr and "invalid" not in p.stderr, p.stderr


def test_export_under_a_file_size_limit_names_the_shard(tiny_checkpoints, tmp_path):
    """``ulimit -f`` for real, on the whole process: one line naming the file and the limit; the
    export's temporary directory is gone and OUT was never made."""
    out = tmp_path / "x"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
    p = subprocess.run([sys.executable, "-m", "vllm_latq.commands.export", str(tiny_checkpoints["ssqr"][0]), str(out),
                        "--dequantize-unmapped"], preexec_fn=limit, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    assert re.match(rf"latq-export: error: the file is too large while writing {re.escape(str(out))}"
                    r"\.tmp-latq-export/\S+ \(the file-size limit, ulimit -f, is 256\.00 KiB\)$", p.stderr), p.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == []


def test_serve_under_a_file_size_limit_names_the_file(tiny_checkpoints, tmp_path):
    """``ulimit -f`` for real while latq-serve writes the verified files it hands vLLM: one line naming the file
    and the limit, nothing half-written left in served/."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 10, resource.RLIM_INFINITY))
    p = subprocess.run([sys.executable, "-m", "vllm_latq.commands.serve", str(tiny_checkpoints["ssqr"][0]),
                        "--print-command"], preexec_fn=limit, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                            "LATQ_CACHE": str(tmp_path / "cache")})
    served = tmp_path / "cache" / "served"
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    assert re.match(rf"latq-serve: error: the file is too large while writing {re.escape(str(served))}/\.tmp-\S+ "
                    r"\(the file-size limit, ulimit -f, is 4\.00 KiB\)$", p.stderr), p.stderr
    assert os.listdir(served) == []


def _open_files_limited(n: int, module: str, args: list[str]) -> subprocess.CompletedProcess:
    """``python -m vllm_latq.commands.MODULE ARGS`` under ``ulimit -n N`` for real (soft and hard)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    return subprocess.run([sys.executable, "-m", f"vllm_latq.commands.{module}", *args], preexec_fn=limit,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("command", ["inspect", "evaluate", "export", "quantize", "serve"])
def test_an_open_file_limit_is_one_line_naming_it(tiny_llama, tiny_checkpoints, tmp_path, command, monkeypatch):
    """``ulimit -n 16`` for real: the first open past it (an import, a shard, the source's config.json) is one
    line naming the limit, in every command: not an OSError traceback, nor "transformers rejects the config", nor
    "file config.json: cannot be opened"."""
    ck = str(tiny_checkpoints["ssqr"][0])
    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "cache"))
    args = {"export": [ck, str(tmp_path / "x"), "--dequantize-unmapped"],
            "quantize": [str(tiny_llama), str(tmp_path / "q"), "--nsamples", "4", "--seqlen", "64", "--no-progress",
                         "-q"],
            "serve": [ck, "--port", "9"]}.get(command, [ck])
    p = _open_files_limited(16, command, args)
    prog = {"inspect": "latq-inspect", "evaluate": "latq-eval"}.get(command, f"latq-{command}")
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-3000:]
    assert re.match(rf"{prog}: error: too many open files while \S+ .*\(the open-file limit, ulimit -n, is 16\)$",
                    p.stderr), p.stderr


def test_serve_refuses_an_open_file_limit_too_low_for_vllm(tiny_checkpoints, tmp_path, monkeypatch):
    """``ulimit -n 64``: enough to verify the checkpoint, not for vLLM's processes (they end in an OSError
    traceback): latq-serve refuses before starting vLLM, naming the limit and what it takes."""
    from vllm_latq.commands.serve_memory import SERVE_DESCRIPTORS
    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "cache"))
    ck = tiny_checkpoints["ssqr"][0]
    p = _open_files_limited(64, "serve", [str(ck), "--port", "9"])
    files = len(list(ck.iterdir()))
    assert p.returncode == 2 and p.stderr.splitlines()[-1] == (
        f"latq-serve: error: the open-file limit, ulimit -n, is 64: vLLM's server takes about "
        f"{SERVE_DESCRIPTORS + files} descriptors ({SERVE_DESCRIPTORS}, and {files} for the checkpoint's files); "
        "raise it (ulimit -n 65536) and run again"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr


def test_out_of_descriptors_is_a_resource_limit_naming_it():
    e = errors.resource_limit(OSError(errno.EMFILE, "Too many open files"), "reading x")
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert str(e) == f"too many open files while reading x (the open-file limit, ulimit -n, is {soft})"
    assert errors.resource_limit(OSError(errno.ENOENT, "No such file"), "reading x") is None


def test_the_plugin_names_a_limit_reached_while_vllm_builds_its_config(tiny_checkpoints, monkeypatch):
    """``vllm serve`` run directly: out of descriptors while the plugin verifies the checkpoint is one line naming
    the limit, not "file config.json: cannot be opened … refused" (the checkpoint is not at fault)."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm_latq.format.checkpoint import Checkpoint
    from vllm_latq.plugin import config as plugin_config

    ck = tiny_checkpoints["ssqr"][0]
    qc = Checkpoint(ck).config["quantization_config"]

    def out_of_descriptors(path):
        raise OSError(errno.EMFILE, "Too many open files", "config.json")
    monkeypatch.setattr(plugin_config, "verify_for_serving", out_of_descriptors)
    with pytest.raises(plugin_config.LatqResourceLimit) as e:
        plugin_config.LatqConfig.from_config(qc).maybe_update_config(
            str(ck), hf_config=SimpleNamespace(quantization_config=qc))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert str(e.value) == f"latq: too many open files while verifying {ck} (the open-file limit, ulimit -n, is {soft})"
