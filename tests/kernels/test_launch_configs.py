"""Launch configurations without autotuning: the packaged table per GPU family, the rule for
shapes it lacks, the autotuner's pruning, and the launch plumbing — the code a GPU runs,
driven here with stubbed device capabilities (the kernels recorded, not run)."""
import json
import tomllib
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from vllm_latq.kernels.triton import configs as cfg  # noqa: E402
from vllm_latq.kernels.triton.device import _row_offset  # noqa: E402
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402
from vllm_latq.kernels.triton import layout as tlay  # noqa: E402
from vllm_latq.kernels.triton.kernel import TritonKernel  # noqa: E402
from vllm_latq.testing.weights import random_weight  # noqa: E402

DEVICES = [((8, 0), 108), ((8, 6), 84), ((8, 9), 142), ((9, 0), 132), ((12, 0), 170)]


class Recorder:
    """Stands in for a jit kernel: records grid and launch keywords instead of running."""
    def __init__(self, seen):
        self.seen = seen

    def __getitem__(self, grid):
        return lambda *args, **kw: self.seen.append((grid, kw))


@pytest.fixture
def recorded(monkeypatch):
    seen = []
    for kind in ("gemv", "mma"):
        monkeypatch.setitem(tk._KERNELS, kind, Recorder(seen))

    def no_tuning(*a, **k):
        raise AssertionError("autotuner reached without LATQ_AUTOTUNE=1")
    monkeypatch.setattr(tk, "tuned", no_tuning)
    monkeypatch.delenv(cfg.ENV_AUTOTUNE, raising=False)
    return seen


def layer(n, k, bits=4):
    w = random_weight(n, k, bits, 0.0, seed=1)
    return TritonKernel.prepare(w)


def test_families():
    assert [cfg.family(c) for c, _ in DEVICES] == ["sm_80", "sm_86", "sm_89", "sm_90", "sm_90"]
    assert cfg.family((8, 7)) == "sm_86"
    with pytest.raises(ValueError, match="8.0"):
        cfg.family((7, 5))


@pytest.mark.parametrize("cap,sms", DEVICES)
@pytest.mark.parametrize("m", [1, 3, 8, 16, 40, 100])
def test_launch_uses_the_planned_config(recorded, monkeypatch, cap, sms, m):
    """Every launch takes :func:`tk.launch_config`'s choice for the stubbed device, one of the
    shape's candidates, and never reaches the autotuner."""
    monkeypatch.setattr(cfg, "INTERPRETER_DEVICE", (cap, sms))
    st = layer(2048, 1024)
    x = torch.zeros(m, 1024, dtype=torch.float16)
    kind = "gemv" if m < 8 else "mma"
    TritonKernel.apply(st, x, kernel=kind)
    (grid, kw), = recorded
    plan = tk.launch_config(st, m, kind, x.device)
    ks = tlay.k_steps(4, st.k_pad)
    cands = cfg.candidates(kind, 4, plan["BM"], st.n_pad, ks["nsteps"] + ks["tsteps"], plan["SPLIT"] > 1 or m <= 16)
    assert {k: kw[k] for k in ("BN", "SPLIT", "num_warps", "num_stages")} == \
        {k: plan[k] for k in ("BN", "SPLIT", "num_warps", "num_stages")}
    assert {k: v for k, v in plan.items() if k != "BM"} in cands
    assert kw["BM"] == plan["BM"] and grid == (triton.cdiv(m, plan["BM"]), triton.cdiv(st.n_pad, kw["BN"]), kw["SPLIT"])


def test_choice_is_made_once_per_shape(monkeypatch):
    """An eager forward asks for every layer's config on every call: the choice is remembered per
    shape and table, and made again once the table is reloaded."""
    made = []
    real = cfg.candidates
    monkeypatch.setattr(cfg, "candidates", lambda *a: made.append(a) or real(*a))
    cfg.reload_table()
    st = layer(2048, 1024)
    cpu = torch.device("cpu")
    for _ in range(3):
        first = tk.launch_config(st, 1, "gemv", cpu)
    first["BN"] = -1                                   # a caller's copy: the remembered choice stays
    assert len(made) == 1 and tk.launch_config(st, 1, "gemv", cpu)["BN"] > 0
    tk.launch_config(st, 4, "gemv", cpu)
    assert len(made) == 2
    cfg.reload_table()
    tk.launch_config(st, 1, "gemv", cpu)
    assert len(made) == 3


