#!/usr/bin/env bash
# Every integer option of every binary and subcommand states its bounds (newcomer 16 F2: options
# without a kvpool::cli::Range read "0100" as octal 64 before cli::Parse checked every integer
# option as plain decimal; Parse cannot know the bounds, so each option needs its Range). In
# --help an integer option shows its type (INT, UINT) followed by its check's description
# ("--page-size INT:in 1..1024=16"); a bare "INT" or "UINT" has none. Walks the subcommands that
# --help lists, recursively.
# Usage: cli_integer_ranges_test.sh BINARY...
set -u
fail=0
walk() {  # walk BINARY [SUBCOMMAND...]
  local help
  help="$("$@" --help 2>&1)" || { echo "FAIL $*: --help exited $?"; fail=1; return; }
  local bare
  bare="$(grep -E '^ +(-[A-Za-z], )?--[a-z0-9-]+ U?INT( |=|$)' <<<"$help")"
  if [[ -n "$bare" ]]; then
    echo "FAIL $*: integer options without a range (give each a kvpool::cli::Range):"; echo "$bare"
    fail=1
  else
    echo "ok   $* ($(grep -cE '^ +(-[A-Za-z], )?--[a-z0-9-]+ U?INT:' <<<"$help") integer options, each with its range)"
  fi
  local sub
  for sub in $(sed -n '/^Subcommands:$/,/^$/p' <<<"$help" | grep -E '^  [a-z]' | awk '{print $1}'); do
    walk "$@" "$sub"
  done
}
for bin in "$@"; do walk "$bin"; done
exit $fail
