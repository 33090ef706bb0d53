"""Quantization with several ranks (``torchrun -m vllm_latq.quantize``, gloo on CPU): the
one-rank checkpoint byte for byte at any world size and after a resume at another, and what every
rank does when one fails, dies or was given other options."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_latq import cpu_features
from vllm_latq.quantize import faults, ranks
from vllm_latq.testing.tiny_models import make_tiny_model, make_word_level_model

ARGS = ["--nsamples", "6", "--seqlen", "64", "--no-progress", "-q"]
# 16 Hessian products of 3 sequences: 1, 2 and 3 ranks split them 16, 8/8 and 6/5/5
DIST_ARGS = ["--nsamples", "48", "--seqlen", "64", "--no-progress", "-q"]


def quantize(src, out, world: int, *extra, env=None, args=DIST_ARGS) -> subprocess.CompletedProcess:
    """``latq-quantize`` as a user runs it: plain for one rank, under torchrun for several."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
        if world > 1 else [sys.executable]
    return subprocess.run([*launcher, "-m", "vllm_latq.quantize", str(src), str(out), *args, *extra],
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True, text=True,
                          timeout=600)


def ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, "\n".join(line for line in p.stderr.splitlines() if "model.layers" not in line)[-6000:]


def same_bytes(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.safetensors")) + ["latq_stats.json", "config.json"]
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The tiny Llama quantized by 1, 2 and 3 ranks."""
    root = tmp_path_factory.mktemp("dist")
    src = make_tiny_model(root / "src", "llama")
    for w in (1, 2, 3):
        ok(quantize(src, root / f"w{w}", w))
    return src, root


def test_same_checkpoint_at_any_world_size(dense):
    """The ranks' Hessian sums are exact pairs merged and rounded once, the products are the same
    sequences' on whichever rank: 2 and 3 ranks write the one-rank checkpoint byte for byte."""
    src, root = dense
    for w in (2, 3):
        assert same_bytes(root / "w1", root / f"w{w}"), w
        assert (root / f"w{w}" / "latq_manifest.json").read_bytes() == (root / "w1" / "latq_manifest.json").read_bytes()


@pytest.mark.slow
def test_resume_at_another_world_size_is_the_one_rank_checkpoint(dense):
    """Stopped after block 0 with 2 ranks, resumed with 2 (--resume) or 3 (the command again, without it): the
    uninterrupted one-rank checkpoint byte for byte."""
    src, root = dense
    for resume_world in (2, 3):
        out = root / f"resumed{resume_world}"
        p = quantize(src, out, 2, env={"LATQ_STOP_AFTER_BLOCK": "0"})
        assert p.returncode != 0 and "simulated interruption after block 0" in p.stderr and not out.exists()
        saved = out.parent / (out.name + ".tmp-latq") / "latq_activations.1.bin"   # every rank's rows, in place
        assert saved.stat().st_size == 48 * 64 * 80 * cpu_features.fastest_float(torch.bfloat16).itemsize
        p = quantize(src, out, resume_world, *(["--resume"] if resume_world == 2 else []))
        ok(p)
        assert "resuming 1 of 2 finished blocks" in p.stderr and same_bytes(out, root / "w1"), resume_world


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
    assert same_bytes(out, root / "w1")


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
                             stderr=subprocess.PIPE, text=True,   # held after the block: killed mid-run, however fast
                             env={**os.environ, "OMP_NUM_THREADS": "1", faults.AT_ENV: "saved-block:hold"})
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
    ok(quantize(src, out, 1, "--resume", args=ARGS))


@pytest.mark.slow   # two ranks held after a block, one of them killed
def test_a_rank_the_launcher_stops_says_why(tmp_path):
    """A rank dies while the other is not in a collective (here: held after the first block): torchrun's
    agent sends the survivor SIGTERM, which says in a line that another rank stopped answering, and
    where, rather than dying silently; a rerun resumes."""
    src = make_tiny_model(tmp_path / "src", "llama", layers=2)
    out = tmp_path / "out"
    progress = out.with_name(out.name + ".tmp-latq") / "latq_progress.json"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              "-m", "vllm_latq.quantize", str(src), str(out), *ARGS], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", faults.AT_ENV: "saved-block:hold"})
    try:
        t0 = time.time()
        while not (progress.exists() and json.loads(progress.read_text())["blocks_done"] == 1) \
                and agent.poll() is None and time.time() - t0 < 300:
            time.sleep(0.2)
        time.sleep(1.0)   # both ranks past the block's last collective, sleeping at the hold
        assert agent.poll() is None, agent.stderr.read()[-3000:]
        rank1 = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == agent.pid
                 and b"RANK=1" in (p / "environ").read_bytes().split(b"\0")]
        assert len(rank1) == 1
        os.kill(rank1[0], 9)
        _, err = agent.communicate(timeout=120)
    finally:
        agent.kill()
    assert agent.returncode != 0
    said = [line for line in err.splitlines() if line.startswith("latq-quantize: ")]
    assert len(said) == 1 and "another rank stopped answering" in said[0], err[-3000:]
    assert "rerun with --resume" in said[0]
    ok(quantize(src, out, 1, "--resume", args=ARGS))


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
@pytest.mark.parametrize("options", [["--method", "ssqr"], ["--method", "hptq", "--compute-dtype", "float32"],
                                     ["--target-correction", "--rotate", "hadamard"],
                                     ["--method", "babai", "--compute-dtype", "bfloat16", "--column-scales", "norm"],
                                     ["--method", "e8", "--bits", "3", "--scale-bits", "4", "--rotate", "hadamard"]],
                         ids=["ssqr", "hptq-fp32", "target-correction-rotated", "babai-bf16-column-scales", "e8"])
