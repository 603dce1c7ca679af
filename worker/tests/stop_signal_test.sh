#!/usr/bin/env bash
# kvpool-worker on SIGTERM/SIGINT (docs/WORKER.md "Stopping a worker"), against a real pool:
#   1. a prefill node logs each prompt as it is stored (not all at the end), and on SIGTERM
#      stops, aborts its open puts (the pool's open puts and staging drop to 0 at once, not at
#      its put timeout), writes --report (interrupted) and --metrics-file, exits 143;
#   2. a decode worker's answers reach a redirected stdout as each completes; on SIGTERM its
#      report holds exactly the answers printed, and it exits 143;
#   3. eval on SIGINT exits 130 with an interrupted report.
# Newcomer s9 A4: exit 143 with no log line, no report, no metrics, open puts pinning staging.
# Usage: stop_signal_test.sh SERVER WORKER KVPOOL_TOOL MODEL DEMO_DIR
set -uo pipefail
server_bin="$1"; worker_bin="$2"; tool_bin="$3"; model="$4"; demo="$5"
work="$(mktemp -d)"
server_pid=""; wpid=""
cleanup() {
  [[ -n "${wpid}" ]] && kill -KILL "${wpid}" 2>/dev/null
  if [[ -n "${server_pid}" ]]; then kill "${server_pid}" 2>/dev/null; wait "${server_pid}" 2>/dev/null; fi
  rm -rf "${work}"
}
trap cleanup EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port="$(free_port)"; mport="$(free_port)"
pool="127.0.0.1:${port}"
# A put timeout far beyond the test: only the worker's AbortPut can free the staging in time.
"${server_bin}" --listen "${pool}" --metrics-port "${mport}" --ucx-tls tcp --capacity 64MiB \
  --put-timeout-ms 600000 >"${work}/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 100); do grep -q "ready" "${work}/server.log" 2>/dev/null && break; sleep 0.1; done
metric() { curl -s "http://127.0.0.1:${mport}/metrics" | awk -v m="$1" '$1 == m {print $2}'; }

"${tool_bin}" calibrate --model "${model}" --text "${demo}/calibration.txt" \
  --out "${work}/rot.safetensors" >/dev/null 2>&1 || { echo "calibrate failed" >&2; exit 1; }
