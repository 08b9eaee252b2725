#!/usr/bin/env bash
# One run on a GPU machine, under 8 minutes, offline: build for the present GPU, the CUDA tests, compute-sanitizer
# (memcheck, racecheck) and the benchmark against ATen (and Liger / Quack if importable).
#
#   bash benchmarks/gpu_check.sh                 # results in $OUT (default ./gpu_check_out)
#
# Every step runs under `timeout`, its limit cut so that the steps after it keep their share of the total
# (GPU_CHECK_TOTAL_S, default 460 s); a failing step is recorded and the next one runs. Files (8, flat):
#   build.log  test_cuda.log  test_others.log  memcheck.log  racecheck.log  bench.log  bench.md  summary.txt
# The summary (also printed last) has each step's exit code and time, build_info(), the ptxas register /
# spill count, test and sanitizer result lines, and the benchmark's summary and decode tables.
# Environment: PYTHON (default python3), MAX_JOBS (16), TORCH_CUDA_ARCH_LIST (default: the GPU's capability).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOTAL=${GPU_CHECK_TOTAL_S:-460}
DEADLINE=$(($(date +%s) + TOTAL))
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY=()

left() { echo $((DEADLINE - $(date +%s))); }

# step NAME CAP RESERVE LOG COMMAND...: run COMMAND for at most CAP seconds, and at most until RESERVE seconds
# before the deadline; output to $OUT/LOG; record the exit code (124/137: timed out) and the time taken.
step() {
  local name=$1 cap=$2 reserve=$3 log=$4 limit started rc took note=""
  shift 4
  limit=$(($(left) - reserve))
  ((limit > cap)) && limit=$cap
  ((limit < 5)) && limit=5
  started=$(date +%s)
  echo "== $name: limit ${limit}s, log $OUT/$log"
  timeout -k 10 "$limit" "$@" >"$OUT/$log" 2>&1
  rc=$?
  took=$(($(date +%s) - started))
  ((rc == 124 || rc == 137)) && note=" (TIMED OUT)"
  SUMMARY+=("$(printf '%-12s rc=%-4s %4ss%s' "$name" "$rc" "$took" "$note")")
  tail -n 3 "$OUT/$log"
  return 0
}

# ---- 1. build for this GPU only, with the ptxas resource report ----------------------------------------------
ARCH=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 9.0)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$ARCH} FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16}
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-Xptxas -v"
step build 300 150 build.log "$PY" setup.py build_ext --inplace
KERNELS=$(grep -c 'ptxas info *: Used' "$OUT/build.log")
SPILLING=$(grep -cE '[1-9][0-9]* bytes spill (stores|loads)' "$OUT/build.log")
STACK=$(grep -cE '[1-9][0-9]* bytes stack frame' "$OUT/build.log")
MAXREG=$(grep -oE 'Used [0-9]+ registers' "$OUT/build.log" | awk '{print $2}' | sort -n | tail -n 1)
INFO=$(timeout 120 "$PY" -c 'import torch, layernorm_ext as L
print("build_info:", L.build_info())
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(), torch.cuda.device_count(), "GPU(s)")' 2>&1 | tail -n 3)
echo "$INFO"

# ---- 2. tests: test_cuda.py, then the CUDA parametrizations of the rest (one CPU instruction set) -------------
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts=-ra)
"$PY" -c 'import xdist' 2>/dev/null && PYTEST+=(-n 8)
"$PY" -c 'import pytest_timeout' 2>/dev/null && PYTEST+=(--timeout 120)
NOT_ISA=$(timeout 60 "$PY" -c 'import layernorm_ext as L; print(" and ".join("not " + i for i in L.native.supported_cpu_isas()[1:]))' 2>/dev/null)
step test_cuda 150 225 test_cuda.log "${PYTEST[@]}" tests/test_cuda.py
step test_others 120 165 test_others.log "${PYTEST[@]}" tests --ignore=tests/test_cuda.py --ignore=tests/test_cuda_emulation.py -k "cuda${NOT_ISA:+ and $NOT_ISA}"

# ---- 3. compute-sanitizer over one call per kernel path --------------------------------------------------------
CS=$(command -v compute-sanitizer)
for candidate in /usr/local/cuda*/bin/compute-sanitizer; do
  [ -z "$CS" ] && [ -x "$candidate" ] && CS=$candidate
done
if [ -n "$CS" ]; then
  step memcheck 90 120 memcheck.log env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool memcheck --error-exitcode 1 \
    --print-limit 20 "$PY" benchmarks/sanitize_cases.py
  step racecheck 60 90 racecheck.log "$CS" --tool racecheck --error-exitcode 1 --print-limit 20 \
    "$PY" benchmarks/sanitize_cases.py --quick
else
  SUMMARY+=("sanitizers   compute-sanitizer not found")
fi

# ---- 4. benchmark: copy bandwidth C, ours vs ATen (Liger, Quack), M >= 8192 rows, decode sizes -----------------
step bench 600 10 bench.log "$PY" benchmarks/bench.py --gpu-check --out "$OUT/bench.md"

# ---- summary -----------------------------------------------------------------------------------------------------
{
  echo "==== gpu_check summary ($(date -u +%FT%TZ), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST) ===="
  printf '%s\n' "${SUMMARY[@]}"
  echo "$INFO"
  echo "ptxas: $KERNELS kernels reported, max ${MAXREG:-?} registers, $SPILLING with spills, $STACK with a stack frame"
  grep -E '[1-9][0-9]* bytes spill (stores|loads)' -B1 "$OUT/build.log" | grep -oE "Function properties for [^ ]+|[0-9]+ bytes spill.*" | head -n 10
  echo "test_cuda:   $(grep -E ' in [0-9.]+s' "$OUT/test_cuda.log" | tail -n 1)"
  grep -E '^(FAILED|ERROR) ' "$OUT/test_cuda.log" | head -n 15
  echo "test_others: $(grep -E ' in [0-9.]+s' "$OUT/test_others.log" | tail -n 1)"
  grep -E '^(FAILED|ERROR) ' "$OUT/test_others.log" | head -n 10
  for t in memcheck racecheck; do
    [ -f "$OUT/$t.log" ] && echo "$t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_cases:' "$OUT/$t.log" | tr '\n' ' ')"
  done
  if [ -f "$OUT/bench.md" ]; then
    grep -E '^- C = ' "$OUT/bench.md" | cut -c1-60
    sed -n '/^## Summary/,/^## /p' "$OUT/bench.md" | grep '^|'
    sed -n '/^## decode/,$p' "$OUT/bench.md" | grep '^|'
  else
    echo "bench: no report; last progress lines:"
    tail -n 8 "$OUT/bench.log"
  fi
} >"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
