#!/usr/bin/env bash
# kvpool-worker --fault-pool-pid against real pools (docs/WORKER.md "Command-line checks"): the
# pool fault hooks SIGKILL/SIGSTOP the pid they are given, so it must be the pool at --pool, as
# that pool reports it (StatsResponse.pool_pid, protocol v1.6):
#   1. the pid of another kvpool-server is refused (exit 1, naming both pids), and that pool
#      still runs with its blocks (newcomer s9b #2: it was SIGKILLed and the run exited 0);
#   2. a process that is only named kvpool-server (a copy of sleep) is refused and not stopped;
#   3. the pool's own pid is accepted: the hook fires and kills it.
# And two prefill checks that need a pool: a capped --put-timeout-ms is named (s10 F3); a
# --ucx-tls sharing no transport with the pool is not treated as an outage (s10 F8).
# Usage: fault_pid_test.sh SERVER WORKER KVPOOL_TOOL MODEL DEMO_DIR
set -uo pipefail
server_bin="$1"; worker_bin="$2"; tool_bin="$3"; model="$4"; demo="$5"
work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "${p}" 2>/dev/null; kill -KILL "${p}" 2>/dev/null; wait "${p}" 2>/dev/null; done
  rm -rf "${work}"
}
trap cleanup EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# start_pool NAME: a pool on a free port; sets NAME_pid and NAME_addr.
start_pool() {
  local port; port="$(free_port)"
  "${server_bin}" --listen "127.0.0.1:${port}" --metrics-port -1 --ucx-tls tcp --capacity 64MiB \
    >"${work}/$1.log" 2>&1 &
  local pid=$!
  pids+=("${pid}")
  for _ in $(seq 1 100); do grep -q "ready" "${work}/$1.log" 2>/dev/null && break; sleep 0.1; done
  printf -v "$1_pid" '%s' "${pid}"; printf -v "$1_addr" '%s' "127.0.0.1:${port}"
}
start_pool a
start_pool b

"${tool_bin}" calibrate --model "${model}" --text "${demo}/calibration.txt" \
  --out "${work}/rot.safetensors" >/dev/null 2>&1 || { echo "calibrate failed" >&2; exit 1; }
common=(--model "${model}" --rotations "${work}/rot.safetensors" --max-new-tokens 4
        --prompt-file "${demo}/prompts/01_kite.txt" --prompt-file "${demo}/prompts/02_garden.txt")
# Pool b holds blocks: what a wrong pid would destroy. (Also: a --put-timeout-ms beyond what the
# pool grants, 10 min here, is named in a warning: newcomer s10 F3.)
"${worker_bin}" --role prefill --pool "${b_addr}" "${common[@]}" --put-timeout-ms 3600000 \
  >/dev/null 2>"${work}/prefill_b.log" || { cat "${work}/prefill_b.log" >&2; fail "prefill into pool b"; }
grep -q "W prefill: the pool grants each put about 600 s, not the 3600000 ms of --put-timeout-ms" \
  "${work}/prefill_b.log" && echo "ok: the capped put timeout is named" \
  || { cat "${work}/prefill_b.log" >&2; fail "no warning for the capped --put-timeout-ms"; }
[[ $(grep -c "the pool grants each put" "${work}/prefill_b.log") -eq 1 ]] || fail "the put-timeout warning is not logged once"

echo "== the pid of another kvpool-server (pool b) for the pool at --pool (pool a)"
"${worker_bin}" --role prefill --pool "${a_addr}" "${common[@]}" --fault kill-pool-after-first-commit \
  --fault-pool-pid "${b_pid}" >/dev/null 2>"${work}/wrong_pool.log"
rc=$?
[[ ${rc} -eq 1 ]] && echo "ok: exit 1" || fail "exit ${rc}, want 1"
want="kvpool-worker: --fault-pool-pid: ${b_pid} is not the pool at ${a_addr} (that pool's pid is ${a_pid}): kill-pool-after-first-commit signals only the pool under test (--pool)"
grep -qF -- "${want}" "${work}/wrong_pool.log" && echo "ok: the message names both pids" \
  || { cat "${work}/wrong_pool.log" >&2; fail "message: want '${want}'"; }
kill -0 "${b_pid}" 2>/dev/null && echo "ok: pool b still runs" || fail "pool b was killed"
grep -q "fault kill-pool-after-first-commit: killing" "${work}/wrong_pool.log" && fail "the hook fired"
"${worker_bin}" --role decode --pool "${b_addr}" "${common[@]}" --teacher-force false \
  --report "${work}/decode_b.json" >/dev/null 2>"${work}/decode_b.log" \
  || { cat "${work}/decode_b.log" >&2; fail "decode from pool b"; }
python3 -c "
import json
d = json.load(open('${work}/decode_b.json'))
assert d['overall']['fallbacks'] == 0 and d['overall']['hit_blocks'] > 0, d['overall']
print('ok: pool b still serves its blocks')" || fail "pool b lost its blocks"

