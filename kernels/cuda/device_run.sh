#!/usr/bin/env bash
# device_run.sh — one call on the GPU machine: the decode GPU tests, then the decode benchmarks
# (PyTorch SDPA baseline first, then ours, in the same run). Binaries are built on the
# development machine and carried with their non-system shared libraries in $DEVLIBS
# (default .devlibs-decode).
#   kernels/cuda/device_run.sh [quick|grid|full]     (results under $OUT)
#     quick: B 1, 32 x 4K, 32K and B 8 x 128K (32q/8kv, d128, page 16), plus the same launcher
#            without programmatic dependent launch (KVPOOL_DECODE_PDL=0) at B 32 x 32K
#     grid:  the PERF.md grid the issue asks for: B {1, 8, 32, 128} x {4K, 32K, 128K} for
#            32q/8kv page 16, and 32q/8kv, 64q/8kv, 32q/4kv at B 32 x 32K for pages 16 and 64
#     v5:    B 1 and 32 x 32K, 8 x 128K, 128 x 128K (32q/8kv, page 16) with SDPA, then B 1 / 32 x 32K
#            and 8 x 128K again with KVPOOL_DECODE_ORDER=$ALT_ORDER (default int2) for A/B
#     v6:    B 1 and 32 x 32K, 8 x 128K with SDPA; then OLD_BENCH (a previous build's
#            cuda_decode_bench, if set), KVPOOL_DECODE_ORDER=$ALT_ORDER (if set) and each VAR=value
#            of ALT_ENVS on the same shapes; EXTRA=1 adds B 32/128 x 128K and the GQA/page-64 shapes
#     ab:    B 1 and 32 x 32K, 8 x 128K with SDPA (this build, with its BF16 baseline); then
#            ROUNDS (default 2) alternating rounds of this build and each binary of AB_BENCHES
#            (other builds' cuda_decode_bench) at B 32 x 32K and 8 x 128K, INT2 launch only
#            (--skip-bf16 where the binary has it); each VAR=value of AB_ENVS adds this build under
#            that setting to every round (an A/B switch of the launcher; VAR=a,VAR2=b sets both);
#            AB_BATCHES (default 32)
#            sets the batches of the 32K rounds, e.g. AB_BATCHES=1,32 adds B 1 x 32K to them
#            NO_PAIR=1 skips the SDPA/BF16 pass; TIMELINE_BENCH (a -DKVPOOL_DECODE_TIMELINE build of
#            cuda_decode_bench) writes per-CTA timestamps of one launch per headline shape to
#            $OUT/timeline.txt first (under TIMELINE_ENV="VAR=value ...")
#     rounds: ROUNDS (default 3) alternating rounds of every entry of CFGS over every bench argument
#            set of SHAPES (';'-separated, default the two headline sets), INT2 launch only
#            (--skip-bf16), each run's JSON under $OUT/rounds/ (packed into $OUT/rounds.tgz); a CFGS
#            entry is a cuda_decode_bench path, or PATH@VAR=a,VAR2=b (that binary under those launcher
#            settings); the first entry is the baseline of the summary table printed last (median
#            of each round per shape and config, mean ratio to the baseline); TEST_JOBS entries
#            BIN%FILTER[%VAR=a,VAR2=b] run concurrently before any timing (logs test_<i>.txt);
#            TIMELINE_BENCH with TIMELINE_SHAPES (';'-separated) writes per-CTA stamps first;
#            PAIRS (';'-separated argument sets) runs SDPA and PAIR_BENCH with its BF16 baseline on
#            each set first (JSON rounds/sdpa_pair<i>.json, rounds/cuda_decode_bench_pair<i>.json)
#     full:  every shape of PERF.md (long)
# TEST_FILTER (gtest filter) and SKIP_TESTS=1 control the tests; TEST_BINS="a b" also runs other
# builds' cuda_kernels_test, concurrently, before any timing (logs test_log_<binary>.txt)
# (TEST_ENV="VAR=value ..." runs them under those environment settings, e.g. an A/B switch of
# the launcher; ALT_TEST_ENV and ALT_TEST_FILTER run them a second time under other settings);
# SANITIZE=1 adds memcheck.
set -u
MODE=${1:-quick}
OUT=${OUT:-/tmp/out}
DEVLIBS=${DEVLIBS:-.devlibs-decode}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$DEVLIBS:${LD_LIBRARY_PATH:-}"
LOG="$OUT/device_log.txt"
{
  echo "== $(date -u) mode=$MODE"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== tests ${TEST_ENV:-}" | tee -a "$LOG"
  env ${TEST_ENV:-} "$DEVLIBS"/cuda_kernels_test --gtest_filter="${TEST_FILTER:-PagedDecode.*:EndToEnd.*}" 2>&1 |
    tee "$OUT/test_log.txt" |
    grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED|case|e2e)|Failure|Expected|Which|actual|error" | tee -a "$LOG"
