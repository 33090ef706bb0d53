#!/usr/bin/env bash
# The GPU check: on a bare CUDA machine (python3 with torch, triton,
# transformers, safetensors, pytest; no vLLM, no network) run the GPU tests, then the GPU bench,
# in under 10 minutes, and leave their logs in OUTDIR.
#
#   bash scripts/gpu_check.sh OUTDIR
#   bash scripts/gpu_check.sh --list-shards   # the test files and shard expressions, nothing run
#
# OUTDIR/env.txt          nvidia-smi, python and package versions, compilers, the cost model's device constants
# OUTDIR/boundary.log     the CUDA-boundary paths that need no vLLM, on real CUDA tensors: what latq hands
#                         vLLM's kernels, multiplied out with torch (vllm_latq/testing/boundary_paths.py),
#                         one line per path, also in summary.txt
# OUTDIR/tests.log        every shard's pytest output (durations included); tests-N.log, junit-N.xml;
#                         tests/gpu/test_gpu_capture.py is vLLM's warm-up + CUDA-graph capture
# OUTDIR/bench.log        bench/kernels.py --no-static --m 1,2,4,8,16,32,64,128,256
# OUTDIR/bench_scales.log the same kernels with coded group scales (--scale-bits 4) against fp16 ones:
#                         --scales fp16-g128,s4-g64,fp16-g64,s4-g32 on two 8B layers (the timing
#                         the --scale-bits 4 default waits for)
# OUTDIR/launch_configs.log  bench/launch_configs.py on four 8B layers at M = 16, 32, 64, at the bit widths
#                         without timings for this GPU family: every tensor-core launch config against the
#                         table's choice, in the time left of the total (none under 30 s);
#                         OUTDIR/launch_timings.json: its timings, for tools/launch_table.py --add-timings
# OUTDIR/summary.txt      what is printed at the end
# Exit status: non-zero when a boundary path or a test failed or timed out (the bench runs anyway).
#
# The tests run as parallel pytest shards (split on their 2bit/3bit/4bit/5bit/splitk/ragged ids and moe): most of
# their time is Triton compiling kernel variants, one CPU core each. Knobs (environment):
# PYTHON (python3), GPU_CHECK_TOTAL_S (570: the whole run, under a 10-minute slot), GPU_CHECK_TEST_S
# (390: wall limit of the test phase; the bench gets what is left of the total),
# LATQ_CPU_NATIVE (0: the CPU halves of the CUDA-vs-CPU tests run the pure-torch paths, the same
# math, instead of building the C++ ops first, which takes minutes).
set -uo pipefail

# the GPU tests (test_gpu_capture.py: vLLM's eager warm-up at each capture size, then the real
# capture) and their shards; tests/gpu/test_gpu_check.py checks every GPU test falls in a shard
test_files=(tests/gpu/test_triton_cuda.py tests/gpu/test_families_cuda.py tests/gpu/test_graphs_cuda.py
            tests/gpu/test_moe_cuda.py tests/gpu/test_solvers_cuda.py tests/gpu/test_pipeline_cuda.py
            tests/kernels/test_opcheck.py tests/gpu/test_gpu_capture.py tests/quantize/test_distributed.py)
shards=()
for b in 2bit 3bit 4bit 5bit; do
  shards+=("$b and splitk" "$b and ragged" "$b and moe and not splitk and not ragged"
           "$b and not moe and not splitk and not ragged")
done
nobits="not 2bit and not 3bit and not 4bit and not 5bit"
shards+=("$nobits and (solver or sweep or mse or quantize)" "$nobits and not (solver or sweep or mse or quantize)")
if [ "${1:-}" = "--list-shards" ]; then
  echo "files: ${test_files[*]}"
  printf 'shard: %s\n' "${shards[@]}"
  exit 0
fi

