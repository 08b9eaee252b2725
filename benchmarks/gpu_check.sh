#!/usr/bin/env bash
# One run on a GPU machine, under 8 minutes, offline: build for the present GPU, the CUDA tests, compute-sanitizer
# (memcheck, racecheck), the host time per call (overhead.py) and the benchmark against ATen (and Liger / Quack if
# importable).
#
#   bash benchmarks/gpu_check.sh                 # results in $OUT (default ./gpu_check_out)
#
# Every step runs under `timeout`, its limit cut so that the steps after it keep their share of the total
# (GPU_CHECK_TOTAL_S, default 470 s); a failing step is recorded and the next one runs. A step that runs out of
# time gets SIGINT first, so that pytest still prints its summary and writes its junit file. Files (flat):
#   build.log  crash_probe.log  tests.log  tests.xml  failures.txt  memcheck.log  racecheck.log  overhead.log
#   overhead.md  bench.log  bench.md  summary.txt
# tests.log has one line per test as it finishes (-v), so failures.txt (every FAILED / ERROR test with its
# message, from the junit file, or from the log where the run was killed) lists every failure even after a
# time-out. The summary (also printed last) names the commit (or GPU_CHECK_COMMIT when the copy has no .git)
# and a hash of the sources, each step's exit code and time, build_info(), the ptxas register / spill count,
# test and sanitizer result lines, and the benchmark's summary and decode tables.
# Environment: PYTHON (default python3), MAX_JOBS and test workers (default: all cores), TORCH_CUDA_ARCH_LIST
# (default: the GPU's capability).
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TOTAL=${GPU_CHECK_TOTAL_S:-470}
CORES=$(nproc 2>/dev/null || echo 8)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "${GPU_CHECK_COMMIT:-unknown}")
[ -n "$(git status --porcelain 2>/dev/null)" ] && COMMIT="$COMMIT+uncommitted changes"
SOURCES_SHA=$(find csrc layernorm_ext tests benchmarks setup.py -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.h' \
  -o -name '*.cu' -o -name '*.cuh' -o -name '*.sh' \) -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs sha1sum |
  sha1sum | cut -c1-12)
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
  timeout -s INT -k 30 "$limit" "$@" >"$OUT/$log" 2>&1
  rc=$?
  took=$(($(date +%s) - started))
  ((rc == 124 || rc == 137)) && note=" (TIMED OUT)"
  SUMMARY+=("$(printf '%-12s rc=%-4s %4ss%s' "$name" "$rc" "$took" "$note")")
  tail -n 3 "$OUT/$log"
  return 0
}

