#!/usr/bin/env bash
# Session-19 write-kernel device call 1 (the lead; carried in .devlibs-w19/w19.tar.xz): the
# warp-specialized d-128 rotating kernels without a producer warpgroup — each of the four
# consumer warpgroups rotates its own 64-token item with wgmma (KVPOOL_WRITE_WS_SELF=1, 512
# threads at 128 registers) — against main (v16: one producer warpgroup for the four). Builds
# (kv_write.cu only, relinked into cuda_write_bench, cuda_kernels_test, kvstore_gpu_test; see
# s19_write_builds.txt): main (3e7d8bf + the rotation moved into WsRotateTile, SASS identical),
# s32 / s64 / s128 (self-rotating, N = 32 / 64 / 128 columns per wgmma). Tests of s32/s64/s128
# (KvWrite.*, EndToEnd.*, kvstore_gpu_test), then alternating bench rounds (order rotated per
# round, medians of 30, L2 flushed) and a table of means with ratios to main.
set -u
L=/tmp/w19
mkdir -p $L && tar xJf .devlibs-w19/w19.tar.xz -C $L
export LD_LIBRARY_PATH="$L/lib:${LD_LIBRARY_PATH:-}"
O=$OUT/r
mkdir -p "$O"
LOG=$O/s19_write_call1_log.txt
{
  echo "== $(date -u)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
summ() {
  grep -E "^\[( +OK|  FAILED|  PASSED|  SKIPPED)|^\[(quantize|rotate|rotate-ws|e2e|demote)|Failure|Expected|Which|actual|rotation d=|commit of" \
    "$1" | head -${2:-40} | tee -a "$LOG"
}
runtest() {  # name binary filter [env...]
  local n=$1 b=$2 f=$3; shift 3
  echo "== test $n: $b --gtest_filter=$f ${*:-} ($(el) s)" | tee -a "$LOG"
  env "$@" timeout 120 $L/$b --gtest_filter="$f" > "$O/test_$n.txt" 2>&1
  echo "test $n exit $? ($(el) s)" | tee -a "$LOG"
  summ "$O/test_$n.txt"
}
for v in s32 s64 s128; do
  runtest $v cuda_kernels_test_$v 'KvWrite.*:EndToEnd.*'
  echo "== kvstore_gpu_test_$v ($(el) s)" | tee -a "$LOG"
  timeout 60 $L/kvstore_gpu_test_$v > "$O/test_kvstore_$v.txt" 2>&1
  echo "kvstore_gpu_test_$v exit $? ($(el) s)" | tee -a "$LOG"
  summ "$O/test_kvstore_$v.txt" 30
done
B=(main s32 s64 s128)
n=${#B[@]}
for r in $(seq 1 "${ROUNDS:-4}"); do
  for i in $(seq 0 $((n - 1))); do
    name=${B[$(( (i + r - 1) % n ))]}
    echo "== bench $name round $r ($(el) s)" | tee -a "$LOG"
    timeout 90 $L/cuda_write_bench_$name --tokens 8192,32768,131072 --iters 30 \
      --warmup 5 --json "$O/bench_${name}_r$r.json" 2>&1 | tee -a "$LOG"
  done
done
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
echo "== table: median us per configuration, mean [rounds] (ratio to main) ($(el) s)" | tee -a "$LOG"
python3 - "$O" <<'PY' 2>&1 | tee -a "$LOG"
import json, glob, os, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(os.path.join(sys.argv[1], 'bench_*.json'))):
    b = os.path.basename(f)[6:-5].rsplit('_r', 1)[0]
    try:
        d = json.load(open(f))
    except Exception as e:
        print(b, 'unreadable', e); continue
    if 'error' in d: print(b, 'ERROR', d['error'])
    for r in d.get('results', []):
        rows[(r['kernel'], r['tokens'])][b].append((r['ms'] * 1e3, r.get('pct_of_floor', r.get('pct', 0))))
order = ['main', 's32', 's64', 's128']
print('kernel tokens | ' + ' | '.join(order))
for k in sorted(rows):
    m = rows[k].get('main')
    mm = sum(x[0] for x in m) / len(m) if m else None
    cells = []
    for b in order:
        v = rows[k].get(b)
        if not v: cells.append('-'); continue
        mu = sum(x[0] for x in v) / len(v)
        cells.append('%.1f [%s]%s' % (mu, '/'.join('%.1f' % x[0] for x in v),
                     ' (%.3f)' % (mu / mm) if mm and b != 'main' else ''))
    print(k[0], k[1], '| ' + ' | '.join(cells))
PY
(cd "$OUT" && cp r/s19_write_call1_log.txt . && tar czf s19_write_call1_results.tgz r && rm -rf r)
