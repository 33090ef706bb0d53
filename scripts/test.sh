#!/usr/bin/env bash
# Run the test suite (sets up .venv first; re-running setup is quick).
#   bash scripts/test.sh          default suite (<= 15 min on 2 idle cores)
#   bash scripts/test.sh --slow   the slow tests (real models end to end, vLLM runs)
# Tests run on LATQ_TEST_WORKERS pytest-xdist workers (default: the cores, at most 4; 1: no
# workers): the default suite whole files to a worker, so a file's module fixtures are built once;
# the slow suite test by test, an idle worker taking another's queue (its tests take minutes each:
# whole files left one worker busy for a quarter of an hour after the other had finished).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${LATQ_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
par=()
if [ "$workers" -gt 1 ]; then par=(-n "$workers" --dist loadfile); fi
if [ "${1:-}" = "--slow" ]; then
  shift
  if [ "$workers" -gt 1 ]; then par=(-n "$workers" --dist worksteal); fi
  exec .venv/bin/python -m pytest -m slow -q "${par[@]}" "$@"
fi
exec .venv/bin/python -m pytest -q "${par[@]}" "$@"
