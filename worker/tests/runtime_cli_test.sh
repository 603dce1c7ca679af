#!/usr/bin/env bash
# kvpool-worker command line: exit codes (0 ok, 1 usage, 2 runtime) and messages, and the
# decode worker's answer when the pool is unreachable (it computes the prefix itself, gives the
# single-process answer, and says so in its log, report and metrics).
# Usage: runtime_cli_test.sh WORKER KVPOOL_TOOL MODEL DEMO_DIR [PROMTOOL]
set -uo pipefail
worker="$1"; tool="$2"; model="$3"; demo="$4"; promtool="${5:-}"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
failures=0
expect() {  # expect RC DESCRIPTION -- COMMAND...
  local want="$1" what="$2"; shift 3
  "$@" >"${work}/out" 2>"${work}/err"
  local rc=$?
  if [[ ${rc} -ne ${want} ]]; then
    echo "FAIL: ${what}: exit ${rc}, want ${want}" >&2; cat "${work}/err" >&2
    failures=$((failures + 1))
  else
    echo "ok: ${what} (exit ${rc})"
  fi
}
expect_err() {  # expect_err PATTERN DESCRIPTION
  if ! grep -q -- "$1" "${work}/err" "${work}/out"; then
    echo "FAIL: $2: output lacks '$1'" >&2; cat "${work}/err" >&2; failures=$((failures + 1))
  fi
}

"${tool}" calibrate --model "${model}" --text "${demo}/calibration.txt" \
  --out "${work}/rot.safetensors" >/dev/null 2>&1 || { echo "calibrate failed" >&2; exit 1; }
prompt=(--prompt-file "${demo}/prompts/01_kite.txt")
model_flags=(--model "${model}" --rotations "${work}/rot.safetensors")
base=("${model_flags[@]}" --max-new-tokens 16)

expect 0 "--help" -- "${worker}" --help
expect_err "--history-precision" "--help lists the flags"
# The default as WORKER.md writes it (newcomer report 11 F8: "--teacher-force BOOLEAN=1").
expect_err "--teacher-force BOOLEAN=true" "--help shows --teacher-force's default as true"
expect 0 "--version" -- "${worker}" --version
# --help wins over a bad value of another flag, as --version does (newcomer s14 #1: "--pool bad
# --help" exited 1 with --pool's error).
expect 0 "--help after a bad --pool" -- "${worker}" --pool bad --help
expect_err "--history-precision" "--help after a bad --pool prints the help"
expect 0 "-h before a bad --fault" -- "${worker}" -h --fault meteor
expect_err "--history-precision" "-h before a bad --fault prints the help"
expect 1 "missing --role" -- "${worker}" "${base[@]}" "${prompt[@]}"
expect 1 "unknown role" -- "${worker}" --role train "${base[@]}" "${prompt[@]}"
expect 1 "bad history precision" -- "${worker}" --role eval --history-precision int3 "${base[@]}" "${prompt[@]}"
expect 1 "sink not a multiple of the page size" -- "${worker}" --role decode --pool 127.0.0.1:1 --sink-tokens 40 "${base[@]}" "${prompt[@]}"
expect_err "sink_tokens" "the message names the field"
expect_err "kvpool-worker: --sink-tokens: " "the message names the flag, with the program prefix"
expect 1 "page size not a power of two" -- "${worker}" --role eval --page-size 12 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --page-size: page_size 12 must be a power of two" "the message names --page-size"
expect 1 "page size beyond 1024" -- "${worker}" --role eval --page-size 1048576 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --page-size: 1048576 is outside 1..1024" "a huge page size names --page-size, not --sink-tokens"
# A block longer than the model's context is never full: nothing would reach the pool (newcomer 17
# F6: --page-size 1024 on the 512-token model ran with "0/0 blocks from the pool" everywhere).
expect 1 "page size beyond the model's context" -- "${worker}" --role decode --pool 127.0.0.1:1 --page-size 1024 --sink-tokens 0 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --page-size: 1024 exceeds the model's context of 512 tokens" "the message names --page-size and the context"
# Newcomer 18 F5: with the default sink (64) the same page size was blamed on --sink-tokens.
expect 1 "page size beyond the context, default sink" -- "${worker}" --role decode --pool 127.0.0.1:1 --page-size 1024 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --page-size: 1024 exceeds the model's context of 512 tokens" "the default sink does not take the blame"
# Integer flags are plain decimal (newcomer 16 F2): CLI11 alone read --recent-tokens 0100 as octal
# 64 (registered W=64), --page-size 016 as 14, and took 0x10, +16 and ' 16'; on the command line
# and from a --config file, quoted or not.
for flag in --page-size --sink-tokens --recent-tokens --fault-pool-pid; do
  for v in 0100 0x10 +16 " 16"; do
    expect 1 "${flag} '${v}'" -- "${worker}" --role decode --pool 127.0.0.1:1 "${flag}" "${v}" "${base[@]}" "${prompt[@]}"
    expect_err "kvpool-worker: ${flag}: '${v}' is not " "${flag} '${v}' is refused naming the flag"
  done
done
printf 'recent-tokens: 0100\n' >"${work}/octal.yaml"
printf 'sink-tokens: "0200"\n' >"${work}/octal_quoted.yaml"
printf 'page-size: 0x10\n' >"${work}/hex.yaml"
for f in octal octal_quoted hex; do
  expect 1 "${f} integer in a --config file" -- "${worker}" --config "${work}/${f}.yaml" --role decode --pool 127.0.0.1:1 "${base[@]}" "${prompt[@]}"
  expect_err "kvpool-worker: --config '${work}/${f}.yaml' key \"[a-z-]*\": --[a-z-]*: '0[x0-9]*' is not " "the ${f} value is refused naming the file, the key and the flag"
