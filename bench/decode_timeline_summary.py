#!/usr/bin/env python3
"""Summary of per-CTA decode timelines (docs/KERNELS.md, s6/s7 notes).

Input: the file a -DKVPOOL_DECODE_TIMELINE build of cuda_decode_bench writes to
$KVPOOL_DECODE_TIMELINE: per launch a '# tag' line, then one line per CTA: kernel (0 QRotate,
1 INT2, 2 BF16, 3 merge), CTA index, SM, entry, after-PDL-wait, end (ns from the first QRotate
entry; -1 = not stamped). With two items per INT2 CTA the 'wait' stamp is the last item's.
Prints per kernel start/wait/end quantiles, INT2 CTAs per SM, end histograms, CTAs active over
time, and for two-item grids (--rows2 R2 --splits S) the second items' per-row end spread, the
mean CTA times by arrival rank on the SM and the SMs holding fewer than --full INT2 CTAs; for
one-item split-major grids (--rows1 R: CTA c is row c % R) the rows' end spread and its
correlation with the sum of the arrival ranks of the row's CTAs; with helper items (s9 builds:
fields 6-7 = end of the regular items, helper items run) how many ran and when.
Usage: decode_timeline_summary.py TIMELINE [--rows2 R2 --splits S [--rows2-tag TAG]]
       [--rows1 R [--rows1-tag TAG]] [--full 5]
"""
import argparse
import collections
import statistics


def q(v, ps):
    v = sorted(v)
    return [v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))] for p in ps]


def fmt(v):
    return "/".join(f"{x:7.2f}" for x in v)


