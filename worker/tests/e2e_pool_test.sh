#!/usr/bin/env bash
# End-to-end test of the main path as separate processes: kvpool-server, a prefill node and a
# decode worker (kvpool-worker) over UCX on loopback TCP, on the real stories260K model.
# Asserts (issue 5 acceptance):
#   1. bf16 history: the pool-served decode reproduces token for token the single-process run
#      (kvpool-worker --role eval: same segmented attention, fp32 rotation, BF16 rounding);
#   2. int2 history: the same holds bit for bit, and the teacher-forced agreement against the
#      float32 reference is >= INT2_MIN_AGREEMENT (measured 0.90 on these two prompts with
#      OSCAR rotations calibrated on worker/demo/calibration.txt; threshold 0.80);
#   3. a prefill node killed mid-push leaves nothing visible (the decode's lease finds 0 blocks);
#   4. a pool killed mid-fetch still yields the same output as a run without the pool, and the
#      decode reports the fallback;
#   5. a hung pool (SIGSTOP) costs one call's deadline, not one per prompt: the later decode
#      prompts report that the pool was skipped after the first one's failure; the later prefill
#      prompts fail fast ("not sent"), or are stored once the pool resumes (SIGCONT); a decode
#      worker asks a resumed pool again 3 x --call-timeout-ms after the timeout and is served;
#   6. a prompt of n = 0 (mod P) tokens is a full hit too (the prefill puts the decoder's blocks);
#   7. a pool killed mid-prefill and restarted a second later receives every prompt (the put
#      that was open is put again), and the prefill node's counters pass promtool;
#   8. a prompt sharing all but its last block with a stored one loads every shared block (the
#      history before its own window as INT2), and a shorter prompt (a strict prefix) the history
#      before its window and the window blocks held in BF16 after those the pool holds INT2-only;
#   9. the pool counts no lookup miss for a full hit of n = 0 (mod P) tokens;
#  10. a prefill node whose stderr is a closed pipe stores every prompt and writes its report;
#  11. prefill nodes that share a pool with room for about one put wait for each other's staging
#      (RESOURCE_EXHAUSTED naming other open puts) instead of failing their prompts, also when
#      their puts share blocks and a commit is refused for room (the put is put again); a
#      shortage that does not pass (staging of puts left open) costs one wait, not one a prompt;
#  12. a decode with a recalibrated rotation file (a new revision) is told which revisions of
#      the model id hold the blocks its lookups cannot find.
# Usage: e2e_pool_test.sh SERVER WORKER KVPOOL_TOOL MODEL DEMO_DIR [PROMTOOL]
set -euo pipefail
server_bin="$1"; worker_bin="$2"; tool_bin="$3"; model="$4"; demo="$5"; promtool="${6:-}"
INT2_MIN_AGREEMENT=0.80
work="$(mktemp -d)"
server_pid=""
room_pid=""
cleanup() {
  if [[ -n "${server_pid}" ]]; then kill "${server_pid}" 2>/dev/null || true; wait "${server_pid}" 2>/dev/null || true; fi
  stop_room
  rm -rf "${work}"
}
trap cleanup EXIT
# Stops the extra pool ${room_pid} (if any); the cleanup trap stops it otherwise.
stop_room() {
  if [[ -n "${room_pid}" ]]; then kill "${room_pid}" 2>/dev/null || true; wait "${room_pid}" 2>/dev/null || true; fi
  room_pid=""
}

port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
pool="127.0.0.1:${port}"
prompts=(--prompt-file "${demo}/prompts/01_kite.txt" --prompt-file "${demo}/prompts/02_garden.txt")
common=(--model "${model}" --rotations "${work}/rot.safetensors" --max-new-tokens 32)

# Waits (up to 20 s) until FILE has a line matching PATTERN or the worker ${worker_pid} stopped.
wait_for_line() {
  for _ in $(seq 1 400); do
    grep -q "$1" "$2" 2>/dev/null && return 0
    kill -0 "${worker_pid}" 2>/dev/null || return 0
    sleep 0.05
  done
}

start_pool() {
  "${server_bin}" --listen "${pool}" --metrics-port 0 --ucx-tls tcp --capacity 64MiB \
    >"${work}/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 100); do
    if grep -q "ready\|listening\|serving" "${work}/server.log" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  sleep 1
}

# A counter of the running pool's /metrics (its port from the start-up line metrics_port=N).
pool_metric() {
  python3 - "${work}/server.log" "$1" <<'PY'
import re, sys, urllib.request
port = re.findall(r"metrics_port=(\d+)", open(sys.argv[1]).read())[-1]
text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
print(int(float(re.search(rf"^{sys.argv[2]} (\S+)$", text, re.M).group(1))))
PY
}

fail() { echo "FAIL: $*" >&2; echo "--- server log" >&2; tail -20 "${work}/server.log" >&2 || true; exit 1; }

echo "== calibrate OSCAR rotations on the calibration text"
"${tool_bin}" calibrate --model "${model}" --text "${demo}/calibration.txt" \
  --out "${work}/rot.safetensors" >/dev/null 2>"${work}/calibrate.log" || fail "calibrate"

echo "== single-process runs (no pool)"
"${worker_bin}" --role eval "${common[@]}" "${prompts[@]}" --eval-windows 64:256 \
  --report "${work}/eval.json" >/dev/null 2>"${work}/eval.log" || fail "eval"

start_pool
for hp in bf16 int2; do
  echo "== ${hp}: prefill node -> pool -> decode worker"
  "${worker_bin}" --role prefill --pool "${pool}" --history-precision "${hp}" "${common[@]}" \
    "${prompts[@]}" --report "${work}/prefill_${hp}.json" >/dev/null 2>"${work}/prefill_${hp}.log" \
    || { cat "${work}/prefill_${hp}.log" >&2; fail "prefill ${hp}"; }
  "${worker_bin}" --role decode --pool "${pool}" --history-precision "${hp}" "${common[@]}" \
    "${prompts[@]}" --report "${work}/decode_${hp}.json" >/dev/null 2>"${work}/decode_${hp}.log" \
    || { cat "${work}/decode_${hp}.log" >&2; fail "decode ${hp}"; }
done

python3 - "${work}" "${INT2_MIN_AGREEMENT}" <<'PY' || fail "pool path checks"
import json, sys
work, min_agree = sys.argv[1], float(sys.argv[2])
ev = json.load(open(f"{work}/eval.json"))
for hp in ("bf16", "int2"):
    dec = json.load(open(f"{work}/decode_{hp}.json"))
    for i, p in enumerate(dec["prompts"]):
        single = ev["prompts"][i]["configs"][f"{hp}_S64_W256"]["greedy_tokens"]
        assert not p["fallback"], (hp, p["name"], p["fallback_reason"])
        assert p["loaded_blocks"] == p["wanted_blocks"] > 0, (hp, p)
        assert p["lookup_blocks"] >= p["wanted_blocks"], (hp, p)
        assert p["bytes_moved"] > 0, (hp, p)
        assert p["tokens"] == single, f"{hp} {p['name']}: pool {p['tokens']} != single {single}"
        print(f"{hp} {p['name']}: {len(p['tokens'])} tokens identical to the single-process run, "
              f"{p['loaded_blocks']} blocks from the pool, {p['bytes_moved']} bytes moved")
    tf = dec["overall"]["teacher_forced"]
    print(f"{hp}: teacher-forced agreement {tf['agreement']:.3f} ppl ratio {tf['ppl_ratio']:.4f}")
    if hp == "int2":
        assert tf["agreement"] >= min_agree, f"int2 agreement {tf['agreement']} < {min_agree}"
        assert sum(p["int2_blocks_fetched"] for p in dec["prompts"]) > 0, "no INT2 block fetched"
        moved = {h: sum(p["bytes_moved"] for p in json.load(open(f"{work}/decode_{h}.json"))["prompts"])
                 for h in ("bf16", "int2")}
        assert moved["int2"] < moved["bf16"], moved
    else:
        assert sum(p["int2_blocks_fetched"] for p in dec["prompts"]) == 0
PY

echo "== partial hit: a shorter prompt whose window blocks have no BF16 form in the pool"
# The first lines of 01_kite: its blocks are held, but the first blocks of this prompt's recent
# window were history (INT2 only) in the stored sequence, so the worker takes the sink and the
# history before its window (INT2, as the recipe stores it), recomputes those INT2-only window
# blocks (the gap) and loads the window blocks after them, which the pool holds in BF16
# (FORMAT.md §3; before newcomer report 10 F5 it took the sink only, before newcomer s10b the
# whole window was recomputed: 9 of 25 blocks loaded).
head -4 "${demo}/prompts/01_kite.txt" >"${work}/kite_prefix.txt"
"${worker_bin}" --role decode --pool "${pool}" "${common[@]}" \
  --prompt-file "${work}/kite_prefix.txt" --report "${work}/decode_prefix.json" >/dev/null \
  2>"${work}/decode_prefix.log" || fail "decode of a shorter prompt"
