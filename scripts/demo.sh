#!/usr/bin/env bash
# kvpool demo: the main job end to end on the real stories260K model (docs/WORKER.md).
#   1. start a pool (kvpool-server, embedded defaults, UCX over loopback tcp)
#   2. calibrate OSCAR rotations on a calibration text (not the evaluation prompts)
#   3. in-process evaluation (no pool): float32 reference continuation; teacher-forced
#      agreement and perplexity ratio for history bf16 / int2 with S64/W256 and S16/W16
#   4. prefill node: computes the prompts and pushes their KV into the pool
#   5. decode worker: looks up, leases and fetches the cached prefix, recomputes the rest,
#      generates
#   6. stops everything and prints the report; JSON in BUILD_DIR/demo/report.json
# Usage: scripts/demo.sh BUILD_DIR
set -euo pipefail

build_dir="${1:-build}"
repo_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${build_dir}/bin"
data_dir="${KVPOOL_DATA_DIR:-${repo_dir}/../shared/data}"
model="${data_dir}/stories260K/stories260K-f32.gguf"
demo_src="${repo_dir}/worker/demo"
out="${build_dir}/demo"
max_new="${KVPOOL_DEMO_MAX_NEW:-48}"

# The directory holds this run's outputs only: a stage that fails must not leave the previous
# run's decode.txt, eval.txt or rotations.safetensors beside the new logs (only *.json and *.log
# were removed: newcomer s14 #3), nor a run refused before its first stage (missing binaries or
# model) the previous run's report (newcomer 16 F3: the checks came before the emptying).
rm -rf -- "${out}"
mkdir -p "${out}"

for b in kvpool-server kvpool-worker kvpool; do
  if [[ ! -x "${bin}/${b}" ]]; then
    echo "demo: ${bin}/${b} not found; build first (make build)" >&2
    exit 2
  fi
done
if [[ ! -f "${model}" ]]; then
  echo "demo: model not found at ${model} (set KVPOOL_DATA_DIR)" >&2
  exit 2
fi
pool_pid=""
stop_pool() {
  if [[ -n "${pool_pid}" ]]; then
    kill "${pool_pid}" 2>/dev/null || true
    wait "${pool_pid}" 2>/dev/null || true
    pool_pid=""
  fi
}
trap stop_pool EXIT INT TERM

now() { date +%s.%N; }
stage_json=""
# stage NAME STDOUT STDERR COMMAND... : runs COMMAND with its output into the two files ("" =
# not redirected; the same file twice = both into it) and records its wall time (in order). A
# failing stage ends the demo with its exit code after naming it, its log and the log's last
# lines (newcomer report 10 F6: 'make demo' ended with 'Error 2' and nothing else).
stage() {
  local name="$1" stdout="$2" stderr="$3"; shift 3
  local t0 rc=0; t0="$(now)"
  if [[ -z "${stdout}" ]]; then
    "$@" || rc=$?
  elif [[ "${stdout}" == "${stderr}" ]]; then
    "$@" >"${stdout}" 2>&1 || rc=$?
  else
    "$@" >"${stdout}" 2>"${stderr}" || rc=$?
  fi
  if [[ ${rc} -ne 0 ]]; then
    echo "demo: stage ${name} failed (exit ${rc}); see ${stderr:-the lines above}" >&2
    if [[ -n "${stderr}" && -s "${stderr}" ]]; then
      echo "demo: the last lines of ${stderr}:" >&2
      tail -n 8 "${stderr}" | sed 's/^/  | /' >&2
    fi
    exit "${rc}"
  fi
  stage_json+="\"${name}\": $(python3 -c "print(round($(now) - ${t0}, 3))"),"
}

prompt_args=()
for f in "${demo_src}"/prompts/*.txt; do prompt_args+=(--prompt-file "$f"); done
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
pool="127.0.0.1:${port}"
common=(--model "${model}" --rotations "${out}/rotations.safetensors")
gen=(--max-new-tokens "${max_new}")  # eval and decode generate; the prefill node does not

# Started when the kvpool-server it started says it is ready on ${pool}, and still runs: a port
# that merely answers may be another process's (one that took the port between the free-port
# probe and the bind), and a server that died must not be waited for.
start_pool() {
  "${bin}/kvpool-server" --listen "${pool}" --metrics-port -1 --ucx-tls tcp \
    >"${out}/pool.log" 2>&1 &
  pool_pid=$!
  local why="it did not say it was ready within 10 s"
  for _ in $(seq 1 100); do
    if ! kill -0 "${pool_pid}" 2>/dev/null; then
      local rc=0
      wait "${pool_pid}" || rc=$?
      pool_pid=""
      why="kvpool-server exited (code ${rc}) before it was ready"
      break
    fi
    if grep -q "kvpool-server ready: grpc ${pool} " "${out}/pool.log" 2>/dev/null; then
      return 0
    fi
    sleep 0.1
  done
  echo "demo: the pool did not start at ${pool}: ${why}; see ${out}/pool.log" >&2
  tail -n 8 "${out}/pool.log" | sed 's/^/  | /' >&2
  exit 2
}

echo "== kvpool demo: stories260K, $(ls "${demo_src}"/prompts/*.txt | wc -l) prompts, pool at ${pool}"
stage pool_start "" "" start_pool
echo "-- calibrating OSCAR rotations on worker/demo/calibration.txt"
stage calibrate "${out}/calibrate.log" "${out}/calibrate.log" \
  "${bin}/kvpool" calibrate --model "${model}" --text "${demo_src}/calibration.txt" \
  --out "${out}/rotations.safetensors"
echo "-- in-process evaluation (float32 reference; bf16/int2 x S64/W256, S16/W16)"
stage eval "${out}/eval.txt" "${out}/eval.log" \
  "${bin}/kvpool-worker" --role eval "${common[@]}" "${gen[@]}" "${prompt_args[@]}" --report "${out}/eval.json"
echo "-- prefill node -> pool"
stage prefill /dev/null "${out}/prefill.log" \
  "${bin}/kvpool-worker" --role prefill --pool "${pool}" "${common[@]}" "${prompt_args[@]}" \
  --report "${out}/prefill.json"
echo "-- pool -> decode worker"
stage decode "${out}/decode.txt" "${out}/decode.log" \
  "${bin}/kvpool-worker" --role decode --pool "${pool}" "${common[@]}" "${gen[@]}" "${prompt_args[@]}" \
  --report "${out}/decode.json"
stage pool_stop "" "" stop_pool

stage_json="{${stage_json%,}}"

python3 "${repo_dir}/scripts/demo_report.py" "${out}" "${stage_json}"
