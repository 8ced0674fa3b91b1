#!/usr/bin/env bash
# Usage: expect_success.sh REGEX FORBIDDEN_REGEX COMMAND [ARGS...]
# Passes when COMMAND exits 0, its output (stdout + stderr, lines joined by spaces, so REGEX may
# span lines) matches REGEX and no line of it matches FORBIDDEN_REGEX (pass '' for none).
set -u
regex=$1; forbidden=$2; shift 2
out=$("$@" 2>&1); rc=$?
echo "$out" | tail -n 12
echo "exit code $rc"
[[ $rc -eq 0 ]] || { echo "FAIL: expected exit 0"; exit 1; }
echo "$out" | tr '\n' ' ' | grep -Eq -e "$regex" || { echo "FAIL: output does not match /$regex/"; exit 1; }
if [[ -n $forbidden ]] && echo "$out" | grep -Eq -e "$forbidden"; then
  echo "FAIL: output matches the forbidden /$forbidden/"; exit 1
fi
echo PASS
