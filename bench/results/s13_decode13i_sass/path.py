import re, sys, collections
# usage: path.py file.sass start_label end_hex "excl_hex,excl_hex,..." "addr:weight,..."
lines = open(sys.argv[1]).read().splitlines()
ins = []; src = None; lab = None
for l in lines:
    m = re.match(r'^(\.L_x_\d+):', l)
    if m: ins.append((None, m.group(1), None)); continue
    m = re.search(r'//## File ".*?([^/]+)", line (\d+)', l)
    if m: src = m.group(1).replace('paged_decode.cu','pd').replace('.hpp','') + ":" + m.group(2); continue
    m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
    if m: ins.append((int(m.group(1), 16), m.group(2).strip(), src))
def op(t):
    t = re.sub(r'^@!?U?P[T0-9]+\s+', '', t); return t.split()[0]
start, end = sys.argv[2], int(sys.argv[3], 16)
excl = [int(x, 16) for x in sys.argv[4].split(',') if x]
wts = dict((int(a, 16), int(w)) for a, w in (x.split(':') for x in sys.argv[5].split(',') if x)) if len(sys.argv) > 5 else {}
on = False; blocks = []; cur = None
for a, t, s in ins:
    if a is None:
        if t == start: on = True
        if on: cur = [t, []]; blocks.append(cur)
        continue
    if not on: continue
    cur[1].append((a, t, s))
    if op(t).startswith('BRA') or op(t) == 'EXIT': cur = ['(fall)', []]; blocks.append(cur)
    if a >= end: break
ops = collections.Counter(); srcs = collections.Counter(); tot = 0; static = 0
for name, b in blocks:
    if not b or b[0][0] in excl: continue
    w = wts.get(b[0][0], 1)
    for a, t, s in b:
        if op(t) == 'NOP': continue
        static += 1; tot += w; ops[op(t).split('.')[0]] += w; srcs[s] += w
print("static", static, "dynamic", tot)
print(" ".join(f"{k}:{v}" for k, v in ops.most_common()))
for k, v in sorted(srcs.items(), key=lambda kv: (kv[0] or '').split(':')[0] + '%06d' % int((kv[0] or 'x:0').split(':')[1])): print(f"  {k}: {v}")
