#!/usr/bin/env python3
"""gguf_set_u32.py MODEL OUT KEY N — writes OUT, a copy of the GGUF file MODEL whose metadata
value KEY (a u32) is N, everything else byte for byte the same. For the CLI tests of a model
whose metadata and tensors disagree (newcomer report 11 F1: llama.block_count 4 over the tensors
of 5 layers)."""
import struct
import sys

model, out, key, n = sys.argv[1], sys.argv[2], sys.argv[3].encode(), int(sys.argv[4])
b = bytearray(open(model, "rb").read())
i = b.index(key) + len(key)
assert struct.unpack_from("<I", b, i)[0] == 4, f"{key.decode()} is not a u32"
struct.pack_into("<I", b, i + 4, n)
open(out, "wb").write(b)
