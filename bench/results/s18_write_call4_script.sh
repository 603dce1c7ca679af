#!/usr/bin/env bash
# Session-18 write-kernel device call 4 (the lead; .devlibs-w18/w18d.tar.xz): main, cA (v16, the
# committed build) and g3 (three consumer warpgroups + the producer, 512 threads at 128
# registers without setmaxnreg, the rotate+quantize producer at N = 128: fewer consumer warps
# competing with the producer for issue slots). KvWrite.* + EndToEnd.* and kvstore_gpu_test of
# g3 first, then 3 alternating bench rounds.
set -u
L=/tmp/w18d
mkdir -p $L && tar xJf .devlibs-w18/w18d.tar.xz -C $L
export LD_LIBRARY_PATH="$L/lib:${LD_LIBRARY_PATH:-}"
O=$OUT/r
mkdir -p "$O"
LOG=$O/s18_write_call4_log.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee "$LOG"
for t in "cuda_kernels_test_g3 --gtest_filter=KvWrite.*:EndToEnd.*" kvstore_gpu_test_g3; do
  echo "== test $t" | tee -a "$LOG"
  timeout 120 $L/$t > "$O/test_${t%% *}.txt" 2>&1
  echo "exit $?" | tee -a "$LOG"
  grep -E "^\[( +OK|  FAILED|  PASSED)|^\[(rotate|rotate-ws|e2e)|rotation d=|Failure" "$O/test_${t%% *}.txt" | head -30 | tee -a "$LOG"
done
B=(main cA g3)
n=${#B[@]}
for r in $(seq 1 "${ROUNDS:-3}"); do
  for i in $(seq 0 $((n - 1))); do
    name=${B[$(( (i + r - 1) % n ))]}
    echo "== bench $name round $r" | tee -a "$LOG"
    timeout 90 $L/cuda_write_bench_$name --tokens 8192,32768,131072 --iters 30 \
      --warmup 5 --json "$O/bench_${name}_r$r.json" 2>&1 | tee -a "$LOG"
  done
done
python3 - "$O" <<'PY' 2>&1 | tee -a "$LOG"
import json, glob, os, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(os.path.join(sys.argv[1], 'bench_*.json'))):
    b = os.path.basename(f)[6:-5].rsplit('_r', 1)[0]
    for r in json.load(open(f)).get('results', []):
        rows[(r['kernel'], r['tokens'])][b].append(r['ms'] * 1e3)
order = ['main', 'cA', 'g3']
for k in sorted(rows):
    m = rows[k]['main']; mm = sum(m) / len(m)
    print(k[0], k[1], '| ' + ' | '.join('%s %.1f (%.3f)' % (b, sum(rows[k][b]) / len(rows[k][b]),
          sum(rows[k][b]) / len(rows[k][b]) / mm) for b in order if rows[k].get(b)))
PY
(cd "$OUT" && cp r/s18_write_call4_log.txt . && tar czf s18_write_call4_results.tgz r && rm -rf r)
