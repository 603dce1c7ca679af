#!/usr/bin/env bash
# Session-11 write-kernel device call (engineer write11; carried in .devlibs-write11): the
# KvWrite.* tests of both candidate builds (default switches, and again with a capped grid /
# the dynamic tail off), alternating bench rounds of every configuration against main's
# cuda_write_bench built from main in the same tree (order rotated per round; medians of 30, L2
# flushed, outputs poisoned and checked), then EndToEnd.* + kvstore_gpu_test of the fastest
# passing configuration at 256K quantize-only (with its environment), and a table.
# Builds: c1 = CodeThresholdBf16 without fp32<->fp64 conversions + the dynamic tail (run-time
# switch KVPOOL_WRITE_DYN_ITEMS, 4 warps x 6 CTAs per SM); c2 = c1 built with
# -DKVPOOL_WRITE_Q_WARPS=24 (one CTA of 24 warps per SM).
set -u
L=/tmp/w11
mkdir -p $L && tar xzf .devlibs-write11/bins.tgz -C $L
export LD_LIBRARY_PATH="$L/lib:${LD_LIBRARY_PATH:-}"
O=$OUT/r
mkdir -p "$O"
LOG=$O/s11_write11_log.txt
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
  env "$@" timeout 90 $L/$b --gtest_filter="$f" > "$O/test_$n.txt" 2>&1
  echo "test $n exit $? ($(el) s)" | tee -a "$LOG"
  summ "$O/test_$n.txt"
}
QF='KvWrite.QuantizeOnly*:KvWrite.NonFinite*:KvWrite.DemoteMatchesCpu'
runtest c1 cuda_kernels_test_c1 'KvWrite.*'
runtest c1_cap5 cuda_kernels_test_c1 "$QF" KVPOOL_WRITE_MAX_CTAS=5
runtest c1_cap5_d2 cuda_kernels_test_c1 'KvWrite.QuantizeOnly*' KVPOOL_WRITE_MAX_CTAS=5 KVPOOL_WRITE_DYN_ITEMS=2
runtest c1_static cuda_kernels_test_c1 'KvWrite.QuantizeOnly*:KvWrite.NonFinite*' KVPOOL_WRITE_DYN_ITEMS=-1 KVPOOL_WRITE_MAX_CTAS=5
runtest c2 cuda_kernels_test_c2 'KvWrite.*'
runtest c2_cap2 cuda_kernels_test_c2 "$QF" KVPOOL_WRITE_MAX_CTAS=2
# bench configurations: name=binary@env
B=(main=main c1_dm1=c1@KVPOOL_WRITE_DYN_ITEMS=-1 c1_d0=c1@KVPOOL_WRITE_DYN_ITEMS=0
   c1_d1=c1@KVPOOL_WRITE_DYN_ITEMS=1 c1_d2=c1@KVPOOL_WRITE_DYN_ITEMS=2
   c2_dm1=c2@KVPOOL_WRITE_DYN_ITEMS=-1 c2_d0=c2@KVPOOL_WRITE_DYN_ITEMS=0
   c2_d1=c2@KVPOOL_WRITE_DYN_ITEMS=1 c2_d2=c2@KVPOOL_WRITE_DYN_ITEMS=2)
n=${#B[@]}
for r in $(seq 1 "${ROUNDS:-4}"); do
  for i in $(seq 0 $((n - 1))); do
    e=${B[$(( (i + r - 1) % n ))]}
    name=${e%%=*}; rest=${e#*=}; bin=${rest%%@*}; benv=""
    [ "$rest" != "$bin" ] && benv=${rest#*@}
    echo "== bench $name ($bin ${benv}) round $r ($(el) s)" | tee -a "$LOG"
    env $benv timeout 60 $L/cuda_write_bench_$bin --tokens 8192,32768,131072 --iters 30 \
      --warmup 5 --json "$O/bench_${name}_r$r.json" 2>&1 | tee -a "$LOG"
  done
done
best=$(python3 - "$O" <<'PY'
import json, glob, os, sys
o = sys.argv[1]
def mean(c):
    v = []
    for f in glob.glob(os.path.join(o, 'bench_%s_r*.json' % c)):
        for r in json.load(open(f)).get('results', []):
            if r['kernel'] == 'quantize-only' and r['tokens'] == 32768: v.append(r['ms'])
    return sum(v) / len(v) if v else 1e9
def ok(b):
    t = [open(f).read() for f in glob.glob(os.path.join(o, 'test_%s*.txt' % b))]
    return t and all('PASSED' in x and 'FAILED' not in x for x in t)
c = [x for x in ('c1_d0', 'c1_d1', 'c1_d2', 'c1_dm1', 'c2_d0', 'c2_d1', 'c2_d2', 'c2_dm1')
     if ok(x.split('_')[0])]
print(min(c, key=mean) if c else 'c1_dm1')
PY
)
echo "== fastest passing configuration at 32768 tokens quantize-only: $best ($(el) s)" | tee -a "$LOG"
bb=${best%%_*}
case $best in *_dm1) dv=-1 ;; *_d0) dv=0 ;; *_d1) dv=1 ;; *) dv=2 ;; esac
echo "== kvstore_gpu_test_$bb KVPOOL_WRITE_DYN_ITEMS=$dv ($(el) s)" | tee -a "$LOG"
KVPOOL_WRITE_DYN_ITEMS=$dv timeout 60 $L/kvstore_gpu_test_$bb > "$O/kvstore_gpu_test_$best.txt" 2>&1
echo "kvstore_gpu_test exit $? ($(el) s)" | tee -a "$LOG"
summ "$O/kvstore_gpu_test_$best.txt" 30
if [ $(el) -lt ${E2E_IF_BELOW_S:-200} ]; then
  runtest e2e_$best cuda_kernels_test_$bb 'EndToEnd.*' KVPOOL_WRITE_DYN_ITEMS=$dv
fi
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
        rows[(r['kernel'], r['tokens'])][b].append(r['ms'] * 1e3)
order = ['main', 'c1_dm1', 'c1_d0', 'c1_d1', 'c1_d2', 'c2_dm1', 'c2_d0', 'c2_d1', 'c2_d2']
print('kernel tokens | ' + ' | '.join(order))
for k in sorted(rows):
    m = rows[k].get('main')
    mm = sum(m) / len(m) if m else None
    cells = []
    for b in order:
        v = rows[k].get(b)
        if not v: cells.append('-'); continue
        mu = sum(v) / len(v)
        cells.append('%.1f [%s]%s' % (mu, '/'.join('%.1f' % x for x in v),
                     ' (%.3f)' % (mu / mm) if mm and b != 'main' else ''))
    print(k[0], k[1], '| ' + ' | '.join(cells))
PY
(cd "$OUT" && cp r/s11_write11_log.txt . && tar czf s11_write11_results.tgz r && rm -rf r)
