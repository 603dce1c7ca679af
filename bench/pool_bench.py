#!/usr/bin/env python3
"""pool_bench.py — kvpool put/fetch next to ucx_perftest on the same transport, in one run.

For each UCX transport (default: tcp and posix,cma) it starts kvpool-server on a free loopback
port, runs pool_bench against it (put / fetch of one block of 16 KiB … 4 MiB through the C++
client, commit throughput, lookup p99 with 16 clients), then runs ucx_perftest (ucp_put_bw and
ucp_get) with the same UCX_TLS and message sizes, and ucp_rotating_bench (a UCX put/get of one
buffer at a time over buffers no earlier operation touched within a 1 GiB ring, i.e. not in any
cache; bench/ucp_rotating_bench.cc), and prints a table with the ratio
kvpool / ucx_perftest, then a second with the ratio kvpool / ucp_rotating_bench ("fresh"): data-phase numbers (what ucx_perftest's numbers compare with: it times
only transfers) and end-to-end numbers (with the control RPCs) side by side. Results go to
bench/results/pool_bench_<tls>[_<tag>].json. The last columns are the measuring thread's minor page
faults per put data phase / first fetch (pool_bench counts them with getrusage) and the bench
process's CPU time per iteration (copy threads included). "put async" is the put through
PutSession::WriteLayerAsync (pool_bench --async-put, on by default; absent for builds without it).

    bench/pool_bench.py --build build [--tls tcp --tls posix,cma] [--iters 50] [--repeat 3]
                        [--sizes-kib 64,256,1024,4096] [--tag NAME] [--bench-flag=--map-shared-memory=false]

--inflight D (default 8; 0 = none) adds a third table: D clients, one thread each, putting and
fetching fresh sequences at the same time (the matched comparison with ucp_put_bw, which keeps
many puts in flight), labelled with the threads used and the CPU per MiB, next to the
ucx_perftest numbers of the same run; it never replaces the one-at-a-time columns. It runs after
every repeat and baseline of the transport (pool_bench --only-inflight, a fresh server and
process per repeat, medians), so its load never precedes a one-at-a-time measurement or a
baseline; builds whose pool_bench has no --only-inflight skip it with a note.

Each transport is measured --repeat times (a fresh server each time, ucx_perftest and
ucp_rotating_bench after each pool_bench run) and the medians are reported: on a shared machine single runs are noisy.

Standard library only. Exit codes: 0 ok, 1 usage, 2 runtime error.
"""
import argparse
import json
import os
import platform
import re
import select
import socket
import subprocess
import sys
import time
from statistics import median

