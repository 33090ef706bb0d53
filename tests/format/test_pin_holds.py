"""A pinned checkpoint is what the readers read, not only what they check: latq-eval, latq-export and
latq-inspect open the checkpoint's directory and files once, verify them, and read what they load from
those files, each tensor and sealed file checked again as read. A checkpoint swapped in (renamed over,
the old one removed, as --overwrite does) right after the check (the reader's test hook,
LATQ_SWAP_AFTER_VERIFY) is not what is read: the output is the pinned checkpoint's; bytes edited in place
after the check are refused by name, exit 2."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from vllm_latq.commands import evaluate, export, inspect
from vllm_latq.format import validate
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.format.manifest import digest_of
from vllm_latq.format.swap_hook import SWAP_ENV
from vllm_latq.testing.header_edits import edit_bytes_in_place

EVAL = ["--nwindows", "1", "--seqlen", "16", "--no-progress"]
EDITED = "model.layers.0.self_attn.q_proj.qweight"


def _ppl(capsys, argv) -> float:
    assert evaluate.main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["ppl"]


def _export_digest(capsys, argv) -> str:
    assert export.main(argv) == 0, capsys.readouterr().err
    return re.search(r"digest (sha256:[0-9a-f]{64})", capsys.readouterr().out).group(1)


def test_eval_measures_the_pinned_checkpoint_through_a_swap(pair, capsys, monkeypatch):
    a, b, da, db = pair
    pinned = _ppl(capsys, [str(a), *EVAL, "--expect-digest", da])
    monkeypatch.setenv(SWAP_ENV, str(b))
    assert _ppl(capsys, [str(a), *EVAL, "--expect-digest", da]) == pinned
    assert digest_of(a) == db and not b.exists()   # swapped, after the check
    monkeypatch.delenv(SWAP_ENV)
    assert _ppl(capsys, [str(a), *EVAL]) != pinned   # the swapped-in checkpoint measures otherwise


def test_export_writes_the_pinned_checkpoint_through_a_swap(pair, capsys, monkeypatch, tmp_path):
    a, b, da, db = pair
    argv = ["--dequantize-unmapped", "--expect-digest", da]
    pinned = _export_digest(capsys, [str(a), str(tmp_path / "x1"), *argv])
    monkeypatch.setenv(SWAP_ENV, str(b))
    assert _export_digest(capsys, [str(a), str(tmp_path / "x2"), *argv]) == pinned
    assert digest_of(a) == db
    monkeypatch.delenv(SWAP_ENV)   # swapped in: the hook's directory is gone, and a command refuses the variable
    assert _export_digest(capsys, [str(a), str(tmp_path / "x3"), "--dequantize-unmapped"]) != pinned


def test_inspect_reports_the_pinned_checkpoint_through_a_swap(pair, capsys, monkeypatch):
    a, b, da, db = pair
    monkeypatch.setenv(SWAP_ENV, str(b))
    assert inspect.inspect_main([str(a), "--expect-digest", da]) == 0
    out = capsys.readouterr().out
    assert f"sealed: digest {da} (the one pinned)" in out and digest_of(a) == db, out
    monkeypatch.delenv(SWAP_ENV)   # as in the export's test
    assert inspect.inspect_main([str(a), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == db


def _edit_after_check(monkeypatch, name: str):
    """The reader's hook edits ``name`` in place once the check passed: a tensor's bytes, or a file's."""
    def edit(path):
        if name.endswith(".json"):
            (path / name).write_bytes((path / name).read_bytes().replace(b'"', b"'", 1))
        else:
            shard = Checkpoint(path).where[name]
            edit_bytes_in_place(path / shard, name, lambda t: t ^ 1)
    monkeypatch.setattr(validate, "swap_if_asked", edit)


@pytest.mark.parametrize("name", [EDITED, "tokenizer.json"])
def test_an_edit_in_place_after_the_check_is_refused_by_every_reader(ck, capsys, monkeypatch, tmp_path, name):
    shard = Checkpoint(ck).where.get(name)
    why = (f"file {shard}, tensor {name}: sha256 mismatch: the bytes read are not those written" if shard
           else f"file {name}: differs from the file verified (sha256 in latq_manifest.json): changed after the check")
    runs = {"latq-eval": lambda: evaluate.main([str(ck), *EVAL]),
            "latq-export": lambda: export.main([str(ck), str(tmp_path / "x"), "--dequantize-unmapped"])}
    if shard:   # inspect reads the layers again for their served bits
        runs["latq-inspect"] = lambda: inspect.inspect_main([str(ck)])
    for run in runs.values():
        fresh = tmp_path / "fresh"
        shutil.copytree(ck, fresh)
        _edit_after_check(monkeypatch, name)
        assert run() == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        shutil.rmtree(ck)
        fresh.rename(ck)
    assert not (tmp_path / "x").exists()


def test_a_tensor_read_unverified_is_not_checked(ck):
    """--no-verify reads what is there: the checks as read belong to a verified checkpoint only."""
    c = validate.validate_checkpoint(ck, decode=False, verify_checksums=False)["checkpoint"]
    assert not c.checked
    edit_bytes_in_place(ck / c.where[EDITED], EDITED, lambda t: t ^ 1)
    assert torch.equal(c.tensor(EDITED), Checkpoint(ck).tensor(EDITED))
