"""The demo's promises that need no model: it numbers its steps, and Ctrl-C stops it with one line
(no traceback) and exit code 130, saying that a re-run goes on."""
from __future__ import annotations

import pytest

from vllm_latq.commands import demo


def test_steps_are_numbered(capsys):
    step = demo.Steps(3)
    step("one")
    step("two")
    assert capsys.readouterr().err.splitlines() == ["[demo 1/3] one", "[demo 2/3] two"]


def test_ctrl_c_stops_in_one_line(monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(demo, "full_demo", interrupted)
    with pytest.raises(SystemExit) as e:
        demo.main([])
    assert e.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[demo] stopped") and "Traceback" not in err[0]


def test_a_checkpoint_another_demo_is_writing_is_one_line(monkeypatch, capsys):
    def locked(*a, **k):
        raise FileExistsError("/c/gptq is being written by another run (latq-quantize, pid 7): wait for it")
    monkeypatch.setattr(demo, "full_demo", locked)
    with pytest.raises(SystemExit) as e:
        demo.main([])
    assert e.value.code == 2
    assert capsys.readouterr().err == "[demo] error: /c/gptq is being written by another run (latq-quantize, " \
                                      "pid 7): wait for it\n"


def test_table_shows_size_beside_bits():
    """Each row's size and its share of the bf16 source sit next to its bits, so a checkpoint bigger
    than its source could not hide in the table."""
    rows = [{"label": "bf16", "bits": 16, "ppl": 10.0, "size": 100 << 20},
            {"label": "GPTQ-4b-g64", "bits": 4.25, "ppl": 11.0, "size": 70 << 20, "outlier_rate": 0.0,
             "rel": 0.01, "cert": None}]
    head, src, q = demo.table(rows)
    assert head.split()[:5] == ["model", "bits/w", "size", "MiB", "of"]
    assert src.split()[:4] == ["bf16", "16.000", "100.0", "100.0%"]
    assert q.split()[:4] == ["GPTQ-4b-g64", "4.250", "70.0", "70.0%"] and "+10.0%" in q
