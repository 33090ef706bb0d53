"""Quantization with several ranks (``torchrun -m vllm_latq.quantize``, gloo on CPU): the
checkpoint at any world size, after a resume at another world size, and what every rank does
when one fails, dies or was given other options."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_latq import cpu_features
from vllm_latq.quantize import ranks
from vllm_latq.testing.tiny_models import make_tiny_model, make_word_level_model

ARGS = ["--nsamples", "6", "--seqlen", "64", "--no-progress", "-q"]


def quantize(src, out, world: int, *extra, env=None, args=ARGS) -> subprocess.CompletedProcess:
    """``latq-quantize`` as a user runs it: plain for one rank, under torchrun for several."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
        if world > 1 else [sys.executable]
    return subprocess.run([*launcher, "-m", "vllm_latq.quantize", str(src), str(out), *args, *extra],
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True, text=True,
                          timeout=600)


def ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, "\n".join(line for line in p.stderr.splitlines() if "model.layers" not in line)[-6000:]


def tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def same_bytes(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.safetensors")) + ["latq_stats.json", "config.json"]
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def outlier_entries(t: dict[str, torch.Tensor], layer: str) -> set[tuple[int, int, float]]:
    """A layer's CSR outliers as (row, column, value) entries: two solves may differ by an entry near
    a tie, which shifts every later position of the arrays but no other entry."""
    crow, col, val = (t[f"{layer}.outlier_{p}"] for p in ("crow", "col", "val"))
    rows = torch.repeat_interleave(torch.arange(crow.numel() - 1), crow.diff().long())
    return set(zip(rows.tolist(), col.tolist(), val.float().tolist()))


def agreement(a: Path, b: Path) -> float:
    """The share of stored quantized values (packed integer words, scales, outlier entries) that agree."""
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    equal = total = 0
    for k in ta:
        if k.endswith(".outlier_crow"):
            ea, eb = (outlier_entries(t, k.removesuffix(".outlier_crow")) for t in (ta, tb))
            equal += len(ea & eb)
            total += max(len(ea), len(eb))
        elif ta[k].dtype in (torch.int32, torch.int16, torch.uint8, torch.int8, torch.float16) \
                and ".outlier_" not in k:
            equal += int((ta[k] == tb[k]).sum())
            total += ta[k].numel()
    return equal / total


def perplexity(ckpt: Path) -> float:
    from vllm_latq.format.checkpoint import load_dequantized_model
    model = load_dequantized_model(ckpt)
    ids = torch.arange(2, 66).remainder(model.config.vocab_size)[None]
    with torch.no_grad():
        return float(torch.exp(model(ids, labels=ids).loss))


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The tiny Llama quantized by 1, 2 and 3 ranks."""
    root = tmp_path_factory.mktemp("dist")
    src = make_tiny_model(root / "src", "llama")
    for w in (1, 2, 3):
        ok(quantize(src, root / f"w{w}", w))
    return src, root


def test_same_checkpoint_at_any_world_size(dense):
    """Every rank's partial Hessians are summed in rank order, so 2 and 3 ranks may differ from
    one in the last bits of H only: the integers agree (here all of them) and so do the models."""
    src, root = dense
    for w in (2, 3):
        assert agreement(root / "w1", root / f"w{w}") >= 0.9999
        assert perplexity(root / f"w{w}") == pytest.approx(perplexity(root / "w1"), rel=1e-3)
        layers = [s["name"] for s in json.loads((root / f"w{w}" / "latq_stats.json").read_text())["layers"]]
        assert layers == [s["name"] for s in json.loads((root / "w1" / "latq_stats.json").read_text())["layers"]]


@pytest.mark.slow
def test_resume_at_another_world_size_and_byte_identical_at_one(dense):
    """Stopped after block 0 with 2 ranks: resumed with 2 it is the uninterrupted 2-rank
    checkpoint byte for byte; resumed with 3 it agrees with it as any two world sizes do."""
    src, root = dense
    for resume_world in (2, 3):
        out = root / f"resumed{resume_world}"
        p = quantize(src, out, 2, env={"LATQ_STOP_AFTER_BLOCK": "0"})
        assert p.returncode != 0 and "simulated interruption after block 0" in p.stderr and not out.exists()
        saved = out.parent / (out.name + ".tmp-latq") / "latq_activations.1.bin"   # every rank's rows, in place
        assert saved.stat().st_size == 6 * 64 * 80 * cpu_features.fastest_float(torch.bfloat16).itemsize
        ok(quantize(src, out, resume_world, "--resume"))
        if resume_world == 2:
            assert same_bytes(out, root / "w2")
        assert agreement(out, root / "w2") >= 0.9999


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_rank_stops_every_rank_and_keeps_the_finished_blocks(dense, killed):
    """Rank 0 too: the writer lost, the rank that remains says so and the finished blocks are kept."""
    src, root = dense
    out = root / f"killed{killed}"
    t0 = time.time()
    p = quantize(src, out, 2, env={"LATQ_FAULT": f"{killed}:layers.1.mlp:kill"})
    assert p.returncode != 0 and time.time() - t0 < 120
    assert "another rank stopped answering" in p.stderr and "block 1" in p.stderr
    run = out.parent / (out.name + ".tmp-latq")
    assert not out.exists() and json.loads((run / "latq_progress.json").read_text())["blocks_done"] == 1
    ok(quantize(src, out, 3, "--resume"))
    assert agreement(out, root / "w1") >= 0.9999


def test_options_that_differ_between_ranks_are_refused(tmp_path):
    """Each rank is given another ``--bits`` (through a launcher that edits its argv): every
    rank refuses before anything is written."""
    src = make_tiny_model(tmp_path / "src", "llama", layers=1)
    launcher = tmp_path / "launch.py"
    launcher.write_text("import os, sys\nfrom vllm_latq.commands.quantize import main\n"
                        "sys.exit(main(sys.argv[1:] + ['--bits', str(4 - int(os.environ['RANK']))]))\n")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(launcher), str(src), str(tmp_path / "out"), *ARGS],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "ranks [1] were given a model, output or options that differ" in p.stderr
    assert p.stderr.count("latq-quantize: ") == 1, p.stderr   # every rank stops, rank 0 says it
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp-latq").exists()


@pytest.mark.slow   # two ranks started and killed, then a resume
def test_ranks_stop_when_their_launcher_is_killed(tmp_path):
    """torchrun's agent killed (SIGKILL: it cannot stop its ranks): the ranks notice their parent
    is gone, stop within seconds, one line says so, nothing is sealed and a rerun resumes."""
    src = make_tiny_model(tmp_path / "src", "llama", layers=1)
    out = tmp_path / "out"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              "-m", "vllm_latq.quantize", str(src), str(out), *ARGS], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        t0 = time.time()
        while not out.with_name(out.name + ".tmp-latq").exists() and agent.poll() is None and time.time() - t0 < 300:
            time.sleep(0.2)
        assert agent.poll() is None, agent.stderr.read()[-3000:]
        ranks = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == agent.pid]
        agent.kill()
        agent.wait()
        t0 = time.time()
        err = agent.stderr.read()   # its end closes when the last rank is gone
        assert time.time() - t0 < 60 and not any(_running(r) for r in ranks), err[-3000:]
    finally:
        agent.kill()
    assert err.count(f"latq-quantize: the ranks' launcher (torchrun's agent, pid {agent.pid}) is gone: every rank of "
                     "this node stops") == 1, err[-3000:]
    assert len(ranks) == 2 and not out.exists()
    ok(quantize(src, out, 1, "--resume"))


def _stat(proc: Path) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command's name: state, parent, ..."""
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _parent(proc: Path) -> int | None:
    fields = _stat(proc)
    return int(fields[1]) if fields else None


def _running(pid: int) -> bool:
    fields = _stat(Path(f"/proc/{pid}"))
    return bool(fields) and fields[0] not in ("Z", "X")   # a zombie has ended: only its parent's wait is left


@pytest.mark.slow
def test_a_failing_rank_names_itself_the_block_and_the_layer(dense):
    src, root = dense
    p = quantize(src, root / "raised", 3, env={"LATQ_FAULT": "2:layers.1.:raise"})   # its first solve in block 1
    assert p.returncode == 1
    assert "rank 2 of 3 failed at block 1: RuntimeError: layer model.layers.1." in p.stderr
    assert "fault injected" in p.stderr and p.stderr.count("latq-quantize: rank 2 of 3 failed") == 1


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "ssqr"])
def test_moe_at_any_world_size(tmp_path, method):
    """Experts go in rounds of one per rank, their Hessians summed over every rank's tokens (at 3
    ranks the block's linears share the first round with one expert)."""
    src = make_tiny_model(tmp_path / "src", "mixtral", layers=1)
    for w in (1, 2, 3):
        ok(quantize(src, tmp_path / f"w{w}", w, "--method", method))
    for w in (2, 3):
        assert agreement(tmp_path / "w1", tmp_path / f"w{w}") >= 0.9999
    stats = json.loads((tmp_path / "w3" / "latq_stats.json").read_text())["layers"]
    assert [s["name"] for s in stats] == [s["name"] for s in
                                          json.loads((tmp_path / "w1" / "latq_stats.json").read_text())["layers"]]