done
expect 1 "negative recent window" -- "${worker}" --role prefill --recent-tokens -1 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --recent-tokens: " "the message names --recent-tokens"
# Each role is checked on the flags it uses (newcomer s9 A10): eval ignores --sink-tokens and
# --recent-tokens (the default S 64 refused --page-size 256), naming one given explicitly;
# prefill and decode ignore --eval-windows.
expect 0 "eval with --page-size 256 and its own windows" -- "${worker}" --role eval --page-size 256 --eval-windows 256:256 "${model_flags[@]}" --max-new-tokens 2 "${prompt[@]}"
if grep -q "ignored" "${work}/err"; then echo "FAIL: a warning about a flag not given" >&2; failures=$((failures + 1)); fi
expect 0 "eval with an explicit --sink-tokens that is no recipe" -- "${worker}" --role eval --sink-tokens 40 --eval-windows 0:0 "${model_flags[@]}" --max-new-tokens 2 "${prompt[@]}"
expect_err "W --sink-tokens is ignored by --role eval (eval compares the S:W pairs of --eval-windows)" "the ignored flag is named"
expect 1 "decode: a bad --eval-windows is not checked, but --sink-tokens is" -- "${worker}" --role decode --pool 127.0.0.1:1 --sink-tokens 40 --eval-windows 1:x "${base[@]}" "${prompt[@]}"
expect_err "W --eval-windows is ignored by --role decode" "the ignored flag is named"
expect_err "kvpool-worker: --sink-tokens: " "and the used one is checked"
# Flags a role ignores, given explicitly, are named (newcomer s9b #5: eval ignored --metrics-file
# silently).
expect 0 "eval with --metrics-file and --pool" -- "${worker}" --role eval --eval-windows 0:0 --metrics-file "${work}/eval.prom" --pool 127.0.0.1:1 "${model_flags[@]}" --max-new-tokens 2 "${prompt[@]}"
expect_err "W --metrics-file is ignored by --role eval (it is for --role prefill and decode)" "eval names the ignored --metrics-file"
expect_err "W --pool is ignored by --role eval (it is for --role prefill and decode)" "eval names the ignored --pool"
[[ ! -e "${work}/eval.prom" ]] || { echo "FAIL: eval wrote --metrics-file" >&2; failures=$((failures + 1)); }
expect 1 "decode: ignored flags are named" -- "${worker}" --role decode --pool 127.0.0.1:1 --put-timeout-ms 5 --sink-tokens 40 "${base[@]}" "${prompt[@]}"
expect_err "W --put-timeout-ms is ignored by --role decode (it is for --role prefill)" "decode names the ignored --put-timeout-ms"
# Every report names the model and rotation files by hash, eval's too (newcomer s10 #13).
expect 0 "eval report with the model and rotation hashes" -- "${worker}" --role eval "${model_flags[@]}" --max-new-tokens 1 --eval-windows 0:0 --report "${work}/hash_eval.json" "${prompt[@]}"
"${worker}" --role decode --pool 127.0.0.1:1 "${model_flags[@]}" --max-new-tokens 1 --teacher-force false --report "${work}/hash_decode.json" "${prompt[@]}" >/dev/null 2>&1
python3 - "${work}" "${model}" <<'PY' || { echo "FAIL: model_sha256 / rotation_id in the eval and decode reports" >&2; failures=$((failures + 1)); }
import hashlib, json, sys
w, model = sys.argv[1], sys.argv[2]
want_m = hashlib.sha256(open(model, "rb").read()).hexdigest()
want_r = hashlib.sha256(open(f"{w}/rot.safetensors", "rb").read()).hexdigest()
for role in ("eval", "decode"):
    d = json.load(open(f"{w}/hash_{role}.json"))
    assert d["model_sha256"] == want_m and d["rotation_id"] == want_r, (role, d.get("model_sha256"), d.get("rotation_id"))
print("ok: eval and decode reports carry model_sha256 and rotation_id")
PY
# Each prompt entry of a report carries its --prompt-file as given (`path`): `name` is the file's
# name only, so d1/same.txt and d2/same.txt were both just "same" (newcomer s14 #4).
mkdir -p "${work}/d1" "${work}/d2"
cp "${demo}/prompts/01_kite.txt" "${work}/d1/same.txt"
cp "${demo}/prompts/01_kite.txt" "${work}/d2/same.txt"
same=(--prompt-file "${work}/d1/same.txt" --prompt-file "${work}/d2/same.txt")
expect 0 "eval report of two prompts with one name" -- "${worker}" --role eval "${model_flags[@]}" --max-new-tokens 1 --eval-windows 0:0 --report "${work}/same_eval.json" "${same[@]}"
expect 0 "decode report of two prompts with one name" -- "${worker}" --role decode --pool 127.0.0.1:1 "${model_flags[@]}" --max-new-tokens 1 --teacher-force false --report "${work}/same_decode.json" "${same[@]}"
python3 - "${work}" <<'PY' || { echo "FAIL: the prompts' path in the eval and decode reports" >&2; failures=$((failures + 1)); }
import json, sys
w = sys.argv[1]
for role in ("eval", "decode"):
    d = json.load(open(f"{w}/same_{role}.json"))
    got = [(p["name"], p.get("path")) for p in d["prompts"]]
    want = [("same", f"{w}/d1/same.txt"), ("same", f"{w}/d2/same.txt")]
    assert got == want, (role, got)
print("ok: eval and decode reports name each prompt's --prompt-file by its path")
PY
# A closed stdout (a pipe into head) stops decode and eval like SIGTERM, as SIGPIPE: report,
# metrics and a last line, exit 141 (newcomer s10 F2: killed by SIGPIPE with none of them).
five=(); for f in "${demo}"/prompts/0*.txt; do five+=(--prompt-file "${f}"); done
"${worker}" --role decode --pool 127.0.0.1:1 "${model_flags[@]}" "${five[@]}" --max-new-tokens 4 \
  --teacher-force false --report "${work}/pipe.json" --metrics-file "${work}/pipe.prom" 2>"${work}/err" | head -1 >/dev/null
rc=${PIPESTATUS[0]}
[[ ${rc} -eq 141 ]] && echo "ok: decode into a closed pipe (exit 141)" || { echo "FAIL: decode into a closed pipe: exit ${rc}, want 141" >&2; failures=$((failures + 1)); }
expect_err "kvpool-worker: stopped by SIGPIPE (standard output was closed): decode: " "the last line names SIGPIPE"
python3 - "${work}" <<'PY' || { echo "FAIL: decode report / metrics after a closed stdout" >&2; failures=$((failures + 1)); }
import json, sys
w = sys.argv[1]
d = json.load(open(f"{w}/pipe.json"))
assert d["interrupted"] is True and d["interrupt_signal"] == "SIGPIPE", d.get("interrupt_signal")
assert 1 <= len(d["prompts"]) < 5 and d["prompts_not_run"] == 5 - len(d["prompts"]), d["prompts_not_run"]
m = dict(l.split() for l in open(f"{w}/pipe.prom") if not l.startswith("#"))
assert int(m["kvpool_worker_requests_total"]) == len(d["prompts"]), m
print(f"ok: decode report and metrics after a closed stdout: {len(d['prompts'])} served")
PY
"${worker}" --role eval "${model_flags[@]}" "${five[@]}" --max-new-tokens 2 --eval-windows 64:256 \
  --report "${work}/pipe_eval.json" 2>"${work}/err" | head -1 >/dev/null
