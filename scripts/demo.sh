#!/usr/bin/env bash
# kvpool demo (initial version): runs the reference Llama engine on the real stories260K model,
# greedy from BOS, and prints the generated text (stdout) and tokens/second (from the engine's
# statistics on stderr). Later issues grow this into prefill → pool → decode.
# Usage: scripts/demo.sh BUILD_DIR
set -euo pipefail

build_dir="${1:-build}"
repo_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
engine="${build_dir}/bin/kvpool-engine"

# The model lives in the shared data directory beside the repository (KVPOOL_DATA_DIR).
data_dir="${KVPOOL_DATA_DIR:-${repo_dir}/../shared/data}"
model="${data_dir}/stories260K/stories260K-f32.gguf"

if [[ ! -x "${engine}" ]]; then
  echo "demo: ${engine} not found; build first (make build)" >&2
  exit 2
fi
if [[ ! -f "${model}" ]]; then
  echo "demo: model not found at ${model} (set KVPOOL_DATA_DIR)" >&2
  exit 2
fi

echo "== kvpool demo: reference engine, stories260K, greedy from BOS, 200 tokens =="
stats="$(mktemp)"
trap 'rm -f "${stats}"' EXIT
if ! "${engine}" generate --model "${model}" --max-tokens 200 --temperature 0 2>"${stats}"; then
  cat "${stats}" >&2
  exit 2
fi
echo
echo "== engine statistics =="
grep -E "prefill|tok/s" "${stats}" | sed -E 's/^[^ ]+ [A-Z] //'
