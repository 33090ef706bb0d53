"""Whatever ``latq-quantize`` writes, every reader reads: a tiny model quantized over the grid of
options latq-quantize takes (each method × its bits, group sizes, scale codes, rotation, output
head and the options that only change values), and each checkpoint read by ``latq-inspect``,
``latq-eval``, the serving check on every kernel family (:mod:`vllm_latq.testing.serving_check`:
each serves every layer or refuses it naming the family and why) and ``latq-export`` in each format
(writes, or refuses naming the layers). Options latq-quantize refuses are refused in one line
before anything is written. The grid is sampled (:func:`tests.helpers.pairs_sampled`): every value
in the default suite, every pair of values in the slow one; a model of odd shapes takes a few cases."""
from __future__ import annotations

import json
import math
import re

import pytest

from tests.helpers import pairs_sampled
from vllm_latq.commands import evaluate, export, inspect, quantize
from vllm_latq.kernels.selector import families
from vllm_latq.testing.serving_check import serve_checkpoint
from vllm_latq.testing.tiny_models import make_word_level_model

# the options that only change values (solver, calibration use, informational keys), one set a case
DENSE_EXTRAS = ("", "--order natural", "--decoder kbest --beam 2", "--column-scales norm", "--target-correction",
                "--order min-pivot --outlier-rate 0.05", "--decoder klein --rotate-seed 7 --outlier-rate 0")
HEADS = ("--no-quantize-lm-head", "", "--lm-head-bits 3")
DENSE = pairs_sampled(method=("gptq", "babai", "rtn", "ssqr"), bits=(2, 3, 4, 5, 6, 7, 8),
                      group=(1, 16, 32, 48, 128, 200), scales=(None, 4), rotate=("none", "hadamard"), head=HEADS,
                      extra=DENSE_EXTRAS)
HUFFMAN = pairs_sampled(method=("hptq", "hrtn"), target=(1.25, 2.125, 3.125, 5.5, 8.0), rotate=("none", "hadamard"),
                        head=HEADS[:2], extra=("", "--order natural", "--decoder kbest --beam 2"))
CODEBOOK = pairs_sampled(method=("e8",), bits=(2, 3, 4), group=(8, 16, 24, 64, 136, 256), scales=(None, 4),
                         rotate=(None, "hadamard", "none"), head=HEADS,
                         extra=("", "--order natural", "--rotate-seed 3 --damp 0.1"))
QUANTIZE = ["--nsamples", "2", "--seqlen", "64", "--no-progress", "-q"]


@pytest.fixture(scope="module")
def grid_model(tmp_path_factory):
    """A one-block Llama whose layers some CPU kernels take (128 columns) and some refuse (192: a
    ragged 128-group), its head 256 words (SmolLM2's 49152 would be most of each run), and its text."""
    return make_word_level_model(tmp_path_factory.mktemp("grid"), num_hidden_layers=1, hidden_size=128,
                                 intermediate_size=192, head_dim=32)


def _argv(method, bits, group, scales, rotate, head: str, extra: str, target=None) -> list[str]:
    opts = {"--method": method, "--bits": bits, "--group-size": group, "--scale-bits": scales, "--rotate": rotate,
            "--target-bits": target}
    return [x for k, v in opts.items() if v is not None for x in (k, str(v))] + head.split() + extra.split()


