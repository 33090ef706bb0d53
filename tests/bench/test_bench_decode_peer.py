"""bench/decode.py's peer engine (llama.cpp, ``--peer llamacpp``): the worker's protocol on a
stand-in server, the latq checkpoint written as llama.cpp blocks value for value, the bytes
each engine streams per token, and the HEADLINE's peer, thread and byte keys; a slow test runs
the bench for real with llama.cpp beside vLLM."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import decode_engines, decode_peer, latq_gguf
from bench.decode_report import headline, table

gguf = pytest.importorskip("gguf")


# ----------------------------------------------------------------------------- the worker

class FakeServer:
    """xllamacpp.Server's completion call as the worker uses it: ``n_predict`` tokens, or fewer."""
    short = False

    def __init__(self, params):
        self.params = params

    def handle_completions(self, req):
        n = req["n_predict"] - (1 if FakeServer.short else 0)
        assert req["ignore_eos"] and req["temperature"] == 0.0 and req["cache_prompt"] is False
        return {"usage": {"completion_tokens": n}, "choices": [{"text": "x"}]}


def fake_xllamacpp():
    mod = types.ModuleType("xllamacpp")

    class Params:
        def __init__(self):
            self.model = types.SimpleNamespace(path=None)
            self.cpuparams = types.SimpleNamespace(n_threads=0, cpumask=[False] * 8, mask_valid=False, strict_cpu=False)
            self.cpuparams_batch = types.SimpleNamespace(n_threads=0, cpumask=[False] * 8, mask_valid=False,
                                                         strict_cpu=False)
            self.sampling = types.SimpleNamespace(temp=1.0)
    mod.CommonParams, mod.Server = Params, FakeServer
    mod.get_system_info = lambda: "CPU : AVX2 = 1 |"
    return mod


def test_peer_worker_answers_runs_at_batch_1_on_its_threads(monkeypatch):
    monkeypatch.setitem(sys.modules, "xllamacpp", fake_xllamacpp())
    replies, servers = [], []
    monkeypatch.setattr(FakeServer, "__init__", lambda self, params: servers.append(params))
    job = {"gguf": "/m.gguf", "threads": 2, "cores": [0, 2], "tokens": 8}
    reqs = [{"op": "run", "batch": 1}, {"op": "run", "batch": 8}, {"op": "run", "batch": 1}, {"op": "quit"},
            {"op": "run", "batch": 1}]
    decode_peer.serve(job, replies.append, iter(reqs), ["p"])
    cpu = servers[0].cpuparams   # the vLLM engines' cores, a thread pinned to each
    assert cpu.n_threads == 2 and cpu.cpumask[:4] == [True, False, True, False] and cpu.strict_cpu and cpu.mask_valid
    assert replies[0]["load_s"] >= 0 and replies[0]["llamacpp_cpu"].startswith("CPU")
    assert "s" in replies[1] and "s" in replies[3] and "batch 1 only" in replies[2]["error"]
    assert len(replies) == 4        # nothing after quit
    FakeServer.short = True
    try:
        replies.clear()
        decode_peer.serve(job, replies.append, iter([{"op": "run", "batch": 1}]), ["p"])
        assert "generated 7 tokens, not 8" in replies[1]["error"]
    finally:
        FakeServer.short = False


def test_peer_worker_says_when_xllamacpp_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "xllamacpp", None)
    replies = []
    decode_peer.serve({"gguf": "x", "threads": 1, "tokens": 4}, replies.append, iter([]), ["p"])
    assert "pip install xllamacpp" in replies[0]["error"]


# ----------------------------------------------------------------------------- latq as GGUF blocks

@pytest.mark.parametrize("bits", [4, 3, 8, 6])
def test_blocks_hold_latqs_weights_exactly(bits):
    """A dense layer (group 64) written as Q4_0 (≤ 4 bits) or Q8_0 dequantizes, by the gguf package's own
    reader, to exactly latq's dequantized weights."""
    from vllm_latq import format as fmt
    g = torch.Generator().manual_seed(bits)
    n, k, group = 48, 192, 64
    z = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (n, k), generator=g, dtype=torch.int32)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half()
    t = {"qweight": fmt.pack(z, bits), "scales": scales, "outlier_crow": torch.zeros(n + 1, dtype=torch.int32),
         "outlier_col": torch.zeros(0, dtype=torch.int16), "outlier_val": torch.zeros(0, dtype=torch.float16)}
    data, qtype = latq_gguf.layer_blocks(t, bits, group, (n, k))
    assert qtype == (gguf.GGMLQuantizationType.Q4_0 if bits <= 4 else gguf.GGMLQuantizationType.Q8_0)
    got = gguf.quants.dequantize(data, qtype)
    want = fmt.dequantize_layer(t, "dense", (n, k), bits, group).numpy()
    assert got.shape == (n, k) and np.array_equal(got, want)


