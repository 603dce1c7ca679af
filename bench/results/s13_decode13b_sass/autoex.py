import re, sys
# autoex.py file.sass label end -> comma list of excluded block start addresses (decode13i's rules)
lines = open(sys.argv[1]).read().splitlines()
ins = []
for l in lines:
    m = re.match(r'^(\.L_x_\d+):', l)
    if m: ins.append((None, m.group(1))); continue
    m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
    if m: ins.append((int(m.group(1), 16), m.group(2).strip()))
def op(t): return re.sub(r'^@!?U?P[T0-9]+\s+', '', t).split()[0]
on=False; blocks=[]; cur=None; end=int(sys.argv[3],16)
for a,t in ins:
    if a is None:
        if t==sys.argv[2]: on=True
        if on: cur=[t,[]]; blocks.append(cur)
        continue
    if not on: continue
    cur[1].append((a,t))
    if op(t).startswith('BRA') or op(t)=='EXIT': cur=['(fall)',[]]; blocks.append(cur)
    if a>=end: break
blocks=[b for b in blocks if b[1]]
ex=[]; skip_to=None; prev_atom=False
for i,(name,b) in enumerate(blocks):
    txt=' '.join(t for a,t in b)
    if skip_to is not None:
        if name==skip_to: skip_to=None
        else: ex.append(b[0][0]); continue
    if prev_atom: ex.append(b[0][0]); prev_atom=False; continue
    last=b[-1][1]
    if ('FSEL' in txt and '-INF' in txt) or 'SHFL.BFLY' in txt or 'ATOMG' in txt or 'SR_LANEID' in txt:
        ex.append(b[0][0]); prev_atom='ATOMG' in txt; continue
    if 'BSSY' in txt and 'SYNCS' in txt and re.match(r'@!?P\d BRA', last):
        skip_to=re.search(r'\((\.L_x_\d+)\)', last).group(1); continue
    if re.match(r'BRA ', last) and 'SHFL.IDX' in txt and 'UBLKCP' not in txt: ex.append(b[0][0]); continue
print(','.join('%x'%x for x in ex))