python3 - "${work}" <<'PY' || fail "partial hit"
import json, sys
p = json.load(open(f"{sys.argv[1]}/decode_prefix.json"))["prompts"][0]
kite = json.load(open(f"{sys.argv[1]}/decode_int2.json"))["prompts"][0]
assert not p["fallback"], p
assert p["hit_blocks"] == p["wanted_blocks"] > 4, p         # every wanted block is held ...
assert kite["name"] == "01_kite" and p["wanted_blocks"] < kite["wanted_blocks"], (p, kite)
# ... the sink and the history before this prompt's window come as stored, then the window
# blocks that were history in the stored sequence (INT2 only: the gap) are recomputed, and the
# window blocks the stored put kept in BF16 (its last 16) are loaded after them.
hist = p["wanted_blocks"] - 16
gap = kite["wanted_blocks"] - p["wanted_blocks"]  # the stored window starts this much later
assert 0 < gap < 16 and p["gap_blocks"] == gap, (p, kite["wanted_blocks"])
assert p["loaded_blocks"] == p["wanted_blocks"] - gap > hist > 4, p
assert p["int2_blocks_fetched"] == hist - 4, p
assert p["bf16_blocks_fetched"] == 4 + 16 - gap, p
assert p["recomputed_tokens"] == p["prompt_tokens"] - 16 * p["loaded_blocks"], p
assert len(p["tokens"]) > 0 and p["teacher_forced"]["agreement"] >= 0.5, p
print(f"partial hit: {p['hit_blocks']} blocks held, {p['loaded_blocks']} loaded ({gap} window "
      f"blocks recomputed between them; {hist} before the window alone), "
      f"{p['recomputed_tokens']} tokens recomputed, agreement {p['teacher_forced']['agreement']:.3f}")
PY

echo "== a prompt sharing all but its last block with a stored one loads every shared block"
# 03_boat + " And then day 1 came." / "... day 2 ...": 483 tokens, 30 wanted blocks, the same
# blocks 0..28 (asserted below). Only day 2 is put, so block 29 of day 1 is a miss; the shared
# blocks 13 ... of day 2's window that lie before day 1's own window (blocks 14..29) are history
# in day 1's context and are taken INT2 (newcomer report 10 F5: the worker asked BF16 of the
# window of the 29 held blocks, 13..28, block 13 had INT2 only, and it loaded the 4 sink blocks
# and recomputed 419 tokens). Its own namespace (--revision).
for d in 1 2; do
  printf '%s%s' "$(cat "${demo}/prompts/03_boat.txt")" " And then day ${d} came." >"${work}/boat_day${d}.txt"
done
day=(--revision day-test "${common[@]}")
"${worker_bin}" --role prefill --pool "${pool}" "${day[@]}" --prompt-file "${work}/boat_day2.txt" \
  --report "${work}/prefill_day2.json" >/dev/null 2>"${work}/prefill_day2.log" \
  || { cat "${work}/prefill_day2.log" >&2; fail "prefill of day 2"; }
"${worker_bin}" --role decode --pool "${pool}" "${day[@]}" --prompt-file "${work}/boat_day1.txt" \
  --prompt-file "${work}/boat_day2.txt" --report "${work}/decode_day.json" >/dev/null \
  2>"${work}/decode_day.log" || { cat "${work}/decode_day.log" >&2; fail "decode of day 1"; }
python3 - "${work}" <<'PY' || fail "a prompt sharing all but its last block"
import json, sys
one, two = json.load(open(f"{sys.argv[1]}/decode_day.json"))["prompts"]
for p in (one, two):
    assert not p["fallback"], p
    assert p["prompt_tokens"] == two["prompt_tokens"] and p["wanted_blocks"] == 30, p
assert one["hit_blocks"] == one["wanted_blocks"] - 1, one   # all but the last block held
assert one["loaded_blocks"] == one["hit_blocks"], one       # every held block used
assert one["int2_blocks_fetched"] == one["wanted_blocks"] - 16 - 4, one  # blocks 4..13
assert one["recomputed_tokens"] == one["prompt_tokens"] - 16 * one["loaded_blocks"], one
assert len(one["tokens"]) > 0 and one["teacher_forced"]["agreement"] >= 0.5, one
assert two["loaded_blocks"] == two["wanted_blocks"], two    # the stored prompt: a full hit
print(f"day 1: {one['hit_blocks']} of {one['wanted_blocks']} blocks held, "
      f"{one['loaded_blocks']} loaded ({one['int2_blocks_fetched']} INT2), "
      f"{one['recomputed_tokens']} of {one['prompt_tokens']} tokens recomputed")
PY

echo "== a prompt of n = 0 (mod P) tokens, prefilled then decoded with the same recipe: a full hit"
# 01_kite + " a a" is 448 tokens (BOS included) = 28 blocks of 16 (asserted below). The decoder takes the
# ⌊(n−1)/P⌋ = 27 blocks before the last token and wants BF16 for its window (blocks 11..26); the
# prefill node puts those 27 blocks, so the pool's BF16 tail is that window (newcomer report s8 N8:
# a put of all 28 blocks kept BF16 for 12..27, block 11 was INT2-only, and the decode loaded only
# the 4 sink blocks). Its own namespace (--revision), so no earlier put of 01_kite's blocks helps.
# 03_boat (not a multiple of 16, no block shared with 01_kite) in the same runs stays a full hit.
printf '%s%s' "$(cat "${demo}/prompts/01_kite.txt")" " a a" >"${work}/kite448.txt"
n0=(--revision n0-test "${common[@]}" --prompt-file "${work}/kite448.txt"
    --prompt-file "${demo}/prompts/03_boat.txt")
"${worker_bin}" --role eval "${n0[@]}" --eval-windows 64:256 --report "${work}/eval_n0.json" \
  >/dev/null 2>"${work}/eval_n0.log" || { cat "${work}/eval_n0.log" >&2; fail "eval n=0 mod P"; }
"${worker_bin}" --role prefill --pool "${pool}" "${n0[@]}" --report "${work}/prefill_n0.json" \
  >/dev/null 2>"${work}/prefill_n0.log" || { cat "${work}/prefill_n0.log" >&2; fail "prefill n=0 mod P"; }
misses0="$(pool_metric kvpool_lookup_misses_total)"; lookups0="$(pool_metric kvpool_lookups_total)"
"${worker_bin}" --role decode --pool "${pool}" "${n0[@]}" --report "${work}/decode_n0.json" \
  >/dev/null 2>"${work}/decode_n0.log" || { cat "${work}/decode_n0.log" >&2; fail "decode n=0 mod P"; }
# Two full hits, two calls each (Lookup, Acquire), no miss: the decoder asks for the blocks it
# wants (newcomer report 10 F4: it sent the whole 448-token prompt and the pool counted a miss).
misses1="$(pool_metric kvpool_lookup_misses_total)"; lookups1="$(pool_metric kvpool_lookups_total)"
[[ $((lookups1 - lookups0)) -eq 4 ]] || fail "n = 0 (mod P): $((lookups1 - lookups0)) lookups, want 4"
[[ ${misses1} -eq ${misses0} ]] || fail "n = 0 (mod P): full hits counted as $((misses1 - misses0)) lookup miss(es) by the pool"
echo "n = 0 (mod P): the pool counted $((lookups1 - lookups0)) lookups and no miss for the two full hits"
python3 - "${work}" <<'PY' || fail "n = 0 (mod P): not a full hit"
import json, sys
w = sys.argv[1]
ev = json.load(open(f"{w}/eval_n0.json"))["prompts"]
pre = json.load(open(f"{w}/prefill_n0.json"))["prompts"]
dec = json.load(open(f"{w}/decode_n0.json"))["prompts"]
ns = [p["prompt_tokens"] for p in dec]
assert ns[0] % 16 == 0 and ns[1] % 16 != 0, ns
for i, (pf, p) in enumerate(zip(pre, dec)):
    n = p["prompt_tokens"]
    assert not p["fallback"], p
    assert p["hit_blocks"] == p["wanted_blocks"], p
    assert p["loaded_blocks"] == p["wanted_blocks"], p       # a full hit, window included
    assert pf["blocks"] == (n - 1) // 16 == p["wanted_blocks"], (pf, p)
    assert p["recomputed_tokens"] == n - 16 * p["wanted_blocks"], p
    single = ev[i]["configs"]["int2_S64_W256"]["greedy_tokens"]
    assert p["tokens"] == single, f"{p['name']}: pool {p['tokens']} != single {single}"
    print(f"{p['name']} (n = {n}): {pf['blocks']} blocks put, {p['loaded_blocks']}/"
          f"{p['wanted_blocks']} loaded, {p['recomputed_tokens']} recomputed, tokens identical")
PY

