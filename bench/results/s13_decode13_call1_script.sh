#!/usr/bin/env bash
# decode13 device call 1 (s13): candidate v27 (deep tail launch of the BF16 kernel:
# KVPOOL_DECODE_BF16_DEEP=P puts the sink+recent CTAs of the last P % of the requests into a second
# BF16 launch behind the first, with KVPOOL_DECODE_BF16_DEEP_STAGES ring stages per warp (2..4,
# default 4) and KVPOOL_DECODE_BF16_DEEP_SPLITS recent splits; -P = only on two-item INT2 grids;
# unset = main's behaviour) against main (f27884b, v24) built in /work/main/build: GPU tests of the
# candidate (concurrent), SDPA, per-CTA timelines, alternating rounds (whole launcher, the BF16-only
# baseline skipped via --skip-bf16 as in s12, medians of 30, L2 flushed), SDPA again, summary.
# Template: bench/results/s12_decode12_call2_script.sh.
set -u
S=.devlibs-decode13
D=/tmp/d13
mkdir -p "$D" && tar xzf "$S/bins.tgz" -C "$D"
export LD_LIBRARY_PATH="$D:${LD_LIBRARY_PATH:-}"
OUT=${OUT:-/tmp/out}
R="$OUT/r"
mkdir -p "$R"
LOG="$OUT/call_log.txt"
T0=$(date +%s)
stamp() { echo "[+$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
{
  echo "== $(date -u) decode13 call ${CALL:-1}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"

# ---- tests (CPU-bound references; concurrent) ----
C=$D/cand_cuda_kernels_test
F='PagedDecode.*'
P=KVPOOL_DECODE_BF16_DEEP
TJ=(
  "$C|*||"
  "$C|$F:EndToEnd.*|$P=75|"
  "$C|$F:EndToEnd.*|$P=100 ${P}_STAGES=3|"
  "$C|$F|$P=50 ${P}_STAGES=2 ${P}_SPLITS=2|"
  "$C|$F|$P=1 ${P}_STAGES=4 ${P}_SPLITS=3|"
  "$C|$F|$P=-75 KVPOOL_DECODE_ITEMS=1|"
  "$C|$F|$P=50 KVPOOL_DECODE_FOLD_SINK=0 ${P}_SPLITS=2|"
  "$C|$F|$P=50 KVPOOL_DECODE_RECENT_SPLITS=2 ${P}_SPLITS=1 ${P}_STAGES=3|"
  "$C|$F|$P=100 KVPOOL_DECODE_PDL=0|"
)
stamp "== tests (${#TJ[@]} jobs, concurrent)"
i=0
for j in "${TJ[@]}"; do
  IFS='|' read -r tb tf te tx <<<"$j"
  i=$((i + 1))
  (timeout 200 env $te "$tb" --gtest_filter="$tf" $tx >"$R/test_$i.txt" 2>&1; echo "rc=$?" >>"$R/test_$i.txt") &
done
wait
i=0
for j in "${TJ[@]}"; do
  i=$((i + 1))
  echo "-- test job $i: $j" | tee -a "$LOG"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|Failure|rc=|ms total\)$" "$R/test_$i.txt" |
    grep -v "^\[----------\]" | head -20 | tee -a "$LOG"
  grep -E "^\[case\]" "$R/test_$i.txt" | awk '{for(k=1;k<=NF;k++){if($k=="rel_l2"&&$(k+1)+0>a)a=$(k+1)+0; if($k=="max|dLSE|"&&$(k+1)+0>b)b=$(k+1)+0}} END{print "   [case] lines: worst rel_l2 " a "  worst |dLSE| " b}' | tee -a "$LOG"
  grep -E "e2e" "$R/test_$i.txt" | head -4 | tee -a "$LOG"
done

SH1="--batches 8,32 --contexts 32768,131072 --gqa 32:8"
sdpa() {
  stamp "== SDPA $1: $SH1"
  PYTHONUNBUFFERED=1 timeout 100 python3 bench/cuda_sdpa_baseline.py --out "$R/sdpa_$1.json" $SH1 >>"$R/sdpa_$1.log" 2>&1
  tail -6 "$R/sdpa_$1.log" | tee -a "$LOG"
}
sdpa 1

# ---- per-CTA timelines (one post-flush launch per shape; candidate code + stamps) ----
tl() {  # env args...
  local e=$1
  shift 1
  stamp "== timeline [$e] $*"
  echo "# env $e" >>"$R/timeline_env.txt"
  timeout 40 env $e KVPOOL_DECODE_TIMELINE="$R/timeline.txt" "$D/tl_cuda_decode_bench" --skip-bf16 "$@" --gqa 32:8 --page-sizes 16 \
    --iters 5 --warmup 2 2>&1 | grep -E "^int2" | tee -a "$LOG"
}
for e in "$P=0" "$P=75" "$P=75,${P}_STAGES=3" "$P=100" "$P=75,${P}_STAGES=2,${P}_SPLITS=2"; do
  tl "${e//,/ }" --batches 32 --contexts 32768
done

# ---- alternating rounds ----
TSV="$R/rounds.tsv"
: >"$TSV"
G="cand@$P="
SETS=(
  "A|--batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16|base cand ${G}75 ${G}75,${P}_STAGES=3 ${G}50 ${G}50,${P}_STAGES=3 ${G}90 ${G}100 ${G}100,${P}_STAGES=3 ${G}75,${P}_STAGES=2 ${G}75,${P}_STAGES=2,${P}_SPLITS=2 ${G}75,${P}_SPLITS=2"
  "B|--batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16|base cand ${G}-75"
  "C1|--batches 1,8 --contexts 32768 --gqa 32:8 --page-sizes 16|base cand ${G}-75"
  "C2|--batches 128 --contexts 32768 --gqa 32:8 --page-sizes 16|base cand ${G}-75"
  "C3|--batches 1,16 --contexts 131072 --gqa 32:8 --page-sizes 16|base cand ${G}-75 ${G}-75,${P}_STAGES=3 ${G}-50 ${G}-100"
)
for r in $(seq "${ROUNDS:-7}"); do
  for st in "${SETS[@]}"; do
    IFS='|' read -r sn sa cf <<<"$st"
    [ "$r" -gt 4 ] && [ "$sn" != A ] && [ "$sn" != B ] && continue
    for cfg in $cf; do
      bin=${cfg%%@*}
      e=""
      [ "$cfg" != "$bin" ] && e=${cfg#*@} && e=${e//,/ }
      stamp "== round $r set $sn $cfg"
      timeout 60 env $e "$D/${bin}_cuda_decode_bench" --skip-bf16 $sa --iters 30 --json "$R/r${r}_${sn}_${cfg//[@=,-]/_}.json" 2>&1 |
        grep -E "^int2|rror" | tee -a "$LOG" |
        awk -v r="$r" -v c="$cfg" '/^int2/{print r "\t" c "\t" $2 "\t" $3 "\t" $4 "\t" $5 "\t" $6}' >>"$TSV"
    done
  done
done
sdpa 2
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
        xs = f"  x_sdpa {sum(s) / len(s) / m:.3f} (min-SDPA {min(s) / m:.3f})" if s else ""
        nb = nbytes.get((b, ctx, sh.split()[2], int(sh.split()[3][1:])))
        pct = f" {nb / (m * 1e-3) / 4.6e12 * 100:5.1f}%" if nb else ""
        print(f"  {' / '.join(f'{x:.4f}' for x in v):<56} mean {m:.4f}{pct} ratio {ratio:.4f}{xs}  {c}")
PY
[ -f bench/decode_timeline_summary.py ] && [ -f "$R/timeline.txt" ] && { cat "$R/timeline_env.txt"; python3 bench/decode_timeline_summary.py "$R/timeline.txt" --rows2 128 --splits 5; } > "$OUT/timeline_summary.txt" 2>&1
stamp "== done"
(cd "$OUT" && tar czf r.tgz r && rm -rf r)
