"""bench/decode.py: its two latq/bf16 ratios (the median of per-round ratios and the ratio of the median
tok/s are different numbers, computed each from what it names), the engines it starts, the default
checkpoint it measures, and the HEADLINE's keys from the engines' results (nothing timed)."""
import math

import pytest

from bench import decode
from bench.decode_report import headline, paired_ratio, speedups


def test_speedups_name_what_they_compute():
    # three rounds of paired times: bf16 / latq = 1.1, 1.2, 1.5 → median 1.2; medians 1.0 s vs 0.8 s → 1.25
    ref = {"tok_s": 8 / 1.0}
    run = {"tok_s": 8 / 0.8, "paired_ratio": 1.2}
    assert speedups(run, ref) == (1.2, 1.25)
    ref_only = speedups({"tok_s": 10.0}, {"tok_s": 8.0})   # the reference kernel: other tokens, no pairs
    assert math.isnan(ref_only[0]) and ref_only[1] == 1.25
    assert all(math.isnan(x) for x in speedups({"tok_s": 10.0}, None))


def test_paired_ratio_against_any_baseline():
    """latq against whichever baseline was fastest: the median of per-round time ratios, each
    round pairing the two engines' runs of that round."""
    fp32 = {"times": [1.0, 1.2, 0.9]}
    latq = {"times": [0.5, 1.0, 0.45]}
    assert paired_ratio(latq, fp32) == 2.0          # rounds 2.0, 1.2, 2.0
    assert math.isnan(paired_ratio({"times": []}, fp32))


def test_engines_time_latqs_first_kernel_in_every_latq_dtype():
    jobs = decode.engine_jobs("B", "C", ["cpu", "reference"], ["bfloat16", "float32"], ["bfloat16", "float32"],
                              ["X/head8"])
    assert [(j["label"], j["kernel"], j["dtype"]) for j in jobs] == [
        ("bf16", None, "bfloat16"), ("fp32", None, "float32"),
        ("latq-cpu", "cpu", "bfloat16"), ("latq-cpu-fp32", "cpu", "float32"),
        ("latq-reference", "reference", "bfloat16"), ("latq-cpu:head8", "cpu", "bfloat16")]
    ab = decode.engine_jobs("B", "C", ["cpu"], ["bfloat16"], ["bfloat16", "float32"], [], streaming_ab=True)
    assert [(j["label"], j["dtype"], j.get("streaming")) for j in ab] == [
        ("bf16", "bfloat16", None), ("latq-cpu", "bfloat16", None),
        ("latq-cpu:L1,no-arena", "bfloat16", False), ("latq-cpu-fp32", "float32", None)]
    extra = decode.engine_jobs("B", "C", ["cpu"], ["bfloat16"], ["bfloat16"], ["X/e8"], extra_kernels=("cpu-e8-a8",))
    assert [(j["label"], j["model"], j["kernel"]) for j in extra[2:]] == [
        ("latq-cpu:e8", "X/e8", "cpu"), ("latq-cpu-e8-a8:e8", "X/e8", "cpu-e8-a8")]


def test_default_checkpoint_is_latq_quantizes_default(monkeypatch):
    """Without --ckpt the bench measures the checkpoint ``latq-quantize`` makes by default (GPTQ
    4-bit g64); --method picks another."""
    from vllm_latq import data
    from vllm_latq.quantize.pipeline import DEFAULT_METHOD, default_group_size
    assert (DEFAULT_METHOD, default_group_size(DEFAULT_METHOD)) == ("gptq", 64)
    asked = []

    class Stop(Exception):
        pass

    def fake_ckpt(model, method):
        asked.append(method)
        raise Stop
    monkeypatch.setattr(decode, "default_ckpt", fake_ckpt)
    monkeypatch.setattr(data, "model_dir", lambda name: f"/models/{name}")
    for argv, want in (([], DEFAULT_METHOD), (["--method", "ssqr"], "ssqr")):
        with pytest.raises(Stop):
            decode.main(["--kernels", "cpu", *argv])
        assert asked[-1] == want


