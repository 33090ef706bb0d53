"""tools/launch_table.py: the packaged launch-config table is what the tool builds from the
committed compile-report summary (tools/launch_report.json), that summary is the committed
compile record's, it covers every candidate the table ranks (no silent fallback to the serving
rule), one entry per shape class serves all the class's shapes, and neither the order of SHAPES
nor of the candidates decides an entry."""
import json

import pytest

pytest.importorskip("triton")
from tools import launch_table as lt  # noqa: E402
from vllm_latq.kernels.triton import configs as cfg  # noqa: E402


@pytest.fixture(scope="module")
def report():
    return lt.read_report()


def test_packaged_table_is_what_the_tool_builds(report):
    assert lt.dumps(lt.build(report, lt.read_timings())) == cfg.TABLE_FILE.read_text()


def test_committed_report_is_the_compile_records_summary():
    """launch_report.json summarises the committed compile record (itself current:
    tests/kernels/test_triton.py), so the table ranks what the kernels compile to today."""
    assert lt.dumps_report(lt.load_report(compile_missing=False)) == lt.REPORT_FILE.read_text(), (
        "tools/launch_report.json is not the compile record's summary: run `python -m tools.launch_table`")


def test_a_stale_record_is_refused(monkeypatch):
    from tools import triton_compile as tc
    monkeypatch.setattr(tc, "code_hash", lambda kernel: "edited")
    with pytest.raises(ValueError, match=r"compile record .*stale \(.*gemv: its device code"):
        lt.load_report(compile_missing=False)


def _timing(c, n, k, m, us, fam="sm_90", bm=16):
    return dict(family=fam, kernel="mma", bits=4, bm=bm, n=n, k=k, m=m, rate=0.01, config=_tuned(c), us=us)


def _tuned(c):
    return {t: c[t] for t in lt.TUNED if t in c}


def test_measured_times_beat_the_model_where_a_gpu_timed_the_class(report):
    """The least summed measured time wins (ties within TIE by preference); a candidate wrong at
    a point is out; other families and classes keep the model's choice."""
    shapes = [(4096, 14336)]
    cands = lt.class_candidates("mma", 4, 16, shapes)
    model = lt.choose("mma", 4, 16, shapes, "sm_90", report)
    fast = next(c for c in cands if lt.tuned_key(c) != lt.tuned_key(model))
    rows = [_timing(c, 4096, 14336, m, 100.0) for c in cands for m in (8, 16)]
    rows = [dict(r, us=40.0) if r["config"] == _tuned(fast) else r for r in rows]
    assert lt.choose("mma", 4, 16, shapes, "sm_90", report, rows) == fast
    assert lt.choose("mma", 4, 16, shapes, "sm_80", report, rows) == lt.choose("mma", 4, 16, shapes, "sm_80", report)
    wrong_once = rows + [_timing(c, 4096, 14336, 12, 100.0 if c != fast else lt.WRONG) for c in cands]
    assert lt.choose("mma", 4, 16, shapes, "sm_90", report, wrong_once) not in (fast, None)
    tie = [dict(r, us=40.0 * (1 + lt.TIE / 2)) if r["config"] == _tuned(model) else r for r in rows]
    assert lt.choose("mma", 4, 16, shapes, "sm_90", report, tie) == min([fast, model], key=cfg.preference)


def test_an_ab_timing_serves_the_pipelined_twin_where_it_ran_faster(report):
    """The GPU check's A/B times the pick and its pipelined twin at a few points only: the twin
    replaces the pick where it ran faster beyond TIE on the points both ran, not when slower or
    wrong; a class with no twin timed keeps the measured pick."""
    shapes = [(4096, 14336)]
    cands = lt.class_candidates("mma", 4, 16, shapes, "sm_90")
    sweep = [_timing(c, 4096, 14336, m, 50.0 + i) for i, c in enumerate(cands) if cfg.depth(c) == 1 for m in (8, 16)]
    pick = lt.choose("mma", 4, 16, shapes, "sm_90", report, sweep)
    twin = cfg.pipelined(dict(pick, BM=16), "mma", 4)
    twin.pop("BM")
    for us, want in ((40.0, twin), (50.0 * (1 - lt.TIE / 2), pick), (70.0, pick), (lt.WRONG, pick)):
        ab = [_timing(pick, 4096, 14336, 16, 50.0), _timing(twin, 4096, 14336, 16, us)]
        got = lt.choose("mma", 4, 16, shapes, "sm_90", report, lt.merge_timings(sweep, ab))
        assert lt.tuned_key(got) == lt.tuned_key(want), us