rc=${PIPESTATUS[0]}
[[ ${rc} -eq 141 ]] && echo "ok: eval into a closed pipe (exit 141)" || { echo "FAIL: eval into a closed pipe: exit ${rc}, want 141" >&2; failures=$((failures + 1)); }
python3 -c "
import json
d = json.load(open('${work}/pipe_eval.json'))
assert d['interrupted'] is True and d['interrupt_signal'] == 'SIGPIPE' and d['prompts_not_run'] >= 1, d.get('interrupt_signal')
print('ok: eval report after a closed stdout')" || { echo "FAIL: eval report after a closed stdout" >&2; failures=$((failures + 1)); }
# The registered identity is checked before any work, naming where a default came from (newcomer
# s10 F5: a model file named "my model ü.gguf" failed at the registration, exit 2, or made decode
# fall back silently).
ln -s "${model}" "${work}/my model ü.gguf"
for r in prefill decode; do
  expect 1 "${r}: a default --model-id that is not printable ASCII" -- "${worker}" --role "${r}" --pool 127.0.0.1:1 --model "${work}/my model ü.gguf" --rotations "${work}/rot.safetensors" "${prompt[@]}"
  expect_err "kvpool-worker: --model-id: 'my model ü' (the default: the --model file's name without its extension) has byte 9 (0xc3), which is not printable ASCII" "the message names --model-id and its default"
done
expect 1 "an explicit --revision that is not printable ASCII" -- "${worker}" --role decode --pool 127.0.0.1:1 --revision "r$(printf '\t')1" "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --revision: " "the message names --revision"
expect 0 "eval takes any --model file name (it registers nothing)" -- "${worker}" --role eval --model "${work}/my model ü.gguf" --rotations "${work}/rot.safetensors" --max-new-tokens 1 --eval-windows 0:0 "${prompt[@]}"
# eval ignores --fault and --fault-pool-pid: named, not checked (newcomer s10 F9).
sleep 30 & sleeper2=$!
expect 0 "eval with a pool fault hook and a pid that is not kvpool-server" -- "${worker}" --role eval --fault kill-pool-mid-fetch --fault-pool-pid "${sleeper2}" --max-new-tokens 1 --eval-windows 0:0 "${model_flags[@]}" "${prompt[@]}"
expect_err "W --fault-pool-pid is ignored by --role eval" "the ignored hook is named"
kill "${sleeper2}"; wait "${sleeper2}" 2>/dev/null
# --eval-windows pairs are plain decimal, as the integer flags (newcomer s9b #7: +256 and 0256 ran).
for bad in +256:0 0256:0 256:+0 256:00 " 256:0" 0x100:0; do
  expect 1 "eval window '${bad}'" -- "${worker}" --role eval --page-size 256 --eval-windows "${bad}" "${base[@]}" "${prompt[@]}"
  expect_err "kvpool-worker: --eval-windows: '${bad}' is not S:W (two non-negative decimal integers" "the message names the pair"
done
expect 1 "non-numeric eval window" -- "${worker}" --role eval --eval-windows 64:x "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --eval-windows" "the message names --eval-windows"
expect 1 "eval window out of int range" -- "${worker}" --role eval --eval-windows 99999999999:16 "${base[@]}" "${prompt[@]}"
expect 1 "eval window not S:W" -- "${worker}" --role eval --eval-windows 64 "${base[@]}" "${prompt[@]}"
expect 1 "bad fault" -- "${worker}" --role decode --fault meteor "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --fault: " "the message names --fault, with the program prefix"
# --fault is checked by the flag (newcomer s14 #2): --help lists the choices, and a --config
# file's bad value is named with the file and the key, as every other flag's.
expect 0 "--help lists --fault's choices" -- "${worker}" --help
expect_err "--fault TEXT:{none,prefill-exit-mid-push,kill-pool-mid-fetch,stop-pool-after-register,kill-pool-after-first-commit,commit-answer-lost}" "--help lists --fault's choices"
printf 'fault: meteor\n' >"${work}/fault.yaml"
expect 1 "bad fault in a --config file" -- "${worker}" --config "${work}/fault.yaml" --role decode "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --config '${work}/fault.yaml' key \"fault\": --fault: meteor not in {none," "the message names the file, the key and the flag"
for bad in 127.0.0.1:99999 127.0.0.1:0 127.0.0.1 :7070 127.0.0.1: 127.0.0.1:x7; do
  expect 1 "--pool ${bad} refused" -- "${worker}" --role decode --pool "${bad}" "${base[@]}" "${prompt[@]}"
  expect_err "kvpool-worker: --pool: " "the message names --pool (${bad})"
