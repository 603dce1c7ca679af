#!/usr/bin/env bash
# Session-10 write-kernel device call (carried in .devlibs-write10): KvWrite.* of each candidate,
# alternating bench rounds of every build (main = main's kv_write.cu built the same way, same
# call, L2 flushed, medians of 30), EndToEnd.* + kvstore_gpu_test of the fastest candidate at
# 256K quantize-only, ncu warp-state / scheduler sections of main and that candidate, a table.
#   CANDS='A AB A2' BENCHES='main A AB A2' ROUNDS=5
set -u
L=/tmp/w10
mkdir -p $L && tar xzf .devlibs-write10/bins.tgz -C $L
export LD_LIBRARY_PATH="$L:${LD_LIBRARY_PATH:-}"
O=$OUT/r
mkdir -p "$O"
LOG=$O/s10_write_log.txt
{
  echo "== $(date -u)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
for c in ${CANDS:-A AB A2}; do
  echo "== tests cuda_kernels_test_$c (KvWrite.*) ($(el) s)" | tee -a "$LOG"
  timeout 120 $L/cuda_kernels_test_$c --gtest_filter='KvWrite.*' > "$O/test_log_$c.txt" 2>&1
  echo "test $c exit $? ($(el) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|^\[(quantize|rotate|rotate-ws|e2e)|Failure|Expected|Which|actual" \
    "$O/test_log_$c.txt" | head -40 | tee -a "$LOG"
done
B=(${BENCHES:-main A AB A2})
n=${#B[@]}
for r in $(seq 1 "${ROUNDS:-5}"); do
  for i in $(seq 0 $((n - 1))); do
    b=${B[$(( (i + r - 1) % n ))]}   # rotated order per round
    echo "== bench $b round $r ($(el) s)" | tee -a "$LOG"
    timeout 60 $L/cuda_write_bench_$b --tokens "${TOKENS:-8192,32768,131072}" --iters 30 \
      --warmup 5 --json "$O/bench_${b}_r$r.json" 2>&1 | tee -a "$LOG"
  done
done
best=$(python3 - "$O" ${CANDS:-A AB A2} <<'PY'
import json, glob, os, sys
o, cands = sys.argv[1], sys.argv[2:]
def mean(c):
    v = []
    for f in glob.glob(os.path.join(o, 'bench_%s_r*.json' % c)):
        for r in json.load(open(f)).get('results', []):
            if r['kernel'] == 'quantize-only' and r['tokens'] == 32768: v.append(r['ms'])
    return sum(v) / len(v) if v else 1e9
ok = [c for c in cands if 'FAILED' not in open(os.path.join(o, 'test_log_%s.txt' % c)).read()
      and 'PASSED' in open(os.path.join(o, 'test_log_%s.txt' % c)).read()]
print(min(ok, key=mean) if ok else cands[0])
PY
)
echo "== fastest passing candidate at 32768 tokens quantize-only: $best ($(el) s)" | tee -a "$LOG"
timeout 60 $L/kvstore_gpu_test_$best > "$O/kvstore_gpu_test_$best.txt" 2>&1
echo "kvstore_gpu_test $best exit $? ($(el) s)" | tee -a "$LOG"
grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|rotation d=|commit of|Failure|Expected" \
  "$O/kvstore_gpu_test_$best.txt" | head -30 | tee -a "$LOG"
for b in main $best; do
  echo "== sizes $b ($(el) s)" | tee -a "$LOG"
  timeout 60 $L/cuda_write_bench_$b --tokens 1024,2048,4096,8192,16384,32768,65536,131072 --iters 30 \
    --warmup 5 --json "$O/sizes_$b.json" 2>&1 | grep -E "quantize-only|memcpy" | tee -a "$LOG"
done
if [ $(el) -lt ${NCU_IF_BELOW_S:-160} ]; then
  M=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
  for nb in main $best; do
    echo "== ncu quantize-only $nb: warp states, scheduler, source counters ($(el) s)" | tee -a "$LOG"
    timeout 60 ncu --clock-control none --kernel-name-base mangled \
      --kernel-name regex:KvWriteKernelILi128ELb0ELb0ELb0ELb0E --launch-count 1 \
      --section WarpStateStats --section SchedulerStats --section SourceCounters --metrics "$M" \
      -o "$O/ncu_$nb" $L/cuda_write_bench_$nb --tokens 32768 --iters 1 --warmup 0 > "$O/ncu_log_$nb.txt" 2>&1
    echo "ncu exit $? ($(el) s)" | tee -a "$LOG"
    ncu --import "$O/ncu_$nb.ncu-rep" --page details --print-details all > "$O/ncu_details_$nb.txt" 2>&1
    ncu --import "$O/ncu_$nb.ncu-rep" --page raw --csv > "$O/ncu_raw_$nb.csv" 2>&1
    ncu --import "$O/ncu_$nb.ncu-rep" --page source --csv --print-source sass > "$O/ncu_sass_$nb.csv" 2>&1
    grep -E "pipe|inst_executed|issue_active|dram__|duration|Stall|Eligible|Issued Warp|No Eligible|Warp Cycles|Active Warps" \
      "$O/ncu_details_$nb.txt" | head -40 | tee -a "$LOG"
    grep -o "smsp__average_warps_issue_stalled_[a-z_]*_per_issue_active.ratio" "$O/ncu_raw_$nb.csv" | head -2 >/dev/null
  done
fi
if [ $(el) -lt ${E2E_IF_BELOW_S:-130} ]; then
  timeout 60 $L/cuda_kernels_test_$best --gtest_filter='EndToEnd.*' > "$O/test_e2e_$best.txt" 2>&1
  echo "e2e $best exit $? ($(el) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED)|^\[e2e|Failure|Expected|Which|actual" "$O/test_e2e_$best.txt" | head -20 | tee -a "$LOG"
fi
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
echo "== table: median us (kernel / tokens) per build, mean [rounds] ($(el) s)" | tee -a "$LOG"
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
        rows[(r['kernel'], r['tokens'])][b] = r['ms'] * 1e3
builds = sorted({b.rsplit('_r', 1)[0] for v in rows.values() for b in v})
print('kernel tokens | ' + ' | '.join(builds))
for k in sorted(rows):
    if k[0] not in ('quantize-only', 'demote', 'rotate+quantize', 'memcpy-d2d'): continue
    cells = []
    for b in builds:
        v = [rows[k][x] for x in rows[k] if x.rsplit('_r', 1)[0] == b]
        cells.append('%.1f [%s]' % (sum(v) / len(v), '/'.join('%.1f' % x for x in v)) if v else '-')
    print(k[0], k[1], '| ' + ' | '.join(cells))
PY
(cd "$OUT" && tar czf s10_write_results.tgz r && cp r/s10_write_log.txt . && rm -rf r)
