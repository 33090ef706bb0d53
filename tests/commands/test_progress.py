"""Every long step of the commands shows progress on stderr — a bar on a terminal, one line in a log,
nothing with ``--no-progress`` — and stdout holds the result alone. The steps of a tiny checkpoint
last less than ``progress.DELAY``, so the tests set it to 0 (``shown``) to see what a large model shows."""
from __future__ import annotations

import json
import re

import pytest

from vllm_latq import progress
from vllm_latq.commands import evaluate, export, inspect, serve

EVAL = ["--nwindows", "1", "--seqlen", "16", "--json"]


@pytest.fixture
def shown(monkeypatch):
    """Steps show at once; stderr stays what capsys makes it, not a terminal."""
    monkeypatch.setattr(progress, "DELAY", 0)


@pytest.fixture
def terminal(shown, monkeypatch):
    monkeypatch.setattr(progress, "terminal", lambda: True)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("The tiny model reads this. " * 40)
    return path


def _run(capsys, main, *args) -> tuple[str, str]:
    capsys.readouterr()
    assert main([*map(str, args)]) in (0, None)
    return capsys.readouterr()


def test_a_step_in_a_log_is_one_line_with_its_size(shown, capsys):
    with progress.step("verifying X", total=3 << 20, unit="B") as advance:
        advance(1 << 20)
        advance(2 << 20)
    out, err = capsys.readouterr()
    assert (out, err) == ("", "verifying X: 3.00 MiB\n")


def test_a_step_on_a_terminal_is_a_bar_over_its_total(terminal, capsys):
    with progress.step("verifying X", total=3 << 20, unit="B") as advance:
        advance(3 << 20)
    out, err = capsys.readouterr()
    assert out == "" and "verifying X: 100%" in err and "3.00M/3.00M" in err, err


def test_a_step_shorter_than_the_delay_switched_off_or_drawn_by_a_library_says_nothing(monkeypatch, capsys):
    monkeypatch.setattr(progress, "DELAY", 60)
    with progress.step("quick", total=1):
        pass
    monkeypatch.setattr(progress, "DELAY", 0)
    with progress.step("off", False, total=1):
        pass
    monkeypatch.setattr(progress, "terminal", lambda: True)
    with progress.step("transformers draws this bar", bar=False):
        pass
    assert capsys.readouterr() == ("", "")


def test_a_step_longer_than_the_delay_says_its_line(monkeypatch, capsys):
    import time
    monkeypatch.setattr(progress, "DELAY", 0.05)
    said, deadline = "", time.monotonic() + 60   # a loaded machine may start the timer late: wait for it
    with progress.step("slow"):
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
            said += capsys.readouterr().err
    assert said + capsys.readouterr().err == "slow\n"


def test_inspect_says_what_it_verifies_and_computes(tiny_checkpoints, shown, capsys):
    ck = tiny_checkpoints["ssqr"][0]
    out, err = _run(capsys, inspect.inspect_main, ck, "--json")
    verified, served = err.splitlines()
    assert re.fullmatch(rf"verifying {re.escape(str(ck))} \(sha256, shapes, values\): \d+\.\d\d MiB", verified), err
    assert served == f"served bits of {ck} per kernel family"
    assert json.loads(out)["totals"]["layers"] > 0
    assert _run(capsys, inspect.inspect_main, ck, "--json", "--no-progress") == (out, "")


def test_inspect_on_a_terminal_draws_a_bar_over_the_bytes(tiny_checkpoints, terminal, capsys):
    out, err = _run(capsys, inspect.inspect_main, tiny_checkpoints["ssqr"][0], "--no-served")
    assert "(sha256, shapes, values): 100%" in err and "B/s]" in err, err
    assert "100%" not in out and out.rstrip().splitlines()[-1].startswith("OK: ")


def test_eval_says_verifying_loading_and_measuring(tiny_checkpoints, shown, text, capsys):
    ck = tiny_checkpoints["hptq"][0]
    out, err = _run(capsys, evaluate.main, ck, "--text", text, *EVAL)
    lines = err.splitlines()
    assert lines[0].startswith(f"verifying {ck} (sha256, shapes, values): ") and lines[0].endswith(" MiB"), err
    assert lines[1:] == [f"loading {ck} dequantized to float32", "perplexity: 1 windows × 16 tokens"], err
    assert json.loads(out)["windows"] == 1
    out, err = _run(capsys, evaluate.main, ck, "--text", text, *EVAL, "--no-progress")
    assert err == "" and json.loads(out)["windows"] == 1


