#!/usr/bin/env bash
# End-to-end checks of the kvpool CLI: exit codes (0 ok, 1 usage, 2 runtime), messages, and
# the subcommands on the real model. Usage: kvpool_cli_test.sh KVPOOL MODEL DATA_DIR
set -u
bin="$1"; model="$2"; data="$3"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
# shellcheck source=../../tests/cli_check.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../tests/cli_check.sh"
check help 0 "quantize" -- "$bin" --help
check version 0 "kvpool 0" -- "$bin" --version
check no-subcommand 1 "" -- "$bin"
check quantize-missing-in 1 "--in" -- "$bin" quantize
# --help wins over a bad value of another flag, as --version does, and shows the subcommand's
# help (newcomer s14 #1: "quantize --clip 5 --help" exited 1 with --clip's error).
check quantize-help-after-bad-clip 0 "--dequant-out" -- "$bin" quantize --clip 5 --help
check quantize-help-before-bad-clip 0 "--dequant-out" -- "$bin" quantize -h --clip 5
check quantize-help-bad-kind 0 "--packed-out" -- "$bin" quantize --kind q --help
# The unset defaults of --head / --clip (-1, outside their ranges) were shown as "=-1".
qhelp="$("$bin" quantize --help 2>&1)"
if grep -q -- "--head INT:INDEX >= 0=input head" <<<"$qhelp" &&
   grep -q -- "--clip FLOAT:RATIO in \[0,1\]=file's ratio" <<<"$qhelp" &&
   ! grep -q -- "=-1" <<<"$qhelp"; then
  echo "ok   quantize-help-defaults"
else
  echo "FAIL quantize-help-defaults:"; grep -E -- "--head|--clip" <<<"$qhelp"; fail=1
fi
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
check quantize-bad-kind 1 "--kind" -- "$bin" quantize --in "$tmp/x.npy" --kind q
check quantize-bad-clip 1 "--clip" -- "$bin" quantize --in "$tmp/x.npy" --clip 2
check quantize-nan-clip 1 "--clip" -- "$bin" quantize --in "$tmp/x.npy" --clip nan
check quantize-neg-clip 1 "--clip" -- "$bin" quantize --in "$tmp/x.npy" --clip -0.5
check quantize-layer-no-file 1 "--layer 99 needs a rotation file" -- "$bin" quantize --in "$tmp/x.npy" --layer 99
check quantize-neg-layer 1 "--layer: must be an index >= 0, got '-1'" -- "$bin" quantize --in "$tmp/x.npy" --layer -1
out="$("$bin" quantize --in "$tmp/x.npy" --layer -1 2>&1)"
grep -q "179769\|e+308" <<<"$out" && { echo "FAIL quantize-neg-layer-range: $out"; fail=1; } || echo "ok   quantize-neg-layer-range"
check quantize-neg-head 1 "--head: must be an index >= 0, got '-5'" -- "$bin" quantize --in "$tmp/x.npy" --head -5
check quantize-huge-head 1 "--head: must be an index in 0..2147483647, got '99999999999'" -- "$bin" quantize --in "$tmp/x.npy" --head 99999999999
# Plain decimal (newcomer 16 F2): lexical_cast read --layer 010 as octal 8 and took 0x10 and +1,
# also from a --config file.
for v in 0100 0x10 +16 " 16"; do
  check "quantize-layer-'$v'" 1 "--layer: must be an index >= 0 in plain decimal (no leading zero, sign, hex or spaces), got '$v'" -- "$bin" quantize --in "$tmp/x.npy" --layer "$v"
  check "quantize-head-'$v'" 1 "--head: must be an index >= 0 in plain decimal" -- "$bin" quantize --in "$tmp/x.npy" --head "$v"
