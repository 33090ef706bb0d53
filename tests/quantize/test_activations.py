"""Calibration activations spilled to disk (:mod:`vllm_latq.quantize.activations`): the
checkpoint is byte-identical to the in-memory run's, also across an interruption."""
from __future__ import annotations

import argparse

import pytest
import torch

from vllm_latq.testing.tiny_models import TINY_OPTS
from tests.quantize.test_pipeline import file_hashes
from vllm_latq.commands import quantize as cli
from vllm_latq.quantize.activations import Activations, inputs_file
from vllm_latq.quantize.pipeline import QuantizeOptions, SimulatedInterruption, quantize_model


def test_spilled_activations_give_the_same_checkpoint(tiny_checkpoints, tiny_llama, tmp_path, caplog):
    ref, _ = tiny_checkpoints["ssqr"]
    with caplog.at_level("INFO", logger="vllm_latq.quantize"):
        out = quantize_model(tiny_llama, tmp_path / "spilled",
                             QuantizeOptions(method="ssqr", max_activation_memory=0, **TINY_OPTS), progress=False)
    assert any("spilling" in r.getMessage() for r in caplog.records)
    assert file_hashes(out) == file_hashes(ref)


def test_resume_moves_between_disk_and_memory(tiny_checkpoints, tiny_llama, tmp_path):
    """Interrupted while spilling, resumed in memory (and the other way round): same bytes."""
    ref, _ = tiny_checkpoints["ssqr"]
    for first, then in ((0, None), (None, 0)):
        out = tmp_path / f"ckpt-{first}"
        with pytest.raises(SimulatedInterruption):
            quantize_model(tiny_llama, out, QuantizeOptions(method="ssqr", max_activation_memory=first, **TINY_OPTS),
                           progress=False, stop_after_block=0)
        run_dir = out.with_name(out.name + ".tmp-latq")
        assert [p.name for p in run_dir.glob("latq_activations.*")] == [inputs_file(run_dir, 1).name]
        quantize_model(tiny_llama, out, QuantizeOptions(method="ssqr", max_activation_memory=then, **TINY_OPTS),
                       progress=False, resume=True)
        assert file_hashes(out) == file_hashes(ref)


def test_rows_are_read_and_written_one_sequence_at_a_time(tmp_path):
    x = torch.randn(3, 4, 5).bfloat16()
    for budget in (0, 1 << 20):
        acts = Activations.create(tmp_path, x.shape, torch.bfloat16, "cpu", budget)
        assert acts.on_disk == (budget == 0)
        for j in range(3):
            acts.write(j, x[j])
        acts.advance()
        acts.save()
        assert all(torch.equal(acts[j:j + 1], x[j:j + 1]) for j in range(3))
        with pytest.raises(IndexError, match="one sequence"):
            acts[0:2]
        with pytest.raises(ValueError, match="shape"):
            acts.write(0, x[0, :2])
    inputs_file(tmp_path, 0).write_bytes(b"\0" * 7)
    with pytest.raises(ValueError, match=r"rerun with --overwrite \(without --resume\) to start over"):
        Activations.resume(tmp_path, x.shape, torch.bfloat16, "cpu", None, block=0)


def test_size_option():
    assert cli._size("8G") == 8 << 30 and cli._size("512MiB") == 512 << 20 and cli._size("0") == 0
    assert cli._size("1.5g") == 3 << 29 and cli._size("auto") is None and cli._size("4096") == 4096
    for bad in ("lots", "-1G"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli._size(bad)
    with pytest.raises(ValueError, match="max_activation_memory"):
        QuantizeOptions(max_activation_memory=-1)
