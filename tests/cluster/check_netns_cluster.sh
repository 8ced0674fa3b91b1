#!/usr/bin/env bash
# launch/netns-cluster end to end: `up` twice and `down` twice leave the same state (nothing
# behind after down), MPI places ranks on distinct hosts, and a 4-rank run over 2 hosts (TCP
# between them) gives bitwise the logits of one process.
# Usage: check_netns_cluster.sh XCTX MODEL. Exit 77 (skipped) where namespaces cannot be made.
set -euo pipefail
xctx=$1 model=$2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cluster=$root/launch/netns-cluster
export XCTX_NETNS_DIR=$(mktemp -d /tmp/xctx-netns-test.XXXXXX)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

fail() { echo "FAIL: $*"; exit 1; }
leftovers() { { ip netns list | grep -o '^xctx-h[0-9]*' || true; ip -o link | grep -o 'xctx-[a-z0-9]*' || true; } | sort -u; }

if [[ $(id -u) -ne 0 ]] || ! ip netns add xctx-probe$$ 2>/dev/null; then
  echo "SKIP: network namespaces need root and CAP_NET_ADMIN here"; exit 77
fi
ip netns del xctx-probe$$
[[ -z $(leftovers) ]] || fail "xctx-* namespaces or links exist before the test: $(leftovers | tr '\n' ' ')"
trap '"$cluster" down >/dev/null 2>&1 || true; rm -rf "$XCTX_NETNS_DIR"' EXIT

"$cluster" up 2 --slots 2
"$cluster" up 2 --slots 2  # again: replaces the first, the same state
[[ $(ip netns list | grep -c '^xctx-h') -eq 2 ]] || fail "two ups should leave 2 namespaces: $(ip netns list)"
hostfile=$("$cluster" hostfile)

hosts=$("$root/launch/xctx-mpirun" -np 4 --hostfile "$hostfile" hostname | sort | uniq -c)
echo "$hosts"
[[ $(echo "$hosts" | wc -l) -eq 2 ]] || fail "4 ranks should run on 2 distinct hosts"

digest() { python3 -c 'import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["logits_fnv1a"])'; }
bench=(bench --model "$model" --text kjv:Jude --prompt-tokens 700 --gen-tokens 4 --cache kivi2 --prefill exact)
one=$("$xctx" "${bench[@]}" --threads 1 | digest)
four=$("$root/launch/xctx-mpirun" -np 4 --hostfile "$hostfile" "$xctx" "${bench[@]}" | digest)
echo "logits digest: 1 process $one, 4 ranks on 2 hosts $four"
[[ -n $one && $one == "$four" ]] || fail "logits differ between 1 process and 4 ranks on 2 hosts"

"$cluster" down
"$cluster" down
[[ -z $(leftovers) ]] || fail "down left behind: $(leftovers | tr '\n' ' ')"
[[ ! -e $XCTX_NETNS_DIR/state && ! -e $XCTX_NETNS_DIR/hostfile ]] || fail "down left its state files"
echo PASS