def launch(tag, rows, a):
    names = {0: "QRotate", 1: "INT2", 2: "BF16", 3: "Merge"}
    print("==", tag)
    by = collections.defaultdict(list)
    for r in rows:
        by[r[0]].append(r)
    for k in range(4):
        rs = by[k]
        if not rs:
            continue
        st = [r[3] for r in rs]
        wt = [r[4] for r in rs if r[4] >= 0]
        en = [r[5] for r in rs if r[5] >= 0]
        s = f"{names[k]:8s} n={len(rs):5d} start[min/p50/max]={fmt(q(st, [0, .5, 1]))}"
        if wt:
            s += f" wait[min/max]={min(wt):7.2f}/{max(wt):7.2f}"
        print(s + f" end[min/p10/p50/p90/max]={fmt(q(en, [0, .1, .5, .9, 1]))}")
    i2, bf, mg = by[1], by[2], by[3]
    per = collections.Counter(r[2] for r in i2)
    print("INT2 CTAs per SM:", dict(collections.Counter(per.values())))
    last = collections.defaultdict(float)
    for r in i2:
        last[r[2]] = max(last[r[2]], r[5])
    print("per-SM last INT2 end [min/p10/p50/p90/max]", fmt(q(list(last.values()), [0, .1, .5, .9, 1])))
    for name, rs, f in (("INT2 end", i2, 5), ("BF16 end", bf, 5), ("BF16 start", bf, 3)):
        h = collections.Counter(int(r[f] // 5) * 5 for r in rs)
        print(f"{name} histogram (5us bins):", " ".join(f"{b}:{h[b]}" for b in sorted(h)))
    tmax = max(r[5] for r in rows)
    for t in range(0, int(tmax) + 10, 10):
        a1 = sum(1 for r in i2 if r[3] <= t < r[5])
        a2 = sum(1 for r in bf if r[3] <= t < r[5])
        print(f"  t={t:4d}us active INT2={a1:4d} BF16={a2:4d}")
    print("BF16 CTAs by INT2 CTAs on their SM:", dict(collections.Counter(per[r[2]] for r in bf)))
    print(f"last INT2 end {max(r[5] for r in i2):.2f}  last BF16 end {max((r[5] for r in bf), default=-1):.2f}"
          f"  merge wait {min(r[4] for r in mg):.2f}-{max(r[4] for r in mg):.2f}  merge end {max(r[5] for r in mg):.2f}")
    # arrival rank on the SM
    bysm = collections.defaultdict(list)
    for r in i2:
        bysm[r[2]].append(r)
    rk = collections.defaultdict(list)
    for v in bysm.values():
        v.sort(key=lambda r: r[3])
        for i, r in enumerate(v):
            rk[i].append(r)
    for i in sorted(rk):
        v = rk[i]
        m = lambda f: sum(f(r) for r in v) / len(v)
        print(f"rank {i}: n={len(v)} start {m(lambda r: r[3]):6.2f} last-item wait {m(lambda r: r[4]):6.2f}"
              f" end {m(lambda r: r[5]):6.2f}")
    if a.rows2 and a.rows2_tag in tag and len(i2) == a.rows2 * a.splits:
        rowend = collections.defaultdict(list)
        # the second item's row: field 5 of s7 builds (handed out at run time since v20), else
        # v19's fixed mapping R2 + c % R2
        for r in i2:
            rowend[r[7] if r[7] >= 0 else a.rows2 + r[1] % a.rows2].append((r[5], r[4]))
        ends = [max(x[0] for x in v) for v in rowend.values()]
        spread = [max(x[0] for x in v) - min(x[0] for x in v) for v in rowend.values()]
        starts = [sum(x[1] for x in v) / len(v) for v in rowend.values()]
        if any(r[6] >= 0 for r in i2):
            fe = [r[6] for r in i2 if r[6] >= 0]
            print("first-item end [min/p10/p50/p90/max]", fmt(q(fe, [0, .1, .5, .9, 1])))
        print("second-item rows: row end [min/p10/p50/p90/max]", fmt(q(ends, [0, .1, .5, .9, 1])),
              " spread within a row [p10/p50/p90/max]", fmt(q(spread, [.1, .5, .9, 1])))
        if statistics.pstdev(starts) > 0 and statistics.pstdev(ends) > 0:
            mx, my = statistics.mean(starts), statistics.mean(ends)
            cov = sum((x - mx) * (y - my) for x, y in zip(starts, ends)) / len(ends)
            print(f"  corr(mean second-item start of the row's CTAs, row end) = "
                  f"{cov / statistics.pstdev(starts) / statistics.pstdev(ends):.3f}")
    if a.rows1 and a.rows1_tag in tag and len(i2) % a.rows1 == 0:
        rank = {}
        for v in bysm.values():
            for i, r in enumerate(sorted(v, key=lambda r: r[3])):
                rank[r[1]] = i
        rowend, rowrank = collections.defaultdict(float), collections.defaultdict(int)
        for r in i2:  # the end of the CTA's own (regular) item when helper items followed it
            rowend[r[1] % a.rows1] = max(rowend[r[1] % a.rows1], r[8] if r[8] >= 0 else r[5])
            rowrank[r[1] % a.rows1] += rank[r[1]]
        ks = sorted(rowend)
        ends, rs = [rowend[k] for k in ks], [rowrank[k] for k in ks]
        print("one-item rows: row end [min/p10/p50/p90/max]", fmt(q(ends, [0, .1, .5, .9, 1])),
              f" rank sum of a row's CTAs [min/max] {min(rs)}/{max(rs)}")
        if statistics.pstdev(rs) > 0 and statistics.pstdev(ends) > 0:
            mx, my = statistics.mean(rs), statistics.mean(ends)
            cov = sum((x - mx) * (y - my) for x, y in zip(rs, ends)) / len(ends)
            print(f"  corr(rank sum, row end) = {cov / statistics.pstdev(rs) / statistics.pstdev(ends):.3f}")
    hl = [r for r in i2 if r[8] >= 0]
    if hl:
        hv = [r for r in hl if r[9] > 0]
        print(f"helper items: {sum(r[9] for r in hl)} on {len(hv)} of {len(hl)} CTAs;"
              " regular-items end [min/p10/p50/p90/max]", fmt(q([r[8] for r in hl], [0, .1, .5, .9, 1])))
        if hv:
            print("  CTAs with helper items: regular end [min/max] "
                  f"{min(r[8] for r in hv):.2f}/{max(r[8] for r in hv):.2f}, end [min/max] "
                  f"{min(r[5] for r in hv):.2f}/{max(r[5] for r in hv):.2f}")
    if any(r[6] >= 0 for r in mg):
        lse = [r[6] - r[4] for r in mg if r[6] >= 0]
        rv = [r[5] - r[6] for r in mg if r[6] >= 0]
        print("merge: wait -> R_V product [min/p50/max]", fmt(q(lse, [0, .5, 1])),
              " R_V product -> end", fmt(q(rv, [0, .5, 1])))
    few = [sm for sm in bysm if per[sm] < a.full]
    if few:
        print(f"SMs with fewer than {a.full} INT2 CTAs (I/B = INT2/BF16 CTA index: start-end us):")
        allsm = collections.defaultdict(list)
        for r in i2 + bf:
            allsm[r[2]].append(r)
        for sm in sorted(few, key=lambda s: per[s]):
            v = sorted(allsm[sm], key=lambda r: r[3])
            print(f"  SM {sm} ({per[sm]} INT2):", " ".join(
                f"{'I' if r[0] == 1 else 'B'}{r[1]}:{r[3]:.0f}-{r[5]:.0f}" for r in v))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline")
    ap.add_argument("--rows2", type=int, default=0, help="items_rows of a two-item grid (B=32x32K: 128)")
    ap.add_argument("--splits", type=int, default=0, help="history splits of that grid (B=32x32K: 5)")
    ap.add_argument("--rows2-tag", default="B=32 ctx=32768 32/8", help="launches the --rows2 analysis applies to")
    ap.add_argument("--rows1", type=int, default=0, help="rows of a one-item split-major grid (B=8x128K: 64)")
    ap.add_argument("--rows1-tag", default="B=8 ctx=131072 32/8", help="launches the --rows1 analysis applies to")
    ap.add_argument("--full", type=int, default=5, help="INT2 CTAs per SM of a full SM")
    a = ap.parse_args()
    tag, rows = None, []
    for line in open(a.timeline):
        if line.startswith("#"):
            if tag is not None:
                launch(tag, rows, a)
            tag, rows = line[2:].strip(), []
            continue
        f = line.split()
        x4 = float(f[6]) / 1e3 if len(f) > 6 else -1.0  # s7 builds: one more stamp and a value
        x5 = int(f[7]) if len(f) > 7 else -1
        x6 = float(f[8]) / 1e3 if len(f) > 8 else -1.0  # s9 builds: end of the regular items, helper items
        x7 = int(f[9]) if len(f) > 9 else 0
        rows.append((int(f[0]), int(f[1]), int(f[2]), float(f[3]) / 1e3, float(f[4]) / 1e3, float(f[5]) / 1e3,
                     x4, x5, x6, x7))
    if tag is not None:
        launch(tag, rows, a)


if __name__ == "__main__":
    main()