def _engine(label, mode, kernel, dtype, times, isa=""):
    runs = {b: {"times": t, "tok_s": int(b) * 4 / sorted(t)[len(t) // 2]} for b, t in times.items()}
    for b, run in runs.items():
        if label != "bf16":
            run["paired_ratio"] = 1.0
    return {"label": label, "mode": mode, "kernel": kernel, "dtype": dtype, "tokens": 4, "load_s": 1.0,
            "gemv_isa": isa, "vllm_ops": "avx2", "runs": runs}


def test_headline_names_the_gemv_isa_that_ran_and_the_fastest_latq_dtype():
    """``gemv_isa`` is what the latq engines' GEMV dispatched to (their reply), not an environment
    value; ``speedup_vs_fastest`` pairs the fastest latq dtype with the fastest baseline, and each
    latq dtype gets its own ratio against that baseline."""
    res = [_engine("bf16", "eager", None, "bfloat16", {"1": [4.0, 4.0, 4.0]}),
           _engine("fp32", "eager", None, "float32", {"1": [2.0, 2.2, 1.8]}),
           _engine("latq-cpu", "eager", "cpu", "bfloat16", {"1": [2.0, 2.0, 2.0]}, "avx2"),
           _engine("latq-cpu-fp32", "eager", "cpu", "float32", {"1": [1.0, 1.0, 1.2]}, "avx2")]
    line = headline(res, modes=["eager"], batches=[1], kernel="cpu", latq_dtypes=["bfloat16", "float32"],
                    extra_ckpts=[], cpu="AVX2", model="m", ckpt="c")
    keys = dict(kv.split("=", 1) for kv in line.split())
    assert keys["cpu"] == "AVX2" and keys["gemv_isa"] == "avx2" and keys["latq_dtypes"] == "bf16,fp32"
    assert keys["vllm_ops"] == "avx2"
    assert keys["eager_b1_fastest_baseline"] == "fp32" and keys["eager_b1_fastest_latq_dtype"] == "fp32"
    assert keys["eager_b1_speedup_vs_fastest"] == "2.00"        # rounds 2.0, 2.2, 1.5
    assert keys["eager_b1_latq_bf16_vs_fastest"] == "1.00" and keys["eager_b1_latq_fp32_vs_fastest"] == "2.00"
    assert keys["eager_b1_latq_tok_s"] == "2.0" and keys["eager_b1_bf16_tok_s"] == "1.0"
    for r in res[2:]:
        r["gemv_isa"] = ""          # no GEMV in the engines (torch's op, or another kernel)
    assert " gemv_isa=none " in " " + headline(res, modes=["eager"], batches=[1], kernel="cpu",
                                         latq_dtypes=["bfloat16", "float32"], extra_ckpts=[], cpu="AVX2",
                                         model="m", ckpt="c")


def test_an_extra_checkpoint_is_paired_with_the_primary_one():
    """An extra checkpoint (``--extra-ckpt``, ``--rotated``): its time over the primary latq
    checkpoint's, paired by round (above 1: slower than the primary), beside its speedup over bf16."""
    res = [_engine("bf16", "compiled", None, "bfloat16", {"1": [4.0, 4.0, 4.0]}),
           _engine("latq-cpu", "compiled", "cpu", "bfloat16", {"1": [2.0, 2.0, 2.0]}),
           _engine("latq-cpu:m-gptq-rot-hadamard", "compiled", "cpu", "bfloat16", {"1": [2.2, 2.1, 2.0]})]
    line = headline(res, modes=["compiled"], batches=[1], kernel="cpu", latq_dtypes=["bfloat16"],
                    extra_ckpts=["/c/m-gptq-rot-hadamard"], cpu="AVX512", model="m", ckpt="c")
    keys = dict(kv.split("=", 1) for kv in line.split())
    assert keys["compiled_b1_m-gptq-rot-hadamard_vs_latq"] == "1.050"     # rounds 1.10, 1.05, 1.00
    assert "compiled_b1_speedup_median_of_rounds_m-gptq-rot-hadamard" in keys


def test_an_extra_kernel_is_paired_with_the_first_on_the_same_checkpoint():
    """``--extra-kernel``: each batch's time of the opt-in kernel over the first kernel's on the same extra
    checkpoint (below 1: faster), beside its speedup over bf16."""
    res = [_engine("bf16", "eager", None, "bfloat16", {"1": [4.0, 4.0, 4.0], "4": [8.0, 8.0, 8.0]}),
           _engine("latq-cpu", "eager", "cpu", "bfloat16", {"1": [2.0, 2.0, 2.0], "4": [4.0, 4.0, 4.0]}),
           _engine("latq-cpu:e8", "eager", "cpu", "bfloat16", {"1": [3.0, 3.0, 3.0], "4": [6.0, 6.0, 6.0]}),
           _engine("latq-cpu-e8-a8:e8", "eager", "cpu-e8-a8", "bfloat16", {"1": [2.7, 3.0, 2.4], "4": [4.8, 4.8, 4.8]})]
    line = headline(res, modes=["eager"], batches=[1, 4], kernel="cpu", latq_dtypes=["bfloat16"],
                    extra_ckpts=["/c/e8"], cpu="AVX512", model="m", ckpt="c", extra_kernels=("cpu-e8-a8",))
    keys = dict(kv.split("=", 1) for kv in line.split())
    assert keys["eager_b1_e8_cpu-e8-a8_vs_cpu"] == "0.900" and keys["eager_b4_e8_cpu-e8-a8_vs_cpu"] == "0.800"
    assert "eager_b4_speedup_median_of_rounds_e8_cpu-e8-a8" in keys


def test_synthetic_pair_is_a_random_model_of_the_shape_and_its_default_checkpoint(tmp_path, monkeypatch):
    """``--synthetic SHAPE``: bench/memory.py's model of that shape and the checkpoint the
    pipeline makes of it by the method asked, both built once: a second call quantizes nothing,
    a source written again with its shape edited is quantized again (the checkpoint is named by it)."""
    import json

    from vllm_latq import data
    from vllm_latq.format.manifest import read_manifest
    from vllm_latq.quantize import pipeline
    from bench.memory import COMPLETE, SHAPES
    monkeypatch.setattr(data, "cache_dir", lambda: tmp_path)
    src, ckpt = decode.synthetic_pair("tiny", "gptq")
    cfg = json.loads((src / "config.json").read_text())
    assert {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")} == \
        {k: SHAPES["tiny"][k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    read_manifest(ckpt)   # sealed, as the loader wants it
    qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert (qc["method"], qc["lm_head_quantized"]) == ("gptq", True)
    quantized = []
    monkeypatch.setattr(pipeline, "quantize_model", lambda *a, **k: quantized.append(a))
    assert decode.synthetic_pair("tiny", "gptq") == (src, ckpt) and not quantized
    edited = {**json.loads((src / COMPLETE).read_text()), "num_hidden_layers": cfg["num_hidden_layers"] + 1}
    monkeypatch.setattr(decode, "model_config", lambda shape, layers: edited)
    again, other = decode.synthetic_pair("tiny", "gptq")
    assert again == src and other != ckpt and len(quantized) == 1


def test_moe_pair_is_built_again_when_its_sizes_change(tmp_path, monkeypatch):
    """``--moe``: its pair is built once, and again once ``MOE_SIZES`` no longer matches the cached
    checkpoint's config (the builders stubbed: they write only the config)."""
    import json

    from vllm_latq import data
    from vllm_latq.testing import moe_models
    monkeypatch.setattr(data, "cache_dir", lambda: tmp_path)
    built = []

    def checkpoint(src, out, method, **kw):
        sizes = decode.MOE_SIZES
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(dict(
            {k: v for k, v in sizes.items() if k not in ("layers", "hidden")},
            num_hidden_layers=sizes["layers"], hidden_size=sizes["hidden"])))
        built.append(out)
    monkeypatch.setattr(moe_models, "make_moe_model", lambda *a, **k: None)
    monkeypatch.setattr(moe_models, "make_moe_checkpoint", checkpoint)
    pair = decode.moe_pair()
    assert decode.moe_pair() == pair and len(built) == 1
    assert decode.moe_sizes(pair[1]) == decode.MOE_SIZES
    monkeypatch.setattr(decode, "MOE_SIZES", dict(decode.MOE_SIZES, num_experts=16))
    decode.moe_pair()
    assert len(built) == 2 and decode.moe_sizes(pair[1])["num_experts"] == 16


@pytest.mark.parametrize("argv", [["--synthetic", "tiny", "--moe"], ["--synthetic", "tiny", "--ckpt", "/ckpt"],
                                  ["--moe", "--ckpt", "/ckpt"]])
def test_a_built_pair_refuses_another_checkpoint(argv, capsys, monkeypatch):
    """--moe and --synthetic measure what they build: with each other or --ckpt, the bench says so
    before building anything."""
    def build(*a):
        raise AssertionError("built a pair")
    monkeypatch.setattr(decode, "moe_pair", build)
    monkeypatch.setattr(decode, "synthetic_pair", build)
    with pytest.raises(SystemExit):
        decode.main(argv)
    assert "without --ckpt" in capsys.readouterr().err