done
expect 1 "sink window beyond the context" -- "${worker}" --role decode --sink-tokens 100000 --recent-tokens 100000 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --sink-tokens: 100000 exceeds the model's context of 512 tokens" "the message names --sink-tokens and the context"
expect 1 "recent window beyond the context" -- "${worker}" --role decode --pool 127.0.0.1:1 --recent-tokens 100000 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --recent-tokens: 100000 exceeds" "the message names --recent-tokens"
expect 1 "eval window not a recipe (sink 8 with P=16)" -- "${worker}" --role eval --eval-windows 8:8 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --eval-windows: 8:8: sink_tokens 8" "the message names --eval-windows and the window"
if grep -q "fp32 reference" "${work}/out"; then echo "FAIL: --eval-windows 8:8 computed before refusing" >&2; failures=$((failures + 1)); fi
expect 1 "eval window beyond the context" -- "${worker}" --role eval --eval-windows 64:4096 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --eval-windows: 64:4096: exceeds" "the message names --eval-windows"
expect 1 "kill-pool-mid-fetch without --fault-pool-pid" -- "${worker}" --role decode --fault kill-pool-mid-fetch "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --fault-pool-pid: " "the message names --fault-pool-pid"
expect 1 "kill-pool-after-first-commit without --fault-pool-pid" -- "${worker}" --role prefill --fault kill-pool-after-first-commit "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --fault-pool-pid: kill-pool-after-first-commit needs the pool's pid" "the message names --fault-pool-pid"
# The pool faults signal only a kvpool-server (an unrelated sleep was SIGKILLed: newcomer s9 A8).
sleep 300 &
sleeper=$!
expect 1 "--fault-pool-pid of a process that is not kvpool-server" -- "${worker}" --role decode --pool 127.0.0.1:1 --fault kill-pool-mid-fetch --fault-pool-pid "${sleeper}" "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --fault-pool-pid: ${sleeper} is 'sleep' (/proc/${sleeper}/comm), not kvpool-server: kill-pool-mid-fetch signals only a kvpool-server" "the message names the flag and the process"
expect 1 "stop-pool-after-register with a pid that is not kvpool-server" -- "${worker}" --role decode --pool 127.0.0.1:1 --fault stop-pool-after-register --fault-pool-pid "${sleeper}" "${base[@]}" "${prompt[@]}"
[[ "$(cut -d' ' -f3 "/proc/${sleeper}/stat" 2>/dev/null)" == S ]] || { echo "FAIL: the sleep was signalled" >&2; failures=$((failures + 1)); }
kill "${sleeper}"; wait "${sleeper}" 2>/dev/null
expect 1 "--fault-pool-pid of no process" -- "${worker}" --role prefill --fault kill-pool-after-first-commit --fault-pool-pid "${sleeper}" "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --fault-pool-pid: ${sleeper} is no process of this host, not kvpool-server" "the message says there is no such process"
# A repeated pair wrote its key twice into one JSON object (newcomer s7 F8).
expect 1 "a repeated --eval-windows pair" -- "${worker}" --role eval --eval-windows 64:256,16:16,64:256 "${base[@]}" "${prompt[@]}" --report "${work}/dupw.json"
expect_err "kvpool-worker: --eval-windows: 64:256 is given twice ('64:256,16:16,64:256'); give each S:W pair once" "the message names the pair"
[[ ! -e "${work}/dupw.json" ]] || { echo "FAIL: a repeated --eval-windows pair wrote a report" >&2; failures=$((failures + 1)); }
# A pair spelt differently (016:16) was caught as a repeat; such spellings are refused now.
expect 1 "a repeated --eval-windows pair, spelt differently" -- "${worker}" --role eval --eval-windows 16:16,016:16 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --eval-windows: '016:16' is not S:W" "the leading zero is refused"
# An output that is an input (another spelling, a symlink, a hard link), the --config file or
# the other output is refused before any work, naming both flags (newcomer s7 F7).
cp "${demo}/prompts/01_kite.txt" "${work}/kite.txt"
ln -s kite.txt "${work}/kite-link.txt"; ln "${work}/rot.safetensors" "${work}/rot-hard.safetensors"
kite_sum="$(sha256sum <"${work}/kite.txt")"; rot_sum="$(sha256sum <"${work}/rot.safetensors")"
expect 1 "--report is the --prompt-file" -- "${worker}" --role eval "${base[@]}" --prompt-file "${work}/kite.txt" --report "${work}/kite.txt"
expect_err "kvpool-worker: --report: '${work}/kite.txt' is the same file as --prompt-file '${work}/kite.txt'; writing it would replace that input" "the message names both flags"
expect 1 "--metrics-file links to the --prompt-file" -- "${worker}" --role decode --pool 127.0.0.1:1 "${base[@]}" --prompt-file "${work}/kite.txt" --metrics-file "${work}/kite-link.txt"
expect_err "kvpool-worker: --metrics-file: '${work}/kite-link.txt' is the same file as --prompt-file" "a symlink to an input is refused"
expect 1 "--report is a hard link to --rotations" -- "${worker}" --role eval "${model_flags[@]}" "${prompt[@]}" --report "${work}/rot-hard.safetensors"
expect_err "kvpool-worker: --report: '${work}/rot-hard.safetensors' is the same file as --rotations" "a hard link to an input is refused"
# (A copy: a worker without the check would write its report over the model given.)
cp "${model}" "${work}/model-copy.gguf"
expect 1 "--report is the --model" -- "${worker}" --role eval --model "${work}/model-copy.gguf" --rotations "${work}/rot.safetensors" "${prompt[@]}" --report "${work}/model-copy.gguf"
expect_err "kvpool-worker: --report: '${work}/model-copy.gguf' is the same file as --model" "the model is refused as an output"
cmp -s "${model}" "${work}/model-copy.gguf" || { echo "FAIL: the --model copy was replaced" >&2; failures=$((failures + 1)); }
expect 1 "--report and --metrics-file one file" -- "${worker}" --role decode --pool 127.0.0.1:1 "${base[@]}" "${prompt[@]}" --report "${work}/same.out" --metrics-file "${work}/./same.out"
expect_err "kvpool-worker: --metrics-file: '${work}/./same.out' is the same file as --report '${work}/same.out'; one would overwrite the other" "two outputs on one file are refused"
# Relative paths in a --config file are taken from the current directory, and a missing one
# says so (newcomer s9 A12).
mkdir -p "${work}/cfgdir"
printf 'role: eval\nmodel: ../kvpool-no-such-model.gguf\nrotations: %s\nprompt-file: %s\n' "${work}/rot.safetensors" "${demo}/prompts/01_kite.txt" >"${work}/cfgdir/rel.yaml"
expect 2 "a relative --model in a --config file that is not there" -- bash -c "cd '${work}' && '${worker}' --config cfgdir/rel.yaml"
expect_err "kvpool-worker: --model: NOT_FOUND: ../kvpool-no-such-model.gguf: cannot open: No such file or directory (relative to the current directory ${work})" "the message names the directory the path was taken from"
printf 'max-new-tokens: 1\n' >"${work}/w.yaml"
expect 1 "--report is the --config file" -- "${worker}" --config "${work}/w.yaml" --role eval "${model_flags[@]}" "${prompt[@]}" --report "${work}/w.yaml"
expect_err "kvpool-worker: --report: '${work}/w.yaml' is the same file as --config '${work}/w.yaml'" "the config file is refused as an output"
[[ "$(sha256sum <"${work}/kite.txt")" == "${kite_sum}" && "$(sha256sum <"${work}/rot.safetensors")" == "${rot_sum}" && -L "${work}/kite-link.txt" && ! -e "${work}/same.out" && "$(cat "${work}/w.yaml")" == "max-new-tokens: 1" ]] \
  || { echo "FAIL: an input was replaced" >&2; failures=$((failures + 1)); }
