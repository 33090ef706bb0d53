"""bench/quantize_cost.py on the tiny Llama: both configurations quantize, and the HEADLINE ratios are
the runs' own medians (the timed runs are real latq-quantize processes)."""
import pytest

from bench import quantize_cost


@pytest.mark.slow
def test_headline_ratios_are_the_runs_medians(tiny_llama, capsys):
    quantize_cost.main(["--model", str(tiny_llama), "--nsamples", "2", "--seqlen", "32"])
    lines = capsys.readouterr().out.splitlines()
    runs = {ln.split(":")[0]: ln for ln in lines if ln.startswith(tuple(quantize_cost.CONFIGS))}
    assert set(runs) == set(quantize_cost.CONFIGS)
    head = dict(kv.split("=", 1) for kv in lines[-1].removeprefix("HEADLINE ").split())
    cpu = {n: float(head[f"{n}_cpu_s"]) for n in quantize_cost.CONFIGS}
    assert all(c > 0 for c in cpu.values())
    assert float(head["e8_3b_vs_gptq_cpu"]) == pytest.approx(cpu["e8_3b"] / cpu["gptq_4b"], rel=0.05, abs=0.01)
    # each run's mean layer error, read from its checkpoint
    assert all(0 < float(head[f"{n}_rel_error"]) < 1 for n in quantize_cost.CONFIGS)
