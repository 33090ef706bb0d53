"""The accuracy study's E8 rows (bench/study/e8.py and the served bits of a codebook result), from
fabricated result records as the runner caches them."""
from __future__ import annotations

import pytest

from bench.study import claims, configs, curves, e8, report, runner, served, which_method
from vllm_latq import format as fmt
from vllm_latq.kernels import served_report

def test_every_e8_base_is_a_configuration_of_the_study():
    """Each E8 configuration's base (rotated GPTQ with the same scales) runs in the study too, at the
    E8 row's width, group size and scale coding."""
    study = {c.label: c for c in configs.sweep_configs("gemma3-270m", 128)}
    rows = [c for c in study.values() if c.family == configs.E8_FAMILY]
    assert len(rows) == 7
    for c in rows:
        base = study[f"GPTQ-{c.level}b-{c.base}"]
        assert base.kwargs["rotate"] == c.kwargs["rotate"] == "hadamard" and base.level == c.level
        assert (base.kwargs["group_size"], base.kwargs.get("scale_bits")) == \
            ((16, 4) if c.kwargs["group_size"] == 16 else (128, None))
        # the target-corrected E8 row against target-corrected GPTQ: the two differ by the codebook alone
        assert base.kwargs.get("target_correction") == c.kwargs.get("target_correction"), c.label
    assert study["E8-3b-rot-tc-s4-g16"].base == "rot-tc-s4-g16"


def test_a_cached_record_is_read_against_todays_base(tmp_path):
    """A record cached when the study paired it with another base reads against the configuration's
    base of today (the pairing is the study's choice, not part of the measurement)."""
    cfg = next(c for c in configs.e8_configs("gemma3-270m") if c.label == "E8-3b-rot-tc-s4-g16")
    st = runner.Settings()
    old = {**_e8("rot-tc-s4-g16", 3, 15.49, 3.375, base="rot-s4-g16"), "settings": st.key(cfg)}
    runner.write_json(tmp_path / "results" / cfg.model / f"{cfg.slug}.json", old)
    r = runner.run_config(cfg, st, tmp_path, keep=False, compute=False)
    assert r["base"] == "rot-tc-s4-g16" and r["ppl"] == 15.49
    assert claims.base_label([r], r["label"]) == "GPTQ-3b-rot-tc-s4-g16"


def _rec(label, family, level, tag, ppl, triton, cpu=None, group=16, base="", method="gptq", kernels=None):
    """A result record with served bits (``triton`` None: none recorded; ``cpu`` defaults to ``triton``)."""
    r = {"model": "gemma3-270m", "label": label, "family": family, "level": level, "tag": tag, "base": base,
         "ppl": ppl, "bits": level + 0.375 if level else 16.0, "outlier_rate": 0.0, "windows": 2, "tokens": 254,
         "quantize_seconds": 1.0, "eval_seconds": 1.0, "certificate": [],
         "options": {"method": method, "bits": level, "group_size": group, "scale_bits": 4, "rotate": "hadamard"}}
    if triton is not None:
        bpw = {"triton": triton, **({"cpu": cpu if cpu is not None else triton} if cpu != "none" else {})}
        r["served"] = {"bits_per_weight": bpw, "source": "layout",
                       "kernels": kernels or {f: {f"{f} {level}b": 14} for f in bpw}}
    return r


def _e8(label_tail, level, ppl, triton, group=16, base="rot-s4-g16", **kw):
    tag = label_tail
    return _rec(f"E8-{level}b-{tag}", "E8", level, tag, ppl, triton, group=group, base=base, method="e8", **kw)


