#!/usr/bin/env bash
# Usage: expect_failure.sh REGEX COMMAND [ARGS...]
# Passes when COMMAND exits non-zero and its output (stdout + stderr) matches REGEX.
set -u
regex=$1; shift
out=$("$@" 2>&1); rc=$?
echo "$out" | tail -n 8
echo "exit code $rc"
[[ $rc -ne 0 ]] || { echo "FAIL: expected a non-zero exit"; exit 1; }
echo "$out" | grep -Eq -e "$regex" || { echo "FAIL: output does not match /$regex/"; exit 1; }
echo PASS
