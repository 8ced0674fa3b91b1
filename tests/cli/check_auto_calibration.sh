#!/usr/bin/env bash
# nuq formats without --calib: the first job makes the model's calibration once (two ranks
# starting together: one makes it, the other waits on the lock and loads the same file), later
# jobs find it, --calib still overrides, and a damaged stored file is refused by name.
# Usage: check_auto_calibration.sh XCTX MODEL
set -euo pipefail
xctx=$1 model=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d /tmp/xctx-autocalib-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
export XCTX_CALIB_DIR=$work/calib
fail() { echo "FAIL: $*"; exit 1; }
run() { local out rc=0; out=$(timeout 600 "$@" 2>&1) || rc=$?; echo "$out" >"$work/last.log"; return $rc; }
expect() { grep -Eq -e "$1" "$work/last.log" || { tail -n 12 "$work/last.log"; fail "output does not match /$1/"; }; }
ask=(generate --model "$model" --cache nuq3-1% --prompt "The capital of France is" -n 3)

run "$root/launch/xctx-mpirun" -np 2 "$xctx" "${ask[@]}" || { tail -n 12 "$work/last.log"; fail "first run (np 2) failed"; }
expect "nuq3-1%: calibration $XCTX_CALIB_DIR/.*[.][0-9a-f]{16}[.]calib \\(made now"
expect "Paris"
[[ $(grep -c "calibrating .* on austen:sensesensibility" "$work/last.log") -eq 1 ]] || fail "the calibration was not made exactly once"
files=("$XCTX_CALIB_DIR"/*.calib)
[[ ${#files[@]} -eq 1 && -s ${files[0]} ]] || fail "expected one calibration file in $XCTX_CALIB_DIR, got: $(ls "$XCTX_CALIB_DIR")"
! compgen -G "$XCTX_CALIB_DIR/*.tmp.*" >/dev/null || fail "a temporary file was left behind"
echo "made once over 2 ranks: ${files[0]}"

run "$xctx" "${ask[@]}" || fail "second run failed"
expect "calibration ${files[0]} \\(found\\)"
expect "Paris"
grep -q "calibrating" "$work/last.log" && fail "the second run made the calibration again"
echo "found by the next job"

cp "${files[0]}" "$work/explicit.calib"
run "$xctx" "${ask[@]}" --calib "$work/explicit.calib" || fail "--calib run failed"
expect "calibration $work/explicit.calib \\(--calib\\)"
echo "--calib overrides"

head -c 1000 "$work/explicit.calib" >"${files[0]}"
if run "$xctx" "${ask[@]}"; then fail "a damaged stored calibration was accepted"; fi
expect "${files[0]}"
echo "damaged stored file refused: $(grep -m1 'error' "$work/last.log")"
echo PASS
