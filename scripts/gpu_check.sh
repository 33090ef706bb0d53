#!/usr/bin/env bash
# The GPU check: on a bare CUDA machine (python3 with torch, triton, transformers, safetensors,
# pytest; no vLLM, no network) the figures of record first — so a run cut short still has them —
# then the GPU tests and the other benches in the time left, all in one call of under 10 minutes.
#
#   GPU_CHECK_COMMIT=<sha> bash scripts/gpu_check.sh OUTDIR     # figures, boundary paths, tests, the rest
#   bash scripts/gpu_check.sh --phase rest OUTDIR               # a second call: tests, scale forms, launch configs
#   bash scripts/gpu_check.sh --phase e8 OUTDIR                 # the codebook kernels alone: bench and the GEMV's
#                                                               # tiles at M = 1 (--sweep), decode, tests, E8's
#                                                               # solve beside GPTQ's on 8B shapes (~6 min)
#   bash scripts/gpu_check.sh --tar "$OUT/check.tgz" ... OUTDIR   # OUTDIR packed into one file at the end (a lent
#                                                               # machine returns at most 8 files)
#   bash scripts/gpu_check.sh --dry-run OUTDIR                  # on a CPU: the figures' pieces, tiny, in Triton's
#                                                               # interpreter with fake timers (no speed), the schema
#   bash scripts/gpu_check.sh --list-shards                     # the test files and shard expressions, nothing run
#
# OUTDIR/env.txt          nvidia-smi, python and package versions (GemLite's too), compilers, the cost model's device
# OUTDIR/kernels.log      bench/kernels.py: the four 8B layers, 4-bit then 2- and 3-bit inliers with 1 % outliers,
#                         M = 1..64, beside bf16, torch's int4 kernel and GemLite (4-bit g128); OUTDIR/points.json;
#                         the table's pick against its pipelined twin and the tensor-core route below 8 rows
#                         (OUTDIR/ab_timings.json); OUTDIR/table.log, launch_configs.json, table_timings.json: the
#                         launch table rebuilt with those timings
# OUTDIR/e8_kernels.log   bench/e8_kernels.py: the codebook kernels (triton-e8, E8-3b s4-g16) on 8b.down and 8b.gate_up
#                         against bf16 and the integer 3-bit kernel at batch 1, 4, 16; OUTDIR/e8_points.json
# OUTDIR/e2e.log          bench/decode_gpu.py: the Llama-3-8B-shaped decoder (8 of 32 blocks, projected) in
#                         SSQR-1 %-4b, E8-3b, the default's form and SSQR-1 %-3b against bf16 and int4, batch 1, 8,
#                         16; OUTDIR/e2e.json
# OUTDIR/latest.json      all three in docs/gpu/latest.json's schema (bench/gpu_figures.py), for commit GPU_CHECK_COMMIT
#                         (else the checkout's HEAD); also written to the checkout's docs/gpu/latest.json
# OUTDIR/boundary.log     the CUDA-boundary paths that need no vLLM (vllm_latq/testing/boundary_paths.py)
# OUTDIR/tests.log        every shard's pytest output; tests-N.log, junit-N.xml (in the time left)
# OUTDIR/bench_scales.log, launch_configs.log, launch_timings.json: the rest, where time is left (--phase rest)
# OUTDIR/solver_e8.log    (--phase e8) bench/solver_speed.py: E8-3b's solve on the GPU beside GPTQ-4b's, 8B shapes
# OUTDIR/summary.txt      what is printed at the end
# Exit status: non-zero when a boundary path or a test failed or timed out (the benches run anyway).
#
# GemLite is not installed on a lent machine: its sdist, unpacked under .gpu_peers/ by scripts/gpu_peers.sh and
# carried with the checkout, goes on PYTHONPATH. Knobs (environment): PYTHON (python3), GPU_CHECK_TOTAL_S (570),
# GPU_CHECK_KERNELS_S (230), GPU_CHECK_E8_S (60), GPU_CHECK_E2E_S (150), GPU_CHECK_TEST_S (390: the tests' limit, at
# most the time left), GPU_CHECK_LAYERS (8), LATQ_CPU_NATIVE (0: the CPU halves of the CUDA-vs-CPU tests run pure torch).
set -uo pipefail

