#!/usr/bin/env python3
"""gguf_with_context_length.py MODEL OUT N — writes OUT, a copy of the GGUF file MODEL whose
llama.context_length (a u32 metadata value) is N. For the CLI tests of models whose context is
at the GGUF reader's bound (newcomer s8 N12)."""
import struct
import sys

model, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
b = bytearray(open(model, "rb").read())
key = b"llama.context_length"
i = b.index(key) + len(key)
assert struct.unpack_from("<I", b, i)[0] == 4, "llama.context_length is not a u32"
struct.pack_into("<I", b, i + 4, n)
open(out, "wb").write(b)