done
printf 'quantize:\n  layer: 010\n' > "$tmp/octal-layer.yaml"
check quantize-layer-octal-config 1 "--config '$tmp/octal-layer.yaml' key \"quantize.layer\": --layer: must be an index >= 0 in plain decimal" -- "$bin" --config "$tmp/octal-layer.yaml" quantize --in "$tmp/x.npy"
check quantize-head-no-file 1 "--head 7 needs a per-head rotation file" -- "$bin" quantize --in "$tmp/x.npy" --head 7
check quantize-dequant-out-no-dir 1 "directory '/nonexistent' of '/nonexistent/x.npy' does not exist" -- "$bin" quantize --in "$tmp/x.npy" --dequant-out /nonexistent/x.npy
check quantize-packed-out-no-dir 1 "directory '/nonexistent' of '/nonexistent/p.bin' does not exist" -- "$bin" quantize --in "$tmp/x.npy" --packed-out /nonexistent/p.bin
out="$("$bin" quantize --in "$tmp/x.npy" --dequant-out /nonexistent/x.npy 2>/dev/null)"
[[ -z "$out" ]] && echo "ok   quantize-bad-out-prints-nothing" || { echo "FAIL quantize-bad-out-prints-nothing: $out"; fail=1; }
python3 - "$tmp" <<'PY'
import math, struct, sys
def save(path, shape, vals):
    h = "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }" % (tuple(shape),)
    h += " " * ((64 - (10 + len(h) + 1) % 64) % 64) + "\n"
    open(path, "wb").write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + struct.pack("<%df" % len(vals), *vals))
v = [1.0] * 32; v[3 * 8 + 5] = math.nan; save(sys.argv[1] + "/nan.npy", (4, 8), v)
v = [1.0] * 32; v[2 * 8 + 1] = math.inf; save(sys.argv[1] + "/pinf.npy", (4, 8), v)
v = [1.0] * 80; v[(4 * 2 + 1) * 8 + 6] = -math.inf; save(sys.argv[1] + "/ninf.npy", (5, 2, 8), v)
save(sys.argv[1] + "/d6.npy", (4, 6), [1.0] * 24)          # head_dim not a power of two
save(sys.argv[1] + "/rank1.npy", (8,), [1.0] * 8)          # too few dimensions
save(sys.argv[1] + "/rank4.npy", (2, 2, 2, 8), [1.0] * 64)  # too many dimensions
save(sys.argv[1] + "/d16.npy", (4, 16), [1.0] * 64)        # head_dim differs from the model's 8
save(sys.argv[1] + "/empty.npy", (0, 8), [])               # no tokens (newcomer s8 N7)
save(sys.argv[1] + "/noheads.npy", (4, 0, 8), [])          # no heads
PY
check quantize-no-tokens 2 "INVALID_ARGUMENT: --in '$tmp/empty.npy' has 0 tokens (shape \[0, 8\]): nothing to quantize" -- "$bin" quantize --in "$tmp/empty.npy"
out="$("$bin" quantize --in "$tmp/empty.npy" 2>&1)"
! grep -q "relative L2 err" <<<"$out" && echo "ok   quantize-no-tokens-prints-no-statistics" || { echo "FAIL quantize-no-tokens-prints-no-statistics: $out"; fail=1; }
check quantize-no-heads 2 "has 0 heads (shape \[4, 0, 8\])" -- "$bin" quantize --in "$tmp/noheads.npy"
check quantize-d-not-pow2 2 "head_dim) must be a power of two in \[8, 1024\], got 6" -- "$bin" quantize --in "$tmp/d6.npy"
check quantize-rank1 2 "got 1 dimensions" -- "$bin" quantize --in "$tmp/rank1.npy"
check quantize-rank4 2 "got 4 dimensions" -- "$bin" quantize --in "$tmp/rank4.npy"
check quantize-nan-input 2 "element \[3,5\] is nan" -- "$bin" quantize --in "$tmp/nan.npy"
check quantize-pinf-input 2 "element \[2,1\] is +inf" -- "$bin" quantize --in "$tmp/pinf.npy" --rotation hadamard
check quantize-ninf-input 2 "element \[4,1,6\] is -inf" -- "$bin" quantize --in "$tmp/ninf.npy"
check calibrate-bad-clip 1 "--clip-k" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --clip-k 5 --out "$tmp/r.safetensors"
check calibrate-clip-underflows 1 "rounds to 0 in the file's float32" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --clip-k 1e-50 --out "$tmp/r.safetensors"
# Outputs are checked before the run (kvpool::cli::OutputFile): a device node or a symlink to
# one is refused (the writer would have replaced it with a regular file), so is a directory no
# file can be created in; a symlink to a regular file is written through (the link stays).
check calibrate-out-devnull 1 "--out: '/dev/null' is a character device, not a regular file" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --out /dev/null
[[ -c /dev/null ]] && echo "ok   calibrate-out-devnull-kept" || { echo "FAIL /dev/null replaced"; fail=1; }
if mknod "$tmp/null" c 1 3 2>/dev/null; then
  check calibrate-out-mknod 1 "--out: '$tmp/null' is a character device, not a regular file" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --out "$tmp/null"
  [[ -c "$tmp/null" ]] && echo "ok   calibrate-out-mknod-kept" || { echo "FAIL device node replaced"; fail=1; }
  rm -f "$tmp/null"