# the GPU tests and their shards; tests/gpu/test_gpu_check.py checks every GPU test falls in a shard
test_files=(tests/gpu/test_triton_cuda.py tests/gpu/test_families_cuda.py tests/gpu/test_graphs_cuda.py
            tests/gpu/test_moe_cuda.py tests/gpu/test_solvers_cuda.py tests/gpu/test_pipeline_cuda.py
            tests/kernels/test_opcheck.py tests/gpu/test_gpu_capture.py tests/quantize/test_distributed.py
            tests/gpu/test_codebook_cuda.py)
shards=()
for b in 2bit 3bit 4bit 5bit; do
  shards+=("$b and splitk" "$b and ragged" "$b and moe and not splitk and not ragged"
           "$b and not moe and not splitk and not ragged")
done
nobits="not 2bit and not 3bit and not 4bit and not 5bit"
shards+=("$nobits and (solver or sweep or mse or quantize)" "$nobits and not (solver or sweep or mse or quantize)")
phase=all
dry=0
tarball=
while [ $# -gt 0 ]; do
  case "$1" in
    --list-shards) echo "files: ${test_files[*]}"; printf 'shard: %s\n' "${shards[@]}"; exit 0 ;;
    --phase) phase=${2:?--phase all|figures|rest|e8}; shift 2 ;;
    --tar) tarball=${2:?--tar FILE}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) break ;;
  esac
