#!/usr/bin/env bash
# Set everything up, then run the default job (the paper's comparison on real layers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m vllm_latq.demo "$@"
