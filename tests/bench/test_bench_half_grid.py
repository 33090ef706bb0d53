"""bench/half_grid.py on a tiny Llama: its control (offset 0) is the perplexity of the checkpoint
the pipeline writes with the same options, and the half grid puts every weight on ``s·(z + ½)``."""
from __future__ import annotations

import pytest
import torch

from bench import half_grid
from vllm_latq.testing.tiny_models import TINY_OPTS
from vllm_latq.commands.evaluate import evaluate
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
from vllm_latq.algorithms.scales import expand


def test_control_is_the_checkpoints_perplexity(tiny_llama, tmp_path, capsys):
    args = [str(tiny_llama), "--method", "gptq", "--bits", "2", "--group-size", str(TINY_OPTS["group_size"]),
            "--offset", "0", "--nsamples", str(TINY_OPTS["nsamples"]), "--seqlen", str(TINY_OPTS["seqlen"]),
            "--eval-seqlen", "64", "--nwindows", "4"]
    assert half_grid.main(args) == 0
    head = dict(kv.split("=", 1) for kv in capsys.readouterr().out.strip().splitlines()[-1].split()[1:])
    ck = quantize_model(tiny_llama, tmp_path / "ck", QuantizeOptions(method="gptq", bits=2, **TINY_OPTS),
                        progress=False)
    ref = evaluate(str(ck), seqlen=64, nwindows=4, progress=False)["ppl"]
    assert float(head["ppl_offset0"]) == pytest.approx(ref, rel=1e-4)


@pytest.mark.parametrize("offset", [0.0, 0.5])
def test_offset_puts_every_weight_on_its_grid(tiny_llama, offset):
    """What the half grid must do on any model and CPU, with no margin on a perplexity:
    each dequantized weight is ``s·(z + offset)`` with integer z, and offset ½ moves all of them."""
    opts = QuantizeOptions(method="gptq", bits=2, **TINY_OPTS)
    results: dict = {}
    weights = half_grid.quantized_weights(str(tiny_llama), opts, offset, results)
    assert weights and set(weights) == set(results)
    for name, q in weights.items():
        res = results[name]
        s = expand(res.scales.float(), res.group_size, tuple(q.shape))
        u = q.double() / s.double() - offset
        # q is an fp32 product: off an exact grid point by its rounding only (≤ 2⁻²³ relative)
        assert (u - u.round()).abs().max() < 1e-4, f"{name}: a weight off the grid s·(z + {offset})"
        if offset:
            assert not torch.any(q == 0), f"{name}: a weight at 0 is not on the half grid"
