#!/usr/bin/env bash
# Usage: check_fault.sh MPIRUN PROBE MODE NP
# Passes when every rank of `mpirun -np NP PROBE MODE` reached the first collective and the job
# then failed (non-zero) within the bound and, for a hang, the survivors' message names the
# stalled operation.
set -u
mpirun=$1 probe=$2 mode=$3 np=$4
bound=60
export XCTX_COMM_TIMEOUT=4 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$(date +%s)
out=$(timeout $((bound + 30)) "$mpirun" --oversubscribe -np "$np" "$probe" "$mode" 2>&1)
rc=$?
elapsed=$(( $(date +%s) - start ))
echo "$out" | tail -n 12
echo "exit code $rc after ${elapsed}s"
[[ $rc -ne 0 ]] || { echo "FAIL: the job succeeded although rank 1 $mode"; exit 1; }
# The job failed for the fault, not before it (a missing probe or a failed start fails too).
alive=$(echo "$out" | grep -c "alive after the first collective")
[[ $alive -eq $np ]] || { echo "FAIL: $alive of $np ranks reached the first collective"; exit 1; }
[[ $rc -ne 124 ]] || { echo "FAIL: the job hung (killed by timeout)"; exit 1; }
(( elapsed <= bound )) || { echo "FAIL: took ${elapsed}s > ${bound}s"; exit 1; }
if [[ $mode == hang ]]; then
  echo "$out" | grep -q "a rank has died or hangs" || { echo "FAIL: no clear error message"; exit 1; }
fi
if echo "$out" | grep -q "all_gather returned although"; then echo "FAIL: a survivor went on"; exit 1; fi
echo "PASS"