# ---- 1. build for this GPU only, with the ptxas resource report ----------------------------------------------
ARCH=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 9.0)
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$ARCH} FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-$CORES}
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-Xptxas -v"
step build 300 170 build.log "$PY" setup.py build_ext --inplace
KERNELS=$(grep -c 'ptxas info *: Used' "$OUT/build.log")
SPILLING=$(grep -cE '[1-9][0-9]* bytes spill (stores|loads)' "$OUT/build.log")
STACK=$(grep -cE '[1-9][0-9]* bytes stack frame' "$OUT/build.log")
MAXREG=$(grep -oE 'Used [0-9]+ registers' "$OUT/build.log" | awk '{print $2}' | sort -n | tail -n 1)
INFO=$(timeout 120 "$PY" -c 'import torch, layernorm_ext as L
print("build_info:", L.build_info())
print("torch", torch.__version__, "cuda", torch.version.cuda, "|", torch.cuda.get_device_name(), torch.cuda.device_count(), "GPU(s)")' 2>&1 | tail -n 3)
echo "$INFO"

# ---- 1b. refused calls, each in a child process, with a native backtrace of any crash (2026-12-04: SIGSEGV) ----
step crash_probe 60 400 crash_probe.log "$PY" benchmarks/crash_probe.py

# ---- 2. tests: test_cuda.py and the CUDA parametrizations of the other files (one CPU instruction set), in one
# run over every core (about 2 minutes for test_cuda.py alone at 16 workers) ---------------------------------------
PYTEST=("$PY" -m pytest -v -p no:cacheprovider -o addopts= -rfE --junitxml="$OUT/tests.xml")
"$PY" -c 'import xdist' 2>/dev/null && PYTEST+=(-n "$CORES")
"$PY" -c 'import pytest_timeout' 2>/dev/null && PYTEST+=(--timeout 150)
NOT_ISA=$(timeout 60 "$PY" -c 'import layernorm_ext as L; print(" and ".join("not " + i for i in L.native.supported_cpu_isas()[1:]))' 2>/dev/null)
# -k "cuda": test_cuda.py's tests by their module's name, the device-parametrized tests by their [cuda] id; not
# the emulated kernels' tests (host code, a build of their own: on 2026-12-04 they took 16 workers' time out).
step tests 330 110 tests.log "${PYTEST[@]}" tests --ignore=tests/test_cuda_emulation.py \
  -k "cuda and not emulated${NOT_ISA:+ and $NOT_ISA}"
"$PY" - "$OUT/tests.xml" "$OUT/tests.log" >"$OUT/failures.txt" 2>&1 <<'PY'
import re, sys, xml.etree.ElementTree as ET
xml_path, log_path = sys.argv[1], sys.argv[2]
try:
    cases = ET.parse(xml_path).getroot().iter("testcase")
    rows = []
    for case in cases:
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is not None:
                message = (bad.get("message") or "").splitlines()[0][:300] if bad.get("message") else ""
                rows.append(f"{kind.upper()} {case.get('classname')}::{case.get('name')} :: {message}")
    print(f"{len(rows)} failures and errors (from {xml_path})")
    print("\n".join(rows))
except (OSError, ET.ParseError):  # killed before pytest wrote its junit file: the -v lines of the log
    lines = [m.group(0) for m in re.finditer(r"^.*\b(FAILED|ERROR)\b.*$", open(log_path, errors="replace").read(), re.M)]
    print(f"no junit file; {len(lines)} FAILED / ERROR lines from {log_path}")
    print("\n".join(lines))
PY

# ---- 3. compute-sanitizer over one call per kernel path --------------------------------------------------------
CS=$(command -v compute-sanitizer)
for candidate in /usr/local/cuda*/bin/compute-sanitizer; do
  [ -z "$CS" ] && [ -x "$candidate" ] && CS=$candidate
done
if [ -n "$CS" ]; then
  step memcheck 60 70 memcheck.log env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$CS" --tool memcheck --error-exitcode 1 \
    --print-limit 20 "$PY" benchmarks/sanitize_cases.py
  step racecheck 45 35 racecheck.log "$CS" --tool racecheck --error-exitcode 1 --print-limit 20 \
    "$PY" benchmarks/sanitize_cases.py --quick
else
  SUMMARY+=("sanitizers   compute-sanitizer not found")
fi

# ---- 4. host time per call on CUDA, ours vs ATen (issue 10's table; about 30 s) ---------------------------------
step overhead 60 35 overhead.log "$PY" benchmarks/overhead.py --devices cuda --out "$OUT/overhead.md"

# Quantized output (fused against norm + torch's quantize ops; codes checked equal first).
step quant 45 180 quant.log "$PY" benchmarks/quantized.py --device cuda --repeats 20
# Strided rows (QK-norm on a qkv view, LayerNorm2d channels_last): in place against the copy paths.
step strided 30 150 strided.log "$PY" benchmarks/strided.py --device cuda --repeats 20

# ---- 5. benchmark: copy bandwidth C, ours vs ATen (Liger, Quack), M >= 8192 rows, decode sizes -----------------
step bench 600 5 bench.log "$PY" benchmarks/bench.py --gpu-check --out "$OUT/bench.md"

# ---- summary -----------------------------------------------------------------------------------------------------
{
  echo "==== gpu_check summary ($(date -u +%FT%TZ), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, $CORES cores) ===="
  echo "commit $COMMIT, sources sha1 $SOURCES_SHA"
  printf '%s\n' "${SUMMARY[@]}"
  echo "$INFO"
  echo "ptxas: $KERNELS kernels reported, max ${MAXREG:-?} registers, $SPILLING with spills, $STACK with a stack frame"
  grep -E '[1-9][0-9]* bytes spill (stores|loads)' -B1 "$OUT/build.log" | grep -oE "Function properties for [^ ]+|[0-9]+ bytes spill.*" | head -n 10
  [ -f "$OUT/crash_probe.log" ] && grep -E '^crash_probe:| exit -' "$OUT/crash_probe.log"
  echo "tests: $(grep -E ' in [0-9.]+s' "$OUT/tests.log" | tail -n 1)"
  head -n 25 "$OUT/failures.txt"
  for t in memcheck racecheck; do
    [ -f "$OUT/$t.log" ] && echo "$t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_cases:' "$OUT/$t.log" | tr '\n' ' ')"
  done
  [ -f "$OUT/overhead.md" ] && grep -E '^Worst|^\| cuda' "$OUT/overhead.md" | grep -E '1x8|Worst'
  [ -f "$OUT/quant.log" ] && grep -E '^copy|^\| [0-9]' "$OUT/quant.log"
  [ -f "$OUT/strided.log" ] && grep -E '^\| (QK|Layer|\[)' "$OUT/strided.log"
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
