#!/bin/bash
# sass.sh SRC.cu OUTPREFIX  -> OUTPREFIX.cubin, OUTPREFIX_int2.sass (line info), resource usage
set -e
B=${NVBIN:-/usr/local/cuda/bin}
src=$1; o=$2
/usr/local/cuda/bin/nvcc -I${REPO:-.}/kernels/include -O2 -g -DNDEBUG -gencode arch=compute_90a,code=sm_90a -lineinfo -std=c++17 -x cu -cubin $EXTRA "$src" -o $o.cubin
$B/cuobjdump --dump-resource-usage $o.cubin | grep -A1 "Int2DecodeKernelILi" | grep -E "REG" | sed -n 1,6p
idx=$($B/cuobjdump -elf $o.cubin | grep -E "FUNC .*Int2DecodeKernelILi128ELi1E" | awk '{print $1}')
$B/nvdisasm -fun $((idx)) -g -c $o.cubin > ${o}_int2.sass
$B/cuobjdump --dump-resource-usage $o.cubin | grep -A1 "Int2DecodeKernelILi128ELi1E" | tail -1