if grep -q "fp32 reference" "${work}/out"; then echo "FAIL: the run started before refusing the output" >&2; failures=$((failures + 1)); fi
expect 1 "--report into a missing directory" -- "${worker}" --role eval "${base[@]}" "${prompt[@]}" --report "${work}/no/such/dir/r.json"
expect_err "kvpool-worker: --report: directory '${work}/no/such/dir' of " "the message names --report and the directory"
expect 1 "--metrics-file into a missing directory" -- "${worker}" --role decode --pool 127.0.0.1:1 "${base[@]}" "${prompt[@]}" --metrics-file "${work}/none/m.prom"
expect_err "kvpool-worker: --metrics-file: directory" "the message names --metrics-file"
# Outputs are checked before the run: a device node, a directory no file can be created in.
expect 1 "--report /dev/null" -- "${worker}" --role eval "${base[@]}" "${prompt[@]}" --report /dev/null
expect_err "kvpool-worker: --report: '/dev/null' is a character device, not a regular file" "the message names --report and the kind of file"
expect 1 "--metrics-file /dev/null" -- "${worker}" --role decode --pool 127.0.0.1:1 "${base[@]}" "${prompt[@]}" --metrics-file /dev/null
expect_err "kvpool-worker: --metrics-file: '/dev/null' is a character device" "the message names --metrics-file"
expect 1 "--report into /proc" -- "${worker}" --role eval "${base[@]}" "${prompt[@]}" --report /proc/r.json
expect_err "kvpool-worker: --report: cannot create a file in directory '/proc' of '/proc/r.json': " "the message names --report, the directory and why"
if grep -q "fp32 reference" "${work}/out"; then echo "FAIL: --report /proc/r.json ran before refusing" >&2; failures=$((failures + 1)); fi
# Prompt files: a directory and an empty file are refused (they read as a BOS-only prompt).
expect 1 "--prompt-file a directory" -- "${worker}" --role eval "${base[@]}" --prompt-file /tmp
expect_err "kvpool-worker: --prompt-file: '/tmp' is a directory; name a file" "the message names --prompt-file"
# Input files are read only when regular and at most their limit (docs/WORKER.md "Input files"):
# a device read forever (/dev/zero ran out of memory), a FIFO blocked in open().
expect 1 "--prompt-file /dev/null" -- "${worker}" --role eval "${base[@]}" --prompt-file /dev/null
expect_err "kvpool-worker: --prompt-file: '/dev/null' is a character device, not a regular file" "the message names --prompt-file and the kind of file"
expect 1 "--prompt-file /dev/zero" -- timeout 20 "${worker}" --role eval "${base[@]}" --prompt-file /dev/zero
expect_err "kvpool-worker: --prompt-file: '/dev/zero' is a character device, not a regular file" "the message names --prompt-file"
mkfifo "${work}/fifo"
expect 1 "--prompt-file a FIFO" -- timeout 20 "${worker}" --role eval "${base[@]}" --prompt-file "${work}/fifo"
expect_err "kvpool-worker: --prompt-file: '${work}/fifo' is a FIFO, not a regular file" "the message names --prompt-file"
truncate -s 65M "${work}/big.txt"
expect 1 "--prompt-file above 64 MiB" -- timeout 20 "${worker}" --role eval "${base[@]}" --prompt-file "${work}/big.txt"
expect_err "kvpool-worker: --prompt-file: '${work}/big.txt' is 65 MiB (68157440 bytes), above the limit of 64 MiB" "the message names the limit"
: >"${work}/empty.txt"
expect 1 "--prompt-file an empty file" -- "${worker}" --role decode --pool 127.0.0.1:1 "${base[@]}" --prompt-file "${work}/empty.txt"
expect_err "'${work}/empty.txt' has no tokens" "the message names the file"
# Prompt length (docs/WORKER.md "Prompt length"; kvpool-engine applies the same rule): at most
# context - 1 = 511 tokens, BOS included; the text of N tokens is "Once" + " upon" x (N - 2).
python3 - "${work}" <<'PY'
import sys
for n in (511, 512):
    open(f"{sys.argv[1]}/prompt{n}.txt", "w").write("Once" + " upon" * (n - 2))
PY
expect 0 "a 511-token prompt (context 512)" -- "${worker}" --role eval "${model_flags[@]}" --eval-windows 64:256 --max-new-tokens 1 --prompt-file "${work}/prompt511.txt" --report "${work}/p511.json"
python3 - "${work}/p511.json" "$(basename "${model}" .gguf)" <<'PY' || failures=$((failures + 1))
import json, sys
d = json.load(open(sys.argv[1]))
p = d["prompts"][0]
assert p["prompt_tokens"] == 511, p["prompt_tokens"]
print("ok: 511-token prompt accepted")
# --model-id defaults to the --model file's stem, not a fixed "stories260K" (newcomer s6 #10).
assert d["model"] == sys.argv[2], (d["model"], sys.argv[2])
print("ok: default --model-id is the model file's stem")
PY
expect 1 "a 512-token prompt (context 512) is a usage error" -- "${worker}" --role eval "${base[@]}" --prompt-file "${work}/prompt512.txt"
expect_err "kvpool-worker: --prompt-file: '${work}/prompt512.txt' is 512 tokens long; a prompt may hold at most 511" "the message gives the length and the limit"
# A file whose byte size alone puts it beyond the limit is refused before it is tokenized (a
# 30 MB prompt took 28 s and 1.2 GB to be refused: newcomer s9 A3).
python3 -c "import sys; open(sys.argv[1], 'w').write(open(sys.argv[2]).read() * 4000)" "${work}/huge.txt" "${demo}/prompts/01_kite.txt"
expect 1 "a prompt file too long by its byte size alone" -- "${worker}" --role eval "${base[@]}" --prompt-file "${work}/huge.txt"
expect_err "kvpool-worker: --prompt-file: '${work}/huge.txt' is $(stat -c %s "${work}/huge.txt") bytes, so at least " "the message gives the bytes"
expect_err "; a prompt may hold at most 511 (the model's context of 512" "the message gives the limit"
# A fatal error reaches stderr whatever --log-level says.
expect 2 "missing model with --log-level off" -- "${worker}" --log-level off --role eval --model /nope.gguf --rotations "${work}/rot.safetensors" "${prompt[@]}"
expect_err "kvpool-worker: --model: " "the fatal error is printed with --log-level off"
expect 2 "prefill without a pool, --log-level off" -- "${worker}" --log-level off --role prefill --pool 127.0.0.1:1 --call-timeout-ms 300 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: pool 127.0.0.1:1: UNAVAILABLE: " "the pool failure is printed with --log-level off"
expect 1 "empty --revision" -- "${worker}" --role decode --revision "" "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --revision: must not be empty" "the message names --revision"
# An explicit empty --model-id fell back to the file-stem default silently (newcomer s8 N3).
expect 1 "empty --model-id" -- "${worker}" --role prefill --pool 127.0.0.1:1 --model-id "" "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --model-id: must not be empty" "the message names --model-id"
printf 'model-id: ""\n' > "${work}/empty-id.yaml"
expect 1 "empty model-id in --config" -- "${worker}" --config "${work}/empty-id.yaml" --role prefill --pool 127.0.0.1:1 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --config '${work}/empty-id.yaml' key \"model-id\": --model-id: must not be empty" "the message names the file, the key and the flag"
# A bracketed IPv6 host without a port said "unbalanced or empty IPv6 brackets" (newcomer s8 N5).
expect 1 "--pool [::1] (no port)" -- "${worker}" --role decode --pool "[::1]" "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --pool: '\[::1\]' has no port (want \[::1\]:PORT)" "the message says the port is missing"
printf 'pool: "[::1]"\n' > "${work}/pool.yaml"
expect 1 "pool: [::1] in --config" -- "${worker}" --config "${work}/pool.yaml" --role decode "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --config '${work}/pool.yaml' key \"pool\": --pool: '\[::1\]' has no port" "the message names the file and the key"
# A GGUF context_length of 2^24 (the reader's bound) was refused as "capacity 16777216 must be
# in [1, 2^20]" and the fp32 reference allocated the whole context (newcomer s8 N12): it runs now,
# under a 3 GB address-space limit (skipped under AddressSanitizer).
python3 "$(dirname "$0")/gguf_with_context_length.py" "${model}" "${work}/ctx24.gguf" $((1 << 24))
if ldd "${worker}" 2>/dev/null | grep -q libasan; then
  echo "skip: context 2^24 (AddressSanitizer build)"