def _study() -> list[dict]:
    """GPTQ's 3-bit floor ±1 %, its rotated bases, and E8 at 2/3/4 bits (3-bit seeds: ±2 %)."""
    return [_rec("bf16", "bf16", None, "", 13.0, None),
            _rec("GPTQ-4b", "GPTQ", 4, "", 15.63, 4.125, group=128),
            _rec("GPTQ-3b", "GPTQ", 3, "", 24.0, 3.25, group=128),
            _rec("GPTQ-3b-seed1", "GPTQ", 3, "seed1", 24.24, 3.25, group=128),
            _rec("GPTQ-3b-rot-s4-g16", "GPTQ", 3, "rot-s4-g16", 18.5, 3.40, base="s4-g16"),
            _rec("GPTQ-3b-rot-tc-s4-g16", "GPTQ", 3, "rot-tc-s4-g16", 18.0, 3.40, base="s4-g16"),
            _rec("GPTQ-3b-rot", "GPTQ", 3, "rot", 20.0, 3.26, group=128),
            _rec("GPTQ-2b-rot-s4-g16", "GPTQ", 2, "rot-s4-g16", 40.0, 2.40, base="s4-g16"),
            _rec("GPTQ-4b-rot-s4-g16", "GPTQ", 4, "rot-s4-g16", 15.0, 4.40, base="s4-g16"),
            _e8("rot-s4-g16", 3, 17.0, 3.40),                                  # −8.1 %: beyond ±2 %
            _e8("rot-s4-g16-seed1", 3, 17.34, 3.40), _e8("rot-s4-g16-seed2", 3, 17.1, 3.40),
            _e8("rot-s4-g64", 3, 20.2, 3.10, group=64, base="rot"),            # +1.0 %: within
            _e8("rot-tc-s4-g16", 3, 19.0, 3.40, base="rot-tc-s4-g16"),         # +5.6 %: beyond
            _e8("rot-s4-g16", 2, 35.0, 2.40),                                  # no floor at 2 bits
            _e8("rot-s4-g16", 4, 14.5, None)]                                  # no served record


def _put(res: list[dict], r: dict) -> list[dict]:
    """``res`` with ``r`` in place of the record of its label."""
    return [r if x["label"] == r["label"] else x for x in res]


def _rows(lines: list[str]) -> dict[str, str]:
    return {r.split(" | ")[0].lstrip("| "): r for r in lines if r.startswith("| E8-")}


def test_e8_section_reads_each_row_against_its_base_and_the_floor():
    """Each E8 row against rotated GPTQ with the same scales (g64: plain rotated GPTQ), "base → E8" per
    column; the 3-bit floor is the larger of E8's own seed spread and GPTQ's; no floor: no verdict;
    a missing served figure or a missing result reads as such."""
    res = _study()
    lines = e8.e8_section({"gemma3-270m": res})
    assert lines[0] == "## E8 codebooks (block Babai)"
    floor = next(x for x in lines if x.startswith("gemma3-270m: 3-bit noise floor"))
    assert "E8's own ±2.00% (E8-3b-rot-s4-g16 over 3 calibration draws: 17.00, 17.34, 17.10)" in floor
    assert "our GPTQ's ±1.00% (GPTQ-3b over 2 calibration draws)" in floor
    assert e8.floor_at(res, 3) == pytest.approx(0.02) and e8.floor_at(res, 2) is None
    rows = _rows(lines)
    assert rows["E8-3b-rot-s4-g16"] == ("| E8-3b-rot-s4-g16 | GPTQ-3b-rot-s4-g16 | 3.375 → 3.375 | 3.400 → 3.400 | "
                                        "3.400 → 3.400 | 18.50 → 17.00 | -8.1% | beats | not recorded |")
    assert rows["E8-3b-rot-s4-g64"].startswith("| E8-3b-rot-s4-g64 | GPTQ-3b-rot | ")
    assert rows["E8-3b-rot-s4-g64"].endswith("| 20.00 → 20.20 | +1.0% | within noise | not recorded |")
    assert rows["E8-3b-rot-tc-s4-g16"].startswith("| E8-3b-rot-tc-s4-g16 | GPTQ-3b-rot-tc-s4-g16 | ")
    assert rows["E8-3b-rot-tc-s4-g16"].endswith("| 18.00 → 19.00 | +5.6% | loses | not recorded |")
    assert rows["E8-2b-rot-s4-g16"].endswith("| -12.5% | — (no noise floor at 2 bits) | not recorded |")
    assert "| 4.400 → n/a | 4.400 → n/a | 15.00 → 14.50 |" in rows["E8-4b-rot-s4-g16"]
    # a configuration of the study not run yet, and one whose base is not run
    res = [r for r in res if r["label"] not in ("GPTQ-2b-rot-s4-g16", "E8-3b-rot-tc-s4-g16")]
    rows = _rows(e8.e8_section({"gemma3-270m": res}))
    assert rows["E8-3b-rot-tc-s4-g16"] == ("| E8-3b-rot-tc-s4-g16 | GPTQ-3b-rot-tc-s4-g16 | 3.375 → not run | "
                                           "3.400 → not run | 3.400 → not run | 18.00 → not run |  |  | "
                                           "not recorded |")
    assert rows["E8-2b-rot-s4-g16"].startswith("| E8-2b-rot-s4-g16 | GPTQ-2b-rot-s4-g16 | not run → 2.375 |")