def test_every_method_at_any_world_size(dense, options):
    """Each method and the levers that add statistics (cross terms, rotations, folded norms), the
    8-bit head included, in fp32 and bf16 forwards: 3 ranks write the one-rank checkpoint."""
    src, root = dense
    name = "-".join(o.strip("-") for o in options)
    for w in (1, 3):
        ok(quantize(src, root / f"{name}-{w}", w, *options))
    assert same_bytes(root / f"{name}-1", root / f"{name}-3")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "ssqr"])
def test_moe_at_any_world_size(tmp_path, method):
    """Experts go in rounds of one per rank, their Hessians summed over every rank's tokens (at 3
    ranks the block's linears share the first round with one expert): the one-rank checkpoint."""
    src = make_tiny_model(tmp_path / "src", "mixtral", layers=1)
    for w in (1, 2, 3):
        ok(quantize(src, tmp_path / f"w{w}", w, "--method", method))
    for w in (2, 3):
        assert same_bytes(tmp_path / "w1", tmp_path / f"w{w}"), w


@pytest.mark.slow
def test_moe_stopped_and_resumed_at_another_world_size(tmp_path):
    """The tiny Mixtral stopped after block 0 with 3 ranks, resumed with 2: the one-rank checkpoint."""
    src = make_tiny_model(tmp_path / "src", "mixtral", layers=2)
    ok(quantize(src, tmp_path / "w1", 1))
    out = tmp_path / "resumed"
    p = quantize(src, out, 3, env={"LATQ_STOP_AFTER_BLOCK": "0"})
    assert p.returncode != 0 and "simulated interruption after block 0" in p.stderr and not out.exists()
    ok(quantize(src, out, 2, "--resume"))
    assert same_bytes(out, tmp_path / "w1")
    assert any(".experts." in s["name"] for s in json.loads((out / "latq_stats.json").read_text())["layers"])


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
    """The pieces the ranks agree on without talking: shares of the sequences (whole products),
    owners by cost."""
    for size in (1, 2, 3, 5):
        rows = [ranks.own_rows(7, ranks.World(r, size)) for r in range(size)]
        assert [i for r in rows for i in r] == list(range(7)) and max(map(len, rows)) - min(map(len, rows)) <= 1
    rows = [ranks.own_rows(128, ranks.World(r, 3), 8) for r in range(3)]   # 16 products of 8 sequences
    assert rows == [range(0, 40), range(40, 80), range(80, 128)]
    assert [ranks.own_rows(10, ranks.World(r, 2), 4) for r in range(2)] == [range(0, 4), range(4, 10)]
    costs = {"q": 9, "o": 4, "up": 6, "down": 7}
    owner = ranks.assign_by_cost(costs, ranks.World(0, 2))
    assert owner == ranks.assign_by_cost(dict(reversed(costs.items())), ranks.World(1, 2))
    load = [sum(c for n, c in costs.items() if owner[n] == r) for r in range(2)]
    assert sorted(load) == [13, 13]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it on a lent GPU)")
def test_quantize_on_cuda_ranks_equals_one(tmp_path):
    """``--device cuda``: one rank per GPU over NCCL (two where two exist), the same code path
    as gloo; its checkpoint is one rank's byte for byte."""
    src, calib = make_word_level_model(tmp_path)        # no data package: the GPU machine has none
    args = [*ARGS, "--device", "cuda", "--calib", str(calib)]
    world = min(2, torch.cuda.device_count())
    ok(quantize(src, tmp_path / "one", 1, args=args))
    ok(quantize(src, tmp_path / "ranks", world, args=args))
    assert same_bytes(tmp_path / "one", tmp_path / "ranks")