def test_eval_of_a_source_model_says_it_loads_it(tiny_llama, shown, text, capsys):
    out, err = _run(capsys, evaluate.main, tiny_llama, "--text", text, *EVAL)
    assert err.splitlines() == [f"loading {tiny_llama} in float32", "perplexity: 1 windows × 16 tokens"], err
    assert json.loads(out)["windows"] == 1


def test_export_says_what_it_verifies_and_writes(tiny_checkpoints, shown, tmp_path, capsys):
    ck = tiny_checkpoints["ssqr"][0]
    out, err = _run(capsys, export.main, ck, tmp_path / "x", "--dequantize-unmapped")
    assert [x.split(":")[0] for x in err.splitlines()[:2]] == [f"verifying {ck} (sha256, shapes, values)",
                                                                f"writing {tmp_path / 'x'} (compressed-tensors)"], err
    assert out.startswith(f"latq-export: {tmp_path / 'x'}: ") and all(x.startswith("latq-export: ")
                                                                     for x in out.splitlines()), out
    out, err = _run(capsys, export.main, ck, tmp_path / "y", "--dequantize-unmapped", "--no-progress")
    assert not any(x.startswith(("verifying", "writing")) for x in err.splitlines()), err


def test_serve_says_what_it_verifies(tiny_checkpoints, shown, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LATQ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(serve, "vllm_cli", lambda: "/opt/venv/bin/vllm")
    ck = tiny_checkpoints["ssqr"][0]
    out, err = _run(capsys, serve.main, ck, "--print-command")
    assert err.startswith(f"verifying {ck} (sha256, shapes, values): "), err
    assert out.startswith("/opt/venv/bin/vllm serve ") and "--no-progress" not in out
    out, err = _run(capsys, serve.main, ck, "--print-command", "--no-progress")
    assert "verifying" not in err and "--no-progress" not in out


def test_every_command_the_readme_names_takes_no_progress(capsys):
    """README, "Use": "Each command shows its long steps ... none with `--no-progress`"."""
    from pathlib import Path

    from vllm_latq.commands import quantize
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert "Each command shows its long steps" in readme and "none with `--no-progress`" in readme
    for main in (quantize.main, inspect.inspect_main, evaluate.main, export.main):
        with pytest.raises(SystemExit):
            main(["--help"])
        assert "--no-progress" in capsys.readouterr().out, main
    assert "--no-progress" in serve.own_parser().format_help()


def test_quantize_says_it_verifies_what_it_wrote(tiny_llama, shown, tmp_path, capsys):
    from vllm_latq.commands import quantize
    args = [tiny_llama, tmp_path / "q", "--method", "rtn", "--group-size", "32", "-q"]
    out, err = _run(capsys, quantize.main, *args)
    assert re.search(rf"^verifying {re.escape(str(tmp_path / 'q'))}\.tmp-latq \(sha256, shapes, values\): ", err,
                     re.M), err
    assert out.startswith(f"latq-quantize: sealed {tmp_path / 'q'}, digest ")
    out, err = _run(capsys, quantize.main, *args[:1], tmp_path / "r", *args[2:], "--no-progress")
    assert "verifying" not in err and out.startswith(f"latq-quantize: sealed {tmp_path / 'r'}, digest ")


def test_quantize_in_a_log_has_no_redrawn_bars(tiny_llama, shown, tmp_path, capsys):
    """A log keeps every redraw of a bar: there, latq-quantize says each step once and each block in its line."""
    from vllm_latq.commands import quantize
    out, err = _run(capsys, quantize.main, tiny_llama, tmp_path / "q", "--method", "gptq", "--group-size", "32",
                    "--nsamples", "2", "--seqlen", "32")
    assert "\r" not in err and "%|" not in err, err
    assert re.search(r"^capturing block-0 inputs$", err, re.M), err
    assert len(re.findall(r"block \d+/\d+: Hessians [\d.]+s, quantization", err)) >= 1, err


def test_quantize_on_a_terminal_draws_its_block_bars(tiny_llama, terminal, tmp_path, capsys):
    from vllm_latq.commands import quantize
    _, err = _run(capsys, quantize.main, tiny_llama, tmp_path / "q", "--method", "gptq", "--group-size", "32",
                  "--nsamples", "2", "--seqlen", "32")
    assert "gptq blocks: 100%" in err and ": Hessians:" in err, err


def test_bar_passes_items_through_where_it_draws_nothing(terminal):
    items = [1, 2, 3]
    assert progress.bar(items, "x", enabled=False) is items
    assert list(progress.bar(items, "x")) == items