def test_timings_merge_read_and_name_a_bad_file(tmp_path):
    c = dict(BN=32, SPLIT=4, BR=8, num_warps=4)
    old = [_timing(c, 4096, 4096, 16, 20.0), _timing(c, 4096, 4096, 8, 19.0)]
    merged = lt.merge_timings(old, [_timing(c, 4096, 4096, 16, 18.0)])
    assert sorted(r["us"] for r in merged) == [18.0, 19.0]
    p = tmp_path / "t.json"
    p.write_text(lt.dumps_timings(merged))
    assert lt.read_timings(p) == merged and lt.read_timings(tmp_path / "absent.json") == []
    p.write_text('[{"family": "sm_90"}]')
    with pytest.raises(ValueError, match=r"launch timings .*t.json: unreadable .*lacks"):
        lt.read_timings(p)


def test_add_timings_writes_both_files(report, tmp_path, monkeypatch):
    monkeypatch.setattr(lt, "load_report", lambda compile_missing: report)
    shapes = [(4096, 14336)]
    fast = lt.class_candidates("mma", 4, 16, shapes)[-1]
    new = tmp_path / "new.json"
    new.write_text(lt.dumps_timings([_timing(c, 4096, 14336, 16, 40.0 if c == fast else 90.0)
                                     for c in lt.class_candidates("mma", 4, 16, shapes)]))
    committed, table = tmp_path / "timings.json", tmp_path / "table.json"
    assert lt.main(["--from-summary", "--add-timings", str(new), "--timings", str(committed),
                    "--out", str(table)]) == 0
    assert len(lt.read_timings(committed)) == len(lt.class_candidates("mma", 4, 16, shapes))
    entry = json.loads(table.read_text())["families"]["sm_90"][cfg.shape_class("mma", 4, 16, 4096, 14336)]
    assert entry == {k: v for k, v in fast.items() if k != "maxnreg"}


def test_report_covers_every_candidate_and_no_entry_spills(report):
    assert lt.missing(report) == []
    assert len(report) == 284 and {k[-1] for k in report} == {80, 86, 89, 90}
    assert {k[-1] for k in report if k[-2] > 1} == {80, 90}                      # pipelined: sm_80, sm_90
    table = json.loads(cfg.TABLE_FILE.read_text())["families"]
    for fam, entries in table.items():
        for key, entry in entries.items():
            kernel, b, bm = key.split("/")[:3]
            if kernel == "route":            # which kernel serves M < 8 rows there (a timed A/B), no config
                assert entry == {"kernel": "mma"}, (fam, key, entry)
                continue
            assert report[lt.report_key(kernel, int(b[1:]), int(bm[2:]), entry, fam)][0] == 0, (fam, key)


def test_an_incomplete_report_is_refused(report, monkeypatch, capsys, tmp_path):
    gap = ("mma", 3, 64, 32, 4, 2, 1, 90)
    partial = {k: v for k, v in report.items() if k != gap}
    assert lt.missing(partial) == [gap]
    with pytest.raises(ValueError, match=r"lacks 1 tile.*'mma', 3, 64, 32, 4, 2, 1, 90.*--compile"):
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
    cands = [c for c in lt.class_candidates("gemv", 2, 1, shapes, "sm_80") if cfg.depth(c) == 1]
    times = [lt.modelled_time(c, "gemv", 2, 1, 28672, 4096, 28672, "sm_80",
                              report[lt.report_key("gemv", 2, 1, c, "sm_80")]) for c in cands]
    assert max(times) <= min(times) * (1 + lt.TIE)
    assert lt.choose("gemv", 2, 1, shapes, "sm_80", report)["BN"] == max(c["BN"] for c in cands)
