#!/usr/bin/env bash
# Peak resident memory of CPU ranks against the plan's host total, side by side in one run: a
# 27.5 M-parameter decoder (hidden 512, 8 heads, intermediate 1536) on the quickstart recipe's 2
# ranks, 3 steps, across ZeRO stages, micro batches and sequence lengths. Rank 0's numbers.
# usage: bash bench/cpu_memory.sh
set -euo pipefail
cd "$(dirname "$0")/.."
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(free -g | awk '/Mem/ {print $2}') GiB; $(date -u +%F)"
printf "%-34s %10s %10s %7s\n" "layers micro seq extra" "peak MiB" "plan MiB" "ratio"
probe() {
  local layers=$1 micro=$2 seq=$3; shift 3
  local d; d=$(mktemp -d)
  ./build/dsrun run recipes/quickstart.toml --db "$d/runs.db" --set run.steps=3 --set schedule.warmup_steps=1 --set eval.every=0 \
    --set logging.progress=false --set model.hidden=512 --set model.layers="$layers" --set model.heads=8 --set model.kv_heads=8 \
    --set model.intermediate=1536 --set batch.micro="$micro" --set batch.global=$((2 * micro)) --set batch.seq_len="$seq" "$@" > "$d/out" 2>&1
  local id; id=$(sqlite3 "$d/runs.db" "select id from runs limit 1")
  local show; show=$(./build/dsrun show "$id" --db "$d/runs.db")
  local peak plan
  peak=$(echo "$show" | awk '/rank0\/peak_rss_bytes/ {print $2}')
  plan=$(echo "$show" | awk '/rank0\/predicted_host_bytes/ {print $2}')
  awk -v what="$layers $micro $seq $*" -v peak="$peak" -v plan="$plan" 'BEGIN { printf "%-34s %10.0f %10.0f %7.3f\n", what, peak / 1048576, plan / 1048576, peak / plan }'
  rm -rf "$d"
}
probe 4 4 128
probe 8 8 128
probe 4 8 512
probe 8 8 128 --set parallel.zero_stage=1
probe 8 8 128 --set parallel.zero_stage=0
probe 8 8 128 --set parallel.offload='"optimizer"'