done
case "$phase" in all|figures|rest|e8) ;; *) echo "gpu_check: --phase must be all, figures, rest or e8 (got $phase)" >&2; exit 2 ;; esac
out=${1:?usage: bash scripts/gpu_check.sh [--phase all|figures|rest|e8] [--tar FILE] [--dry-run] OUTDIR}
repo=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
total_s=${GPU_CHECK_TOTAL_S:-570}
mkdir -p "$out" && out=$(cd "$out" && pwd)
peers=$(ls -d "$repo"/.gpu_peers/*/ 2>/dev/null | tr '\n' ':')
export PYTHONPATH="$repo${peers:+:${peers%:}}${PYTHONPATH:+:$PYTHONPATH}"
export LATQ_CPU_NATIVE=${LATQ_CPU_NATIVE:-0}
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
if [ "$dry" = 1 ]; then
  export TRITON_INTERPRET=1 LATQ_TRITON_INTERPRET_OK=1
else
  export TRITON_INTERPRET=0                    # tests/conftest.py only sets it when unset
fi
commit=${GPU_CHECK_COMMIT:-$(git -C "$repo" rev-parse HEAD 2>/dev/null || true)}
t0=$(date +%s)
left() { echo $((total_s - ($(date +%s) - t0))); }
: > "$out/summary.txt"
note() { echo "$*" | tee -a "$out/summary.txt"; }
# run LOG LIMIT_S ARGS...: one python module under a time limit, its HEADLINE (or last line) in the summary
run() {
  local log=$1 limit=$2; shift 2
  echo "python $* (limit ${limit}s)" > "$out/$log"
  (cd "$repo" && timeout -k 10 "$limit" "$py" "$@") >> "$out/$log" 2>&1
  local rc=$?
  local why=""; [ "$rc" = 124 ] && why=" (timed out after ${limit}s)"
  note "$log: exit $rc$why: $(grep -m1 '^HEADLINE' "$out/$log" || tail -n 1 "$out/$log")"
  return $rc
}

# ---------------------------------------------------------------------------- environment
{
  echo "date: $(date -u +%FT%TZ)"
  echo "repo: $repo @ ${commit:-(no commit: set GPU_CHECK_COMMIT)}; peers on PYTHONPATH: ${peers:-none}"
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
          "memory clock kHz", getattr(p, "memory_clock_rate", "?"), "bus bits", getattr(p, "memory_bus_width", "?"),
          "L2", getattr(p, "L2_cache_size", "?"))
    try:   # the cost model's constants for this GPU (kernels/triton/cost_model.py: HBM from clock x bus width)
        from vllm_latq.kernels.triton.cost_model import device_model
        print("cost model:", device_model(p))
    except Exception as e:
        print("cost model: unavailable:", type(e).__name__, e)
for m in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "pytest", "pytest_timeout", "gemlite"):
    try:
        print(m, getattr(__import__(m), "__version__", "?"))
    except Exception as e:
        print(m, "missing:", type(e).__name__, str(e)[:100])
try:
    import vllm
    print("vllm", vllm.__version__, "(installed; the GPU check does not use it)")
except Exception:
    print("vllm absent")
EOF
  for tool in g++ ninja nvcc ptxas; do echo "$tool: $(command -v $tool || echo absent)"; done
  echo "cpus: $(nproc)"
} > "$out/env.txt" 2>&1

# ---------------------------------------------------------------------------- the figures
figures() {
  local kern_s=${GPU_CHECK_KERNELS_S:-230} e8_s=${GPU_CHECK_E8_S:-60} e2e_s=${GPU_CHECK_E2E_S:-150}
  # beside the table's pick, its pipelined twin and (M < 8) the tensor-core route, 4-bit first:
  # a cut run still has the A/B (OUTDIR/ab_timings.json, launch timings the table takes)
  local ab=(--breakdown pipelined,mma,mma_pipelined --timings-json "$out/ab_timings.json")
  local kern=(-m bench.kernels --no-static --shapes 8b --bits 4,2,3 --rates 0.01 --m 1,2,4,8,16,32,64 "${ab[@]}"
              --json "$out/points.json" --budget-s $((kern_s - 70)))
  local e8=(-m bench.e8_kernels --shapes 8b.down,8b.gate_up --m 1,4,16 --scales s4-g16 --json "$out/e8_points.json"
            --budget-s $((e8_s - 25)))
  local e2e=(-m bench.decode_gpu --layers "${GPU_CHECK_LAYERS:-8}" --forms ssqr-1%-4b,e8-3b-s4-g16,gptq-4b-g64,ssqr-1%-3b
             --json "$out/e2e.json" --budget-s $((e2e_s - 50)))
  local device
  if [ "$dry" = 1 ]; then
    kern=(-m bench.kernels --dry-run --shapes 8b --bits 4 --rates 0.01 --m 1,8 "${ab[@]}" --json "$out/points.json")
    e8=(-m bench.e8_kernels --dry-run --shapes 8b.down --m 1,8 --scales s4-g16 --json "$out/e8_points.json")
    e2e=(-m bench.decode_gpu --dry-run --forms ssqr-1%-4b,e8-3b-s4-g16 --tokens 4 --prompt 2 --batches 1,2
         --json "$out/e2e.json")
  fi
  run kernels.log "$kern_s" "${kern[@]}"
  # the packaged table rebuilt with the A/B's timings: where a pipelined kernel or the tensor-core
  # route ran faster (OUTDIR/launch_configs.json; commit it with tools/launch_timings.json)
  cp "$repo/tools/launch_timings.json" "$out/table_timings.json"
  run table.log 60 -m tools.launch_table --from-summary --add-timings "$out/ab_timings.json" \
      --timings "$out/table_timings.json" --out "$out/launch_configs.json"
  run e8_kernels.log "$e8_s" "${e8[@]}"
  run e2e.log "$e2e_s" "${e2e[@]}"
  device=$(sed -n 's/^device \(.*\) capability.*/\1/p' "$out/env.txt" | head -n 1)
  [ "$dry" = 1 ] && device="dry run (CPU, fake timers)"
  if [ -z "$device" ]; then
    note "latest.json: not written (no CUDA device; --dry-run shows the schema)"
    return
  fi
  if [ -z "$commit" ]; then
    note "latest.json: not written (no commit: set GPU_CHECK_COMMIT=<sha>; merge later with python -m bench.gpu_figures merge)"
    return
  fi
  run merge.log 60 -m bench.gpu_figures merge --points "$out/points.json" --e2e "$out/e2e.json" --e8 "$out/e8_points.json" \
      --device "${device:-unknown}" --commit "$commit" --out "$out/latest.json"
  if [ "$dry" = 0 ] && [ -s "$out/latest.json" ]; then
    mkdir -p "$repo/docs/gpu" && cp "$out/latest.json" "$repo/docs/gpu/latest.json"
  fi
}

# ---------------------------------------------------------------------------- the GPU tests (shards)
tests() {
  local limit=$1 per_test=() i rc why
  "$py" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=300)
  note "tests: ${#shards[@]} shards in parallel, limit ${limit}s"
  for i in "${!shards[@]}"; do
    (
      cd "$repo" && OMP_NUM_THREADS=2 timeout -k 15 "$limit" "$py" -m pytest -m gpu \
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
    why=""; [ "$rc" = 124 ] && why=" (timed out after ${limit}s)"
    { echo "===== shard $i: -k \"${shards[$i]}\" -> exit $rc$why"; cat "$out/tests-$i.log"; echo; } >> "$out/tests.log"
    note "shard $i exit $rc$why: $(tail -n 1 "$out/tests-$i.log")"
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
}