echo "== a prefill node whose stderr is a closed pipe still pushes every prompt and writes its report"
# Its log is all it prints; a reader that is gone (here 'true', which reads nothing) used to kill
# it by SIGPIPE at its next log line: exit 141, no report, the later prompts never pushed and its
# open put left to the put timeout (newcomer report 10 F2). SIGPIPE is ignored: the lines are lost,
# the run is not.
set +e
{ "${worker_bin}" --role prefill --pool "${pool}" --revision pipe-test "${common[@]}" "${prompts[@]}" \
    --report "${work}/prefill_pipe.json" 2>&1 >/dev/null; } | true
rc=${PIPESTATUS[0]}
set -e
[[ ${rc} -eq 0 ]] || fail "prefill with a closed stderr: exit ${rc}, want 0"
python3 - "${work}" <<'PY' || fail "prefill with a closed stderr: report"
import json, sys
r = json.load(open(f"{sys.argv[1]}/prefill_pipe.json"))
assert r["interrupted"] is False, r
assert [p["name"] for p in r["prompts"]] == ["01_kite", "02_garden"], r["prompts"]
assert all(p["blocks"] > 0 and not p.get("error") for p in r["prompts"]), r["prompts"]
print(f"prefill with a closed stderr: exit 0, {len(r['prompts'])} prompts stored, report written")
PY

echo "== prefill node killed mid-push: nothing becomes visible"
set +e
"${worker_bin}" --role prefill --pool "${pool}" "${common[@]}" \
  --prompt-file "${demo}/prompts/03_boat.txt" --fault prefill-exit-mid-push \
  >/dev/null 2>"${work}/prefill_killed.log"
rc=$?
set -e
[[ ${rc} -ne 0 ]] || fail "the faulted prefill exited 0"
grep -q "prefill-exit-mid-push" "${work}/prefill_killed.log" || fail "fault hook did not fire"
"${worker_bin}" --role decode --pool "${pool}" "${common[@]}" \
  --prompt-file "${demo}/prompts/03_boat.txt" --teacher-force false \
  --report "${work}/decode_after_kill.json" >/dev/null 2>"${work}/decode_after_kill.log" \
  || fail "decode after killed prefill"
python3 - "${work}" <<'PY' || fail "killed prefill left blocks visible"
import json, sys
d = json.load(open(f"{sys.argv[1]}/decode_after_kill.json"))
p = d["prompts"][0]
assert p["lookup_blocks"] == 0, p
assert p["hit_blocks"] == 0 and p["loaded_blocks"] == 0, p
print(f"killed prefill: Lookup finds {p['lookup_blocks']} blocks, Acquire {p['hit_blocks']} "
      f"(of {p['wanted_blocks']} wanted)")
PY

echo "== prefill with a prompt shorter than one block: skipped with a warning, the others pushed"
printf 'Tom ran.' >"${work}/short.txt"
"${worker_bin}" --role prefill --pool "${pool}" --revision short-prompt-test "${common[@]}" \
  --prompt-file "${demo}/prompts/01_kite.txt" --prompt-file "${work}/short.txt" \
  --prompt-file "${demo}/prompts/03_boat.txt" --report "${work}/prefill_short.json" \
  >/dev/null 2>"${work}/prefill_short.log" \
  || { cat "${work}/prefill_short.log" >&2; fail "prefill with a short prompt"; }
grep -q "W prefill --prompt-file ${work}/short.txt: skipped" "${work}/prefill_short.log" \
  || { cat "${work}/prefill_short.log" >&2; fail "the skip warning does not name the file"; }
python3 - "${work}/prefill_short.json" <<'PY' || fail "prefill short-prompt report"
import json, sys
d = json.load(open(sys.argv[1]))
p = d["prompts"]
assert [x["name"] for x in p] == ["01_kite", "short", "03_boat"], p
assert p[1]["skipped"] and "hold no full block of 16 before the last token" in p[1]["skip_reason"], p[1]
assert p[0]["blocks_written"] > 0 and p[2]["blocks_written"] > 0, p
assert d["overall"]["skipped_prompts"] == 1 and d["overall"]["failed_prompts"] == 0, d["overall"]
print(f"short prompt skipped; {p[0]['blocks_written']} + {p[2]['blocks_written']} blocks pushed")
PY

echo "== registration conflict: the pool's FAILED_PRECONDITION is kept, its code printed once"
"${tool_bin}" calibrate --model "${model}" --text "${demo}/calibration.txt" --clip-k 0.9 \
  --out "${work}/rot2.safetensors" >/dev/null 2>>"${work}/calibrate.log" || fail "calibrate 2"
"${worker_bin}" --role prefill --pool "${pool}" --revision conflict-test "${common[@]}" \
  --prompt-file "${demo}/prompts/01_kite.txt" >/dev/null 2>"${work}/conflict1.log" \
  || { cat "${work}/conflict1.log" >&2; fail "prefill (first registration)"; }
rc=0
"${worker_bin}" --role prefill --pool "${pool}" --revision conflict-test --model "${model}" \
  --rotations "${work}/rot2.safetensors" --prompt-file "${demo}/prompts/01_kite.txt" \
  >/dev/null 2>"${work}/conflict2.log" || rc=$?
cat "${work}/conflict2.log"
[[ ${rc} -eq 2 ]] || fail "conflicting registration: exit ${rc}, want 2"
grep -q ": FAILED_PRECONDITION: " "${work}/conflict2.log" || fail "conflict: code not FAILED_PRECONDITION"
if grep -q "UNAVAILABLE" "${work}/conflict2.log"; then fail "conflict reported as UNAVAILABLE"; fi
# The decode role falls back to local compute, and its report names the refusal, not an outage.
"${worker_bin}" --role decode --pool "${pool}" --revision conflict-test --model "${model}" \
  --rotations "${work}/rot2.safetensors" --prompt-file "${demo}/prompts/01_kite.txt" \
  --max-new-tokens 4 --teacher-force false --report "${work}/conflict_decode.json" \
  --prompt-file "${demo}/prompts/02_garden.txt" \
  >/dev/null 2>"${work}/conflict3.log" || { cat "${work}/conflict3.log" >&2; fail "decode (conflict)"; }
# The refusal is logged once for the run, not once more per prompt.
[[ $(grep -c "FAILED_PRECONDITION" "${work}/conflict3.log") -eq 1 ]] \
  || { cat "${work}/conflict3.log" >&2; fail "decode conflict: the refusal is not logged exactly once"; }
python3 - "${work}/conflict_decode.json" <<'PY' || fail "decode conflict report"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["overall"]["fallbacks"] == 2, d["overall"]
for p in d["prompts"]:
    assert p["fallback"], p
    r = p["fallback_reason"]
    assert r.startswith("pool refused the registration: ") and "FAILED_PRECONDITION" in r, r
    assert "unreachable" not in r, r
print(f"decode with a conflicting registration: fallback, reason {r[:70]!r}")
PY

echo "== a recalibrated rotation file: a new revision, whose registration names the old one"
# rot2 (another clip ratio) gives another rotation id, so --revision auto registers another
# revision: every lookup misses what the int2 prefill stored, which went unsaid (newcomer s10b).
# The pool names its other revisions holding blocks (protocol v1.7) and the worker warns.
"${worker_bin}" --role decode --pool "${pool}" --history-precision int2 --model "${model}" \
  --rotations "${work}/rot2.safetensors" --prompt-file "${demo}/prompts/01_kite.txt" \
  --max-new-tokens 2 --teacher-force false --report "${work}/recal_decode.json" \
  >/dev/null 2>"${work}/recal.log" || { cat "${work}/recal.log" >&2; fail "decode with a recalibrated rotation"; }
python3 - "${work}" <<'PY' || { cat "${work}/recal.log" >&2; fail "recalibrated rotation"; }
import hashlib, json, sys
w = sys.argv[1]
d = json.load(open(f"{w}/recal_decode.json"))
old = hashlib.sha256(open(f"{w}/rot.safetensors", "rb").read()).hexdigest()
assert d["rotation_id"] != old, d["rotation_id"]
others = [o for o in d["pool_other_revisions"] if o["rotation_id"] == old and o["blocks"] > 0]
assert others, d["pool_other_revisions"]
assert d["prompts"][0]["hit_blocks"] == 0, d["prompts"][0]
log = open(f"{w}/recal.log").read()
assert f"(rotation {old[:16]}), not under this worker's revision" in log, log
assert "another rotation file (recalibrated?)" in log, log
print(f"recalibrated rotation: 0 blocks hit, warned of {len(others)} revision(s) under rotation "
      f"{old[:16]} ({others[0]['blocks']} blocks)")
PY

# A prefill node makes no lookups: its warning says it stores a second copy (newcomer 11b F5).
"${worker_bin}" --role prefill --pool "${pool}" --history-precision int2 --model "${model}" \
  --rotations "${work}/rot2.safetensors" --prompt-file "${demo}/prompts/01_kite.txt" \
  >/dev/null 2>"${work}/recal_prefill.log" || { cat "${work}/recal_prefill.log" >&2; fail "prefill with a recalibrated rotation"; }
