"""Where one decode step's time goes, for ``bench/decode.py --profile``: one batch-1 generate
of an engine under ``torch.profiler``, split into

- ``linears_ms``: the decoder blocks' linears (vLLM's bf16 GEMM ops ``_C::onednn_mm`` & co.,
  latq's ``latq::*`` / ``latq_cpu::*`` custom ops; outermost match, the head's excluded);
- ``attention_ms``: vLLM's attention ops (``unified_attention``, the CPU backend's
  ``cpu_attention_with_kv_cache`` and cache writes);
- ``forward_rest_ms``: the rest of the model's forward (embedding, norms, rotary, activations,
  residual adds, and the Python or compiled glue between ops);
- ``lm_head_ms``: the output head (a ``bench::lm_head`` record around ``LogitsProcessor._get_logits``);
- ``sampling_ms``: vLLM's ``Sampler`` (greedy here);
- ``engine_ms``: everything outside those: scheduling, input preparation, output processing and
  detokenization, the engine's Python.

Each part is per generated token (its total over the run / new tokens). Profiling adds per-op
overhead, so the profiled step is printed beside the unprofiled one.
"""
from __future__ import annotations

import time

# names of the ops that are a decoder linear (outermost match counts; inside lm_head excluded)
LINEAR_OPS = ("onednn_mm", "weight_packed_linear", "aten::linear", "aten::addmm", "aten::mm", "latq::",
              "latq_cpu::")
ATTENTION_OPS = ("unified_attention", "cpu_attention", "cpu_attn", "paged_attention")
REGIONS = {"forward": "bench::forward", "lm_head": "bench::lm_head", "sampling": "bench::sample"}


def _recorded(fn, name: str):
    from torch.profiler import record_function

    def wrapped(*a, **k):
        with record_function(name):
            return fn(*a, **k)
    return wrapped


def _patches():
    """(owner, attribute, record name) of the methods wrapped in a named record while profiling."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    return [(GPUModelRunner, "_model_forward", REGIONS["forward"]),
            (LogitsProcessor, "_get_logits", REGIONS["lm_head"]), (Sampler, "forward", REGIONS["sampling"])]


def _outermost(evs, match, inside=None, outside=()) -> float:
    """µs of the events ``match`` accepts, nested ones counted once, within the ``inside`` spans
    (None: anywhere) and outside the ``outside`` spans."""
    total, last_end = 0.0, -1.0
    for e in sorted((e for e in evs if match(e.name)), key=lambda e: e.time_range.start):
        a, b = e.time_range.start, e.time_range.end
        if a < last_end or any(h0 <= a and b <= h1 for h0, h1 in outside):
            continue
        if inside is not None and not any(h0 <= a and b <= h1 for h0, h1 in inside):
            continue
        total += b - a
        last_end = b
    return total


def profile_step(llm, tokens: int, prompt: str) -> dict:
    """One batch-1 generate of ``tokens`` new tokens under torch.profiler → ms per token in each
    part (module docstring), ``step_ms`` the profiled run's wall time per token."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    patches = _patches()
    originals = [getattr(owner, attr) for owner, attr, _ in patches]
    for (owner, attr, name), fn in zip(patches, originals):
        setattr(owner, attr, _recorded(fn, name))
    try:
        llm.generate([prompt], sp, use_tqdm=False)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            llm.generate([prompt], sp, use_tqdm=False)
            wall = time.perf_counter() - t
    finally:
        for (owner, attr, _), fn in zip(patches, originals):
            setattr(owner, attr, fn)
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    spans = {k: [(e.time_range.start, e.time_range.end) for e in evs if e.name == n] for k, n in REGIONS.items()}
    tid = next((e.thread for e in evs if e.name == REGIONS["forward"]), None)
    mine = [e for e in evs if e.thread == tid]
    us = {k: sum(b - a for a, b in s) for k, s in spans.items()}
    linears = _outermost(mine, lambda n: any(k in n for k in LINEAR_OPS), spans["forward"], spans["lm_head"])
    attention = _outermost(mine, lambda n: any(k in n for k in ATTENTION_OPS), spans["forward"])
    ms = {k: v / 1000 / tokens for k, v in
          {"linears": linears, "attention": attention, "forward_rest": us["forward"] - linears - attention,
           "lm_head": us["lm_head"], "sampling": us["sampling"]}.items()}
    step = 1000 * wall / tokens
    out = {"step_ms": step, **{f"{k}_ms": v for k, v in ms.items()}, "engine_ms": step - us["forward"] / 1000 / tokens
           - ms["lm_head"] - ms["sampling"], "head_calls": len(spans["lm_head"])}
    out["other_ms"] = step - ms["linears"] - ms["lm_head"]
    out["outside_linears_share"] = out["other_ms"] / step
    return out