@pytest.mark.slow
def test_moe_stopped_and_resumed_at_another_world_size(tmp_path):
    """The tiny Mixtral stopped after block 0 with 3 ranks, resumed with 2: it agrees with one
    rank's checkpoint; two fresh runs with 3 ranks are the same byte for byte."""
    src = make_tiny_model(tmp_path / "src", "mixtral", layers=2)
    for name, world in (("w1", 1), ("w3", 3), ("again3", 3)):
        ok(quantize(src, tmp_path / name, world))
    assert same_bytes(tmp_path / "w3", tmp_path / "again3")
    out = tmp_path / "resumed"
    p = quantize(src, out, 3, env={"LATQ_STOP_AFTER_BLOCK": "0"})
    assert p.returncode != 0 and "simulated interruption after block 0" in p.stderr and not out.exists()
    ok(quantize(src, out, 2, "--resume"))
    assert agreement(out, tmp_path / "w1") >= 0.9999
    stats = [s["name"] for s in json.loads((out / "latq_stats.json").read_text())["layers"]]
    assert stats == [s["name"] for s in json.loads((tmp_path / "w1" / "latq_stats.json").read_text())["layers"]]
    assert any(".experts." in n for n in stats)


def test_the_linears_fill_the_ranks_the_experts_leave_idle(tmp_path):
    """3 experts on 2 ranks: the first round holds one expert (rank 0), and the block's linears
    are solved beside it, not in a round of their own: a failing attention linear on rank 1 is
    reported from that round."""
    src = make_tiny_model(tmp_path / "src", "mixtral", layers=1, num_local_experts=3)
    p = quantize(src, tmp_path / "out", 2, "--method", "rtn", env={"LATQ_FAULT": "1:layers.0.self_attn:raise"})
    assert p.returncode == 1
    assert ("rank 1 of 2 failed at block 0 and model.layers.0.mlp.experts, experts 0..0: RuntimeError: layer "
            "model.layers.0.self_attn.") in p.stderr


