#!/usr/bin/env bash
# decode9 device call 2: GPU tests of the candidates (concurrent processes), SDPA + our BF16 on the
# headline shapes, per-CTA timelines of the candidates, then 4 alternating rounds of main (base)
# against the candidates (INT2 launch only, medians of 30, L2 flushed), summary table last.
#   carve = main + the rotation grid's maximum shared-memory carveout also where the INT2 grid is
#           one wave with claimed stages (KVPOOL_DECODE_QROT_CARVEOUT: 0 driver, 1 v17 rule, 2 always)
set -u
D=.devlibs-decode9
export LD_LIBRARY_PATH="$PWD/$D:${LD_LIBRARY_PATH:-}"
OUT=${OUT:-/tmp/out}
R="$OUT/r"
mkdir -p "$R"
LOG="$OUT/call_log.txt"
T0=$(date +%s)
stamp() { echo "[+$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
{
  echo "== $(date -u) decode9 call ${CALL:-1}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"

# ---- tests (CPU-bound references; concurrent) ----
C=$D/carve_cuda_kernels_test
F='PagedDecode.*:EndToEnd.*'
TJ=(
  "$C|$F|"
  "$C|PagedDecode.*|KVPOOL_DECODE_QROT_CARVEOUT=2"
)
stamp "== tests (${#TJ[@]} jobs, concurrent)"
i=0
for j in "${TJ[@]}"; do
  IFS='|' read -r tb tf te <<<"$j"
  i=$((i + 1))
  (timeout 240 env $te "$tb" --gtest_filter="$tf" >"$R/test_$i.txt" 2>&1; echo "rc=$?" >>"$R/test_$i.txt") &
done
wait
i=0
for j in "${TJ[@]}"; do
  i=$((i + 1))
  echo "-- test job $i: $j" | tee -a "$LOG"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|Failure|rc=|ms total\)$" "$R/test_$i.txt" |
    grep -v "^\[----------\]" | head -20 | tee -a "$LOG"
  grep -E "^\[e2e\]" "$R/test_$i.txt" | tee -a "$LOG"
done

# ---- SDPA + our INT2 and BF16 on the headline shapes (same call) ----
SH1="--batches 8,32 --contexts 32768,131072 --gqa 32:8"
sdpa_pair() {  # tag
  stamp "== SDPA + pair $1: $SH1"
  PYTHONUNBUFFERED=1 python3 bench/cuda_sdpa_baseline.py --out "$R/sdpa_$1.json" $SH1 >>"$R/sdpa_$1.log" 2>&1
  timeout 120 "$D/carve_cuda_decode_bench" $SH1 --page-sizes 16 --iters 30 --sdpa-json "$R/sdpa_$1.json" \
    --json "$R/pair_$1.json" 2>&1 | tee -a "$LOG"
}
sdpa_pair 1

# ---- per-CTA timelines (one post-flush launch per shape) ----
tl() {  # bin env args...
  local b=$1 e=$2
  shift 2
  stamp "== timeline $b [$e] $*"
  timeout 60 env $e KVPOOL_DECODE_TIMELINE="$R/timeline.txt" "$D/$b" --skip-bf16 "$@" --gqa 32:8 --page-sizes 16 \
    --iters 5 --warmup 2 2>&1 | grep -E "^int2" | tee -a "$LOG"
}
tl tlbase_cuda_decode_bench "" --batches 8 --contexts 131072
tl tlcarve_cuda_decode_bench "" --batches 8 --contexts 131072
tl tlbase_cuda_decode_bench "" --batches 16 --contexts 131072
tl tlcarve_cuda_decode_bench "" --batches 16 --contexts 131072

# ---- alternating rounds ----
TSV="$R/rounds.tsv"
: >"$TSV"
SETS=(
  "A|--batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16|base carve carve@KVPOOL_DECODE_QROT_CARVEOUT=1"
  "B|--batches 1,8,32 --contexts 32768 --gqa 32:8 --page-sizes 16|base carve carve@KVPOOL_DECODE_QROT_CARVEOUT=2"
  "C|--batches 1,4,16 --contexts 131072 --gqa 32:8 --page-sizes 16|base carve carve@KVPOOL_DECODE_QROT_CARVEOUT=2"
)
for r in $(seq "${ROUNDS:-4}"); do
  for st in "${SETS[@]}"; do
    IFS='|' read -r sn sa cf <<<"$st"
    for cfg in $cf; do
      bin=${cfg%%@*}
      e=""
      [ "$cfg" != "$bin" ] && e=${cfg#*@} && e=${e//,/ }
      stamp "== round $r set $sn $cfg"
      timeout 60 env $e "$D/${bin}_cuda_decode_bench" --skip-bf16 $sa --iters 30 --json "$R/r${r}_${sn}_${cfg//[@=,]/_}.json" 2>&1 |
        grep -E "^int2|rror" | tee -a "$LOG" |
        awk -v r="$r" -v c="$cfg" '/^int2/{print r "\t" c "\t" $2 "\t" $3 "\t" $4 "\t" $5 "\t" $6}' >>"$TSV"
    done
  done
done
sdpa_pair 2
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"

python3 - "$TSV" "$R" <<'PY' | tee "$OUT/summary.txt" | tee -a "$LOG"
import collections, json, sys, glob
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
cfgs, shapes, ms = [], [], collections.defaultdict(list)
for r, c, b, ctx, heads, p, t in rows:
    sh = f"B={b} ctx={ctx} {heads} p{p}"
    cfgs += [c] if c not in cfgs else []
    shapes += [sh] if sh not in shapes else []
    ms[(sh, c)].append(float(t))
sdpa = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[2] + "/sdpa_*.json")):
    d = json.load(open(f))
    for x in d.get("results", d if isinstance(d, list) else []):
        try:
            sdpa[(int(x["batch"]), int(x["context"]))].append(float(x["ms"]))
        except Exception:
            pass
nbytes = {}
for f in glob.glob(sys.argv[2] + "/r*.json"):
    try:
        for x in json.load(open(f))["decode"]:
            nbytes[(x["batch"], x["context"], f"{x['hq']}/{x['hkv']}", x["page"])] = x["int2_mixed"]["bytes"]
    except Exception:
        pass
print("== summary: per-round medians (ms); mean; ratio = mean / mean of base; % of 4.6 TB/s (bytes of the bench JSON)")
for sh in shapes:
    b, ctx = int(sh.split()[0][2:]), int(sh.split()[1][4:])
    base = ms.get((sh, "base"))
    s = sdpa.get((b, ctx)) if "32/8 p16" in sh else None
    print(sh + (f"   SDPA {' / '.join(f'{x:.4f}' for x in s)}" if s else ""))
    for c in cfgs:
        v = ms.get((sh, c))
        if not v:
            continue
        m = sum(v) / len(v)
        ratio = m / (sum(base) / len(base)) if base else float("nan")
        xs = f"  x_sdpa {sum(s) / len(s) / m:.3f}" if s else ""
        nb = nbytes.get((b, ctx, sh.split()[2], int(sh.split()[3][1:])))
        pct = f" {nb / (m * 1e-3) / 4.6e12 * 100:5.1f}%" if nb else ""
        print(f"  {' / '.join(f'{x:.4f}' for x in v):<28} mean {m:.4f}{pct} ratio {ratio:.4f}{xs}  {c}")
PY
stamp "== done"
(cd "$OUT" && tar czf r.tgz r && rm -rf r)
