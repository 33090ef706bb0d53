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
    with exclusive(out):
        run_dir.mkdir()
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