prompts=()
for _ in $(seq 1 12); do for f in "${demo}"/prompts/0*.txt; do prompts+=(--prompt-file "${f}"); done; done
n=${#prompts[@]}; n=$((n / 2))  # 60 prompts
common=(--pool "${pool}" --model "${model}" --rotations "${work}/rot.safetensors" --model-id stoptest)

# wait_for PATTERN FILE PID: until FILE has a line matching PATTERN while PID still runs (true:
# the line was written before the end), or PID ends (false).
wait_for() {
  for _ in $(seq 1 600); do
    if grep -q -- "$1" "$2" 2>/dev/null; then kill -0 "$3" 2>/dev/null; return; fi
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

echo "== prefill: SIGTERM after the first stored prompt"
"${worker_bin}" --role prefill "${common[@]}" "${prompts[@]}" --report "${work}/prefill.json" \
  --metrics-file "${work}/prefill.prom" >/dev/null 2>"${work}/prefill.log" &
wpid=$!
if wait_for "I prefill " "${work}/prefill.log" "${wpid}"; then
  echo "ok: a prompt was logged while the run went on"
else
  fail "no 'I prefill' line before the run ended"
fi
kill -TERM "${wpid}"; wait "${wpid}"; rc=$?; wpid=""
[[ ${rc} -eq 143 ]] && echo "ok: prefill exit 143" || fail "prefill exit ${rc}, want 143"
open="$(metric kvpool_open_puts)"; staging="$(metric kvpool_staging_bytes)"
[[ "${open}" == "0" && "${staging}" == "0" ]] && echo "ok: the pool holds no open put (staging 0) right after the exit" \
  || fail "the pool still holds ${open} open put(s), ${staging} staging bytes"
grep -q "kvpool-worker: stopped by SIGTERM: prefill: " "${work}/prefill.log" || fail "no final line naming SIGTERM"
python3 - "${work}" "${n}" <<'PY' || fail "prefill report / metrics"
import json, sys
w, n = sys.argv[1], int(sys.argv[2])
d = json.load(open(f"{w}/prefill.json"))
assert d["interrupted"] is True and d["interrupt_signal"] == "SIGTERM", d.get("interrupted")
assert len(d["prompts"]) == n, len(d["prompts"])
stored = [p for p in d["prompts"] if "blocks" in p]
interrupted = [p for p in d["prompts"] if p.get("interrupted")]
assert len(stored) >= 1 and len(interrupted) >= 1, (len(stored), len(interrupted))
assert len(stored) + len(interrupted) == n, d["overall"]
assert d["overall"]["interrupted_prompts"] == len(interrupted), d["overall"]
log = open(f"{w}/prefill.log").read()
assert log.count("I prefill ") == len(stored), (log.count("I prefill "), len(stored))
m = dict(l.split() for l in open(f"{w}/prefill.prom") if not l.startswith("#"))
assert int(m["kvpool_worker_prefill_interrupted_prompts_total"]) == len(interrupted), m
assert int(m["kvpool_worker_pushed_bytes_total"]) == d["overall"]["bytes_written"] > 0, m
print(f"ok: prefill report: {len(stored)} stored, {len(interrupted)} interrupted, metrics agree")
PY

echo "== prefill: SIGTERM while the pool is stopped (SIGSTOP): no put is said to be aborted"
aborts0="$(metric kvpool_put_aborts_total)"
"${worker_bin}" --role prefill "${common[@]}" "${prompts[@]}" --call-timeout-ms 1000 \
  --report "${work}/prefill_stopped.json" >/dev/null 2>"${work}/prefill_stopped.log" &
wpid=$!
wait_for "I prefill " "${work}/prefill_stopped.log" "${wpid}" || fail "no 'I prefill' line before the run ended"
kill -STOP "${server_pid}"
kill -TERM "${wpid}"; wait "${wpid}"; rc=$?; wpid=""
kill -CONT "${server_pid}"
[[ ${rc} -eq 143 ]] && echo "ok: prefill exit 143 with the pool stopped" || fail "prefill exit ${rc}, want 143"
aborts1="$(metric kvpool_put_aborts_total)"
python3 - "${work}" "${aborts0}" "${aborts1}" <<'PY' || fail "prefill report with the pool stopped"
import json, sys
w, a0, a1 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = json.load(open(f"{w}/prefill_stopped.json"))
reasons = [p["interrupt_reason"] for p in d["prompts"] if p.get("interrupted")]
said_aborted = [r for r in reasons if "its put was aborted" in r]
said_not = [r for r in reasons if "its AbortPut did not reach the pool" in r]
# The pool took no AbortPut while stopped: every open put's reason must say so.
assert a1 == a0, (a0, a1)
assert not said_aborted, said_aborted
assert said_not, reasons
print(f"ok: {len(said_not)} open put(s) reported as not aborted (the pool was stopped), none claimed aborted")
PY

echo "== decode: SIGTERM after the first answer, stdout into a file"
"${worker_bin}" --role decode "${common[@]}" "${prompts[@]}" --max-new-tokens 16 \
  --report "${work}/decode.json" --metrics-file "${work}/decode.prom" >"${work}/decode.out" 2>"${work}/decode.log" &
wpid=$!
if wait_for "^== " "${work}/decode.out" "${wpid}"; then
  echo "ok: an answer reached the file while the run went on"
else
  fail "no answer in stdout before the run ended"
fi
kill -TERM "${wpid}"; wait "${wpid}"; rc=$?; wpid=""
[[ ${rc} -eq 143 ]] && echo "ok: decode exit 143" || fail "decode exit ${rc}, want 143"
python3 - "${work}" "${n}" <<'PY' || fail "decode report / stdout"
import json, sys
w, n = sys.argv[1], int(sys.argv[2])
d = json.load(open(f"{w}/decode.json"))
assert d["interrupted"] is True and d["interrupt_signal"] == "SIGTERM"
served = len(d["prompts"])
printed = sum(1 for l in open(f"{w}/decode.out") if l.startswith("== "))
assert 1 <= served < n and printed == served, (served, printed, n)
assert d["prompts_not_run"] == n - served, d["prompts_not_run"]
m = dict(l.split() for l in open(f"{w}/decode.prom") if not l.startswith("#"))
assert int(m["kvpool_worker_requests_total"]) == served, m
assert int(m["kvpool_worker_requests_not_run_total"]) == n - served, m
print(f"ok: decode: {served} answers printed and reported, {n - served} not run")
PY

echo "== eval: SIGINT after the first prompt"
"${worker_bin}" --role eval --model "${model}" --rotations "${work}/rot.safetensors" "${prompts[@]}" \
  --max-new-tokens 8 --eval-windows 64:256 --report "${work}/eval.json" >"${work}/eval.out" 2>"${work}/eval.log" &
wpid=$!
wait_for "^== " "${work}/eval.out" "${wpid}" || fail "no eval output before the run ended"
kill -INT "${wpid}"; wait "${wpid}"; rc=$?; wpid=""
[[ ${rc} -eq 130 ]] && echo "ok: eval exit 130 on SIGINT" || fail "eval exit ${rc}, want 130"
python3 -c "
import json, sys
d = json.load(open('${work}/eval.json'))
assert d['interrupted'] is True and d['interrupt_signal'] == 'SIGINT', d.get('interrupted')
assert 1 <= len(d['prompts']) < ${n} and d['prompts_not_run'] == ${n} - len(d['prompts'])
print('ok: eval report marked interrupted by SIGINT')" || fail "eval report"

[[ ${failures} -eq 0 ]] && echo PASS || { echo "${failures} failure(s)" >&2; tail -5 "${work}/server.log" >&2; exit 1; }
