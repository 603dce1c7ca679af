#!/usr/bin/env bash
# device_profile.sh — Nsight Compute counters (clocks left alone) for the INT2 decode kernel at
# B=32 x 32K (32q/8kv, d128, page 16): speed of light, occupancy, instruction counts and the
# per-issue stall breakdown. Results under $OUT (ncu_int2.txt); PROFILE_LAUNCH=0 skips the second
# pass (durations of the four kernels of one launch, ncu_launch.txt).
set -u
OUT=${OUT:-/tmp/out}
DEVLIBS=${DEVLIBS:-.devlibs-decode}
export LD_LIBRARY_PATH="$PWD/$DEVLIBS:${LD_LIBRARY_PATH:-}"
B=$DEVLIBS/cuda_decode_bench
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis"
ST=""
for r in barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle membar mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait; do
  ST="$ST,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
ST=${ST#,}
ncu --clock-control none --kernel-name-base mangled --kernel-name regex:Int2DecodeKernelILi128ELi1 --launch-skip 2 --launch-count 1 $S \
  --metrics "$ST,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active" \
  $B --batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 2 --warmup 1 > "$OUT/ncu_int2.txt" 2>&1
grep -E "Duration|Issue Slots Busy|Eligible Warps|Registers Per|Achieved Active|Executed Instructions  |DRAM Throughput|issue_stalled|pipe_|Compute \(SM\)" "$OUT/ncu_int2.txt"
[ "${PROFILE_LAUNCH:-1}" = 1 ] || exit 0
# Durations of the four kernels of one INT2 mixed launch (ncu serializes them: no PDL overlap).
ncu --clock-control none --kernel-name-base mangled --kernel-name "regex:QRotateKernel|DecodeKernel|MergeKernel" \
  --launch-skip 4 --launch-count 4 --section SpeedOfLight \
  $B --batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 2 --warmup 1 > "$OUT/ncu_launch.txt" 2>&1
grep -E "^  [A-Za-z_].*\(|Duration|DRAM Throughput" "$OUT/ncu_launch.txt" | sed -E 's/\(.*//' | cut -c1-120