else
  expect 0 "eval with a context_length of 2^24 under a 3 GB address-space limit" -- bash -c 'ulimit -v 3000000; exec "$@"' _ "${worker}" --role eval --model "${work}/ctx24.gguf" --rotations "${work}/rot.safetensors" "${prompt[@]}" --max-new-tokens 2 --eval-windows 64:256
  expect_err "int2_S64_W256" "the eval ran"
fi
# A model whose weights are all zero (same shape: the rotation file fits) has logits that are
# all equal: eval reported agreement 1.0 with <unk> continuations and exit 0 (newcomer s10b F4).
python3 "$(dirname "$0")/gguf_zero_weights.py" "${model}" "${work}/zero.gguf"
expect 2 "eval with a model whose weights are zero" -- "${worker}" --role eval --model "${work}/zero.gguf" --rotations "${work}/rot.safetensors" "${prompt[@]}" --max-new-tokens 2 --eval-windows 64:256
expect_err "logits is 0 (the model is degenerate" "the message says the model is degenerate"
# llama.block_count 4 over the tensors of 5 layers ran 4 layers (newcomer report 11 F1).
python3 "$(dirname "$0")/gguf_set_u32.py" "${model}" "${work}/layers4.gguf" llama.block_count 4
expect 2 "eval with a model holding a layer its metadata does not describe" -- "${worker}" --role eval --model "${work}/layers4.gguf" --rotations "${work}/rot.safetensors" "${prompt[@]}" --max-new-tokens 2 --eval-windows 64:256
expect_err "tensor 'blk.4.attn_q.weight' belongs to layer 4, beyond the layers the metadata describes (llama.block_count 4" "the message names the tensor and the key"
# A rotation file calibrated for another model name (same geometry) was used without a word
# (newcomer report 11 F2): the name is advisory, so it is warned about, once; the run goes on.
python3 - "${work}/rot.safetensors" "${work}/rot-other-name.safetensors" <<'PY'
import sys
b = open(sys.argv[1], "rb").read()
old = b'"model_name":"stories260K-f32"'
assert b.count(old) == 1, "header layout changed; update the edit"
open(sys.argv[2], "wb").write(b.replace(old, b'"model_name":"stories260K-f99"'))
PY
expect 0 "eval with a rotation file calibrated for another model name" -- "${worker}" --role eval --model "${model}" --rotations "${work}/rot-other-name.safetensors" "${prompt[@]}" --max-new-tokens 2 --eval-windows 64:256
expect_err "W --rotations '${work}/rot-other-name.safetensors': the rotation file was calibrated for model 'stories260K-f99', not 'stories260K-f32' (the model file's name): only its geometry (head_dim 8, 5 layers, 4 KV heads) is checked" "the warning names both models"
[[ $(grep -c "was calibrated for model" "${work}/err") -eq 1 ]] || { echo "FAIL: the model-name warning is not given exactly once" >&2; failures=$((failures + 1)); }
expect 0 "eval with the model's own rotation file" -- "${worker}" --role eval "${model_flags[@]}" "${prompt[@]}" --max-new-tokens 2 --eval-windows 64:256
if grep -q "was calibrated for model" "${work}/err"; then echo "FAIL: a model-name warning for a matching file" >&2; failures=$((failures + 1)); fi
# A --metrics-file that cannot be written (disk full in the report) skipped --report too, without
# a word (newcomer report 11 F5): both are attempted, each failure named, and the one written
# said. The metrics file's directory is replaced by a plain file once the run is under way (the
# flag's up-front check passed), so its write fails.
mkdir -p "${work}/mdir"
many=(); for i in 1 2; do for p in "${demo}"/prompts/0*.txt; do many+=(--prompt-file "$p"); done; done
"${worker}" --role decode --teacher-force false --pool 127.0.0.1:1 "${model_flags[@]}" --max-new-tokens 16 "${many[@]}" \
  --report "${work}/f5.json" --metrics-file "${work}/mdir/m.prom" >"${work}/out" 2>"${work}/err" &
f5=$!
for _ in $(seq 100); do grep -q "not usable" "${work}/err" && break; sleep 0.1; done
rm -rf "${work}/mdir"; touch "${work}/mdir"
wait ${f5}; rc=$?
if [[ ${rc} -eq 2 && -s "${work}/f5.json" ]] && grep -q -- "kvpool-worker: --metrics-file: " "${work}/err" &&
   grep -q -- "kvpool-worker: --report '${work}/f5.json' written; exit 2 because --metrics-file failed" "${work}/err"; then
  echo "ok: a failed --metrics-file still writes --report and says so (exit 2)"
else
  echo "FAIL: failed --metrics-file: exit ${rc}, report $(ls "${work}/f5.json" 2>&1)" >&2; cat "${work}/err" >&2; failures=$((failures + 1))