fi
ln -s /dev/null "$tmp/null-link"
check calibrate-out-link-to-device 1 "links to '/dev/null', a character device" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --out "$tmp/null-link"
check quantize-dequant-out-device 1 "--dequant-out: '/dev/null' is a character device" -- "$bin" quantize --in "$tmp/x.npy" --dequant-out /dev/null
check quantize-packed-out-link-to-device 1 "--packed-out: '$tmp/null-link' links to '/dev/null'" -- "$bin" quantize --in "$tmp/x.npy" --packed-out "$tmp/null-link"
check calibrate-out-proc 1 "--out: cannot create a file in directory '/proc' of '/proc/r.safetensors': " -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --out /proc/r.safetensors
check quantize-packed-out-proc 1 "--packed-out: cannot create a file in directory '/proc'" -- "$bin" quantize --in "$tmp/x.npy" --packed-out /proc/p.bin
mkdir "$tmp/real"
ln -s real/y.npy "$tmp/y-link.npy"
ln -s real/p.bin "$tmp/p-link.bin"
check quantize-out-through-link 0 "relative L2 err" -- "$bin" quantize --in "$tmp/x.npy" --dequant-out "$tmp/y-link.npy" --packed-out "$tmp/p-link.bin"
if [[ -L "$tmp/y-link.npy" && -L "$tmp/p-link.bin" && -f "$tmp/real/y.npy" && $(stat -c %s "$tmp/real/p.bin") -eq $((4 * 2 + 4 * 4)) && $(ls -A "$tmp/real" | wc -l) -eq 2 ]]; then
  echo "ok   quantize-out-through-link-kept"
else
  echo "FAIL quantize outputs through a symlink:"; ls -la "$tmp" "$tmp/real"; fail=1
