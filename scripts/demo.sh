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

python3 - "${out}" "${stage_json}" <<'PY'
import json, sys
out, stages = sys.argv[1], json.loads(sys.argv[2])
ev = json.load(open(f"{out}/eval.json"))
pre = json.load(open(f"{out}/prefill.json"))
dec = json.load(open(f"{out}/decode.json"))
bf16_tok = dec["bf16_bytes_per_token"]
def fmt(v, spec):  # agreement / ppl_ratio are null over no position (KVPOOL_DEMO_MAX_NEW=0)
    return "n/a" if v is None else format(v, spec)
configs = ["bf16_S64_W256", "int2_S64_W256", "bf16_S16_W16", "int2_S16_W16"]
pool_cfg = f"{dec['history_precision']}_S{dec['sink_tokens']}_W{dec['recent_tokens']}"
report = {"model": ev["model"], "pool_config": pool_cfg, "prompts": [], "stages_seconds": stages}
all_match = True
print()
for e, p, d in zip(ev["prompts"], pre["prompts"], dec["prompts"]):
    single = e["configs"][pool_cfg]["greedy_tokens"]
    match = d["tokens"] == single
    all_match &= match
    entry = {
        "name": e["name"], "prompt_tokens": e["prompt_tokens"],
        "reference_continuation": e["reference"]["text"],
        "pool_continuation": d["text"],
        "pool_matches_single_process": match,
        "teacher_forced": {c: {k: e["configs"][c][k] for k in ("agreement", "ppl_ratio", "positions")}
                           for c in configs},
        "pool_teacher_forced": d.get("teacher_forced"),
        "blocks": {"wanted": d["wanted_blocks"], "hit": d["hit_blocks"], "missed": d["missed_blocks"],
                   "loaded": d["loaded_blocks"], "bf16_fetched": d["bf16_blocks_fetched"],
                   "int2_fetched": d["int2_blocks_fetched"], "recomputed_tokens": d["recomputed_tokens"]},
        "bytes": {"pushed": p["bytes_written"], "moved": d["bytes_moved"],
                  "moved_bf16_equivalent": d["bf16_bytes_equivalent"], "stored": d["bytes_stored"],
                  "bf16_per_token": bf16_tok,
                  "stored_per_token": d["bytes_stored"] / max(1, d["hit_blocks"] * dec["page_size"]),
                  "moved_per_token": d["bytes_moved"] / max(1, d["loaded_blocks"] * dec["page_size"])},
        "fallback": d["fallback"], "fallback_reason": d["fallback_reason"],
    }
    report["prompts"].append(entry)
    print(f"== {e['name']} ({e['prompt_tokens']} prompt tokens)")
    print(f"   float32 reference : {e['reference']['text']!r}")
    print(f"   pool-served ({pool_cfg}): {d['text']!r}")
    b = entry["bytes"]
    print(f"   bytes/token: stored {b['stored_per_token']:.0f}, moved {b['moved_per_token']:.0f} "
          f"(BF16 {bf16_tok}); teacher-forced int2 S64/W256 agreement "
          f"{fmt(entry['teacher_forced']['int2_S64_W256']['agreement'], '.3f')}")
    print(f"   pool-served == same recipe in one process (no pool): {match}; "
          f"blocks hit {d['hit_blocks']}/{d['wanted_blocks']}"
          f"{'  FALLBACK: ' + d['fallback_reason'] if d['fallback'] else ''}")
ov = dec["overall"]
overall = {
    "teacher_forced": ev["overall"],
    "pool_teacher_forced": ov.get("teacher_forced"),
    "pool_matches_single_process": all_match,
    "blocks_hit": ov["hit_blocks"], "blocks_missed": ov["missed_blocks"],
    "blocks_loaded": ov["loaded_blocks"], "fallbacks": ov["fallbacks"],
    "bf16_bytes_per_token": bf16_tok,
    "bytes_pushed_per_token": pre["overall"]["bytes_written_per_token"],
    "bytes_stored_per_token": ov["bytes_stored_per_token"],
    "bytes_moved_per_token": ov["bytes_moved_per_token"],
    "stored_vs_bf16": ov["bytes_stored_per_token"] / bf16_tok,
    "moved_vs_bf16": ov["moved_vs_bf16"],
}
report["overall"] = overall
print("\n== teacher-forced vs float32 reference (all prompts; continuation tokens)")
print(f"   {'config':<16} {'agreement':>9} {'ppl ratio':>10} {'positions':>9}")
for c in configs:
    r = ev["overall"][c]
    print(f"   {c:<16} {fmt(r['agreement'], '.3f'):>9} {fmt(r['ppl_ratio'], '.4f'):>10} {r['positions']:>9}")
if ov.get("teacher_forced"):
    r = ov["teacher_forced"]
    print(f"   {'pool ' + pool_cfg:<16} {fmt(r['agreement'], '.3f'):>9} {fmt(r['ppl_ratio'], '.4f'):>10} {r['positions']:>9}")
print("\n== bytes per token (5 layers x 4 KV heads x head_dim 8; BF16 = %d B)" % bf16_tok)
print(f"   pushed (un-rotated BF16 staging) {overall['bytes_pushed_per_token']:.1f}")
print(f"   stored in the pool (all forms)  {overall['bytes_stored_per_token']:.1f}  ({overall['stored_vs_bf16']:.3f} x BF16)")
print(f"   moved to the decode worker      {overall['bytes_moved_per_token']:.1f}  ({overall['moved_vs_bf16']:.3f} x BF16)")
print(f"\n== blocks hit {overall['blocks_hit']}, missed {overall['blocks_missed']}, "
      f"loaded {overall['blocks_loaded']}, fallbacks {overall['fallbacks']}")
print("== wall time per stage (s): " + ", ".join(f"{k} {v}" for k, v in stages.items()))
json.dump(report, open(f"{out}/report.json", "w"), indent=2)
print(f"\nreport: {out}/report.json")
if not all_match:
    sys.exit("demo: the pool-served output differs from the single-process run")
PY
