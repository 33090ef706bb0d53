#!/usr/bin/env bash
# Run the test suite (sets up .venv first; re-running setup is quick).
#   bash scripts/test.sh          default suite (< ~25 min on 2 cores)
#   bash scripts/test.sh --slow   the slow tests (real models end to end, vLLM runs)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--slow" ]; then
  shift
  exec .venv/bin/python -m pytest -m slow -q "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
