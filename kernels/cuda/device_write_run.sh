#!/usr/bin/env bash
# device_write_run.sh — one call on the GPU machine for the write kernels (kv_write.cu): the
# GPU tests of kv_write_test.cc, then bench/cuda_write_bench (table + JSON), optionally Nsight
# Compute counters of the four d=128 write kernels (clocks left alone) and their SASS profile.
# Binaries are built on the development machine and carried, with their non-system shared
# libraries, in $L (default .devlibs-write5/). Results under $OUT.
#   kernels/cuda/device_write_run.sh            tests + bench
#   NCU=1 kernels/cuda/device_write_run.sh      ... + ncu + SASS instruction mix
#   SRC=1 kernels/cuda/device_write_run.sh      ... + ncu source counters of quantize-only (d 128):
#                                               executed instructions per SASS line (CSV) and
#                                               the ALU / FMA pipe utilization
#   TEST_FILTER='KvWrite.*' ...                 a subset of the tests (default: KvWrite.*:EndToEnd.*)
#   TEST_BINS='a b%FILTER' ...                  several test builds in turn (default: cuda_kernels_test);
#                                               'b%FILTER': that build with its own gtest filter
#   BENCHES='a b' ROUNDS=2 NCU_BENCH=b TAR_JSON=1  several bench builds in turn (A/B in one run);
#                                               an entry 'b@VAR=value' runs build b with that
#                                               environment (launcher switches, e.g. KVPOOL_WRITE_TMA=0)
#   ALT_TEST_ENV='VAR=value' ...                the tests again under that environment
#                                               (binary ALT_TEST_BIN, default cuda_kernels_test)
#   SASS_BINS='a b' ...                         the SASS of the d=128 quantize-only kernel of each
#                                               build, gzipped, as $OUT/sass_<binary>.txt.gz
#   TARBALL=1 ...                               pack everything under $OUT into write_results.tgz
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
L=${L:-.devlibs-write5}
export LD_LIBRARY_PATH="$PWD/$L:${LD_LIBRARY_PATH:-}"
LOG="$OUT/write_log.txt"
{
  echo "== $(date -u) $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  for entry in ${TEST_BINS:-cuda_kernels_test}; do
    # an entry 'binary%FILTER' runs that binary with its own gtest filter
    tb=${entry%%\%*}
    filter=${TEST_FILTER:-KvWrite.*:EndToEnd.*}
    [ "$entry" != "$tb" ] && filter=${entry#*%}
    TL="$OUT/write_test_log.txt"
    [ "${TEST_BINS:-cuda_kernels_test}" != cuda_kernels_test ] && TL="$OUT/write_test_log_$tb.txt"
    echo "== tests $tb ($filter)" | tee -a "$LOG"
    $L/$tb --gtest_filter="$filter" > "$TL" 2>&1
    echo "test exit $?" | tee -a "$LOG"
    grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|^\[(quantize|rotate|e2e)|Failure|Expected|Which|actual" \
      "$TL" | head -80 | tee -a "$LOG"
  done
  if [ -n "${ALT_TEST_ENV:-}" ]; then
    TL="$OUT/write_test_log_alt.txt"
    echo "== tests cuda_kernels_test with $ALT_TEST_ENV" | tee -a "$LOG"
    env $ALT_TEST_ENV $L/${ALT_TEST_BIN:-cuda_kernels_test} --gtest_filter="${ALT_TEST_FILTER:-KvWrite.*}" > "$TL" 2>&1
    echo "test exit $?" | tee -a "$LOG"
    grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|^\[(quantize|rotate|e2e)|Failure|Expected|Which|actual" \
      "$TL" | head -80 | tee -a "$LOG"
  fi
fi
# BENCHES: bench binaries in $L run in turn, ROUNDS times (A/B of kernel builds in one run;
# each run's JSON is $OUT/<binary>_r<round>.json, or $OUT/cuda_write_bench.json for the default).
BENCHES=${BENCHES:-cuda_write_bench}
for round in $(seq 1 "${ROUNDS:-1}"); do
  for entry in $BENCHES; do
    b=${entry%%@*}
    benv=""
    [ "$entry" != "$b" ] && benv=${entry#*@}
    name=$b
    [ -n "$benv" ] && name="${b}_$(echo "$benv" | tr -c 'A-Za-z0-9_\n' '_')"
    J="$OUT/${name}_r${round}.json"
    [ "$BENCHES" = cuda_write_bench ] && [ "${ROUNDS:-1}" = 1 ] && J="$OUT/cuda_write_bench.json"
    echo "== bench $b ${benv:+($benv) }round $round" | tee -a "$LOG"
    env $benv $L/$b --tokens "${TOKENS:-8192,32768,131072}" --iters 30 --warmup 5 --json "$J" 2>&1 |
      tee -a "$LOG"
  done
done
[ -n "${TAR_JSON:-}" ] && (cd "$OUT" && tar cf bench_json.tar *.json && rm -f *.json)
for sb in ${SASS_BINS:-}; do
  cuobjdump -sass "$L/$sb" 2>/dev/null |
    awk '/Function : /{p = ($0 ~ /KvWriteKernelILi128ELb0ELb0E/)} p' | gzip > "$OUT/sass_$sb.txt.gz"
  echo "== sass $sb: $(zcat "$OUT/sass_$sb.txt.gz" | grep -cE '^\s+/\*[0-9a-f]{4}\*/') instructions" | tee -a "$LOG"
done
NB=${NCU_BENCH:-cuda_write_bench}
if [ "${NCU:-0}" = 1 ]; then
  echo "== ncu (d=128, 32768 tokens x 8 KV heads; quantize-only, rotate+quantize, rotate-bf16, demote)" | tee -a "$LOG"
  S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis"
  ncu --clock-control none --kernel-name-base mangled --kernel-name regex:KvWriteKernelILi128 \
    --launch-count 4 $S $L/$NB --tokens 32768 --iters 1 --warmup 0 > "$OUT/ncu_write.txt" 2>&1
  grep -E "KvWriteKernel|Duration|Memory Throughput|DRAM Throughput|Issue Slots Busy|Issued Warp|Eligible Warps|Registers Per|Achieved Active|Executed Instructions  |Stall|Theoretical Occ" \
    "$OUT/ncu_write.txt" | tee -a "$LOG"
  cuobjdump -sass $L/$NB > /tmp/all.sass 2>&1
  python3 - <<'PY' > "$OUT/sass_write.txt" 2>&1
import re, collections
txt = open('/tmp/all.sass').read()
for fn in re.split(r'\n\s*Function : ', txt)[1:]:
    name = fn.split('\n', 1)[0]
    if 'KvWriteKernel' not in name:
        continue
    ops = collections.Counter()
    for m in re.finditer(r'/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)', fn):
        ops[m.group(2).split('.')[0]] += 1
    print(name, 'static instructions:', sum(ops.values()))
    print('  ', ', '.join(f'{k}:{v}' for k, v in ops.most_common(40)))
PY
  head -c 6000 "$OUT/sass_write.txt" | tee -a "$LOG"
fi
if [ "${SRC:-0}" = 1 ]; then
  echo "== ncu source counters (quantize-only, d=128, 32768 tokens x 8 KV heads)" | tee -a "$LOG"
  M=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
  ncu --clock-control none --kernel-name-base mangled --kernel-name regex:KvWriteKernelILi128ELb0ELb0E \
    --launch-count 1 --section SourceCounters --section WarpStateStats --metrics "$M" \
    -o "$OUT/ncu_src" $L/$NB --tokens 32768 --iters 1 --warmup 0 > "$OUT/ncu_src_log.txt" 2>&1
  ncu --import "$OUT/ncu_src.ncu-rep" --page details --print-details all > "$OUT/ncu_src_details.txt" 2>&1
  grep -E "pipe|inst_executed|issue_active|dram__|duration" "$OUT/ncu_src_details.txt" | tee -a "$LOG"
  ncu --import "$OUT/ncu_src.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_src_sass.csv" 2>&1
  head -c 600 "$OUT/ncu_src_sass.csv" | tee -a "$LOG"; echo | tee -a "$LOG"
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
if [ "${TARBALL:-0}" = 1 ]; then
  (cd "$OUT" && tar czf /tmp/write_results.tgz . && find . -type f ! -name write_log.txt -delete &&
    mv /tmp/write_results.tgz .)
fi