out=${1:?usage: bash scripts/gpu_check.sh OUTDIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
total_s=${GPU_CHECK_TOTAL_S:-570}
test_s=${GPU_CHECK_TEST_S:-390}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0                      # tests/conftest.py only sets it when unset
export LATQ_CPU_NATIVE=${LATQ_CPU_NATIVE:-0}
export PYTHONDONTWRITEBYTECODE=1
t0=$(date +%s)

# ---------------------------------------------------------------------------- environment
{
  echo "date: $(date -u +%FT%TZ)"
  echo "repo: $repo @ $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '(no git)')"
  nvidia-smi || echo "nvidia-smi: not available"
  "$py" - <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    p = torch.cuda.get_device_properties(0)
    print("properties: SMs", p.multi_processor_count, "SM clock kHz", getattr(p, "clock_rate", "?"),
          "memory clock kHz", getattr(p, "memory_clock_rate", "?"), "bus bits", getattr(p, "memory_bus_width", "?"))
    try:   # the cost model's constants for this GPU (kernels/triton/cost_model.py: HBM from clock x bus width)
        from vllm_latq.kernels.triton.cost_model import device_model
        print("cost model:", device_model(p))
    except Exception as e:
        print("cost model: unavailable:", type(e).__name__, e)
for m in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "pytest", "pytest_timeout"):
    try:
        print(m, getattr(__import__(m), "__version__", "?"))
    except Exception as e:
        print(m, "missing:", type(e).__name__)
try:
    import vllm
    print("vllm", vllm.__version__, "(installed; the GPU tests do not use it)")
except Exception:
    print("vllm absent")
EOF
  for tool in g++ ninja nvcc ptxas; do echo "$tool: $(command -v $tool || echo absent)"; done
  echo "cpus: $(nproc)"
} > "$out/env.txt" 2>&1

# ---------------------------------------------------------------------------- the CUDA boundary, torch alone
(cd "$repo" && timeout -k 10 120 "$py" -m vllm_latq.testing.boundary_paths --device cuda) > "$out/boundary.log" 2>&1
boundary_rc=$?
grep '^boundary ' "$out/boundary.log" > "$out/summary.txt" || echo "boundary: exit $boundary_rc, no path ran" > "$out/summary.txt"
[ "$boundary_rc" = 0 ] || tail -n 5 "$out/boundary.log" >> "$out/summary.txt"

# ---------------------------------------------------------------------------- tests (shards)
per_test=()
"$py" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=300)
cat "$out/summary.txt"
echo "gpu_check: ${#shards[@]} test shards in parallel, limit ${test_s}s" | tee -a "$out/summary.txt"
for i in "${!shards[@]}"; do
  (
    cd "$repo" && OMP_NUM_THREADS=2 timeout -k 15 "$test_s" "$py" -m pytest -m gpu \
      "${test_files[@]}" -k "${shards[$i]}" -q -rfEs --durations=15 --maxfail=100 \
      -p no:cacheprovider "${per_test[@]}" --junitxml="$out/junit-$i.xml" > "$out/tests-$i.log" 2>&1
    echo $? > "$out/rc-$i"
  ) &
done
wait
tests_rc=0
: > "$out/tests.log"
for i in "${!shards[@]}"; do
  rc=$(cat "$out/rc-$i" 2>/dev/null || echo 99)
  rm -f "$out/rc-$i"
  [ "$rc" = 0 ] || tests_rc=1
  note=""; [ "$rc" = 124 ] && note=" (timed out after ${test_s}s)"
  { echo "===== shard $i: -k \"${shards[$i]}\" -> exit $rc$note"; cat "$out/tests-$i.log"; echo; } >> "$out/tests.log"
  echo "shard $i exit $rc$note: $(tail -n 1 "$out/tests-$i.log")" | tee -a "$out/summary.txt"
done
"$py" - "$out" <<'EOF' | tee -a "$out/summary.txt"
import glob, sys
import xml.etree.ElementTree as ET
tot = dict(tests=0, failures=0, errors=0, skipped=0)
for f in glob.glob(f"{sys.argv[1]}/junit-*.xml"):
    try:
        for s in ET.parse(f).getroot().iter("testsuite"):
            for k in tot:
                tot[k] += int(s.get(k, 0))
    except ET.ParseError:
        print(f"unreadable {f} (a shard was killed?)")
print("tests: " + " ".join(f"{k} {v}" for k, v in tot.items()))
EOF
t1=$(date +%s)
echo "test phase: $((t1 - t0))s" | tee -a "$out/summary.txt"

