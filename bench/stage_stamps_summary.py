#!/usr/bin/env python3
"""stage_stamps_summary.py — where a fetch's and an asynchronous put's time goes, from the stamps
of a client built with -DKVPOOL_STAGE_STAMPS=ON (client/src/stage_stamps.h) and run with
KVPOOL_STAGE_STAMPS_OUT=FILE (e.g. pool_bench --sizes-kib 256, one size per run).

    bench/stage_stamps_summary.py FILE [--json OUT]

Prints p50 / p90 (µs) of every stage of the first fetch after an Acquire, of the warm fetches
(a fetch right after a fetch), and of the WriteLayerAsync puts, plus what the copy threads did
inside them (slots / stream tasks: count, durations, start after publication). Standard library
only.
"""
import argparse
import json
import sys
from collections import defaultdict

EV = {1: "acq_enter", 2: "acq_rpc_done", 3: "acq_exit", 10: "fetch_enter", 11: "lease_checked",
      12: "items", 13: "overlap_checked", 14: "alive_checked", 15: "copy_done", 16: "fetch_exit",
      20: "run_enter", 21: "run_published", 22: "run_done", 23: "slot_begin", 24: "slot_end",
      25: "hint_begin", 26: "hint_end", 27: "task_begin", 28: "task_end", 30: "bp_enter",
      31: "bp_rpc_done", 32: "bp_exit", 40: "wa_enter", 41: "wa_exit", 42: "w_enter",
      43: "w_exit", 44: "flush_enter", 45: "flush_joined", 46: "flush_exit", 47: "wa_ready",
      48: "wa_submitted"}


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--json")
    ap.add_argument("--skip", type=int, default=10, help="first operations of each kind ignored")
    a = ap.parse_args()
    with open(a.file) as f:
        head = f.readline().split()
        per_us = float(head[1])
        ev = defaultdict(list)  # thread -> [(tsc, name, arg)]
        for line in f:
            t, tsc, e, arg = line.split()
            ev[int(t)].append((int(tsc), EV.get(int(e), e), int(arg)))
    us = lambda d: d / per_us
    # Every slot / task / hint of every thread, for the windows below.
    work = []  # (begin, end, thread, kind)
    work_arg = {}  # work entry -> its stamps' arg (slot / task index)
    for th, es in ev.items():
        open_ = {}
        for tsc, name, arg in es:
            if name in ("slot_begin", "task_begin", "hint_begin"):
                open_[name[:-6]] = tsc
            elif name in ("slot_end", "task_end", "hint_end"):
                k = name[:-4]
                if k in open_:
                    w = (open_.pop(k), tsc, th, k)
                    work.append(w)
                    work_arg[w] = arg
    work.sort()
    stages = defaultdict(list)
    out = {}

    def in_window(lo, hi, kind):
        return [w for w in work if w[3] == kind and w[0] >= lo and w[1] <= hi]

    fetch_kinds = {"first": [], "warm": []}
    put_async = []
    for th, es in ev.items():
        prev = None
        i = 0
        cpu = {}  # the CPU args of the last acq_enter / acq_rpc_done / bp_enter / bp_rpc_done
        while i < len(es):
            tsc, name, arg = es[i]
            if name in ("acq_enter", "acq_rpc_done", "bp_enter", "bp_rpc_done"):
                cpu[name] = arg
            if name == "fetch_enter":
                j = i
                marks = {}
                while j < len(es) and es[j][1] != "fetch_exit":
                    marks.setdefault(es[j][1], es[j][0])
                    j += 1
                if j < len(es):
                    marks["fetch_exit"] = es[j][0]
                    kind = "first" if prev == "acq_exit" else ("warm" if prev == "fetch_exit" else None)
                    if kind:
                        moved = (cpu.get("acq_enter") != cpu.get("acq_rpc_done")) if kind == "first" else None
                        fetch_kinds[kind].append((marks, th, moved))
                    prev = "fetch_exit"
                    i = j + 1
                    continue
            if name == "wa_enter" and arg == 0:
                # an asynchronous put: to the next flush_exit on this thread
                j = i
                marks = {"first_wa_enter": tsc}
                calls = []
                submitted = {}  # layer -> its wa_submitted stamp (session 13 stamps)
                open_call = None
                while j < len(es) and es[j][1] != "flush_exit":
                    n2 = es[j][1]
                    if n2 == "wa_enter":
                        open_call = es[j][0]
                    elif n2 == "wa_exit" and open_call is not None:
                        calls.append((open_call, es[j][0]))
                    elif n2 == "wa_submitted":
                        submitted[es[j][2]] = es[j][0]
                        marks.setdefault(n2, es[j][0])
                    else:
                        marks.setdefault(n2, es[j][0])
                    j += 1
                if j < len(es):
                    marks["flush_exit"] = es[j][0]
                    marks["submitted"] = submitted
                    put_async.append((marks, calls, th, cpu.get("bp_enter") != cpu.get("bp_rpc_done")))
                    prev = "flush_exit"
                    i = j + 1
                    continue
            prev = name
            i += 1

    def fetch_report(kind, lst):
        lst = lst[a.skip:]
        rep = {"count": len(lst)}
        order = ["fetch_enter", "lease_checked", "items", "overlap_checked", "alive_checked",
                 "run_enter", "run_published", "run_done", "copy_done", "fetch_exit"]
        st = defaultdict(list)
        slots_caller, slot_dur, first_start, hints_done, hint_lead = [], [], [], [], []
        for marks, th, moved in lst:
            st["total"].append(us(marks["fetch_exit"] - marks["fetch_enter"]))
            if moved is not None:
                # Session 13: whether the caller came back from the Acquire RPC on another CPU.
                tag = "moved" if moved else "same cpu"
                st[f"total ({tag})"].append(us(marks["fetch_exit"] - marks["fetch_enter"]))
                if "run_published" in marks:
                    st[f"enter->run_published ({tag})"].append(
                        us(marks["run_published"] - marks["fetch_enter"]))
            last = None
            for o in order:
                if o in marks:
                    if last is not None:
                        st[f"{last}->{o}"].append(us(marks[o] - marks[last]))
                    last = o
            if "run_published" in marks and "run_done" in marks:
                ws = in_window(marks["run_enter"], marks["run_done"], "slot")
                slots_caller.append(sum(1 for w in ws if w[2] == th))
                slot_dur += [us(w[1] - w[0]) for w in ws]
                starts = defaultdict(lambda: None)
                for w in ws:
                    if w[2] != th and starts[w[2]] is None:
                        starts[w[2]] = w[0]
                for s in starts.values():
                    first_start.append(us(s - marks["run_published"]))
            # hints that ran for this fetch: between the Acquire before it and the run
            hs = [w for w in work if w[3] == "hint" and w[1] <= marks.get("run_done", 0)
                  and w[0] >= marks["fetch_enter"] - int(50 * per_us)]
            hints_done.append(len(hs))
            hint_lead += [us(marks.get("run_published", marks["fetch_exit"]) - w[1]) for w in hs]
        for k, v in st.items():
            rep[k] = {"p50": pct(v, 0.5), "p90": pct(v, 0.9)}
        moved = [m for _, _, m in lst if m is not None]
        if moved:
            rep["caller_moved_cpu_in_acquire_rpc_fraction"] = round(sum(moved) / len(moved), 3)
        rep["slots_on_caller_p50"] = pct(slots_caller, 0.5)
        rep["slot_us"] = {"p50": pct(slot_dur, 0.5), "p90": pct(slot_dur, 0.9), "n": len(slot_dur)}
        rep["worker_first_slot_after_publish_us"] = {"p50": pct(first_start, 0.5),
                                                     "p90": pct(first_start, 0.9)}
        rep["hints_per_fetch_p50"] = pct(hints_done, 0.5)
        rep["hint_end_before_run_us"] = {"p50": pct(hint_lead, 0.5), "p90": pct(hint_lead, 0.9)}
        return rep

    for kind, lst in fetch_kinds.items():
        out[f"fetch_{kind}"] = fetch_report(kind, lst)
    lst = put_async[a.skip:]
    rep = {"count": len(lst)}
    st = defaultdict(list)
    tasks_caller, task_dur, last_task_after_flush = [], [], []
    task_start_after_submit = []
    for marks, calls, th, moved in lst:
        st["window (first call -> flush returned)"].append(us(marks["flush_exit"] - marks["first_wa_enter"]))
        tag = "moved" if moved else "same cpu"
        st[f"window ({tag} in BeginPut RPC)"].append(us(marks["flush_exit"] - marks["first_wa_enter"]))
        if "wa_ready" in marks:  # the first call's stages (session 13 stamps)
            st["first call: enter -> checks + layout done"].append(us(marks["wa_ready"] - marks["first_wa_enter"]))
            if "wa_submitted" in marks:
                st["first call: Submit"].append(us(marks["wa_submitted"] - marks["wa_ready"]))
        if calls:
            st["first call"].append(us(calls[0][1] - calls[0][0]))
            st["later calls (sum)"].append(sum(us(e - b) for b, e in calls[1:]))
            st["between calls (sum)"].append(sum(us(calls[k + 1][0] - calls[k][1]) for k in range(len(calls) - 1)))
            st["last call -> flush"].append(us(marks["flush_enter"] - calls[-1][1]))
        st["flush: join"].append(us(marks["flush_joined"] - marks["flush_enter"]))
        st["flush: after join"].append(us(marks["flush_exit"] - marks["flush_joined"]))
        ws = in_window(marks["first_wa_enter"], marks["flush_exit"], "task")
        tasks_caller.append(sum(1 for w in ws if w[2] == th))
        task_dur += [us(w[1] - w[0]) for w in ws]
        if ws:
            last_task_after_flush.append(us(max(w[1] for w in ws) - marks["flush_enter"]))
        sub = marks.get("submitted") or {}
        if sub and calls and len(ws) % len(calls) == 0:
            # Each task's start after the Submit that published it (tasks are layer-major, the
            # same number per layer; the task index is the stamp's arg).
            per_layer = len(ws) // len(calls)
            for w in ws:
                at = sub.get(work_arg[w] // per_layer)
                if at is not None:
                    task_start_after_submit.append(us(w[0] - at))
    for k, v in st.items():
        rep[k] = {"p50": pct(v, 0.5), "p90": pct(v, 0.9)}
    if lst:
        rep["caller_moved_cpu_in_beginput_rpc_fraction"] = round(sum(1 for x in lst if x[3]) / len(lst), 3)
    rep["tasks_on_caller_p50"] = pct(tasks_caller, 0.5)
    rep["task_us"] = {"p50": pct(task_dur, 0.5), "p90": pct(task_dur, 0.9), "n": len(task_dur)}
    if task_start_after_submit:
        rep["task_start_after_its_submit_us"] = {"p50": pct(task_start_after_submit, 0.5),
                                                 "p90": pct(task_start_after_submit, 0.9)}
    rep["last_task_end_after_flush_enter_us"] = {"p50": pct(last_task_after_flush, 0.5),
                                                 "p90": pct(last_task_after_flush, 0.9)}
    out["put_async"] = rep
    out["tsc_per_us"] = per_us
    for name, r in out.items():
        if not isinstance(r, dict):
            continue
        print(f"== {name} ({r.get('count')} operations after the first {a.skip})")
        for k, v in r.items():
            if isinstance(v, dict):
                print(f"  {k:<42} p50 {v['p50']:8.2f}  p90 {v['p90']:8.2f}" + (f"  n {v['n']}" if 'n' in v else ""))
            elif k != "count":
                print(f"  {k:<42} {v}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
