#!/usr/bin/env bash
# Session-8 write-kernel device call (carried in .devlibs-write8): KvWrite.* tests of each
# candidate build, alternating bench rounds of the candidates against the main build (same
# call, L2 flushed, medians of 30), then EndToEnd.* + kvstore_gpu_test of the faster candidate,
# an ncu instruction count of its quantize-only kernel, a short table last.
#   CANDS='c1 c3' BENCHES='main c1 c1@KVPOOL_WRITE_FIRST_WAIT=1 c3 c2' ROUNDS=3
set -u
# the binaries and their shared libraries travel packed (the carry limit): unpacked to /tmp/w8
L=/tmp/w8
mkdir -p $L && tar xzf .devlibs-write8/bins.tgz -C $L
export LD_LIBRARY_PATH="$L:${LD_LIBRARY_PATH:-}"
O=$OUT/r
mkdir -p "$O"
LOG=$O/s8_log.txt
{
  echo "== $(date -u)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
t0=$(date +%s)
for c in ${CANDS:-c1 c3}; do
  echo "== tests cuda_kernels_test_$c (KvWrite.*)" | tee -a "$LOG"
  timeout 150 $L/cuda_kernels_test_$c --gtest_filter='KvWrite.*' > "$O/s8_test_log_$c.txt" 2>&1
  echo "test exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|^\[(quantize|rotate|rotate-ws|e2e)|Failure|Expected|Which|actual" \
    "$O/s8_test_log_$c.txt" | head -60 | tee -a "$LOG"
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  for b in ${BENCHES:-main c1 c1@KVPOOL_WRITE_FIRST_WAIT=1 c3 c2}; do
    exe=${b%%@*}
    benv=""
    [ "$exe" != "$b" ] && benv=${b#*@}
    name=$(echo "$b" | tr -c 'A-Za-z0-9_\n' '_')
    echo "== bench $b round $r ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
    env $benv timeout 60 $L/cuda_write_bench_$exe --tokens "${TOKENS:-8192,32768,131072}" --iters 30 \
      --warmup 5 --json "$O/bench_${name}_r$r.json" 2>&1 | tee -a "$LOG"
  done
done
# the faster of CANDS (mean quantize-only at 32768 tokens over the rounds): EndToEnd.* and
# kvstore_gpu_test of its own build, and ncu of its quantize-only kernel
best=$(python3 - "$O" ${CANDS:-c1 c3} <<'PY'
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
echo "== picked $best ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
timeout 150 $L/cuda_kernels_test_$best --gtest_filter='EndToEnd.*' > "$O/s8_test_e2e_$best.txt" 2>&1
echo "e2e exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
grep -E "^\[( +OK|  FAILED|  PASSED)|^\[e2e|Failure|Expected|Which|actual" "$O/s8_test_e2e_$best.txt" | head -30 | tee -a "$LOG"
timeout 120 $L/kvstore_gpu_test_$best > "$O/s8_kvstore_gpu_test_$best.txt" 2>&1
echo "kvstore_gpu_test exit $? ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|rotation d=|commit of|Failure|Expected" \
  "$O/s8_kvstore_gpu_test_$best.txt" | head -40 | tee -a "$LOG"
if [ "${NCU:-1}" = 1 ] && [ $(( $(date +%s) - t0 )) -lt ${NCU_IF_BELOW_S:-130} ]; then
  M=sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
  for nb in ${NCU_BUILDS:-main $best}; do
    echo "== ncu quantize-only $nb ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
    timeout 60 ncu --clock-control none --kernel-name-base mangled \
      --kernel-name regex:KvWriteKernelILi128ELb0ELb0ELb0E --launch-count 1 --metrics "$M" \
      $L/cuda_write_bench_$nb --tokens 32768 --iters 1 --warmup 0 > "$O/s8_ncu_$nb.txt" 2>&1
    echo "ncu exit $?" | tee -a "$LOG"
    grep -E "pipe|inst_executed|issue_active|dram__|duration" "$O/s8_ncu_$nb.txt" | head -12 | tee -a "$LOG"
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
builds = sorted({b for v in rows.values() for b in v})
print('kernel tokens | ' + ' | '.join(builds))
for k in sorted(rows):
    print(k[0], k[1], '| ' + ' | '.join('%.1f' % rows[k][b] if b in rows[k] else '-' for b in builds))
PY
(cd "$OUT" && tar czf s8_results.tgz r && cp r/s8_log.txt . && rm -rf r)
