"""What the format states of its versions and files, checked on a sealed checkpoint edited and
sealed again (as anyone can): format_version a JSON integer, version 3 only for the codebook kind,
and a shard exactly 8 + header + data bytes. Each is refused by the readers in one line naming
the file; the codebook kind without its rotation: tests/quantize/test_e8_method.py."""
from __future__ import annotations

import json

import pytest

from vllm_latq.commands import inspect
from vllm_latq.format.manifest import write_manifest


def _edit_qc(d, **change):
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    write_manifest(d)


def _refused(d, capsys, *says) -> str:
    assert inspect.inspect_main([str(d), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    for s in says:
        assert s in err, err
    return err


def test_the_tiny_checkpoint_passes(ck, capsys):
    assert inspect.inspect_main([str(ck), "--no-served"]) == 0   # so each refusal below is the edit's


@pytest.mark.parametrize("change, says", [
    ({"format_version": 1.0}, "format_version must be an integer, got 1.0"),
    ({"format_version": 3}, "format_version 3 marks the codebook kind (method e8), not ssqr"),
    ({"format_version": 2}, "format_version 2 marks a rotated checkpoint, but it has no rotation"),
])
def test_a_version_that_does_not_mean_this_checkpoint_is_refused(ck, capsys, change, says):
    _edit_qc(ck, **change)
    _refused(ck, capsys, "config.json", says)


def test_bytes_after_a_shards_data_are_refused(ck, capsys):
    """The manifest seals a shard's header (its tensors' bytes through their checksums): bytes
    appended after the data change neither, so the reader checks the size itself."""
    shard = sorted(ck.glob("model-*.safetensors"))[0]
    with open(shard, "ab") as f:
        f.write(b"\0" * 8)
    _refused(ck, capsys, shard.name, "8 bytes after the tensors' data")