def test_blocks_refuse_what_llama_cpp_cannot_hold():
    t = {"qweight": torch.zeros(16, 4, dtype=torch.int32), "scales": torch.ones(16, 1).half(),
         "outlier_crow": torch.tensor([0] * 16 + [1], dtype=torch.int32)}
    with pytest.raises(ValueError, match="outliers"):
        latq_gguf.layer_blocks(t, 4, 32, (16, 32))
    with pytest.raises(ValueError, match="multiples of 32"):
        latq_gguf.block_scales(torch.ones(4, 2).half(), 48, 96)


def test_q_rows_in_llama_cpps_order():
    """The reference GGUF (llama.cpp's converter) holds SmolLM2's q and k rows in the order
    ``permute_rows`` gives the HF model's (converted from that GGUF, bf16)."""
    from safetensors import safe_open

    from vllm_latq import data
    ref = gguf.GGUFReader(str(data.MODELS["smollm2-135m"].gguf()))
    src = data.model_dir("smollm2-135m")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for hf, name, heads in (("q_proj", "blk.0.attn_q.weight", 9), ("k_proj", "blk.0.attn_k.weight", 3)):
            w = f.get_tensor(f"model.layers.0.self_attn.{hf}.weight").float()
            t = next(t for t in ref.tensors if t.name == name)
            g = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
            assert torch.allclose(latq_gguf.permute_rows(w, heads), g, rtol=1e-2, atol=1e-3)
            assert not torch.allclose(w, g, rtol=1e-2, atol=1e-3)


# ----------------------------------------------------------------------------- bytes per token