fi
rm -f "${work}/mdir"
# A boolean that is none lists what is accepted (newcomer s8 N9; was CLI11's "Could not convert").
expect 1 "--teacher-force maybe" -- "${worker}" --role decode --pool 127.0.0.1:1 --teacher-force maybe "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --teacher-force: 'maybe' is not a boolean (want true or false" "the message lists the accepted values"
printf 'teacher-force: maybe\n' > "${work}/tf.yaml"
expect 1 "teacher-force: maybe in --config" -- "${worker}" --config "${work}/tf.yaml" --role decode --pool 127.0.0.1:1 "${base[@]}" "${prompt[@]}"
expect_err "kvpool-worker: --config '${work}/tf.yaml' key \"teacher-force\": --teacher-force: 'maybe' is not a boolean" "the message names the file and the key"
# An explicit revision asserts the weights (the pool does not compare them): warned once, and
# the report carries the model file's SHA-256.
# (The report goes through a symlink: the link stays, its target gets the JSON.)
mkdir "${work}/reports"
ln -s reports/explicit-target.json "${work}/explicit.json"
expect 0 "decode with an explicit --revision" -- "${worker}" --role decode --pool 127.0.0.1:1 --revision my-rev "${base[@]}" "${prompt[@]}" --teacher-force false --report "${work}/explicit.json"
[[ -L "${work}/explicit.json" && -f "${work}/reports/explicit-target.json" && $(ls -A "${work}/reports" | wc -l) -eq 1 ]] || { echo "FAIL: --report through a symlink did not keep the link" >&2; ls -la "${work}" "${work}/reports" >&2; failures=$((failures + 1)); }
[[ $(grep -c -- "--revision my-rev is explicit: the pool does not compare weights" "${work}/err") -eq 1 ]] || { echo "FAIL: explicit revision not warned exactly once" >&2; cat "${work}/err" >&2; failures=$((failures + 1)); }
python3 - "${work}/explicit.json" "${model}" <<'PY' || failures=$((failures + 1))
import hashlib, json, sys
d = json.load(open(sys.argv[1]))
assert d["revision"] == "my-rev", d["revision"]
assert d["model_sha256"] == hashlib.sha256(open(sys.argv[2], "rb").read()).hexdigest(), d["model_sha256"]
print("ok: explicit revision kept, report carries the weights' SHA-256")
PY
expect 2 "missing model file" -- "${worker}" --role eval --model /nonexistent.gguf --rotations "${work}/rot.safetensors" "${prompt[@]}"
printf 'not a safetensors file' >"${work}/bad.safetensors"
expect 2 "corrupted rotation file" -- "${worker}" --role eval --model "${model}" --rotations "${work}/bad.safetensors" "${prompt[@]}"
# The errors of --rotations named neither the flag nor the file, and a model given there read as
# a safetensors header of 5 GB (newcomer 20 F3).
expect_err "kvpool-worker: --rotations '${work}/bad.safetensors': " "a corrupted file is named with its flag"
expect 2 "the model given as --rotations" -- "${worker}" --role eval --model "${model}" --rotations "${model}" "${prompt[@]}"
expect_err "kvpool-worker: --rotations '${model}': INVALID_ARGUMENT: rotation file: this is a GGUF file (a model, for --model)" "a model is named as one"
expect 2 "a missing rotation file" -- "${worker}" --role eval --model "${model}" --rotations "${work}/no-such-rot.safetensors" "${prompt[@]}"
expect_err "kvpool-worker: --rotations: NOT_FOUND: " "a missing file is named with its flag"
expect 2 "missing prompt file" -- "${worker}" --role eval "${base[@]}" --prompt-file /nonexistent.txt
expect 2 "prefill without a pool" -- "${worker}" --role prefill --pool 127.0.0.1:1 --call-timeout-ms 300 "${base[@]}" "${prompt[@]}"
expect_err "pool 127.0.0.1:1: UNAVAILABLE: " "the pool's own status code is kept"
# A pool that never answered was said to have "stopped or restarted" and forgotten this client's
# puts (newcomer s7 F13): the message says no pool answers at the address.
expect_err "UNAVAILABLE: RegisterModel: could not reach the pool at 127.0.0.1:1 (" "a pool that never started is not reachable"
expect_err "no pool has answered at that address yet; check that kvpool-server runs and listens there" "the message says what to check"
# A prefill whose registration failed exited 2 without its --report (newcomer 18 F2): the report
# and metrics now say what became of each prompt.
expect 2 "prefill without a pool, with --report" -- "${worker}" --role prefill --pool 127.0.0.1:1 --call-timeout-ms 300 "${base[@]}" "${prompt[@]}" --report "${work}/noreg.json" --metrics-file "${work}/noreg.prom"
expect_err "kvpool-worker: pool 127.0.0.1:1: UNAVAILABLE: " "the pool failure is still the last word"
# ... after waiting for the pool as for an outage (newcomer 19 F3: a node started before its pool
# failed at once).
expect_err "prefill: the pool at 127.0.0.1:1 does not answer yet (UNAVAILABLE: " "the wait is logged"
expect_err "waiting up to 300 ms for it (--call-timeout-ms)" "the wait names its bound"
python3 - "${work}/noreg.json" "${work}/noreg.prom" <<'PY' || failures=$((failures + 1))
import json, sys
d = json.load(open(sys.argv[1]))
assert d["registration_error"].startswith("UNAVAILABLE: RegisterModel: could not reach the pool at 127.0.0.1:1"), d["registration_error"]
ps = d["prompts"]
assert len(ps) == 1 and ps[0]["error"].startswith("UNAVAILABLE: not put: the registration with the pool at 127.0.0.1:1 failed: RegisterModel: could not reach"), ps
assert d["overall"]["failed_prompts"] == 1 and d["overall"]["tokens_stored"] == 0, d["overall"]
m = open(sys.argv[2]).read()
assert "kvpool_worker_prefill_failed_prompts_total 1" in m, m
print("ok: a failed registration still writes the report and metrics")
PY
if grep -q "stopped or restarted\|forgotten" "${work}/err"; then echo "FAIL: a pool that never started is said to have stopped" >&2; cat "${work}/err" >&2; failures=$((failures + 1)); fi
# A bad local transport list is this worker's misconfiguration, not a pool failure: both roles
# stop with exit 2 and name the local data plane (no silent fallback).
expect 2 "decode with a bogus --ucx-tls" -- "${worker}" --role decode --pool 127.0.0.1:1 --ucx-tls bogus "${base[@]}" "${prompt[@]}" --teacher-force false
expect_err "local data plane (--ucx-tls 'bogus'" "the log names the local data plane"
expect 2 "prefill with a bogus --ucx-tls" -- "${worker}" --role prefill --pool 127.0.0.1:1 --ucx-tls bogus "${base[@]}" "${prompt[@]}"
expect_err "local data plane (--ucx-tls 'bogus'" "the log names the local data plane"
if grep -q "UNAVAILABLE: UNAVAILABLE" "${work}/err"; then echo "FAIL: doubled status code" >&2; failures=$((failures + 1)); fi

# The auto revision follows the rotation file: a re-calibration (other clip ratios, other file)
# gives another revision, so it never conflicts with the old registration.
"${tool}" calibrate --model "${model}" --text "${demo}/calibration.txt" --clip-k 0.9 --clip-v 0.8 \
  --out "${work}/rot2.safetensors" >/dev/null 2>&1 || { echo "calibrate 2 failed" >&2; exit 1; }
expect 0 "decode (rotation 1), revision in the report" -- "${worker}" --role decode --pool 127.0.0.1:1 --model "${model}" --rotations "${work}/rot.safetensors" "${prompt[@]}" --teacher-force false --max-new-tokens 1 --report "${work}/rev1.json"
expect 0 "decode (rotation 2), revision in the report" -- "${worker}" --role decode --pool 127.0.0.1:1 --model "${model}" --rotations "${work}/rot2.safetensors" "${prompt[@]}" --teacher-force false --max-new-tokens 1 --report "${work}/rev2.json"
python3 - "${work}" <<'PY' || failures=$((failures + 1))
import hashlib, json, sys
w = sys.argv[1]
r1 = json.load(open(f"{w}/rev1.json"))["revision"]
r2 = json.load(open(f"{w}/rev2.json"))["revision"]
rid = hashlib.sha256(open(f"{w}/rot.safetensors", "rb").read()).hexdigest()[:16]
assert r1 != r2, (r1, r2)
assert "-k0.96-v0.92-" in r1 and r1.endswith("-r" + rid), r1
assert "-k0.9-v0.8-" in r2, r2
print("ok: auto revision carries the clip ratios and the rotation id:", r1, r2)
PY