echo "== a process named kvpool-server that is not the pool (a copy of sleep)"
mkdir -p "${work}/fake"
cp "$(command -v sleep)" "${work}/fake/kvpool-server"
"${work}/fake/kvpool-server" 300 &
fake=$!
pids+=("${fake}")
"${worker_bin}" --role decode --pool "${a_addr}" "${common[@]}" --fault stop-pool-after-register \
  --fault-pool-pid "${fake}" >/dev/null 2>"${work}/fake.log"
rc=$?
[[ ${rc} -eq 1 ]] && echo "ok: exit 1" || fail "exit ${rc}, want 1"
grep -qF -- "--fault-pool-pid: ${fake} is not the pool at ${a_addr} (that pool's pid is ${a_pid})" \
  "${work}/fake.log" && echo "ok: the message names the pool's pid" \
  || { cat "${work}/fake.log" >&2; fail "message for the fake pool"; }
state="$(awk '{print $3}' "/proc/${fake}/stat" 2>/dev/null)"
[[ "${state}" != "T" ]] && echo "ok: the fake is not stopped (state ${state})" || fail "the fake was SIGSTOPped"

echo "== the pool's own pid: accepted, the hook fires"
"${worker_bin}" --role prefill --pool "${a_addr}" "${common[@]}" --fault kill-pool-after-first-commit \
  --fault-pool-pid "${a_pid}" --call-timeout-ms 1000 >/dev/null 2>"${work}/right_pool.log"
grep -q "fault kill-pool-after-first-commit: killing pool pid ${a_pid}" "${work}/right_pool.log" \
  && echo "ok: the hook fired on pool a" || { cat "${work}/right_pool.log" >&2; fail "the hook did not fire"; }
kill -0 "${a_pid}" 2>/dev/null && fail "pool a still runs" || echo "ok: pool a is gone"
kill -0 "${b_pid}" 2>/dev/null && echo "ok: pool b still runs" || fail "pool b was killed"

echo "== a prefill whose --ucx-tls shares no transport with the pool (tcp): no 'lost put'"
# A configuration mismatch, not an outage: it was logged as a lost put ('the put ... was lost
# with the pool', since session 17 '... failed: the pool went away or closed the connection')
# and put again (newcomer s10 F8).
"${worker_bin}" --role prefill --pool "${b_addr}" "${common[@]}" --ucx-tls posix,cma --revision tls-test \
  --call-timeout-ms 2000 >/dev/null 2>"${work}/tls.log"
rc=$?
[[ ${rc} -eq 2 ]] && echo "ok: exit 2" || { cat "${work}/tls.log" >&2; fail "exit ${rc}, want 2"; }
grep -q "share no UCX transport" "${work}/tls.log" && echo "ok: the error names the transports" \
  || { cat "${work}/tls.log" >&2; fail "the error does not say that no UCX transport is shared"; }
grep -q "was lost with the pool\|went away or closed the connection\|the pool is unreachable" "${work}/tls.log" \
  && { cat "${work}/tls.log" >&2; fail "the mismatch was treated as a pool outage"; } || echo "ok: not treated as an outage"

echo "== a decode worker whose --ucx-tls shares no transport with the pool: named so, not 'unreachable'"
# The pool (tcp) accepts the registration, then cannot connect back to this worker (posix,cma)
# for its reads: each fetch failed with UCX's bare "Destination is unreachable" (newcomer 20 F2).
"${worker_bin}" --role decode --pool "${b_addr}" "${common[@]}" --ucx-tls posix,cma \
  --teacher-force false --call-timeout-ms 2000 >/dev/null 2>"${work}/tls_decode.log"
rc=$?
[[ ${rc} -eq 0 ]] && echo "ok: exit 0 (the prefix is computed locally)" || { cat "${work}/tls_decode.log" >&2; fail "exit ${rc}, want 0"; }
grep -q "share no UCX transport; check --ucx-tls / UCX_TLS on both: this client uses 'posix,cma'" "${work}/tls_decode.log" \
  && echo "ok: the fallback names the transports" || { cat "${work}/tls_decode.log" >&2; fail "the fallback does not name the transports"; }
grep -q "pool unreachable" "${work}/tls_decode.log" \
  && { cat "${work}/tls_decode.log" >&2; fail "the mismatch was called an unreachable pool"; } || echo "ok: not called unreachable"

echo "== a put timeout shorter than a put takes (--put-timeout-ms 1): the error names the timeout"
# It read as a client that stopped answering UCX, or named only the pool's flag (newcomer 13b F8).
"${worker_bin}" --role prefill --pool "${b_addr}" "${common[@]}" --put-timeout-ms 1 \
  --revision short-put-test >/dev/null 2>"${work}/short_put.log"
rc=$?
[[ ${rc} -eq 2 ]] && echo "ok: exit 2" || { cat "${work}/short_put.log" >&2; fail "exit ${rc}, want 2"; }
last="$(tail -n 1 "${work}/short_put.log")"
if [[ "${last}" == *"longer than the put timeout of 1 ms that kvpool-worker --put-timeout-ms asks for"* ||
      "${last}" == *"the put's timeout ran out first"* ]]; then
  echo "ok: the failure names the put timeout"
else
  cat "${work}/short_put.log" >&2; fail "the failure does not name the put timeout"
fi

[[ ${failures} -eq 0 ]] && echo PASS || { echo "${failures} failure(s)" >&2; exit 1; }
