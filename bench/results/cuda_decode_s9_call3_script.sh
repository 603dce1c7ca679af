#!/usr/bin/env bash
# decode9 device call 3: the landing candidate (final = main + the rotation's maximum carveout for
# one-wave claim grids whose rotation grid holds > 3/4 of the SMs) against main, alternating, 3
# rounds, INT2 launch only, medians of 30, L2 flushed.
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
  echo "== $(date -u) decode9 call 3"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
} 2>&1 | tee "$LOG"
TSV="$R/rounds.tsv"
: >"$TSV"
SETS=(
  "A|--batches 12,14,16 --contexts 131072 --gqa 32:8 --page-sizes 16|base final final@KVPOOL_DECODE_QROT_CARVEOUT=1"
  "B|--batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16|base final"
  "C|--batches 1,32 --contexts 32768 --gqa 32:8 --page-sizes 16|base final"
)
for r in 1 2 3; do
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
