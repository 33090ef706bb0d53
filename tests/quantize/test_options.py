"""``QuantizeOptions``: a bad option is refused when the options are made, named as the user wrote
it (``bits``, not ``quantization_config.bits``), by the same rules the format reads checkpoints with."""
from __future__ import annotations

import math

import pytest

from vllm_latq import format as fmt
from vllm_latq.quantize.options import QuantizeOptions


@pytest.mark.parametrize("kw,message", [
    (dict(method="latq"), "method must be one of ssqr, gptq, rtn, babai, hptq, hrtn, e8, got 'latq'"),
    (dict(bits=9), "bits must be an integer in 2..8, got 9"),
    (dict(method="rtn", bits=1), "bits must be an integer in 2..8, got 1"),
    (dict(group_size=0), r"group_size must be an integer in 1..1048576 .*, got 0"),
    (dict(group_size=2 ** 31), r"group_size must be an integer in 1..1048576 .*, got 2147483648"),
    (dict(group_size=2 ** 63 - 1), r"group_size must be an integer in 1..1048576 .*, got 9223372036854775807"),
    (dict(group_size=2 ** 64), r"group_size must be an integer in 1..1048576 .*, got 18446744073709551616"),
    (dict(decoder="kbest", beam=100_000), "beam must be an integer in 1..4096, got 100000"),
    (dict(device="bogus"), "device 'bogus' is not a device: cpu, cuda or cuda:N"),
    (dict(device="meta"), "device meta: latq computes on cpu or cuda, not meta"),
    (dict(method="ssqr", outlier_rate=1.5), r"outlier_rate must be in \[0, 1\), got 1.5"),
    (dict(method="hptq", target_bits=0.5), r"target_bits must be in \(1, 8\] bits/weight for hptq, got 0.5"),
    (dict(order="reverse"), "order must be one of act, min-pivot, natural, got 'reverse'"),
    (dict(damp=math.nan), "damp must be >= 0, got nan"),
    (dict(method="rtn", scale_bits=3), r"scale_bits must be one of \(4,\), got 3"),
    (dict(quantize_lm_head=True, lm_head_bits=1), "lm_head_bits must be an integer in 2..8, got 1"),
    (dict(nsamples=0), "nsamples must be a positive integer, got 0"),
    (dict(moe_min_tokens=0), r"moe_min_tokens must be an integer in \[1, 2\^63\), got 0"),
    (dict(moe_min_tokens=2 ** 64), r"moe_min_tokens must be an integer in \[1, 2\^63\), got 18446744073709551616"),
    (dict(seed=2 ** 64), r"seed must be an integer in \[-2\^63, 2\^63\), got 18446744073709551616"),
    (dict(column_scales="norm", column_scale_power=-1.0), "column_scale_power must be >= 0, got -1.0"),
])
def test_a_bad_option_is_named_as_the_user_wrote_it(kw, message):
    with pytest.raises(ValueError, match=message) as e:
        QuantizeOptions(**kw)
    assert "quantization_config" not in str(e.value)


def test_what_the_options_accept_the_format_writes():
    """The options' rules and the format's agree at their edges: every accepted width writes."""
    for bits in fmt.spec.INLIER_BITS:
        opts = QuantizeOptions(bits=bits, quantize_lm_head=True, lm_head_bits=bits)
        assert opts.quantization_config([], "lm_head")["layer_bits"] == {"lm_head": bits}
    assert QuantizeOptions(method="ssqr", outlier_rate=0.0).quantization_config([])["outlier_rate"] == 0.0
    assert QuantizeOptions(method="hrtn", target_bits=8).quantization_config([])["target_bits"] == 8.0