fi
check evaluate-negative-tokens 1 "--tokens: -3 is outside 0..2147483647" -- "$bin" evaluate --model "$model" --rotations /nonexistent --text "$data/evaluation.txt" --tokens -3
check evaluate-huge-negative-tokens 1 "--tokens: -99999999999 is outside 0..2147483647" -- "$bin" evaluate --model "$model" --rotations /nonexistent --text "$data/evaluation.txt" --tokens -99999999999
check calibrate-huge-tokens 1 "--tokens: 99999999999 is outside 0..2147483647" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 99999999999 --out "$tmp/r.safetensors"
check calibrate-bad-out 1 "/nonexistent/dir" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --out /nonexistent/dir/x.safetensors
check quantize-missing 2 "cannot open" -- "$bin" quantize --in "$tmp/none.npy"
printf 'garbage' > "$tmp/bad.npy"
check quantize-garbage 2 "magic" -- "$bin" quantize --in "$tmp/bad.npy"
mkdir "$tmp/outdir"
check calibrate-out-is-dir 1 "is a directory" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 400 --out "$tmp/outdir"
# No temporary file of the atomic writer (TARGET.tmp-PID-N, kvpool/common/atomic_file.h).
! compgen -G "$tmp/outdir.tmp*" >/dev/null && echo "ok   calibrate-out-is-dir-no-tmp" || { echo "FAIL calibrate-out-is-dir left a temporary file"; fail=1; }
# The bound is a fixed floor, not head_dim (8 for this model; newcomer report 11 F10).
check calibrate-tokens-15 1 "--tokens must be 0 (all) or >= 16, got 15: 16 is calibrate's fixed floor" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 15 --out "$tmp/r15.safetensors"
out="$("$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 15 --out "$tmp/r15.safetensors" 2>&1)"
! grep -q "fewer tokens than head_dim" <<<"$out" && echo "ok   calibrate-tokens-15-no-head-dim-claim" || { echo "FAIL calibrate-tokens-15 cites head_dim: $out"; fail=1; }
check calibrate-tokens-1 1 "--tokens must be 0 (all) or >= 16, got 1" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 1 --out "$tmp/r1.safetensors"
[[ ! -e "$tmp/r1.safetensors" ]] && echo "ok   calibrate-tokens-1-no-file" || { echo "FAIL calibrate-tokens-1 wrote a file"; fail=1; }
check calibrate-few-tokens-warns 0 "is few" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 32 --out "$tmp/r32.safetensors"
# The bounds apply to the tokens actually used, also under the default --tokens 0 (newcomer
# report s6 #4: a 3-token text wrote a rotation with no word).
printf 'hello' > "$tmp/short.txt"
check calibrate-short-text 2 "--text '$tmp/short.txt' gives [0-9]* tokens, fewer than 16" -- "$bin" calibrate --model "$model" --text "$tmp/short.txt" --out "$tmp/rs.safetensors"
[[ ! -e "$tmp/rs.safetensors" ]] && echo "ok   calibrate-short-text-no-file" || { echo "FAIL calibrate-short-text wrote a file"; fail=1; }
# llama.block_count 4 over the tensors of 5 layers: calibrate wrote a 4-layer rotation file
# (newcomer report 11 F1); the model is refused, nothing written.
python3 "$(dirname "${BASH_SOURCE[0]}")/../../worker/tests/gguf_set_u32.py" "$model" "$tmp/layers4.gguf" llama.block_count 4
check calibrate-layers-beyond-block-count 2 "tensor 'blk.4.attn_q.weight' belongs to layer 4, beyond the layers the metadata describes (llama.block_count 4" -- "$bin" calibrate --model "$tmp/layers4.gguf" --text "$data/calibration.txt" --tokens 400 --out "$tmp/r4.safetensors"
[[ ! -e "$tmp/r4.safetensors" ]] && echo "ok   calibrate-layers-beyond-block-count-no-file" || { echo "FAIL calibrate wrote a rotation file for an inconsistent model"; fail=1; }
head -c 400 "$data/calibration.txt" > "$tmp/t100.txt"
check calibrate-short-text-warns 0 "--text '$tmp/t100.txt' gives [0-9]* tokens, which is few" -- "$bin" calibrate --model "$model" --text "$tmp/t100.txt" --out "$tmp/rw.safetensors"
check calibrate-text-below-tokens-warns 0 "(--tokens 2000) gives [0-9]* tokens, which is few" -- "$bin" calibrate --model "$model" --text "$tmp/t100.txt" --tokens 2000 --out "$tmp/rw.safetensors"
out="$("$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 400 --out "$tmp/r400.safetensors" 2>&1)"
! grep -q "is few" <<<"$out" && echo "ok   calibrate-enough-tokens-no-warning" || { echo "FAIL calibrate-enough-tokens-no-warning: $out"; fail=1; }
# --config after the subcommand is refused naming the file, never silently ignored (newcomer
# report s6 #5); before it, it is read (a missing file is named).
printf 'calibrate:\n  model: %s\n  text: %s\n  out: %s\n' "$model" "$tmp/t100.txt" "$tmp/rc.safetensors" > "$tmp/c.yaml"
# A top-level or unknown flag after the subcommand is named, also when required flags are
# missing (newcomer s9b #8: "--model is required").
check calibrate-help-names-log-level 0 "kvpool's own flags go before the subcommand: --log-level LEVEL" -- "$bin" calibrate --help
check calibrate-version-after-missing 1 "kvpool: --version is a flag of kvpool itself, not of the subcommand 'calibrate'" -- "$bin" calibrate --version
check calibrate-log-level-after-missing 1 "kvpool: --log-level is a flag of kvpool itself" -- "$bin" calibrate --log-level
check calibrate-bogus-missing 1 "kvpool: The following argument was not expected: --bogus" -- "$bin" calibrate --bogus
check calibrate-config-after-missing 1 "--config: '/nonexistent.yaml' is not read after the subcommand 'calibrate'" -- "$bin" calibrate --config /nonexistent.yaml
check calibrate-config-after 1 "--config: '$tmp/c.yaml' is not read after the subcommand 'calibrate'" -- "$bin" calibrate --config "$tmp/c.yaml"
check inspect-config-after 1 "is not read after the subcommand 'inspect'" -- "$bin" rotations inspect --config "$tmp/c.yaml"
check config-before-missing 1 "'/nonexistent.yaml' does not exist" -- "$bin" --config /nonexistent.yaml calibrate
# A config: key in the file (re-tester s6: inside a subcommand's section it got the message about
# --config after the subcommand on the command line) names the key and the file.
printf 'calibrate:\n  config: other.yaml\n' > "$tmp/nested-config.yaml"
check config-key-in-section 1 "--config '$tmp/nested-config.yaml' sets \"calibrate.config\": a config file cannot name another config file" -- "$bin" --config "$tmp/nested-config.yaml" calibrate
printf 'config: other.yaml\n' > "$tmp/top-config.yaml"
check config-key-at-top 1 "--config '$tmp/top-config.yaml' sets \"config\": a config file cannot name another config file" -- "$bin" --config "$tmp/top-config.yaml" calibrate
check calibrate-config-before 0 "wrote $tmp/rc.safetensors" -- "$bin" --config "$tmp/c.yaml" calibrate
# Input files (docs/TOOLS.md "Input files"): only regular files up to their limit are read; a
# device read forever, a FIFO blocked in open(). Usage errors naming the flag, before any work.
mkfifo "$tmp/fifo"
truncate -s 65M "$tmp/big.txt"
truncate -s 65G "$tmp/big.gguf"
check calibrate-text-dev-zero 1 "--text: '/dev/zero' is a character device, not a regular file" -- timeout 20 "$bin" calibrate --model "$model" --text /dev/zero --out "$tmp/z.safetensors"
check evaluate-text-dev-zero 1 "--text: '/dev/zero' is a character device, not a regular file" -- timeout 20 "$bin" evaluate --model "$model" --rotations "$tmp/none.safetensors" --text /dev/zero
check calibrate-text-fifo 1 "--text: '$tmp/fifo' is a FIFO, not a regular file" -- timeout 20 "$bin" calibrate --model "$model" --text "$tmp/fifo" --out "$tmp/z.safetensors"
check calibrate-text-dir 1 "--text: '$tmp/outdir' is a directory; name a file" -- timeout 20 "$bin" calibrate --model "$model" --text "$tmp/outdir" --out "$tmp/z.safetensors"
check calibrate-text-too-big 1 "--text: '$tmp/big.txt' is 65 MiB (68157440 bytes), above the limit of 64 MiB" -- timeout 20 "$bin" calibrate --model "$model" --text "$tmp/big.txt" --out "$tmp/z.safetensors"
check calibrate-model-fifo 1 "--model: '$tmp/fifo' is a FIFO, not a regular file" -- timeout 20 "$bin" calibrate --model "$tmp/fifo" --text "$data/calibration.txt" --out "$tmp/z.safetensors"
check evaluate-model-too-big 1 "--model: '$tmp/big.gguf' is 65 GiB (69793218560 bytes), above the limit of 64 GiB" -- timeout 20 "$bin" evaluate --model "$tmp/big.gguf" --rotations "$tmp/none.safetensors" --text "$data/calibration.txt"
check evaluate-rotations-fifo 1 "--rotations: '$tmp/fifo' is a FIFO, not a regular file" -- timeout 20 "$bin" evaluate --model "$model" --rotations "$tmp/fifo" --text "$data/calibration.txt"
check quantize-rotation-fifo 1 "--rotation: '$tmp/fifo' is a FIFO, not a regular file" -- timeout 20 "$bin" quantize --in "$tmp/x.npy" --rotation "$tmp/fifo"
[[ ! -e "$tmp/z.safetensors" ]] && echo "ok   input-files-no-output" || { echo "FAIL input-files wrote an output"; fail=1; }
check inspect-dir 1 "file: '$tmp/outdir' is a directory; name a file" -- "$bin" rotations inspect "$tmp/outdir"
check inspect-fifo 1 "file: '$tmp/fifo' is a FIFO, not a regular file" -- timeout 20 "$bin" rotations inspect "$tmp/fifo"
check quantize-in-dev-zero 1 "--in: '/dev/zero' is a character device, not a regular file" -- timeout 20 "$bin" quantize --in /dev/zero
check calibrate 0 "wrote" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 400 --out "$tmp/rot.safetensors"
# Calibrating again through a symlink: the link stays, its target gets the new file.
ln -s real/rot-target.safetensors "$tmp/rot-link.safetensors"
printf 'old' >"$tmp/real/rot-target.safetensors"
check calibrate-through-link 0 "wrote" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 400 --out "$tmp/rot-link.safetensors"
if [[ -L "$tmp/rot-link.safetensors" ]] && cmp -s "$tmp/rot.safetensors" "$tmp/real/rot-target.safetensors" && [[ $(ls -A "$tmp/real" | wc -l) -eq 3 ]]; then
  echo "ok   calibrate-through-link-kept"
