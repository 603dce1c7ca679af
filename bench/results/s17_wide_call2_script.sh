#!/usr/bin/env bash
# s17 device call 2 (lead): call 1's binaries, the wide form's work distribution at the two
# headline shapes (claims share, splits, order) under the launcher's A/B switches. Call 1 was: v31 = the INT2 kernel's 4-CTA form Int2DecodeKernel<128, 1, 4>
# (120 registers, no spill; the 5-CTA form keeps 95) where the 5-CTA plan claims stages or takes
# more than one wave (d 128, KT 1, page 16), the history re-planned for its 528 slots;
# KVPOOL_DECODE_INT2_WIDE=0/1 forces it off / on. Session 16's call 1 measured this form as
# "SV 3" (B=32 x 32K 0.9872, B=8 x 128K 0.9994 of main; its branch was lost with its machine).
# Main with v31 merged (65f246c): its default against the wide form under the switches. GPU tests of the candidate (concurrent), SDPA before and
# after, alternating rounds (order reversed every round; whole launcher, --skip-bf16, medians of
# 30, L2 flushed, shuffled pages, 32 q / 8 KV, d 128).
set -u
S=${S:-.devlibs-wide17}
D=/tmp/w17
mkdir -p "$D" && tar xJf "$S/bins.tar.xz" -C "$D"
export LD_LIBRARY_PATH="$D:${LD_LIBRARY_PATH:-}"
OUT=${OUT:-/tmp/out}
R="$OUT/r"
mkdir -p "$R"
LOG="$OUT/call_log.txt"
T0=$(date +%s)
stamp() { echo "[+$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
{
  echo "== $(date -u) s17 wide call 2"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
(command -v cuobjdump >/dev/null && for b in main cand; do echo "-- $b"; cuobjdump --dump-resource-usage $D/${b}_cuda_decode_bench 2>/dev/null | grep -A1 -E 'Int2DecodeKernelILi128ELi1E' | grep -E 'Function|REG' ; done) > "$OUT/resource_usage.txt" 2>&1

# ---- tests (CPU-bound references; concurrent) ----
C=$D/cand_cuda_kernels_test
F='PagedDecode.*'
E='KVPOOL_DECODE'
TJ=()
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

# ---- alternating rounds ----
TSV="$R/rounds.tsv"
: >"$TSV"
CF_ALL="main main@${E}_INT2_WIDE=1 main@${E}_INT2_WIDE=1,${E}_DYN=50 main@${E}_INT2_WIDE=1,${E}_DYN=90 main@${E}_INT2_WIDE=1,${E}_DYN=0 main@${E}_INT2_WIDE=1,${E}_HIST_SPLITS=4 main@${E}_INT2_WIDE=1,${E}_SPLIT_MAJOR=0 main@${E}_INT2_WIDE=1,${E}_HIST_SPLITS=6"
SETS=(
  "B|--batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16"
  "A|--batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16"
)
for r in $(seq "${ROUNDS:-5}"); do
  for st in "${SETS[@]}"; do
    IFS='|' read -r sn sa <<<"$st"
    [ "$r" -gt 3 ] && [ "$sn" != A ] && [ "$sn" != B ] && continue
    order=$CF_ALL
    [ $((r % 2)) -eq 0 ] && order=$(echo $CF_ALL | tr ' ' '\n' | tac | tr '\n' ' ')
    for cfg in $order; do
      bin=${cfg%%@*}
      e=""
      [ "$cfg" != "$bin" ] && e=${cfg#*@} && e=${e//,/ }
      stamp "== round $r set $sn $cfg"
      timeout 60 env $e "$D/${bin}_cuda_decode_bench" --skip-bf16 $sa --iters 30 --json "$R/r${r}_${sn}_$(echo "$cfg" | tr -c 'A-Za-z0-9\n' '_').json" 2>&1 |
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
print("== summary: per-round medians (ms); mean; ratio = mean / mean of main; % of 4.6 TB/s (bytes of the bench JSON)")
for sh in shapes:
    b, ctx = int(sh.split()[0][2:]), int(sh.split()[1][4:])
    base = ms.get((sh, "main"))
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
        wins = f" below-all-main {sum(x < min(base) for x in v)}/{len(v)}" if base and c != "main" else ""
        print(f"  {' / '.join(f'{x:.4f}' for x in v):<60} mean {m:.4f}{pct} ratio {ratio:.4f}{xs}{wins}  {c}")
PY
stamp "== done"
(cd "$OUT" && tar czf r.tgz r && rm -rf r)
