#!/usr/bin/env bash
# device_profile.sh — Nsight Compute counters (clocks left alone) for the INT2 decode kernel at
# B=32 x 32K (32q/8kv, d128, page 16) and the quantize-only write kernel, plus the SASS of
# every kernel; results under $OUT.
set -u
OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH="$PWD/.devlibs:${LD_LIBRARY_PATH:-}"
B=.devlibs/cuda_decode_bench
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
ncu --clock-control none --kernel-name-base mangled --kernel-name regex:DecodeKernelILb1ELi128ELi1 --launch-skip 2 --launch-count 1 $S \
  $B --batches 32 --contexts 32768 --gqa 32:8 --page-sizes 16 --iters 2 --warmup 1 --skip-write > "$OUT/ncu_int2.txt" 2>&1
ncu --clock-control none --kernel-name-base mangled --kernel-name regex:KvWriteKernelILi128ELb0ELb0 --launch-count 1 $S \
  $B --skip-decode --iters 1 --warmup 0 > "$OUT/ncu_quant.txt" 2>&1
cuobjdump -sass "$B" > "$OUT/sass.txt" 2>&1; gzip -9 "$OUT/sass.txt"
grep -E "Duration|Throughput|Warp Cycles Per Issued|Issue Slots Busy|Achieved Occupancy|Registers|Stall|No Eligible|Active Warps Per|Eligible Warps" "$OUT/ncu_int2.txt" | head -60
echo ---- quant; grep -E "Duration|Throughput|Warp Cycles Per Issued|Issue Slots Busy|Achieved Occupancy|Registers|No Eligible|Eligible Warps" "$OUT/ncu_quant.txt" | head -30