else
  echo "FAIL calibrate through a symlink:"; ls -la "$tmp" "$tmp/real"; fail=1
fi
check inspect 0 "max orth_err" -- "$bin" rotations inspect "$tmp/rot.safetensors"
check quantize-file 0 "relative L2 err" -- "$bin" quantize --in "$tmp/x.npy" --rotation "$tmp/rot.safetensors" --layer 2 --kind v
check quantize-file-head-dim 2 "rotation file head_dim 8 != input head_dim 16" -- "$bin" quantize --in "$tmp/d16.npy" --rotation "$tmp/rot.safetensors"
check quantize-head-per-layer-file 2 "--head 7 needs a per-head rotation file" -- "$bin" quantize --in "$tmp/x.npy" --rotation "$tmp/rot.safetensors" --head 7
check calibrate-per-head 0 "per head (v2)" -- "$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 400 --per-head --out "$tmp/roth.safetensors"
check quantize-head-out-of-range 2 "--head 7 out of range (file has 4 KV heads)" -- "$bin" quantize --in "$tmp/x.npy" --rotation "$tmp/roth.safetensors" --head 7
check quantize-head-in-range 0 "relative L2 err" -- "$bin" quantize --in "$tmp/x.npy" --rotation "$tmp/roth.safetensors" --head 3
check quantize-file-layer 2 "--layer 9 out of range" -- "$bin" quantize --in "$tmp/x.npy" --rotation "$tmp/rot.safetensors" --layer 9
check evaluate 0 "all" -- "$bin" evaluate --model "$model" --rotations "$tmp/rot.safetensors" --text "$data/evaluation.txt" --tokens 200
# evaluate takes calibrate's bounds on the tokens (newcomer s8 N7: a 2-token text printed
# per-layer errors with rc 0): --tokens 1..15 exit 1, fewer than 16 used exit 2 with nothing
# printed, fewer than 256 a warning.
check evaluate-tokens-1 1 "--tokens must be 0 (all) or >= 16, got 1" -- "$bin" evaluate --model "$model" --rotations "$tmp/rot.safetensors" --text "$data/evaluation.txt" --tokens 1
printf 'a' > "$tmp/one.txt"
check evaluate-short-text 2 "--text '$tmp/one.txt' gives [0-9]* tokens, fewer than 16: errors over so few tokens say nothing about a rotation; nothing printed" -- "$bin" evaluate --model "$model" --rotations "$tmp/rot.safetensors" --text "$tmp/one.txt"
out="$("$bin" evaluate --model "$model" --rotations "$tmp/rot.safetensors" --text "$tmp/one.txt" 2>&1)"
! grep -q "^all" <<<"$out" && echo "ok   evaluate-short-text-prints-no-errors" || { echo "FAIL evaluate-short-text-prints-no-errors: $out"; fail=1; }
check evaluate-few-tokens-warns 0 "evaluate: --text '$data/evaluation.txt' (--tokens 200) gives 200 tokens, which is few" -- "$bin" evaluate --model "$model" --rotations "$tmp/rot.safetensors" --text "$data/evaluation.txt" --tokens 200
out="$("$bin" evaluate --model "$model" --rotations "$tmp/rot.safetensors" --text "$data/evaluation.txt" --tokens 400 2>&1)"
! grep -q "is few" <<<"$out" && echo "ok   evaluate-enough-tokens-no-warning" || { echo "FAIL evaluate-enough-tokens-no-warning: $out"; fail=1; }
head -c 100 "$tmp/rot.safetensors" > "$tmp/trunc.safetensors"
check inspect-corrupt 2 "DATA_LOSS: .*header length [0-9]* runs past the end of the file (100 bytes)" -- "$bin" rotations inspect "$tmp/trunc.safetensors"
# A non-orthogonal matrix (one element set to 7.0) is refused by the shared reader.
python3 - "$tmp/rot.safetensors" "$tmp/nonorth.safetensors" <<'PY'
import json, struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
off = 8 + n + h["layers.0.k.rotation"]["data_offsets"][0]
b[off:off + 4] = struct.pack("<f", 7.0)
open(sys.argv[2], "wb").write(b)
PY
check inspect-nonorthogonal 2 "layers.0.k.rotation' is not orthogonal" -- "$bin" rotations inspect "$tmp/nonorth.safetensors"
check quantize-nonorthogonal 2 "not orthogonal" -- "$bin" quantize --in "$tmp/x.npy" --rotation "$tmp/nonorth.safetensors"
# An infinite eigenvalue (metadata of the fit, not used for rotating) is refused too.
python3 - "$tmp/rot.safetensors" "$tmp/infeig.safetensors" <<'PY'
import json, math, struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
off = 8 + n + h["layers.1.v.eigenvalues"]["data_offsets"][0] + 4 * 3
b[off:off + 4] = struct.pack("<f", math.inf)
open(sys.argv[2], "wb").write(b)
PY
check inspect-inf-eigenvalue 2 "layers.1.v.eigenvalues' element 3 is not finite" -- "$bin" rotations inspect "$tmp/infeig.safetensors"
# A negative eigenvalue (the targets are PSD) was printed as eig_min and accepted (newcomer
# report 11 F4).
python3 - "$tmp/rot.safetensors" "$tmp/negeig.safetensors" <<'PY'
import json, struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
off = 8 + n + h["layers.0.k.eigenvalues"]["data_offsets"][0]
b[off:off + 4] = struct.pack("<f", -5.0)
open(sys.argv[2], "wb").write(b)
PY
check inspect-negative-eigenvalue 2 "layers.0.k.eigenvalues' element 0 is -5: eigenvalues of the PSD targets" -- "$bin" rotations inspect "$tmp/negeig.safetensors"
# Bytes after the last tensor were accepted, and gave a new rotation id (newcomer report 11 F3).
cp "$tmp/rot.safetensors" "$tmp/long.safetensors"; printf xxxx >>"$tmp/long.safetensors"
check inspect-trailing-bytes 2 "INVALID_ARGUMENT: .*4 byte(s) after the last tensor" -- "$bin" rotations inspect "$tmp/long.safetensors"
# A rotation file calibrated for another model name (same geometry) was used without a word
# (newcomer report 11 F2): evaluate warns, naming both, and runs.
python3 - "$tmp/rot.safetensors" "$tmp/other-name.safetensors" "$(basename "$model" .gguf)" <<'PY'
import sys
b = open(sys.argv[1], "rb").read()
old = b'"model_name":"' + sys.argv[3].encode() + b'"'
assert b.count(old) == 1, "header layout changed; update the edit"
open(sys.argv[2], "wb").write(b.replace(old, b'"model_name":"' + sys.argv[3][:-2].encode() + b'99"'))
PY
check evaluate-other-model-name 0 "evaluate: --rotations '$tmp/other-name.safetensors': the rotation file was calibrated for model '.*99', not '$(basename "$model" .gguf)'" -- "$bin" evaluate --model "$model" --rotations "$tmp/other-name.safetensors" --text "$data/evaluation.txt" --tokens 400
out="$("$bin" evaluate --model "$model" --rotations "$tmp/rot.safetensors" --text "$data/evaluation.txt" --tokens 400 2>&1)"
! grep -q "was calibrated for model" <<<"$out" && echo "ok   evaluate-own-model-name-no-warning" || { echo "FAIL evaluate-own-model-name-no-warning: $out"; fail=1; }
# An output that is an input (also through another spelling, a symlink or a hard link), the
# --config file or the other output is refused at parse time naming both flags, and the input
# is left as it was (newcomer s7 F7: --out equal to --model turned the model into a rotation
# file).
cp "$model" "$tmp/mcopy.gguf"; cp "$data/calibration.txt" "$tmp/text.txt"
ln -s mcopy.gguf "$tmp/mcopy-link.gguf"; ln "$tmp/text.txt" "$tmp/text-hard.txt"
mkdir -p "$tmp/sub"
msum="$(sha256sum <"$tmp/mcopy.gguf")"; tsum="$(sha256sum <"$tmp/text.txt")"
check calibrate-out-is-model 1 "kvpool: --out: '$tmp/mcopy.gguf' is the same file as --model '$tmp/mcopy.gguf'; writing it would replace that input" -- "$bin" calibrate --model "$tmp/mcopy.gguf" --text "$tmp/text.txt" --out "$tmp/mcopy.gguf"
check calibrate-out-is-model-spelt 1 "--out: '$tmp/sub/../mcopy.gguf' is the same file as --model" -- "$bin" calibrate --model "$tmp/mcopy.gguf" --text "$tmp/text.txt" --out "$tmp/sub/../mcopy.gguf"
check calibrate-out-links-to-model 1 "--out: '$tmp/mcopy-link.gguf' is the same file as --model" -- "$bin" calibrate --model "$tmp/mcopy.gguf" --text "$tmp/text.txt" --out "$tmp/mcopy-link.gguf"
check calibrate-out-is-text 1 "--out: '$tmp/text.txt' is the same file as --text '$tmp/text.txt'" -- "$bin" calibrate --model "$tmp/mcopy.gguf" --text "$tmp/text.txt" --out "$tmp/text.txt"
check calibrate-out-hard-link-to-text 1 "--out: '$tmp/text-hard.txt' is the same file as --text" -- "$bin" calibrate --model "$tmp/mcopy.gguf" --text "$tmp/text.txt" --out "$tmp/text-hard.txt"
printf 'calibrate:\n  tokens: 400\n' >"$tmp/c.yaml"
check calibrate-out-is-config 1 "--out: '$tmp/c.yaml' is the same file as --config '$tmp/c.yaml'" -- "$bin" --config "$tmp/c.yaml" calibrate --model "$tmp/mcopy.gguf" --text "$tmp/text.txt" --out "$tmp/c.yaml"
[[ "$(sha256sum <"$tmp/mcopy.gguf")" == "$msum" && "$(sha256sum <"$tmp/text.txt")" == "$tsum" && -L "$tmp/mcopy-link.gguf" && $(grep -c tokens "$tmp/c.yaml") -eq 1 ]] \
  && echo "ok   calibrate-inputs-kept" || { echo "FAIL calibrate replaced an input"; fail=1; }
