#!/usr/bin/env bash
# Session-18 write-kernel device call 2 (the lead; .devlibs-w18/w18b.tar.xz): where the
# rotate+quantize kernel's time goes. cuda_write_bench of main, cA (call 1's candidate: the
# 128-register producer, one m64n128k16 per k step) and two measurement builds of cA that
# compute wrong bytes on purpose: nR (the producer arrives as soon as the tiles land, no
# rotation: the consumers alone) and nQ (the consumers skip the quantization: the producer's
# rotation chain alone). Alternating rounds, order rotated, medians of 30, table of means.
set -u
L=/tmp/w18b
mkdir -p $L && tar xJf .devlibs-w18/w18b.tar.xz -C $L
export LD_LIBRARY_PATH="$L/lib:${LD_LIBRARY_PATH:-}"
O=$OUT/r
mkdir -p "$O"
LOG=$O/s18_write_call2_log.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee "$LOG"
B=(main cA nR nQ)
n=${#B[@]}
for r in $(seq 1 "${ROUNDS:-3}"); do
  for i in $(seq 0 $((n - 1))); do
    name=${B[$(( (i + r - 1) % n ))]}
    echo "== bench $name round $r" | tee -a "$LOG"
    timeout 90 $L/cuda_write_bench_$name --tokens 8192,32768,131072 --iters 30 \
      --warmup 5 --json "$O/bench_${name}_r$r.json" 2>&1 | grep -E "rotate\+quantize|error|Error" | tee -a "$LOG"
  done
done
python3 - "$O" <<'PY' 2>&1 | tee -a "$LOG"
import json, glob, os, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(os.path.join(sys.argv[1], 'bench_*.json'))):
    b = os.path.basename(f)[6:-5].rsplit('_r', 1)[0]
    for r in json.load(open(f)).get('results', []):
        rows[(r['kernel'], r['tokens'])][b].append(r['ms'] * 1e3)
order = ['main', 'cA', 'nR', 'nQ']
for k in sorted(rows):
    m = rows[k]['main']; mm = sum(m) / len(m)
    print(k[0], k[1], '| ' + ' | '.join('%s %.1f (%.3f)' % (b, sum(rows[k][b]) / len(rows[k][b]),
          sum(rows[k][b]) / len(rows[k][b]) / mm) for b in order if rows[k].get(b)))
PY
(cd "$OUT" && cp r/s18_write_call2_log.txt . && tar czf s18_write_call2_results.tgz r && rm -rf r)
