#!/usr/bin/env bash
# Usage: expect_cuda_backend.sh XCTX NO_GPU_REGEX GPU_OUTCOME GPU_REGEX COMMAND [ARGS...]
# A CLI test of --backend cuda that holds on every machine: where `XCTX doctor` lists no GPU (or
# CUDA is not compiled in), COMMAND must fail clearly matching NO_GPU_REGEX (expect_failure.sh);
# where it lists one, COMMAND must end as GPU_OUTCOME says -- "fail" (a clear error matching
# GPU_REGEX) or "pass" (exit 0, output matching GPU_REGEX). Asserting "CUDA is unusable" alone
# failed on every CUDA build with a GPU (issue 54).
set -u
xctx=$1 no_gpu_regex=$2 gpu_outcome=$3 gpu_regex=$4
shift 4
here=$(cd "$(dirname "$0")" && pwd)
if ! "$xctx" doctor 2>/dev/null | grep -q '^gpu '; then
  exec "$here/expect_failure.sh" "$no_gpu_regex" "$@"
fi
echo "a GPU is listed by xctx doctor: expecting $gpu_outcome /$gpu_regex/"
case "$gpu_outcome" in
  fail) exec "$here/expect_failure.sh" "$gpu_regex" "$@" ;;
  pass)
    out=$("$@" 2>&1); rc=$?
    echo "$out" | tail -n 8
    [[ $rc -eq 0 ]] || { echo "FAIL: exit code $rc"; exit 1; }
    echo "$out" | grep -Eq -e "$gpu_regex" || { echo "FAIL: output does not match /$gpu_regex/"; exit 1; }
    echo PASS ;;
  *) echo "expect_cuda_backend.sh: GPU_OUTCOME must be fail or pass, got '$gpu_outcome'" >&2; exit 2 ;;
esac
