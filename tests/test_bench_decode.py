"""bench/decode.py's two latq/bf16 ratios: the median of per-round ratios and the ratio of the median
tok/s are different numbers, computed each from what it names."""
import math

from bench.decode import speedups


def test_speedups_name_what_they_compute():
    # three rounds of paired times: bf16 / latq = 1.1, 1.2, 1.5 → median 1.2; medians 1.0 s vs 0.8 s → 1.25
    ref = {"tok_s": 8 / 1.0}
    run = {"tok_s": 8 / 0.8, "paired_ratio": 1.2}
    assert speedups(run, ref) == (1.2, 1.25)
    ref_only = speedups({"tok_s": 10.0}, {"tok_s": 8.0})   # the reference kernel: other tokens, no pairs
    assert math.isnan(ref_only[0]) and ref_only[1] == 1.25
    assert all(math.isnan(x) for x in speedups({"tok_s": 10.0}, None))


def test_paired_ratio_against_any_baseline():
    """latq against whichever baseline was fastest: the median of per-round time ratios, each
    round pairing the two engines' runs of that round."""
    from bench.decode import paired_ratio
    fp32 = {"times": [1.0, 1.2, 0.9]}
    latq = {"times": [0.5, 1.0, 0.45]}
    assert paired_ratio(latq, fp32) == 2.0          # rounds 2.0, 1.2, 2.0
    assert math.isnan(paired_ratio({"times": []}, fp32))
