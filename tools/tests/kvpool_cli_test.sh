#!/usr/bin/env bash
# End-to-end checks of the kvpool CLI: exit codes (0 ok, 1 usage, 2 runtime), messages, and
# the subcommands on the real model. Usage: kvpool_cli_test.sh KVPOOL MODEL DATA_DIR
set -u
bin="$1"; model="$2"; data="$3"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
fail=0
check() {  # check NAME EXPECTED_RC GREP_PATTERN -- command...
  local name="$1" want="$2" pat="$3"; shift 4
  local out rc
  out="$("$@" 2>&1)"; rc=$?
  if [[ $rc -ne $want ]]; then echo "FAIL $name: rc $rc != $want"; echo "$out"; fail=1; return; fi
  if [[ -n "$pat" ]] && ! grep -q -- "$pat" <<<"$out"; then
    echo "FAIL $name: output lacks '$pat'"; echo "$out"; fail=1; return
  fi
  echo "ok   $name"
}
check help 0 "quantize" -- "$bin" --help
check version 0 "kvpool 0" -- "$bin" --version
check no-subcommand 1 "" -- "$bin"
check quantize-missing-in 1 "--in" -- "$bin" quantize
# a float32 [4, 8] array written by hand: header padded to 64 bytes
python3 - "$tmp/x.npy" <<'PY' || { echo "FAIL python"; exit 1; }
import struct, sys
h = "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 8), }"
h += " " * ((64 - (10 + len(h) + 1) % 64) % 64) + "\n"
vals = [((i * 37) % 17 - 8) / 3.0 for i in range(32)]
open(sys.argv[1], "wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + struct.pack("<32f", *vals))
PY
check quantize-none 0 "relative L2 err" -- "$bin" quantize --in "$tmp/x.npy" --dequant-out "$tmp/y.npy" --packed-out "$tmp/p.bin"
check quantize-bits 0 "bits/element     6.0000" -- "$bin" quantize --in "$tmp/x.npy" --rotation hadamard
[[ -s "$tmp/y.npy" && $(stat -c %s "$tmp/p.bin") -eq $((4 * 2 + 4 * 4)) ]] && echo "ok   outputs" || { echo "FAIL outputs"; fail=1; }
check quantize-bad-kind 2 "--kind must be k or v" -- "$bin" quantize --in "$tmp/x.npy" --kind q
check quantize-bad-clip 2 "--clip" -- "$bin" quantize --in "$tmp/x.npy" --clip 2
check quantize-missing 2 "cannot open" -- "$bin" quantize --in "$tmp/none.npy"
printf 'garbage' > "$tmp/bad.npy"
check quantize-garbage 2 "magic" -- "$bin" quantize --in "$tmp/bad.npy"
check calibrate 0 "wrote" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 400 --out "$tmp/rot.safetensors"
check inspect 0 "max orth_err" -- "$bin" rotations inspect "$tmp/rot.safetensors"
check quantize-file 0 "relative L2 err" -- "$bin" quantize --in "$tmp/x.npy" --rotation "$tmp/rot.safetensors" --layer 2 --kind v
check quantize-file-layer 2 "--layer 9 out of range" -- "$bin" quantize --in "$tmp/x.npy" --rotation "$tmp/rot.safetensors" --layer 9
check evaluate 0 "all" -- "$bin" evaluate --model "$model" --rotations "$tmp/rot.safetensors" --text "$data/evaluation.txt" --tokens 200
head -c 100 "$tmp/rot.safetensors" > "$tmp/trunc.safetensors"
check inspect-corrupt 2 "" -- "$bin" rotations inspect "$tmp/trunc.safetensors"
exit $fail