if grep -q "another rotation file (recalibrated?).*this node stores its prompts under its own revision, a second copy" "${work}/recal_prefill.log" \
  && ! grep -q "lookups of this run" "${work}/recal_prefill.log"; then
  echo "ok: the prefill node's other-revision warning speaks of a second copy, not of lookups"
else
  cat "${work}/recal_prefill.log" >&2; fail "prefill other-revision warning"
fi

echo "== pool killed mid-fetch: same answer as without the pool"
"${worker_bin}" --role decode --pool "${pool}" "${common[@]}" "${prompts[@]}" \
  --fault kill-pool-mid-fetch --fault-pool-pid "${server_pid}" --teacher-force false \
  --report "${work}/decode_pool_killed.json" --metrics-file "${work}/pool_killed.prom" >/dev/null 2>"${work}/decode_pool_killed.log" \
  || { cat "${work}/decode_pool_killed.log" >&2; fail "decode with the pool killed"; }
wait "${server_pid}" 2>/dev/null || true
server_pid=""
python3 - "${work}" <<'PY' || fail "pool-killed decode"
import json, sys
work = sys.argv[1]
ev = json.load(open(f"{work}/eval.json"))
d = json.load(open(f"{work}/decode_pool_killed.json"))
assert d["prompts"][0]["fallback"], d["prompts"][0]
# Every prompt after the kill is a fallback with the pool's status as its reason (a failed
# Lookup is not a cache miss; after a failed call that found the pool down, the pool is not
# asked again and the reason names that earlier failure), and the overall count says so.
for p in d["prompts"][1:]:
    r = p["fallback_reason"]
    assert p["fallback"] and (r.startswith("lookup: UNAVAILABLE") or
                              r.startswith("pool skipped after an earlier failure in this run: ")), p
assert d["overall"]["fallbacks"] == len(d["prompts"]), d["overall"]
# The sink blocks fetched before the kill moved over the data plane: counted as discarded, and
# in the fetched-bytes metric (newcomer s10 F7: 0 everywhere).
p0 = d["prompts"][0]
assert p0["bytes_moved"] == 0 and p0["bytes_discarded"] > 0, p0
assert d["overall"]["bytes_discarded"] == sum(p["bytes_discarded"] for p in d["prompts"]), d["overall"]
m = dict(l.split() for l in open(f"{work}/pool_killed.prom") if not l.startswith("#"))
assert int(m["kvpool_worker_fetched_bytes_total"]) == d["overall"]["bytes_moved"] + d["overall"]["bytes_discarded"], m
for i, p in enumerate(d["prompts"]):
    single = ev["prompts"][i]["configs"]["int2_S64_W256"]["greedy_tokens"]
    assert p["tokens"] == single, f"{p['name']}: {p['tokens']} != {single}"
    print(f"pool killed: {p['name']} fallback={p['fallback']} ({p['fallback_reason'][:60]}), "
          f"output identical to the single-process run")
PY
grep -q "computed the" "${work}/decode_pool_killed.log" || fail "the fallback is not logged"
grep -q "^kvpool_worker_pool_fallbacks_total 2$" "${work}/pool_killed.prom" \
  || fail "metrics: pool fallbacks are not 2 of 2 prompts"

echo "== hung pool (SIGSTOP after the registration): one deadline, then the pool is skipped"
# The first prompt's first pool call (its Lookup) waits for the client's deadline
# (DEADLINE_EXCEEDED); the other
# prompts must not ask the hung pool again (each would wait the full deadline): their report
# names the earlier failure. The answers still match the run without a pool.
start_pool
rc=0
"${worker_bin}" --role decode --pool "${pool}" "${common[@]}" "${prompts[@]}" \
  --prompt-file "${demo}/prompts/03_boat.txt" --fault stop-pool-after-register \
  --fault-pool-pid "${server_pid}" --teacher-force false --report "${work}/decode_hung.json" \
  >/dev/null 2>"${work}/decode_hung.log" || rc=$?
kill -CONT "${server_pid}" 2>/dev/null || true
[[ ${rc} -eq 0 ]] || { cat "${work}/decode_hung.log" >&2; fail "decode with a hung pool: exit ${rc}"; }
grep -q "fault stop-pool-after-register" "${work}/decode_hung.log" || fail "fault hook did not fire"
[[ $(grep -c "the remaining requests of this run compute their prefix locally" "${work}/decode_hung.log") -eq 1 ]] \
  || { cat "${work}/decode_hung.log" >&2; fail "hung pool: the skip is not logged exactly once"; }
python3 - "${work}" <<'PY' || fail "hung-pool decode"
import json, sys
work = sys.argv[1]
ev = json.load(open(f"{work}/eval.json"))
d = json.load(open(f"{work}/decode_hung.json"))
first, rest = d["prompts"][0], d["prompts"][1:]
assert len(rest) == 2, d["prompts"]
assert first["fallback"] and "DEADLINE_EXCEEDED" in first["fallback_reason"], first
for p in rest:
    assert p["fallback"], p
    assert p["fallback_reason"] == ("pool skipped after an earlier failure in this run: "
                                    + first["fallback_reason"]), p["fallback_reason"]
    assert p["lookup_blocks"] == -1 and p["hit_blocks"] == 0, p
assert d["overall"]["fallbacks"] == 3, d["overall"]
for i, p in enumerate(d["prompts"][:2]):
    single = ev["prompts"][i]["configs"]["int2_S64_W256"]["greedy_tokens"]
    assert p["tokens"] == single, f"{p['name']}: {p['tokens']} != {single}"
print(f"hung pool: {first['name']} waited for its deadline ({first['fallback_reason'][:45]}...), "
      f"the other {len(rest)} skipped the pool; answers identical to the single-process run")
PY
five=()
for f in "${demo}"/prompts/0[1-5]_*.txt; do five+=(--prompt-file "$f"); done
echo "== hung pool under a prefill node: one call timeout, then the later prompts fail fast"
# The pool is SIGSTOPped right after the registration (it accepts connections, never answers).
# The first prompt's BeginPut waits for its deadline (--call-timeout-ms 2000: DEADLINE_EXCEEDED);
# after it the client checks the pool's health before each call (ClientOptions::
# hung_pool_probe_timeout, 1 s) and the later BeginPuts come back UNAVAILABLE "not sent" (the
# second after the outage wait of --call-timeout-ms) instead of each waiting its own 2 s. The
# pool is the one of the decode case above (resumed); the restart case below uses it too.
rc=0
"${worker_bin}" --role prefill --pool "${pool}" --revision hung-test "${common[@]}" "${five[@]}" \
  --fault stop-pool-after-register --fault-pool-pid "${server_pid}" --call-timeout-ms 2000 \
  --report "${work}/prefill_hung.json" >/dev/null 2>"${work}/prefill_hung.log" || rc=$?
kill -CONT "${server_pid}" 2>/dev/null || true
[[ ${rc} -eq 2 ]] || { cat "${work}/prefill_hung.log" >&2; fail "prefill with a hung pool: exit ${rc}, want 2"; }
grep -q "fault stop-pool-after-register" "${work}/prefill_hung.log" || fail "fault hook did not fire (prefill)"
python3 - "${work}" <<'PY' || { cat "${work}/prefill_hung.log" >&2; fail "prefill against a hung pool"; }
import json, sys
pre = json.load(open(f"{sys.argv[1]}/prefill_hung.json"))
p = pre["prompts"]
assert len(p) == 5, p
assert p[0]["error"].startswith("DEADLINE_EXCEEDED: BeginPut"), p[0]
for x in p[1:]:  # not sent: each did not wait for its own deadline
    assert x["error"].startswith("UNAVAILABLE: BeginPut: not sent"), x
    assert "did not answer a health check" in x["error"], x
print(f"hung pool under prefill: {p[0]['name']} waited its deadline, the other {len(p) - 1} "
      f"failed fast (not sent); run {pre['seconds']:.1f} s with a 2 s call timeout")
PY
# The same, but the pool resumes a second after the first prompt's deadline, within the outage
# wait (--call-timeout-ms 3000 from the first UNAVAILABLE): the later prompts are stored.
"${worker_bin}" --role prefill --pool "${pool}" --revision hung-resume-test "${common[@]}" \
  "${five[@]}" --fault stop-pool-after-register --fault-pool-pid "${server_pid}" \
  --call-timeout-ms 3000 --report "${work}/prefill_resumed.json" >/dev/null \
  2>"${work}/prefill_resumed.log" &