def test_overloads_are_read_from_the_checkpoint_stats_and_backfilled(tmp_path):
    """A codebook checkpoint's overloaded blocks and covered layers come from its latq_stats.json, at
    record time or afterwards from a kept checkpoint; the section shows them beside the certificate."""
    stats = {"layers": [{"name": "a", "shape": [16, 64], "overloads": 12, "cert": None},
                        {"name": "b", "shape": [16, 128], "overloads": 4, "cert": 0.31}]}
    over = runner.overload_record(stats)
    assert over == {"blocks": 16, "of": 16 * 8 + 16 * 16, "certified_layers": 1, "layers": 2}
    assert runner.overload_record({"layers": [{"name": "a", "shape": [16, 64], "cert": 0.3}]}) is None
    cfg = next(c for c in configs.e8_configs("gemma3-270m") if c.label == "E8-3b-rot-s4-g16")
    r = _e8("rot-s4-g16", 3, 17.0, 3.40)
    assert runner.backfill_overloads(cfg, tmp_path, r) is r and "overloads" not in r   # no kept checkpoint
    ck = tmp_path / "checkpoints" / cfg.model / cfg.slug
    ck.mkdir(parents=True)
    (ck / "latq_stats.json").write_text(runner.json.dumps(stats))
    (tmp_path / "results" / cfg.model).mkdir(parents=True)
    r = runner.backfill_overloads(cfg, tmp_path, r)
    assert r["overloads"] == over and (tmp_path / "results" / cfg.model / f"{cfg.slug}.json").is_file()
    r["stats_cert_max"] = 0.31
    assert e8.certificate_cell(r) == "4.2 % · ≤ 0.310 (1/2 layers)"
    row = _rows(e8.e8_section({"gemma3-270m": _put(_study(), r)}))["E8-3b-rot-s4-g16"]
    assert row.endswith("| beats | 4.2 % · ≤ 0.310 (1/2 layers) |")


def test_a_layers_certificate_record_covers_only_the_bounded_rows():
    """E8 rows with an overloaded block have an infinite bound: a layer's record leaves them out, and
    is None where no row is covered (its old records read 0 there)."""
    import math
    import torch

    class Res:
        def __init__(self, bound):
            self.bound = torch.tensor(bound, dtype=torch.float64)

        def error(self, W, H):
            return torch.tensor([0.5, 9.0, 0.5], dtype=torch.float64)
    rec = runner._cert_record("x", None, None, Res([1.0, math.inf, 2.0]))
    assert rec == {"name": "x", "layer_ratio": pytest.approx(1 / 3), "row_max": 0.5, "row_median": 0.25}
    assert runner._cert_record("x", None, None, Res([math.inf] * 3))["layer_ratio"] is None