fi
if [ -n "${TEST_BINS:-}" ]; then  # other builds' cuda_kernels_test, all at once (CPU-bound references)
  echo "== tests of $TEST_BINS (in parallel)" | tee -a "$LOG"
  for t in $TEST_BINS; do
    "$t" --gtest_filter="${TEST_FILTER:-PagedDecode.*:EndToEnd.*}" >"$OUT/test_log_$(basename "$t").txt" 2>&1 &
  done
  wait
  for t in $TEST_BINS; do
    echo "-- $t" | tee -a "$LOG"
    grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED|case|e2e)|Failure|Expected|Which|actual|error" \
      "$OUT/test_log_$(basename "$t").txt" | tee -a "$LOG"
  done
fi
if [ -n "${ALT_TEST_ENV:-}" ]; then  # the same tests again under an A/B switch of the launcher
  echo "== tests $ALT_TEST_ENV (${ALT_TEST_FILTER:-PagedDecode.*})" | tee -a "$LOG"
  env $ALT_TEST_ENV "$DEVLIBS"/cuda_kernels_test --gtest_filter="${ALT_TEST_FILTER:-PagedDecode.*}" 2>&1 |
    tee "$OUT/test_log_alt.txt" |
    grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|Failure|Expected|Which|actual|error" | tee -a "$LOG"
