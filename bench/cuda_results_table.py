#!/usr/bin/env python3
"""Markdown tables from cuda_decode_bench JSON (bench/results/cuda_*.json).

Usage: cuda_results_table.py cuda_decode_bench.json [more.json ...]
Prints the decode grid (INT2 mixed vs our BF16 kernel vs PyTorch SDPA, all measured in the same
device run) and the write kernels against their memory floor.
"""
import json
import sys


def fmt(x, spec):
    return "—" if x is None or (isinstance(x, (int, float)) and x < 0) else format(x, spec)


def main():
    for path in sys.argv[1:]:
        d = json.load(open(path))
        dev = d.get("device", {})
        print(f"### {path}: {dev.get('name')} ({dev.get('sms')} SMs), git {d.get('git_sha')}, "
              f"pages {d.get('config', {}).get('page_order', 'shuffled')}\n")
        if d.get("decode"):
            print("| B | ctx | q/kv | P | INT2 ms | INT2 GB/s | INT2 % of 4.6 TB/s | BF16 ms | BF16 % | SDPA ms |"
                  " INT2 / BF16 | INT2 / SDPA | BF16 / SDPA | graph ms INT2 / BF16 |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for r in d["decode"]:
                if "skipped" in r:
                    print(f"| {r['batch']} | {r['context']} | {r['hq']}/{r['hkv']} | {r['page']} | skipped: {r['skipped']} |")
                    continue
                i, b, s = r["int2_mixed"], r["bf16"], r.get("sdpa_ms")
                g = ""
                if i.get("graph_ms", -1) > 0:
                    g = f"{i['graph_ms']:.4f} / {b['graph_ms']:.4f}"
                print(f"| {r['batch']} | {r['context']} | {r['hq']}/{r['hkv']} | {r['page']} | {i['ms']:.4f} | "
                      f"{i['gbs']:.0f} | {i['pct_roofline']:.1f} | {b['ms']:.4f} | {b['pct_roofline']:.1f} | "
                      f"{fmt(s, '.4f')} | {i['speedup_vs_bf16']:.2f} | {fmt(i['speedup_vs_sdpa'], '.2f')} | "
                      f"{fmt(b['speedup_vs_sdpa'], '.2f')} | {g} |")
            print()
        if d.get("write"):
            print("| write kernel | tokens × heads | ms | floor ms | % of floor |")
            print("|---|---|---|---|---|")
            for w in d["write"]:
                print(f"| {w['kernel']} | {w['tokens']} × {w['heads']} | {w['ms']:.4f} | {w['floor_ms']:.4f} | "
                      f"{w['pct_floor']:.1f} |")
            print()


if __name__ == "__main__":
    main()
