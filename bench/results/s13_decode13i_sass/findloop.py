import re, sys
L = open(sys.argv[1]).read().splitlines()
labels = {}; addr = None; brs = []; hm = None
for l in L:
    m = re.match(r'^(\.L_x_\d+):', l)
    if m: labels[m.group(1)] = addr; continue
    m = re.match(r'\s+/\*([0-9a-f]{4,})\*/\s+(.*?);', l)
    if m:
        a = int(m.group(1), 16); t = m.group(2); addr = a
        if 'HMMA' in t and hm is None: hm = a
        mb = re.search(r'BRA `\((\.L_x_\d+)\)', t)
        if mb: brs.append((a, mb.group(1)))
best = None
for a, lab in brs:
    la = labels.get(lab)
    if la is None: continue
    start = la + 0x10
    if start <= hm <= a and (best is None or a - start < best[1] - best[0]):
        best = (start, a, lab)
print(best[2], hex(best[1])[2:])
