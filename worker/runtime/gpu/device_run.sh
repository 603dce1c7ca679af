#!/usr/bin/env bash
# device_run.sh — one call on the GPU machine: the worker's GPU path (GpuMixedKvCache) against
# its CPU path (MixedKvCache) on a synthetic head_dim-128 Llama (worker_gpu_test, label gpu).
# The binary is built on the development machine and carried in .devlibs/ with its non-system
# shared libraries (see kernels/cuda/device_run.sh for the same pattern).
#   worker/runtime/gpu/device_run.sh            (log under $OUT/worker_gpu_log.txt)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
LOG="$OUT/worker_gpu_log.txt"
{
  echo "== $(date -u)"
  nvidia-smi --query-gpu=name,driver_version --format=csv
  nproc
} 2>&1 | tee "$LOG"
start=$(date +%s)
.devlibs/worker_gpu_test 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "== worker_gpu_test rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$LOG"
exit "$rc"
