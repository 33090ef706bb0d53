"""bench/launch_configs.py without a GPU: its command line, one layer's candidates run forced in
Triton's interpreter with a fake timer, a wrong candidate reported, the HEADLINE and the CPU exit."""
import pytest
import torch

from bench import launch_configs as lc
from tests.helpers import FakeTimer

triton = pytest.importorskip("triton")
from tools import launch_table as lt  # noqa: E402
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402


def test_arguments():
    a = lc.parse_args([])
    assert [s[0] for s in a.shapes] == ["8b.down", "8b.o"] and a.m == [1, 4, 8, 16] and a.bits == [4]
    assert lc.parse_args(["--m", "8,64"]).m == [8, 64]
    with pytest.raises(SystemExit):
        lc.parse_args(["--m", "1,65"])          # above one 64-row tile: no launch config of its own


def test_untimed_bits_are_those_this_family_has_no_timing_of():
    rows = [{"family": "sm_90", "bits": 4}, {"family": "sm_80", "bits": 2}]
    assert lc.untimed_bits([2, 3, 4, 5], "sm_90", rows) == [2, 3, 5]
    assert lc.untimed_bits([2, 3, 4, 5], "sm_89", rows) == [2, 3, 4, 5]
    assert lc.untimed_bits([4], "sm_90", rows) == [4]          # every one timed: look again
    assert lc.parse_args(["--untimed"]).untimed and not lc.parse_args([]).untimed


def test_every_candidate_against_the_tables_choice(monkeypatch):
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    log, timings = [], []
    pts = lc.layer_configs(("t", 32, 256), 4, 0.02, [1, 8], torch.bfloat16, torch.device("cpu"), 1, FakeTimer(),
                           log.append, timings)
    st = tk.TritonKernel.prepare(lc.bench_weight(32, 256, 4, 0.02))
    assert [(p["m"], p["kernel"]) for p in pts] == [(1, "gemv"), (8, "mma")]
    timed = 0
    for p in pts:
        bm, cands = tk.launch_candidates(st, p["m"], p["kernel"])
        keys = [lc.key(c) for c in cands]
        table = lc.key(tk.launch_config(st, p["m"], p["kernel"], torch.device("cpu")))
        assert len(cands) > 1 and p["table"] == table and not p["wrong"]
        assert p["best"] == keys[0] and p["best_us"] == timed + 1            # the first timed: 1 µs after the last M's
        assert p["table_us"] == timed + 1 + keys.index(table)
        mine = [t for t in timings if t["m"] == p["m"]]
        assert [lc.key(t["config"]) for t in mine] == keys
        assert {(t["kernel"], t["bm"], t["n"], t["k"], t["family"]) for t in mine} == {(p["kernel"], bm, 32, 256, "cpu")}
        assert [t["us"] for t in mine] == [timed + 1 + i for i in range(len(cands))]
        timed += len(cands)
    assert lc.headline(pts, "Fake GPU").startswith("HEADLINE table_over_best_max=")
    assert "points=2 wrong=0 gpu=Fake_GPU" in lc.headline(pts, "Fake GPU")
    assert sum("<- table" in line for line in log) == 2 and "FAILED" not in "\n".join(log)


def test_a_wrong_candidate_is_named_and_not_timed(monkeypatch):
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    st = tk.TritonKernel.prepare(lc.bench_weight(32, 256, 4, 0.0))
    table = lc.key(tk.launch_config(st, 1, "gemv", torch.device("cpu")))
    victim = next(lc.key(c) for c in tk.launch_candidates(st, 1, "gemv")[1] if lc.key(c) != table)
    real = tk.launch

    def launch(st, x2, bias, kernel, config=None, scratch=None):
        y = real(st, x2, bias, kernel, config, scratch)
        return y * 2 if config is not None and lc.key(config) == victim else y
    monkeypatch.setattr(tk, "launch", launch)
    timer = FakeTimer()
    timings = []
    pts = lc.layer_configs(("t", 32, 256), 4, 0.0, [1], torch.bfloat16, torch.device("cpu"), 1, timer,
                           lambda s: None, timings)
    n = len(tk.launch_candidates(st, 1, "gemv")[1])
    assert len(pts[0]["wrong"]) == 1 and f"BN={victim[0]} SPLIT={victim[1]}" in pts[0]["wrong"][0]
    assert timer.n == n - 1 and lc.headline(pts, "g").endswith("wrong=1 gpu=g")
    assert [lc.key(t["config"]) for t in timings if t["us"] == lt.WRONG] == [victim]     # recorded, never served
    assert len(timings) == n


def test_without_cuda_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lc.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "HEADLINE table_over_best_max=na table_over_best_median=na points=0 wrong=0 gpu=none"


def test_the_json_holds_every_timing_after_each_layer(monkeypatch, tmp_path):
    """``--json``: rewritten after each layer, so a sweep a time limit stops keeps what it timed."""
    import json
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    out = tmp_path / "timings.json"
    a = lc.parse_args(["--shapes", "32x256", "--bits", "2,4", "--m", "1", "--json", str(out)])
    seen = []
    real = lc.layer_configs

    def layer(*args, **kw):
        seen.append(len(json.loads(out.read_text())) if out.exists() else 0)
        return real(*args, **kw)
    monkeypatch.setattr(lc, "layer_configs", layer)
    timings = []
    lc.sweep(a, torch.device("cpu"), 1, FakeTimer(), lambda s: None, timings)
    rows = json.loads(out.read_text())
    assert seen[0] == 0 and 0 < seen[1] < len(rows) == len(timings)
    assert {r["bits"] for r in rows} == {2, 4}
