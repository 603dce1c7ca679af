#!/usr/bin/env bash
# Session-9 write-kernel device call (carried in .devlibs-write9): KvWrite.* of each candidate
# test build, alternating bench rounds of every bench build (main = the main build, same call,
# L2 flushed, medians of 30), EndToEnd.* + kvstore_gpu_test of the first candidate, ncu
# instruction counts of the quantize-only kernel (main and NCU_BUILDS), a short table last.
#   CANDS='c1' BENCHES='main c1 c1i2 c1i4' ROUNDS=3 NCU_BUILDS='main c1'
set -u
L=/tmp/w9
mkdir -p $L && tar xzf .devlibs-write9/bins.tgz -C $L
export LD_LIBRARY_PATH="$L:${LD_LIBRARY_PATH:-}"
O=$OUT/r
mkdir -p "$O"
LOG=$O/s9_log.txt
{
  echo "== $(date -u)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
t0=$(date +%s)
CANDS=${CANDS:-c1}
for c in $CANDS; do
  echo "== tests cuda_kernels_test_$c (KvWrite.*)" | tee -a "$LOG"
  timeout 150 $L/cuda_kernels_test_$c --gtest_filter='KvWrite.*' > "$O/s9_test_log_$c.txt" 2>&1
  echo "test exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|^\[(quantize|rotate|rotate-ws|e2e)|Failure|Expected|Which|actual" \
    "$O/s9_test_log_$c.txt" | head -60 | tee -a "$LOG"
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  for b in ${BENCHES:-main c1 c1i2 c1i4}; do
    exe=${b%%@*}
    benv=""
    [ "$exe" != "$b" ] && benv=${b#*@}
    name=$(echo "$b" | tr -c 'A-Za-z0-9_\n' '_')
    echo "== bench $b round $r ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
    env $benv timeout 60 $L/cuda_write_bench_$exe --tokens "${TOKENS:-8192,32768,131072}" --iters 30 \
      --warmup 5 --json "$O/bench_${name}_r$r.json" 2>&1 | tee -a "$LOG"
  done
done
# the fastest bench build at 32768 tokens (quantize-only, mean over rounds) among PICK: its
# KvWrite.* too when it is not the first candidate (already tested above)
best=$(python3 - "$O" ${PICK:-c1 c1i2 c1i4} <<'PY'
import json, glob, os, sys
o, cands = sys.argv[1], sys.argv[2:]
def mean(c):
    v = []
    for f in glob.glob(os.path.join(o, 'bench_%s_r*.json' % c)):
        for r in json.load(open(f)).get('results', []):
            if r['kernel'] == 'quantize-only' and r['tokens'] == 32768: v.append(r['ms'])
    return sum(v) / len(v) if v else 1e9
print(min(cands, key=mean))
PY
)
first=${CANDS%% *}
echo "== fastest quantize-only at 32768 tokens among ${PICK:-c1 c1i2 c1i4}: $best ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
if [ "$best" != "$first" ] && [ -x $L/cuda_kernels_test_$best ]; then
  timeout 150 $L/cuda_kernels_test_$best --gtest_filter='KvWrite.*' > "$O/s9_test_log_$best.txt" 2>&1
  echo "test $best exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|Failure|Expected" "$O/s9_test_log_$best.txt" | head -20 | tee -a "$LOG"
fi
timeout 150 $L/cuda_kernels_test_$first --gtest_filter='EndToEnd.*' > "$O/s9_test_e2e_$first.txt" 2>&1
echo "e2e $first exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
grep -E "^\[( +OK|  FAILED|  PASSED)|^\[e2e|Failure|Expected|Which|actual" "$O/s9_test_e2e_$first.txt" | head -30 | tee -a "$LOG"
timeout 120 $L/kvstore_gpu_test_$first > "$O/s9_kvstore_gpu_test_$first.txt" 2>&1
echo "kvstore_gpu_test $first exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|rotation d=|commit of|Failure|Expected" \
  "$O/s9_kvstore_gpu_test_$first.txt" | head -40 | tee -a "$LOG"
if [ $(( $(date +%s) - t0 )) -lt ${NCU_IF_BELOW_S:-200} ]; then
  M=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
  for nb in ${NCU_BUILDS:-main c1}; do
    echo "== ncu quantize-only $nb ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
    timeout 60 ncu --clock-control none --kernel-name-base mangled \
      --kernel-name regex:KvWriteKernelILi128ELb0ELb0ELb0E --launch-count 1 --metrics "$M" \
      $L/cuda_write_bench_$nb --tokens 32768 --iters 1 --warmup 0 > "$O/s9_ncu_$nb.txt" 2>&1
    echo "ncu exit $?" | tee -a "$LOG"
    grep -E "pipe|inst_executed|issue_active|dram__|duration" "$O/s9_ncu_$nb.txt" | head -12 | tee -a "$LOG"
  done
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
        rows[(r['kernel'], r['tokens'])][b] = r['ms'] * 1e3
builds = sorted({b.rsplit('_r', 1)[0] for v in rows.values() for b in v})
print('kernel tokens | ' + ' | '.join(builds) + '   (mean of rounds; per-round values in the JSON)')
for k in sorted(rows):
    cells = []
    for b in builds:
        v = [rows[k][x] for x in rows[k] if x.rsplit('_r', 1)[0] == b]
        cells.append('%.1f [%s]' % (sum(v) / len(v), '/'.join('%.1f' % x for x in v)) if v else '-')
    print(k[0], k[1], '| ' + ' | '.join(cells))
PY
(cd "$OUT" && tar czf s9_results.tgz r && cp r/s9_log.txt . && rm -rf r)
