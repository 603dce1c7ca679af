#!/usr/bin/env bash
# Flag checks of the bench binaries (no pool needed: they fail while parsing).
# Usage: bench_cli_test.sh POOL_BENCH QUANTIZE_BENCH
set -u
pool="$1"; quant="$2"
# shellcheck source=../../tests/cli_check.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../tests/cli_check.sh"
# A negative count used to abort in std::vector (std::length_error, exit 134).
for flag in --lookup-clients --commit-blocks --iters --lookup-iters --commit-iters; do
  check "pool_bench $flag -3" 1 "$flag" -- "$pool" --server 127.0.0.1:1 "$flag" -3
  check "pool_bench $flag 0" 1 "$flag" -- "$pool" --server 127.0.0.1:1 "$flag" 0
done
check "pool_bench --warmup -1" 1 "--warmup" -- "$pool" --server 127.0.0.1:1 --warmup -1
# The default results file is in the current directory, not a committed file of the source tree.
out="$("$quant" --help 2>&1)"
if grep -q -- "--json-out.*=quantize_cpu.json\|--json-out.*\[quantize_cpu.json\]" <<<"$out" &&
   ! grep -q "bench/results" <<<"$out"; then
  echo "ok   quantize_bench default --json-out"
else
  echo "FAIL quantize_bench default --json-out:"; grep -- "--json-out" <<<"$out"; fail=1
fi
# Outputs are checked before the run (kvpool::cli::OutputFile): a device node, an unwritable
# directory.
check "quantize_bench --json-out /dev/null" 1 "--json-out: '/dev/null' is a character device, not a regular file" -- "$quant" --json-out /dev/null
check "quantize_bench --json-out /proc/q.json" 1 "--json-out: cannot create a file in directory '/proc'" -- "$quant" --json-out /proc/q.json
# pool_bench --json too: it was checked only after the whole benchmark had run (exit 2).
# 127.0.0.1:1 has no pool, so a run that got past parsing would fail otherwise (exit 2).
check "pool_bench --json /nonexistent/dir/x.json" 1 "--json: directory '/nonexistent/dir' of '/nonexistent/dir/x.json' does not exist" -- "$pool" --server 127.0.0.1:1 --json /nonexistent/dir/x.json
check "pool_bench --json /dev/null" 1 "--json: '/dev/null' is a character device, not a regular file" -- "$pool" --server 127.0.0.1:1 --json /dev/null
exit $fail