fi
B="$DEVLIBS/cuda_decode_bench"
SDPA="python3 bench/cuda_sdpa_baseline.py"
run_pair() {  # name, bench args...   (SDPA for the same shapes first, then ours)
  local name=$1
  shift
  echo "== $name" | tee -a "$LOG"
  PYTHONUNBUFFERED=1 $SDPA --out "$OUT/sdpa_$name.json" $(echo "$@" | sed -E 's/--page-sizes [0-9,]+//') \
    2>>"$LOG"
  "$B" "$@" --sdpa-json "$OUT/sdpa_$name.json" --json "$OUT/cuda_decode_bench_$name.json" 2>&1 | tee -a "$LOG"
}
case "$MODE" in
  quick)
    run_pair quick --batches 1,32 --contexts 4096,32768 --gqa 32:8 --page-sizes 16 --iters 20
    run_pair b8 --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 20
    echo "== without PDL" | tee -a "$LOG"
    KVPOOL_DECODE_PDL=0 "$B" --batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 20 2>&1 | tee -a "$LOG"
    # SASS of the INT2 kernel at d128 / one n-tile: instruction mix per 32-token step.
    [ "${SASS:-0}" = 1 ] && cuobjdump -sass "$B" 2>/dev/null | awk '/Function : .*Int2DecodeKernelILi128ELi1E/{p=1} p&&/Function : /&&!/Int2DecodeKernelILi128ELi1E/{p=0} p' \
      > "$OUT/sass_int2_d128.txt"
    ;;
  grid)
    run_pair grid --batches 1,8,32,128 --contexts 4096,32768,131072 --gqa 32:8 --page-sizes 16
    run_pair gqa_p64 --batches 32 --contexts 32768 --gqa 32:8,64:8,32:4 --page-sizes 16,64
    echo "== without PDL" | tee -a "$LOG"
    KVPOOL_DECODE_PDL=0 "$B" --batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16 2>&1 | tee -a "$LOG"
    ;;
  v5)  # headline shapes with SDPA, then the v4 launch sequence (separate MergeKernel) for A/B
    run_pair quick --batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 20
    run_pair b8 --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 20
    run_pair b128 --batches 128 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 10 --warmup 3
    echo "== KVPOOL_DECODE_ORDER=${ALT_ORDER:-int2} (A/B of the launch order)" | tee -a "$LOG"
    KVPOOL_DECODE_ORDER=${ALT_ORDER:-int2} "$B" --batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 20 2>&1 | tee -a "$LOG"
    KVPOOL_DECODE_ORDER=${ALT_ORDER:-int2} "$B" --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 20 2>&1 | tee -a "$LOG"
    ;;
  v6)  # headline shapes with SDPA, then the previous build (OLD_BENCH) on the same shapes for A/B
    run_pair quick --batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 20
    run_pair b8 --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 20
    if [ -n "${OLD_BENCH:-}" ] && [ -x "$OLD_BENCH" ]; then
      echo "== previous build $OLD_BENCH (A/B, same run)" | tee -a "$LOG"
      "$OLD_BENCH" --batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 20 2>&1 | tee -a "$LOG"
      "$OLD_BENCH" --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 20 2>&1 | tee -a "$LOG"
    fi
    if [ -n "${ALT_ORDER:-}" ]; then
      echo "== KVPOOL_DECODE_ORDER=$ALT_ORDER (A/B of the launch order)" | tee -a "$LOG"
      KVPOOL_DECODE_ORDER=$ALT_ORDER "$B" --batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 20 2>&1 | tee -a "$LOG"
      KVPOOL_DECODE_ORDER=$ALT_ORDER "$B" --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 20 2>&1 | tee -a "$LOG"
    fi
    for e in ${ALT_ENVS:-}; do  # further A/B switches of the launcher, one VAR=value each
      echo "== $e (A/B)" | tee -a "$LOG"
      env "$e" "$B" --batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 20 2>&1 | tee -a "$LOG"
      env "$e" "$B" --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 20 2>&1 | tee -a "$LOG"
    done
    if [ "${EXTRA:-0}" = 1 ]; then  # larger launches, other GQA shapes and page 64
      run_pair big --batches 32,128 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 10 --warmup 3
      run_pair gqa_p64 --batches 32 --contexts 32768 --gqa 32:8,64:8,32:4 --page-sizes 16,64 --iters 20
    fi
    ;;
  ab)  # this build vs other builds, alternating, same data seeds
    if [ "${NO_PAIR:-0}" != 1 ]; then
      run_pair quick --batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 30
      run_pair b8 --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 30
    fi
    if [ -n "${TIMELINE_BENCH:-}" ]; then  # a -DKVPOOL_DECODE_TIMELINE build: per-CTA stamps
      echo "== timeline $TIMELINE_BENCH" | tee -a "$LOG"
      for tb in "32 32768" "8 131072"; do
        set -- $tb
        env ${TIMELINE_ENV:-} KVPOOL_DECODE_TIMELINE="$OUT/timeline.txt" "$TIMELINE_BENCH" --skip-bf16 --batches "$1" \
          --contexts "$2" --gqa 32:8 --page-sizes 16 --iters 5 --warmup 2 2>&1 | grep -E "^int2" | tee -a "$LOG"
      done
    fi
    for r in $(seq "${ROUNDS:-2}"); do
      for ab in "$B" ${AB_BENCHES:-} ${AB_ENVS:-}; do
        e=""
        case "$ab" in *=*) e=${ab//,/ } ab=$B ;; esac  # VAR=value[,VAR=value]: this build so set
        [ -x "$ab" ] || continue
        sk=""
        "$ab" --help 2>/dev/null | grep -q -- --skip-bf16 && sk=--skip-bf16
        echo "== A/B round $r: $e $ab $sk" | tee -a "$LOG"
        env $e "$ab" $sk --batches "${AB_BATCHES:-32}" --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 30 2>&1 | grep -E "^int2|^kernel" | tee -a "$LOG"
        env $e "$ab" $sk --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 30 2>&1 | grep -E "^int2" | tee -a "$LOG"
      done
    done
    ;;
  rounds)  # CFGS x SHAPES in alternating rounds (see the header)
    mkdir -p "$OUT/rounds"
    TSV="$OUT/rounds/results.tsv"
    : >"$TSV"
    i=0
    for job in ${TEST_JOBS:-}; do  # concurrent test processes (CPU-bound references)
      IFS=% read -r tb tf te <<<"$job"
      i=$((i + 1))
      echo "== test job $i: ${te:-} $tb --gtest_filter=$tf" | tee -a "$LOG"
      env ${te//,/ } "$tb" --gtest_filter="$tf" >"$OUT/rounds/test_$i.txt" 2>&1 &
    done
    wait
    i=0
    for job in ${TEST_JOBS:-}; do
      i=$((i + 1))
      echo "-- test job $i: $job" | tee -a "$LOG"
      grep -E "^\[(  FAILED|  PASSED|  SKIPPED)|^\[=+\] .* ran|Failure|Expected|Which|actual|error|worst|e2e" \
        "$OUT/rounds/test_$i.txt" | head -40 | tee -a "$LOG"
    done
    if [ -n "${PAIRS:-}" ]; then  # SDPA + our INT2 and BF16 launches (PAIR_BENCH) per set
      B=${PAIR_BENCH:-$B}
      IFS=';' read -ra PS <<<"$PAIRS"
      n=0
      for ps in "${PS[@]}"; do
        n=$((n + 1))
        run_pair "pair$n" $ps --iters 30
      done
      mv "$OUT"/sdpa_pair*.json "$OUT"/cuda_decode_bench_pair*.json "$OUT/rounds/" 2>/dev/null
    fi
    if [ -n "${TIMELINE_BENCH:-}" ]; then
      IFS=';' read -ra TS <<<"${TIMELINE_SHAPES:---batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16}"
      for ts in "${TS[@]}"; do
        echo "== timeline $TIMELINE_BENCH $ts" | tee -a "$LOG"
        env ${TIMELINE_ENV:-} KVPOOL_DECODE_TIMELINE="$OUT/rounds/timeline.txt" "$TIMELINE_BENCH" --skip-bf16 $ts \
          --iters 5 --warmup 2 2>&1 | grep -E "^int2" | tee -a "$LOG"
      done
    fi
    IFS=';' read -ra SH <<<"${SHAPES:---batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16;--batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16}"
    for r in $(seq "${ROUNDS:-3}"); do
      c=0
      for cfg in ${CFGS:-$B}; do
        c=$((c + 1))
        bin=${cfg%%@*}
        e=""
        [ "$cfg" != "$bin" ] && e=${cfg#*@} && e=${e//,/ }
        n=0
        for sh in "${SH[@]}"; do
          n=$((n + 1))
          echo "== round $r cfg $c: $cfg | $sh" | tee -a "$LOG"
          env $e "$bin" --skip-bf16 $sh --iters 30 \
            --json "$OUT/rounds/r${r}_c${c}_s${n}.json" 2>&1 | grep -E "^int2|rror" | tee -a "$LOG" |
            awk -v r="$r" -v c="$cfg" '/^int2/{print r "\t" c "\t" $2 "\t" $3 "\t" $4 "\t" $6}' >>"$TSV"
        done
      done
    done
    python3 - "$TSV" <<'PY' | tee -a "$LOG"
import collections, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
cfgs, shapes, ms = [], [], collections.defaultdict(list)
for r, c, b, ctx, heads, t in rows:
    sh = f"B={b} ctx={ctx} {heads}"
    cfgs += [c] if c not in cfgs else []
    shapes += [sh] if sh not in shapes else []
    ms[(sh, c)].append(float(t))
print("== summary: per-round medians (ms); ratio = mean / mean of the first config")
for sh in shapes:
    print(sh)
    base = ms.get((sh, cfgs[0]))
    for c in cfgs:
        v = ms.get((sh, c))
        if not v:
            continue
        m = sum(v) / len(v)
        ratio = m / (sum(base) / len(base)) if base else float("nan")
        print(f"  {' / '.join(f'{x:.4f}' for x in v):<28} ratio {ratio:.3f}  {c.split('/')[-1]}")
PY
    tar -czf "$OUT/rounds.tgz" -C "$OUT" rounds && rm -rf "$OUT/rounds"
    ;;
  full)
    run_pair full
    ;;
esac
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
[ "${PROFILE:-0}" = 1 ] && DEVLIBS=$DEVLIBS bash kernels/cuda/device_profile.sh 2>&1 | tee -a "$LOG"
if [ "${SANITIZE:-0}" = 1 ]; then
  echo "== compute-sanitizer (memcheck, small cases)" | tee -a "$LOG"
  compute-sanitizer --tool memcheck --print-limit 20 "$DEVLIBS"/cuda_kernels_test \
    --gtest_filter='PagedDecode.OddAndShortLengths:PagedDecode.EachSegmentEmptyInTurn' \
    2>&1 | tail -25 | tee -a "$LOG"
fi