# ---------------------------------------------------------------------------- the rest
rest() {
  local scales_s=75 configs_s
  if [ "$(left)" -ge $((scales_s + 10)) ]; then
    run bench_scales.log "$scales_s" -m bench.kernels --no-static --shapes 8b.down,8b.o --rates 0 --m 1,8,64 \
        --breakdown none --peers none --scales fp16-g128,s4-g64,fp16-g64,s4-g32 --budget-s $((scales_s - 25))
  else
    note "scale-form bench: not run ($(left)s left)"
  fi
  configs_s=$(($(left) - 5))
  if [ "$configs_s" -ge 30 ]; then
    # the tensor-core rows at every bit width this family has no timings of (tools/launch_timings.json);
    # OUTDIR/launch_timings.json is what `python -m tools.launch_table --from-summary --add-timings` takes
    run launch_configs.log "$configs_s" -m bench.launch_configs --shapes 8b.down,8b.gate_up,8b.qkv,8b.o \
        --bits 2,3,4,5 --untimed --m 16,32,64 --json "$out/launch_timings.json" --budget-s $((configs_s - 20))
  else
    note "launch-config bench: not run (${configs_s}s left)"
  fi
}

# ---------------------------------------------------------------------------- the codebook kernels alone
e8_phase() {
  local scales
  run e8_kernels_s4-g16.log 150 -m bench.e8_kernels --shapes 8b.down,8b.gate_up --m 1,4,8,16 --scales s4-g16 \
      --json "$out/e8_points_s4-g16.json" --budget-s 100 --sweep     # the study's form, and the GEMV's tiles
  run e8_kernels_fp16-g64.log 90 -m bench.e8_kernels --shapes 8b.down,8b.gate_up --m 1,4,8,16 --scales fp16-g64 \
      --json "$out/e8_points_fp16-g64.json" --budget-s 50           # a plain form: what coded scales cost
  run e2e.log 100 -m bench.decode_gpu --layers 8 --forms e8-3b-s4-g16,e8-2b-s4-g16 --batches 1,8,16 \
      --json "$out/e2e.json" --budget-s 60
  (cd "$repo" && timeout -k 10 150 "$py" -m pytest -m gpu tests/gpu/test_codebook_cuda.py -q -rfEs -p no:cacheprovider \
      > "$out/tests.log" 2>&1)
  tests_rc=$?
  note "codebook tests exit $tests_rc: $(tail -n 1 "$out/tests.log")"
  # E8's solve on the GPU beside GPTQ's (block Babai's torch path: a user's `--device cuda`), in the time left
  local solve_s=$(( $(left) - 10 ))
  [ "$solve_s" -le 90 ] || solve_s=90
  if [ "$solve_s" -ge 30 ]; then
    run solver_e8.log "$solve_s" -m bench.solver_speed --sections c --device cuda --e8-shapes 4096x4096,4096x14336 \
        --e8-bits 3 --e8-tokens 2048 --repeats 1
  else
    note "solver_e8: not run (${solve_s}s left)"
  fi
}

boundary_rc=0
tests_rc=0
case "$phase" in
  e8)
    if [ "$dry" = 0 ]; then e8_phase; else note "--phase e8: on a GPU only"; fi ;;
  *)
    [ "$phase" = rest ] || figures
    if [ "$dry" = 0 ] && [ "$phase" != rest ]; then
      run boundary.log 120 -m vllm_latq.testing.boundary_paths --device cuda
      boundary_rc=$?
      grep '^boundary ' "$out/boundary.log" >> "$out/summary.txt"
    fi
    if [ "$phase" != figures ] && [ "$dry" = 0 ]; then
      test_s=$(( $(left) - 15 ))
      [ "$test_s" -le "${GPU_CHECK_TEST_S:-390}" ] || test_s=${GPU_CHECK_TEST_S:-390}
      if [ "$test_s" -ge 60 ]; then tests "$test_s"; else note "tests: not run (${test_s}s left)"; fi
      rest
    fi
    [ "$dry" = 1 ] && note "dry run: no GPU, no tests, no speed; OUTDIR/latest.json shows the schema only" ;;
esac
note "total: $(($(date +%s) - t0))s; logs in $out"
[ -n "$tarball" ] && tar czf "$tarball" -C "$out" .
[ "$boundary_rc" = 0 ] || exit 1
exit $tests_rc