def test_bytes_each_engine_streams():
    """SmolLM2: llama.cpp's shipped GGUF streams its Q4_1 blocks and the Q8_0 head tied to the
    embedding (96.6 MB, 5.45 bits/weight); the bf16 model its 134.5 M weights in 2 bytes."""
    from vllm_latq import data
    n, w = decode_peer.gguf_bytes(data.MODELS["smollm2-135m"].gguf())
    assert (n, w) == (106168320 * 5 // 8 + 28311552 * 34 // 32, 106168320 + 28311552)
    hb, hw = decode_peer.hf_bytes(data.model_dir("smollm2-135m"), 2)
    assert hw == w and hb == 2 * w


def test_thread_binding_cores():
    assert [decode_engines.bind_cores(b) for b in ("0-1", "0", "0,2", "0-3,8")] == [[0, 1], [0], [0, 2], [0, 1, 2, 3, 8]]


def test_thread_counts_take_the_first_cores_this_process_may_use(monkeypatch):
    monkeypatch.setattr(decode_engines.os, "sched_getaffinity", lambda pid: {6, 4, 5})
    assert decode_engines.thread_binds("1,3", None) == {1: "4", 3: "4,5,6"}
    assert decode_engines.thread_binds(None, None) == {3: "4,5,6"}
    assert decode_engines.thread_binds(None, "5-6") == {2: "5-6"}
    with pytest.raises(ValueError, match="may run on 3 cores"):
        decode_engines.thread_binds("4", None)


def test_a_vllm_engine_runs_on_the_threads_and_cores_asked():
    """An in-process vLLM engine gets no OpenMP binding from vLLM: the worker's environment
    (``omp_env``) gives torch one thread per asked core, pinned there."""
    code = "import os, torch; print(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **decode_engines.omp_env([0])},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split(None, 1) == ["1", "[0]\n"]


def test_an_engine_on_other_threads_than_asked_is_an_error_not_a_row(monkeypatch):
    """run_mode gives each vLLM engine ``omp_env`` of its cores and the peer none; an engine
    that reports another thread count is an error in its row and is never timed."""
    seen = []

    class Engine:
        def __init__(self, job, env, logdir):
            seen.append((job["label"], env.get("OMP_NUM_THREADS"), env.get("OMP_PLACES")))
            self.job, self.lines = job, []

        def read(self):
            return {"load_s": 1.0, **({} if self.job.get("peer") else {"omp_threads": 2, "cpus": [0, 1]})}

        def call(self, **req):
            raise AssertionError("an engine on the wrong threads was timed")

        def close(self):
            pass

    monkeypatch.setattr(decode_engines, "Engine", Engine)
    common = {"mode": "compiled", "threads": 1, "cores": [0], "batches": [1], "tokens": 4}
    jobs = [{"label": "bf16", "kernel": None, "repeats": 1, **common},
            {"label": "llama.cpp:Q4_1", "kernel": "llamacpp", "peer": True, "repeats": 0, **common}]
    res = decode_engines.run_mode(jobs, {"OMP_NUM_THREADS": "7"}, repeats=1)
    assert seen == [("bf16", "1", "{0}"), ("llama.cpp:Q4_1", "7", None)]
    assert res[0]["error"] == "the engine ran 2 OpenMP threads, not 1 (on cores [0, 1])" and "error" not in res[1]


# ----------------------------------------------------------------------------- the report

def _engine(label, kernel, times, threads, peer=False, mb=None, bits=None):
    runs = {"1": {"times": times, "tok_s": 4 / sorted(times)[len(times) // 2], "ms_per_step": 1.0}}
    r = {"label": label, "mode": "compiled", "kernel": kernel, "dtype": "gguf" if peer else "bfloat16",
         "tokens": 4, "load_s": 1.0, "gemv_isa": "avx512" if kernel == "cpu" else "", "vllm_ops": "avx512bf16",
         "runs": runs, "threads": threads}
    if peer:
        r["peer"] = True
    if mb:
        r.update(mb_per_token=mb, bits_per_weight=bits)
    return r


def test_headline_pairs_latq_with_each_peer_per_thread_count():
    """Per thread count: ``latq_vs_llamacpp_<gguf>`` is the median of the per-round time ratios
    peer / latq (above 1 latq is faster), the all-cores keys unsuffixed and the others ``_t<n>``;
    the bytes each engine streams; whether the CPU paths were the hardware's or emulated."""
    res = []
    for t, s in ((2, 1.0), (1, 2.0)):
        res += [_engine("bf16", None, [2 * s] * 3, t, mb=269.0, bits=16.0),
                _engine("latq-cpu", "cpu", [s, s, s], t, mb=85.4, bits=5.08),
                _engine("llama.cpp:Q4_1", "llamacpp", [1.1 * s, 1.3 * s, 0.9 * s], t, peer=True, mb=96.6, bits=5.74),
                _engine("llama.cpp:latq", "llamacpp", [1.2 * s] * 3, t, peer=True, mb=92.0, bits=5.47)]
    line = headline(res, modes=["compiled"], batches=[1], kernel="cpu", latq_dtypes=["bfloat16"], extra_ckpts=[],
                    cpu="AVX2", cpu_hw="AVX512+bf16", model="m", ckpt="c", threads=[2, 1], all_threads=2)
    keys = dict(kv.split("=", 1) for kv in line.split())
    assert keys["cpu_paths"] == "emulated" and keys["cpu_hw"] == "AVX512+bf16"
    assert keys["compiled_b1_latq_vs_llamacpp_Q4_1"] == "1.10" and keys["compiled_b1_t1_latq_vs_llamacpp_Q4_1"] == "1.10"
    assert keys["compiled_b1_latq_vs_llamacpp_latq"] == "1.20" and keys["compiled_b1_llamacpp_latq_tok_s"] == "3.3"
    assert keys["compiled_b1_speedup_tok_s"] == "2.00" and keys["compiled_b1_t1_latq_tok_s"] == "2.0"
    assert keys["latq_mb_per_token"] == "85.4" and keys["llamacpp_Q4_1_bits"] == "5.740" and keys["bf16_bits"] == "16.000"
    native = headline(res, modes=["compiled"], batches=[1], kernel="cpu", latq_dtypes=["bfloat16"], extra_ckpts=[],
                      cpu="AVX512+bf16", cpu_hw="AVX512+bf16", model="m", ckpt="c", threads=[2, 1], all_threads=2)
    assert " cpu_paths=native " in native
    lines = table(res)
    assert any("latq-cpu vs llama.cpp:Q4_1 at batch 1: 1.10x paired" in ln for ln in lines)


@pytest.mark.slow
def test_bench_runs_llama_cpp_beside_vllm(tmp_path):
    """The bench for real, briefly: SmolLM2's bf16 model, latq's default checkpoint and llama.cpp on
    its shipped GGUF and on the checkpoint as llama.cpp blocks, one thread, eager, 8 tokens; the
    table and the HEADLINE carry the paired ratios against llama.cpp and every engine's bytes."""
    out = subprocess.run([sys.executable, "-m", "bench.decode", "--kernels", "cpu", "--modes", "eager",
                          "--batches", "1", "--tokens", "8", "--repeats", "2", "--baseline-dtypes", "bfloat16",
                          "--latq-dtypes", "bfloat16", "--peer", "llamacpp", "--threads", "1"],
                         capture_output=True, text=True, timeout=3600, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR" not in out.stdout, out.stdout
    keys = dict(kv.split("=", 1) for kv in out.stdout.strip().splitlines()[-1].split()[1:])
    for k in ("eager_b1_t1_latq_vs_llamacpp_Q4_1", "eager_b1_t1_latq_vs_llamacpp_latq", "latq_mb_per_token",
              "llamacpp_latq_mb_per_token", "bf16_mb_per_token", "cpu_paths"):
        assert k in keys, (k, out.stdout[-2000:])
    assert float(keys["latq_mb_per_token"]) < float(keys["llamacpp_Q4_1_mb_per_token"]) < float(
        keys["bf16_mb_per_token"])


def test_a_gguf_file_of_the_same_weights_runs_as_a_peer_named_by_its_type(tmp_path):
    iq = tmp_path / "smollm2-135m-IQ3_S.gguf"
    iq.write_bytes(b"GGUF")
    jobs = decode_peer.peer_jobs("llamacpp", str(iq), "smollm2-135m", "unused", str(tmp_path))
    assert [(j["label"], j["gguf"], j["peer"]) for j in jobs] == [("llama.cpp:IQ3_S", str(iq), True)]
    with pytest.raises(SystemExit, match="no such file"):
        decode_peer.peer_jobs("llamacpp", str(tmp_path / "missing-IQ3_S.gguf"), "smollm2-135m", "unused", str(tmp_path))
