#!/usr/bin/env bash
# device_profile.sh — Nsight Compute counters (clocks left alone) for the INT2 decode kernel at
# B=32 x 32K (32q/8kv, d128, page 16) and the quantize-only write kernel: speed of light,
# occupancy, instruction counts and the per-issue stall breakdown; plus the SASS of every kernel.
# Results under $OUT.
set -u
OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
B=.devlibs/cuda_decode_bench
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats"
ST=""
for r in barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle membar mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait; do
  ST="$ST,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
ST=${ST#,}
ncu --clock-control none --kernel-name-base mangled --kernel-name regex:DecodeKernelILb1ELi128ELi1 --launch-skip 2 --launch-count 1 $S --metrics "$ST" \
  $B --batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 2 --warmup 1 --skip-write > "$OUT/ncu_int2.txt" 2>&1
ncu --clock-control none --kernel-name-base mangled --kernel-name regex:KvWriteKernelILi128ELb0ELb0 --launch-count 1 $S --metrics "$ST" \
  $B --skip-decode --iters 1 --warmup 0 > "$OUT/ncu_quant.txt" 2>&1
grep -E "Duration|Issue Slots Busy|Eligible Warps|Registers Per|Achieved Active|Executed Instructions  |issue_stalled" "$OUT/ncu_int2.txt"
echo ---- quant
grep -E "Duration|Issue Slots Busy|Eligible Warps|issue_stalled" "$OUT/ncu_quant.txt"
