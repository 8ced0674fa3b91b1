#!/usr/bin/env bash
# Usage: expect_failure.sh REGEX COMMAND [ARGS...]
# Passes when COMMAND exits with a clear error -- a non-zero status that is not a signal's
# (128 + N: a crash after printing the right message is still a crash) -- and its output
# (stdout + stderr) matches REGEX.
set -u
regex=$1; shift
out=$("$@" 2>&1); rc=$?
echo "$out" | tail -n 8
echo "exit code $rc"
[[ $rc -ne 0 ]] || { echo "FAIL: expected a non-zero exit"; exit 1; }
[[ $rc -lt 128 ]] || { echo "FAIL: exit code $rc is a signal's ($((rc - 128))): a crash, not a clear error"; exit 1; }
echo "$out" | grep -Eq -e "$regex" || { echo "FAIL: output does not match /$regex/"; exit 1; }
echo PASS
