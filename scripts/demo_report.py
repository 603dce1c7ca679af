#!/usr/bin/env python3
"""The report of scripts/demo.sh (docs/WORKER.md "Measured").

Usage: demo_report.py OUT_DIR STAGES_JSON
Reads OUT_DIR/eval.json, prefill.json and decode.json (kvpool-worker reports), prints the
per-prompt and overall tables, writes OUT_DIR/report.json; exits non-zero when a pool-served
continuation differs from the single-process run. Python standard library only.
"""
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
rows = [(c, ev["overall"][c]) for c in configs]
if ov.get("teacher_forced"):
    rows.append(("pool " + pool_cfg, ov["teacher_forced"]))
# The label column fits the longest label ("pool int2_S64_W256" is 18 characters: a fixed 16
# pushed that row's numbers one column right of the others).
width = max(len("config"), *(len(label) for label, _ in rows))
print(f"   {'config':<{width}} {'agreement':>9} {'ppl ratio':>10} {'positions':>9}")
for label, r in rows:
    print(f"   {label:<{width}} {fmt(r['agreement'], '.3f'):>9} {fmt(r['ppl_ratio'], '.4f'):>10} {r['positions']:>9}")
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