def test_table_entry_wins_per_family(recorded, monkeypatch, tmp_path):
    """An override table (``LATQ_LAUNCH_CONFIGS``) entry is what the launch runs on its family
    only; the other family keeps the packaged/rule choice; an entry that is not a candidate
    for the shape (SPLIT on several M tiles) is ignored."""
    st = layer(2048, 1024)
    key = cfg.shape_class("gemv", 4, 1, st.n_pad, st.k_pad)
    entry = {"BN": 128, "SPLIT": 2, "num_warps": 8, "num_stages": 1}
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"families": {"sm_90": {key: entry}}}))
    monkeypatch.setenv(cfg.ENV_TABLE, str(path))
    x = torch.zeros(1, 1024, dtype=torch.float16)
    for cap, want in (((9, 0), True), ((8, 0), False)):
        monkeypatch.setattr(cfg, "INTERPRETER_DEVICE", (cap, 132))
        TritonKernel.apply(st, x, kernel="gemv")
        kw = recorded.pop()[1]
        assert ({k: kw[k] for k in entry} == entry) is want
    st2 = layer(2048, 1024)
    bad = cfg.shape_class("mma", 4, 64, st2.n_pad, st2.k_pad)
    path.write_text(json.dumps({"families": {"sm_90": {bad: {"BN": 32, "SPLIT": 4, "BR": 2, "num_warps": 4}}}}))
    cfg.reload_table()
    monkeypatch.setattr(cfg, "INTERPRETER_DEVICE", ((9, 0), 132))
    TritonKernel.apply(st2, torch.zeros(100, 1024, dtype=torch.float16), kernel="mma")
    assert recorded.pop()[1]["SPLIT"] == 1
    # stages come from the candidate (what the offline compile checked), not from the table
    path.write_text(json.dumps({"families": {"sm_90": {key: dict(entry, num_stages=3)}}}))
    cfg.reload_table()
    TritonKernel.apply(st, x, kernel="gemv")
    kw = recorded.pop()[1]
    assert (kw["BN"], kw["SPLIT"], kw["num_stages"]) == (128, 2, 1)


def test_rule_is_deterministic_and_fills_the_gpu():
    many = cfg.candidates("gemv", 4, 1, 28672, 32, True)
    c = cfg.rule(many, 28672, 1, 108)
    assert c["SPLIT"] == 1 and c["BN"] == 128 and 28672 // 128 >= 216
    few = cfg.candidates("gemv", 4, 1, 4096, 32, True)
    c = cfg.rule(few, 4096, 1, 108)
    assert (4096 // c["BN"]) * c["SPLIT"] >= 216 and c["SPLIT"] == 2
    tiny = cfg.candidates("gemv", 4, 1, 48, 3, True)
    assert cfg.rule(tiny, 48, 1, 108) == cfg.rule(list(tiny), 48, 1, 108) and max(c["SPLIT"] for c in tiny) == 2
    assert cfg.candidates("gemv", 4, 1, 32768, 32, True) == [c for c in cfg.configs_for("gemv", 1, 4, pipelined=True)
                                                          if c["SPLIT"] == 1]


def test_prune_hook_is_the_candidates():
    """The autotuner (``LATQ_AUTOTUNE=1``) prunes to exactly the shape's unpipelined candidates: it
    tunes the unpipelined kernel, the pipelined ones are served only from measured table entries."""
    for kernel, bm, m, n_pad, steps in (("gemv", 1, 1, 4096, 8), ("mma", 16, 16, 4096, 8), ("mma", 64, 200, 4096, 8),
                                        ("gemv", 8, 8, 32768, 32)):
        tuner = tk.tuned(kernel, 4, tk.m_bucket(m))
        kept = tk._prune(kernel, 4)(tuner.configs, dict(BM=bm, M=m, N_PAD=n_pad, NSTEPS=steps, TSTEPS=0))
        got = sorted(json.dumps(dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages), sort_keys=True)
                     for c in kept)
        want = sorted(json.dumps({k: v for k, v in c.items() if k != "maxnreg"}, sort_keys=True)
                      for c in cfg.candidates(kernel, 4, bm, n_pad, steps, m <= 16 and bm <= 16) if cfg.depth(c) == 1)
        assert got == want


