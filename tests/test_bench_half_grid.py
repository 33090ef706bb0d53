"""bench/half_grid.py on a tiny Llama: its control (offset 0) is the perplexity of the checkpoint
the pipeline writes with the same options, and the half grid changes it."""
from __future__ import annotations

import pytest

from bench import half_grid
from tests.conftest import TINY_OPTS
from vllm_latq.quantize.evaluate import evaluate
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model


def test_control_is_the_checkpoints_perplexity(tiny_llama, tmp_path, capsys):
    args = [str(tiny_llama), "--method", "gptq", "--bits", "2", "--group-size", str(TINY_OPTS["group_size"]),
            "--offset", "0", "0.5", "--nsamples", str(TINY_OPTS["nsamples"]), "--seqlen", str(TINY_OPTS["seqlen"]),
            "--eval-seqlen", "64", "--nwindows", "4"]
    assert half_grid.main(args) == 0
    head = dict(kv.split("=", 1) for kv in capsys.readouterr().out.strip().splitlines()[-1].split()[1:])
    ck = quantize_model(tiny_llama, tmp_path / "ck", QuantizeOptions(method="gptq", bits=2, **TINY_OPTS),
                        progress=False)
    ref = evaluate(str(ck), seqlen=64, nwindows=4, progress=False)["ppl"]
    assert float(head["ppl_offset0"]) == pytest.approx(ref, rel=1e-4)
    assert float(head["ppl_offset0.5"]) != pytest.approx(ref, rel=1e-3)
