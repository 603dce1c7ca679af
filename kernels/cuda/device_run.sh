#!/usr/bin/env bash
# device_run.sh — one call on the GPU machine: GPU tests, then the benchmarks (PyTorch SDPA
# baseline first, then ours, in the same run). Binaries are built on the development machine
# and carried in .devlibs/ with their non-system shared libraries.
#   kernels/cuda/device_run.sh [quick|full]     (results under $OUT)
set -u
MODE=${1:-quick}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
LOG="$OUT/device_log.txt"
{
  echo "== $(date -u) mode=$MODE"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== tests" | tee -a "$LOG"
  .devlibs/cuda_kernels_test ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} 2>&1 | tee "$OUT/test_log.txt" | grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED|case|quantize|rotate|e2e)|Failure|Expected|Which|actual|error" | tee -a "$LOG"
fi
if [ "$MODE" = quick ]; then
  ARGS="--batches 1,32 --contexts 4096,32768 --gqa 32:8 --page-sizes 16 --iters 20"
  BARGS=(--batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 20 --skip-write)
else
  ARGS=""
  BARGS=()
fi
echo "== sdpa" | tee -a "$LOG"
PYTHONUNBUFFERED=1 python3 bench/cuda_sdpa_baseline.py --out "$OUT/cuda_sdpa_baseline.json" \
  $(echo $ARGS | sed 's/--page-sizes 16//') 2>>"$OUT/sdpa_log.txt"
if [ "$MODE" = quick ]; then
  PYTHONUNBUFFERED=1 python3 bench/cuda_sdpa_baseline.py --out "$OUT/cuda_sdpa_baseline_b8.json" \
    --batches 8 --contexts 131072 --gqa 32:8 --iters 20 2>>"$OUT/sdpa_log.txt"
fi
echo "== ours" | tee -a "$LOG"
.devlibs/cuda_decode_bench $ARGS --sdpa-json "$OUT/cuda_sdpa_baseline.json" --json "$OUT/cuda_decode_bench.json" 2>&1 | tee -a "$LOG"
if [ "$MODE" = quick ]; then
  .devlibs/cuda_decode_bench "${BARGS[@]}" --sdpa-json "$OUT/cuda_sdpa_baseline_b8.json" --json "$OUT/cuda_decode_bench_b8.json" 2>&1 | tee -a "$LOG"
else
  echo "== ours, contiguous page ids (page-gather cost)" | tee -a "$LOG"
  .devlibs/cuda_decode_bench --batches 8,32 --contexts 32768,131072 --gqa 32:8 --page-sizes 16 --skip-write \
    --contiguous-pages --sdpa-json "$OUT/cuda_sdpa_baseline.json" --json "$OUT/cuda_decode_bench_contig.json" 2>&1 | tee -a "$LOG"
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
if [ "${SANITIZE:-0}" = 1 ]; then
  echo "== compute-sanitizer (memcheck, small cases)" | tee -a "$LOG"
  compute-sanitizer --tool memcheck --print-limit 20 .devlibs/cuda_kernels_test \
    --gtest_filter='PagedDecode.OddAndShortLengths:PagedDecode.EachSegmentEmptyInTurn:KvWrite.NonFinite*:KvWrite.DemoteMatchesCpu' \
    2>&1 | tail -25 | tee -a "$LOG"
fi
