"""bench/memory.py on small shapes: its report and HEADLINE, and peak RSS that does not grow
with the model's depth."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.memory import GiB, model_config, sizes

ROOT = Path(__file__).resolve().parents[2]


def bench(*args) -> tuple[str, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "bench/memory.py", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("HEADLINE "), p.stdout
    return p.stdout, dict(kv.split("=", 1) for kv in last.split()[1:])


def test_bench_reports_rtn_and_spilled_ssqr(tmp_path):
    out, head = bench("--shape", "tiny", "--layers", "2", "--nsamples", "2", "--seqlen", "32", "--ssqr-blocks", "1",
                      "--max-activation-memory", "0", "--model-dir", str(tmp_path / "tiny"))
    assert "rtn: 2 blocks" in out and "ssqr: 1 blocks" in out and "activations on disk" in out
    assert head["layers"] == "2" and head["rtn_blocks"] == "2" and head["ssqr_blocks"] == "1"
    assert head["ssqr_spilled"] == "1" and head["rtn_spilled"] == "0"
    for k in ("model_gib", "block_ws_gib", "rtn_peak_rss_gib", "ssqr_peak_rss_gib", "rtn_s_per_block",
              "ssqr_s_per_block", "ssqr_target_gib"):
        assert float(head[k]) > 0, k
    assert float(head["ssqr_peak_rss_gib"]) >= float(head["ssqr_peak_rss_blocks_gib"]) > 0
    assert not list(tmp_path.glob("out-*")), "the bench leaves its checkpoints behind"



def test_bench_target_correction_counts_its_second_stream(tmp_path):
    """--target-correction runs SSQR with it; its target counts the Hessians and the activations
    twice (the cross-covariances, the full-precision stream)."""
    args = ("--shape", "tiny", "--layers", "2", "--nsamples", "2", "--seqlen", "32", "--ssqr-blocks", "1", "--no-rtn",
            "--model-dir", str(tmp_path / "tiny"))
    _, plain = bench(*args)
    out, tc = bench(*args, "--target-correction")
    assert tc["target_correction"] == "1" and plain["target_correction"] == "0" and "ssqr: 1 blocks" in out
    sz = sizes(model_config("tiny", 2), 2, 32)
    extra = (2 * sz["block_hessians"] + sz["activations"]) / GiB
    assert abs(float(tc["ssqr_target_gib"]) - float(plain["ssqr_target_gib"]) - extra) < 2e-3

@pytest.mark.slow
def test_peak_rss_does_not_grow_with_depth(tmp_path):
    """A model four times as deep peaks within three blocks' weights of the shallower one: holding
    the blocks read (e.g. through memory maps) would add twelve, a heap that keeps a quarter of
    each freed block three; the rest is the peak's run-to-run spread."""
    peaks = {}
    for layers in (4, 16):
        _, head = bench("--shape", "small", "--layers", str(layers), "--ssqr-blocks", "0",
                        "--model-dir", str(tmp_path / f"small{layers}"))
        peaks[layers] = float(head["rtn_peak_rss_blocks_gib"])
        block = float(head["block_ws_gib"]) - float(head["acts_gib"])
    from bench.memory import SHAPES, model_config, sizes
    block_weights = sizes(model_config("small", 4), 1, 1)["block_weights"] / 2**30
    assert SHAPES["small"]["num_hidden_layers"] == 4 and block > block_weights
    assert peaks[16] - peaks[4] < 3 * block_weights, (peaks, block_weights)


@pytest.mark.slow
def test_bench_moe_shape_per_expert_checkpoint(tmp_path):
    """``--shape tiny-moe``: a mixture written with one tensor per expert and projection (as the
    hub's checkpoints), quantized with RTN and SSQR; its Hessians count one expert's at a time."""
    import json

    from bench.memory import model_config, sizes
    out, head = bench("--shape", "tiny-moe", "--nsamples", "2", "--seqlen", "32", "--ssqr-blocks", "1",
                      "--model-dir", str(tmp_path / "moe"))
    assert "rtn: 2 blocks" in out and "ssqr: 1 blocks" in out and head["shape"] == "tiny-moe"
    names = set(json.loads((tmp_path / "moe" / "model.safetensors.index.json").read_text())["weight_map"])
    assert {f"model.layers.1.mlp.experts.15.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")} <= names
    assert not any(n.endswith("gate_up_proj") for n in names)
    cfg = model_config("tiny-moe", None)
    h, mi, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    sz = sizes(cfg, 2, 32)
    assert sz["block_hessians"] == 8 * (3 * h * h + (4 * 32) ** 2 + 2 * mi * mi)
    assert sz["block_weights"] > 2 * 3 * E * h * mi and sz["activations"] == 2 * 2 * 2 * 32 * h
