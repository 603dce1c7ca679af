#!/usr/bin/env python3
"""gguf_zero_weights.py MODEL OUT — writes OUT, a copy of the GGUF file MODEL whose tensor data
(everything after the header, metadata and tensor infos, from the aligned data offset on) is
zero: a degenerate model of the same shape. For the tests of a model whose logits are all equal
(newcomer s10b F4)."""
import struct
import sys

model, out = sys.argv[1], sys.argv[2]
b = bytearray(open(model, "rb").read())
assert b[:4] == b"GGUF", "not a GGUF file"
(version,) = struct.unpack_from("<I", b, 4)
assert version in (1, 2, 3), f"GGUF version {version}"
# A count / length / dim field: uint32 in GGUF v1, uint64 from v2 on.
CNT, CW = ("<I", 4) if version == 1 else ("<Q", 8)
(n_tensors,) = struct.unpack_from(CNT, b, 8)
(n_kv,) = struct.unpack_from(CNT, b, 8 + CW)
pos = 8 + 2 * CW
SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def string(p):
    (n,) = struct.unpack_from(CNT, b, p)
    return b[p + CW:p + CW + n].decode(), p + CW + n


def value(t, p):
    if t == 8:
        return string(p)
    if t == 9:
        (et,) = struct.unpack_from("<I", b, p)
        (n,) = struct.unpack_from(CNT, b, p + 4)
        p += 4 + CW
        vals = []
        for _ in range(n):
            v, p = value(et, p)
            vals.append(v)
        return vals, p
    fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}[t]
    return struct.unpack_from(fmt, b, p)[0], p + SIZES[t]


alignment = 32
for _ in range(n_kv):
    key, pos = string(pos)
    (t,) = struct.unpack_from("<I", b, pos)
    v, pos = value(t, pos + 4)
    if key == "general.alignment":
        alignment = v
for _ in range(n_tensors):
    _, pos = string(pos)
    (n_dims,) = struct.unpack_from("<I", b, pos)
    pos += 4 + CW * n_dims + 4 + 8
data = (pos + alignment - 1) // alignment * alignment
b[data:] = bytes(len(b) - data)
open(out, "wb").write(b)
