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
