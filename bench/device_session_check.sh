#!/usr/bin/env bash
# device_session_check.sh — the lead's one end-of-session call on the GPU machine: every GPU test
# binary of one build of main, then the PERF.md decode grid (PyTorch SDPA first for the same
# shapes, then ours with its BF16 baseline), then the write kernels, all in the same run.
# Binaries are built on the development machine (cmake --build build) and carried with their
# non-system shared libraries in $DEVLIBS or $DEVLIBS/lib (lib/ is shared with the pool part).
#   DEVLIBS=.devlibs-final bench/device_session_check.sh      (results under $OUT)
# Expects in $DEVLIBS: cuda_kernels_test kvstore_gpu_test worker_gpu_test cuda_decode_bench
# cuda_write_bench (and their libraries). Optional pool part (the H200 host as a quiet 16-core
# machine, no GPU used): $DEVLIBS/pool/ with ucx/ (UCX's
# transport modules), bin/ucx_perftest and one folder per build (BUILD/bin/{kvpool-server,
# pool_bench}, BUILD/SHA); POOL_BUILDS="a b" lists them, POOL_ROUNDS (default 2) alternating
# rounds of bench/pool_bench.py --repeat 3 over posix,cma with ucx_perftest in every run, and
# the fresh-buffer baseline too when bin/ucp_rotating_bench is there (or BUILD/bin has one);
# POOL_TCP_BUILD=b adds one pool_bench.py --repeat 3 run of build b over UCX_TLS=tcp at the end.
# POOL_INFLIGHT (default 8; 0 = none) is pool_bench.py --inflight: the in-flight table (8 clients
# x 1 thread, after each run's baselines), for builds whose pool_bench has --only-inflight.
# DECODE_AB_ENV="KVPOOL_DECODE_X=v" adds DECODE_AB_ROUNDS (2) alternating rounds of the headline
# shapes with and without that launcher switch. POOL_ONLY=1 skips everything but the pool part.
# Prints a one-line verdict per test binary; the bench JSON files and logs are packed into
# $OUT/session_check.tgz, the summary log stays beside it.
set -u
OUT=${OUT:-/tmp/out}
DEVLIBS=${DEVLIBS:-.devlibs-final}
mkdir -p "$OUT/r"
export LD_LIBRARY_PATH="$PWD/$DEVLIBS:$PWD/$DEVLIBS/lib:${LD_LIBRARY_PATH:-}"
LOG="$OUT/session_check_log.txt"
T0=$(date +%s)
stamp() { echo "[+$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
{
  echo "== $(date -u) $(cat "$DEVLIBS/COMMIT" 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"

if [ -z "${POOL_ONLY:-}" ]; then
stamp "== GPU tests, concurrently (CPU references dominate their time)"
TESTS="cuda_kernels_test kvstore_gpu_test worker_gpu_test"
for t in $TESTS; do
  ("$DEVLIBS/$t" >"$OUT/r/test_$t.txt" 2>&1; echo "rc=$?" >>"$OUT/r/test_$t.txt") &
done
wait
for t in $TESTS; do
  echo "-- $t" | tee -a "$LOG"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|Failure|rc=" "$OUT/r/test_$t.txt" | head -40 | tee -a "$LOG"
done

B="$DEVLIBS/cuda_decode_bench"
pair() {  # name, bench args...: SDPA for the same shapes (page sizes do not apply), then ours
  local name=$1
  shift
  stamp "== decode $name: $*"
  PYTHONUNBUFFERED=1 python3 bench/cuda_sdpa_baseline.py --out "$OUT/r/sdpa_$name.json" \
    $(echo "$@" | sed -E 's/--page-sizes [0-9,]+//') >>"$OUT/r/sdpa_$name.log" 2>&1
  "$B" "$@" --sdpa-json "$OUT/r/sdpa_$name.json" --json "$OUT/r/decode_$name.json" 2>&1 | tee -a "$LOG"
}
pair grid --batches 1,8,32,128 --contexts 4096,32768,131072 --gqa 32:8 --page-sizes 16
pair gqa_p64 --batches 32 --contexts 32768 --gqa 32:8,64:8,32:4 --page-sizes 16,64
pair headline --batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16
pair headline128 --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16

if [ -n "${DECODE_AB_ENV:-}" ]; then
  # Same-call A/B of a launcher switch at the two headline shapes: DECODE_AB_ROUNDS (default 2)
  # alternating rounds of the default build against the same binary under DECODE_AB_ENV
  # ("NAME=VALUE ..."), SDPA measured once before the rounds (files decode_ab_*).
  PYTHONUNBUFFERED=1 python3 bench/cuda_sdpa_baseline.py --out "$OUT/r/sdpa_ab.json" \
    --batches 8,32 --contexts 32768,131072 --gqa 32:8 >>"$OUT/r/sdpa_ab.log" 2>&1
  for r in $(seq "${DECODE_AB_ROUNDS:-2}"); do
    for arm in default env; do
      for shape in "32 32768" "8 131072"; do
        set -- $shape
        stamp "== decode A/B round $r $arm B=$1 ctx=$2 ${DECODE_AB_ENV}"
        if [ "$arm" = env ]; then
          env $DECODE_AB_ENV "$B" --batches "$1" --contexts "$2" --gqa 32:8 --page-sizes 16 \
            --sdpa-json "$OUT/r/sdpa_ab.json" --json "$OUT/r/decode_ab_${arm}_b$1_r$r.json" 2>&1 | tee -a "$LOG"
        else
          "$B" --batches "$1" --contexts "$2" --gqa 32:8 --page-sizes 16 \
            --sdpa-json "$OUT/r/sdpa_ab.json" --json "$OUT/r/decode_ab_${arm}_b$1_r$r.json" 2>&1 | tee -a "$LOG"
        fi
      done
    done
  done
fi

stamp "== write kernels (64K / 256K / 1M token-heads at 8 KV heads)"
"$DEVLIBS/cuda_write_bench" --tokens 8192,32768,131072 --iters 30 --warmup 5 \
  --json "$OUT/r/write.json" 2>&1 | tee -a "$LOG"

nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
fi  # POOL_ONLY

if [ -n "${POOL_BUILDS:-}" ]; then
  P="$PWD/$DEVLIBS/pool"
  rot=()
  [ -x "$P/bin/ucp_rotating_bench" ] && rot=(--rotating-bench "$P/bin/ucp_rotating_bench")
  stamp "== pool bench, posix,cma, builds: $(for b in $POOL_BUILDS; do echo -n "$b=$(cat "$P/$b/SHA") "; done)"
  for r in $(seq "${POOL_ROUNDS:-2}"); do
    for b in $POOL_BUILDS; do
      stamp "-- round $r $b"
      (export LD_LIBRARY_PATH="$PWD/$DEVLIBS/lib" UCX_MODULE_DIR="$P/ucx" PATH="$P/bin:$PATH" UCX_NET_DEVICES=lo PYTHONUNBUFFERED=1
        timeout 120 python3 bench/pool_bench.py --build "$P/$b" --tls posix,cma --repeat 3 \
          --results "$OUT/r" --sizes-kib "${POOL_SIZES_KIB:-256,1024,4096}" --tag "s_${b}_r$r" \
          ${rot[@]+"${rot[@]}"} --inflight "${POOL_INFLIGHT:-8}" --bench-flag=--commit-blocks=4 --bench-flag=--lookup-clients=16) 2>&1 | tee -a "$LOG" | tail -14
    done
  done
  if [ -n "${POOL_TCP_BUILD:-}" ]; then
    b=$POOL_TCP_BUILD
    stamp "-- tcp $b"
    (export LD_LIBRARY_PATH="$PWD/$DEVLIBS/lib" UCX_MODULE_DIR="$P/ucx" PATH="$P/bin:$PATH" UCX_NET_DEVICES=lo PYTHONUNBUFFERED=1
      timeout 180 python3 bench/pool_bench.py --build "$P/$b" --tls tcp --repeat 3 \
        --results "$OUT/r" --sizes-kib "${POOL_SIZES_KIB:-256,1024,4096}" --tag "s_${b}_tcp" \
        ${rot[@]+"${rot[@]}"} --inflight "${POOL_INFLIGHT:-8}" --bench-flag=--commit-blocks=4 --bench-flag=--lookup-clients=16) 2>&1 | tee -a "$LOG" | tail -14
  fi
fi
stamp "== done"
(cd "$OUT" && tar czf session_check.tgz r && rm -rf r)
