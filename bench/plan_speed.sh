#!/usr/bin/env bash
# Times `dsrun plan` (process start to exit, so an upper bound on the plan itself) for each
# shipped recipe, then for an adversarial set of layout searches (every parallel key "auto" on
# clusters up to 100,000 nodes × 4,096 GPUs, `--layouts` and `--json` included). Goals: a shipped
# recipe under 50 ms; the slowest search under 1 s (the script fails otherwise).
# Results go in docs/benchmarks.md.
# Usage: bench/plan_speed.sh [runs per recipe, default 50]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-50}
bin=./build/dsrun
[ -x "$bin" ] || { echo "build first: ./setup.sh" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)"

# time_ms CMD...: one run's wall time in ms
time_ms() {
  local start end
  start=$(date +%s%N)
  "$@" >/dev/null 2>&1 || true   # exit 2 (does not fit) or 3 (no such GPUs here) still times the plan
  end=$(date +%s%N)
  echo $(( (end - start) / 1000 ))
}

printf "%-58s %10s %10s\n" recipe "mean ms" "max ms"
for recipe in recipes/*.toml; do
  total=0; max=0
  for _ in $(seq "$runs"); do
    us=$(time_ms "$bin" plan "$recipe")
    total=$(( total + us )); [ "$us" -gt "$max" ] && max=$us
  done
  awk -v r="$recipe" -v t="$total" -v n="$runs" -v m="$max" 'BEGIN { printf "%-58s %10.2f %10.2f\n", r, t / n / 1000, m / 1000 }'
done

# The adversarial set: searches whose candidate count grows with the cluster.
auto='[parallel]
tensor = "auto"
pipeline = "auto"
pipeline_schedule = "auto"
virtual_stages = "auto"
sequence_parallel = "auto"
data_parallel = "auto"
zero_stage = "auto"
[precision]
dtype = "bf16"'
cluster() {  # name model nodes devices_per_node global [expert]
  {
    echo "base = [\"hardware/h100-80gb-x8\", \"models/$2\"]"
    printf '[hardware]\nnodes = %s\ndevices_per_node = %s\ninter_node_bandwidth_gbs = 50\n' "$3" "$4"
    echo "$auto"
    printf '[batch]\nglobal = %s\nseq_len = 4096\n' "$5"
  } > "$work/$1.toml"
  [ -n "${6:-}" ] && sed -i 's/^zero_stage = "auto"$/zero_stage = "auto"\nexpert = "auto"/' "$work/$1.toml"
  true
}
cluster moe16b_100000x4096 deepseek-moe-16b 100000 4096 409600000 expert
cluster moe16b_4096x8 deepseek-moe-16b 4096 8 32768 expert
cluster llm67b_1024x8 deepseek-llm-67b 1024 8 16384
cluster llm7b_65536x8 deepseek-llm-7b 65536 8 524288
slowest=0; slowest_name=""
for f in "$work"/*.toml; do
  for flags in "" "--layouts" "--layouts --json" "--json"; do
    max=0
    for _ in $(seq 5); do
      us=$(time_ms "$bin" plan "$f" $flags)
      [ "$us" -gt "$max" ] && max=$us
    done
    name="$(basename "$f" .toml) ${flags:-(plan)}"
    awk -v r="$name" -v m="$max" 'BEGIN { printf "%-58s %10s %10.2f\n", r, "", m / 1000 }'
    [ "$max" -gt "$slowest" ] && { slowest=$max; slowest_name=$name; }
  done
done
bytes=$( ("$bin" plan "$work/moe16b_100000x4096.toml" --layouts --json 2>/dev/null || true) | wc -c)
echo "largest output: moe16b_100000x4096 --layouts --json, $bytes bytes"
awk -v m="$slowest" -v n="$slowest_name" 'BEGIN { printf "slowest search: %s, %.2f ms (goal: under 1000 ms)\n", n, m / 1000 }'
[ "$slowest" -lt 1000000 ] || { echo "FAILED: a search took over 1 s" >&2; exit 1; }