worker_pid=$!
wait_for_line "did not answer (" "${work}/prefill_resumed.log"  # the first BeginPut timed out
sleep 1
kill -CONT "${server_pid}" 2>/dev/null || true
rc=0
wait "${worker_pid}" || rc=$?
[[ ${rc} -eq 2 ]] || { cat "${work}/prefill_resumed.log" >&2; fail "prefill with a resumed pool: exit ${rc}, want 2"; }
grep -q "prefill: the pool answers again after .* (the same pool, which had stopped answering)" \
  "${work}/prefill_resumed.log" || { cat "${work}/prefill_resumed.log" >&2; fail "the resume is not logged"; }
python3 - "${work}" <<'PY' || { cat "${work}/prefill_resumed.log" >&2; fail "prefill across a hang"; }
import json, sys
pre = json.load(open(f"{sys.argv[1]}/prefill_resumed.json"))
p = pre["prompts"]
assert p[0]["error"].startswith("DEADLINE_EXCEEDED: BeginPut"), p[0]
for x in p[1:]:
    assert "error" not in x and x["blocks_written"] == x["blocks"] > 0, x
assert pre["overall"]["pool_reconnects"] == 1 and pre["overall"]["failed_prompts"] == 1, pre["overall"]
print(f"pool resumed under prefill: {p[0]['name']} lost at its deadline, the other {len(p) - 1} "
      f"stored; run {pre['seconds']:.1f} s")
PY

echo "== hung pool under a decode worker that outlives the hang: asked again, then served"
# Newcomer report 13: a pool that stopped answering once was never asked again in the run. Now
# the decode worker asks it again 3 x --call-timeout-ms (here 900 ms) after the timeout. The pool
# (above: prompts 2-5 stored under revision hung-resume-test) is stopped right after the registration
# and resumed once the first Lookup has timed out; 40 prompts of --max-new-tokens 40 outlast
# the interval many times over, so the later ones are served by the pool again.
many=()
for _ in $(seq 1 10); do for f in "${five[@]:2}"; do [[ "$f" == --prompt-file ]] || many+=(--prompt-file "$f"); done; done
"${worker_bin}" --role decode --pool "${pool}" --revision hung-resume-test --model "${model}" \
  --rotations "${work}/rot.safetensors" --max-new-tokens 40 "${many[@]}" --call-timeout-ms 300 \
  --fault stop-pool-after-register --fault-pool-pid "${server_pid}" --teacher-force false \
  --report "${work}/decode_retry.json" >/dev/null 2>"${work}/decode_retry.log" &
worker_pid=$!
wait_for_line "did not answer within the deadline" "${work}/decode_retry.log"  # the first Lookup
kill -CONT "${server_pid}" 2>/dev/null || true
rc=0
wait "${worker_pid}" || rc=$?
[[ ${rc} -eq 0 ]] || { cat "${work}/decode_retry.log" >&2; fail "decode across a hang: exit ${rc}"; }
grep -q "decode: asking the pool again, 900 ms after it did not answer" "${work}/decode_retry.log" \
  || { cat "${work}/decode_retry.log" >&2; fail "the decode worker did not ask the pool again"; }
python3 - "${work}" <<'PY' || { cat "${work}/decode_retry.log" >&2; fail "decode across a hang"; }
import json, sys
d = json.load(open(f"{sys.argv[1]}/decode_retry.json"))
p = d["prompts"]
assert len(p) == 40, len(p)
assert p[0]["fallback"] and "DEADLINE_EXCEEDED" in p[0]["fallback_reason"], p[0]
served = [x for x in p if not x["fallback"]]
assert served and not p[-1]["fallback"] and p[-1]["hit_blocks"] > 0, p[-1]
first_served = next(i for i, x in enumerate(p) if not x["fallback"])
assert all(not x["fallback"] for x in p[first_served:]), "a fallback after the pool came back"
print(f"hung pool under decode: {first_served} prompts fell back, the pool served the other "
      f"{len(p) - first_served} after it was asked again")
PY

# decode_one NAME REVISION PROMPT_FLAGS...: one token of each prompt decoded from the pool (no
# teacher forcing), report ${work}/decode_NAME.json; fails the test with its log if it fails.
decode_one() {
  local name="$1" revision="$2"
  shift 2
  "${worker_bin}" --role decode --pool "${pool}" --revision "${revision}" --model "${model}" \
    --rotations "${work}/rot.safetensors" "$@" --max-new-tokens 1 --teacher-force false \
    --report "${work}/decode_${name}.json" >/dev/null 2>"${work}/decode_${name}.log" \
    || { cat "${work}/decode_${name}.log" >&2; fail "decode ${name} (revision ${revision})"; }
}

# prefill_killing_pool NAME ARGS...: a prefill node (ARGS: its flags) that SIGKILLs the pool right
# after its first commit (--fault kill-pool-after-first-commit), in the background, stderr in
# ${work}/prefill_NAME.log; returns once the pool is dead (or the node stopped), with worker_pid
# set and server_pid cleared.
prefill_killing_pool() {
  local name="$1" old_pool="${server_pid}"
  shift
  "${worker_bin}" --role prefill --pool "${pool}" "$@" \
    --fault kill-pool-after-first-commit --fault-pool-pid "${server_pid}" \
    >/dev/null 2>"${work}/prefill_${name}.log" &
  worker_pid=$!
  for _ in $(seq 1 1200); do  # until the worker has killed the pool (or itself stopped)
    kill -0 "${old_pool}" 2>/dev/null && kill -0 "${worker_pid}" 2>/dev/null || break
    sleep 0.05
  done
  wait "${old_pool}" 2>/dev/null || true
  server_pid=""
}

echo "== pool killed mid-prefill and restarted 1 s later: every prompt reaches the new pool"
# The worker SIGKILLs the pool right after the first prompt committed, while the second
# prompt's put is open; the test restarts the pool on the same port a second later. The open
# put is lost (the restarted pool has forgotten it) and put again from the recorded K/V; every
# later prompt waits for the pool (up to --call-timeout-ms), and the client registers the model
# again (newcomer s7 F2: the later prompts all failed in the same millisecond, the restarted
# pool never saw a registration; session 7 still lost the prompt whose put was open).
prefill_killing_pool restart --revision restart-test "${common[@]}" "${five[@]}" \
  --call-timeout-ms 30000 --report "${work}/prefill_restart.json" \
  --metrics-file "${work}/prefill_restart.prom"
grep -q "fault kill-pool-after-first-commit" "${work}/prefill_restart.log" \
  || { cat "${work}/prefill_restart.log" >&2; fail "the kill-pool-after-first-commit hook did not fire"; }
sleep 1
start_pool
rc=0
wait "${worker_pid}" || rc=$?
[[ ${rc} -eq 0 ]] || { cat "${work}/prefill_restart.log" >&2; fail "prefill across a restart: exit ${rc}, want 0 (every prompt stored)"; }
grep -q "prefill: the put of a .*-token prompt failed: the pool went away or closed the connection" "${work}/prefill_restart.log" \
  || { cat "${work}/prefill_restart.log" >&2; fail "the lost put is not logged"; }
grep -q "W prefill: prompt 0 of the run was committed to the pool before it restarted (epoch .*): its blocks went with that pool; computing it and putting it again" \
  "${work}/prefill_restart.log" \
  || { cat "${work}/prefill_restart.log" >&2; fail "the prompt lost with the old pool is not logged"; }
grep -q "prefill: the pool answers again after .* (a restarted pool: model registered again)" \
  "${work}/prefill_restart.log" \
  || { cat "${work}/prefill_restart.log" >&2; fail "the reconnect is not logged"; }
"${worker_bin}" --role decode --pool "${pool}" --revision restart-test "${common[@]}" "${five[@]}" \
  --teacher-force false --report "${work}/decode_restart.json" >/dev/null \
  2>"${work}/decode_restart.log" || { cat "${work}/decode_restart.log" >&2; fail "decode after the restart"; }
python3 - "${work}" <<'PY' || { cat "${work}/prefill_restart.log" >&2; fail "prefill across a pool restart"; }
import json, sys
work = sys.argv[1]
pre = json.load(open(f"{work}/prefill_restart.json"))
p = pre["prompts"]
assert len(p) == 5, p
assert "error" not in p[0] and p[0]["blocks"] > 0, p[0]   # committed to the old pool,
assert not p[0]["reput"], p[0]
# then lost with it: computed and put again into the restarted pool at the end of the run
# (newcomer 14 F1: the report said it was stored, and the restarted pool did not hold it).
assert p[0].get("recomputed_after_restart") and p[0]["blocks_written"] == p[0]["blocks"], p[0]
assert all(not x.get("recomputed_after_restart") for x in p[1:]), p
# Its put was open when the pool died: put again from the recorded K/V into the restarted pool.
assert "error" not in p[1] and p[1]["reput"] and p[1]["blocks_written"] == p[1]["blocks"] > 0, p[1]
for x in p[2:]:                                             # all reach the restarted pool
    assert "error" not in x and not x["reput"] and x["blocks_written"] == x["blocks"] > 0, x