def test_each_rank_runs_the_threads_it_is_given(tmp_path):
    """torchrun gives each rank one thread unless ``OMP_NUM_THREADS`` says otherwise: an explicit
    count is the one every rank runs with, and the run's first line says ranks × threads (an OUT
    that exists ends the run right after it)."""
    (tmp_path / "out").mkdir()
    p = quantize(tmp_path / "src", tmp_path / "out", 2, env={"OMP_NUM_THREADS": "2"}, args=["--no-progress"])
    assert p.returncode != 0 and "exists (pass overwrite=True" in p.stderr
    assert "[rank 0] 2 ranks (gloo) × 2 threads each" in p.stderr


def test_experts_in_rounds_and_the_linears_beside_them():
    """Experts of one module cost the same (their shapes are equal), so dealing them in turn is
    balanced; the short round comes first, where the linears go to the idle ranks by cost."""
    three = ranks.World(0, 3)
    rounds = ranks.expert_rounds(8, three)
    assert [list(r.items()) for r in rounds] == [[(0, 0), (1, 1)], [(2, 0), (3, 1), (4, 2)], [(5, 0), (6, 1), (7, 2)]]
    assert ranks.expert_rounds(3, ranks.SINGLE) == [{0: 0}, {1: 0}, {2: 0}]
    assert ranks.expert_rounds(2, three) == [{0: 0, 1: 1}] and len(ranks.expert_rounds(6, three)[0]) == 3
    # Mixtral-8x7B's shapes: its attention costs less than one expert, so rank 2 takes all of it
    hidden, inter, kv = 4096, 14336, 1024
    expert = 2 * ranks.solve_cost(inter, hidden) + ranks.solve_cost(hidden, inter)
    attention = {"q": ranks.solve_cost(hidden, hidden), "k": ranks.solve_cost(kv, hidden),
                 "v": ranks.solve_cost(kv, hidden), "o": ranks.solve_cost(hidden, hidden)}
    busy = [expert if r in rounds[0].values() else 0 for r in range(3)]
    assert set(ranks.assign_by_cost(attention, three, busy).values()) == {2}
    # more linears than the idle rank can hold beside one expert spill onto the busy ranks
    owner = ranks.assign_by_cost({"a": expert, "b": expert // 2, "c": expert // 2}, three, busy)
    assert owner == {"a": 2, "b": 0, "c": 1}


def test_rank_arithmetic():
    """The pieces the ranks agree on without talking: shares of the sequences, owners by cost."""
    for size in (1, 2, 3, 5):
        rows = [ranks.own_rows(7, ranks.World(r, size)) for r in range(size)]
        assert [i for r in rows for i in r] == list(range(7)) and max(map(len, rows)) - min(map(len, rows)) <= 1
    costs = {"q": 9, "o": 4, "up": 6, "down": 7}
    owner = ranks.assign_by_cost(costs, ranks.World(0, 2))
    assert owner == ranks.assign_by_cost(dict(reversed(costs.items())), ranks.World(1, 2))
    load = [sum(c for n, c in costs.items() if owner[n] == r) for r in range(2)]
    assert sorted(load) == [13, 13]
    assert ranks.sum_in_rank_order(torch.ones(3), ranks.SINGLE).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it on a lent GPU)")
def test_quantize_on_cuda_ranks_equals_one(tmp_path):
    """``--device cuda``: one rank per GPU over NCCL (two where two exist), the same code path
    as gloo; its checkpoint agrees with one rank's."""
    src, calib = make_word_level_model(tmp_path)        # no data package: the GPU machine has none
    args = [*ARGS, "--device", "cuda", "--calib", str(calib)]
    world = min(2, torch.cuda.device_count())
    ok(quantize(src, tmp_path / "one", 1, args=args))
    ok(quantize(src, tmp_path / "ranks", world, args=args))
    assert agreement(tmp_path / "one", tmp_path / "ranks") >= 0.9999