def test_e8_claim_verdict_both_ways():
    """The claims rows: the best E8 operating point (seeds are no operating points) at ≤ 3.5
    Triton-served bits against GPTQ-4b's perplexity and rotated GPTQ-4b's: it holds only lower by more
    than the 4-bit noise floor (here ±1.41 %), "within noise" inside it, fails beyond it the other way;
    no 4-bit floor: no verdict; none served at ≤ 3.5 bits: does not hold; no served figure at all: no
    verdict."""
    def claim(res, base="GPTQ-4b"):
        head = f"| an E8 configuration at ≤ 3.5 Triton-served bits reaches {base}-g128's perplexity"
        return next(r for r in claims.claims_table({"gemma3-270m": res}, {}) if r.startswith(head))
    res = _study() + [_rec("GPTQ-4b-seed1", "GPTQ", 4, "seed1", 15.85, 4.125, group=128),
                      _rec("GPTQ-4b-rot", "GPTQ", 4, "rot", 14.33, 4.125, group=128)]
    assert claim(res).endswith("| E8-3b-rot-s4-g16 17.00 at 3.400 b vs GPTQ-4b 15.63 at 4.125 b (+8.8%) "
                               "| does not hold |")
    res = _put(res, _e8("rot-tc-s4-g16", 3, 15.5, 3.40))                 # −0.8 %: inside the floor
    assert claim(res).endswith("| E8-3b-rot-tc-s4-g16 15.50 at 3.400 b vs GPTQ-4b 15.63 at 4.125 b (-0.8%) — "
                               "within noise (±1.41 %) | within noise |")
    assert claim(res, "GPTQ-4b-rot").endswith("| E8-3b-rot-tc-s4-g16 15.50 at 3.400 b vs GPTQ-4b-rot 14.33 at "
                                              "4.125 b (+8.2%) | does not hold |")
    assert claim(_put(res, _e8("rot-tc-s4-g16", 3, 15.3, 3.40))).endswith("(-2.1%) | holds |")   # beyond it
    no_floor = [r for r in res if r["label"] != "GPTQ-4b-seed1"]
    assert claim(no_floor).endswith("(-0.8%): no noise floor at 4 bits | — |")
    res = _put(res, _e8("rot-tc-s4-g16", 3, 15.5, 3.60))          # over the budget: the next best
    res = _put(res, _e8("rot-s4-g16", 2, 15.6, 2.40))
    assert claim(res).endswith("| E8-2b-rot-s4-g16 15.60 at 2.400 b vs GPTQ-4b 15.63 at 4.125 b (-0.2%) — "
                               "within noise (±1.41 %) | within noise |")
    e8_only = [r for r in res if r["family"] != "E8" or r["tag"].endswith("seed1")]   # a seed alone: not run
    assert claim(e8_only).endswith("| not run | — |")
    over = [r for r in res if r["family"] != "E8"] + [_e8("rot-s4-g16", 4, 14.0, 4.40)]
    assert claim(over).endswith("| no E8 point at ≤ 3.5 b (fewest: E8-4b-rot-s4-g16 at 4.400 b) | does not hold |")
    fallback = {f: {"bf16 3b": 14} for f in ("triton", "cpu")}
    unserved = [r for r in res if r["family"] != "E8"] + [_e8("rot-s4-g16", 3, 15.0, 16.0, kernels=fallback)]
    assert claim(unserved).endswith("| no Triton served bits for E8: no codebook kernel (bf16 fallback) | — |")


def test_e8_points_join_the_served_bits_front_and_the_plot():
    """E8 configurations are series of their own (group size in the name; seeds are not) on the
    served-bits front, in the which-method table with the options that make them, and on the plot."""
    res = _study()
    assert [curves.series_of(r) for r in res[-7:]] == ["E8+rot+s4 g16", None, None, "E8+rot+s4 g64",
                                                       "E8+rot+TC+s4 g16", "E8+rot+s4 g16", "E8+rot+s4 g16"]
    front = curves.global_front(res, "triton")
    assert {"E8-3b-rot-s4-g16", "E8-3b-rot-s4-g64", "E8-2b-rot-s4-g16"} <= front
    assert "GPTQ-3b-rot-s4-g16" not in front and "E8-3b-rot-tc-s4-g16" not in front
    rows = which_method.table({"gemma3-270m": res})
    row = next(r for r in rows if r.startswith("| E8-3b-rot-s4-g16 |"))
    assert row == ("| E8-3b-rot-s4-g16 | `--method e8 --bits 3 --group-size 16 --scale-bits 4 --rotate hadamard` | "
                   "17.00 @ 3.400 ★ |")
    pytest.importorskip("matplotlib")
    lines = {ln.get_label(): ln for ln in report.pareto_figure({"gemma3-270m": res}).axes[0].get_lines()}
    assert list(lines["E8+rot+s4 g16"].get_xdata()) == [2.4, 3.4] and "E8+rot+s4 g64" in lines


def test_report_renders_e8_rows_without_served_figures(tmp_path):
    """The whole report with E8 rows that have no served record, or no CPU figure: they read n/a,
    stay out of the rotation rows and the variants tables, and nothing breaks."""
    res = _study()
    res = _put(res, _e8("rot-s4-g16", 3, 17.0, 3.40, cpu="none"))
    out = tmp_path / "R.md"
    report.write_report({"gemma3-270m": res}, {}, runner.Settings(), out, tmp_path / "p.png", "cmd")
    text = out.read_text()
    assert "| E8-3b-rot-s4-g16 | GPTQ-3b-rot-s4-g16 | 3.375 → 3.375 | 3.400 → 3.400 | 3.400 → n/a |" in text
    assert "| E8-4b-rot-s4-g16 | 4.375 | — | — |" in text                   # every configuration: not served
    served_row = next(x for x in text.splitlines() if x.startswith("| E8-3b-rot-s4-g16") and "E8+rot+s4 g16" in x)
    assert " | 3.400 | n/a | " in served_row
    rotation = next(x for x in text.splitlines() if x.startswith("| rotation (`--rotate hadamard`) lowers ppl at 3"))
    assert "E8" not in rotation
    assert "| GPTQ-3b-rot-s4-g16 | 18.50 | 17.00 |" not in text and "| E8-3b-rot-s4-g16 | 17.00 |" not in text


