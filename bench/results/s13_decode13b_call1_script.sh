#!/usr/bin/env bash
# decode13b device call (s13): INT2 stage-loop cuts against main (52e760e: v27 INT2 + v28 BF16).
# cand  = m_run dropped (nref = -mref held) + the K and V lanes' shared-memory offsets held in
#         registers + no -inf start of the step max (584 instr/stage vs 599, 95 registers)
# cand2 = cand + 32-bit page stride in the copy address (launcher requires stride < 2^32):
#         583/stage, 93 registers
# GPU tests of the candidates (concurrent) + main's PagedDecode/EndToEnd, SDPA before/after,
# alternating rounds (whole launcher, --skip-bf16, medians of 30), ncu of the INT2 kernel at
# B=8x128K for each build.
set -u
D=.devlibs-decode13b
export LD_LIBRARY_PATH="$PWD/$D:${LD_LIBRARY_PATH:-}"
OUT=${OUT:-/tmp/out}
R="$OUT/r"
mkdir -p "$R"
LOG="$OUT/call_log.txt"
T0=$(date +%s)
stamp() { echo "[+$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }
{
  echo "== $(date -u) decode13b call 1"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv
  echo "ncu: $(command -v ncu)  cuobjdump: $(command -v cuobjdump)"
} 2>&1 | tee "$LOG"
(command -v cuobjdump >/dev/null && for b in main cand cand2; do echo "-- $b"; cuobjdump --dump-resource-usage $D/${b}_cuda_decode_bench 2>/dev/null | grep -A1 -E 'Int2DecodeKernelILi|Bf16DecodeKernelILi128ELi1E' | grep -E 'Function|REG' ; done) > "$OUT/resource_usage.txt" 2>&1

C=$D/cand_cuda_kernels_test
F='PagedDecode.*'
TJ=(
  "$C|*||"
  "$C|$F:EndToEnd.*|KVPOOL_DECODE_ITEMS=1|"
  "$C|$F|KVPOOL_DECODE_ITEMS=1 KVPOOL_DECODE_DYN=0|"
  "$C|$F|KVPOOL_DECODE_DYN=75 KVPOOL_DECODE_SPLIT_MAJOR=1|"
  "$C|$F|KVPOOL_DECODE_ITEMS=0 KVPOOL_DECODE_DYN=0 KVPOOL_DECODE_SPLIT_MAJOR=0|"
  "$D/cand2_cuda_kernels_test|*||"
  "$D/main_cuda_kernels_test|$F:EndToEnd.*||"
)
stamp "== tests (${#TJ[@]} jobs, concurrent)"
i=0
for j in "${TJ[@]}"; do
  IFS='|' read -r tb tf te tx <<<"$j"
  i=$((i + 1))
  (timeout 170 env $te "$tb" --gtest_filter="$tf" $tx >"$R/test_$i.txt" 2>&1; echo "rc=$?" >>"$R/test_$i.txt") &
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

sdpa() {
  stamp "== SDPA $1"
  PYTHONUNBUFFERED=1 timeout 100 python3 bench/cuda_sdpa_baseline.py --out "$R/sdpa_ab$1.json" --batches 8,32 --contexts 32768,131072 --gqa 32:8 >>"$R/sdpa_ab$1.log" 2>&1
  tail -6 "$R/sdpa_ab$1.log" | tee -a "$LOG"
}
sdpa 1
TSV="$R/rounds.tsv"; : >"$TSV"
SETS=(
  "B|--batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16"
  "A|--batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16"
  "C1|--batches 1,8 --contexts 32768 --gqa 32:8 --page-sizes 16"
  "C2|--batches 128 --contexts 32768 --gqa 32:8 --page-sizes 16"
  "C3|--batches 1,16 --contexts 131072 --gqa 32:8 --page-sizes 16"
)
for r in 1 2 3 4 5 6; do
  for st in "${SETS[@]}"; do
    IFS='|' read -r sn sa <<<"$st"
    [ "$r" -gt 3 ] && [ "$sn" != A ] && [ "$sn" != B ] && continue
    if [ $((r % 2)) -eq 1 ]; then order="main cand cand2"; else order="cand2 cand main"; fi
    for cfg in $order; do
      stamp "== round $r set $sn $cfg"
      timeout 60 "$D/${cfg}_cuda_decode_bench" --skip-bf16 $sa --iters 30 --json "$R/r${r}_${sn}_${cfg}.json" 2>&1 |
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
shapes, ms = [], collections.defaultdict(list)
for r, c, b, ctx, heads, p, t in rows:
    sh = f"B={b} ctx={ctx} {heads} p{p}"
    shapes += [sh] if sh not in shapes else []
    ms[(sh, c)].append(float(t))
sdpa = collections.defaultdict(list)
for f in sorted(glob.glob(sys.argv[2] + "/sdpa_ab*.json")):
    d = json.load(open(f))
    for x in d.get("results", d if isinstance(d, list) else []):
        try: sdpa[(int(x["batch"]), int(x["context"]))].append(float(x["ms"]))
        except Exception: pass
nbytes = {}
for f in glob.glob(sys.argv[2] + "/r*.json"):
    try:
        for x in json.load(open(f))["decode"]:
            nbytes[(x["batch"], x["context"], f"{x['hq']}/{x['hkv']}", x["page"])] = x["int2_mixed"]["bytes"]
    except Exception: pass
print("== summary: per-round medians (ms); mean; ratio = mean / mean of main (52e760e); % of 4.6 TB/s")
for sh in shapes:
    b, ctx = int(sh.split()[0][2:]), int(sh.split()[1][4:])
    base = ms.get((sh, "main")); s = sdpa.get((b, ctx))
    print(sh + (f"   SDPA {' / '.join(f'{x:.4f}' for x in s)}" if s else ""))
    for c in ["main", "cand", "cand2"]:
        v = ms.get((sh, c))
        if not v: continue
        m = sum(v) / len(v); ratio = m / (sum(base) / len(base)) if base else float("nan")
        xs = f"  x_sdpa {sum(s) / len(s) / m:.3f} (min-SDPA {min(s) / m:.3f})" if s else ""
        nb = nbytes.get((b, ctx, sh.split()[2], int(sh.split()[3][1:])))
        pct = f" {nb / (m * 1e-3) / 4.6e12 * 100:5.1f}%" if nb else ""
        print(f"  {' / '.join(f'{x:.4f}' for x in v):<52} mean {m:.4f}{pct} ratio {ratio:.4f}{xs}  {c}")
PY
if command -v ncu >/dev/null && [ $(($(date +%s) - T0)) -lt 240 ]; then
  S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats"
  ST=""
  for s in long_scoreboard math_pipe_throttle not_selected selected short_scoreboard wait mio_throttle branch_resolving no_instruction dispatch_stall; do
    ST="$ST,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
  done
  M="${ST#,},smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed"
  for b in main cand cand2; do
    [ $(($(date +%s) - T0)) -lt 270 ] || break
    stamp "== ncu $b"
    timeout 60 ncu --clock-control none --kernel-name-base mangled --kernel-name regex:Int2DecodeKernelILi128ELi1 --launch-skip 2 --launch-count 1 $S \
      --metrics "$M" "$D/${b}_cuda_decode_bench" --skip-bf16 --batches 8 --contexts 131072 --gqa 32:8 --page-sizes 16 --iters 2 --warmup 1 > "$OUT/ncu_${b}.txt" 2>&1
    grep -E "Duration|Elapsed Cycles|SM Frequency|Issue Slots Busy|Eligible Warps|Registers Per|Achieved Active|Executed Instructions  |DRAM Throughput|issue_stalled|pipe_|inst_executed.sum|dram__" "$OUT/ncu_${b}.txt" | tee -a "$LOG"
  done
fi
stamp "== done"
(cd "$OUT" && tar czf r.tgz r && rm -rf r)