def test_autotune_only_when_asked(monkeypatch, tmp_path):
    """With ``LATQ_AUTOTUNE=1`` (on a GPU) the launch goes through the autotuner and its choice
    lands in the override table, which the next process's launches read."""
    seen = []

    class Tuner(Recorder):
        best_config = triton.Config({"BN": 64, "SPLIT": 1}, num_warps=4, num_stages=1)
    monkeypatch.setattr(tk, "INTERPRET", False)
    monkeypatch.setattr(tk, "tuned", lambda *a: Tuner(seen))
    monkeypatch.setitem(tk._KERNELS, "gemv", Recorder(seen))
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(cfg.ENV_TABLE, str(path))
    st = layer(2048, 1024)
    x = torch.zeros(1, 1024, dtype=torch.float16)
    monkeypatch.delenv(cfg.ENV_AUTOTUNE, raising=False)
    TritonKernel.apply(st, x, kernel="gemv")
    assert not path.exists() and "BN" in seen.pop()[1]         # a fixed config, no tuning
    monkeypatch.setenv(cfg.ENV_AUTOTUNE, "1")
    TritonKernel.apply(st, x, kernel="gemv")
    assert "BN" not in seen.pop()[1]                            # the tuner chose
    fam = cfg.family(cfg.INTERPRETER_DEVICE[0])
    entry = json.loads(path.read_text())["families"][fam][cfg.shape_class("gemv", 4, 1, st.n_pad, st.k_pad)]
    assert entry == {"BN": 64, "SPLIT": 1, "num_warps": 4, "num_stages": 1}
    monkeypatch.delenv(cfg.ENV_AUTOTUNE)
    TritonKernel.apply(st, x, kernel="gemv")
    kw = seen.pop()[1]
    assert (kw["BN"], kw["SPLIT"], kw["num_stages"]) == (64, 1, 1)


def test_packaged_table():
    """The table ships as package data, covers every family, and each entry is a candidate of
    its own shape class, at the candidate's stages (so :func:`cfg.choose` takes it)."""
    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "kernels/triton/launch_configs.json" in data["tool"]["setuptools"]["package-data"]["vllm_latq"]
    table = json.loads(cfg.TABLE_FILE.read_text())["families"]
    assert set(table) == set(cfg.FAMILY_SMS) and all(len(v) > 100 for v in table.values())
    for fam, entries in table.items():
        for key, entry in entries.items():
            kernel, b, bm, n, k = key.split("/")
            if kernel == "route":
                assert entry == {"kernel": "mma"} and fam in cfg.PIPE_FAMILIES + ("sm_86", "sm_89"), (fam, key)
                continue
            bits, bm, n_pad, k_pad = int(b[1:]), int(bm[2:]), int(n[1:]), int(k[1:])
            ks = tlay.k_steps(bits, k_pad)
            cands = cfg.candidates(kernel, bits, bm, n_pad, ks["nsteps"] + ks["tsteps"], True, fam)
            # stages included: a table may not serve a tile at stages the offline compile never checked
            assert entry in [{k: v for k, v in c.items() if k != "maxnreg"} for c in cands], (fam, key)


def word_limit_rows(k, bits):
    """Most rows (a multiple of 16) whose planes stay under 2³¹ int32 words at K = k."""
    return (2**31 * 32 - 1) // (k * bits) // 16 * 16


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_word_index_limit(bits, monkeypatch):
    """``can_implement`` refuses a layer whose planes reach 2³¹ int32 words (N·K·b/32) and
    accepts the one just below, at every bit width (no tensors of that size are made)."""
    from types import SimpleNamespace
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    k = 8192
    n = word_limit_rows(k, bits)
    for rows, ok in ((n, True), (n + 16, False)):
        w = SimpleNamespace(out_features=rows, in_features=k, bits=bits, nnz=0, group_size=128,
                            scales=torch.empty(1, 64))
        got, why = TritonKernel.can_implement(w, "cpu", torch.float16)
        assert got is ok, (rows, why)
        assert ok or "2³¹" in why
    w = SimpleNamespace(out_features=16, in_features=k, bits=bits, nnz=2**31 // 16, group_size=128,
                        scales=torch.empty(1, 64))
    assert TritonKernel.can_implement(w, "cpu", torch.float16)[0] is False


