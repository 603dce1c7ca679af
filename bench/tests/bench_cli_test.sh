#!/usr/bin/env bash
# Flag checks of the bench binaries (no pool needed: they fail while parsing).
# With SERVER (kvpool-server), also pool_bench --only-inflight against a small pool of its own.
# Usage: bench_cli_test.sh POOL_BENCH QUANTIZE_BENCH [SERVER]
set -u
pool="$1"; quant="$2"; server="${3:-}"
# shellcheck source=../../tests/cli_check.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../tests/cli_check.sh"
# A negative count used to abort in std::vector (std::length_error, exit 134).
for flag in --lookup-clients --commit-blocks --iters --lookup-iters --commit-iters; do
  check "pool_bench $flag -3" 1 "$flag" -- "$pool" --server 127.0.0.1:1 "$flag" -3
  check "pool_bench $flag 0" 1 "$flag" -- "$pool" --server 127.0.0.1:1 "$flag" 0
done
check "pool_bench --warmup -1" 1 "--warmup" -- "$pool" --server 127.0.0.1:1 --warmup -1
# A CPU outside the process's affinity was refused with no reason (newcomer 13b F9).
check "pool_bench --pin-caller-cpu 4095" 1 "^pool_bench: --pin-caller-cpu: CPU 4095 is not one this process may run on (its CPUs: 0" -- "$pool" --server 127.0.0.1:1 --pin-caller-cpu 4095
# Integer flags are plain decimal (newcomer 16 F2): --sizes-kib had no range check, so CLI11 read
# 0100 as octal 64 (a power of two, measured as 64 KiB) and took 0x10 and +16.
for v in 0100 0x10 +16 " 16"; do
  check "pool_bench --sizes-kib '$v'" 1 "^pool_bench: --sizes-kib: '$v' is not " -- "$pool" --server 127.0.0.1:1 --sizes-kib "$v"
done
cfg="$(mktemp -d)"
printf 'sizes-kib: 0100\n' >"$cfg/octal.yaml"
check "pool_bench --config sizes-kib: 0100" 1 "^pool_bench: --config '$cfg/octal.yaml' key \"sizes-kib\": --sizes-kib: '0100' is not a decimal integer" -- "$pool" --server 127.0.0.1:1 --config "$cfg/octal.yaml"
printf 'pairs: 0x10\n' >"$cfg/hex.yaml"
check "quantize_bench --config pairs: 0x10" 1 "key \"pairs\": --pairs: '0x10' is not an integer" -- "$quant" --config "$cfg/hex.yaml"
check "quantize_bench --pairs 0100" 1 "--pairs: '0100' is not a decimal integer" -- "$quant" --pairs 0100
rm -rf "$cfg"
# The other benches, when given (bench/CMakeLists.txt): integer flags that had no range check
# (cuda_write_bench --tokens went through std::stoi, which took +16 and ' 16').
for spec in "${UCP_ROTATING_BENCH:-}|--ring-mib" "${CUDA_DECODE_BENCH:-}|--head-dim" \
            "${CUDA_DECODE_BENCH:-}|--page-sizes" "${CUDA_WRITE_BENCH:-}|--page-size" \
            "${CUDA_WRITE_BENCH:-}|--tokens"; do
  b="${spec%%|*}"; flag="${spec##*|}"
  [[ -n "$b" ]] || continue
  for v in 0100 0x10 +16 " 16"; do
    check "$(basename "$b") $flag '$v'" 1 "^$(basename "$b"): $flag: '$v' is not " -- "$b" "$flag" "$v"
  done
done
# The project's range message, not CLI11's "Value 0,1 not in range -1 to 4095" (newcomer 16 F10).
for v in 0,1 1-2; do
  check "pool_bench --pin-caller-cpu $v" 1 "^pool_bench: --pin-caller-cpu: '$v' is not an integer (want -1..4095)" -- "$pool" --server 127.0.0.1:1 --pin-caller-cpu "$v"
