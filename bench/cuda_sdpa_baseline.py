#!/usr/bin/env python3
"""PyTorch SDPA decode baseline for cuda_decode_bench (issue 3, PERF.md rules).

One query token per request, BF16 contiguous K/V [B, H_kv, L, d], enable_gqa=True, measured with
CUDA events: warm-up, median of --iters, L2 flushed (256 MiB memset) before every timed run,
fresh random inputs per shape. Writes JSON {"torch": version, "results": [{batch, context, hq,
hkv, d, ms, gbs}, ...]} that cuda_decode_bench reads with --sdpa-json to print speed-ups.
Usage: cuda_sdpa_baseline.py --out sdpa.json [--batches 1,8,32,128] [--contexts ...]
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F


def ints(s):
    return [int(x) for x in s.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8,32,128", type=ints)
    ap.add_argument("--contexts", default="1024,4096,32768,100000,131072", type=ints)
    ap.add_argument("--gqa", default="32:8,64:8,32:4")
    ap.add_argument("--head-dim", default=128, type=int)
    ap.add_argument("--iters", default=30, type=int)
    ap.add_argument("--warmup", default=5, type=int)
    ap.add_argument("--max-gb", default=110.0, type=float)
    a = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    results = []
    d = a.head_dim
    for pair in a.gqa.split(","):
        hq, hkv = (int(x) for x in pair.split(":"))
        for B in a.batches:
            for L in a.contexts:
                kv_gb = 2 * B * hkv * L * d * 2 / 1e9
                row = {"batch": B, "context": L, "hq": hq, "hkv": hkv, "d": d}
                if kv_gb > a.max_gb:
                    row["ms"] = None
                    row["skipped"] = f"K+V {kv_gb:.1f} GB > --max-gb"
                    results.append(row)
                    continue
                try:
                    q = torch.randn(B, hq, 1, d, device=dev, dtype=torch.bfloat16)
                    k = torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16)
                    v = torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16)
                    for _ in range(a.warmup):
                        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    torch.cuda.synchronize()
                    times = []
                    for i in range(a.iters):
                        flush.fill_(i & 0xFF)
                        e0 = torch.cuda.Event(enable_timing=True)
                        e1 = torch.cuda.Event(enable_timing=True)
                        e0.record()
                        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                        e1.record()
                        e1.synchronize()
                        times.append(e0.elapsed_time(e1))
                    assert torch.isfinite(o).all().item()
                    ms = statistics.median(times)
                    row["ms"] = ms
                    row["gbs"] = kv_gb * 1e9 / (ms * 1e-3) / 1e9
                except torch.OutOfMemoryError:
                    row["ms"] = None
                    row["skipped"] = "out of memory"
                finally:
                    q = k = v = None
                    torch.cuda.empty_cache()
                results.append(row)
                print(f"sdpa B={B} L={L} {hq}/{hkv}: {row.get('ms')} ms", file=sys.stderr, flush=True)
    with open(a.out, "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
