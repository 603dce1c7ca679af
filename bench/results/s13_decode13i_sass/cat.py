import re, sys, collections
lines = open(sys.argv[1]).read().splitlines()
ins = []; src = None
for l in lines:
    m = re.match(r'^(\.L_x_\d+):', l)
    if m: ins.append((None, m.group(1), None)); continue
    m = re.search(r'//## File ".*?([^/]+)", line (\d+)', l)
    if m: src = m.group(1) + ":" + m.group(2); continue
    m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
    if m: ins.append((int(m.group(1), 16), m.group(2).strip(), src))
def op(t):
    t = re.sub(r'^@!?U?P[T0-9]+\s+', '', t); return t.split()[0]
start, end = sys.argv[2], int(sys.argv[3], 16)
excl = [int(x, 16) for x in sys.argv[4].split(',') if x]
wts = dict((int(a, 16), int(w)) for a, w in (x.split(':') for x in sys.argv[5].split(',') if x))
klines = sys.argv[6].split(',')
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
cats = collections.Counter()
def cat(t, s):
    o = op(t); b = o.split('.')[0]
    if b in ('IMMA', 'HMMA'): return '1 tensor MMAs (IMMA K, HMMA V [+ min])'
    if b == 'LOP3' and re.search(r'0xc0c0c0c0|0x30003|0xc000c|0x300030|0xc000c0', t): return '2 code conversions (LOP3, IMAD.SHL, PRMT)'
    if o.startswith('IMAD.SHL') and re.search(r', 0x(40|10|4), RZ', t) and s and s.split(':')[-1] in klines: return '2 code conversions (LOP3, IMAD.SHL, PRMT)'
    if b == 'PRMT': return '2 code conversions (LOP3, IMAD.SHL, PRMT)'
    if b == 'LDS': return '3 LDS (K, V words, params)'
    if b in ('HADD2', 'I2FP', 'FMUL', 'FFMA') or (b == 'IMAD' and ', 0x100, ' in t): return '4 logits + Σp·min (half->float, I2FP, dot IMAD, FMUL, FFMA)'
    if b in ('MUFU', 'FMNMX', 'FSETP', 'VOTE', 'FADD', 'F2FP', 'HMUL2', 'MOVM'): return '5 softmax + P\' (ex2, max vote, l, pack, HMUL2, MOVM)'
    if b in ('UBLKCP', 'ELECT', 'R2UR', 'SHFL', 'SYNCS', 'LDG', 'ATOMG', 'VOTEU', 'POPC', 'FLO') or b.startswith('U'): return '6 TMA issue, page ids, stage bookkeeping (uniform ops, SHFL, R2UR, UBLKCP, mbarrier, LDG)'
    if b in ('BRA', 'BSSY', 'BSYNC', 'PLOP3', 'ISETP', 'SEL', 'WARPSYNC'): return '7 branches, predicates'
    return '8 per-lane address arithmetic, moves, other (IMAD, LEA, LOP3, S2R, ...)'
n = 0
for name, b in blocks:
    if not b or b[0][0] in excl: continue
    w = wts.get(b[0][0], 1)
    for a, t, s in b:
        if op(t) == 'NOP': continue
        cats[cat(t, s)] += w; n += w
for k in sorted(cats): print(f"{cats[k]:5d}  {k}")
print(f"{n:5d}  total per stage (2 warp steps of 32 tokens)")