def test_row_offsets_are_int64():
    """The kernels' row address ``rows · stride`` does not wrap at 2³¹ (a 16k-token prefill into a
    128k-row head): the device helper computed in a kernel, for offsets around the boundary."""
    @triton.jit
    def offsets(out_ptr, stride, R: tl.constexpr):
        rows = tl.arange(0, R) + 16376
        tl.store(out_ptr + tl.arange(0, R), _row_offset(rows, stride))

    out = torch.zeros(16, dtype=torch.int64)
    stride = 131072
    offsets[(1,)](out, stride, R=16)
    want = (torch.arange(16, dtype=torch.int64) + 16376) * stride
    assert want.max() > 2**31 and torch.equal(out, want)


def test_pipelined_candidates_are_offered_but_never_ruled():
    """The pipelined configs are candidates on PIPE_FAMILIES only (their compile is checked there),
    after the unpipelined ones; the rule and ties keep the unpipelined kernels."""
    plain = cfg.candidates("gemv", 4, 1, 4096, 32, True, "sm_86")
    both = cfg.candidates("gemv", 4, 1, 4096, 32, True, "sm_90")
    assert all(cfg.depth(c) == 1 for c in plain) and both[:len(plain)] == plain
    assert {cfg.depth(c) for c in both[len(plain):]} == {cfg.PIPE_DEPTH["gemv", 4, 1]}
    assert all(cfg.depth(c) == 1 for c in cfg.candidates("mma", 3, 16, 4096, 8, True, "sm_90"))
    assert cfg.depth(cfg.rule(both, 4096, 1, 132)) == 1 and cfg.rule(both, 4096, 1, 132) == cfg.rule(plain, 4096, 1, 132)
    piped = dict(plain[0], DEPTH=4)
    assert min([piped, plain[0]], key=cfg.preference) is plain[0]


def test_a_table_entry_serves_a_pipelined_config_and_routes_small_m(recorded, monkeypatch, tmp_path):
    """An entry with DEPTH launches the pipelined kernel (on a family that has it); a ``route``
    entry sends M < 8 of its class to the tensor-core kernel, the GEMV serving elsewhere."""
    monkeypatch.setitem(tk._PIPELINED, "gemv", Recorder(recorded))
    st = layer(2048, 1024)
    key = cfg.shape_class("gemv", 4, 1, st.n_pad, st.k_pad)
    entry = {"BN": 64, "SPLIT": 2, "num_warps": 4, "num_stages": 1, "DEPTH": cfg.PIPE_DEPTH["gemv", 4, 1]}
    path = tmp_path / "tuned.json"
    route = cfg.shape_class("route", 4, 4, st.n_pad, st.k_pad)
    path.write_text(json.dumps({"families": {"sm_90": {key: entry, route: {"kernel": "mma"}}}}))
    monkeypatch.setenv(cfg.ENV_TABLE, str(path))
    cfg.reload_table()
    monkeypatch.setattr(cfg, "INTERPRETER_DEVICE", ((9, 0), 132))
    TritonKernel.apply(st, torch.zeros(1, 1024, dtype=torch.float16))
    kw = recorded.pop()[1]
    assert {k: kw[k] for k in entry} == entry
    ran = []
    monkeypatch.setattr(tk, "launch", lambda st, x2, bias, kernel, config, scratch:
                        ran.append(kernel) or x2.new_zeros(x2.shape[0], st.n))
    for m, want in ((1, "gemv"), (3, "mma"), (4, "mma"), (5, "gemv"), (8, "mma")):
        TritonKernel.apply(st, torch.zeros(m, 1024, dtype=torch.float16))
        assert ran.pop() == want, m
    TritonKernel.apply(st, torch.zeros(4, 1024, dtype=torch.float32))       # fp32: the exact GEMV
    assert ran.pop() == "gemv"
    monkeypatch.setattr(cfg, "INTERPRETER_DEVICE", ((8, 6), 84))             # another family: no route
    TritonKernel.apply(st, torch.zeros(4, 1024, dtype=torch.float16))
    assert ran.pop() == "gemv"