cp "$tmp/x.npy" "$tmp/xin.npy"; xsum="$(sha256sum <"$tmp/xin.npy")"
check quantize-dequant-out-is-in 1 "--dequant-out: '$tmp/xin.npy' is the same file as --in '$tmp/xin.npy'" -- "$bin" quantize --in "$tmp/xin.npy" --dequant-out "$tmp/xin.npy"
check quantize-packed-out-is-in 1 "--packed-out: '$tmp/./xin.npy' is the same file as --in" -- "$bin" quantize --in "$tmp/xin.npy" --packed-out "$tmp/./xin.npy"
"$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 400 --out "$tmp/rq.safetensors" >/dev/null 2>&1
rsum="$(sha256sum <"$tmp/rq.safetensors")"
check quantize-packed-out-is-rotation 1 "--packed-out: '$tmp/rq.safetensors' is the same file as --rotation" -- "$bin" quantize --in "$tmp/xin.npy" --rotation "$tmp/rq.safetensors" --layer 0 --packed-out "$tmp/rq.safetensors"
check quantize-two-outputs-one-file 1 "--packed-out: '$tmp/both.bin' is the same file as --dequant-out '$tmp/both.bin'; one would overwrite the other" -- "$bin" quantize --in "$tmp/xin.npy" --dequant-out "$tmp/both.bin" --packed-out "$tmp/both.bin"
[[ "$(sha256sum <"$tmp/xin.npy")" == "$xsum" && "$(sha256sum <"$tmp/rq.safetensors")" == "$rsum" && ! -e "$tmp/both.bin" ]] \
  && echo "ok   quantize-inputs-kept" || { echo "FAIL quantize replaced an input"; fail=1; }
