"""What a run may delete: ``--overwrite`` replaces only a latq checkpoint or an empty directory —
never the source model, a directory holding it, a link or anyone else's files —, a second run
on the same OUT is refused at once naming the first, and a refused run leaves nothing behind."""
from __future__ import annotations

import shutil

import pytest

from vllm_latq.commands import quantize as cli
from vllm_latq.format.checkpoint import is_latq_checkpoint
from vllm_latq.format.output_dir import LOCK_SUFFIX
from vllm_latq.quantize.output import exclusive
from vllm_latq.quantize.resume import TMP_SUFFIX

RTN = ["--method", "rtn", "--group-size", "32", "--no-progress"]


def _tree(d):
    return sorted((p.relative_to(d).as_posix(), p.stat().st_size) for p in d.rglob("*") if p.is_file())


@pytest.fixture
def source(tiny_llama, tmp_path):
    """A copy of the tiny model inside a folder with an unrelated file, so a deletion shows."""
    root = tmp_path / "models"
    shutil.copytree(tiny_llama, root / "tiny")
    (root / "notes.txt").write_text("mine")
    return root / "tiny"


@pytest.mark.parametrize("where", ["source", "parent"])
def test_overwrite_refuses_the_source_model_or_a_folder_holding_it(source, where, capsys):
    out = source if where == "source" else source.parent
    before = _tree(source.parent)
    assert cli.main([str(source), str(out), *RTN, "--overwrite"]) == 2
    assert "holds it" in capsys.readouterr().err
    assert _tree(source.parent) == before


def test_overwrite_refuses_a_directory_latq_did_not_write(source, tmp_path, capsys):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "cat.jpg").write_bytes(b"\xff\xd8")
    assert cli.main([str(source), str(out), *RTN, "--overwrite"]) == 2
    assert "not a checkpoint latq-quantize wrote" in capsys.readouterr().err
    assert (out / "cat.jpg").read_bytes() == b"\xff\xd8" and not (tmp_path / ("photos" + TMP_SUFFIX)).exists()


def test_overwrite_refuses_a_link(source, tmp_path, capsys):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    (tmp_path / "link").symlink_to(target)
    assert cli.main([str(source), str(tmp_path / "link"), *RTN, "--overwrite"]) == 2
    assert "symbolic link" in capsys.readouterr().err and (target / "keep").read_text() == "x"


def test_overwrite_replaces_a_latq_checkpoint_and_an_empty_directory(source, tmp_path):
    out = tmp_path / "ck"
    out.mkdir()
    assert cli.main([str(source), str(out), *RTN, "--overwrite"]) == 0   # empty: taken
    assert is_latq_checkpoint(out)
    assert cli.main([str(source), str(out), *RTN, "--bits", "3", "--overwrite"]) == 0
    assert is_latq_checkpoint(out) and sorted(p.name for p in tmp_path.iterdir()) == ["ck", "models"]   # no lock, no temporary


def test_second_run_on_one_out_is_refused_naming_the_first(source, tmp_path, capsys):
    """While one run holds OUT, another fails at once with the holder's pid, and leaves the
    first's partial output alone."""
    out = tmp_path / "ck"
    run_dir = tmp_path / ("ck" + TMP_SUFFIX)
    with exclusive(out, source, overwrite=False):
        (run_dir / "latq_progress.json").write_text("{}")
        assert cli.main([str(source), str(out), *RTN]) == 2
        err = capsys.readouterr().err
        assert "being written by another run (latq-quantize, pid" in err and LOCK_SUFFIX in err
        assert (run_dir / "latq_progress.json").read_text() == "{}"
    assert not (tmp_path / ("ck" + LOCK_SUFFIX)).exists()   # released, and removed
    shutil.rmtree(run_dir)
    assert cli.main([str(source), str(out), *RTN]) == 0   # the next run goes ahead


def test_refused_calibrated_run_leaves_no_partial_output(source, tmp_path, capsys):
    bad = tmp_path / "calib.txt"
    bad.write_bytes(b"\xff\xfe not utf-8 \xc3\x28")
    out = tmp_path / "ck"
    assert cli.main([str(source), str(out), "--method", "gptq", "--nsamples", "2", "--seqlen", "16",
                     "--calib", str(bad), "--no-progress"]) == 2
    assert f"{bad}: line 1: not UTF-8 text (byte 0" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / ("ck" + TMP_SUFFIX)).exists()


@pytest.mark.parametrize("bits", ["1000", "1", "nan"])
def test_target_bits_out_of_range_is_refused_before_any_work(source, tmp_path, bits, capsys):
    assert cli.main([str(source), str(tmp_path / "ck"), "--method", "hptq", "--target-bits", bits, "--no-progress"]) == 2
    assert "target_bits must be in (1, 8]" in capsys.readouterr().err and not list(tmp_path.glob("ck*"))


# ----------------------------------------------------------------------------- latq-export's OUT

@pytest.fixture
def ckpt(source, tmp_path):
    """A latq checkpoint of the tiny model beside a user's folder."""
    out = tmp_path / "ck"
    assert cli.main([str(source), str(out), *RTN]) == 0
    return out


