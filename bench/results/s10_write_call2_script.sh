#!/usr/bin/env bash
# Session-10 write-kernel device call 2 (carried in .devlibs-write10): candidate D (v14 + the
# per-CTA dynamic pair split) against v14 (main at a52fe73, the tested AB binary): KvWrite.* and
# kvstore_gpu_test of D, alternating bench rounds (rotated order), ncu per-scheduler instruction
# balance of both, EndToEnd of D when time allows, a table last.
set -u
L=/tmp/w10b
mkdir -p $L && tar xzf .devlibs-write10/bins2.tgz -C $L
export LD_LIBRARY_PATH="$L:${LD_LIBRARY_PATH:-}"
O=$OUT/r
mkdir -p "$O"
LOG=$O/s10_write_call2_log.txt
{ echo "== $(date -u)"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; } 2>&1 | tee "$LOG"
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
echo "== tests cuda_kernels_test_D (KvWrite.*) ($(el) s)" | tee -a "$LOG"
timeout 90 $L/cuda_kernels_test_D --gtest_filter='KvWrite.*' > "$O/test_log_D.txt" 2>&1
echo "test D exit $? ($(el) s)" | tee -a "$LOG"
grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|^\[(quantize|rotate|rotate-ws)|Failure|Expected|Which|actual" "$O/test_log_D.txt" | head -40 | tee -a "$LOG"
timeout 40 $L/kvstore_gpu_test_D > "$O/kvstore_gpu_test_D.txt" 2>&1
echo "kvstore_gpu_test D exit $? ($(el) s)" | tee -a "$LOG"
grep -E "^\[( +OK|  FAILED|  PASSED)|Failure|Expected" "$O/kvstore_gpu_test_D.txt" | head -12 | tee -a "$LOG"
B=(v14 D)
for r in $(seq 1 "${ROUNDS:-6}"); do
  for i in 0 1; do
    b=${B[$(( (i + r - 1) % 2 ))]}
    echo "== bench $b round $r ($(el) s)" | tee -a "$LOG"
    timeout 40 $L/cuda_write_bench_$b --tokens 8192,32768,131072 --iters 30 --warmup 5 \
      --json "$O/bench_${b}_r$r.json" 2>&1 | grep -E "memcpy|quantize-only|demote|rotate" | tee -a "$LOG"
  done
done
M=smsp__inst_executed.sum,smsp__inst_executed.max,smsp__inst_executed.min,smsp__inst_executed.avg,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,smsp__warps_active.avg.per_cycle_active,gpu__time_duration.sum
for nb in ${NCU_BUILDS:-D}; do
  echo "== ncu quantize-only $nb ($(el) s)" | tee -a "$LOG"
  timeout 30 ncu --clock-control none --kernel-name-base mangled --kernel-name regex:KvWriteKernelILi128ELb0ELb0ELb0ELb0E \
    --launch-count 1 --metrics "$M" $L/cuda_write_bench_$nb --tokens 32768 --iters 1 --warmup 0 > "$O/ncu_$nb.txt" 2>&1
  echo "ncu exit $?" | tee -a "$LOG"
  grep -E "smsp__|sm__|gpu__" "$O/ncu_$nb.txt" | tee -a "$LOG"
done
if [ $(el) -lt ${E2E_IF_BELOW_S:-50} ]; then
  timeout 50 $L/cuda_kernels_test_D --gtest_filter='EndToEnd.*' > "$O/test_e2e_D.txt" 2>&1
  echo "e2e D exit $? ($(el) s)" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED)|^\[e2e|Failure" "$O/test_e2e_D.txt" | head -8 | tee -a "$LOG"
fi
echo "== table: mean us [rounds] ($(el) s)" | tee -a "$LOG"
python3 - "$O" <<'PY' 2>&1 | tee -a "$LOG"
import json, glob, os, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(os.path.join(sys.argv[1], 'bench_*.json'))):
    b = os.path.basename(f)[6:-5].rsplit('_r', 1)[0]
    for r in json.load(open(f)).get('results', []):
        rows[(r['kernel'], r['tokens'])][b].append((r['ms'] * 1e3, r['floor_ms'] * 1e3))
for k in sorted(rows):
    m = rows[k]['v14']; d = rows[k]['D']
    mm = sum(x for x, _ in m) / len(m); dm = sum(x for x, _ in d) / len(d)
    print('%-16s %6d v14 %7.1f (%4.1f%%) [%s] | D %7.1f (%4.1f%%) [%s] | D/v14 %.3f' % (k[0], k[1], mm, 100 * m[0][1] / mm,
          '/'.join('%.1f' % x for x, _ in m), dm, 100 * d[0][1] / dm, '/'.join('%.1f' % x for x, _ in d), dm / mm))
PY
(cd "$OUT" && tar czf s10_write_call2_results.tgz r && cp r/s10_write_call2_log.txt . && rm -rf r)
