#!/usr/bin/env bash
# Session-7 write-kernel device call (carried in .devlibs-write7): tests of the candidate
# build, alternating bench rounds of the candidates against the v10 binary, ncu of the
# warp-specialized fused kernel, a short table last.
#   BENCHES='v10 ws bf16 ...' ROUNDS=2 TOKENS=32768,131072 TESTS='KvWrite.*' NCU=1 KVTEST=0
set -u
L=.devlibs-write7
export LD_LIBRARY_PATH="$PWD/$L:${LD_LIBRARY_PATH:-}"
O=$OUT/r
mkdir -p "$O"
LOG=$O/s7_log.txt
{
  echo "== $(date -u)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
t0=$(date +%s)
# TEST_BINS: suffixes of cuda_kernels_test_<x> to run TESTS with (default: the plain binary)
for tb in ${TEST_BINS:-plain}; do
  [ -z "${TESTS:-}" ] && break
  exe=$L/cuda_kernels_test; [ "$tb" != plain ] && exe=$L/cuda_kernels_test_$tb
  echo "== tests $exe ($TESTS)" | tee -a "$LOG"
  timeout 150 $exe --gtest_filter="$TESTS" > "$O/s7_test_log_$tb.txt" 2>&1
  echo "test exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|^\[(quantize|rotate|rotate-ws|e2e)|Failure|Expected|Which|actual" \
    "$O/s7_test_log_$tb.txt" | head -60 | tee -a "$LOG"
done
if [ "${KVTEST:-0}" = 1 ]; then
  echo "== kvstore_gpu_test" | tee -a "$LOG"
  timeout 120 $L/kvstore_gpu_test > "$O/s7_kvstore_gpu_test_log.txt" 2>&1
  echo "kvstore_gpu_test exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|rotation d=|commit|Failure|Expected" \
    "$O/s7_kvstore_gpu_test_log.txt" | head -40 | tee -a "$LOG"
fi
for r in $(seq 1 "${ROUNDS:-2}"); do
  for b in ${BENCHES:-v10 ws}; do
    exe=${b%%@*}
    benv=""
    [ "$exe" != "$b" ] && benv=${b#*@}
    name=$(echo "$b" | tr -c 'A-Za-z0-9_\n' '_')
    echo "== bench $b round $r ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
    env $benv timeout 60 $L/cuda_write_bench_$exe --tokens "${TOKENS:-32768,131072}" --iters 30 \
      --warmup 5 --json "$O/bench_${name}_r$r.json" 2>&1 | tee -a "$LOG"
  done
done
# PICK='a b': the faster of these builds (mean rotate+quantize at 32768 tokens over the rounds)
# gets the end-to-end test and kvstore_gpu_test of its own build, and the ncu run
if [ -n "${PICK:-}" ]; then
  best=$(python3 - "$O" $PICK <<'PY'
import json, glob, os, sys
o, cands = sys.argv[1], sys.argv[2:]
def mean(c):
    v = []
    for f in glob.glob(os.path.join(o, 'bench_%s_r*.json' % c)):
        for r in json.load(open(f)).get('results', []):
            if r['kernel'] == 'rotate+quantize' and r['tokens'] == 32768: v.append(r['ms'])
    return sum(v) / len(v) if v else 1e9
print(min(cands, key=mean))
PY
)
  echo "== picked $best ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
  timeout 150 $L/cuda_kernels_test_$best --gtest_filter='EndToEnd.*' > "$O/s7_test_e2e_$best.txt" 2>&1
  echo "e2e exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED)|^\[e2e|Failure|Expected|Which|actual" "$O/s7_test_e2e_$best.txt" | head -30 | tee -a "$LOG"
  timeout 120 $L/kvstore_gpu_test_$best > "$O/s7_kvstore_gpu_test_$best.txt" 2>&1
  echo "kvstore_gpu_test exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|rotation d=|commit of|Failure|Expected" \
    "$O/s7_kvstore_gpu_test_$best.txt" | head -40 | tee -a "$LOG"
  NCU_BENCH=$best
fi
if [ "${NCU:-0}" = 1 ]; then
  echo "== ncu ws fused ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
  M=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
  timeout 120 ncu --clock-control none --kernel-name-base mangled \
    --kernel-name regex:"${NCU_KERNEL:-KvWriteKernelILi128ELb1ELb0ELb1E}" --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
    --metrics "$M" $L/cuda_write_bench_${NCU_BENCH:-ws} --tokens 32768 --iters 1 --warmup 0 \
    > "$O/s7_ncu.txt" 2>&1
  echo "ncu exit $?" | tee -a "$LOG"
  grep -E "KvWriteKernel|Duration|Throughput|Issue Slots|Issued Warp|Eligible|Registers Per|Achieved|Theoretical Occ|Stall|pipe|inst_executed|issue_active|dram__|bank|warps_active|No Eligible|Active Warps" \
    "$O/s7_ncu.txt" | head -80 | tee -a "$LOG"
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
echo "== table: median us (kernel / tokens) per build and round ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
python3 - "$O" <<'PY' 2>&1 | tee -a "$LOG"
import json, glob, os, sys, collections
rows = collections.defaultdict(dict)
for f in sorted(glob.glob(os.path.join(sys.argv[1], 'bench_*.json'))):
    b = os.path.basename(f)[6:-5]
    try:
        d = json.load(open(f))
    except Exception as e:
        print(b, 'unreadable', e); continue
    if 'error' in d: print(b, 'ERROR', d['error'])
    for r in d.get('results', []):
        rows[(r['kernel'], r['tokens'])][b] = (r['ms'] * 1e3, r['pct_floor'])
builds = sorted({b for v in rows.values() for b in v})
print('kernel tokens | ' + ' | '.join(builds))
for k in sorted(rows):
    print(k[0], k[1], '| ' + ' | '.join('%.1f (%.1f%%)' % rows[k][b] if b in rows[k] else '-' for b in builds))
PY
(cd "$OUT" && tar czf s7_results.tgz r && cp r/s7_log.txt . && rm -rf r)
