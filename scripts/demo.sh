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
mkdir -p "${out}"
rm -f "${out}"/*.json "${out}"/*.log

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
stage() {  # stage NAME COMMAND... : runs and records wall time (in order)
  local name="$1"; shift
  local t0; t0="$(now)"
  "$@"
  stage_json+="\"${name}\": $(python3 -c "print(round($(now) - ${t0}, 3))"),"
}

prompt_args=()
for f in "${demo_src}"/prompts/*.txt; do prompt_args+=(--prompt-file "$f"); done
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
pool="127.0.0.1:${port}"
common=(--model "${model}" --rotations "${out}/rotations.safetensors" --max-new-tokens "${max_new}")

start_pool() {
  "${bin}/kvpool-server" --listen "${pool}" --metrics-port -1 --ucx-tls tcp \
    >"${out}/pool.log" 2>&1 &
  pool_pid=$!
  for _ in $(seq 1 50); do
    if python3 -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1',${port})))"; then
      return 0
    fi
    sleep 0.1
  done
  echo "demo: the pool did not start; see ${out}/pool.log" >&2
  exit 2
}

echo "== kvpool demo: stories260K, $(ls "${demo_src}"/prompts/*.txt | wc -l) prompts, pool at ${pool}"
stage pool_start start_pool
echo "-- calibrating OSCAR rotations on worker/demo/calibration.txt"
stage calibrate "${bin}/kvpool" calibrate --model "${model}" --text "${demo_src}/calibration.txt" \
  --out "${out}/rotations.safetensors" >"${out}/calibrate.log" 2>&1
echo "-- in-process evaluation (float32 reference; bf16/int2 x S64/W256, S16/W16)"
stage eval "${bin}/kvpool-worker" --role eval "${common[@]}" "${prompt_args[@]}" \
  --report "${out}/eval.json" >"${out}/eval.txt" 2>"${out}/eval.log"
echo "-- prefill node -> pool"
stage prefill "${bin}/kvpool-worker" --role prefill --pool "${pool}" "${common[@]}" \
  "${prompt_args[@]}" --report "${out}/prefill.json" >/dev/null 2>"${out}/prefill.log"
echo "-- pool -> decode worker"
stage decode "${bin}/kvpool-worker" --role decode --pool "${pool}" "${common[@]}" \
  "${prompt_args[@]}" --report "${out}/decode.json" >"${out}/decode.txt" 2>"${out}/decode.log"
stage pool_stop stop_pool

stage_json="{${stage_json%,}}"

python3 "${repo_dir}/scripts/demo_report.py" "${out}" "${stage_json}"