o = pre["overall"]
assert o["failed_prompts"] == 0 and o["reput_prompts"] == 1 and o["pool_reconnects"] == 1, o
assert o["recomputed_prompts"] == 1, o
dec = {d["name"]: d for d in json.load(open(f"{work}/decode_restart.json"))["prompts"]}
for x in p:
    d = dec[x["name"]]
    assert not d["fallback"] and d["hit_blocks"] == d["wanted_blocks"] > 0, d
print(f"pool restart mid-prefill: {p[1]['name']} (open at the kill) put again, {p[0]['name']} "
      f"(committed before it) computed again, all {len(p)} served from the restarted pool")
PY
grep -q "^kvpool_worker_pool_reconnects_total 1$" "${work}/prefill_restart.prom" \
  && grep -q "^kvpool_worker_prefill_failed_prompts_total 0$" "${work}/prefill_restart.prom" \
  && grep -q "^kvpool_worker_prefill_reput_prompts_total 1$" "${work}/prefill_restart.prom" \
  && grep -q "^kvpool_worker_prefill_recomputed_prompts_total 1$" "${work}/prefill_restart.prom" \
  || { cat "${work}/prefill_restart.prom" >&2; fail "prefill metrics"; }
if [[ -n "${promtool}" && -x "${promtool}" ]]; then
  "${promtool}" check metrics <"${work}/prefill_restart.prom" \
    || { cat "${work}/prefill_restart.prom" >&2; fail "promtool check metrics on the prefill counters"; }
  echo "promtool check metrics passes on the prefill node's counters"
else
  echo "skip: promtool not found; prefill metrics format not checked"
fi
echo "== pool restarted mid-prefill, the node SIGTERMed as the pool answers again: what the report calls stored is in the pool"
# Newcomer 16 F1: a stop after a restart (or during the recompute at the end) reported the prompts
# committed to the old pool as stored; they went with it. They are now interrupted ("committed
# to the pool before it restarted … the run stopped before putting it again"), or put again
# when the stop comes after the recompute. Either way each prompt the report calls stored must
# be served by the pool: checked by decoding them all (positions: the 40 prompts repeat the 5).
forty=()
for _ in $(seq 1 8); do forty+=("${five[@]}"); done
prefill_killing_pool rs --revision restart-stop-test "${common[@]}" "${forty[@]}" \
  --call-timeout-ms 30000 --report "${work}/prefill_rs.json"
sleep 1
start_pool
for _ in $(seq 1 600); do
  grep -q "prefill: the pool answers again" "${work}/prefill_rs.log" 2>/dev/null && break
  kill -0 "${worker_pid}" 2>/dev/null || break
  sleep 0.02
done
kill -TERM "${worker_pid}" 2>/dev/null
rc=0
wait "${worker_pid}" || rc=$?
[[ ${rc} -eq 143 || ${rc} -eq 0 ]] || { cat "${work}/prefill_rs.log" >&2; fail "prefill SIGTERMed after a restart: exit ${rc}, want 143 (or 0 if it ended first)"; }
decode_one rs restart-stop-test "${forty[@]}"
python3 - "${work}" <<'PY' || { cat "${work}/prefill_rs.log" >&2; fail "a prompt reported stored is not in the pool"; }
import json, sys
work = sys.argv[1]
pre = json.load(open(f"{work}/prefill_rs.json"))["prompts"]
dec = json.load(open(f"{work}/decode_rs.json"))["prompts"]
assert len(pre) == len(dec) == 40, (len(pre), len(dec))
stored = [i for i, x in enumerate(pre) if "error" not in x and not x.get("interrupted")
          and not x.get("unconfirmed")]
missing = [i for i in stored if dec[i]["hit_blocks"] < dec[i]["wanted_blocks"]]
assert not missing, f"reported stored, not in the pool: {missing}"
first = pre[0]  # committed to the killed pool
lost = "committed to the pool before it restarted"
assert first.get("recomputed_after_restart") or (
    first.get("interrupted") and lost in first["interrupt_reason"]), first
print(f"stop after a restart: {len(stored)} of 40 reported stored, all served; prompt 0 "
      f"{'put again' if first.get('recomputed_after_restart') else 'interrupted: ' + lost}")
PY
echo "== pool killed after the run's only commit and restarted at once: the end-of-run check reaches the new pool"
# Newcomer 16b F3: the epoch check at the end of the run was one fail-fast Stats call; right
# after a restart the channel is still in its reconnect backoff, the call was refused and the
# prompt was reported "unconfirmed" though a pool answered a moment later. UNAVAILABLE is now
# asked again (up to 5 s), so the prompt committed to the killed pool is found lost, computed
# and put again into the new one, and reported stored (not unconfirmed). Failed on the old code
# (unconfirmed, recomputed_after_restart absent).
prefill_killing_pool end --revision restart-end-test "${common[@]}" \
  --prompt-file "${demo}/prompts/03_boat.txt" --call-timeout-ms 30000 \
  --report "${work}/prefill_end.json"
start_pool
rc=0
wait "${worker_pid}" || rc=$?
[[ ${rc} -eq 0 ]] || { cat "${work}/prefill_end.log" >&2; fail "prefill with the pool restarted after its only commit: exit ${rc}, want 0"; }
decode_one end restart-end-test --prompt-file "${demo}/prompts/03_boat.txt"
python3 - "${work}" <<'PY' || { cat "${work}/prefill_end.log" >&2; fail "the end-of-run check after a restart"; }
import json, sys
work = sys.argv[1]
p = json.load(open(f"{work}/prefill_end.json"))["prompts"]
assert len(p) == 1 and "error" not in p[0], p
assert not p[0].get("unconfirmed"), p[0]
assert p[0].get("recomputed_after_restart") and p[0]["blocks_written"] == p[0]["blocks"] > 0, p[0]
d = json.load(open(f"{work}/decode_end.json"))["prompts"][0]
assert not d["fallback"] and d["hit_blocks"] == d["wanted_blocks"] > 0, d
print("pool restarted right after the only commit: the prompt was put again into the new pool "
      "and served from it")
PY
echo "== pool restarted mid-prefill, then gone for good: what went with the first pool is lost, the rest unconfirmed"
# Newcomer 16b F2: with no answer at the end of the run every committed prompt was reported
# "unconfirmed", also those committed to the first pool, which the node had seen restart (it
# registered with the second): they are not stored, whatever the second pool's fate. They are now
# errors (exit 2) naming the restart; what went to the second pool stays unconfirmed.
prefill_killing_pool gone --revision gone-test "${common[@]}" "${forty[@]}" \
  --call-timeout-ms 2000 --report "${work}/prefill_gone.json"
start_pool
for _ in $(seq 1 300); do  # until the second pool holds a commit of this run
  [[ $(pool_metric kvpool_commit_bytes_total 2>/dev/null || echo 0) -gt 0 ]] && break
  kill -0 "${worker_pid}" 2>/dev/null || break
  sleep 0.1
done
kill -KILL "${server_pid}" 2>/dev/null
wait "${server_pid}" 2>/dev/null || true
server_pid=""
rc=0
wait "${worker_pid}" || rc=$?
[[ ${rc} -eq 2 ]] || { cat "${work}/prefill_gone.log" >&2; fail "prefill with the restarted pool gone at the end: exit ${rc}, want 2"; }
python3 - "${work}" <<'PY' || { cat "${work}/prefill_gone.log" >&2; fail "prompts of a pool that restarted and then went away"; }
import json, sys
work = sys.argv[1]
p = json.load(open(f"{work}/prefill_gone.json"))["prompts"]
assert len(p) == 40, len(p)
lost = "the restarted pool did not answer at the end of the run: not in the pool"
first = p[0]  # committed to the first pool
assert "error" in first and lost in first["error"], first
stored = [x for x in p if "error" not in x and not x.get("interrupted")]
assert stored, "nothing was committed to the second pool"
assert all(x.get("unconfirmed") for x in stored), [x for x in stored if not x.get("unconfirmed")]
import re
epochs = {re.search(r"\(epoch (\d+)", x["unconfirmed_reason"]).group(1) for x in stored}
was, now = re.search(r"\(epoch (\d+), now (\d+)\)", first["error"]).groups()
assert epochs == {now} and was != now, (epochs, first["error"])
print(f"restarted pool gone at the end: prompt 0 (first pool) lost, {len(stored)} unconfirmed "
      f"(second pool), {sum('error' in x for x in p) - 1} other errors")
PY
start_pool
echo "== the answer of a committed put is lost: the node finds the prompt stored by a Lookup"
# Newcomer 17 F1: with --call-timeout-ms 3 a slow pool's CommitPut answers came too late and the
# prompts were reported failed (exit 2), although the pool had committed them and served them.
# After an unanswered commit the node now asks the pool (Lookup): every block held = stored,
# with the reason in "commit_unanswered". --fault commit-answer-lost drops the first answer.
"${worker_bin}" --role prefill --pool "${pool}" --revision answer-lost-test "${common[@]}" \
  "${prompts[@]}" --fault commit-answer-lost --report "${work}/prefill_al.json" \
  >/dev/null 2>"${work}/prefill_al.log" \
  || { cat "${work}/prefill_al.log" >&2; fail "prefill with a lost commit answer: want exit 0"; }