def _one_line(err: str, prefix: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


def _read_by_every_reader(ck, text, tmp_path, capsys) -> None:
    """inspect, eval, the serving check on each family, export in each format: each reads ``ck``."""
    assert inspect.inspect_main([str(ck)]) == 0, capsys.readouterr().err
    assert f"OK: {ck} is a valid latq checkpoint" in capsys.readouterr().out
    assert evaluate.main([str(ck), "--text", str(text), "--seqlen", "16", "--nwindows", "1", "--no-progress",
                          "--json"]) == 0
    assert math.isfinite(json.loads(capsys.readouterr().out)["ppl"])
    served = serve_checkpoint(ck)
    assert set(served) == {f.name for f in families()} and all(served.values())
    for fmt in export.FORMATS:
        for unmapped in ([], ["--dequantize-unmapped"]):
            out = tmp_path / f"export-{fmt}{'-'.join(unmapped)}"
            rc = export.main([str(ck), str(out), "--format", fmt, *unmapped])
            err = capsys.readouterr().err
            assert rc in (0, 2) and "Traceback" not in err, err
            if rc == 2:   # the first line says it, the layers follow by name
                assert err.startswith("latq-export: refused: ") and not out.exists(), err
                assert all(re.match(r"  [\w.]+: ", line) for line in err.splitlines()[1:-1]), err
            else:
                assert (out / "config.json").is_file()




def _quantized_and_read(grid_model, tmp_path, capsys, argv: list[str]) -> None:
    """latq-quantize with ``argv`` writes a checkpoint every reader reads, or refuses the options in
    one line naming one, writing nothing."""
    model, text = grid_model
    ck = tmp_path / "ck"
    rc = quantize.main([str(model), str(ck), *argv, *QUANTIZE, "--calib", str(text)])
    err = capsys.readouterr().err
    if rc == 2:
        _one_line(err, "latq-quantize: error: ")
        assert not ck.exists() and not (tmp_path / "ck.tmp-latq").exists()
        return
    assert rc == 0 and "Traceback" not in err, err
    _read_by_every_reader(ck, text, tmp_path, capsys)


@pytest.mark.parametrize("method, bits, group, scales, rotate, head, extra", DENSE)
def test_dense_options(grid_model, tmp_path, capsys, monkeypatch, method, bits, group, scales, rotate, head, extra):
    monkeypatch.setenv("LATQ_TRITON_INTERPRET_OK", "1")   # the Triton family in its interpreter
    _quantized_and_read(grid_model, tmp_path, capsys, _argv(method, bits, group, scales, rotate, head, extra))


@pytest.mark.parametrize("method, target, rotate, head, extra", HUFFMAN)
def test_huffman_options(grid_model, tmp_path, capsys, monkeypatch, method, target, rotate, head, extra):
    monkeypatch.setenv("LATQ_TRITON_INTERPRET_OK", "1")
    _quantized_and_read(grid_model, tmp_path, capsys, _argv(method, None, None, None, rotate, head, extra, target))


@pytest.mark.parametrize("method, bits, group, scales, rotate, head, extra", CODEBOOK)
def test_codebook_options(grid_model, tmp_path, capsys, monkeypatch, method, bits, group, scales, rotate, head,
                          extra):
    monkeypatch.setenv("LATQ_TRITON_INTERPRET_OK", "1")
    _quantized_and_read(grid_model, tmp_path, capsys, _argv(method, bits, group, scales, rotate, head, extra))


# a model of odd shapes: k/v 8 rows (half a scale-code grid), 40 and 24 columns (5 and 3 codebook blocks,
# rotation blocks of 8), heads of 5; one case a suite, the rest slow
ODD = [pytest.param(opts, marks=() if i == 0 else pytest.mark.slow, id=opts) for i, opts in enumerate((
    "--method gptq --bits 3 --group-size 16 --rotate hadamard --scale-bits 4 --lm-head-bits 2",
    "--method e8 --bits 3 --group-size 8 --scale-bits 4", "--method e8 --bits 4 --group-size 24 --quantize-lm-head",
    "--method ssqr --bits 8 --group-size 7 --outlier-rate 0.2", "--method hrtn --target-bits 1.5 --rotate hadamard",
    "--method rtn --bits 2 --group-size 1 --scale-bits 4"))]


@pytest.fixture(scope="module")
def odd_model(tmp_path_factory):
    return make_word_level_model(tmp_path_factory.mktemp("odd"), num_hidden_layers=1, hidden_size=40,
                                 intermediate_size=24, num_attention_heads=5, num_key_value_heads=1, head_dim=8)


@pytest.mark.parametrize("opts", ODD)
def test_odd_shapes(odd_model, tmp_path, capsys, monkeypatch, opts):
    monkeypatch.setenv("LATQ_TRITON_INTERPRET_OK", "1")
    _quantized_and_read(odd_model, tmp_path, capsys, opts.split())