# No generated token, no teacher-forced position: agreement and ppl_ratio are null, not 1.0.
expect 0 "decode --max-new-tokens 0" -- "${worker}" --role decode --pool 127.0.0.1:1 "${model_flags[@]}" "${prompt[@]}" --max-new-tokens 0 --report "${work}/zero.json"
python3 - "${work}/zero.json" <<'PY' || failures=$((failures + 1))
import json, sys
d = json.load(open(sys.argv[1]))
for tf in (d["prompts"][0]["teacher_forced"], d["overall"]["teacher_forced"]):
    assert tf["positions"] == 0 and tf["agreement"] is None and tf["ppl_ratio"] is None, tf
print("ok: no position -> agreement and ppl_ratio null")
PY
expect 0 "eval --max-new-tokens 0" -- "${worker}" --role eval --eval-windows 64:256 "${model_flags[@]}" "${prompt[@]}" --max-new-tokens 0 --report "${work}/zero_eval.json"
expect_err "agreement n/a (0/0)  ppl ratio n/a" "the summary says n/a"
python3 - "${work}/zero_eval.json" <<'PY' || failures=$((failures + 1))
import json, sys
d = json.load(open(sys.argv[1]))
tf = d["overall"]["int2_S64_W256"]
assert tf["positions"] == 0 and tf["agreement"] is None and tf["ppl_ratio"] is None, tf
print("ok: eval report null over no position")
PY

# Decode with the pool unreachable: same answer as the single-process run, reported.
expect 0 "eval (single process)" -- "${worker}" --role eval --eval-windows 64:256 "${base[@]}" "${prompt[@]}" --report "${work}/eval.json"
expect 0 "decode with the pool unreachable" -- "${worker}" --role decode --pool 127.0.0.1:1 "${base[@]}" "${prompt[@]}" --teacher-force false --report "${work}/decode.json" --metrics-file "${work}/metrics.txt"
expect_err "not usable (pool unreachable at start-up: UNAVAILABLE: " "the fallback is logged"
[[ $(grep -c "UNAVAILABLE" "${work}/err") -eq 1 ]] || { echo "FAIL: the start-up status is not logged exactly once" >&2; cat "${work}/err" >&2; failures=$((failures + 1)); }
grep -q "^kvpool_worker_pool_fallbacks_total 1$" "${work}/metrics.txt" || { echo "FAIL: metrics lack the fallback" >&2; failures=$((failures + 1)); }
expect_err "pool unreachable at start-up: UNAVAILABLE: RegisterModel: could not reach the pool at 127.0.0.1:1" "the decode worker says the pool could not be reached"
if grep -q "stopped or restarted" "${work}/err"; then echo "FAIL: decode: a pool that never started is said to have stopped" >&2; failures=$((failures + 1)); fi
# The counters pass promtool (three had no HELP text: newcomer s7 F9), as the pool's do
# (kvstore metrics_test; the prefill node's are checked in worker_e2e_pool_test).
if [[ -n "${promtool}" && -x "${promtool}" ]]; then
  for m in metrics.txt; do
    if "${promtool}" check metrics <"${work}/${m}" >"${work}/promtool.out" 2>&1; then
      echo "ok: promtool check metrics passes on the decode worker's ${m}"
    else
      echo "FAIL: promtool check metrics on ${m}:" >&2; cat "${work}/promtool.out" "${work}/${m}" >&2; failures=$((failures + 1))
    fi
  done
  # And promtool does refuse a counter without HELP (so the check above can fail).
  printf '# TYPE x_total counter\nx_total 1\n' | "${promtool}" check metrics >/dev/null 2>&1 \
    && { echo "FAIL: promtool accepted a counter without HELP" >&2; failures=$((failures + 1)); }
else
  echo "skip: promtool not found (Debian package prometheus); metrics format not checked"
fi
# The registration follows --call-timeout-ms (a fixed 5 s ignored it while its error said to
# raise the flag: newcomer s9 A7). A listener that accepts and never answers is a hung pool.
python3 "$(dirname "${BASH_SOURCE[0]}")/silent_listener.py" >"${work}/silent.port" &
silent_pid=$!
for _ in $(seq 50); do [[ -s "${work}/silent.port" ]] && break; sleep 0.1; done
silent="127.0.0.1:$(cat "${work}/silent.port")"
expect 2 "prefill against a pool that never answers" -- "${worker}" --role prefill --pool "${silent}" "${base[@]}" "${prompt[@]}" --call-timeout-ms 700
expect_err "DEADLINE_EXCEEDED: RegisterModel: no answer from the pool at ${silent} within the call's deadline (\([4-6][0-9][0-9]\|700\) ms;" "the registration's deadline is --call-timeout-ms (printed as the time left at the call's start: 400-700 ms, not the old fixed 5000)"
# A decode worker says its pool did not answer in time, not that it is unreachable (newcomer 20 F2).
expect 0 "decode against a pool that never answers" -- "${worker}" --role decode --pool "${silent}" "${base[@]}" "${prompt[@]}" --teacher-force false --call-timeout-ms 700
expect_err "not usable (no answer from the pool within --call-timeout-ms at start-up: DEADLINE_EXCEEDED: " "the decode worker names the timeout"
if grep -q "pool unreachable" "${work}/err"; then echo "FAIL: decode: a pool that accepts and never answers is called unreachable" >&2; failures=$((failures + 1)); fi
kill "${silent_pid}" 2>/dev/null; wait "${silent_pid}" 2>/dev/null
python3 - "${work}" <<'PY' || failures=$((failures + 1))
import json, sys
w = sys.argv[1]
e = json.load(open(f"{w}/eval.json"))["prompts"][0]["configs"]["int2_S64_W256"]["greedy_tokens"]
d = json.load(open(f"{w}/decode.json"))["prompts"][0]
assert d["fallback"] and "unreachable" in d["fallback_reason"], d
assert d["tokens"] == e and len(e) > 0, (d["tokens"], e)
print("ok: unreachable pool -> fallback, answer identical to the single-process run")
PY
[[ ${failures} -eq 0 ]] && echo PASS || { echo "${failures} failure(s)" >&2; exit 1; }