done
# An unreachable pool is said in words with its address, not as a source expression ("E
# info.status(): UNAVAILABLE: ...": newcomer 16 F10).
check "pool_bench unreachable pool" 2 "cannot reach the pool at 127.0.0.1:1 (registering model bench-16k): UNAVAILABLE" -- "$pool" --server 127.0.0.1:1 --sizes-kib 16
out="$("$pool" --server 127.0.0.1:1 --sizes-kib 16 2>&1)"
if grep -q "status()" <<<"$out"; then echo "FAIL pool_bench unreachable pool names an expression: $out"; fail=1
else echo "ok   pool_bench unreachable pool names no expression"; fi
# A bad size is refused in the usage form, and no run that ends without a row prints the table's
# header (newcomer reports 13 F7 and 13b).
check "pool_bench --sizes-kib 24" 1 "^pool_bench: --sizes-kib: 24 is not a power of two >= 16" -- "$pool" --server 127.0.0.1:1 --sizes-kib 24
for args in "--sizes-kib 24" "--sizes-kib 16"; do  # a usage error; a pool that cannot be reached
  # shellcheck disable=SC2086
  if out="$("$pool" --server 127.0.0.1:1 $args 2>/dev/null)"; [[ -z "$out" ]]; then
    echo "ok   pool_bench $args prints no table header"
  else
    echo "FAIL pool_bench $args printed: $out"; fail=1
  fi
done
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
check "quantize_bench --benchmark_filter matching nothing" 1 "--benchmark_filter matches no benchmark" -- "$quant" --pairs 1 --window-ms 1 --benchmark_filter=NOPE --json-out /tmp/kvpool_bench_cli_qb.json
# pool_bench --json too: it was checked only after the whole benchmark had run (exit 2).
# 127.0.0.1:1 has no pool, so a run that got past parsing would fail otherwise (exit 2).
check "pool_bench --json /nonexistent/dir/x.json" 1 "--json: directory '/nonexistent/dir' of '/nonexistent/dir/x.json' does not exist" -- "$pool" --server 127.0.0.1:1 --json /nonexistent/dir/x.json
check "pool_bench --json /dev/null" 1 "--json: '/dev/null' is a character device, not a regular file" -- "$pool" --server 127.0.0.1:1 --json /dev/null
# --only-inflight without clients: the usage form of the other flags (newcomer 11b F7: an E log
# line).
check "pool_bench --only-inflight --inflight-clients 0" 1 "^pool_bench: --only-inflight: needs --inflight-clients > 0" -- "$pool" --server 127.0.0.1:1 --only-inflight=true
if [[ -n "$server" ]]; then
  # Newcomer 11b F7: --only-inflight printed the one-at-a-time table's header with no rows, and a
  # pool too small for the section failed with "E put.status(): RESOURCE_EXHAUSTED: ..." naming
  # neither the section nor what it needs.
  work="$(mktemp -d)"
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  "$server" --listen "127.0.0.1:${port}" --metrics-port -1 --ucx-tls tcp --capacity 2MiB >"${work}/server.log" 2>&1 &
  spid=$!
  for _ in $(seq 1 100); do grep -q "ready" "${work}/server.log" 2>/dev/null && break; sleep 0.1; done
  check "pool_bench --only-inflight runs" 0 "16 KiB    in flight: 2 clients" -- "$pool" --server "127.0.0.1:${port}" --ucx-tls tcp \
    --only-inflight=true --inflight-clients 2 --sizes-kib 16 --inflight-rounds 2 --inflight-window-kib 64
  out="$("$pool" --server "127.0.0.1:${port}" --ucx-tls tcp --only-inflight=true --inflight-clients 2 --sizes-kib 16 \
    --inflight-rounds 2 --inflight-window-kib 64 2>&1)"
  if grep -q "put data" <<<"$out"; then echo "FAIL pool_bench --only-inflight prints the one-at-a-time header:"; echo "$out"; fail=1
  else echo "ok   pool_bench --only-inflight prints no one-at-a-time header"; fi
  # 4 clients x 4 puts x 256 KiB = 4 MiB of open puts into a 2 MiB pool.
  check "pool_bench --only-inflight, pool too small" 2 "in-flight section, 256 KiB blocks, client [0-9] of 4: .*RESOURCE_EXHAUSTED.*(this section holds 4 client(s) x 4 put(s) x 256 KiB = 4194304 bytes of open puts at once" \
    -- "$pool" --server "127.0.0.1:${port}" --ucx-tls tcp --only-inflight=true --inflight-clients 4 --sizes-kib 256 --inflight-rounds 2
  kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null; rm -rf "$work"
fi
exit $fail
