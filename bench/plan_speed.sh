#!/usr/bin/env bash
# Times `dsrun plan` (process start to exit, so an upper bound on the plan itself) for each
# shipped recipe. The goal is under 50 ms; results go in docs/benchmarks.md.
# Usage: bench/plan_speed.sh [runs per recipe, default 50]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-50}
bin=./build/dsrun
[ -x "$bin" ] || { echo "build first: ./setup.sh" >&2; exit 1; }
printf "%-40s %10s %10s\n" recipe "mean ms" "max ms"
for recipe in recipes/*.toml; do
  total=0; max=0
  for _ in $(seq "$runs"); do
    start=$(date +%s%N)
    "$bin" plan "$recipe" >/dev/null 2>&1 || true   # exit 2 (does not fit) still times the plan
    end=$(date +%s%N)
    ms=$(( (end - start) / 1000 ))
    total=$(( total + ms )); [ "$ms" -gt "$max" ] && max=$ms
  done
  awk -v r="$recipe" -v t="$total" -v n="$runs" -v m="$max" 'BEGIN { printf "%-40s %10.2f %10.2f\n", r, t / n / 1000, m / 1000 }'
done
