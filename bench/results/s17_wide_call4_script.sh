#!/usr/bin/env bash
# s17 call 4: the 4K shapes, with and without --skip-bf16, rule vs KVPOOL_DECODE_INT2_WIDE=0/1
set -u
D=/tmp/w17; mkdir -p $D && tar xJf .devlibs-wide17/bins.tar.xz -C $D
export LD_LIBRARY_PATH="$D:${LD_LIBRARY_PATH:-}"
B=$D/main_cuda_decode_bench
for r in 1 2; do
  for mode in skip both; do
    for e in X=0 KVPOOL_DECODE_INT2_WIDE=0 KVPOOL_DECODE_INT2_WIDE=1; do
      f=""; [ $mode = skip ] && f=--skip-bf16
      echo "== r$r $mode $e"
      env $e $B $f --batches 32,128 --contexts 4096 --gqa 32:8 --page-sizes 16 --iters 30 2>&1 | grep -E "^int2"
    done
  done
done
echo "== grid order, default"
$B --batches 1,8,32,128 --contexts 4096,32768 --gqa 32:8 --page-sizes 16 --iters 30 2>&1 | grep -E "^int2"
echo "== grid order, WIDE=0"
KVPOOL_DECODE_INT2_WIDE=0 $B --batches 1,8,32,128 --contexts 4096,32768 --gqa 32:8 --page-sizes 16 --iters 30 2>&1 | grep -E "^int2"
