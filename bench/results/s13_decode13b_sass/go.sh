#!/bin/bash
# go.sh NAME : build cubin of the worktree's paged_decode.cu, print regs, loop label, block table
cd /work/wt-decode13b
NVBIN=$HOME/.local/lib/python3.11/site-packages/nvidia/cu13/bin REPO=. bash /work/main/bench/results/s13_decode13i_sass/sass.sh kernels/cuda/paged_decode.cu /tmp/d13b/$1 2>&1 | grep -v "^$"
$HOME/.local/lib/python3.11/site-packages/nvidia/cu13/bin/cuobjdump --dump-resource-usage /tmp/d13b/$1.cubin | grep -A1 "Int2DecodeKernel" | grep -oE "Int2DecodeKernelILi[0-9]+ELi[0-9]|REG:[0-9]+|STACK:[0-9]+|LOCAL:[0-9]+" | paste - - - - 
L=$(python3 /tmp/d13b/findloop.py /tmp/d13b/$1_int2.sass); echo "loop $L"
python3 /tmp/d13b/blocks.py /tmp/d13b/$1_int2.sass $L
E=$(python3 /tmp/d13b/autoex.py /tmp/d13b/$1_int2.sass $L); echo "excluded $E"
python3 /tmp/d13b/path.py /tmp/d13b/$1_int2.sass $L "$E" "" 2>/dev/null| head -2