def _export(ckpt, out, *extra):
    from vllm_latq.commands import export
    return export.main([str(ckpt), str(out), "--dequantize-unmapped", *extra])


@pytest.mark.parametrize("where", ["ckpt", "parent", "inside"])
def test_export_never_writes_over_or_into_its_source(ckpt, capsys, where):
    out = {"ckpt": ckpt, "parent": ckpt.parent, "inside": ckpt / "ex"}[where]
    before = _tree(ckpt.parent)
    assert _export(ckpt, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert str(out) in err and ("is the source" in err or "inside the source" in err), err
    assert _tree(ckpt.parent) == before


def test_export_overwrite_replaces_only_its_own_export(ckpt, tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    assert _export(ckpt, user, "--overwrite") == 2
    assert "not a checkpoint latq-export wrote" in capsys.readouterr().err and (user / "notes.txt").exists()
    assert _export(ckpt, ckpt.parent / "other-ck", "--overwrite") == 0   # a new OUT
    assert _export(ckpt, ckpt.parent / "other-ck", "--overwrite") == 0   # its own export: replaced
    assert _export(ckpt, ckpt, "--overwrite") == 2                        # a latq-quantize checkpoint, and the source
    (ckpt.parent / "other-ck" / "results.csv").write_text("1,2")
    assert _export(ckpt, ckpt.parent / "other-ck", "--overwrite") == 2
    err = capsys.readouterr().err
    assert "it holds results.csv, which its latq_manifest.json does not list" in err, err
    assert (ckpt.parent / "other-ck" / "results.csv").exists()
    assert not list(tmp_path.glob("*.tmp-latq-export")) and not list(tmp_path.glob("*.latq-lock"))


def test_export_leaves_a_temporary_name_it_did_not_make(ckpt, tmp_path, capsys):
    theirs = tmp_path / ("ex" + ".tmp-latq-export")
    theirs.mkdir()
    (theirs / "draft.txt").write_text("mine")
    assert _export(ckpt, tmp_path / "ex") == 2
    assert "not a temporary directory latq made" in capsys.readouterr().err
    assert (theirs / "draft.txt").read_text() == "mine" and not (tmp_path / "ex").exists()


def test_export_onto_a_file_fails_before_any_work(ckpt, tmp_path, capsys):
    f = tmp_path / "ex"
    f.write_text("a file")
    for extra in ([], ["--overwrite"]):
        assert _export(ckpt, f, *extra) == 2
        assert str(f) in capsys.readouterr().err
    assert f.read_text() == "a file" and not list(tmp_path.glob("ex.*"))


def test_export_verifies_the_tensors(ckpt, tmp_path, capsys):
    """A flipped byte of a packed tensor (its checksum left as written) is refused, not exported."""
    from vllm_latq.format.checkpoint import Checkpoint
    from vllm_latq.format.safetensors_file import SafetensorsFile
    name = "model.layers.0.self_attn.q_proj.qweight"
    path = ckpt / Checkpoint(ckpt).where[name]
    f = SafetensorsFile(path)
    raw = bytearray(path.read_bytes())
    raw[f.data_start + f.entries[name].begin] ^= 0x11
    path.write_bytes(bytes(raw))
    assert _export(ckpt, tmp_path / "ex") == 2
    assert f"tensor {name}: sha256 mismatch" in capsys.readouterr().err and not (tmp_path / "ex").exists()


# ----------------------------------------------------------------------------- latq-quantize's OUT

def test_quantize_overwrite_keeps_a_checkpoint_holding_other_files(source, tmp_path, capsys):
    out = tmp_path / "ck"
    assert cli.main([str(source), str(out), *RTN]) == 0
    (out / "notes.txt").write_text("mine")
    (out / "results").mkdir()
    assert cli.main([str(source), str(out), *RTN, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "it holds notes.txt, which its latq_manifest.json does not list" in err, err
    assert (out / "notes.txt").read_text() == "mine" and (out / "results").is_dir()


def test_quantize_refuses_an_out_inside_the_source(source, capsys):
    before = _tree(source)
    assert cli.main([str(source), str(source / "q4"), *RTN]) == 2
    assert "inside the source" in capsys.readouterr().err and _tree(source) == before


def test_quantize_leaves_a_temporary_name_it_did_not_make(source, tmp_path, capsys):
    theirs = tmp_path / ("ck" + TMP_SUFFIX)
    theirs.mkdir()
    (theirs / "draft.txt").write_text("mine")
    assert cli.main([str(source), str(tmp_path / "ck"), *RTN]) == 2
    assert "not a temporary directory latq made" in capsys.readouterr().err
    assert (theirs / "draft.txt").read_text() == "mine"


def test_out_dot_is_the_working_directory(source, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main([str(source), ".", *RTN]) == 2
    assert f"error: {tmp_path} exists (pass" in capsys.readouterr().err


def test_an_out_latq_cannot_lock_is_named_as_such(source, tmp_path, capsys):
    """Not "being written by another run": the folder meant to hold OUT cannot hold its lock."""
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "ck"
    assert cli.main([str(source), str(out), *RTN]) == 2
    err = capsys.readouterr().err
    assert f"{out}: cannot create its lock" in err and "another run" not in err, err
