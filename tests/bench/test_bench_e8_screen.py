"""bench/e8_screen.py (lever (i) of bench.levers): its verdict rule, the scalar point it compares
with, and one width of the screen on small random layers."""
import torch

from bench import e8_screen as es


def test_verdict_needs_the_gain_to_exceed_both_noise_estimates():
    assert es.verdict([0.80, 0.82], [0.78, 0.80, 0.82, 0.84])[2] == "beats"
    mean, noise, word = es.verdict([0.95, 1.04], [0.9, 1.0, 1.0, 1.1])
    assert (round(mean, 3), round(noise, 3), word) == (0.995, 0.09, "within noise")
    assert es.verdict([1.2, 1.21], [1.2, 1.21, 1.19, 1.2])[2] == "loses"


def point(label, bits, err):
    p = es.Point(label)
    p.err, p.norm, p.numel, p.stored = {"a": err}, {"a": 1.0}, 1, bits
    return p


def test_best_at_keeps_to_the_bit_budget():
    pts = [point("row", 3.02, 0.5), point("g64", 3.09, 0.4), point("g128", 3.13, 0.3)]
    assert es.best_at(pts, 3.02).label == "row"
    assert es.best_at(pts, 3.10).label == "g64"
    assert es.best_at(pts, 3.125 + 0.01).label == "g128"


def test_e8_beats_the_same_bit_grid_on_gaussian_layers_at_2_bits():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(256, 64, generator=g)
    layers = {"l": (torch.randn(16, 64, generator=g) * 0.02, (X.T @ X / 256).double())}
    rot = es.rotated_layers(layers, 0)
    scalar = es.scalar_points(rot, 2)
    e8pts, extra = es.e8_points(rot, 2)
    assert [p.label for p in scalar][:2] == ["gptq row act", "gptq row min-pivot"]
    main = next(p for p in e8pts if p.label == f"e8 {es.MAIN}")
    assert abs(main.bits - (2 + 16 / 64)) < 1e-9 and abs(scalar[0].bits - main.bits) < 1e-9
    assert main.rel < es.best_at(scalar, main.bits).rel
    assert extra["rtn_mse_ratio"] < 0.8
    assert set(scalar[0].served_bits()) == {"cpu", "triton"}


def test_report_prints_each_verdict_against_the_first_seeds_scalar_point(capsys):
    def pt(label, bits, errs):
        p = es.Point(label)
        p.err, p.norm, p.numel, p.stored = dict(zip("ab", errs)), {"a": 1.0, "b": 1.0}, 1, bits
        p.served = {"cpu": 4.0, "triton": bits + 0.3} if label.startswith("gptq") else {}
        return p

    def run(scale):
        return [pt("gptq row act", 3.02, (1.0 * scale, 1.0)), pt("gptq s4-g64 act", 3.09, (0.9, 0.9)),
                pt(f"e8 {es.MAIN}", 3.02, (0.7, 0.72)), pt(f"e8 {es.GROUPED}", 3.09, (0.66, 0.68))]
    rows = []
    es.report(3, {0: run(1.0), 1: run(1.02)}, {"gauss": 0.73, 0: {"rtn_mse_ratio": 0.74},
                                               1: {"rtn_mse_ratio": 0.75}}, rows.append)
    out = capsys.readouterr().out
    assert out.count(": beats") == 3 and "(gptq row act, 3.020 b/w)" in out
    assert [r[1] for r in rows] == [f"{es.MAIN} vs gptq row act", f"{es.MAIN} vs gptq s4-g64 act",
                                    f"{es.GROUPED} vs gptq s4-g64 act"]
    assert "| gptq row act | 3.020 | 4.000 / 3.320 | 1, 1.01 |" in out
