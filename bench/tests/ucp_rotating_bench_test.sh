#!/usr/bin/env bash
# ucp_rotating_bench: flag refusals, and a short real run over shared memory whose JSON holds
# every (size, ring, test) row and the byte-exact put/get check.
# Usage: ucp_rotating_bench_test.sh UCP_ROTATING_BENCH
set -u
bin="$1"
# shellcheck source=../../tests/cli_check.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../tests/cli_check.sh"
check "--iters 0" 1 "--iters" -- "$bin" --iters 0
check "--sizes-kib 0" 1 "--sizes-kib" -- "$bin" --sizes-kib 0
check "--json /proc/x.json" 1 "--json" -- "$bin" --json /proc/x.json
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
check "posix,cma run" 0 "fresh  get" -- "$bin" --ucx-tls posix,cma --ring-mib 4 --sizes-kib 16,64 \
  --iters 5 --warmup 1 --json "$tmp/r.json"
if python3 - "$tmp/r.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
rows = {(x["bytes"], x["ring"], x["test"]): x for x in r["results"]}
want = {(s << 10, ring, t) for s in (16, 64) for ring in ("fresh", "same") for t in ("put", "get")}
assert set(rows) == want, sorted(rows)
assert all(x["gbps"] > 0 and x["p50_us"] > 0 for x in rows.values())
assert rows[(16 << 10, "fresh", "get")]["buffers"] == 256 and rows[(64 << 10, "same", "put")]["buffers"] == 1
assert r["data_check"].startswith("a 4 KiB page put and got back byte-exact")
PY
then echo "ok   posix,cma run JSON"; else echo "FAIL posix,cma run JSON"; fail=1; fi
exit $fail