SIZES_KIB = [16, 64, 256, 1024, 4096]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(build, tls, capacity, extra):
    cmd = [os.path.join(build, "bin", "kvpool-server"), "--listen", "127.0.0.1:0",
           "--metrics-port", "-1", "--ucx-tls", tls, "--capacity", capacity,
           "--drain-ms", "0"] + list(extra)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""
    m = re.search(r"grpc_port=(\d+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"kvpool-server did not start (got {line!r})")
    return proc, int(m.group(1))


def perftest(tls, test, size, iters, warmup):
    """Runs one ucx_perftest pair; returns (bandwidth bytes/s, p50 latency us)."""
    env = dict(os.environ, UCX_TLS=tls)
    port = free_port()
    server = subprocess.Popen(["ucx_perftest", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        out = subprocess.run(["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", test,
                              "-s", str(size), "-n", str(iters), "-w", str(warmup)],
                             env=env, capture_output=True, text=True, timeout=300).stdout
    finally:
        server.kill()
        server.wait()
    for line in out.splitlines():
        if line.startswith("Final:"):
            f = line.split()
            # Final: iters p50_lat avg_lat overall_lat bw_avg(MB/s) bw_overall msgrate...
            return float(f[5]) * 1024 * 1024, float(f[2])
    raise RuntimeError(f"ucx_perftest {test} {size}: no Final line:\n{out}")


def rotating(binary, tls, sizes_kib, iters, warmup, ring_mib):
    """Runs ucp_rotating_bench once for every size; returns {bytes: {...}} with the fresh-buffer
    put/get GB/s and p50, and its one-buffer ("same", ucx_perftest's setting) numbers."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([binary, "--ucx-tls", tls, "--sizes-kib", sizes_kib, "--iters", str(iters),
                        "--warmup", str(warmup), "--ring-mib", str(ring_mib), "--json", f.name],
                       check=True, capture_output=True, text=True, timeout=300)
        res = json.load(open(f.name))
    out = {}
    for r in res["results"]:
        d = out.setdefault(r["bytes"], {"ring_bytes_per_side": res["ring_bytes_per_side"]})
        pre = "" if r["ring"] == "fresh" else "same_"
        d[f"{pre}{r['test']}_gbps"] = r["gbps"]
        d[f"{pre}{r['test']}_p50_us"] = r["p50_us"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build", help="build directory (bin/ holds the binaries)")
    ap.add_argument("--tls", action="append", help="UCX_TLS values (repeatable)")
    ap.add_argument("--iters", type=int, default=50, help="timed puts/fetches per size")
    ap.add_argument("--perftest-iters", type=int, default=200, help="ucx_perftest iterations")
    ap.add_argument("--capacity", default="1GiB", help="kvpool-server --capacity")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of pool_bench and ucx_perftest per transport; medians reported")
    ap.add_argument("--sizes-kib", default=",".join(str(x) for x in SIZES_KIB),
                    help="comma-separated transfer sizes in KiB")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--bench-flag", action="append",
                    help="extra pool_bench flag (repeatable), e.g. "
                         "--bench-flag=--map-shared-memory=false")
    ap.add_argument("--rotating-bench", default=None,
                    help="ucp_rotating_bench binary (default: BUILD/bin/ucp_rotating_bench, "
                         "skipped with a note when that does not exist; 'none' = no "
                         "fresh-buffer baseline)")
    ap.add_argument("--ring-mib", type=int, default=1024,
                    help="ucp_rotating_bench --ring-mib (buffers per side; keep it well above "
                         "the last-level cache)")
    ap.add_argument("--inflight", type=int, default=8,
                    help="clients of the in-flight table (pool_bench --only-inflight "
                         "--inflight-clients D, one thread each); 0 = none")
    ap.add_argument("--server-flag", action="append",
                    help="extra kvpool-server flag (repeatable), e.g. --server-flag=--transfer-"
                         "initiator=client")
    args = ap.parse_args()
    # Loopback only for kvpool and ucx_perftest alike (UCX's tcp would add an eth0 lane).
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    tls_list = args.tls or ["tcp", "posix,cma"]
    bench_bin = os.path.join(args.build, "bin", "pool_bench")
    for b in (bench_bin, os.path.join(args.build, "bin", "kvpool-server")):
        if not os.path.exists(b):
            print(f"--build: {b} does not exist", file=sys.stderr)
            return 1
    rot_bin = args.rotating_bench
    if rot_bin is None:
        # A build from before session 9 has no ucp_rotating_bench: run without the second
        # baseline (said in the output) instead of refusing, so old builds still compare.
        rot_bin = os.path.join(args.build, "bin", "ucp_rotating_bench")
        if not os.path.exists(rot_bin):
            print(f"note: {rot_bin} does not exist; no fresh-buffer baseline in this run "
                  "(--rotating-bench PATH names one)", file=sys.stderr)
            rot_bin = "none"
    elif rot_bin != "none" and not os.path.exists(rot_bin):
        print(f"--rotating-bench: {rot_bin} does not exist ('none' to run without it)",
              file=sys.stderr)
        return 1
    os.makedirs(args.results, exist_ok=True)
    inflight = args.inflight
    if inflight > 0:
        helptext = subprocess.run([bench_bin, "--help"], capture_output=True, text=True).stdout
        if "--only-inflight" not in helptext:
            print(f"note: {bench_bin} has no --only-inflight (an older build): no in-flight table",
                  file=sys.stderr)
            inflight = 0
    for tls in tls_list:
        suffix = f"_{args.tag}" if args.tag else ""
        json_path = os.path.join(args.results,
                                 f"pool_bench_{tls.replace(',', '_')}{suffix}.json")

        def run_bench(rep_path, extra):
            """One pool_bench run against a fresh server; its JSON, or None after printing why."""
            server, port = start_server(args.build, tls, args.capacity, args.server_flag or [])
            try:
                r = subprocess.run([bench_bin, "--server", f"127.0.0.1:{port}", "--ucx-tls", tls,
                                    "--json", rep_path, "--sizes-kib", args.sizes_kib] + extra +
                                   (args.bench_flag or []),
                                   capture_output=True, text=True, timeout=1200)
            finally:
                server.kill()
                server.wait()
            if r.returncode != 0:
                print(r.stdout, r.stderr, sep="\n", file=sys.stderr)
                return None
            with open(rep_path) as f:
                res = json.load(f)
            os.remove(rep_path)
            return res

        runs = []
        for rep in range(args.repeat):
            res = run_bench(json_path + f".rep{rep}", ["--iters", str(args.iters)])
            if res is None:
                return 2
            for t in res["transfers"]:
                size = t["bytes"]
                put_bw, put_lat = perftest(tls, "ucp_put_bw", size, args.perftest_iters, 10)
                get_bw, get_lat = perftest(tls, "ucp_get", size, args.perftest_iters, 10)
                t["perftest"] = {"ucp_put_bw_gbps": put_bw / 1e9, "ucp_put_bw_p50_us": put_lat,
                                 "ucp_get_gbps": get_bw / 1e9, "ucp_get_p50_us": get_lat}
            if rot_bin != "none":
                rot = rotating(rot_bin, tls, args.sizes_kib, args.perftest_iters, 10,
                               args.ring_mib)
                for t in res["transfers"]:
                    t["fresh"] = rot[t["bytes"]]
            runs.append(res)
        # The in-flight passes, after every repeat and baseline above.
        inflight_runs = []
        for rep in range(args.repeat if inflight > 0 else 0):
            res = run_bench(json_path + f".inflight{rep}",
                            ["--only-inflight=true", "--inflight-clients", str(inflight)])
            if res is None:
                return 2
            inflight_runs.append(res)
        # Medians over the repeats, metric by metric (kvpool and ucx_perftest alike); each
        # repeat is kept under "repeats".
        res = json.loads(json.dumps(runs[0]))
        for i, t in enumerate(res["transfers"]):
            for k, v in t.items():
                if isinstance(v, float):
                    t[k] = median([r["transfers"][i][k] for r in runs])
            for k in t["perftest"]:
                t["perftest"][k] = median([r["transfers"][i]["perftest"][k] for r in runs])
            if inflight_runs:
                fl = [r["transfers"][i] for r in inflight_runs]
                for k, v in fl[0].items():
                    if "inflight" in k:
                        t[k] = median([x[k] for x in fl]) if isinstance(v, float) else v
            p = t["perftest"]
            if "fresh" in t:
                for k in t["fresh"]:
                    t["fresh"][k] = median([r["transfers"][i]["fresh"][k] for r in runs])
            fr = t.get("fresh")
            for k in list(t):
                if k.endswith("_gbps") and not k.startswith("perftest"):
                    base = p["ucp_put_bw_gbps"] if k.startswith("put") else p["ucp_get_gbps"]
                    t[k.replace("_gbps", "_ratio")] = t[k] / base if base > 0 else None
                    if fr is not None:
                        fb = fr["put_gbps"] if k.startswith("put") else fr["get_gbps"]
                        t[k.replace("_gbps", "_ratio_fresh")] = t[k] / fb if fb > 0 else None
        for sect in ("commit", "lookup"):
            for k, v in res[sect].items():
                if isinstance(v, float):
                    res[sect][k] = median([r[sect][k] for r in runs])
        res["repeats"] = runs
        res["inflight_repeats"] = inflight_runs
        res["repeat_count"] = args.repeat
        res["statistic"] = "median over repeats (each repeat: mean bandwidth, p50/p99 latency)"
        res["perftest_iters"] = args.perftest_iters
        res["fresh_baseline"] = (None if rot_bin == "none" else
                                 {"binary": "ucp_rotating_bench", "ring_mib": args.ring_mib,
                                  "iters": args.perftest_iters, "in_flight": 1})
        res["python"] = platform.python_version()
        res["load_average_1m_at_end"] = os.getloadavg()[0]
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
        loads = [r.get("load_average_1m_at_start", 0) for r in runs]
        print(f"\n== UCX_TLS={tls}: median of {args.repeat} runs (load average at the starts "
              f"{', '.join(f'{x:.1f}' for x in loads)}, at the end "
              f"{res['load_average_1m_at_end']:.1f}, on {res['hardware_threads']} hardware "
              f"threads; transfers initiated by the "
              f"{'pool' if res['transfers'][0].get('pool_initiated') else 'client'}) ==")
        def ratio(t, k):
            r = t.get(k.replace("_gbps", "_ratio"))
            return f"{t[k]:7.3f} ({r:4.2f})" if r is not None else f"{t[k]:7.3f} (  - )"
        cols = [("put data", "put_gbps"), ("put async", "put_async_gbps"),
                ("put e2e", "put_e2e_gbps"),
                ("put+commit", "put_commit_gbps"), ("fetch", "fetch_gbps"),
                ("fetch warm", "fetch_warm_gbps"), ("no xxh3", "fetch_unverified_gbps"),
                ("fetch e2e", "fetch_e2e_gbps"), ("raw get", "raw_get_gbps")]
        print("GB/s (ratio to ucx_perftest of the same run: puts / ucp_put_bw, fetches and raw "
              "get / ucp_get); path: " + res["transfers"][0].get("data_path", "?"))
        print(f"{'size':>9} | " + " | ".join(f"{c:>14}" for c, _ in cols) +
              f" | {'ucp_put_bw':>10} {'ucp_get':>8} | {'put p50/p99 us':>15} "
              f"{'async p50/p99 us':>17} {'fetch p50/p99 us':>17} | page faults put/fetch"
              f" | cpu ms/iter")
        for t in res["transfers"]:
            p = t["perftest"]
            cells = [ratio(t, k) if k in t else f"{'-':>14}" for _, k in cols]
            print(f"{t['bytes'] // 1024:>5} KiB | " + " | ".join(cells) +
                  f" | {p['ucp_put_bw_gbps']:10.3f} {p['ucp_get_gbps']:8.3f} | "
                  f"{t['put_p50_us']:7.1f}/{t['put_p99_us']:<7.1f} "
                  f"{t.get('put_async_p50_us', float('nan')):8.1f}/"
                  f"{t.get('put_async_p99_us', float('nan')):<8.1f} "
                  f"{t['fetch_p50_us']:8.1f}/{t['fetch_p99_us']:<8.1f} | "
                  f"{t.get('put_minor_faults_per_iter', float('nan')):.1f}/"
                  f"{t.get('fetch_minor_faults_per_iter', float('nan')):.1f} | "
                  f"{t.get('cpu_us_per_iter', float('nan')) / 1e3:.3f}")
        if "fresh" in res["transfers"][0]:
            print("GB/s (ratio to ucp_rotating_bench of the same run, one operation in flight over "
                  "buffers not in any cache: puts / its put, fetches / its get); 'same' = the "
                  "same binary reusing one buffer (ucx_perftest's setting)")
            fcols = [("put data", "put_gbps"), ("put async", "put_async_gbps"),
                     ("fetch", "fetch_gbps"), ("fetch warm", "fetch_warm_gbps")]
            print(f"{'size':>9} | " + " | ".join(f"{c:>14}" for c, _ in fcols) +
                  f" | {'fresh put':>9} {'fresh get':>9} | {'same put':>8} {'same get':>8} | "
                  f"{'fresh put/get p50 us':>20}")
            for t in res["transfers"]:
                fr = t["fresh"]
                cells = []
                for _, k in fcols:
                    r = t.get(k.replace("_gbps", "_ratio_fresh"))
                    cells.append(f"{t[k]:7.3f} ({r:4.2f})" if k in t and r is not None
                                 else f"{'-':>14}")
                print(f"{t['bytes'] // 1024:>5} KiB | " + " | ".join(cells) +
                      f" | {fr['put_gbps']:9.3f} {fr['get_gbps']:9.3f} | "
                      f"{fr['same_put_gbps']:8.3f} {fr['same_get_gbps']:8.3f} | "
                      f"{fr['put_p50_us']:9.1f}/{fr['get_p50_us']:<9.1f}")
        if "put_inflight_gbps" in res["transfers"][0]:
            t0 = res["transfers"][0]
            print(f"In flight (an additional measurement; the tables above are one operation at a "
                  f"time): {t0['inflight_clients']} clients in the bench process, "
                  f"{t0['inflight_threads']} threads in all (copy_threads "
                  f"{t0['inflight_copy_threads']} each), each putting and then fetching its own "
                  f"fresh sequences back to back, all clients started together per window; GB/s = "
                  f"bytes of all windows / their time (put: WriteLayer -> Flush, no BeginPut, no "
                  f"CommitPut; fetch: the first verified Fetch after the commit); ratio to "
                  f"ucx_perftest of the same run; CPU = the bench process's over the windows, us "
                  f"per MiB moved (ucx_perftest: one core copying, at least 2^20 / its bytes per "
                  f"us)")
            print(f"{'size':>9} | {'put in flight':>14} | {'fetch in flight':>15} | {'per window':>10} "
                  f"| {'put p50/p99 us':>15} {'fetch p50/p99 us':>17} | {'cpu us/MiB put':>14} "
                  f"{'fetch':>6} | {'ucp_put_bw':>10} {'ucp_get':>8} | {'1 core us/MiB put/get':>21}")
            for t in res["transfers"]:
                p = t["perftest"]
                pr = t.get("put_inflight_ratio")
                fr_ = t.get("fetch_inflight_ratio")
                core = lambda g: 2**20 / (g * 1e3) if g > 0 else float("nan")
                print(f"{t['bytes'] // 1024:>5} KiB | {t['put_inflight_gbps']:7.3f} ({pr or 0:4.2f}) | "
                      f"{t['fetch_inflight_gbps']:8.3f} ({fr_ or 0:4.2f}) | "
                      f"{t['inflight_per_window']:>10} | "
                      f"{t['put_inflight_p50_us']:7.1f}/{t['put_inflight_p99_us']:<7.1f} "
                      f"{t['fetch_inflight_p50_us']:8.1f}/{t['fetch_inflight_p99_us']:<8.1f} | "
                      f"{t['put_inflight_cpu_us_per_mib']:14.0f} "
                      f"{t['fetch_inflight_cpu_us_per_mib']:6.0f} | "
                      f"{p['ucp_put_bw_gbps']:10.3f} {p['ucp_get_gbps']:8.3f} | "
                      f"{core(p['ucp_put_bw_gbps']):10.1f}/{core(p['ucp_get_gbps']):<10.1f}")
        c = res["commit"]
        print(f"commit (rotate + INT2 quantize on the pool, {c['blocks']} blocks): "
              f"{c['gbps']:.3f} GB/s of BF16 input, p50 {c['p50_ms']:.1f} ms")
        lk = res["lookup"]
        print(f"lookup ({lk['blocks']} blocks, {lk['clients']} concurrent clients): "
              f"p50 {lk['p50_us']:.1f} us, p99 {lk['p99_us']:.1f} us, {lk['rate']:.0f}/s")
        print(f"JSON: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