@pytest.fixture
def triton_e8(monkeypatch):
    """A Triton codebook kernel streaming codes (bits/8 bytes a weight) and coded scales (12 bytes
    per 16 rows × group), the CPU family without one; the study's caches cleared around it."""
    class TritonE8:
        name = "triton-e8"

        @classmethod
        def codebook_bytes(cls, n, k, bits, group, scale_bits=None):
            return {"codes": n * k * bits // 8, "scales": 12 * -(-n // 16) * -(-k // group)}

    def member(family, form):
        return TritonE8 if family == "triton" else None
    caches = (served.cost_model_fingerprints, served._outlier_free_served)
    for c in caches:
        c.cache_clear()
    monkeypatch.setattr(served_report, "family_member", member)
    monkeypatch.setattr(served, "family_member", member)
    yield
    for c in caches:
        c.cache_clear()


def test_codebook_served_bits_follow_the_family_kernel(triton_e8, tmp_path, monkeypatch):
    """A codebook result's served record from its layout: the family's codebook kernel's bytes plus
    the rotation's signs once per block size; the bf16 fallback where a family has none (no
    figure then); a record made before a family had its kernel is stale and is recomputed."""
    shapes = [(64, 576), (1536, 576), (576, 1536)]
    rec = served.outlier_free_served(shapes, 3, 16, 4, rotated=True, kind="codebook")
    weights = sum(n * k for n, k in shapes)
    signs = 4 * sum({fmt.Rotation(0).block_size(k) for _, k in shapes})   # fp32, once per block size
    want = 8 * (sum(n * k * 3 // 8 + 12 * (n // 16) * (k // 16) for n, k in shapes) + signs) / weights
    assert rec["bits_per_weight"]["triton"] == pytest.approx(want) and rec["bits_per_weight"]["cpu"] == 16.0
    assert rec["kernels"] == {"triton": {"triton-e8 3b": 3}, "cpu": {"bf16 3b": 3}}
    r = {**_e8("rot-s4-g16", 3, 17.0, None), "served": rec}
    assert served.served_bits(r, "triton") == pytest.approx(want) and served.served_bits(r, "cpu") is None
    assert not served.is_stale(r)
    old = {**r, "served": {**rec, "cost_model": {**rec["cost_model"], "triton+codebook": "none"}}}
    assert served.is_stale(old)                                      # made before Triton had its kernel
    coded = {**old, "family": "GPTQ", "options": {**old["options"], "method": "gptq"}}
    assert not served.is_stale(coded)                                # a dense record does not depend on it
    cfg = next(c for c in configs.e8_configs("tiny") if c.label == "E8-3b-rot-s4-g16")
    monkeypatch.setattr(runner, "source_dir", lambda model, st, root: tmp_path)
    monkeypatch.setattr(served, "linear_shapes", lambda src: shapes)
    new = runner.backfill_served(cfg, runner.Settings(), tmp_path, {**old, "options": cfg.kwargs}, keep=False,
                                 requantize=False)
    assert new["served"] == rec and (tmp_path / "results" / "tiny" / f"{cfg.slug}.json").is_file()


@pytest.mark.slow
def test_codebook_layout_is_the_checkpoint_record(tiny_llama, tmp_path):
    """An E8 checkpoint's served record (what the runner records when a run finishes) equals the one
    its layout gives from the model's shapes alone (what the backfill computes without it)."""
    from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model
    ck = quantize_model(tiny_llama, tmp_path / "e8", QuantizeOptions(method="e8", bits=3, group_size=16, scale_bits=4,
                                                                     rotate="hadamard", nsamples=4, seqlen=64,
                                                                     quantize_lm_head=False), progress=False)
    rec = served.checkpoint_record(ck)
    layout = served.outlier_free_served(served.linear_shapes(tiny_llama), 3, 16, 4, rotated=True, kind="codebook")
    assert {**rec, "source": "layout"} == layout and sum(rec["kernels"]["triton"].values()) == 14
