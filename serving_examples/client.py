"""Query a served latq checkpoint through vLLM's OpenAI-compatible API.

    python serving_examples/client.py                       # one completion + one chat answer
    python serving_examples/client.py --requests 16 --concurrency 4 --check

Start the server first (see serving_examples/README.md), e.g.
    latq-serve ckpt/smollm2-ssqr --host 127.0.0.1 --port 8000

``--check`` turns the run into a smoke test: every answer must be complete (finish reason
"length" with exactly --max-tokens tokens, as EOS is ignored), else exit status 1.
Requests alternate between /v1/completions and /v1/chat/completions (chat needs a chat
template in the checkpoint's tokenizer; pass --no-chat for base models without one).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

PROMPTS = ["The capital of France is", "Photosynthesis is the process by which",
           "The three laws of thermodynamics are", "A haiku about the sea:"]
QUESTIONS = ["What is the capital of France?", "Explain photosynthesis in one sentence.",
             "Name three prime numbers.", "Write a haiku about the sea."]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-chat", action="store_true", help="only /v1/completions")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every answer is complete")
    ap.add_argument("--json", action="store_true", help="print one JSON summary line")
    a = ap.parse_args(argv)

    from openai import OpenAI

    client = OpenAI(base_url=a.base_url, api_key="EMPTY", timeout=600, max_retries=0)
    model = a.model or client.models.list().data[0].id

    def one(i: int) -> dict:
        t0 = time.time()
        chat = not a.no_chat and i % 2 == 1
        extra = {"ignore_eos": True} if a.check else {}
        if chat:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                max_tokens=a.max_tokens, temperature=0.0, extra_body=extra)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        else:
            r = client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=a.max_tokens,
                                          temperature=0.0, extra_body=extra)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        return {"i": i, "endpoint": "chat" if chat else "completions", "text": text, "finish": finish,
                "tokens": r.usage.completion_tokens, "seconds": round(time.time() - t0, 2)}

    t0 = time.time()
    with ThreadPoolExecutor(max_workers=a.concurrency) as pool:
        results = list(pool.map(one, range(a.requests)))
    wall = time.time() - t0
    bad = [r for r in results if a.check and (r["finish"] != "length" or r["tokens"] != a.max_tokens or not r["text"])]
    if a.json:
        print(json.dumps({"model": model, "requests": len(results), "complete": len(results) - len(bad),
                          "wall_s": round(wall, 2), "results": results}))
    else:
        for r in results:
            print(f"[{r['i']:2d} {r['endpoint']:11s} {r['finish']:6s} {r['tokens']:3d} tok {r['seconds']:6.1f}s] "
                  f"{r['text']!r}")
        print(f"{len(results)} requests, {a.concurrency} in flight, {wall:.1f} s, model {model}")
    if bad:
        print(f"incomplete answers: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