# ---------------------------------------------------------------------------- bench
bench=(-m bench.kernels --no-static --m 1,2,4,8,16,32,64,128,256)
scales_s=75   # the scale-form bench's share, after the main bench
bench_s=$((total_s - (t1 - t0) - 20 - scales_s))
[ "$bench_s" -ge 30 ] || bench_s=30
echo "bench: ${bench[*]} (limit ${bench_s}s)" > "$out/bench.log"
(cd "$repo" && PYTHONUNBUFFERED=1 timeout -k 15 "$bench_s" "$py" "${bench[@]}") >> "$out/bench.log" 2>&1
bench_rc=$?
if [ "$bench_rc" = 2 ] && grep -q "unrecognized arguments" "$out/bench.log"; then
  # a bench without --no-static/--m: its quick static report, then its default GPU timing
  echo "(bench without --no-static/--m: rerun as bench/kernels.py --quick)" >> "$out/bench.log"
  left=$((bench_s - ($(date +%s) - t1)))
  [ "$left" -ge 10 ] || left=10
  (cd "$repo" && PYTHONUNBUFFERED=1 timeout -k 15 "$left" "$py" -m bench.kernels --quick) >> "$out/bench.log" 2>&1
  bench_rc=$?
fi
note=""; [ "$bench_rc" = 124 ] && note=" (timed out after ${bench_s}s)"
head=$(grep -m1 '^HEADLINE' "$out/bench.log" || tail -n 1 "$out/bench.log")
echo "bench exit $bench_rc$note: $head" | tee -a "$out/summary.txt"
scales=(-m bench.kernels --no-static --shapes 8b.down,8b.o --rates 0 --m 1,8,64 --breakdown none
        --scales fp16-g128,s4-g64,fp16-g64,s4-g32 --budget-s $((scales_s - 25)))
echo "bench: ${scales[*]} (limit ${scales_s}s)" > "$out/bench_scales.log"
(cd "$repo" && PYTHONUNBUFFERED=1 timeout -k 15 "$scales_s" "$py" "${scales[@]}") >> "$out/bench_scales.log" 2>&1
scales_rc=$?
head=$(grep -m1 '^HEADLINE' "$out/bench_scales.log" || tail -n 1 "$out/bench_scales.log")
echo "scale-form bench exit $scales_rc: $head" | tee -a "$out/summary.txt"
configs_s=$((total_s - ($(date +%s) - t0) - 5))
if [ "$configs_s" -ge 30 ]; then
  # the tensor-core rows at every bit width this family has no timings of (tools/launch_timings.json);
  # OUTDIR/launch_timings.json is what `python -m tools.launch_table --from-summary --add-timings` takes
  configs=(-m bench.launch_configs --shapes 8b.down,8b.gate_up,8b.qkv,8b.o --bits 2,3,4,5 --untimed --m 16,32,64
           --json "$out/launch_timings.json" --budget-s $((configs_s - 20)))
  echo "bench: ${configs[*]} (limit ${configs_s}s)" > "$out/launch_configs.log"
  (cd "$repo" && PYTHONUNBUFFERED=1 timeout -k 10 "$configs_s" "$py" "${configs[@]}") >> "$out/launch_configs.log" 2>&1
  configs_rc=$?
  head=$(grep -m1 '^HEADLINE' "$out/launch_configs.log" || tail -n 1 "$out/launch_configs.log")
  echo "launch-config bench exit $configs_rc: $head" | tee -a "$out/summary.txt"
  if [ -s "$out/launch_timings.json" ]; then
    echo "launch timings: $(grep -c '"us"' "$out/launch_timings.json") in $out/launch_timings.json (merge: python -m" \
         "tools.launch_table --from-summary --add-timings FILE)" | tee -a "$out/summary.txt"
  fi
else
  echo "launch-config bench: not run (${configs_s}s left)" | tee -a "$out/summary.txt"
fi
echo "total: $(($(date +%s) - t0))s; logs in $out" | tee -a "$out/summary.txt"
[ "$boundary_rc" = 0 ] || exit 1
exit $tests_rc
