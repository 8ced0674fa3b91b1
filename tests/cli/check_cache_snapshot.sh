#!/usr/bin/env bash
# `xctx generate --save-cache` then `--load-cache` end to end over 2 ranks: the resumed run
# recalls a fact from the saved document and prints what one uninterrupted run of document +
# question prints; a wrong rank count, another cache format and a damaged file are refused
# with errors that name the problem (and no rank is left hanging).
# Usage: check_cache_snapshot.sh XCTX MODEL
set -euo pipefail
xctx=$1 model=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
mpirun_=$root/launch/xctx-mpirun
work=$(mktemp -d /tmp/xctx-snapshot-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
expect_error() {  # REGEX COMMAND...: non-zero exit and REGEX in the output
  local regex=$1 out rc=0; shift
  out=$(timeout 120 "$@" 2>&1) || rc=$?
  [[ $rc -ne 0 ]] || fail "expected an error from: $*"
  [[ $rc -ne 124 ]] || fail "timed out (a rank left hanging?): $*"
  grep -Eq -e "$regex" <<<"$out" || { echo "$out" | tail -n 8; fail "output does not match /$regex/"; }
  echo "refused as expected: $(grep -Eo -e "$regex" <<<"$out" | head -n 1)"
}

# The document ends in a newline, so document + question tokenize as the two parts do.
{
  echo "Remember this: the passkey is 73915."
  for i in $(seq 1 30); do echo "The grass is green. The sky is blue. Here we go, there and back again."; done
} >"$work/doc.txt"
question="Again, the passkey is"
{ cat "$work/doc.txt"; printf '%s' "$question"; } >"$work/whole.txt"

"$mpirun_" -np 2 "$xctx" generate --model "$model" --prompt-file "$work/doc.txt" --save-cache "$work/snap" -n 0 \
  2>"$work/save.log" >/dev/null || { cat "$work/save.log"; fail "save failed"; }
grep -E "saved [0-9]+ tokens of cache .* over 2 rank\(s\)\) to $work/snap" "$work/save.log" || fail "no save line"
for f in manifest.json rank-0-of-2.xsnap rank-1-of-2.xsnap; do [[ -s $work/snap/$f ]] || fail "$f missing"; done
[[ -z $(find "$work/snap" -name '*.tmp') ]] || fail "temporary files left behind"

resumed=$("$mpirun_" -np 2 "$xctx" generate --model "$model" --prompt "$question" --load-cache "$work/snap" -n 8 \
  2>"$work/load.log") || { cat "$work/load.log"; fail "load failed"; }
grep -E "resumed [0-9]+ saved tokens from $work/snap" "$work/load.log" || fail "no resume line"
whole=$("$mpirun_" -np 2 "$xctx" generate --model "$model" --prompt-file "$work/whole.txt" -n 8 2>/dev/null)
echo "resumed: [$resumed]  uninterrupted: [$whole]"
[[ $resumed == *73915* ]] || fail "the resumed run does not recall the passkey"
[[ $resumed == "$whole" ]] || fail "the resumed run differs from the uninterrupted one"

expect_error "was saved over 2 rank\(s\); this run has 1 \(run it with mpirun -np 2\)" \
  "$mpirun_" -np 1 "$xctx" generate --model "$model" --prompt "$question" --load-cache "$work/snap" -n 4
expect_error "saved with cache format \"fp16\"; this run uses \"kivi2\"" \
  "$mpirun_" -np 2 "$xctx" generate --model "$model" --prompt "$question" --load-cache "$work/snap" --cache kivi2 -n 4
expect_error "--(save|load)-cache excludes --(load|save)-cache" \
  "$xctx" generate --model "$model" --prompt "$question" --load-cache "$work/snap" --save-cache "$work/other"
# One byte of rank 1's first layer flipped: refused before the cache reads it.
python3 - "$work/snap/rank-1-of-2.xsnap" <<'PY'
import struct, sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
header = struct.unpack_from("<Q", b, 16)[0]
at = (24 + header + 7) // 8 * 8 + 16  # rank 1 stores no token ids: inside layer 0's block
b[at] ^= 0x01
open(p, "wb").write(b)
PY
expect_error "rank-1-of-2.xsnap: checksum mismatch in layer 0" \
  "$mpirun_" -np 2 "$xctx" generate --model "$model" --prompt "$question" --load-cache "$work/snap" -n 4
echo PASS