decode_one al answer-lost-test "${prompts[@]}"
python3 - "${work}" <<'PY' || { cat "${work}/prefill_al.log" >&2; fail "a committed prompt whose answer was lost"; }
import json, sys
work = sys.argv[1]
pre = json.load(open(f"{work}/prefill_al.json"))
p = pre["prompts"]
assert len(p) == 2 and all("error" not in x for x in p), p
assert "DEADLINE_EXCEEDED" in p[0].get("commit_unanswered", ""), p[0]
assert p[0]["blocks_written"] == 0 and "commit_unanswered" not in p[1], p
assert pre["overall"]["failed_prompts"] == 0, pre["overall"]
# Its log line says the written bytes are unknown, not "0 written, 0 bytes" (newcomer 19 F6).
assert "blocks (written unknown: the commit was not answered)" in open(f"{work}/prefill_al.log").read()
for d in json.load(open(f"{work}/decode_al.json"))["prompts"]:
    assert not d["fallback"] and d["hit_blocks"] == d["wanted_blocks"] > 0, d
print("a lost commit answer: the prompt was found stored by a Lookup and served")
PY
echo "== three prefill nodes into a pool with room for about one put: they wait for each other's staging"
# 1 MiB holds one put's staging and forms at a time (a demo prompt: 276480 bytes of staging plus
# about 290 KB of new forms). The refusal names the other open puts' staging, pressure that
# passes: each node waits for room (backoff, up to --call-timeout-ms) instead of failing the
# prompt at once, and commits its own open put before waiting (newcomer report 10 F3: 5, 2 and
# 2 of the 15 prompts failed, in under a second; 20 of 20 for one node in the report's run).
# Its own pool on its own port, ready once it says so (its pid checked).
# Rounds 2 and 3: the three nodes share one model id, so their puts share blocks: a BeginPut
# pins the blocks another node stored, and a put that passed BeginPut's check can be refused at
# its commit ("can no longer hold this put's commit") by what was pinned or begun since. Such a
# put is put again from its recorded K/V, waiting for room (newcomer s10b F1: 2 of 15 prompts
# failed at CommitPut; before the fix 2 of 4 rounds lost 2-3 prompts).
room_round() {  # room_round ROUND MODEL_ID_PREFIX SAME(0|1)
  local round="$1" prefix="$2" same="$3"
  room_port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  "${server_bin}" --listen "127.0.0.1:${room_port}" --metrics-port -1 --ucx-tls tcp --capacity 1MiB \
    >"${work}/server_room${round}.log" 2>&1 &
  room_pid=$!
  for _ in $(seq 1 100); do
    kill -0 "${room_pid}" 2>/dev/null || { cat "${work}/server_room${round}.log" >&2; fail "the 1 MiB pool exited"; }
    grep -q "kvpool-server ready: grpc 127.0.0.1:${room_port} " "${work}/server_room${round}.log" && break
    sleep 0.1
  done
  local all=() pids=() t id
  for f in "${demo}"/prompts/*.txt; do all+=(--prompt-file "$f"); done
  for t in 1 2 3; do
    id="${prefix}${t}"; [[ ${same} == 1 ]] && id="${prefix}"
    "${worker_bin}" --role prefill --pool "127.0.0.1:${room_port}" --model-id "${id}" "${common[@]}" "${all[@]}" \
      --report "${work}/prefill_room${round}_${t}.json" >/dev/null 2>"${work}/prefill_room${round}_${t}.log" &
    pids+=($!)
  done
  rcs=()
  for p in "${pids[@]}"; do rc=0; wait "${p}" || rc=$?; rcs+=("${rc}"); done
  stop_room
  python3 - "${work}" "${round}" "${rcs[@]}" <<'PY' || { cat "${work}"/prefill_room${round}_*.log >&2; fail "prefill nodes sharing a small pool (round ${round})"; }
import json, sys
work, rnd, rcs = sys.argv[1], sys.argv[2], sys.argv[3:]
reps = [json.load(open(f"{work}/prefill_room{rnd}_{t}.json"))["overall"] for t in (1, 2, 3)]
assert rcs == ["0", "0", "0"], (rcs, reps)
assert all(r["failed_prompts"] == 0 for r in reps), reps
refused = sum(open(f"{work}/prefill_room{rnd}_{t}.log").read().count("refused the commit of a")
              for t in (1, 2, 3))
print(f"round {rnd}: three prefill nodes, 1 MiB pool: 15 of 15 prompts stored, "
      f"{sum(r['room_waits'] for r in reps)} put(s) waited for room, {refused} refused at the "
      f"commit and put again")
PY
}
room_round 1 room 0
room_round 2 roomshared 1
room_round 3 roomshared3 1

echo "== a room shortage that does not pass costs the run one --call-timeout-ms, not one per prompt"
# Two prefill nodes die mid-push (--fault prefill-exit-mid-push), each leaving a put open in a
# 1 MiB pool whose put timeout is 10 min: their staging (573440 bytes) holds the room, and
# nothing frees it within the run. The refusals name that staging (RoomHeldByOthers), so the
# first prompt waits its --call-timeout-ms; the others then fail at once, saying why (newcomer
# 11b F8: each of 5 prompts waited its full 3 s, 15.1 s).
# own_pool NAME FLAGS...: a pool of its own on a free port (log ${work}/server_NAME.log), once it
# says it is ready; sets own_port and own_pid.
own_pool() {
  local name="$1"; shift
  own_port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
  "${server_bin}" --listen "127.0.0.1:${own_port}" --metrics-port -1 --ucx-tls tcp "$@" \
    >"${work}/server_${name}.log" 2>&1 &
  own_pid=$!
  for _ in $(seq 1 100); do
    grep -q "kvpool-server ready: grpc 127.0.0.1:${own_port} " "${work}/server_${name}.log" && break
    sleep 0.1
  done
}
own_pool stuck --capacity 1MiB --put-timeout-ms 600000
stuck_port=${own_port}; room_pid=${own_pid}
for f in 01_kite 02_garden; do
  "${worker_bin}" --role prefill --pool "127.0.0.1:${stuck_port}" --model-id stuck "${common[@]}" \
    --prompt-file "${demo}/prompts/${f}.txt" --fault prefill-exit-mid-push >/dev/null 2>"${work}/stuck_${f}.log" \
    && fail "prefill --fault prefill-exit-mid-push ${f} did not die"
done
all=(); for f in "${demo}"/prompts/*.txt; do all+=(--prompt-file "$f"); done
t0=$(date +%s%N); rc=0
"${worker_bin}" --role prefill --pool "127.0.0.1:${stuck_port}" --model-id stuck "${common[@]}" "${all[@]}" \
  --call-timeout-ms 1500 --report "${work}/prefill_stuck.json" >/dev/null 2>"${work}/prefill_stuck.log" || rc=$?
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
stop_room
python3 - "${work}" "${rc}" "${ms}" <<'PY' || { cat "${work}/prefill_stuck.log" >&2; fail "a room shortage that does not pass"; }
import json, sys
work, rc, ms = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = json.load(open(f"{work}/prefill_stuck.json"))
o = d["overall"]
log = open(f"{work}/prefill_stuck.log").read()
assert rc == 2 and o["failed_prompts"] == 5, (rc, o)
# One wait for the run, not one per prompt; the other four say why they did not wait.
assert o["room_waits"] == 1, o
assert log.count("no room came within the whole 1500 ms of waiting") == 1, log
errors = [p["error"] for p in d["prompts"]]
assert all(e.startswith("RESOURCE_EXHAUSTED") for e in errors), errors
assert sum("(not waited for: an earlier prompt waited the whole 1500 ms" in e for e in errors) == 4, errors
print(f"a shortage that does not pass: 5 prompts failed after {ms} ms, 1 room wait of 1500 ms, 4 not waited for")
PY
echo "== a pool stopped for 3 s mid-run (--call-timeout-ms 2000): the puts its stop cut off are put again"
# Newcomer 19 F1: the prompt whose CommitPut met the stop failed at its deadline, and so did the
# next one, whose WritePut (sent during the stop) timed out a second after the pool answered
# again; both had their K/V recorded. A call the pool did not answer is now put again once
# (unless the pool holds every block).
own_pool paused
paused_pid=${own_pid}; room_pid=${own_pid}
thirty=()
for r in 1 2 3 4 5 6; do
  for f in "${demo}"/prompts/*.txt; do
    printf 'Story %s of %s. ' "${r}" "$(basename "${f}" .txt)" >"${work}/paused_${r}_$(basename "${f}")"
    cat "${f}" >>"${work}/paused_${r}_$(basename "${f}")"
    thirty+=(--prompt-file "${work}/paused_${r}_$(basename "${f}")")
  done
done
"${worker_bin}" --role prefill --pool "127.0.0.1:${own_port}" --model-id paused "${common[@]}" \
  "${thirty[@]}" --call-timeout-ms 2000 --report "${work}/prefill_paused.json" >/dev/null \
  2>"${work}/prefill_paused.log" &
worker_pid=$!
wait_for_line " tokens, " "${work}/prefill_paused.log"  # the first prompt is stored
kill -STOP "${paused_pid}"; sleep 3; kill -CONT "${paused_pid}"
rc=0
wait "${worker_pid}" || rc=$?
stop_room
python3 - "${work}" "${rc}" <<'PY' || { cat "${work}/prefill_paused.log" >&2; fail "a pool stopped for 3 s mid-run"; }
import json, sys
work, rc = sys.argv[1], int(sys.argv[2])
o = json.load(open(f"{work}/prefill_paused.json"))["overall"]
log = open(f"{work}/prefill_paused.log").read()
assert rc == 0 and o["failed_prompts"] == 0, (rc, o)
assert o["reput_prompts"] >= 1 and "got no answer from the pool within --call-timeout-ms" in log, o
print(f"a pool stopped for 3 s: 30 of 30 prompts stored, {o['reput_prompts']} put again")
PY
echo "== a put timeout too short for any put: every prompt's error says it expired again and which flag"
# Newcomer 18 F4: a prompt whose put expired was put again, and when the second put's own
# timeout ran out while it was written (the pool's pull failed, or its connection), the error
# lacked the "(it expired again when put a second time ...)" explanation that names the flag.
own_pool short
room_pid=${own_pid}
rc=0
"${worker_bin}" --role prefill --pool "127.0.0.1:${own_port}" --model-id short "${common[@]}" \
  --prompt-file "${demo}/prompts/01_kite.txt" --prompt-file "${demo}/prompts/02_garden.txt" \
  --prompt-file "${demo}/prompts/03_boat.txt" --put-timeout-ms 1 \
  --report "${work}/prefill_short.json" >/dev/null 2>"${work}/prefill_short.log" || rc=$?
stop_room
python3 - "${work}" "${rc}" <<'PY' || { cat "${work}/prefill_short.log" >&2; fail "a put timeout too short for any put"; }
import json, sys
work, rc = sys.argv[1], int(sys.argv[2])
d = json.load(open(f"{work}/prefill_short.json"))
assert rc == 2 and d["overall"]["failed_prompts"] == 3, (rc, d["overall"])
errors = [p["error"] for p in d["prompts"]]
assert all("(it expired again when put a second time from the recorded K/V: " in e and
           "longer than the put timeout of 1 ms that kvpool-worker --put-timeout-ms asks for" in e
           for e in errors), errors
# The first expiry's warning names this node's flag, not only the pool's (newcomer 19 F4).
log = open(f"{work}/prefill_short.log").read()
assert "expired in the pool after the 1 ms this node asks for (kvpool-worker --put-timeout-ms)" in log, log
print("a 1 ms put timeout: 3 prompts failed, each saying it expired again and naming --put-timeout-ms")
PY
echo "== --max-put-blocks: a prefix given first in the same run lets the whole prompt through"
# Newcomer 16 F4: the refusal says "put a prefix with at most that many new blocks first", but
# the node opens prompt i+1's put before it commits prompt i, so the prefix's blocks did not
# count as held yet and the whole prompt was refused within one run. The node now commits its
# put in flight and asks once more.
own_pool limit --capacity 64MiB --max-put-blocks 20
lim_port=${own_port}; room_pid=${own_pid}  # room_pid: stopped by the cleanup trap too
head -c 300 "${demo}/prompts/01_kite.txt" >"${work}/kite_prefix.txt"  # 8 blocks of the 27
rc=0
"${worker_bin}" --role prefill --pool "127.0.0.1:${lim_port}" --model-id limit "${common[@]}" \
  --prompt-file "${work}/kite_prefix.txt" --prompt-file "${demo}/prompts/01_kite.txt" \
  --report "${work}/prefill_limit.json" >/dev/null 2>"${work}/prefill_limit.log" || rc=$?
stop_room
python3 - "${work}" "${rc}" <<'PY' || { cat "${work}/prefill_limit.log" >&2; fail "a prefix first under --max-put-blocks"; }
import json, sys
work, rc = sys.argv[1], int(sys.argv[2])
p = json.load(open(f"{work}/prefill_limit.json"))["prompts"]
assert rc == 0 and all("error" not in x for x in p), (rc, p)
assert p[1]["blocks"] == 27 and p[1]["blocks_written"] <= 20, p[1]
print(f"--max-put-blocks 20: the {p[0]['blocks']}-block prefix, then the {p[1]['blocks']}-block "
      f"prompt writing {p[1]['blocks_written']}, in one run")
PY
echo "== a lease shorter than any fetch (--lease-ms 1): the fallback says no byte was used"
# Newcomer 20 F1: the reason read "lease expired ... the 0 bytes read are discarded", and each
# expired lease's release logged a warning.
own_pool lease --capacity 64MiB --lease-ms 1 --max-lease-ms 1 --tick-ms 1
room_pid=${own_pid}
"${worker_bin}" --role prefill --pool "127.0.0.1:${own_port}" --model-id lease "${common[@]}" "${prompts[@]}" \
  >/dev/null 2>"${work}/prefill_lease.log" || { cat "${work}/prefill_lease.log" >&2; fail "prefill into the 1 ms-lease pool"; }
rc=0
"${worker_bin}" --role decode --pool "127.0.0.1:${own_port}" --model-id lease "${common[@]}" "${prompts[@]}" \
  --teacher-force false --report "${work}/decode_lease.json" >/dev/null 2>"${work}/decode_lease.log" || rc=$?
stop_room
python3 - "${work}" "${rc}" <<'PY' || { cat "${work}/decode_lease.log" >&2; fail "a lease shorter than any fetch"; }
import json, sys
work, rc = sys.argv[1], int(sys.argv[2])
d = json.load(open(f"{work}/decode_lease.json"))
ev = json.load(open(f"{work}/eval.json"))
log = open(f"{work}/decode_lease.log").read()
assert rc == 0, rc
fell = 0
for i, p in enumerate(d["prompts"]):
    assert p["tokens"] == ev["prompts"][i]["configs"]["int2_S64_W256"]["greedy_tokens"], p["name"]
    if p["fallback"]:
        fell += 1
        # Expired before the fetch began ("lease: expired (renew ...)", a loaded host) or during it.
        assert "lease: expired" in p["fallback_reason"], p["fallback_reason"]
        assert "the 0 bytes" not in p["fallback_reason"], p["fallback_reason"]
assert " W release of lease" not in log, log
print(f"1 ms leases: {fell} of {len(d['prompts'])} prompts computed locally, tokens as the single-process run, no release warning")
PY
echo "== a decode worker started before its pool: it registers when the pool comes, and is served"
# Newcomer 19 F3 (decode side): a decode worker that found no pool at start-up computed every
# prompt locally for the rest of its run.
late_port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
many=()
for _ in $(seq 1 10); do for f in 01_kite 02_garden 03_boat 04_cat; do many+=(--prompt-file "${demo}/prompts/${f}.txt"); done; done
"${worker_bin}" --role decode --pool "127.0.0.1:${late_port}" --model-id late --model "${model}" \
  --rotations "${work}/rot.safetensors" --max-new-tokens 8 "${many[@]}" --teacher-force false --report "${work}/decode_late.json" >/dev/null 2>"${work}/decode_late.log" &
worker_pid=$!
wait_for_line "not usable" "${work}/decode_late.log"
"${server_bin}" --listen "127.0.0.1:${late_port}" --metrics-port -1 --ucx-tls tcp --capacity 64MiB \
  >"${work}/server_late.log" 2>&1 &
room_pid=$!
rc=0
wait "${worker_pid}" || rc=$?
stop_room
python3 - "${work}" "${rc}" <<'PY' || { cat "${work}/decode_late.log" >&2; fail "a decode worker started before its pool"; }
import json, sys
work, rc = sys.argv[1], int(sys.argv[2])
p = json.load(open(f"{work}/decode_late.json"))["prompts"]
log = open(f"{work}/decode_late.log").read()
assert rc == 0 and len(p) == 40, (rc, len(p))
assert p[0]["fallback"] and "pool unreachable at start-up" in p[0]["fallback_reason"], p[0]
assert not p[-1]["fallback"], p[-1]
assert "answered after" in log, log
by = {}
for x in p: by.setdefault(x["name"], set()).add(tuple(x["tokens"]))
assert all(len(v) == 1 for v in by.values()), {k: len(v) for k, v in by.items()}
fell = sum(x["fallback"] for x in p)
print(f"a decode worker started before its pool: {fell} of 40 prompts computed locally, then looked up; same tokens either way")
PY
echo "PASS"
