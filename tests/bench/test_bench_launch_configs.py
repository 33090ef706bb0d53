"""bench/launch_configs.py without a GPU: its command line, one layer's candidates run forced in
Triton's interpreter with a fake timer, a wrong candidate reported, the HEADLINE and the CPU exit."""
import pytest
import torch

from bench import launch_configs as lc
from tests.helpers import FakeTimer

triton = pytest.importorskip("triton")
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402


def test_arguments():
    a = lc.parse_args([])
    assert [s[0] for s in a.shapes] == ["8b.down", "8b.o"] and a.m == [1, 4, 8, 16] and a.bits == [4]
    assert lc.parse_args(["--m", "8,64"]).m == [8, 64]
    with pytest.raises(SystemExit):
        lc.parse_args(["--m", "1,65"])          # above one 64-row tile: no launch config of its own


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
        assert [tuple(t["config"].get(k) for k in lc.TUNED) for t in mine] == keys
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
    pts = lc.layer_configs(("t", 32, 256), 4, 0.0, [1], torch.bfloat16, torch.device("cpu"), 1, timer,
                           lambda s: None)
    n = len(tk.launch_candidates(st, 1, "gemv")[1])
    assert len(pts[0]["wrong"]) == 1 and f"BN={victim[0]} SPLIT={victim[1]}" in pts[0]["wrong"][0]
    assert timer.n == n - 1 and lc.headline(pts, "g").endswith("wrong=1 gpu=g")


def test_without_cuda_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lc.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "HEADLINE table_over_best_max=na table_over_best_median=na points=0 wrong=0 gpu=none"
