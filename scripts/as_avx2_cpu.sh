#!/usr/bin/env bash
# Run a command as it would run on an AVX2-only x86 CPU (AMD Zen 2/3, older Xeons), on any newer
# x86 CPU: every library's instruction-set dispatch is capped at AVX2 + FMA and bf16 counts as
# emulated. The hardware stays what it is (clock, caches, memory), so speeds are an approximation.
#   bash scripts/as_avx2_cpu.sh python -m bench.decode --kernels cpu --modes compiled
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export LATQ_CPU_MARCH=x86-64-v3       # latq's C++ op, built as there (its own cached build)
export LATQ_CPU_ISA=avx2              # … and its GEMV's dispatch
export LATQ_CPU_BF16=0                # latq's dtype choices (cpu_features.native_bf16)
export ATEN_CPU_CAPABILITY=avx2       # torch's own kernels
export ONEDNN_MAX_CPU_ISA=AVX2        # oneDNN (torch's and vLLM's GEMMs)
export MKL_ENABLE_INSTRUCTIONS=AVX2   # MKL's BLAS
export PYTHONPATH="$here/avx2_cpu${PYTHONPATH:+:$PYTHONPATH}"   # vLLM's probes (sitecustomize.py)
exec "$@"
