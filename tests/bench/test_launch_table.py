"""tools/launch_table.py: the packaged launch-config table is what the tool builds from the
committed compile-report summary (tools/launch_report.json), the summary covers every candidate
the table ranks (no silent fallback to the serving rule), one entry per shape class serves all
the class's shapes, and neither the order of SHAPES nor of the candidates decides an entry."""
import json

import pytest

pytest.importorskip("triton")
from tools import launch_table as lt  # noqa: E402
from vllm_latq.kernels.triton import configs as cfg  # noqa: E402


@pytest.fixture(scope="module")
def report():
    return lt.read_report()


def test_packaged_table_is_what_the_tool_builds(report):
    assert lt.dumps(lt.build(report)) == cfg.TABLE_FILE.read_text()


def test_report_covers_every_candidate_and_no_entry_spills(report):
    assert lt.missing(report) == []
    assert len(report) == 256 and {k[-1] for k in report} == {80, 86, 89, 90}
    table = json.loads(cfg.TABLE_FILE.read_text())["families"]
    for fam, entries in table.items():
        for key, entry in entries.items():
            kernel, b, bm = key.split("/")[:3]
            assert report[lt.report_key(kernel, int(b[1:]), int(bm[2:]), entry, fam)][0] == 0, (fam, key)


def test_an_incomplete_report_is_refused(report, monkeypatch, capsys, tmp_path):
    gap = ("mma", 3, 64, 32, 4, 2, 90)
    partial = {k: v for k, v in report.items() if k != gap}
    assert lt.missing(partial) == [gap]
    with pytest.raises(ValueError, match=r"lacks 1 tile.*'mma', 3, 64, 32, 4, 2, 90.*--compile"):
        lt.build(partial)
    monkeypatch.setattr(lt, "load_report", lambda compile_missing: partial)
    out = tmp_path / "table.json"
    assert lt.main(["--out", str(out), "--report-out", str(tmp_path / "r.json")]) == 2
    assert "lacks 1 tile" in capsys.readouterr().err and not out.exists()


def test_unreadable_summary_names_the_file(tmp_path):
    bad = tmp_path / "launch_report.json"
    bad.write_text('[{"kernel": "gemv"}]')
    with pytest.raises(ValueError, match="launch report .*launch_report.json: unreadable"):
        lt.read_report(bad)


def test_summary_round_trips(report, tmp_path):
    p = tmp_path / "r.json"
    p.write_text(lt.dumps_report(report))
    assert lt.read_report(p) == report
    assert p.read_text() == lt.REPORT_FILE.read_text()


def test_shared_classes_are_chosen_for_all_their_shapes(report):
    """4096 × 4096 and 3072 × 4096 share n4096/k4096: the entry is a candidate of both and
    ranked on both, whichever SHAPES lists first."""
    classes = lt.classes()
    shared = {key: shapes for key, shapes in classes.items() if len(shapes) > 1}
    assert shared and all(set(s) == {(4096, 4096), (3072, 4096)} for s in shared.values())
    for (kernel, bits, bm, _), shapes in shared.items():
        entry = lt.choose(kernel, bits, bm, shapes, "sm_80", report)
        assert all(entry in lt.shape_candidates(kernel, bits, bm, n, k) for n, k in shapes)
        assert lt.choose(kernel, bits, bm, shapes[::-1], "sm_80", report) == entry


def test_order_never_decides(report, monkeypatch):
    """Reversing SHAPES and every candidate list builds the same table: near-ties go to
    configs.preference (fewest splits, widest tile, fewest warps), not to list order."""
    want = lt.build(report)
    real = cfg.candidates
    monkeypatch.setattr(lt, "SHAPES", lt.SHAPES[::-1])
    monkeypatch.setattr(cfg, "candidates", lambda *a: real(*a)[::-1])
    assert lt.build(report) == want


def test_ties_go_to_the_preference(report):
    """2-bit GEMV of 28672 rows: the three tiles model alike (issue-bound, same waves), so the
    widest tile (fewest activation re-reads) is the entry."""
    shapes = [(28672, 4096)]
    cands = lt.class_candidates("gemv", 2, 1, shapes)
    times = [lt.modelled_time(c, "gemv", 2, 1, 28672, 4096, 28672, "sm_80",
                              report[lt.report_key("gemv", 2, 1, c, "sm_80")]) for c in cands]
    assert max(times) <= min(times) * (1 + lt.TIE)
    assert lt.choose("gemv", 2, 1, shapes, "sm_80", report)["BN"] == max(c["BN"] for c in cands)
