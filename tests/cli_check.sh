# Shared helper of the CLI test scripts (tools/tests/kvpool_cli_test.sh,
# bench/tests/bench_cli_test.sh): source it, then call
#   check NAME EXPECTED_RC GREP_PATTERN -- command...
# which runs the command with stdout and stderr merged, compares the exit code and (when the
# pattern is non-empty) greps the output, prints "ok   NAME" or "FAIL NAME: ..." with the output,
# and sets fail=1 on a failure. The caller exits with $fail at the end.
fail=0
check() {
  local name="$1" want="$2" pat="$3"; shift 4
  local out rc
  out="$("$@" 2>&1)"; rc=$?
  if [[ $rc -ne $want ]]; then echo "FAIL $name: rc $rc != $want"; echo "$out"; fail=1; return; fi
  if [[ -n "$pat" ]] && ! grep -q -- "$pat" <<<"$out"; then
    echo "FAIL $name: output lacks '$pat'"; echo "$out"; fail=1; return
  fi
  echo "ok   $name"
}