# A keyword is not a file: --rotation none with an output named "none" still runs.
check quantize-rotation-keyword-not-a-file 0 "relative L2 err" -- bash -c "cd '$tmp' && '$bin' quantize --in xin.npy --rotation none --packed-out none"
# A rotation file named like a keyword needs a path: the help says so (newcomer s14 #5), and
# ./hadamard is that file (here a copy of a per-layer rotation file, so --layer works), while
# hadamard is the normalized Hadamard rotation.
check quantize-help-keyword-file 0 "a file named none or hadamard: give its path, ./hadamard" -- "$bin" quantize --help
cp "$tmp/rot.safetensors" "$tmp/hadamard"
check quantize-rotation-dot-slash-keyword-is-the-file 0 "relative L2 err" -- bash -c "cd '$tmp' && '$bin' quantize --in xin.npy --rotation ./hadamard --layer 2"
check quantize-rotation-keyword-is-not-the-file 1 "--layer 2 needs a rotation file" -- bash -c "cd '$tmp' && '$bin' quantize --in xin.npy --rotation hadamard --layer 2"
# --clip-k -0 is 0: the same file, so the same rotation id and namespace (newcomer report 13 F9).
"$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 400 --clip-k -0 --clip-v -0 --out "$tmp/rneg0.safetensors" >/dev/null 2>&1
"$bin" calibrate --model "$model" --text "$data/calibration.txt" --tokens 400 --clip-k 0 --clip-v 0 --out "$tmp/rzero.safetensors" >/dev/null 2>&1
[[ -s "$tmp/rzero.safetensors" ]] && cmp -s "$tmp/rneg0.safetensors" "$tmp/rzero.safetensors" \
  && echo "ok   calibrate-clip-minus-zero-is-zero" || { echo "FAIL calibrate --clip-k -0 wrote another file than --clip-k 0"; fail=1; }
exit $fail
