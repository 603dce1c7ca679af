import re, sys, collections
# usage: blocks.py file.sass start_label end_addr_hex
lines = open(sys.argv[1]).read().splitlines()
ins = []  # (addr, text, label_before)
lab = None
src = None
for l in lines:
    m = re.match(r'^(\.L_x_\d+):', l)
    if m:
        lab = m.group(1); ins.append((None, lab, None)); continue
    m = re.search(r'//## File ".*?([^/]+)", line (\d+)', l)
    if m: src = m.group(1) + ":" + m.group(2); continue
    m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
    if m:
        ins.append((int(m.group(1), 16), m.group(2).strip(), src))
def op(t):
    t = re.sub(r'^@!?U?P[T0-9]+\s+', '', t)
    return t.split()[0]
start = sys.argv[2]; end = int(sys.argv[3], 16)
on = False; blocks = []; cur = None
for a, t, s in ins:
    if a is None:
        if t == start: on = True
        if on:
            cur = [t, []]; blocks.append(cur)
        continue
    if not on: continue
    cur[1].append((a, t, s))
    if op(t).startswith('BRA') or op(t) == 'EXIT':
        cur = ['(fall)', []]; blocks.append(cur)
    if a >= end: break
tot = 0
for name, b in blocks:
    if not b: continue
    n = sum(1 for a, t, s in b if op(t) != 'NOP')
    tot += n
    c = collections.Counter(op(t).split('.')[0] for a, t, s in b if op(t) != 'NOP')
    print(f"{name:10s} {b[0][0]:05x}-{b[-1][0]:05x} n={n:4d} last={b[-1][1][:40]:40s} " + " ".join(f"{k}:{v}" for k, v in c.most_common()))
print("total non-NOP", tot)
